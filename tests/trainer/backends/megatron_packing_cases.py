"""Packed and token-budget micro-batches of the megatron backend against padded ones, on CPU.

Run as a script (``python megatron_packing_cases.py OUT.json MODEL_DIR``): 2 processes in one
gloo world; for each layout (tensor 2, pipeline 2) the megatron actor (with a reference) and
critic are built twice from the same weights, padded and packed (megatron-core's local
attention: a block-diagonal causal mask, rotary positions restarting per sequence), and run on
the same mixed-length batch (a sample without response among them): log-probs, reference
log-probs, values, one update's loss and the gradient it accumulated (each rank's local shard,
captured before the optimizer step). A third pair, on a batch with skewed lengths (one sample
of 40 tokens among short ones), compares the gradient of one whole-mini-batch micro-batch with
that of micro-batches sized by a 40-token budget, padded and packed (and their log-probs,
in the batch's row order). Rank 0 writes the max abs
differences as JSON (the worst rank's); ``test_megatron_packing.py`` asserts on them.
"""

from __future__ import annotations

import dataclasses
import json
import sys
import warnings
from pathlib import Path
from typing import Any

import torch
from megatron_cases import _cfg  # (this script's directory is on sys.path)

SKEWED = ([2, 3, 1, 4, 2, 3], [38, 2, 5, 1, 3, 6])
BUDGET = 40


def _value_loss(values, mb):  # type: ignore[no-untyped-def]
    from ppojob_trainer.algorithms import value_loss

    loss, _ = value_loss(values, mb["old_values"], mb["returns"], mb["response_mask"], 0.2)
    return loss, {"loss": loss.detach()}


def _capture(trainer: Any, into: list) -> None:
    """The trainer's optimizer step replaced by a copy of its accumulated local gradients."""

    def capture() -> dict[str, float]:
        into.append(
            [torch.zeros_like(p) if p.grad is None else p.grad.clone() for p in trainer.m.params]
        )
        for p in trainer.m.params:
            p.grad = None
        return {}

    trainer.m._step = capture


def _diff(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.float() - b.float()).abs().max()) if a.numel() else 0.0


def _grad_diff(a: list[torch.Tensor], b: list[torch.Tensor]) -> float:
    """Max abs difference of two gradients, relative to the first one's largest entry."""
    scale = max(float(g.abs().max()) for g in a)
    return max(_diff(x, y) for x, y in zip(a, b, strict=True)) / scale


def run_layout(rank: int, world: int, model_dir: Path, tp: int, pp: int) -> dict[str, float]:
    from megatron.core import parallel_state as ps

    from ppojob_trainer.backends.megatron_backend import (
        MegatronPolicyTrainer,
        MegatronValueTrainer,
    )
    from ppojob_trainer.distributed import identity
    from tests.helpers.batches import mixed_batch, ppo_policy_loss

    shard = identity("actor", rank, world, tp, pp, 1)
    critic_shard = dataclasses.replace(shard, role="critic")
    batch = mixed_batch()
    mask = batch["response_mask"]
    out: dict[str, float] = {}

    res: dict[bool, dict[str, Any]] = {}
    for packing in (False, True):
        cfg = _cfg(tp, pp, packing=packing, microBatchSize=2)
        actor = MegatronPolicyTrainer(cfg, model_dir, shard, need_reference=True)
        grads: list = []
        _capture(actor, grads)
        r: dict[str, Any] = {
            "logp": actor.logprobs(batch),
            "ref": actor.logprobs(batch, reference=True),
        }
        r["loss"] = actor.update(batch, ppo_policy_loss, 2)["loss"]
        r["grad"] = grads[0]
        critic = MegatronValueTrainer(cfg, model_dir, critic_shard)
        cgrads: list = []
        _capture(critic, cgrads)
        r["values"] = critic.values(batch)
        r["vf_loss"] = critic.update(batch, _value_loss, 2)["loss"]
        r["vf_grad"] = cgrads[0]
        res[packing] = r
        ps.destroy_model_parallel()
    padded, packed = res[False], res[True]
    for key in ("logp", "ref", "values"):
        out[f"{key}_max_abs"] = _diff(packed[key][mask], padded[key][mask])
    out["loss_abs"] = abs(packed["loss"] - padded["loss"])
    out["vf_loss_abs"] = abs(packed["vf_loss"] - padded["vf_loss"])
    out["grad_rel"] = _grad_diff(padded["grad"], packed["grad"])
    out["vf_grad_rel"] = _grad_diff(padded["vf_grad"], packed["vf_grad"])
    out["grad_scale"] = max(float(g.abs().max()) for g in padded["grad"])

    # Token budget on skewed lengths: the gradient of one micro-batch of the whole mini-batch.
    skewed = mixed_batch(*SKEWED, seed=1)
    n = len(SKEWED[0])
    budget_grads: dict[str, list] = {}
    budget_logp: dict[str, torch.Tensor] = {}
    for name, training in (
        ("whole", {}),
        ("padded", {"maxTokensPerMicroBatch": BUDGET}),
        ("packed", {"maxTokensPerMicroBatch": BUDGET, "packing": True}),
    ):
        actor = MegatronPolicyTrainer(
            _cfg(tp, pp, **training), model_dir, shard, need_reference=False
        )
        grads = []
        _capture(actor, grads)
        micros = len(actor.m.plan(skewed, None))
        out[f"budget_{name}_micro_batches"] = micros
        budget_logp[name] = actor.logprobs(skewed)  # the no-grad forward under the budget
        actor.update(skewed, ppo_policy_loss, n)
        budget_grads[name] = grads[0]
        ps.destroy_model_parallel()
    out["budget_padded_grad_rel"] = _grad_diff(budget_grads["whole"], budget_grads["padded"])
    out["budget_packed_grad_rel"] = _grad_diff(budget_grads["whole"], budget_grads["packed"])
    smask = skewed["response_mask"]
    for name in ("padded", "packed"):
        diff = _diff(budget_logp[name][smask], budget_logp["whole"][smask])
        out[f"budget_{name}_logp_max_abs"] = diff
    return out


def _worker(rank: int, world: int, port: int, model_dir: str, out_path: str) -> None:
    warnings.filterwarnings("ignore")
    import torch.distributed as dist

    torch.set_num_threads(1)
    dist.init_process_group(
        "gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world
    )
    results = {}
    for name, tp, pp in (("tp2", 2, 1), ("pp2", 1, 2)):
        res = run_layout(rank, world, Path(model_dir), tp, pp)
        gathered: list[Any] = [None] * world
        dist.all_gather_object(gathered, res)
        results[name] = {k: max(r[k] for r in gathered) for k in res}
    if rank == 0:
        Path(out_path).write_text(json.dumps(results, indent=1))
    dist.destroy_process_group()


def main() -> None:
    from megatron_cases import start

    from ppojob_trainer.distributed import free_port

    out_path, model_dir = sys.argv[1], sys.argv[2]
    start(_worker, (2, free_port(), model_dir, out_path), 2)


if __name__ == "__main__":
    main()
