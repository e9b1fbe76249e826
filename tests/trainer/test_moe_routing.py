"""Mixture-of-experts routing replay on the tiny built-in MoE models (CPU).

The engine samples in bfloat16 (``model.dtype: bfloat16``, as a real engine serves), the actor
computes its log-probs from float32 master weights under bfloat16 autocast (the torch backend's
mixed precision): the same weights, different numerics. A router whose top-2 candidates are
close flips between the two (the mismatch MoE RL suffers at scale, from other kernels and batch
shapes). Replaying the engine's experts makes the actor's forward use exactly the engine's
choice, and the rollout/training log-prob mismatch falls.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from ppojob_api.training import TrainingSettings
from ppojob_trainer import models
from ppojob_trainer.backends.torch_backend.generation import TorchGenerationEngine
from ppojob_trainer.backends.torch_backend.memory import trim_padding
from ppojob_trainer.backends.torch_backend.moe import agreement, moe_routers, replay_choice
from ppojob_trainer.backends.torch_backend.policy import TorchPolicyTrainer, replay_layout
from ppojob_trainer.workers.actor import logprob_mismatch
from ppojob_trainer.workers.rollout import cat_batches

MOE = ("tiny-qwen3-moe", "tiny-mixtral")


@pytest.fixture(scope="module")
def cache(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("moe-cache")


def rollout(model_dir: Path, n: int = 48) -> dict[str, torch.Tensor]:
    """A bfloat16 engine's samples of prompts of 1 to 3 digits (left-padded), with the
    experts it routed every fed token to."""
    tok = models.load_tokenizer(model_dir)
    engine = TorchGenerationEngine(
        model_dir, "bfloat16", stop_ids=[2], pad_id=0, record_routing=True
    )
    prompts = [str(i % 10) * (1 + i % 3) for i in range(n)]
    enc = tok(prompts, return_tensors="pt", padding=True)
    gen = engine.generate(
        enc.input_ids,
        enc.attention_mask.bool(),
        max_new_tokens=10,
        temperature=1.0,
        top_p=1.0,
        seed=3,
    )
    assert gen.routed_experts is not None and gen.prompt_routed_experts is not None
    return {
        "prompt_ids": enc.input_ids,
        "prompt_mask": enc.attention_mask.bool(),
        "response_ids": gen.response_ids,
        "response_mask": gen.response_mask,
        "rollout_logprobs": gen.logprobs,
        "routed_experts": gen.routed_experts,
        "prompt_routed_experts": gen.prompt_routed_experts,
    }


def actor(model_dir: Path, replay: bool, packing: bool = False) -> TorchPolicyTrainer:
    return TorchPolicyTrainer(
        model_dir,
        "bfloat16",
        TrainingSettings(packing=packing),
        total_updates=1,
        temperature=1.0,
        need_reference=False,
        routing_replay=replay,
    )


def used_agreement(trainer: TorchPolicyTrainer, batch: dict[str, torch.Tensor]) -> float:
    """The share of the engine's token-layer choices the actor's last forward used."""
    tap = next(iter(trainer.taps.values()))
    recorded, valid = replay_layout(trim_padding(batch)[0], trainer.settings.packing)
    same, total = agreement(recorded, tap.stacked(tap.used, tuple(valid.shape)), valid)
    assert total > 0
    return same / total


@pytest.mark.parametrize("name", MOE)
def test_the_engine_records_the_experts_of_every_token_it_fed(name: str, cache: Path) -> None:
    path = models.materialize_builtin(name, 1, cache)
    batch = rollout(path)
    b, t = batch["response_ids"].shape
    p = batch["prompt_ids"].shape[1]
    assert batch["routed_experts"].shape == (b, t, 2, 2)
    assert batch["prompt_routed_experts"].shape == (b, p, 2, 2)
    assert batch["routed_experts"].dtype == torch.int16
    # every fed response token has 2 distinct experts of 8 in each layer; the last sampled
    # token of the longest row was never fed
    lengths = batch["response_mask"].sum(1)
    fed = torch.arange(t)[None] < (lengths[:, None] - 1)
    routes = batch["routed_experts"][fed]
    assert bool(((routes >= 0) & (routes < 8)).all())
    assert bool((routes[..., 0] != routes[..., 1]).all())
    assert bool((batch["routed_experts"][:, t - 1] == -1).all())


@pytest.mark.parametrize("name", MOE)
def test_replayed_routing_uses_the_engines_experts_and_lowers_the_mismatch(
    name: str, cache: Path
) -> None:
    path = models.materialize_builtin(name, 1, cache)
    batch = rollout(path)
    mask = batch["response_mask"]
    results = {}
    for replay in (False, True):
        trainer = actor(path, replay)
        logp = trainer.logprobs(batch)
        mism = logprob_mismatch(batch["rollout_logprobs"], logp, mask)
        results[replay] = (mism["logprob_diff_sum"] / float(mask.sum()), mism["logprob_diff_max"])
    stats = trainer.routing_stats()  # the replaying actor's
    own = stats["router_agree_sum"] / stats["router_choices"]
    assert 0.9 < own < 1.0  # its routers would choose otherwise for some tokens themselves
    assert used_agreement(trainer, batch) == 1.0  # it used exactly the engine's experts
    off, on = results[False], results[True]
    print(f"{name}: router agreement {own:.4f}; mismatch mean, max without replay {off}, with {on}")
    assert on[0] < off[0] and on[1] < off[1]


def test_packed_forwards_replay_the_same_experts(cache: Path) -> None:
    path = models.materialize_builtin("tiny-qwen3-moe", 1, cache)
    batch = rollout(path)
    padded = actor(path, replay=True)
    packed = actor(path, replay=True, packing=True)
    a, b = padded.logprobs(batch), packed.logprobs(batch)
    assert used_agreement(packed, batch) == 1.0
    mask = batch["response_mask"]
    torch.testing.assert_close(a[mask], b[mask], atol=2e-2, rtol=0)


def test_an_update_replays_in_its_forward_and_in_activation_checkpointings_recompute(
    cache: Path,
) -> None:
    """The update's forward uses the engine's experts and trains the routers; with activation
    checkpointing the backward pass recomputes the forward with the same replayed routing
    (the routing stays set after the forward), so both give the same new weights."""
    path = models.materialize_builtin("tiny-mixtral", 1, cache)
    batch = rollout(path)

    def loss_fn(logp, ent, mb):  # the PolicyLossFn shape
        m = mb["response_mask"]
        return -(logp * m).sum() / m.sum(), {}

    after = []
    for checkpointing in (False, True):
        trainer = TorchPolicyTrainer(
            path,
            "bfloat16",
            TrainingSettings(gradient_checkpointing=checkpointing),
            total_updates=1,
            temperature=1.0,
            need_reference=False,
            routing_replay=True,
        )
        batch["old_logprobs"] = trainer.logprobs(batch)
        before = {n: r.weight.detach().clone() for n, r in moe_routers(trainer.lm).items()}
        tap = next(iter(trainer.taps.values()))
        with tap.record():  # one micro-batch: the update's forward (and its recompute)
            trainer.update(batch, loss_fn, micro_batch_size=len(batch["prompt_ids"]))
        assert used_agreement(trainer, batch) == 1.0
        routers = moe_routers(trainer.lm)
        assert all(not torch.equal(before[n], routers[n].weight) for n in before)
        after.append(dict(trainer.lm.named_parameters()))
    for name, value in after[0].items():
        torch.testing.assert_close(after[1][name], value, rtol=0, atol=0, msg=name)


def test_a_replayed_choice_keeps_the_routers_gradient() -> None:
    from transformers import Qwen3MoeConfig
    from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeTopKRouter

    config = Qwen3MoeConfig(
        hidden_size=8, num_experts=4, num_experts_per_tok=2, norm_topk_prob=True
    )
    router = Qwen3MoeTopKRouter(config)
    torch.nn.init.normal_(router.weight)
    h = torch.randn(5, 8)
    logits, scores, index = router(h)
    forced = torch.tensor([[0, 1], [2, 3], [-1, -1], [3, 0], [1, 2]])
    _, weights, chosen = replay_choice(router, logits, scores, index, forced)
    assert torch.equal(chosen[[0, 1, 3, 4]], forced[[0, 1, 3, 4]])
    assert torch.equal(chosen[2], index[2])  # no record: the router's own choice
    torch.testing.assert_close(weights.sum(-1), torch.ones(5))  # norm_topk_prob
    probs = torch.softmax(logits, -1)
    torch.testing.assert_close(weights[1], probs[1, [2, 3]] / probs[1, [2, 3]].sum())
    weights[:, 0].sum().backward()
    assert router.weight.grad is not None and bool(router.weight.grad.abs().sum() > 0)


def test_routed_experts_pad_with_no_record_when_parts_join_and_trim_with_their_columns() -> None:
    def part(rows: int, plen: int, tlen: int) -> dict[str, torch.Tensor]:
        return {
            "prompt_ids": torch.ones(rows, plen, dtype=torch.long),
            "prompt_mask": torch.ones(rows, plen, dtype=torch.bool),
            "response_ids": torch.ones(rows, tlen, dtype=torch.long),
            "response_mask": torch.ones(rows, tlen, dtype=torch.bool),
            "routed_experts": torch.zeros(rows, tlen, 2, 2, dtype=torch.int16),
            "prompt_routed_experts": torch.zeros(rows, plen, 2, 2, dtype=torch.int16),
        }

    joined = cat_batches([part(1, 2, 3), part(1, 4, 5)])
    assert joined["routed_experts"].shape == (2, 5, 2, 2)
    assert bool((joined["routed_experts"][0, 3:] == -1).all())
    assert bool((joined["routed_experts"][0, :3] == 0).all())
    assert joined["prompt_routed_experts"].shape == (2, 4, 2, 2)
    assert bool((joined["prompt_routed_experts"][0, :2] == -1).all())  # left-padded
    # a micro-batch of the first row keeps its own widths for every tensor
    trimmed, _ = trim_padding({k: v[:1] for k, v in joined.items()})
    assert trimmed["prompt_routed_experts"].shape[:2] == trimmed["prompt_ids"].shape == (1, 2)
    assert trimmed["routed_experts"].shape[:2] == trimmed["response_ids"].shape == (1, 3)


def test_the_architectures_validation_accepts_are_the_ones_whose_routers_we_drive() -> None:
    from ppojob_api.checks.moe import REPLAY_MODEL_TYPES
    from ppojob_api.trainspec.constants import BUILTIN_MOE_MODELS

    types = set()
    for name, (experts, per_token) in BUILTIN_MOE_MODELS.items():
        model = models.build_builtin_model(name, 0)
        types.add(model.config.model_type)
        routers = moe_routers(model)
        assert sorted(routers) == [0, 1]
        assert {(r.num_experts, r.top_k) for r in routers.values()} == {(experts, per_token)}
    assert types == set(REPLAY_MODEL_TYPES)
    dense = moe_routers(models.build_builtin_model("tiny-llama", 0))
    assert dense == {}


def test_lora_replays_for_the_policy_and_its_base_model_reference(cache: Path) -> None:
    """With LoRA the reference is the base model (adapters off): one model, one set of
    routers, replayed in both forwards."""
    from ppojob_api.training import LoraSpec

    path = models.materialize_builtin("tiny-qwen3-moe", 1, cache)
    batch = rollout(path, n=16)
    trainer = TorchPolicyTrainer(
        path,
        "bfloat16",
        TrainingSettings(),
        total_updates=1,
        temperature=1.0,
        need_reference=True,
        lora=LoraSpec(rank=4),
        routing_replay=True,
    )
    old = trainer.logprobs(batch)
    assert used_agreement(trainer, batch) == 1.0
    tap = next(iter(trainer.taps.values()))
    with tap.record():
        ref = trainer.logprobs(batch, reference=True)
    assert used_agreement(trainer, batch) == 1.0
    torch.testing.assert_close(ref, old, rtol=0, atol=0)  # B = 0: the adapters add nothing


def test_a_weight_update_mid_generation_rerecords_the_tokens_so_far(cache: Path) -> None:
    """Partial rollout: new weights re-encode the prompt and the tokens so far; their
    routing under the new weights, which the KV cache of every later token holds, replaces
    the old one."""
    path = models.materialize_builtin("tiny-qwen3-moe", 1, cache)
    engine = TorchGenerationEngine(path, "float32", stop_ids=[2], pad_id=0, record_routing=True)
    other = models.build_builtin_model("tiny-qwen3-moe", 2).state_dict()
    ids = torch.tensor([[1, 5, 6], [0, 1, 7]])
    mask = ids != 0
    asked = []

    def interrupt():  # new weights before the third token
        asked.append(1)
        return (1, other) if len(asked) == 2 else None

    gen = engine.generate(
        ids, mask, max_new_tokens=6, temperature=1.0, top_p=1.0, seed=0, interrupt=interrupt
    )
    assert gen.versions is not None and gen.versions[0, 2] == 1
    # the routing of the new weights, recomputed in one forward over the whole sequence
    fresh = TorchGenerationEngine(path, "float32", stop_ids=[], pad_id=0, record_routing=True)
    fresh.update_weights(other)
    tap = fresh.tap
    assert tap is not None
    full = torch.cat([ids, gen.response_ids[:, :2]], 1)
    attn = torch.cat([mask, torch.ones(2, 2, dtype=torch.bool)], 1).long()
    with torch.no_grad(), tap.record():
        fresh.model(
            input_ids=full, attention_mask=attn, position_ids=(attn.cumsum(-1) - 1).clamp_min(0)
        )
    want = tap.stacked(tap.chosen, tuple(full.shape))
    got = torch.cat([gen.prompt_routed_experts, gen.routed_experts[:, :2]], 1)
    real = attn.bool()
    assert torch.equal(got[real], want[real])


@pytest.mark.parametrize("backend", ["sglang", "torch"])
def test_a_moe_actors_weights_reach_sglang_under_its_per_expert_names(backend: str) -> None:
    """SGLang's load_weights takes a MoE model's experts one tensor each (checkpoint names) and
    skips the fused names of transformers >= 5 without a word; the host hands an sglang engine
    the former (any actor backend: the megatron actor's family is the model type), a torch
    engine the model's own names."""
    import types
    from collections import deque

    from ppojob_api.training import TrainerConfig
    from ppojob_trainer.backends.sglang_backend import SGLANG_EXPERT_NAMES
    from ppojob_trainer.backends.weight_sync import WeightStream
    from ppojob_trainer.workers.host import WorkerHost

    lm = models.build_builtin_model("tiny-mixtral", 0)
    weights = {k: v.detach() for k, v in lm.state_dict().items()}
    cfg = TrainerConfig.model_validate({"roles": {"rollout": {"backend": backend}}})
    host = WorkerHost.__new__(WorkerHost)
    host.cfg, host.device, host.events = cfg, "cpu", deque()
    trainer = types.SimpleNamespace(
        lm=lm, export_weight_stream=lambda limit: WeightStream.of(weights, limit)
    )
    host.actor = types.SimpleNamespace(trainer=trainer)
    host._weights = host._staged = None
    stream = host._exported(1)
    got = {k: v for i in range(len(stream.plan)) for k, v in stream.bucket(i).items()}
    if backend == "torch":
        assert got.keys() == weights.keys()
        return
    block, (gate, up, down) = SGLANG_EXPERT_NAMES["mixtral"]
    assert "model.layers.0.mlp.experts.gate_up_proj" not in got
    fused = weights["model.layers.1.mlp.experts.gate_up_proj"]
    assert torch.equal(got[f"model.layers.1.{block}.experts.7.{gate}.weight"], fused[7, :64])
    assert torch.equal(got[f"model.layers.1.{block}.experts.7.{up}.weight"], fused[7, 64:])
    assert f"model.layers.0.{block}.experts.0.{down}.weight" in got
    assert sum(".experts." in k for k in got) == 2 * 8 * 3
