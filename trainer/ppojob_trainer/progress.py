"""Training progress: a reporter interface and the local implementation.

The loop calls `start(total_steps, start_step)` once (start_step = steps already completed, from
a checkpoint), `report(step, metrics)` after every completed step (steps count from 1), and
`finish(summary)` at the end. `LocalProgressReporter` shows a progress bar, appends one JSON
object per step to `out_dir/metrics.jsonl` and draws `out_dir/reward_curve.png` at the end; it
also keeps the run's history of attempts in `out_dir/attempts.jsonl` (:data:`ATTEMPTS_FILE`). The
Kubernetes reporter (patching the PPOJob's `status.progress`) lives in `k8s_progress`.
"""

from __future__ import annotations

import json
import logging
import math
import os
import sys
import time
from collections.abc import Iterable
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

log = logging.getLogger(__name__)

METRICS_FILE = "metrics.jsonl"
CURVE_FILE = "reward_curve.png"
SUMMARY_FILE = "summary.json"
ATTEMPTS_FILE = "attempts.jsonl"
"""One line per event of each attempt of a run, appended and never rewritten (metrics.jsonl keeps
only the steps a resume kept): ``{"event": "start", "step": S, "totalSteps": T}`` where an
attempt began (S: the steps its checkpoint held), ``{"event": "failed", "step": S, "error":
"..."}`` where one ended on an error or a stop (``Preempted: ...``: the trainer's account of the
checkpoint it wrote), ``{"event": "finished", "step": S}``; each with its UTC ``time``. A killed
attempt leaves only its start."""
REQUIRED_KEYS = ("step", "elapsed_seconds", "reward_mean", "kl", "value_loss", "tokens_per_second")

# The loop's namespaced names of the headline values. Reporters rename them to the plain key, so
# metrics.jsonl and the PPOJob status carry each value under one name (docs/trainer-guide.md).
ALIASES = {
    "elapsed_seconds": ("time/elapsed",),
    "reward_mean": ("reward/mean",),
    "kl": ("kl/mean",),
    "value_loss": ("critic/vf_loss", "critic/value_loss"),
    "tokens_per_second": ("throughput/tokens_per_second", "time/tokens_per_second"),
}


def canonical_metrics(metrics: dict[str, Any]) -> dict[str, Any]:
    """`metrics` with each headline value under its plain name only (`reward/mean` becomes
    `reward_mean`, and so on); every other metric as sent."""
    out = dict(metrics)
    for key, aliases in ALIASES.items():
        for alias in aliases:
            if alias in out:
                value = out.pop(alias)
                if out.get(key) is None:
                    out[key] = value
    return out


class ProgressReporter:
    """Receives progress from the training loop. The base class does nothing."""

    def start(self, total_steps: int, start_step: int = 0) -> None:
        """Training of `total_steps` begins, `start_step` of them already done (resume)."""

    def report(self, step: int, metrics: dict[str, float]) -> None:
        """Step `step` (1-based) completed with these metrics."""

    def checkpointed(self, checkpoints: list[tuple[int, str]]) -> None:
        """A checkpoint was written; `checkpoints` are the complete ones kept, (step, path),
        oldest first."""

    def finish(self, summary: dict[str, Any]) -> None:
        """Training ended (successfully or not); `summary` holds final figures."""

    def fail(self, message: str) -> None:
        """The run failed or was interrupted; `message` is one line naming the cause."""

    def warn(self, message: str) -> None:
        """A problem that does not stop the run: ``<Reason>: <one line naming the field and the
        fix>`` (e.g. a grace period too short for a step and a checkpoint)."""


class CompositeReporter(ProgressReporter):
    """Forwards every call to each of its reporters, in order."""

    def __init__(self, reporters: Iterable[ProgressReporter]) -> None:
        self.reporters = list(reporters)

    def start(self, total_steps: int, start_step: int = 0) -> None:
        for r in self.reporters:
            r.start(total_steps, start_step)

    def report(self, step: int, metrics: dict[str, float]) -> None:
        for r in self.reporters:
            r.report(step, metrics)

    def checkpointed(self, checkpoints: list[tuple[int, str]]) -> None:
        for r in self.reporters:
            r.checkpointed(checkpoints)

    def finish(self, summary: dict[str, Any]) -> None:
        for r in self.reporters:
            r.finish(summary)

    def fail(self, message: str) -> None:
        for r in self.reporters:
            r.fail(message)

    def warn(self, message: str) -> None:
        for r in self.reporters:
            r.warn(message)


def _json_value(value: Any) -> Any:
    """Plain JSON for a metric: tensors/numpy scalars to float, NaN/inf to None."""
    if hasattr(value, "item") and callable(value.item):
        value = value.item()
    if isinstance(value, bool | int | str) or value is None:
        return value
    if isinstance(value, float):
        return value if math.isfinite(value) else None
    try:
        f = float(value)
    except (TypeError, ValueError):
        return str(value)
    return f if math.isfinite(f) else None


def _read_records(path: Path, key: str, kind: type) -> list[dict[str, Any]]:
    """The JSON objects of the lines of ``path`` whose ``key`` is a ``kind`` ([] when the file
    is absent; a line cut short by a crash is skipped)."""
    try:
        lines = path.read_text().splitlines()
    except FileNotFoundError:
        return []
    records = []
    for line in lines:
        try:
            rec = json.loads(line)
        except ValueError:
            continue
        if isinstance(rec, dict) and isinstance(rec.get(key), kind):
            records.append(rec)
    return records


def read_metrics(out_dir: Path) -> list[dict[str, Any]]:
    """The per-step records of `out_dir/metrics.jsonl` (unreadable lines skipped)."""
    return _read_records(Path(out_dir) / METRICS_FILE, "step", int)


class LocalProgressReporter(ProgressReporter):
    """Progress bar, `metrics.jsonl` (one line per step) and `reward_curve.png`.

    Every line has the REQUIRED_KEYS (null when a metric does not apply, e.g. `value_loss`
    without a critic) and the loop's other metrics as sent. `elapsed_seconds` is the training
    wall time across resumes: the value the loop sends (or the reporter's own clock since
    `start`), plus the `elapsed_seconds` of the last step kept from before the resume.

    Resume: the first `report(step)` of a run drops the lines of `step` and later ones (they were
    computed after the checkpoint the run resumed from and are computed again) and keeps the
    earlier ones, so no step appears twice and no completed step is lost, whether or not the
    loop passes `start_step`.
    """

    def __init__(self, out_dir: Path, show_bar: bool = True, plain: bool | None = None) -> None:
        """``plain``: progress as one plain line every few steps (about 20 in a run, and the
        last) instead of a redrawn bar; None: plain exactly when stderr is not a terminal, so a
        log file (``make demo``'s run.log, a pod's log) gets lines, not carriage-return frames."""
        self.out_dir = Path(out_dir)
        self.show_bar = show_bar
        self.plain = plain
        self.metrics_path = self.out_dir / METRICS_FILE
        self._bar: Any = None
        self._lines_every = 0  # > 0: plain lines every that many steps
        self._total = 0
        self._last_step: int | None = None  # None until the first report of this run
        self._start_step = 0
        self._t0 = time.monotonic()
        self._elapsed_before = 0.0

    def start(self, total_steps: int, start_step: int = 0) -> None:
        if total_steps < 0 or start_step < 0:
            raise ValueError(
                f"total_steps and start_step must be >= 0, got {total_steps}, {start_step}"
            )
        self.out_dir.mkdir(parents=True, exist_ok=True)
        self._start_step = start_step
        self._last_step = None
        self._attempt("start", start_step, totalSteps=total_steps)
        self._t0 = time.monotonic()
        self._total = total_steps
        plain = self.plain if self.plain is not None else not _is_terminal(sys.stderr)
        if self.show_bar and plain:
            self._lines_every = max(1, -(-max(total_steps - start_step, 1) // 20))
        elif self.show_bar:
            from tqdm.auto import tqdm

            self._bar = tqdm(
                total=total_steps,
                initial=start_step,
                desc="ppo",
                unit="step",
                file=sys.stderr,
                dynamic_ncols=True,
            )

    def _begin(self, first_step: int) -> None:
        """Keep the lines of steps before `first_step` (deduplicated, in order); drop the rest.

        A fresh start (step 1) over the metrics of an earlier run keeps that file, renamed, and
        says so: nothing a user recorded disappears silently."""
        self.out_dir.mkdir(parents=True, exist_ok=True)
        old = read_metrics(self.out_dir)
        if first_step <= 1 and old:
            kept_as = _free_name(self.metrics_path)
            os.replace(self.metrics_path, kept_as)
            log.warning(
                "starting fresh in %s: the earlier run's %s (%d steps) is kept as %s",
                self.out_dir,
                METRICS_FILE,
                len(old),
                kept_as.name,
            )
            old = []
        by_step = {r["step"]: r for r in old if r["step"] < first_step}
        kept = [by_step[s] for s in sorted(by_step)]
        tmp = self.metrics_path.with_name(METRICS_FILE + ".tmp")
        with open(tmp, "w") as f:
            for rec in kept:
                f.write(json.dumps(rec) + "\n")
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, self.metrics_path)
        last = kept[-1].get("elapsed_seconds") if kept else None
        self._elapsed_before = float(last) if isinstance(last, int | float) else 0.0
        self._last_step = first_step - 1
        if self._bar is not None and first_step - 1 != self._start_step:
            self._bar.n = first_step - 1  # the loop resumed elsewhere than start_step said

    def report(self, step: int, metrics: dict[str, float]) -> None:
        if self._last_step is None:
            self._begin(step)
        last_step = self._last_step if self._last_step is not None else step - 1
        if step <= last_step:
            log.warning(
                "step %d already recorded in %s; not writing it again", step, self.metrics_path
            )
            return
        record: dict[str, Any] = {"step": int(step)}
        plain = canonical_metrics(metrics)
        record.update({k: _json_value(v) for k, v in plain.items() if k != "step"})
        elapsed = record.get("elapsed_seconds")
        if not isinstance(elapsed, int | float):
            elapsed = time.monotonic() - self._t0
        record["elapsed_seconds"] = self._elapsed_before + elapsed
        for key in REQUIRED_KEYS:
            record.setdefault(key, None)  # e.g. value_loss without a critic, kl with KL off
        with open(self.metrics_path, "a") as f:
            f.write(json.dumps(record) + "\n")
            f.flush()
        advanced = step - last_step
        self._last_step = step
        if self._bar is not None:
            self._bar.set_postfix_str(_postfix(record), refresh=False)
            self._bar.update(advanced)
        elif self._lines_every and (
            step // self._lines_every != last_step // self._lines_every or step >= self._total
        ):
            done = f"{step}/{self._total}" if self._total else str(step)
            line = f"ppo {done} steps, {record['elapsed_seconds']:.1f} s {_postfix(record)}"
            print(line.rstrip(), file=sys.stderr, flush=True)

    def close(self) -> None:
        """End the progress bar's line (so what is printed next starts on its own line)."""
        if self._bar is not None:
            self._bar.close()
            self._bar = None

    def _attempt(self, event: str, step: int, **more: Any) -> None:
        """Append one event of this attempt to :data:`ATTEMPTS_FILE`."""
        when = datetime.now(UTC).strftime("%Y-%m-%dT%H:%M:%SZ")
        record = {"event": event, "step": int(step), **more, "time": when}
        self.out_dir.mkdir(parents=True, exist_ok=True)
        with open(self.out_dir / ATTEMPTS_FILE, "a") as f:
            f.write(json.dumps(record) + "\n")
            f.flush()
            os.fsync(f.fileno())

    def _completed(self) -> int:
        return self._last_step if self._last_step is not None else self._start_step

    def fail(self, message: str) -> None:
        self.close()
        self._attempt("failed", self._completed(), error=message)

    def finish(self, summary: dict[str, Any]) -> None:
        self.close()
        self._attempt("finished", self._completed())
        plain = {k: _json_value(v) for k, v in summary.items()}
        # A run that had nothing left to do (resumed at its last step) knows no final figures:
        # keep the ones the earlier run wrote instead of overwriting them with nulls.
        for key, value in read_summary(self.out_dir).items():
            if plain.get(key) is None and value is not None:
                plain[key] = value
        (self.out_dir / SUMMARY_FILE).write_text(json.dumps(plain, indent=1, sort_keys=True))
        try:
            plot_reward_curve(self.out_dir)
        except Exception as exc:  # a plot must never fail the run
            log.warning("could not draw %s: %s", CURVE_FILE, exc)


def read_attempts(out_dir: Path) -> list[dict[str, Any]]:
    """The events of `out_dir/attempts.jsonl`, in order (unreadable lines skipped)."""
    return _read_records(Path(out_dir) / ATTEMPTS_FILE, "event", str)


def read_summary(out_dir: Path) -> dict[str, Any]:
    """`out_dir/summary.json` as a dict ({} when absent or unreadable)."""
    try:
        doc = json.loads((Path(out_dir) / SUMMARY_FILE).read_text())
    except (OSError, ValueError):
        return {}
    return doc if isinstance(doc, dict) else {}


def _free_name(path: Path) -> Path:
    """`metrics.jsonl` -> the first free `metrics.jsonl.1`, `.2`, ..."""
    i = 1
    while path.with_name(f"{path.name}.{i}").exists():
        i += 1
    return path.with_name(f"{path.name}.{i}")


def _is_terminal(stream: Any) -> bool:
    try:
        return bool(stream.isatty())
    except (AttributeError, ValueError):  # a closed or unusual stream
        return False


def _postfix(rec: dict[str, Any]) -> str:
    parts = []
    for key, label, fmt in (
        ("reward_mean", "reward", ".3f"),
        ("eval/reward_mean", "eval", ".3f"),
        ("kl", "kl", ".4f"),
        ("value_loss", "vloss", ".4f"),
        ("tokens_per_second", "tok/s", ".0f"),
    ):
        value = rec.get(key)
        if isinstance(value, int | float):
            parts.append(f"{label}={value:{fmt}}")
    return " ".join(parts)


def plot_reward_curve(out_dir: Path) -> Path | None:
    """Draw mean reward (and KL, when recorded) per step from metrics.jsonl; None if no data."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    records = [r for r in read_metrics(out_dir) if isinstance(r.get("reward_mean"), int | float)]
    if not records:
        return None
    steps = [r["step"] for r in records]
    kls = [(r["step"], r["kl"]) for r in records if isinstance(r.get("kl"), int | float)]
    # short axis labels (a long one is taller than a panel and runs into the other's), the
    # units in each panel's title
    fig = Figure(figsize=(7, 6 if kls else 3.5), dpi=100, layout="constrained")
    FigureCanvasAgg(fig)
    ax = fig.add_subplot(2 if kls else 1, 1, 1)
    ax.plot(steps, [r["reward_mean"] for r in records], marker="." if len(steps) < 50 else None)
    ax.set_ylabel("mean reward")
    ax.grid(alpha=0.3)
    ax.set_title(f"mean reward per step ({len(steps)} steps; the reward function's units)")
    if kls:
        ax2 = fig.add_subplot(2, 1, 2, sharex=ax)
        ax2.plot([s for s, _ in kls], [k for _, k in kls], color="tab:orange")
        ax2.set_ylabel("KL")
        ax2.set_title("KL to the reference policy (nats per sequence)")
        ax2.grid(alpha=0.3)
        ax2.set_xlabel("training step (one rollout batch each)")
    else:
        ax.set_xlabel("training step (one rollout batch each)")
    path = Path(out_dir) / CURVE_FILE
    fig.savefig(path)
    return path
