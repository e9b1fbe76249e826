"""`ppojob run FILE`: train a PPOJob manifest on this machine.

Starts a local Ray bound to 127.0.0.1 only, runs the same trainer as in the cluster, prints a
summary. Exit codes: 0 done, 1 bad input (the message lists every problem, no traceback), 2 the
training or the placement failed, 75 preempted (a SIGTERM answered with a checkpoint of the last
completed step), 130 interrupted. Running the same command again resumes from
the newest checkpoint in the output directory.

This module imports neither torch nor Ray at import time (`ppojob validate` imports it to build
the parser).
"""

from __future__ import annotations

import argparse
import logging
import math
import os
import sys
import time
from pathlib import Path
from typing import Any

DEFAULT_OUT_ROOT = Path("ppojob-out")
CLOSING_STEPS = 50  # the steps whose mean reward the summary shows

log = logging.getLogger("ppojob_trainer.run")


def add_run_parser(subparsers: Any) -> argparse.ArgumentParser:
    """Add the `run` subcommand to `ppojob`'s subparsers; it dispatches via `args.func`."""
    from ppojob_api.setflags import add_set_arguments

    p = subparsers.add_parser(
        "run",
        help="train a PPOJob manifest locally (Ray bound to 127.0.0.1)",
        description="Train a PPOJob manifest on this machine with a local Ray bound to 127.0.0.1 "
        "only. Running it again resumes from the newest checkpoint in the output directory.",
    )
    p.add_argument("file", metavar="FILE", help="PPOJob manifest (YAML)")
    p.add_argument("--steps", metavar="N", help="train N steps (sets spec.training.steps)")
    p.add_argument("--seed", metavar="N", help="random seed (sets spec.training.seed)")
    p.add_argument(
        "--out",
        metavar="DIR",
        type=Path,
        default=None,
        help="output directory (default: ./ppojob-out/<metadata.name>)",
    )
    add_set_arguments(p, "run with")
    p.add_argument(
        "--num-cpus",
        metavar="N",
        default=None,
        help="logical CPUs of the local Ray (default: this machine's CPU count)",
    )
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    p.set_defaults(func=run_command)
    return p


def _fail(message: str) -> int:
    print(f"ppojob run: {message}", file=sys.stderr)
    return 1


def _positive(name: str, raw: str | None) -> int | None:
    if raw is None:
        return None
    try:
        value = int(raw)
    except ValueError:
        raise ValueError(f"{name} must be a whole number >= 1, got {raw!r}") from None
    if value < 1:
        raise ValueError(f"{name} must be >= 1, got {value}")
    return value


def run_command(args: argparse.Namespace) -> int:
    """Run `ppojob run`; returns the exit code."""
    from ppojob_api.problems import SpecError
    from ppojob_trainer.manifest import load_manifest, parse_set

    try:
        num_cpus = _positive("--num-cpus", args.num_cpus)
    except ValueError as exc:
        return _fail(str(exc))
    try:
        sets = [parse_set(s) for s in args.sets]
        if args.steps is not None:
            sets.append(("training.steps", parse_set(f"x={args.steps}")[1]))
        if args.seed is not None:
            sets.append(("training.seed", parse_set(f"x={args.seed}")[1]))
        doc, cfg = load_manifest(args.file, sets, args.unsets)
    except SpecError as exc:
        return _fail(str(exc))
    from ppojob_trainer.preflight import preflight

    problems = preflight(cfg)  # before Ray starts: paths, hook modules, hook signatures
    if problems:
        return _fail(
            f"{args.file}: {len(problems)} problem(s) found before starting:\n"
            + "\n".join(f"  - {p}" for p in problems)
        )
    name = (doc.get("metadata") or {}).get("name") or Path(args.file).stem
    out_dir = Path(args.out) if args.out is not None else DEFAULT_OUT_ROOT / name
    try:
        out_dir.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        return _fail(f"--out {out_dir}: cannot create: {exc}")
    return train_locally(cfg, out_dir, num_cpus=num_cpus, show_bar=not args.no_progress)


def train_locally(
    cfg: Any, out_dir: Path, num_cpus: int | None = None, show_bar: bool = True
) -> int:
    """Start a loopback-only Ray, train `cfg` into `out_dir`, print a summary; the exit code."""
    _configure_logging()
    try:
        from ppojob_trainer.driver.run import train
    except ImportError as exc:
        print(f"ppojob run: {missing_trainer_extra(exc)}", file=sys.stderr)
        return 2
    from ppojob_trainer.errors import StartupError, describe_failure
    from ppojob_trainer.placement import PlacementError
    from ppojob_trainer.preemption import PREEMPTED_EXIT_CODE, Preempted
    from ppojob_trainer.runtime import shutdown_ray, start_local_ray

    done = completed_run(cfg, out_dir)
    if done is not None:
        print(done)
        return 0
    t0 = time.monotonic()
    from ppojob_trainer.progress import CompositeReporter
    from ppojob_trainer.trackers import local_reporters

    reporter = CompositeReporter(local_reporters(cfg, out_dir, show_bar))
    print(
        f"ppojob run: {cfg.job_name or 'job'}: {cfg.training.steps} steps, "
        f"{cfg.algorithm.advantage_estimator}, output in {out_dir}",
        file=sys.stderr,
    )
    import ray

    owns_ray = not ray.is_initialized()  # a caller's (e.g. a test's) Ray is left running
    # The run's last line (and exit code) is printed once Ray is down: a worker's log lines that
    # Ray forwards late must not come after it.
    ending: tuple[str, int] | None = None
    try:
        start_local_ray(num_cpus=num_cpus)
        result = train(cfg, out_dir, reporter)
    except Preempted as exc:
        reporter.fail(f"{exc.reason}: {exc}")
        ending = f"ppojob run: {exc.reason}: {exc}", PREEMPTED_EXIT_CODE
    except KeyboardInterrupt:
        reporter.fail("interrupted")  # ends the progress bar's line first
        ending = (
            "ppojob run: interrupted; run the same command again to resume from the newest "
            "checkpoint",
            130,
        )
    except PlacementError as exc:
        reporter.fail(str(exc))
        ending = (
            f"ppojob run: cannot place the job on the local Ray: {exc}\n  locally: --num-cpus N "
            "gives the local Ray N logical CPUs (default: this machine's count)",
            2,
        )
    except Exception as exc:
        log.debug("training failed", exc_info=True)
        message = describe_failure(exc)
        reporter.fail(message)
        head = "" if isinstance(exc, StartupError) else "training failed: "
        ending = f"ppojob run: {head}{message}", 2
    finally:
        if owns_ray:
            shutdown_ray()
    if ending is not None:
        print(ending[0], file=sys.stderr)
        return ending[1]
    print(format_summary(cfg, result, out_dir, time.monotonic() - t0))
    return 0


def completed_run(cfg: Any, out_dir: Path) -> str | None:
    """What to print instead of training when `out_dir` already holds a run that completed all
    of `cfg.training.steps` (and resume is on); None when there is something to train."""
    from ppojob_trainer.checkpoint import latest_checkpoint, read_manifest
    from ppojob_trainer.progress import read_summary

    if not cfg.training.resume:
        return None
    ckpt_dir = Path(cfg.training.checkpoint_dir)
    if not ckpt_dir.is_absolute():
        ckpt_dir = out_dir / ckpt_dir
    path = latest_checkpoint(ckpt_dir)
    manifest = read_manifest(path) if path is not None else None
    step = (manifest or {}).get("step")
    if not isinstance(step, int) or step < cfg.training.steps:
        return None
    final = read_summary(out_dir).get("final_reward")
    reward = f"{final:.4f}" if isinstance(final, int | float) and math.isfinite(final) else "n/a"
    return "\n".join(
        [
            f"ppojob run: {cfg.job_name or 'job'} is already complete: {step} of "
            f"{cfg.training.steps} steps in {out_dir} (checkpoint {path})",
            f"  final reward:  {reward}",
            f"  to train further:  --steps N with N > {step} (resumes from step {step})",
            f"  to start fresh:    --out NEW_DIR, or delete {out_dir}",
        ]
    )


def missing_trainer_extra(exc: ImportError) -> str:
    """One line for a trainer started without its dependencies (torch, ray, transformers)."""
    what = getattr(exc, "name", None) or str(exc)
    return (
        f"training needs the trainer extra, and {what} is not importable: "
        "pip install 'ppojob[trainer]' (from a clone: pip install -e '.[trainer]')"
    )


def format_summary(cfg: Any, result: Any, out_dir: Path, wall_s: float) -> str:
    """Human summary of a TrainResult (tolerates the field names of either loop version)."""
    from ppojob_trainer.progress import read_summary

    steps = _first(result, "steps_completed", "steps")
    final = _first(result, "final_reward")
    metrics = _first(result, "final_metrics") or {}
    if final is None and isinstance(metrics, dict):
        final = metrics.get("reward_mean", metrics.get("reward/mean"))
    if final is None:  # nothing left to train this time: the earlier run's figure
        final = read_summary(out_dir).get("final_reward")
    reward = f"{final:.4f}" if isinstance(final, int | float) and math.isfinite(final) else "n/a"
    ckpt = _first(result, "checkpoint")
    lines = [
        f"ppojob run: {cfg.job_name or 'job'} finished",
        f"  steps:         {steps if steps is not None else 'n/a'} of {cfg.training.steps}",
        f"  final reward:  {reward}",
    ]
    closing = closing_reward(out_dir)
    if closing is not None:
        lines.append(f"  last {closing[0]} steps: mean reward {closing[1]:.4f}")
    lines += [f"  time:          {wall_s:.1f} s", f"  output:        {out_dir}"]
    for label, name in (
        ("reward curve", "reward_curve.png"),
        ("metrics", "metrics.jsonl"),
        ("summary", "summary.json"),
    ):
        if (out_dir / name).exists():
            lines.append(f"  {label + ':':14} {out_dir / name}")
    if ckpt:
        lines.append(f"  checkpoint:    {ckpt}")
    return "\n".join(lines)


def closing_reward(out_dir: Path, last: int = CLOSING_STEPS) -> tuple[int, float] | None:
    """(n, mean reward of the run's last n steps) from `out_dir/metrics.jsonl`, n = `last` or
    fewer when the run is shorter; None without a reward. One step's reward is noisy: this is
    the figure that says where a run ended."""
    from ppojob_trainer.progress import read_metrics

    rewards = [
        r["reward_mean"]
        for r in read_metrics(out_dir)
        if isinstance(r.get("reward_mean"), int | float) and math.isfinite(r["reward_mean"])
    ][-last:]
    return (len(rewards), sum(rewards) / len(rewards)) if rewards else None


def _first(obj: Any, *names: str) -> Any:
    for name in names:
        value = getattr(obj, name, None)
        if value is not None:
            return value
    return None


class _StderrHandler(logging.StreamHandler):
    """Writes to whatever sys.stderr is at the time (test capture replaces it)."""

    @property  # type: ignore[override]
    def stream(self) -> Any:
        return sys.stderr

    @stream.setter
    def stream(self, value: Any) -> None:
        pass


def _configure_logging() -> None:
    """Show the trainer's INFO logs (placement, resume, checkpoints) on stderr, once."""
    logger = logging.getLogger("ppojob_trainer")
    if not any(isinstance(h, _StderrHandler) for h in logger.handlers):
        handler = _StderrHandler()
        handler.setFormatter(logging.Formatter("%(message)s"))
        logger.addHandler(handler)
        level = os.environ.get("PPOJOB_LOG_LEVEL", "INFO").upper()
        logger.setLevel(getattr(logging, level, logging.INFO))
        logger.propagate = False
