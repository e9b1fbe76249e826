"""End to end: a run stopped after step k and resumed ends with the same metrics as an
uninterrupted run (fixed seed) and loses no completed step."""

from __future__ import annotations

import json
import math
import os
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from ppojob_trainer.checkpoint import complete_checkpoints, latest_checkpoint
from ppojob_trainer.manifest import load_manifest
from ppojob_trainer.progress import REQUIRED_KEYS, LocalProgressReporter, read_metrics

ROOT = Path(__file__).resolve().parents[2]
TINY = ROOT / "examples" / "ppojob-tiny.yaml"
COMPARED = ("reward_mean", "kl", "value_loss", "actor/pg_loss", "response/length")

pytestmark = pytest.mark.slow


def tiny_cfg():
    sets = [
        ("training.steps", 4),
        ("training.seed", 7),
        ("training.checkpointInterval", 2),
        ("training.keepCheckpoints", 2),
        ("data.rolloutBatchSize", 4),
        ("training.miniBatchSize", 32),
    ]
    return load_manifest(TINY, sets)[1]


def train(cfg, out: Path, max_steps: int | None = None):
    from ppojob_trainer.driver.run import train as loop_train

    return loop_train(cfg, out, LocalProgressReporter(out, show_bar=False), max_steps=max_steps)


def test_stopped_and_resumed_run_matches_an_uninterrupted_one(local_ray, tmp_path: Path) -> None:
    cfg = tiny_cfg()
    whole, parts = tmp_path / "whole", tmp_path / "parts"
    train(cfg, whole)

    # Run 4 steps... stopped after step 3, with step 3's checkpoint lost mid-write: the newest
    # complete checkpoint is step 2, and a partial temp dir lies beside it.
    train(cfg, parts, max_steps=3)
    ckpts = parts / "checkpoints"
    step3 = ckpts / "step-000003"
    os.remove(step3 / "MANIFEST.json")
    shutil.move(step3, ckpts / ".tmp-step-000003-crashed0")
    assert latest_checkpoint(ckpts) == ckpts / "step-000002"
    assert [r["step"] for r in read_metrics(parts)] == [1, 2, 3]

    train(cfg, parts)  # resumes from step 2, recomputes 3, runs 4

    a, b = read_metrics(whole), read_metrics(parts)
    assert [r["step"] for r in a] == [1, 2, 3, 4]
    assert [r["step"] for r in b] == [1, 2, 3, 4]  # no step lost, none twice
    for ra, rb in zip(a, b, strict=True):
        assert set(REQUIRED_KEYS) <= set(rb)
        for key in COMPARED:
            if ra.get(key) is None:
                assert rb.get(key) is None, (ra["step"], key)
            else:
                assert rb[key] == pytest.approx(ra[key], rel=1e-5, abs=1e-7), (ra["step"], key)
    elapsed = [r["elapsed_seconds"] for r in b]
    assert elapsed == sorted(elapsed)  # wall time keeps growing across the resume
    assert [p.name for p in complete_checkpoints(ckpts)] == ["step-000002", "step-000004"]
    assert not (ckpts / ".tmp-step-000003-crashed0").exists()
    assert json.loads((parts / "summary.json").read_text())
    assert (parts / "reward_curve.png").stat().st_size > 0


def test_a_sharded_run_resumes_from_its_workers_shards(tmp_path: Path, monkeypatch) -> None:
    """Two FSDP actor (and colocated critic) workers: each writes its own shard; a run resumed
    from step 2 continues exactly like an uninterrupted one."""
    monkeypatch.setenv("PPOJOB_CACHE_DIR", str(tmp_path / "cache"))  # a model cache of its own
    sets = [
        ("training.steps", 3),
        ("training.seed", 3),
        ("training.checkpointInterval", 2),
        ("training.sharding", "fsdp"),
        ("data.rolloutBatchSize", 4),
        ("training.miniBatchSize", 16),
        ("roles.actor.replicas", 2),
        ("roles.actor.resources.cpus", 1),
    ]
    cfg = load_manifest(TINY, sets)[1]
    whole, parts = tmp_path / "whole", tmp_path / "parts"
    train(cfg, whole)
    train(cfg, parts, max_steps=2)
    step2 = parts / "checkpoints" / "step-000002"
    for role in ("actor", "critic"):
        assert len(list((step2 / role).glob("*.distcp"))) == 2  # one file per worker
    assert not (step2 / "actor.pt").exists()  # no model state went through the driver
    train(cfg, parts)
    a, b = read_metrics(whole), read_metrics(parts)
    assert [r["step"] for r in b] == [1, 2, 3]
    for key in COMPARED:
        if a[-1].get(key) is not None:
            assert b[-1][key] == pytest.approx(a[-1][key], rel=1e-5, abs=1e-7), key
    export = whole / "checkpoints" / "hf" / "step-000003"
    assert (export / "actor" / "config.json").exists()
    assert (export / "critic" / "value_head.safetensors").exists()

    # The same checkpoint resumed by one worker (a job restarted where fewer CPUs/GPUs are
    # free): each role's two shards are read back resharded, to the very weights the two
    # workers held at step 2 (their export then), and the run trains on from there.
    from ppojob_trainer.driver.run import resume
    from ppojob_trainer.driver.trainer import PPOTrainer

    narrow_cfg = load_manifest(TINY, [*sets[:-2], ("roles.actor.resources.cpus", 1)])[1]
    assert narrow_cfg.roles.workers_of("actor") == 1
    narrow = tmp_path / "narrow-checkpoints"
    shutil.copytree(parts / "checkpoints" / "step-000002", narrow / "step-000002")
    trainer = PPOTrainer(narrow_cfg)
    try:
        assert resume(trainer, narrow) == 2
        trainer.export_pretrained(tmp_path / "narrow")
        metrics = trainer.step(2)
    finally:
        trainer.shutdown()
    wide = parts / "checkpoints" / "hf" / "step-000002"
    for role in ("actor", "critic"):
        files = sorted(p.name for p in (wide / role).glob("*.safetensors"))
        assert files == sorted(p.name for p in (tmp_path / "narrow" / role).glob("*.safetensors"))
        for name in files:
            ours = load_file(tmp_path / "narrow" / role / name)
            theirs = load_file(wide / role / name)
            assert ours.keys() == theirs.keys() and ours, (role, name)
            for key, tensor in theirs.items():
                assert torch.equal(ours[key], tensor), (role, name, key)
    assert math.isfinite(metrics["actor/pg_loss"]) and metrics["reward/mean"] >= 0
