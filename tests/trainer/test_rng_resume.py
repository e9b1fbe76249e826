"""Checkpoints carry every worker process's RNG states, and a resumed run restores them."""

from __future__ import annotations

import random

import numpy as np
import pytest
import ray
import torch

from ppojob_api.training import TrainerConfig
from ppojob_trainer.checkpoint import capture_rng_state
from ppojob_trainer.driver.trainer import PPOTrainer

pytestmark = pytest.mark.usefixtures("ray_session")  # conftest: loopback Ray + model cache


def _same(a, b) -> bool:
    if isinstance(a, torch.Tensor):
        return isinstance(b, torch.Tensor) and torch.equal(a, b)
    if isinstance(a, dict):
        return isinstance(b, dict) and a.keys() == b.keys() and all(_same(a[k], b[k]) for k in a)
    if isinstance(a, list | tuple):
        return len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b, strict=True))
    return a == b


def _other_state(seed: int) -> dict:
    """RNG states unlike a freshly started worker's (which seeds everything from the config)."""
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)
    for _ in range(3):
        random.random(), np.random.rand(), torch.rand(1)
    return capture_rng_state()


@pytest.mark.slow
def test_checkpoint_saves_and_restores_every_workers_rng_states():
    cfg = TrainerConfig.model_validate(
        {
            "algorithm": {"advantageEstimator": "grpo"},
            "data": {"rolloutBatchSize": 2, "samplesPerPrompt": 2, "maxResponseLength": 4},
            "training": {"steps": 2, "learningRate": 1e-3, "seed": 3},
        }
    )
    first = PPOTrainer(cfg)
    try:
        first.step(0)
        hosts = first.groups.all_hosts
        assert len(hosts) == 2  # the actor's process and the rollout's
        wanted = [_other_state(100 + i) for i in range(len(hosts))]
        ray.get([h.set_rng_state.remote(s) for h, s in zip(hosts, wanted, strict=True)])
        state = first.state(1)
    finally:
        first.shutdown()
    assert len(state["rng"]) == 2 and all(
        _same(s, w) for s, w in zip(state["rng"], wanted, strict=True)
    )

    second = PPOTrainer(cfg)
    try:
        fresh = ray.get([h.rng_state.remote() for h in second.groups.all_hosts])
        assert not any(_same(f, w) for f, w in zip(fresh, wanted, strict=True))
        assert second.restore(state) == 1
        restored = ray.get([h.rng_state.remote() for h in second.groups.all_hosts])
        assert all(_same(r, w) for r, w in zip(restored, wanted, strict=True))
    finally:
        second.shutdown()
    assert state["rng_layout"] == [["actor:0"], ["rollout:0"]]

    # Resumed on another layout of as many processes (the worker counts may change across a
    # resume): two actor workers, each with its engine. No process gets another's generators.
    other = TrainerConfig.model_validate(
        {
            **cfg.model_dump(by_alias=True),
            "roles": {"actor": {"replicas": 2}, "rollout": {"colocateWithActor": True}},
        }
    )
    third = PPOTrainer(other)
    try:
        assert third.rng_layout() == [["actor:0", "rollout:0"], ["actor:1", "rollout:1"]]
        assert third.restore(state) == 1
        kept = ray.get([h.rng_state.remote() for h in third.groups.all_hosts])
        assert not any(_same(k, w) for k, w in zip(kept, wanted, strict=True))
    finally:
        third.shutdown()
