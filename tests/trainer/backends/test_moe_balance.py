"""The router load-balancing loss (``algorithm.routerAuxLossCoefficient``) on CPU: its value
against its definition and against transformers' own ``load_balancing_loss_func``, the torch
backend's updates lowering it, and the megatron router hook's shares under sequence
parallelism adding up to the whole sequence's loss (two gloo processes)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from ppojob_api.training import TrainingSettings
from ppojob_trainer import models
from ppojob_trainer.backends.torch_backend.moe import BalanceTap, balance_loss, balance_terms
from ppojob_trainer.backends.torch_backend.policy import TorchPolicyTrainer

HERE = Path(__file__).resolve().parent
ROOT = HERE.parents[2]


def test_uniform_routing_scores_one_and_crowded_routing_experts_over_k() -> None:
    experts, k, n = 8, 2, 64
    # every expert chosen equally often and equally probable: 1
    chosen = torch.arange(n * k).reshape(n, k) % experts
    probs = torch.full((n, experts), 1 / experts)
    assert float(balance_loss(*balance_terms(probs, chosen, None), k)) == pytest.approx(1.0)
    # every token to experts 0 and 1, with all the probability there: E / k
    crowded = torch.zeros(n, experts)
    crowded[:, :2] = 0.5
    pair = torch.tensor([[0, 1]]).expand(n, k)
    assert float(balance_loss(*balance_terms(crowded, pair, None), k)) == pytest.approx(4.0)
    # the tokens marked invalid count for nothing, whatever they hold
    mixed = torch.cat([probs, crowded])
    both = torch.cat([chosen, pair])
    valid = torch.arange(2 * n) < n
    assert float(balance_loss(*balance_terms(mixed, both, valid), k)) == pytest.approx(1.0)


@pytest.mark.parametrize("name", ["tiny-qwen3-moe", "tiny-mixtral"])
def test_the_tap_is_transformers_switch_loss_over_the_real_tokens(
    name: str, tmp_path: Path
) -> None:
    """A one-layer model with a left-padded batch: the tap's loss times k is transformers'
    ``load_balancing_loss_func`` of the router logits it returns under the attention mask
    (which, for one layer, normalises the choices by tokens instead of tokens x k)."""
    import importlib

    from transformers import AutoConfig, AutoModelForCausalLM

    src = models.materialize_builtin(name, 3, tmp_path / "cache")
    config = AutoConfig.from_pretrained(src)
    config.num_hidden_layers = 1
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config).eval()
    family = importlib.import_module(type(model).__module__).load_balancing_loss_func
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(3, 14, (3, 9), generator=g)
    mask = torch.ones_like(ids)
    mask[0, :4] = 0
    mask[2, :2] = 0
    tap = BalanceTap(model)
    with torch.enable_grad(), tap.collect(mask.bool().reshape(-1)):
        out = model(input_ids=ids, attention_mask=mask, output_router_logits=True)
    mine = tap.loss().detach()
    k = config.num_experts_per_tok
    experts = getattr(config, "num_experts", None) or config.num_local_experts
    ref = family(out.router_logits, experts, k, mask)
    assert float(mine) * k == pytest.approx(float(ref.detach()), rel=1e-5)
    # the padding changes the loss: the mask is what keeps it out
    with torch.enable_grad(), tap.collect(None):
        model(input_ids=ids, attention_mask=mask)
    assert abs(float(tap.loss().detach()) - float(mine)) > 1e-4


def test_torch_updates_with_the_loss_alone_balance_the_routers(tmp_path: Path) -> None:
    """Routers that crowd the tokens onto expert 0 (its router row set large), a zero policy
    loss and coefficient 1: the updates follow the load-balancing loss alone, and the loss they
    report falls from above 2 to near 1 (uniform). With coefficient 0 nothing moves and no
    balance is reported."""
    src = models.materialize_builtin("tiny-qwen3-moe", 7, tmp_path / "cache")
    g = torch.Generator().manual_seed(1)
    n, p, t = 8, 6, 6
    batch = {
        "prompt_ids": torch.randint(3, 14, (n, p), generator=g),
        "prompt_mask": torch.ones(n, p, dtype=torch.bool),
        "response_ids": torch.randint(3, 14, (n, t), generator=g),
        "response_mask": torch.ones(n, t, dtype=torch.bool),
    }
    batch["prompt_mask"][:3, :2] = False

    def zero(logp, ent, mb):  # type: ignore[no-untyped-def]
        return logp.sum() * 0.0, {}

    def trainer(coef: float) -> TorchPolicyTrainer:
        out = TorchPolicyTrainer(
            src,
            "float32",
            TrainingSettings(learningRate=0.003),
            total_updates=40,
            temperature=1.0,
            need_reference=False,
            router_aux_loss=coef,
        )
        crowd = torch.randn(64, generator=torch.Generator().manual_seed(2)).sign() * 0.3
        with torch.no_grad():
            for name, weight in out.lm.named_parameters():
                if name.endswith("mlp.gate.weight"):
                    weight[0] = crowd
        return out

    balanced = trainer(1.0)
    before = {k: v.clone() for k, v in balanced.lm.state_dict().items()}
    seen = [balanced.update(batch, zero, 4)["router_balance"] for _ in range(12)]
    assert seen[0] > 2.0, seen
    assert max(seen[-3:]) < 1.2, seen
    moved = [k for k, v in balanced.lm.state_dict().items() if not torch.equal(v, before[k])]
    assert any(k.endswith("mlp.gate.weight") for k in moved), moved

    plain = trainer(0.0)
    before = {k: v.clone() for k, v in plain.lm.state_dict().items()}
    metrics = plain.update(batch, zero, 4)
    assert "router_balance" not in metrics
    assert all(torch.equal(v, before[k]) for k, v in plain.lm.state_dict().items())


def test_the_loss_under_activation_checkpointing_is_the_loss_without(tmp_path: Path) -> None:
    """Recomputed blocks (gradient checkpointing) run the router hooks again in the backward
    pass: the update with the loss is the update without recomputation."""
    src = models.materialize_builtin("tiny-mixtral", 4, tmp_path / "cache")
    g = torch.Generator().manual_seed(3)
    n, p, t = 4, 5, 5
    batch = {
        "prompt_ids": torch.randint(3, 14, (n, p), generator=g),
        "prompt_mask": torch.ones(n, p, dtype=torch.bool),
        "response_ids": torch.randint(3, 14, (n, t), generator=g),
        "response_mask": torch.ones(n, t, dtype=torch.bool),
    }
    batch["prompt_mask"][0, :2] = False

    def loss_fn(logp, ent, mb):  # type: ignore[no-untyped-def]
        return -(logp * mb["response_mask"]).sum() / mb["response_mask"].sum(), {}

    weights, seen = [], []
    for recompute in (False, True):
        trainer = TorchPolicyTrainer(
            src,
            "float32",
            TrainingSettings(learningRate=0.01, gradientCheckpointing=recompute),
            total_updates=2,
            temperature=1.0,
            need_reference=False,
            router_aux_loss=0.5,
        )
        seen.append(trainer.update(batch, loss_fn, 2)["router_balance"])
        weights.append({k: v.clone() for k, v in trainer.lm.state_dict().items()})
    assert seen[0] == pytest.approx(seen[1], rel=1e-6)
    assert max(float((weights[0][k] - weights[1][k]).abs().max()) for k in weights[0]) < 1e-6


def test_sequence_parallel_shares_add_up_to_the_whole_sequence(tmp_path: Path) -> None:
    """megatron's router hook on two gloo ranks that each see half of the tokens (sequence
    parallelism): every rank reports the whole sequence's loss, and the gradients of the two
    ranks' shares sum to the gradient of the loss over all tokens on one rank
    (``megatron_balance_case.py``)."""
    out = tmp_path / "balance.json"
    env = {"PYTHONPATH": ":".join(str(ROOT / d) for d in ("api", "trainer", "operator", "."))}
    cmd = [sys.executable, str(HERE / "megatron_balance_case.py"), str(out)]
    proc = subprocess.run(
        cmd, capture_output=True, text=True, env={**os.environ, **env}, timeout=300, check=False
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    r = json.loads(out.read_text())
    assert r["whole"] > 1.0
    assert r["reported"] == pytest.approx([r["whole"], r["whole"]], rel=1e-6)
    assert r["shares_sum"] == pytest.approx(r["whole"], rel=1e-6)
    assert r["grad_max_abs"] < 1e-7 * r["grad_scale"], r
    assert r["grad_scale"] > 0
    # the counts' all-reduce was judged, its tensors placed for the group's device
    assert any(s.endswith(":ReplayTopK._balance_loss") for s in r["sites"]), r["sites"]
    assert r["violations"] == []


@pytest.mark.parametrize("loss_scale", [1.0, 8.0])
def test_megatrons_share_of_a_micro_batch_carries_its_weight_and_the_fp16_loss_scale(
    loss_scale: float,
) -> None:
    """``_Sharded._balance`` gives each router the coefficient times the micro-batch's loss
    weight over the layers, times the loss scale megatron-core's fp16 optimizer multiplies the
    main loss by (``config.grad_scale_func``: the aux gradient would otherwise be divided by it
    at the step); a filler micro-batch and one without a weight get none."""
    from types import SimpleNamespace

    from ppojob_trainer.backends.megatron_routing import ReplayTopK
    from ppojob_trainer.backends.megatron_sharded import _Sharded
    from ppojob_trainer.distributed import ShardIdentity

    m = _Sharded.__new__(_Sharded)
    m.shard, m.device, m.sequence_parallel = ShardIdentity("actor"), torch.device("cpu"), False
    m.router_aux_loss = 0.1
    m.shape = SimpleNamespace(layers=4)
    scaled = None if loss_scale == 1.0 else (lambda x: x * loss_scale)
    m.config = SimpleNamespace(grad_scale_func=scaled)
    routers = {0: ReplayTopK(), 1: ReplayTopK()}
    tokens = torch.tensor([[True, True, False]])
    assert m._balance(routers, {"_aux": (0.5, 1.0), "_tokens": tokens})
    for r in routers.values():
        assert r.scale == pytest.approx(0.1 * 0.5 / 4 * loss_scale)
        assert r.valid.tolist() == [True, True, False]
    for off in ({"_aux": (0.5, 1.0), "_tokens": tokens, "_filler": True}, {"_tokens": tokens}):
        assert not m._balance(routers, off)
        assert all(r.scale is None for r in routers.values())
