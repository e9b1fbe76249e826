"""Partial (interruptible) rollout on the CPU torch engine (issue 24): a weight update that
arrives mid-generation is loaded at once and generation resumes with it; each token's version
tag says which weights sampled it, and the off-policy correction computed from the tags and the
recorded log-probs is exact token by token."""

from __future__ import annotations

import random

import pytest
import torch

from ppojob_api.training import TrainerConfig
from ppojob_trainer import models
from ppojob_trainer.algorithms import importance_weights, sampling_logprobs, staleness_stats
from ppojob_trainer.backends.base import ShardIdentity
from ppojob_trainer.backends.torch_backend import full_inputs

SWITCH = 3  # the update arrives before the 4th token


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
