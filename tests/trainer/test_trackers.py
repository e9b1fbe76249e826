"""Experiment trackers (spec.trackers): TensorBoard's event files read back with TensorBoard's own
event reader (the metrics.jsonl names, every step, the resolved config as text); a tracker that
cannot write is one warning and the run goes on."""

from __future__ import annotations

import logging
from pathlib import Path

import yaml
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

from ppojob_api.validation import validate_manifest
from ppojob_trainer.progress import LocalProgressReporter
from ppojob_trainer.trackers import TensorBoardReporter, local_reporters, tracker_reporters
from tests.helpers.controlplane import ROOT

TINY = yaml.safe_load((ROOT / "examples" / "ppojob-tiny.yaml").read_text())


def _read(log_dir: Path) -> EventAccumulator:
    acc = EventAccumulator(str(log_dir), size_guidance={"scalars": 0, "tensors": 0})
    acc.Reload()
    return acc


def test_tensorboard_events_read_back(tmp_path: Path) -> None:
    doc = {**TINY, "spec": {**TINY["spec"], "trackers": [{"type": "tensorboard"}]}}
    cfg = validate_manifest(doc).spec
    (tb,) = tracker_reporters(cfg, tmp_path)
    assert isinstance(tb, TensorBoardReporter) and tb.log_dir == tmp_path / "tensorboard"
    tb.start(2)
    tb.report(1, {"reward/mean": 0.25, "kl/mean": 0.5, "time/step": 1.5, "note": "text"})
    tb.report(2, {"reward/mean": 0.75, "kl/mean": 0.25, "time/step": 1.0})
    tb.finish({"steps": 2, "final_reward": 0.75})
    acc = _read(tmp_path / "tensorboard")
    tags = set(acc.Tags()["scalars"])
    assert {"reward_mean", "kl", "time/step", "summary/final_reward"} <= tags
    assert "note" not in tags
    reward = [(e.step, e.value) for e in acc.Scalars("reward_mean")]
    assert reward == [(1, 0.25), (2, 0.75)]
    # the metric names are metrics.jsonl's
    local = LocalProgressReporter(tmp_path / "local", show_bar=False)
    local.start(1)
    local.report(1, {"reward/mean": 0.25, "kl/mean": 0.5, "time/step": 1.5})
    line = (tmp_path / "local" / "metrics.jsonl").read_text()
    assert all(f'"{tag}"' in line for tag in ("reward_mean", "kl", "time/step"))
    # the resolved config, as text
    (config,) = [t for t in acc.Tags()["tensors"] if t.startswith("config")]
    text = acc.Tensors(config)[0].tensor_proto.string_val[0].decode()
    assert "count-up" in text and "lrScheduler: cosine" in text


def test_a_tracker_that_cannot_write_is_a_warning(tmp_path: Path, caplog) -> None:
    blocked = tmp_path / "file"
    blocked.write_text("not a directory")
    tb = TensorBoardReporter(blocked / "tb")
    with caplog.at_level(logging.WARNING, logger="ppojob_trainer.trackers"):
        tb.start(2)
        tb.report(1, {"reward/mean": 0.5})
        tb.finish({"steps": 1})
    assert tb.disabled is not None
    (warning,) = [r.getMessage() for r in caplog.records]
    assert f"tracker tensorboard ({blocked / 'tb'}): start failed" in warning
    assert "training goes on without it" in warning


def test_ppojob_run_and_the_trainer_in_the_cluster_report_to_the_trackers(tmp_path: Path) -> None:
    from ppojob_trainer import entrypoint

    doc = {**TINY, "spec": {**TINY["spec"], "trackers": [{"type": "tensorboard"}]}}
    cfg = validate_manifest(doc).spec
    kinds = [type(r).__name__ for r in local_reporters(cfg, tmp_path, False)]
    assert kinds == ["LocalProgressReporter", "TensorBoardReporter"]
    inside = entrypoint._reporters(tmp_path, show_bar=False, cfg=cfg).reporters
    assert [type(r).__name__ for r in inside] == kinds
