"""The torch backend without Ray: KV-cache sampling, log-probs, updates, weight sync."""

from __future__ import annotations

import pytest
import torch
from ppojob_trainer import models
from ppojob_trainer.backends.torch_backend import (
    TorchGenerationEngine,
    TorchPolicyTrainer,
    TorchValueTrainer,
    lr_factor,
    top_p_filter,
)
from ppojob_trainer.config import TrainingSettings


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return models.materialize_builtin("tiny-llama", 5, tmp_path_factory.mktemp("cache"))


@pytest.fixture(scope="module")
def tok(model_dir):
    return models.load_tokenizer(model_dir)


def _engine(model_dir, tok):
    return TorchGenerationEngine(model_dir, "float32", tok.all_special_ids, tok.pad_token_id)


def _prompts(tok, texts):
    enc = tok(texts, padding=True, return_tensors="pt")
    return enc["input_ids"], enc["attention_mask"].bool()


def _settings(**kw):
    return TrainingSettings(learning_rate=1e-2, **kw)


def test_generation_shapes_mask_and_determinism(model_dir, tok):
    engine = _engine(model_dir, tok)
    ids, mask = _prompts(tok, ["3"] * 64)
    kw = dict(max_new_tokens=8, temperature=1.0, top_p=1.0)
    a = engine.generate(ids, mask, seed=1, **kw)
    b = engine.generate(ids, mask, seed=1, **kw)
    c = engine.generate(ids, mask, seed=2, **kw)
    assert a.response_ids.shape[0] == 64 and a.response_ids.shape[1] <= 8
    assert torch.equal(a.response_ids, b.response_ids) and torch.equal(a.logprobs, b.logprobs)
    assert not torch.equal(a.response_ids, c.response_ids)
    special = set(tok.all_special_ids)
    for row, m, n in zip(
        a.response_ids.tolist(), a.response_mask.tolist(), a.lengths.tolist(), strict=True
    ):
        stop = next((i for i, t in enumerate(row) if t in special and m[i]), None)
        expected = (stop + 1) if stop is not None else len(row)
        assert n == expected == sum(m)
        assert all(t == tok.pad_token_id for t in row[n:])
    assert (a.logprobs[~a.response_mask] == 0).all() and (a.logprobs[a.response_mask] < 0).all()


@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_rollout_logprobs_match_a_full_forward_with_left_padding(model_dir, tok, temperature):
    """The KV-cache loop and a plain forward of prompt + response agree, padded or not."""
    engine = _engine(model_dir, tok)
    ids, mask = _prompts(tok, ["1", "2345", "67", "890"] * 4)
    assert not mask.all()
    gen = engine.generate(ids, mask, max_new_tokens=6, temperature=temperature, top_p=1.0, seed=0)
    trainer = TorchPolicyTrainer(model_dir, "float32", _settings(), total_updates=1,
                                 temperature=temperature, need_reference=False)  # fmt: skip
    batch = {"prompt_ids": ids, "prompt_mask": mask, "response_ids": gen.response_ids}
    logp = trainer.logprobs(batch)
    m = gen.response_mask
    torch.testing.assert_close(logp[m], gen.logprobs[m], atol=1e-4, rtol=1e-4)


def test_top_p_keeps_the_smallest_nucleus():
    probs = torch.tensor([[0.5, 0.3, 0.15, 0.05]])
    assert torch.equal(top_p_filter(probs, 0.7), torch.tensor([[0.5, 0.3, 0.0, 0.0]]))
    assert torch.equal(top_p_filter(probs, 0.4), torch.tensor([[0.5, 0.0, 0.0, 0.0]]))
    assert torch.equal(top_p_filter(probs, 1.0), probs)


def test_policy_update_and_weight_sync(model_dir, tok):
    engine = _engine(model_dir, tok)
    ids, mask = _prompts(tok, ["4"] * 32)
    gen = engine.generate(ids, mask, max_new_tokens=8, temperature=1.0, top_p=1.0, seed=0)
    trainer = TorchPolicyTrainer(model_dir, "float32", _settings(), total_updates=10,
                                 temperature=1.0, need_reference=True)  # fmt: skip
    batch = {"prompt_ids": ids, "prompt_mask": mask, "response_ids": gen.response_ids,
             "response_mask": gen.response_mask}  # fmt: skip

    def loss_fn(logp, ent, mb):
        return -(logp[:, 0]).mean(), {"ent": float(ent.detach().mean())}

    before = trainer.logprobs(batch)[:, 0].mean()
    for _ in range(5):
        metrics = trainer.update(batch, loss_fn, micro_batch_size=8)
    assert set(metrics) >= {"ent", "grad_norm", "lr"}
    assert trainer.logprobs(batch)[:, 0].mean() > before
    ref = trainer.logprobs(batch, reference=True)
    assert not torch.allclose(ref, trainer.logprobs(batch))
    engine.update_weights(trainer.export_weights())
    gen2 = engine.generate(ids, mask, max_new_tokens=8, temperature=1.0, top_p=1.0, seed=3)
    batch2 = {"prompt_ids": ids, "prompt_mask": mask, "response_ids": gen2.response_ids}
    m = gen2.response_mask
    torch.testing.assert_close(trainer.logprobs(batch2)[m], gen2.logprobs[m], atol=1e-4, rtol=1e-4)
    with pytest.raises(ValueError, match="weights missing"):
        engine.update_weights({})


def test_value_trainer_fits_returns(model_dir, tok):
    ids, mask = _prompts(tok, ["7"] * 16)
    resp = torch.randint(4, 14, (16, 8))
    rmask = torch.ones(16, 8, dtype=torch.bool)
    critic = TorchValueTrainer(model_dir, "float32", _settings(), total_updates=50, seed=0)
    batch = {"prompt_ids": ids, "prompt_mask": mask, "response_ids": resp, "response_mask": rmask,
             "returns": torch.full((16, 8), 0.5)}  # fmt: skip

    def loss_fn(values, mb):
        loss = ((values - mb["returns"]) ** 2).mean()
        return loss, {"loss": float(loss.detach())}

    first = critic.update(batch, loss_fn, 16)["loss"]
    for _ in range(30):
        last = critic.update(batch, loss_fn, 8)["loss"]
    assert last < first / 10
    assert critic.values(batch).shape == (16, 8)
    state = critic.state_dict()
    critic.load_state_dict(state)


def test_lr_schedules():
    s = TrainingSettings(learning_rate=1.0, lr_warmup_steps=2, lr_scheduler="cosine",
                         min_learning_rate=0.1)  # fmt: skip
    assert [lr_factor(i, s, 12) for i in (0, 1)] == [0.5, 1.0]
    assert lr_factor(2, s, 12) == pytest.approx(1.0)
    assert lr_factor(12, s, 12) == pytest.approx(0.1)
    lin = TrainingSettings(learning_rate=1.0, lr_scheduler="linear")
    assert lr_factor(5, lin, 10) == pytest.approx(0.5)
    assert lr_factor(5, TrainingSettings(learning_rate=1.0), 10) == 1.0
