"""Rollout engines on Ray (CPU, torch engine): prompts split across engines, colocated engines
told to release and resume their memory in order every step, weight sync in bounded buckets both
ways (in-process tensor buckets when colocated, a gloo weight-update group when disaggregated)."""

from __future__ import annotations

import time

import pytest
import ray
import torch

from ppojob_api.training import TrainerConfig
from ppojob_api.trainspec import roles as trainspec_roles
from ppojob_trainer.driver.trainer import PPOTrainer
from ppojob_trainer.driver.weights import BroadcastSync, DeferredSync

pytestmark = pytest.mark.usefixtures("ray_session")  # conftest: loopback Ray + model cache


def _cfg(roles: dict, prompts: int, bucket_mb: float = 512.0, **algo) -> TrainerConfig:
    roles["rollout"]["weightSyncBucketMb"] = bucket_mb
    return TrainerConfig.model_validate(
        {
            "roles": roles,
            "algorithm": {"advantageEstimator": "grpo", **algo},
            "data": {"rolloutBatchSize": prompts, "samplesPerPrompt": 2, "maxResponseLength": 6},
            "training": {"steps": 3, "learningRate": 1e-2, "seed": 5},
        }
    )


def _same_weights(a: dict, b: dict) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


@pytest.mark.slow
def test_colocated_engines_are_told_to_release_before_training_and_resume_before_new_weights(
    monkeypatch: pytest.MonkeyPatch,
):
    """The order of the driver's release/resume calls, not what they free: the torch engine's
    release and resume do nothing (SGLang's free and retake GPU memory, which needs a GPU), so
    they are sent only to engines of ``RELEASING_BACKENDS``; here this process (the driver)
    counts the torch engine among them, the worker processes do not (so the wake of the rest
    of the engine after the sync, the worker's own decision, is absent: the sglang tests drive
    it through the worker's own code).
    Two actor workers, each with a colocated engine and critic (gae); one prompt, so the
    second engine gets none and sits the step out (fewer prompts than engines used to raise
    IndexError). Step 0 is a critic warm-up step: the actor does not train, yet the woken
    engines take the weights again (their memory was released)."""
    roles = {
        "actor": {"replicas": 2, "resources": {"cpus": 1}},
        "rollout": {"colocateWithActor": True, "offload": True},
    }
    cfg = _cfg(roles, prompts=1, advantageEstimator="gae", criticWarmupSteps=1)
    monkeypatch.setattr(trainspec_roles, "RELEASING_BACKENDS", frozenset({"torch", "sglang"}))
    trainer = PPOTrainer(cfg)
    try:
        assert len(trainer.hosts["rollout"]) == 2 and trainer.groups.engine_groups == [
            [h] for h in trainer.hosts["actor"]
        ]
        steps = 3
        for s in range(steps):
            t0 = time.perf_counter()
            metrics = trainer.step(s)
            wall = time.perf_counter() - t0
            # generation, then preparation, then (after training) the sync, one after the
            # other within the step, which the driver's own clock bounds
            phases = [metrics[f"time/{k}"] for k in ("generate", "prepare", "weight_sync")]
            assert all(p > 0 for p in phases), phases
            assert sum(phases) <= metrics["time/step"] <= wall, (phases, metrics, wall)
        first, second = ray.get([h.calls.remote() for h in trainer.hosts["actor"]])

        # every step, on the engine's process: generate -> release -> values, log-probs and
        # training -> empty cache, wake the weights -> the weights (one bucket, in a session);
        # the next generation after that
        def step_calls(actor_trains: bool, generates: bool = True) -> list[str]:
            return [
                *(["engine.generate"] if generates else []),
                "engine.release_memory",
                "critic.values",
                "actor.prepare",
                "critic.train",
                *(["actor.train"] if actor_trains else []),
                "cuda.empty_cache",
                "engine.resume_memory(weights)",
                "engine.begin_weight_update",
                "engine.update_weights_from_tensor",
                "engine.end_weight_update",
            ]

        assert first == step_calls(False) + step_calls(True) * (steps - 1)
        # the engine without prompts generates nothing but still sleeps, wakes and syncs
        assert second == step_calls(False, False) + step_calls(True, False) * (steps - 1)
        a0, r0, r1 = ray.get(
            [
                trainer.hosts["actor"][0].actor_weights.remote(),
                trainer.hosts["rollout"][0].rollout_weights.remote(),
                trainer.hosts["rollout"][1].rollout_weights.remote(),
            ]
        )
        assert _same_weights(a0, r0) and _same_weights(a0, r1)
    finally:
        trainer.shutdown()


@pytest.mark.slow
def test_disaggregated_engines_take_the_weights_bucket_by_bucket_over_a_group():
    """Two engines on their own workers; the actor's leader broadcasts over a gloo weight-update
    group in buckets of at most 0.1 MiB (the tiny model is ~0.5 MiB: several buckets)."""
    roles = {
        "actor": {"replicas": 1, "resources": {"cpus": 1}},
        "rollout": {"replicas": 2, "resources": {"cpus": 1}},
    }
    trainer = PPOTrainer(_cfg(roles, prompts=1, bucket_mb=0.1))
    try:
        before = ray.get(trainer.hosts["rollout"][1].rollout_weights.remote())
        metrics = trainer.step(0)
        actor, *engines = ray.get(
            [trainer.hosts["actor"][0].actor_weights.remote()]
            + [h.rollout_weights.remote() for h in trainer.hosts["rollout"]]
        )
        assert not _same_weights(before, actor), "the actor did not change: nothing to check"
        assert all(_same_weights(actor, e) for e in engines)
        # the sync carried version 1, which both engines reported back; the step's samples
        # came from version 0
        assert (metrics["weights/version"], metrics["rollout/version"]) == (1.0, 0.0)
        sizes = sorted((t.numel() * t.element_size() for t in actor.values()), reverse=True)
        assert sizes[0] <= 0.1 * 2**20  # every tensor fits a bucket, so the bound holds
        calls = ray.get([h.calls.remote() for h in trainer.hosts["rollout"]])
        buckets = [c.count("engine.update_weights_from_distributed") for c in calls]
        assert buckets[0] == buckets[1] >= 4
        assert calls[0][0] == "engine.init_weights_update_group"
        # the engine without prompts never generated, and still took the weights, every bucket
        # inside one weight-update session
        n = buckets[1]
        assert calls[1][: n + 3] == [
            "engine.init_weights_update_group",
            "engine.begin_weight_update",
            *["engine.update_weights_from_distributed"] * n,
            "engine.end_weight_update",
        ]
    finally:
        trainer.shutdown()


@pytest.mark.slow
def test_bounded_staleness_over_a_weight_update_group_syncs_inside_sessions_between_generations():
    """maxStaleness 1 with engines on GPUs of their own takes the path SGLang engines take (no
    object-store loads: each sync a weight-update session over the group), here with the CPU
    engine behind the same calls: the engine generates step k+1 before step k's session, every
    bucket of a sync is inside one session, and each step's samples are one version old."""
    roles = {
        "actor": {"replicas": 1, "resources": {"cpus": 1}},
        "rollout": {"replicas": 1, "resources": {"cpus": 1}},
    }
    trainer = PPOTrainer(_cfg(roles, prompts=2, bucket_mb=0.1, maxStaleness=1))
    try:
        # CPU engines take the object store; gpus > 0 (sglang) takes a broadcast, set up here
        assert isinstance(trainer.weights, DeferredSync)
        trainer.weights = BroadcastSync(trainer.groups, trainer.topo.weight_backend)
        trainer.weights.init_group(1)
        history = [trainer.step(k) for k in range(3)]
        actor, engine = ray.get(
            [
                trainer.hosts["actor"][0].actor_weights.remote(),
                trainer.hosts["rollout"][0].rollout_weights.remote(),
            ]
        )
        calls = ray.get(trainer.hosts["rollout"][0].calls.remote())
    finally:
        trainer.shutdown()
    assert [m["staleness/max"] for m in history] == [0.0, 1.0, 1.0]
    assert [m["policy/version"] for m in history] == [0.0, 1.0, 2.0]
    # each sync's version as the engine reported it back, and its samples' versions
    assert [m["weights/version"] for m in history] == [1.0, 2.0, 3.0]
    assert [m["rollout/version"] for m in history] == [0.0, 0.0, 1.0]
    assert _same_weights(actor, engine)
    begins = [i for i, c in enumerate(calls) if c == "engine.begin_weight_update"]
    ends = [i for i, c in enumerate(calls) if c == "engine.end_weight_update"]
    updates = [i for i, c in enumerate(calls) if c == "engine.update_weights_from_distributed"]
    assert len(begins) == len(ends) == 3
    for u in updates:  # every bucket inside a session
        assert any(b < u < e for b, e in zip(begins, ends, strict=True)), (u, calls)
    for b, e in zip(begins, ends, strict=True):  # nothing else inside a session
        assert set(calls[b + 1 : e]) == {"engine.update_weights_from_distributed"}
    generations = [i for i, c in enumerate(calls) if "generate" in c]
    # step k+1's generation was launched before step k's sync: it is on the engine first
    assert generations[1] < begins[0] and generations[2] < begins[1]
