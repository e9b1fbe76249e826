"""Experiment trackers as progress reporters (spec.trackers).

Each tracker logs every step's metrics under the names of ``metrics.jsonl``
(:func:`~ppojob_trainer.progress.canonical_metrics`) and the resolved config at the start. A
tracker that cannot be set up or written (its library missing, its directory unwritable) logs
one warning and is switched off: it never fails the run.
"""

from __future__ import annotations

import contextlib
import logging
import math
from pathlib import Path
from typing import Any

from ppojob_trainer.progress import ProgressReporter, canonical_metrics

log = logging.getLogger(__name__)


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


class TensorBoardReporter(ProgressReporter):
    """Scalars per step and the config as text, in TensorBoard event files under ``log_dir``."""

    def __init__(self, log_dir: Path, config: dict[str, Any] | None = None) -> None:
        self.log_dir = Path(log_dir)
        self.config = config
        self._writer: Any = None
        self.disabled: str | None = None

    def _off(self, what: str, exc: BaseException) -> None:
        self.disabled = f"{type(exc).__name__}: {exc}"
        log.warning(
            "tracker tensorboard (%s): %s failed (%s); training goes on without it",
            self.log_dir,
            what,
            self.disabled,
        )
        writer, self._writer = self._writer, None
        if writer is not None:
            with contextlib.suppress(Exception):  # already broken
                writer.close()

    def start(self, total_steps: int, start_step: int = 0) -> None:
        try:
            from torch.utils.tensorboard import SummaryWriter

            self._writer = SummaryWriter(str(self.log_dir))
            if self.config is not None:
                import yaml

                text = yaml.safe_dump(self.config, sort_keys=False)
                self._writer.add_text("config", f"```yaml\n{text}```", start_step)
        except Exception as exc:  # ImportError (no tensorboard), OSError (the directory)
            self._off("start", exc)

    def report(self, step: int, metrics: dict[str, float]) -> None:
        if self._writer is None:
            return
        try:
            for key, value in _scalars(metrics).items():
                self._writer.add_scalar(key, value, step)
        except Exception as exc:
            self._off(f"step {step}", exc)

    def finish(self, summary: dict[str, Any]) -> None:
        if self._writer is None:
            return
        try:
            for key, value in _scalars(summary).items():
                self._writer.add_scalar(f"summary/{key}", value, 0)
            self._writer.close()
        except Exception as exc:
            self._off("finish", exc)
        self._writer = None

    def fail(self, message: str) -> None:
        if self._writer is None:
            return
        try:
            self._writer.add_text("error", message)
            self._writer.close()
        except Exception as exc:
            self._off("fail", exc)
        self._writer = None


def tracker_reporters(cfg: Any, out_dir: Path) -> list[ProgressReporter]:
    """The reporters of ``cfg.trackers`` (a TrainingHalf's), relative paths inside ``out_dir``."""
    config = cfg.model_dump(mode="json", by_alias=True, exclude_none=True)
    out: list[ProgressReporter] = []
    for tracker in cfg.trackers:
        if tracker.type == "tensorboard":
            path = Path(tracker.log_dir)
            out.append(TensorBoardReporter(path if path.is_absolute() else out_dir / path, config))
    return out


def local_reporters(cfg: Any, out_dir: Path, show_bar: bool) -> list[ProgressReporter]:
    """metrics.jsonl and the progress bar, then the trackers of ``cfg``: what `ppojob run`
    reports to, and the trainer in the cluster before its PPOJob status reporter."""
    from ppojob_trainer.progress import LocalProgressReporter

    return [LocalProgressReporter(out_dir, show_bar=show_bar), *tracker_reporters(cfg, out_dir)]
