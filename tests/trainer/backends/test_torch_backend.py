"""The torch backend without Ray: KV-cache sampling, log-probs, updates, weight sync."""

from __future__ import annotations

import pytest
import torch

from ppojob_api.training import TrainingSettings
from ppojob_trainer import models
from ppojob_trainer.backends.torch_backend.common import lr_factor, top_p_filter
from ppojob_trainer.backends.torch_backend.generation import TorchGenerationEngine
from ppojob_trainer.backends.torch_backend.policy import TorchPolicyTrainer
from ppojob_trainer.backends.torch_backend.value import TorchValueTrainer


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
    trainer = TorchPolicyTrainer(
        model_dir,
        "float32",
        _settings(),
        total_updates=1,
        temperature=temperature,
        need_reference=False,
    )
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
    trainer = TorchPolicyTrainer(
        model_dir, "float32", _settings(), total_updates=10, temperature=1.0, need_reference=True
    )
    batch = {
        "prompt_ids": ids,
        "prompt_mask": mask,
        "response_ids": gen.response_ids,
        "response_mask": gen.response_mask,
    }

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
    batch = {
        "prompt_ids": ids,
        "prompt_mask": mask,
        "response_ids": resp,
        "response_mask": rmask,
        "returns": torch.full((16, 8), 0.5),
    }

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
    s = TrainingSettings(
        learning_rate=1.0, lr_warmup_steps=2, lr_scheduler="cosine", min_learning_rate=0.1
    )
    assert [lr_factor(i, s, 12) for i in (0, 1)] == [0.5, 1.0]
    assert lr_factor(2, s, 12) == pytest.approx(1.0)
    assert lr_factor(12, s, 12) == pytest.approx(0.1)
    lin = TrainingSettings(learning_rate=1.0, lr_scheduler="linear")
    assert lr_factor(5, lin, 10) == pytest.approx(0.5)
    assert lr_factor(5, TrainingSettings(learning_rate=1.0), 10) == 1.0


def test_warmup_stable_decay():
    """lrDecaySteps: the peak holds until the last N updates, which decay to the floor; without
    it the decay spans every update after the warmup (unchanged)."""
    kw = {"learning_rate": 1.0, "lr_warmup_steps": 2, "min_learning_rate": 0.1}
    wsd = TrainingSettings(**kw, lr_scheduler="linear", lr_decay_steps=4)
    factors = [lr_factor(i, wsd, 12) for i in range(13)]
    assert factors[:2] == [0.5, 1.0]
    assert factors[2:8] == [1.0] * 6  # stable
    assert factors[8:] == pytest.approx([1.0, 0.775, 0.55, 0.325, 0.1])  # linear over 4
    cos = TrainingSettings(**kw, lr_scheduler="cosine", lr_decay_steps=4)
    assert lr_factor(10, cos, 12) == pytest.approx(0.55)  # half-way down the cosine
    # longer than the run after the warmup: the whole post-warmup decay, as without it
    full = TrainingSettings(**kw, lr_scheduler="cosine")
    long = TrainingSettings(**kw, lr_scheduler="cosine", lr_decay_steps=100)
    assert [lr_factor(i, long, 12) for i in range(13)] == [
        lr_factor(i, full, 12) for i in range(13)
    ]


@pytest.mark.parametrize("agg", ["token-mean", "seq-mean-token-mean"])
def test_micro_batches_of_unequal_token_counts_give_the_full_batch_gradient(model_dir, tok, agg):
    """Gradient accumulation over micro-batches with 1 and 11 response tokens (1 and 2 non-empty
    samples) equals one pass over the whole mini-batch: the loss is the mean over the whole
    mini-batch, not a mean of the micro-batch means."""
    from ppojob_trainer.algorithms import policy_loss

    ids, mask = _prompts(tok, ["1", "2", "3", "4"])
    g = torch.Generator().manual_seed(0)
    resp = torch.randint(4, 14, (4, 6), generator=g)
    rmask = torch.arange(6)[None, :] < torch.tensor([1, 0, 6, 5])[:, None]
    batch = {
        "prompt_ids": ids,
        "prompt_mask": mask,
        "response_ids": resp,
        "response_mask": rmask,
        "old_logprobs": -torch.rand(4, 6, generator=g) * 3,
        "advantages": torch.randn(4, 6, generator=g),
    }

    def loss_fn(logp, ent, mb):
        loss, _ = policy_loss(
            logp,
            mb["old_logprobs"],
            mb["advantages"],
            mb["response_mask"],
            agg=agg,
            entropy=ent,
            entropy_coef=0.01,
        )
        return loss, {}

    grads = []
    for micro in (4, 2):
        trainer = TorchPolicyTrainer(
            model_dir,
            "float32",
            _settings(),
            total_updates=1,
            temperature=1.0,
            need_reference=False,
        )

        def capture(trainer=trainer):
            grads.append([p.grad.clone() for p in trainer.opt.params])
            return {}

        trainer.opt.step = capture
        trainer.update(batch, loss_fn, micro_batch_size=micro, agg=agg)
    (whole, parts) = grads
    assert any(float(g.abs().sum()) > 0 for g in whole)
    for a, b in zip(whole, parts, strict=True):
        torch.testing.assert_close(b, a, atol=1e-6, rtol=1e-5)


def test_accumulation_weights_scale_by_global_count_and_dp():
    from ppojob_trainer.backends.torch_backend.optimiser import accumulation_weights

    # this worker: micro-batches of 3 and 11 tokens; both workers together: 20 tokens
    assert accumulation_weights([3, 11], 20, 2) == pytest.approx([0.3, 1.1])
    assert accumulation_weights([3, 11], 14, 1) == pytest.approx([3 / 14, 11 / 14])
    with pytest.raises(ValueError, match="no unit"):
        accumulation_weights([0], 0, 1)


def test_logprobs_and_values_run_in_eval_mode_and_updates_in_train_mode(model_dir, tok):
    """Old/ref log-probs and the values for the advantages are computed without dropout (eval
    mode); the updates train in train mode."""
    ids, mask = _prompts(tok, ["5"] * 4)
    resp = torch.randint(4, 14, (4, 3))
    batch = {
        "prompt_ids": ids,
        "prompt_mask": mask,
        "response_ids": resp,
        "response_mask": torch.ones(4, 3, dtype=torch.bool),
    }
    policy = TorchPolicyTrainer(
        model_dir, "float32", _settings(), total_updates=1, temperature=1.0, need_reference=True
    )
    critic = TorchValueTrainer(model_dir, "float32", _settings(), total_updates=1, seed=0)
    modes: list[tuple[str, bool]] = []
    for name, module in (
        ("policy", policy.model),
        ("ref", policy.reference),
        ("critic", critic.model),
    ):
        module.register_forward_pre_hook(lambda m, _a, name=name: modes.append((name, m.training)))
    policy.logprobs(batch)
    policy.logprobs(batch, reference=True)
    critic.values(batch)
    assert modes == [("policy", False), ("ref", False), ("critic", False)]
    modes.clear()
    policy.update(batch, lambda logp, ent, mb: (-logp.mean(), {}), micro_batch_size=4)
    critic.update(batch, lambda v, mb: ((v**2).mean(), {}), micro_batch_size=4)
    assert modes == [("policy", True), ("critic", True)]


@pytest.mark.parametrize("entropy_grad", [False, True])
def test_entropy_has_a_graph_only_when_the_loss_uses_it(model_dir, tok, entropy_grad):
    ids, mask = _prompts(tok, ["6"] * 2)
    batch = {
        "prompt_ids": ids,
        "prompt_mask": mask,
        "response_ids": torch.randint(4, 14, (2, 3)),
        "response_mask": torch.ones(2, 3, dtype=torch.bool),
    }
    policy = TorchPolicyTrainer(
        model_dir,
        "float32",
        _settings(),
        total_updates=1,
        temperature=1.0,
        need_reference=False,
        entropy_grad=entropy_grad,
    )
    seen = []

    def loss_fn(logp, ent, mb):
        seen.append(ent.requires_grad)
        return -logp.mean(), {"entropy": float(ent.detach().mean())}

    metrics = policy.update(batch, loss_fn, micro_batch_size=2)
    assert seen == [entropy_grad] and metrics["entropy"] > 0
