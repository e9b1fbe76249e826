"""The torch backend off the CPU fast path: device placement, mixed precision, bounded memory,
Hugging Face export. The device test runs the model on torch's ``meta`` device (shapes only,
no data), which catches every tensor left on the CPU by a forward, a loss or an optimizer step.
"""

from __future__ import annotations

import pytest
import torch

from ppojob_api.checks import check_training_half
from ppojob_api.training import TrainerConfig, TrainingHalf, TrainingSettings
from ppojob_trainer import algorithms as A
from ppojob_trainer import models
from ppojob_trainer.backends.torch_backend.common import token_logprobs
from ppojob_trainer.backends.torch_backend.memory import chunked_logprobs, trim_padding
from ppojob_trainer.backends.torch_backend.policy import TorchPolicyTrainer
from ppojob_trainer.backends.torch_backend.value import TorchValueTrainer
from ppojob_trainer.distributed import ShardIdentity


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return models.materialize_builtin("tiny-llama", 5, tmp_path_factory.mktemp("cache"))


def _batch(n: int = 4, seed: int = 0, t: int = 6) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    lengths = torch.tensor([1, 3, t, 2] * (n // 4))
    return {
        "prompt_ids": torch.randint(4, 14, (n, 3), generator=g),
        "prompt_mask": torch.ones(n, 3, dtype=torch.bool),
        "response_ids": torch.randint(4, 14, (n, t), generator=g),
        "response_mask": torch.arange(t)[None, :] < lengths[:, None],
        "old_logprobs": -torch.rand(n, t, generator=g) * 3,
        "ref_logprobs": -torch.rand(n, t, generator=g) * 3,
        "advantages": torch.randn(n, t, generator=g),
        "scores": torch.rand(n, generator=g),
        "group_ids": torch.arange(n) // 2,
        "sample_idx": torch.arange(n),
    }


def test_a_whole_actor_and_critic_update_with_the_models_off_the_cpu(model_dir, monkeypatch):
    """The actor worker's real loss (PPO clip, KL loss, entropy) and a critic update run with
    the models on another device: every mini-batch tensor must reach that device."""
    from transformers import masking_utils

    from ppojob_trainer.workers.actor import ActorWorker

    # transformers probes position ids for packed sequences with a data-dependent `.all()`,
    # which a shapes-only tensor cannot answer; our batches are never packed.
    monkeypatch.setattr(masking_utils, "find_packed_sequence_indices", lambda _pos: None)

    cfg = TrainerConfig.model_validate(
        {
            "data": {"rolloutBatchSize": 2, "samplesPerPrompt": 2},
            "algorithm": {
                "advantageEstimator": "grpo",
                "entropyCoefficient": 0.01,
                "kl": {"coefficient": 0.1, "mode": "loss", "estimator": "k3"},
            },
            "training": {"microBatchSize": 2},
        }
    )
    actor = ActorWorker(cfg, ShardIdentity("actor"), model_dir, "meta", None)
    assert next(actor.trainer.model.parameters()).device.type == "meta"
    actor.batch = _batch()
    metrics = actor.train(step=0)
    assert {"actor/pg_loss", "actor/kl_loss", "actor/grad_norm", "actor/lr"} <= set(metrics)
    assert all(p.device.type == "meta" for p in actor.trainer.opt.params)
    assert all(
        s["exp_avg"].device.type == "meta" for s in actor.trainer.opt.optimizer.state.values()
    )

    critic = TorchValueTrainer(
        model_dir, "float32", cfg.training, total_updates=1, seed=0, device="meta"
    )
    batch = {k: v for k, v in _batch().items() if k.startswith(("prompt", "response"))}
    batch["old_values"] = torch.zeros(4, 6)
    batch["returns"] = torch.ones(4, 6)

    def value_loss(values, mb):
        loss, m = A.value_loss(values, mb["old_values"], mb["returns"], mb["response_mask"], 0.2)
        return loss, {f"critic/{k}": v for k, v in m.items()}

    out = critic.update(batch, value_loss, micro_batch_size=2)
    assert "grad_norm" in out and next(critic.model.parameters()).device.type == "meta"


def _frac_changed(before: dict[str, torch.Tensor], module: torch.nn.Module) -> float:
    changed = total = 0
    for name, p in module.named_parameters():
        changed += int((p.detach() != before[name]).sum())
        total += p.numel()
    return changed / total


def test_bfloat16_trains_float32_masters_and_computes_in_bfloat16(model_dir):
    """lr 1e-6, three AdamW steps: with float32 master weights nearly every element moves (pure
    bfloat16 parameters round most such updates away); the matmuls run in bfloat16."""
    settings = TrainingSettings(learning_rate=1e-6, grad_clip=None)
    policy = TorchPolicyTrainer(
        model_dir, "bfloat16", settings, total_updates=3, temperature=1.0, need_reference=True
    )
    assert all(p.dtype == torch.float32 for p in policy.opt.params)
    assert all(p.dtype == torch.bfloat16 for p in policy.reference.parameters())
    seen = []
    policy.lm.model.layers[0].mlp.down_proj.register_forward_hook(
        lambda _m, _i, out: seen.append(out.dtype)
    )
    before = {n: p.detach().clone() for n, p in policy.model.named_parameters()}
    batch = _batch(8)

    def loss_fn(logp, ent, mb):
        loss, m = A.policy_loss(logp, mb["old_logprobs"], mb["advantages"], mb["response_mask"])
        return loss, m

    for _ in range(3):
        policy.update(batch, loss_fn, micro_batch_size=4)
    assert _frac_changed(before, policy.model) >= 0.99
    assert seen and set(seen) == {torch.bfloat16}
    weights = policy.export_weights()  # the rollout engines get the compute dtype
    assert {v.dtype for v in weights.values()} == {torch.bfloat16}


def test_float16_is_rejected_for_the_torch_trainers():
    half = TrainingHalf.model_validate({"model": {"dtype": "float16"}})
    problems = check_training_half(half)
    assert [p.path for p in problems] == ["spec.model.dtype"]
    assert "bfloat16" in problems[0].fix
    assert not check_training_half(TrainingHalf.model_validate({"model": {"dtype": "bfloat16"}}))


def test_chunked_logprobs_equal_the_full_logits_with_the_same_gradients():
    torch.manual_seed(0)
    head = torch.nn.Linear(8, 11, bias=False)
    hidden = torch.randn(3, 5, 8, requires_grad=True)
    tokens = torch.randint(0, 11, (3, 5))
    full = torch.log_softmax(head(hidden) / 0.7, -1)
    ref_lp = full.gather(-1, tokens[..., None]).squeeze(-1)
    ref_ent = -(full.exp() * full).sum(-1)
    (ref_lp.sum() + ref_ent.sum()).backward()
    ref_grads = hidden.grad.clone(), head.weight.grad.clone()
    hidden.grad = head.weight.grad = None
    lp, ent = chunked_logprobs(
        hidden, head, tokens, 0.7, want_entropy=True, entropy_grad=True, chunk_tokens=4
    )
    torch.testing.assert_close(lp, ref_lp)
    torch.testing.assert_close(ent, ref_ent)
    (lp.sum() + ent.sum()).backward()
    torch.testing.assert_close(hidden.grad, ref_grads[0])
    torch.testing.assert_close(head.weight.grad, ref_grads[1])
    torch.testing.assert_close(token_logprobs(head(hidden) / 1.0, tokens, 0.7), ref_lp)


def test_trim_padding_keeps_only_the_longest_prompt_and_response():
    b = _batch()
    b["response_mask"][:, 4:] = False
    b["prompt_mask"][:, 0] = False
    out, width = trim_padding(b)
    assert width == 6
    assert out["response_ids"].shape == (4, 4) and out["advantages"].shape == (4, 4)
    assert out["prompt_ids"].shape == (4, 2) and out["scores"].shape == (4,)


def test_forwards_without_gradient_run_in_micro_batches_padded_to_their_longest(model_dir):
    settings = TrainingSettings(forward_micro_batch_size=2)
    policy = TorchPolicyTrainer(
        model_dir, "float32", settings, total_updates=1, temperature=1.0, need_reference=False
    )
    whole = TorchPolicyTrainer(
        model_dir,
        "float32",
        TrainingSettings(),
        total_updates=1,
        temperature=1.0,
        need_reference=False,
    )
    critic = TorchValueTrainer(model_dir, "float32", settings, total_updates=1, seed=0)
    shapes: list[tuple[int, ...]] = []
    for module in (policy.lm.model, critic.model.backbone):
        module.register_forward_pre_hook(
            lambda _m, _a, kw: shapes.append(tuple(kw["input_ids"].shape)), with_kwargs=True
        )
    batch = _batch()  # response lengths 1, 3, 6, 2 (of 6 columns)
    logp = policy.logprobs(batch)
    assert shapes == [(2, 3 + 3), (2, 3 + 6)]
    m = batch["response_mask"]
    torch.testing.assert_close(logp[m], whole.logprobs(batch)[m], atol=1e-5, rtol=1e-5)
    assert logp.shape == (4, 6) and (logp[:, 3:][:2] == 0).all()  # past the micro-batch's end
    shapes.clear()
    assert critic.values(batch).shape == (4, 6)
    assert shapes == [(2, 3 + 3), (2, 3 + 6)]


def test_gradient_checkpointing_gives_the_same_update(model_dir):
    batch = _batch()
    results = []
    for ckpt in (False, True):
        settings = TrainingSettings(learning_rate=1e-3, gradient_checkpointing=ckpt)
        policy = TorchPolicyTrainer(
            model_dir, "float32", settings, total_updates=1, temperature=1.0, need_reference=False
        )
        policy.update(batch, lambda logp, ent, mb: (-(logp * mb["response_mask"]).sum(), {}), 4)
        results.append(policy.export_weights())
    for k, v in results[0].items():
        torch.testing.assert_close(results[1][k], v, atol=1e-6, rtol=1e-5)


def test_hugging_face_export_of_actor_and_critic_loads_back(model_dir, tmp_path):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    settings = TrainingSettings(learning_rate=1e-2)
    policy = TorchPolicyTrainer(
        model_dir, "float32", settings, total_updates=1, temperature=1.0, need_reference=False
    )
    critic = TorchValueTrainer(model_dir, "float32", settings, total_updates=1, seed=3)
    batch = _batch()
    policy.update(batch, lambda logp, ent, mb: (-(logp * mb["response_mask"]).sum(), {}), 4)
    batch["returns"] = torch.ones(4, 6)
    critic.update(batch, lambda v, mb: (((v - mb["returns"]) ** 2).mean(), {}), 4)
    leader = ShardIdentity("actor")
    policy.export_pretrained(tmp_path / "actor", leader)
    critic.export_pretrained(tmp_path / "critic", leader)

    loaded = AutoModelForCausalLM.from_pretrained(str(tmp_path / "actor"))
    trained = policy.export_weights()
    for k, v in loaded.state_dict().items():
        torch.testing.assert_close(v, trained[k])
    assert AutoTokenizer.from_pretrained(str(tmp_path / "actor")).pad_token == "<pad>"
    value_model = models.load_value_model(tmp_path / "critic", seed=99)  # head from the file
    torch.testing.assert_close(value_model.value_head.weight, critic.model.value_head.weight)
    ids = torch.cat([batch["prompt_ids"], batch["response_ids"]], 1)
    torch.testing.assert_close(value_model(ids), critic.model(ids))
