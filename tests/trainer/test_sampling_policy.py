"""pi_old is the sampling policy (top-p truncated), the rollout/training log-prob mismatch is
reported, and truncated importance sampling corrects the policy loss."""

from __future__ import annotations

import math
import random

import pytest
import ray
import torch

from ppojob_api.training import TrainerConfig, TrainingSettings
from ppojob_trainer import models
from ppojob_trainer.algorithms import policy_loss, rollout_is_weights, sampling_logprobs
from ppojob_trainer.backends.torch_backend.generation import TorchGenerationEngine
from ppojob_trainer.backends.torch_backend.policy import TorchPolicyTrainer
from ppojob_trainer.distributed import ShardIdentity


def _reference_truncated(logits: torch.Tensor, tokens: torch.Tensor, temperature, top_p):
    """log(p[token] / mass of the nucleus), the nucleus built token by token (float64 loops)."""
    probs = torch.softmax(logits.double() / temperature, -1)
    out = torch.empty(tokens.shape, dtype=torch.float64)
    for idx in torch.cartesian_prod(*[torch.arange(s) for s in tokens.shape]).tolist():
        idx = tuple(idx) if isinstance(idx, list) else (idx,)
        p = probs[idx]
        order = sorted(range(p.numel()), key=lambda j: -float(p[j]))
        kept, mass = set(), 0.0
        for j in order:
            if mass >= top_p:
                break
            kept.add(j)
            mass += float(p[j])
        kept.add(int(tokens[idx]))
        out[idx] = math.log(float(p[int(tokens[idx])]) / sum(float(p[j]) for j in kept))
    return out


def test_sampling_logprobs_are_the_renormalised_nucleus():
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(3, 5, 11, generator=g) * 2
    tokens = torch.randint(0, 11, (3, 5), generator=g)
    plain = torch.log_softmax(logits / 0.8, -1).gather(-1, tokens[..., None]).squeeze(-1)
    torch.testing.assert_close(sampling_logprobs(logits, tokens, 0.8, 1.0), plain)
    for top_p in (0.3, 0.75):
        got = sampling_logprobs(logits, tokens, 0.8, top_p)
        exp = _reference_truncated(logits, tokens, 0.8, top_p)
        torch.testing.assert_close(got.double(), exp, atol=1e-5, rtol=1e-5)
    # differentiable in the logits, finite for a token outside the nucleus
    x = logits.clone().requires_grad_(True)
    sampling_logprobs(x, tokens, 1.0, 0.1).sum().backward()
    assert torch.isfinite(x.grad).all()


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return models.materialize_builtin("tiny-llama", 5, tmp_path_factory.mktemp("cache"))


@pytest.mark.parametrize("top_p", [0.5, 0.8])
def test_rollout_and_old_logprobs_are_the_sampling_policy_under_top_p(model_dir, top_p):
    """The engine samples from the truncated distribution; the log-probs it reports and the
    actor's recomputed old log-probs are that distribution's (mismatch ~0), not the full
    softmax's."""
    tok = models.load_tokenizer(model_dir)
    enc = tok(["1", "2345", "67", "890"] * 4, padding=True, return_tensors="pt")
    ids, mask = enc["input_ids"], enc["attention_mask"].bool()
    engine = TorchGenerationEngine(model_dir, "float32", tok.all_special_ids, tok.pad_token_id)
    gen = engine.generate(ids, mask, max_new_tokens=6, temperature=0.9, top_p=top_p, seed=3)
    trainer = TorchPolicyTrainer(
        model_dir,
        "float32",
        TrainingSettings(),
        total_updates=1,
        temperature=0.9,
        top_p=top_p,
        need_reference=False,
    )
    batch = {"prompt_ids": ids, "prompt_mask": mask, "response_ids": gen.response_ids}
    with torch.no_grad():
        logits = _response_logits(trainer, batch)
    m = gen.response_mask
    exp = _reference_truncated(logits, gen.response_ids, 0.9, top_p).float()
    full = torch.log_softmax(logits / 0.9, -1).gather(-1, gen.response_ids[..., None])[..., 0]
    assert (exp[m] - full[m]).abs().max() > 1e-2  # truncation matters in this setting
    torch.testing.assert_close(gen.logprobs[m], exp[m], atol=1e-4, rtol=1e-4)
    old = trainer.logprobs(batch)
    torch.testing.assert_close(old[m], exp[m], atol=1e-4, rtol=1e-4)
    assert float((old[m] - gen.logprobs[m]).abs().max()) < 1e-4


def test_truncated_importance_sampling_weights_and_loss():
    old = torch.tensor([[0.0, -1.0, -2.0]])
    rollout = torch.tensor([[-1.0, -1.0, 0.0]])
    w = rollout_is_weights(old, rollout, 2.0)
    torch.testing.assert_close(w, torch.tensor([[2.0, 1.0, math.exp(-2.0)]]))
    mask = torch.ones(1, 3, dtype=torch.bool)
    adv = torch.tensor([[1.0, -2.0, 0.5]])
    logp = old.clone().requires_grad_(True)
    plain, _ = policy_loss(logp, old, adv, mask)
    weighted, metrics = policy_loss(logp, old, adv, mask, weights=w)
    # at the first update the ratio is 1: the per-token loss is -A, weighted by w
    torch.testing.assert_close(weighted, -(adv * w).mean())
    torch.testing.assert_close(plain, -adv.mean())
    torch.testing.assert_close(metrics["is_weight_mean"], w.mean())


# --- the actor reports the mismatch and applies the correction ------------------------------


def _cfg(**algo) -> TrainerConfig:
    return TrainerConfig.model_validate(
        {
            "algorithm": {"advantageEstimator": "grpo", **algo},
            "data": {
                "rolloutBatchSize": 3,
                "samplesPerPrompt": 4,
                "maxResponseLength": 8,
                "topP": 0.7,
            },
            "training": {"steps": 1, "learningRate": 1e-3, "seed": 3},
        }
    )


def test_actor_reports_the_mismatch_and_weighs_the_loss_by_capped_ratios(ray_session):
    from ppojob_trainer.tasks import make_task
    from ppojob_trainer.workers.actor import ActorWorker
    from ppojob_trainer.workers.rollout import RolloutWorker

    cfg = _cfg()
    path = models.resolve_model_path(cfg.model.path, cfg.training.seed)
    rollout = RolloutWorker(cfg, ShardIdentity("rollout"), path, "cpu")
    examples = make_task(cfg.data.prompts).sample(cfg.data.rollout_batch_size, random.Random(0))
    batch, _ = rollout.generate(examples, 0, seed=0)
    n = cfg.data.samples_per_step
    batch["scores"] = torch.arange(n, dtype=torch.float32) % 3  # advantages that are not all 0
    m = batch["response_mask"]

    actor = ActorWorker(cfg, ShardIdentity("actor"), path, "cpu", None)
    _, metrics = actor.prepare([(0, n, ray.put(batch))], None, None, 0.0)
    assert metrics["logprob_diff_max"] < 1e-4  # same model, same truncated distribution
    plain = actor.train(0)["actor/pg_loss"]

    # an engine whose log-probs are 1 nat lower: pi_old / pi_rollout = e, capped at 1.5
    shifted = dict(batch, rollout_logprobs=torch.where(m, batch["rollout_logprobs"] - 1.0, 0.0))
    tis = ActorWorker(_cfg(tisCap=1.5), ShardIdentity("actor"), path, "cpu", None)
    _, metrics = tis.prepare([(0, n, ray.put(shifted))], None, None, 0.0)
    assert abs(metrics["logprob_diff_sum"] / float(m.sum()) - 1.0) < 1e-4
    assert abs(metrics["logprob_diff_max"] - 1.0) < 1e-4
    out = tis.train(0)
    assert abs(plain) > 1e-4
    assert out["actor/pg_loss"] == pytest.approx(1.5 * plain, rel=1e-4)
    assert out["actor/is_weight_mean"] == pytest.approx(1.5)


def _response_logits(trainer, batch):
    """Full-vocabulary logits at the response positions, from the policy's HF model on the
    backend's own inputs (the backend itself never materialises them)."""
    from ppojob_trainer.backends.torch_backend.common import full_inputs

    ids, attn, pos, plen = full_inputs(batch)
    out = trainer.lm(input_ids=ids, attention_mask=attn, position_ids=pos).logits
    return out[:, plen - 1 : plen - 1 + batch["response_ids"].shape[1]].float()
