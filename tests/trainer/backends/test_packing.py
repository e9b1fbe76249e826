"""Packed micro-batches and token-budget micro-batches in the torch backend: the same log-probs,
values, losses and gradients as padded ones (fp32), on mixed lengths, on tiny random-init HF
models (no downloads)."""

from __future__ import annotations

import pytest
import torch

from ppojob_api.training import TrainingSettings
from ppojob_trainer import models
from ppojob_trainer.algorithms import value_loss
from ppojob_trainer.backends.torch_backend.packing import (
    micro_batch_rows,
    pack_rows,
    split_to_count,
)
from ppojob_trainer.backends.torch_backend.policy import TorchPolicyTrainer
from ppojob_trainer.backends.torch_backend.value import TorchValueTrainer
from tests.helpers.batches import PROMPT_LENS, RESPONSE_LENS
from tests.helpers.batches import mixed_batch as _batch
from tests.helpers.batches import ppo_policy_loss as _policy_loss


@pytest.fixture(scope="module", params=["tiny-llama", "tiny-qwen2"])
def model_dir(request, tmp_path_factory):
    return models.materialize_builtin(request.param, 5, tmp_path_factory.mktemp("cache"))


def _settings(**kw):
    return TrainingSettings(learning_rate=1e-2, **kw)


def _policy(model_dir, **kw):
    return TorchPolicyTrainer(
        model_dir,
        "float32",
        _settings(**kw),
        total_updates=1,
        temperature=0.7,
        need_reference=True,
        entropy_grad=True,
    )


def _capture_grads(trainer, into):
    def capture():
        into.append([p.grad.clone() for p in trainer.opt.params])
        return {}

    trainer.opt.step = capture


def _value_loss(values, mb):
    loss, _ = value_loss(values, mb["old_values"], mb["returns"], mb["response_mask"], 0.2)
    return loss, {"loss": loss.detach()}


def test_pack_rows_restarts_positions_and_points_at_each_response_token():
    batch = _batch()
    ids, pos, select, rows, cols = pack_rows(batch)
    assert ids.shape == (1, sum(PROMPT_LENS) + sum(RESPONSE_LENS))
    starts = (pos[0] == 0).nonzero().flatten().tolist()
    assert starts == [0, 10, 11, 18, 29]  # 3+7, 1+0, 5+2, 2+9
    # the hidden state at select[k] predicts the token right after it
    assert torch.equal(ids[0, select + 1], batch["response_ids"][rows, cols])
    assert torch.equal(batch["response_mask"][rows, cols], torch.ones(len(rows), dtype=torch.bool))


@pytest.mark.parametrize("micro", [5, 2])
def test_packed_and_padded_policy_agree(model_dir, micro):
    """Log-probs (policy and reference), the loss and its gradient (with an entropy bonus)."""
    batch = _batch()
    mask = batch["response_mask"]
    out = {}
    for packing in (False, True):
        trainer = _policy(model_dir, packing=packing, micro_batch_size=micro)
        grads: list = []
        _capture_grads(trainer, grads)
        logp = trainer.logprobs(batch)
        ref = trainer.logprobs(batch, reference=True)
        metrics = trainer.update(batch, _policy_loss, micro)
        out[packing] = (logp, ref, metrics["loss"], grads[0])
    (lp0, ref0, loss0, g0), (lp1, ref1, loss1, g1) = out[False], out[True]
    assert (lp1[~mask] == 0).all()
    torch.testing.assert_close(lp1[mask], lp0[mask], atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(ref1[mask], ref0[mask], atol=1e-5, rtol=1e-5)
    assert loss1 == pytest.approx(loss0, abs=1e-6)
    assert any(float(g.abs().sum()) > 0 for g in g0)
    for a, b in zip(g0, g1, strict=True):
        torch.testing.assert_close(b, a, atol=1e-6, rtol=1e-4)


def test_packed_and_padded_values_agree(model_dir):
    batch = _batch()
    mask = batch["response_mask"]
    out = {}
    for packing in (False, True):
        critic = TorchValueTrainer(
            model_dir, "float32", _settings(packing=packing), total_updates=1, seed=3
        )
        grads: list = []
        _capture_grads(critic, grads)
        values = critic.values(batch)
        metrics = critic.update(batch, _value_loss, 2)
        out[packing] = (values, metrics["loss"], grads[0])
    (v0, l0, g0), (v1, l1, g1) = out[False], out[True]
    torch.testing.assert_close(v1[mask], v0[mask], atol=1e-5, rtol=1e-5)
    assert l1 == pytest.approx(l0, abs=1e-6)
    for a, b in zip(g0, g1, strict=True):
        torch.testing.assert_close(b, a, atol=1e-6, rtol=1e-4)


@pytest.mark.parametrize("packing", [False, True])
def test_token_budget_micro_batches_give_the_one_micro_batch_gradient(model_dir, packing):
    """Skewed lengths (one sample of 40 tokens among short ones) split by a token budget into
    several micro-batches of different sizes: the accumulated gradient equals the gradient of
    the whole mini-batch in one micro-batch (the loss normalisation is unchanged)."""
    batch = _batch([2, 3, 1, 4, 2, 3], [38, 2, 5, 1, 3, 6], seed=1)
    budget = 40
    rows = micro_batch_rows(batch, budget, packing=packing, max_rows=None)
    assert len(rows) >= 2 and sorted(torch.cat(rows).tolist()) == list(range(6))
    grads: list = []
    for kw in ({}, {"max_tokens_per_micro_batch": budget}):
        trainer = _policy(model_dir, packing=packing, **kw)
        _capture_grads(trainer, grads)
        trainer.update(batch, _policy_loss, 6)
    for a, b in zip(grads[0], grads[1], strict=True):
        torch.testing.assert_close(b, a, atol=1e-6, rtol=1e-4)
    # the no-grad forwards under the budget: same values in the batch's row order
    whole = _policy(model_dir, packing=packing).logprobs(batch)
    split = _policy(model_dir, packing=packing, max_tokens_per_micro_batch=budget).logprobs(batch)
    mask = batch["response_mask"]
    torch.testing.assert_close(split[mask], whole[mask], atol=1e-5, rtol=1e-5)


def test_token_budget_bins_fit_and_a_longer_sequence_names_the_field():
    batch = _batch([2, 3, 1, 4, 2, 3], [38, 2, 5, 1, 3, 6])
    tokens = (batch["prompt_mask"].sum(1) + batch["response_mask"].sum(1)).tolist()
    packed = micro_batch_rows(batch, 40, packing=True, max_rows=None)
    assert all(sum(tokens[i] for i in b.tolist()) <= 40 for b in packed)
    assert len(packed) == 2  # 40 | 5+6+6+9+5 = 31
    padded = micro_batch_rows(batch, 40, packing=False, max_rows=None)
    for b in padded:
        p = int(batch["prompt_mask"][b].sum(1).max())
        r = int(batch["response_mask"][b].sum(1).max())
        assert len(b) * (p + r) <= 40
    capped = micro_batch_rows(batch, 40, packing=True, max_rows=2)
    assert max(len(b) for b in capped) == 2
    with pytest.raises(ValueError, match="maxTokensPerMicroBatch: a sequence of 40 tokens"):
        micro_batch_rows(batch, 39, packing=True, max_rows=None)
    split = split_to_count([torch.tensor([0, 1, 2, 3]), torch.tensor([4])], 4)
    assert len(split) == 4 and sorted(torch.cat(split).tolist()) == [0, 1, 2, 3, 4]
    with pytest.raises(ValueError, match="maxTokensPerMicroBatch"):
        split_to_count([torch.tensor([0])], 2)


def test_packing_refuses_a_model_that_builds_its_own_attention_mask(model_dir):
    from torch import nn

    from ppojob_trainer.backends.torch_backend.packing import check_packing_support

    check_packing_support(models.load_causal_lm(model_dir))  # transformers' masking utilities
    with pytest.raises(ValueError, match="set packing: false"):
        check_packing_support(nn.Linear(2, 2))
