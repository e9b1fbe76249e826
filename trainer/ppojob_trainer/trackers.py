"""Experiment trackers as progress reporters (spec.trackers): TensorBoard, MLflow, W&B.

Each tracker logs every step's metrics under the names of ``metrics.jsonl``
(:func:`~ppojob_trainer.progress.canonical_metrics`), the resolved config at the start (MLflow:
run parameters; W&B: the run's config; TensorBoard: text) and, at the end, the summary and (MLflow,
W&B) the run's output files (``reward_curve.png``, ``metrics.jsonl``, ``summary.json``) as
artifacts. Credentials come from the environment (in the cluster: the Secret of the tracker's
``secretRef``, which the operator puts into the head pod, where this driver runs).

A tracker that cannot be set up or written (its library missing, its server unreachable, its
directory unwritable, no credentials) logs one warning and is switched off: it never fails the
run.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import math
import os
import re
import time
from pathlib import Path
from typing import Any

from ppojob_trainer.progress import (
    ALIASES,
    CURVE_FILE,
    METRICS_FILE,
    SUMMARY_FILE,
    ProgressReporter,
    canonical_metrics,
)

log = logging.getLogger(__name__)

OUTPUT_FILES = (CURVE_FILE, METRICS_FILE, SUMMARY_FILE)
"""The run's output files a tracker uploads as artifacts at the end (those that exist)."""

STATE_DIR = ".trackers"
"""Under the output directory: each MLflow / W&B tracker's run id, so that a run resumed from a
checkpoint goes on logging into the same tracker run."""


def _scalars(metrics: dict[str, Any]) -> dict[str, float]:
    out = {}
    for key, value in canonical_metrics(metrics).items():
        if hasattr(value, "item") and callable(value.item):
            value = value.item()
        if isinstance(value, bool) or not isinstance(value, int | float):
            continue
        if math.isfinite(value):
            out[key] = float(value)
    return out


class TrackerReporter(ProgressReporter):
    """A tracker: its calls guarded so that the first failure logs one warning and switches it
    off. Subclasses implement ``_open``, ``_log``, ``_close`` and ``_abort``."""

    kind = "tracker"

    def __init__(self, where: str) -> None:
        self.where = where
        self.disabled: str | None = None
        self.active = False

    def _off(self, what: str, exc: BaseException) -> None:
        self.disabled = f"{type(exc).__name__}: {exc}"
        if isinstance(exc, ImportError):
            self.disabled += "; install it with pip install 'ppojob[trackers]'"
        log.warning(
            "tracker %s (%s): %s failed (%s); training goes on without it",
            self.kind,
            self.where,
            what,
            self.disabled,
        )
        if self.active:
            self.active = False
            with contextlib.suppress(Exception):  # already broken
                self._abort()

    def _open(self, total_steps: int, start_step: int) -> None:
        raise NotImplementedError

    def _log(self, step: int, scalars: dict[str, float]) -> None:
        raise NotImplementedError

    def _close(self, summary: dict[str, float] | None, error: str | None) -> None:
        """End the run: ``summary`` after a completed run, ``error`` after a failed one."""
        raise NotImplementedError

    def _abort(self) -> None:
        """Release what ``_open`` took, after a failure (errors are ignored)."""

    def start(self, total_steps: int, start_step: int = 0) -> None:
        if self.disabled is not None:
            return
        try:
            self._open(total_steps, start_step)
            self.active = True
        except Exception as exc:  # ImportError, an unreachable server, an unwritable directory
            self.active = True  # so that _off releases what was opened
            self._off("start", exc)

    def report(self, step: int, metrics: dict[str, float]) -> None:
        if not self.active:
            return
        try:
            self._log(step, _scalars(metrics))
        except Exception as exc:
            self._off(f"step {step}", exc)

    def finish(self, summary: dict[str, Any]) -> None:
        if not self.active:
            return
        try:
            self._close(_scalars(summary), None)
            self.active = False
        except Exception as exc:
            self._off("finish", exc)

    def fail(self, message: str) -> None:
        if not self.active:
            return
        try:
            self._close(None, message)
            self.active = False
        except Exception as exc:
            self._off("fail", exc)


class TensorBoardReporter(TrackerReporter):
    """Scalars per step and the config as text, in TensorBoard event files under ``log_dir``."""

    kind = "tensorboard"

    def __init__(self, log_dir: Path, config: dict[str, Any] | None = None) -> None:
        super().__init__(str(log_dir))
        self.log_dir = Path(log_dir)
        self.config = config
        self._writer: Any = None

    def _open(self, total_steps: int, start_step: int) -> None:
        from torch.utils.tensorboard import SummaryWriter

        self._writer = SummaryWriter(str(self.log_dir))
        if self.config is not None:
            import yaml

            text = yaml.safe_dump(self.config, sort_keys=False)
            self._writer.add_text("config", f"```yaml\n{text}```", start_step)

    def _log(self, step: int, scalars: dict[str, float]) -> None:
        for key, value in scalars.items():
            self._writer.add_scalar(key, value, step)

    def _close(self, summary: dict[str, float] | None, error: str | None) -> None:
        if error is not None:
            self._writer.add_text("error", error)
        for key, value in (summary or {}).items():
            self._writer.add_scalar(f"summary/{key}", value, 0)
        writer, self._writer = self._writer, None
        writer.close()

    def _abort(self) -> None:
        writer, self._writer = self._writer, None
        if writer is not None:
            writer.close()


# ---------------------------------------------------------------------------------------------
# MLflow
# ---------------------------------------------------------------------------------------------
MLFLOW_PARAM_VALUE_LIMIT = 500
"""Longest parameter value sent: MLflow servers before 2.x (and some hosted ones) refuse more
than 500 characters (newer ones take 6000). Longer values are cut, ending in `...`; the whole
config is also uploaded as the artifact ``ppojob/config.yaml``."""
MLFLOW_KEY_LIMIT = 250
MLFLOW_BATCH = 100  # parameters per log_batch (MLflow's MAX_PARAMS_TAGS_PER_BATCH)
MLFLOW_HTTP_DEFAULTS = {
    "MLFLOW_HTTP_REQUEST_MAX_RETRIES": "3",
    "MLFLOW_HTTP_REQUEST_BACKOFF_FACTOR": "1",
    "MLFLOW_HTTP_REQUEST_TIMEOUT": "30",
}
"""Set unless the environment sets them: a tracking server that cannot be reached costs about
10 seconds, not MLflow's default of minutes of retries, before the tracker is switched off."""
_MLFLOW_KEY = re.compile(r"[^/\w.\- :]")


def mlflow_key(key: str) -> str:
    """``key`` as MLflow accepts a metric or parameter name: characters other than letters,
    digits, ``_ - . / : space`` become ``_``, and at most 250 characters. The metrics.jsonl names
    (``reward_mean``, ``time/step``, ...) pass unchanged."""
    return _MLFLOW_KEY.sub("_", key)[:MLFLOW_KEY_LIMIT].strip("/") or "_"


def flat_params(config: dict[str, Any], prefix: str = "") -> dict[str, str]:
    """The config as MLflow parameters: nested keys joined with ``.``, lists and other values as
    JSON, each value at most MLFLOW_PARAM_VALUE_LIMIT characters."""
    out: dict[str, str] = {}
    for key, value in config.items():
        name = f"{prefix}{key}"
        if isinstance(value, dict) and value:
            out.update(flat_params(value, f"{name}."))
            continue
        text = value if isinstance(value, str) else json.dumps(value)
        if len(text) > MLFLOW_PARAM_VALUE_LIMIT:
            text = text[: MLFLOW_PARAM_VALUE_LIMIT - 3] + "..."
        out[mlflow_key(name)] = text
    return out


def _state_file(out_dir: Path | None, kind: str, *parts: str | None) -> Path | None:
    if out_dir is None:
        return None
    digest = hashlib.sha256("\0".join(p or "" for p in parts).encode()).hexdigest()[:16]
    return Path(out_dir) / STATE_DIR / f"{kind}-{digest}"


def _read_state(path: Path | None, start_step: int) -> str | None:
    """The run id a resumed run (``start_step`` > 0) goes on with, if one was recorded."""
    if path is None or start_step <= 0:
        return None
    with contextlib.suppress(OSError):
        return path.read_text().strip() or None
    return None


def _write_state(path: Path | None, run_id: str) -> None:
    if path is not None:
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(run_id)


class MlflowReporter(TrackerReporter):
    """An MLflow run through MLflow's own client: params (the flattened config), metrics per
    step, the summary, and the output files as artifacts; FINISHED or FAILED at the end."""

    kind = "mlflow"

    def __init__(
        self,
        tracking_uri: str,
        experiment_name: str,
        run_name: str,
        config: dict[str, Any] | None = None,
        out_dir: Path | None = None,
    ) -> None:
        super().__init__(tracking_uri)
        self.tracking_uri = tracking_uri
        self.experiment_name = experiment_name
        self.run_name = run_name
        self.config = config
        self.out_dir = Path(out_dir) if out_dir is not None else None
        self.run_id: str | None = None
        self._client: Any = None
        self._last_step = 0
        self._grouped: set[str] = set()
        self._state = _state_file(out_dir, "mlflow", tracking_uri, experiment_name, run_name)

    def _open(self, total_steps: int, start_step: int) -> None:
        for key, value in MLFLOW_HTTP_DEFAULTS.items():
            os.environ.setdefault(key, value)
        if self.tracking_uri.startswith("file:"):  # chosen in the spec: MLflow 3 asks for this
            os.environ.setdefault("MLFLOW_ALLOW_FILE_STORE", "true")
        from mlflow import MlflowClient

        client = MlflowClient(tracking_uri=self.tracking_uri)
        self._client = client
        self._last_step = start_step
        previous = _read_state(self._state, start_step)
        if previous is not None:
            with contextlib.suppress(Exception):  # gone from the server: start a new run
                client.update_run(previous, status="RUNNING")
                self.run_id = previous
        if self.run_id is None:
            exp = client.get_experiment_by_name(self.experiment_name)
            exp_id = exp.experiment_id if exp else client.create_experiment(self.experiment_name)
            run = client.create_run(
                exp_id, run_name=self.run_name, tags={"ppojob.io/job": self.run_name}
            )
            self.run_id = run.info.run_id
            _write_state(self._state, self.run_id)
            if self.config is not None:
                self._log_config(client)

    def _log_config(self, client: Any) -> None:
        from mlflow.entities import Param

        params = [Param(k, v) for k, v in flat_params(self.config or {}).items()]
        for i in range(0, len(params), MLFLOW_BATCH):
            client.log_batch(self.run_id, params=params[i : i + MLFLOW_BATCH])
        import yaml

        text = yaml.safe_dump(self.config, sort_keys=False)
        client.log_text(self.run_id, text, "ppojob/config.yaml")

    def _names(self, keys: list[str]) -> dict[str, str]:
        """The MLflow name of each metric: its metrics.jsonl name, except a name that is also
        the group of others (`kl` beside `kl/coef`), which MLflow's file-based stores cannot
        hold both of (`metrics/kl` would be a file and a directory): it keeps the loop's own
        name (`kl/mean`), or gets `/value`, from the first step it is a group on."""
        names = {k: mlflow_key(k) for k in keys}
        groups = {n.rsplit("/", i)[0] for n in names.values() for i in range(1, n.count("/") + 1)}
        for key, name in names.items():
            if name in groups:
                self._grouped.add(name)
            if name in self._grouped:
                own = [a for a in ALIASES.get(key, ()) if a.startswith(f"{name}/")]
                names[key] = mlflow_key(own[0]) if own else f"{name}/value"
        return names

    def _log(self, step: int, scalars: dict[str, float], prefix: str = "") -> None:
        from mlflow.entities import Metric

        now = int(time.time() * 1000)
        names = self._names([prefix + k for k in scalars])
        metrics = [Metric(names[prefix + k], v, now, step) for k, v in scalars.items()]
        if metrics:
            self._client.log_batch(self.run_id, metrics=metrics)
        self._last_step = max(self._last_step, step)

    def _close(self, summary: dict[str, float] | None, error: str | None) -> None:
        client, run_id = self._client, self.run_id
        if summary:
            self._log(self._last_step, summary, prefix="summary/")
        if error is not None:
            client.set_tag(run_id, "ppojob.io/error", error[:5000])
        if self.out_dir is not None:
            for name in OUTPUT_FILES:
                path = self.out_dir / name
                if path.is_file():
                    client.log_artifact(run_id, str(path))
        client.set_terminated(run_id, status="FAILED" if error is not None else "FINISHED")

    def _abort(self) -> None:
        if self._client is not None and self.run_id is not None:
            self._client.set_terminated(self.run_id, status="FAILED")


# ---------------------------------------------------------------------------------------------
# Weights & Biases
# ---------------------------------------------------------------------------------------------
def _wait_for_wandb_service() -> None:
    """Return once wandb's service (``wandb-core``) has written out every finished run.

    ``run.finish()`` does not wait for that: its last step only *informs* the service that the
    run is over (a message with no reply), and the service's transaction-log writer holds the
    current 32 KiB block in memory until it closes the run's stream on that message. A short
    offline run's ``run-<id>.wandb`` is therefore just its 7-byte header when ``finish()``
    returns, until the service gets scheduled. ``wandb.teardown()`` sends its own request after
    that message on the same connection and waits for the service process to exit, which it
    does only after closing every stream."""
    import wandb

    try:
        wandb.teardown()
    except SystemExit as exc:  # wandb exits its caller when the service exited with an error
        raise RuntimeError(f"wandb's service exited with code {exc.code}") from None


class WandbReporter(TrackerReporter):
    """A W&B run through ``wandb``: the config, metrics per step, the summary, and the output
    files as an artifact (``<run id>-output``, type ``ppojob-output``). When the last open W&B
    run of this process ends, the reporter waits for wandb's service to write it out (and stops
    the service), so that the run's files are complete once ``finish`` or ``fail`` returns."""

    kind = "wandb"
    _open_runs = 0
    """This process's W&B runs that reporters have opened and not yet finished."""

    def __init__(
        self,
        project: str,
        run_name: str,
        directory: Path,
        mode: str = "online",
        entity: str | None = None,
        config: dict[str, Any] | None = None,
        out_dir: Path | None = None,
    ) -> None:
        super().__init__(f"{entity + '/' if entity else ''}{project}, {mode}")
        self.project = project
        self.entity = entity
        self.run_name = run_name
        self.dir = Path(directory)
        self.mode = mode
        self.config = config
        self.out_dir = Path(out_dir) if out_dir is not None else None
        self.run: Any = None
        self._state = _state_file(out_dir, "wandb", entity, project, run_name, mode)

    def _open(self, total_steps: int, start_step: int) -> None:
        import wandb

        if self.mode == "online" and not wandb.login(prompt=False, verify=False):
            raise RuntimeError(
                "no W&B API key: set WANDB_API_KEY (in the cluster: a key of the Secret named "
                "in the tracker's secretRef)"
            )
        self.dir.mkdir(parents=True, exist_ok=True)
        previous = _read_state(self._state, start_step)
        self.run = wandb.init(
            project=self.project,
            entity=self.entity,
            name=self.run_name,
            dir=str(self.dir),
            mode=self.mode,
            config=self.config,
            id=previous,
            resume="allow" if previous else None,
            reinit="create_new",
            settings=wandb.Settings(console="off", silent=True),
        )
        WandbReporter._open_runs += 1
        _write_state(self._state, self.run.id)

    def _log(self, step: int, scalars: dict[str, float]) -> None:
        self.run.log(scalars, step=step)

    def _close(self, summary: dict[str, float] | None, error: str | None) -> None:
        import wandb

        run = self.run
        if summary:
            run.summary.update(summary)
        files = [self.out_dir / n for n in OUTPUT_FILES] if self.out_dir is not None else []
        files = [f for f in files if f.is_file()]
        if files:
            artifact = wandb.Artifact(f"{run.id}-output", type="ppojob-output")
            for path in files:
                artifact.add_file(str(path))
            run.log_artifact(artifact)
        self._end(exit_code=1 if error is not None else 0)

    def _abort(self) -> None:
        self._end(exit_code=1)

    def _end(self, exit_code: int) -> None:
        """Finish the run (if still open) and, after the last one, wait for its files."""
        run, self.run = self.run, None
        if run is None:
            return
        WandbReporter._open_runs -= 1
        run.finish(exit_code=exit_code)
        if WandbReporter._open_runs == 0:
            _wait_for_wandb_service()


def tracker_reporters(cfg: Any, out_dir: Path) -> list[ProgressReporter]:
    """The reporters of ``cfg.trackers`` (a TrainingHalf's), relative paths inside ``out_dir``."""
    config = cfg.model_dump(mode="json", by_alias=True, exclude_none=True)
    name = getattr(cfg, "job_name", None) or "ppojob"

    def inside(path: str) -> Path:
        return Path(path) if Path(path).is_absolute() else out_dir / path

    out: list[ProgressReporter] = []
    for tracker in cfg.trackers:
        if tracker.type == "tensorboard":
            out.append(TensorBoardReporter(inside(tracker.log_dir), config))
        elif tracker.type == "mlflow":
            out.append(
                MlflowReporter(
                    tracker.tracking_uri,
                    tracker.experiment_name or name,
                    tracker.run_name or name,
                    config,
                    out_dir,
                )
            )
        elif tracker.type == "wandb":
            out.append(
                WandbReporter(
                    tracker.project,
                    tracker.run_name or name,
                    inside(tracker.dir),
                    mode=tracker.mode,
                    entity=tracker.entity,
                    config=config,
                    out_dir=out_dir,
                )
            )
    return out


def local_reporters(cfg: Any, out_dir: Path, show_bar: bool) -> list[ProgressReporter]:
    """metrics.jsonl and the progress bar, then the trackers of ``cfg``: what `ppojob run`
    reports to, and the trainer in the cluster before its PPOJob status reporter."""
    from ppojob_trainer.progress import LocalProgressReporter

    return [LocalProgressReporter(out_dir, show_bar=show_bar), *tracker_reporters(cfg, out_dir)]
