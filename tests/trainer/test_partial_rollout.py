"""Partial (interruptible) rollout on the CPU torch engine (issue 24): a weight update that
arrives mid-generation is loaded at once and generation resumes with it; each token's version
tag says which weights sampled it, and the off-policy correction computed from the tags and the
recorded log-probs is exact token by token."""

from __future__ import annotations

import asyncio
import random
from pathlib import Path
from typing import Any

import pytest
import ray
import torch
import yaml

from ppojob_api.training import TrainerConfig
from ppojob_trainer import models
from ppojob_trainer.algorithms import importance_weights, sampling_logprobs, staleness_stats
from ppojob_trainer.backends.torch_backend.common import full_inputs
from ppojob_trainer.distributed import ShardIdentity

SWITCH = 3  # the update arrives before the 4th token
EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "ppojob-tiny.yaml"


def _teacher_forced(model: torch.nn.Module, batch: dict[str, torch.Tensor], temp: float):
    ids, attn, pos, plen = full_inputs(batch)
    with torch.no_grad():
        logits = model(input_ids=ids, attention_mask=attn, position_ids=pos).logits
    width = batch["response_ids"].shape[1]
    return sampling_logprobs(logits[:, plen - 1 : plen - 1 + width], batch["response_ids"], temp)


def test_a_weight_update_mid_generation_switches_the_token_versions(
    tmp_path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from ppojob_trainer.tasks import make_task
    from ppojob_trainer.workers.rollout import RolloutWorker

    monkeypatch.setenv("PPOJOB_CACHE_DIR", str(tmp_path))
    cfg = TrainerConfig.model_validate(
        {
            "algorithm": {"advantageEstimator": "grpo"},
            "data": {"rolloutBatchSize": 4, "samplesPerPrompt": 4, "maxResponseLength": 8},
            "training": {"steps": 1, "seed": 3},
        }
    )
    path = models.resolve_model_path(cfg.model.path, cfg.training.seed)
    rollout = RolloutWorker(cfg, ShardIdentity("rollout"), path, "cpu")
    model = rollout.engine.model
    before = {k: v.clone() for k, v in model.state_dict().items()}
    g = torch.Generator().manual_seed(0)
    after = {k: v + 0.3 * torch.randn(v.shape, generator=g) for k, v in before.items()}
    asked: list[int] = []

    def interrupt():
        asked.append(len(asked) + 1)  # asked before tokens 1, 2, ...
        return (8, after) if len(asked) == SWITCH else None

    examples = make_task(cfg.data.prompts).sample(cfg.data.rollout_batch_size, random.Random(0))
    batch, _ = rollout.generate(examples, 0, seed=1, version=7, interrupt=interrupt)
    mask = batch["response_mask"]
    versions = batch["versions"]
    assert mask[:, SWITCH:].any(), "no sample outlived the switch: the test proves nothing"
    assert (versions[:, :SWITCH] == 7).all() and (versions[:, SWITCH:] == 8).all()

    # the recorded log-probs are the sampling policy's of each token's own version
    temp = cfg.data.temperature
    new = _teacher_forced(model, batch, temp)  # the engine holds the new weights now
    model.load_state_dict(before)
    old = _teacher_forced(model, batch, temp)
    early, late = mask.clone(), mask.clone()
    early[:, SWITCH:] = False
    late[:, :SWITCH] = False
    got = batch["rollout_logprobs"]
    torch.testing.assert_close(got[early], old[early], atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(got[late], new[late], atol=1e-4, rtol=1e-4)
    assert (old[late] - new[late]).abs().max() > 1e-2  # the two versions do differ there

    # trained by the actor at version 8 (pi_old = the new weights): the late tokens are on
    # policy (weight 1, staleness 0), the early ones one version old, weighed by pi_new/pi_old
    stats = staleness_stats(versions, mask, current=8, bound=1)
    assert stats["staleness_hist_1"] == float(early.sum())
    assert stats["staleness_hist_0"] == float(late.sum())
    w, _ = importance_weights(new, got, mask, level="token", mode="truncate", cap=1e3)
    torch.testing.assert_close(w[late], torch.ones_like(w[late]), atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(w[early], (new[early] - old[early]).exp(), atol=1e-3, rtol=1e-3)


# ---------------------------------------------------------------------------------------------
# In the Ray loop: a sync offered while the engine generates reaches that generation
# ---------------------------------------------------------------------------------------------
@ray.remote(num_cpus=0)
class TokenGate:
    """Hears of every token of every partial-rollout generation; holds the first token of the
    second generation (the second distinct seed) until :meth:`release`, so a weight sync is
    sure to be offered while that generation is in flight."""

    def __init__(self) -> None:
        self.seeds: list[int] = []
        self.released = asyncio.Event()
        self.held = 0
        self.log: list[dict[str, Any]] = []

    async def arrive(self, event: str, caller: Any, info: dict[str, Any]) -> None:
        self.log.append({"event": event, **info})
        if event != "token":
            return
        if info["seed"] not in self.seeds:
            self.seeds.append(info["seed"])
            if len(self.seeds) == 2:
                self.held += 1
                await self.released.wait()

    async def release(self) -> int:
        self.released.set()
        return self.held

    async def arrivals(self) -> list[dict[str, Any]]:
        return self.log


@pytest.mark.usefixtures("ray_session")
def test_a_sync_offered_mid_generation_reaches_it_in_the_ray_loop(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """maxStaleness 1 with partialRollout: step 1's generation, launched at step 0's start, is
    held at its first token until step 0 has trained and offered sync 1. It then goes on with
    sync 1's weights: its first token is one version old, the rest current (with the
    synchronous hand-over, an engine runs a sync only after the generation in progress, so
    every token would be one version old). The engine ends holding the actor's weights."""
    from ppojob_trainer.driver.trainer import PPOTrainer
    from ppojob_trainer.manifest import config_from_doc
    from ppojob_trainer.workers.host import FAULT_GATE_ENV

    doc = yaml.safe_load(EXAMPLE.read_text())
    spec = doc["spec"]
    spec["training"].update(steps=2, checkpointInterval=0)
    spec["algorithm"].update(maxStaleness=1, partialRollout=True, criticWarmupSteps=0)
    spec["roles"]["actor"]["resources"]["cpus"] = 1
    spec["roles"]["rollout"] = {"resources": {"cpus": 1}}
    cfg = config_from_doc(doc)
    gate = TokenGate.options(name="token-gate").remote()
    monkeypatch.setenv(FAULT_GATE_ENV, "token-gate")
    trainer = PPOTrainer(cfg)
    trainer.total_steps = 2
    try:
        first = trainer.step(0)  # returns with step 1's generation held at its first token
        assert ray.get(gate.release.remote()) == 1, "step 1's generation was never held"
        second = trainer.step(1)
        engine = ray.get(trainer.hosts["rollout"][0].rollout_weights.remote())
        actor = ray.get(trainer.hosts["actor"][0].actor_weights.remote())
    finally:
        trainer.shutdown()
        log = ray.get(gate.arrivals.remote())
        ray.kill(gate)
    assert first["staleness/max"] == 0.0 and first["rollout/switched_share"] == 0.0
    # step 1: the first token sampled by version 0, every later one by version 1 (the actor's)
    assert second["policy/version"] == 1.0
    assert second["rollout/switched_share"] > 0.5, second
    assert 0.0 < second["staleness/share_1"] < 0.5 < second["staleness/share_0"], second
    tokens = [a for a in log if a["event"] == "token"]
    seeds = list(dict.fromkeys(a["seed"] for a in tokens))
    held = [a for a in tokens if a["seed"] == seeds[1]]  # step 1's generation
    assert held[0]["version"] == 0 and held[-1]["version"] == 1  # loaded between two tokens
    # the engine holds the weights of the last sync (2, offered after step 1 trained)
    for name, tensor in actor.items():
        torch.testing.assert_close(engine[name].float(), tensor.float(), atol=1e-6, rtol=0)
