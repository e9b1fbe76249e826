"""Parity cases of the megatron backend against Hugging Face and the torch backend, on CPU.

Run as a script (``python megatron_cases.py OUT.json MODEL_DIR [MODEL_DIR...]``): it starts 2
processes in one gloo world and, for each layout (tensor 2, pipeline 2 and data 2 for the first
model; tensor 2 for the others), builds the megatron actor and critic from the model directory
and measures, against a single-process torch backend on the same weights and batch:
full-vocabulary logits vs the HF model, log-probs and reference log-probs, values, the weights
after one actor and one critic update (gathered to HF names), the HF -> megatron -> HF round
trip through the distributed gather, and a checkpoint state round trip. Rank 0 writes the max
abs differences (and exactness flags) as JSON.
``tests/trainer/backends/test_megatron.py`` asserts on them; a separate process keeps
megatron-core's process-global state out of pytest's.

Adam's epsilon is 1e-3 here, which bounds how much the first step amplifies a gradient's fp32
rounding: the step is lr * g / (|g| + eps), whose sensitivity to an error dg is at most
lr / eps = 10 per unit of gradient, so reordered fp32 sums (dg ~ 1e-8) move a weight by ~1e-7, the
last bits of a weight near 1. With eps 1e-6 the same rounding on near-zero gradients became steps
of up to lr * dg / eps ~ 1e-5, and a fixed 1e-5 bound failed on another machine (1.22e-5). The
updates still move weights by ~lr where |g| >> eps; the test bounds the differences relative to
that update size, and records how far the torch backend's own update moves under another valid
summation order (``*_noise``), which the bound must cover too.
"""

from __future__ import annotations

import json
import os
import sys
import warnings
from pathlib import Path
from typing import Any

import torch

AUX = float(os.environ.get("PPOJOB_CASE_AUX", "0.1"))
"""The router load-balancing coefficient of the MoE cases with one."""


def _cfg(
    tp: int, pp: int, micro: int | None = None, ep: int = 1, aux: float = 0.0, **training: object
) -> object:
    """A megatron actor and colocated critic of ``tp`` x ``pp`` (experts over ``ep``; ``aux``:
    the router load-balancing coefficient) over two processes; ``training`` adds to (or
    replaces) the training settings of these cases."""
    from ppojob_api.training import TrainerConfig

    par = {"tensor": tp, "pipeline": pp, "expert": ep}
    settings = {"learningRate": 1e-2, "seed": 3, "microBatchSize": micro, **training}
    return TrainerConfig.model_validate(
        {
            "roles": {
                "actor": {"replicas": 2, "backend": "megatron", "parallelism": par},
                "critic": {"colocateWithActor": True, "backend": "megatron", "parallelism": par},
            },
            "algorithm": {
                "advantageEstimator": "gae",
                "entropyCoefficient": 0.01,
                "routerAuxLossCoefficient": aux,
            },
            "data": {"temperature": 0.8, "rolloutBatchSize": 4, "samplesPerPrompt": 2},
            "training": settings,
        }
    )


def _batch(n: int, seed: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    p, t = 5, 6
    prompt_ids = torch.randint(4, 14, (n, p), generator=g)
    plen = torch.randint(2, p + 1, (n,), generator=g)
    prompt_mask = torch.arange(p)[None, :] >= (p - plen)[:, None]
    prompt_ids = prompt_ids.masked_fill(~prompt_mask, 0)
    response_ids = torch.randint(0, 14, (n, t), generator=g)
    rlen = torch.randint(1, t + 1, (n,), generator=g)
    response_mask = torch.arange(t)[None, :] < rlen[:, None]
    return {
        "prompt_ids": prompt_ids,
        "prompt_mask": prompt_mask,
        "response_ids": response_ids.masked_fill(~response_mask, 0),
        "response_mask": response_mask,
        "old_logprobs": -torch.rand(n, t, generator=g) * 3,
        "advantages": torch.randn(n, t, generator=g),
        "old_values": torch.randn(n, t, generator=g) * 0.1,
        "returns": torch.randn(n, t, generator=g),
    }


def _policy_loss(cfg):  # type: ignore[no-untyped-def]
    from ppojob_trainer import algorithms as A

    algo = cfg.algorithm

    def loss_fn(logp, ent, mb):  # type: ignore[no-untyped-def]
        loss, m = A.policy_loss(
            logp,
            mb["old_logprobs"],
            mb["advantages"],
            mb["response_mask"],
            0.2,
            0.2,
            None,
            agg=algo.loss_aggregation,
            entropy=ent,
            entropy_coef=algo.entropy_coefficient,
        )
        return loss, {"pg_loss": float(loss.detach()), "entropy": float(m["entropy"])}

    return loss_fn


def _value_loss(values, mb):  # type: ignore[no-untyped-def]
    from ppojob_trainer import algorithms as A

    loss, _ = A.value_loss(values, mb["old_values"], mb["returns"], mb["response_mask"], 0.2)
    return loss, {"vf_loss": float(loss.detach())}


def _maxdiff(a: dict, b: dict) -> float:
    assert set(a) == set(b), sorted(set(a) ^ set(b))[:5]
    return max(float((a[k].float() - b[k].float()).abs().max()) for k in a)


def _layout(rank: int, tp: int, pp: int, world: int, ep: int = 1) -> object:
    from ppojob_trainer.distributed import identity

    return identity("actor", rank, world, tp, pp, 1, ep)


def run_layout(
    rank: int,
    world: int,
    model_dir: Path,
    tp: int,
    pp: int,
    ep: int = 1,
    budget: int | None = None,
    aux: float = 0.0,
) -> dict[str, object]:
    import dataclasses

    from megatron.core import parallel_state as ps

    from ppojob_trainer.backends.megatron_backend import MegatronPolicyTrainer, MegatronValueTrainer
    from ppojob_trainer.backends.megatron_logprobs import _select, output_weight
    from ppojob_trainer.backends.torch_backend.policy import TorchPolicyTrainer
    from ppojob_trainer.backends.torch_backend.value import TorchValueTrainer
    from ppojob_trainer.models import load_causal_lm

    micro = 2
    cfg = _cfg(tp, pp, micro, ep, aux, gradClip=0.5, adamEps=1e-3, maxTokensPerMicroBatch=budget)
    shard = _layout(rank, tp, pp, world, ep)
    out: dict[str, object] = {}
    n = 8
    batch = _batch(n, seed=11)
    lo, hi = (shard.dp_rank * n // shard.dp_size, (shard.dp_rank + 1) * n // shard.dp_size)
    mine = {k: v[lo:hi] for k, v in batch.items()}

    actor = MegatronPolicyTrainer(cfg, model_dir, shard, need_reference=True, total_updates=4)
    hf = load_causal_lm(model_dir).eval()
    hf_sd = {k: v.clone() for k, v in hf.state_dict().items()}

    # HF -> megatron -> HF through the distributed gather: bit-identical.
    exported = actor.export_weights()
    if exported:
        out["roundtrip_exact"] = set(exported) == set(hf_sd) and all(
            torch.equal(exported[k], hf_sd[k]) for k in hf_sd
        )

    # Full-vocabulary logits against the HF model (unpadded rows).
    from megatron.core.tensor_parallel import gather_from_tensor_model_parallel_region

    full = {"prompt_ids": batch["prompt_ids"][:, 3:], "response_ids": batch["response_ids"]}
    full["prompt_mask"] = torch.ones_like(full["prompt_ids"], dtype=torch.bool)

    def logits_head(output, mb):  # type: ignore[no-untyped-def]
        # (the actor's model ends at its final hidden states: project them here)
        local = torch.nn.functional.linear(output, output_weight(actor.m.model))
        return output.new_zeros(()), gather_from_tensor_model_parallel_region(local).cpu()

    with torch.no_grad():
        parts = actor.m.run(full, n, logits_head, forward_only=True)
        logits = actor.m.from_last_stage(torch.cat(parts) if parts else None)
        ids = torch.cat([full["prompt_ids"], full["response_ids"]], 1)
        ref = hf(input_ids=ids).logits
    out["logits_max_abs"] = float((logits - ref).abs().max())
    del _select

    # Log-probs (policy and reference) against the torch backend, left-padded prompts.
    settings = cfg.training
    torch_actor = TorchPolicyTrainer(
        model_dir,
        "float32",
        settings,
        total_updates=4,
        temperature=0.8,
        need_reference=True,
        entropy_grad=True,
        router_aux_loss=aux,
    )
    lp_m = actor.logprobs(mine)
    lp_t = torch_actor.logprobs(mine)
    mask = mine["response_mask"]
    out["logprobs_max_abs"] = float((lp_m - lp_t)[mask].abs().max())
    out["ref_logprobs_max_abs"] = float(
        (actor.logprobs(mine, reference=True) - torch_actor.logprobs(mine, reference=True))[mask]
        .abs()
        .max()
    )

    # One actor update (the torch backend sees the whole mini-batch in one process).
    loss_fn = _policy_loss(cfg)
    m_metrics = actor.update(mine, loss_fn, micro)
    t_metrics = torch_actor.update(batch, loss_fn, micro)
    # The same update with another valid fp32 summation order (micro-batches of 1 row, or with a
    # load-balancing loss the same micro-batches in reverse order): how far
    # two correct updates differ on this machine, amplified as Adam's first step amplifies it.
    torch_order = TorchPolicyTrainer(
        model_dir,
        "float32",
        settings,
        total_updates=4,
        temperature=0.8,
        need_reference=True,
        entropy_grad=True,
        router_aux_loss=aux,
    )
    if aux:  # (micro-batches of other rows would change the load-balancing loss itself)
        blocks = torch.arange(n).reshape(-1, micro).flip(0).reshape(-1)
        torch_order.update({k: v[blocks] for k, v in batch.items()}, loss_fn, micro)
    else:
        torch_order.update(batch, loss_fn, 1)
    after = actor.export_weights()
    if after:
        out["update_noise"] = _maxdiff(torch_order.lm.state_dict(), torch_actor.lm.state_dict())
        out["update_weights_max_abs"] = _maxdiff(after, torch_actor.lm.state_dict())
        out["update_changed"] = _maxdiff(after, hf_sd)
        out["grad_norm"] = [m_metrics["grad_norm"], t_metrics["grad_norm"]]
    if shard.dp_size == 1:
        out["pg_loss"] = [m_metrics["pg_loss"], t_metrics["pg_loss"]]
        if aux:
            out["router_balance"] = [m_metrics["router_balance"], t_metrics["router_balance"]]

    # Checkpoint state round trip (gathered weights and Adam moments) into a fresh actor.
    state = actor.state_dict()
    states = [None] * world
    torch.distributed.all_gather_object(states, state)
    state = states[0]
    fresh = MegatronPolicyTrainer(cfg, model_dir, shard, need_reference=False, total_updates=4)
    out["local_params"] = sum(p.numel() for p in actor.m.model.parameters())
    out["fillers"] = actor.m.fillers
    fresh.load_state_dict(state)
    actor.update(mine, loss_fn, micro)
    fresh.update(mine, loss_fn, micro)
    a, b = actor.export_weights(), fresh.export_weights()
    if a:
        out["resume_max_abs"] = _maxdiff(a, b)

    # Critic: values and one update against the torch backend's value model.
    critic = MegatronValueTrainer(
        cfg, model_dir, dataclasses.replace(shard, role="critic"), total_updates=4
    )
    torch_critic = TorchValueTrainer(model_dir, "float32", settings, total_updates=4, seed=3)
    out["values_max_abs"] = float(
        (critic.values(mine) - torch_critic.values(mine))[mask].abs().max()
    )
    critic.update(mine, _value_loss, micro)
    torch_critic.update(batch, _value_loss, micro)
    critic_order = TorchValueTrainer(model_dir, "float32", settings, total_updates=4, seed=3)
    critic_order.update(batch, _value_loss, 1)
    after = critic.export_weights()
    if after:

        def hf_names(model):  # type: ignore[no-untyped-def]
            return {
                ("model." + k[len("backbone.") :] if k.startswith("backbone.") else k): v
                for k, v in model.state_dict().items()
            }

        ref_sd = hf_names(torch_critic.model)
        out["critic_update_weights_max_abs"] = _maxdiff(after, ref_sd)
        out["critic_update_noise"] = _maxdiff(hf_names(critic_order.model), ref_sd)
        out["critic_update_changed"] = _maxdiff(
            after,
            hf_names(
                TorchValueTrainer(model_dir, "float32", settings, total_updates=4, seed=3).model
            ),
        )
    ps.destroy_model_parallel()
    return out


def merge(per_rank: list[dict[str, object]]) -> dict[str, object]:
    """One result from every rank's: the worst of each measurement (``*_max_abs`` and
    ``*_noise`` the largest, ``update_changed`` the smallest, an exactness flag only if it holds
    on every rank), other values from the lowest rank that has them (a later rank used to
    overwrite an earlier one's measurement)."""
    merged: dict[str, object] = {}
    for r in per_rank:
        for key, value in r.items():
            if key not in merged:
                merged[key] = value
            elif key.endswith(("_max_abs", "_noise")):
                merged[key] = max(merged[key], value)
            elif key == "update_changed":
                merged[key] = min(merged[key], value)
            elif key == "fillers":  # (per rank: the total)
                merged[key] += value
            elif isinstance(value, bool):
                merged[key] = merged[key] and value
    return merged


def _worker(
    rank: int, world: int, port: int, model_dirs: list[str], out_path: str, moe: bool = False
) -> None:
    warnings.filterwarnings("ignore")
    import torch.distributed as dist

    torch.set_num_threads(1)
    dist.init_process_group(
        "gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world
    )
    results = {}
    cases = [
        (model_dirs[0], "tp2", 2, 1, 1, None),
        (model_dirs[0], "pp2", 1, 2, 1, None),
        (model_dirs[0], "dp2", 1, 1, 1, None),
    ]
    cases += [(d, "tp2", 2, 1, 1, None) for d in model_dirs[1:]]  # further models: tensor 2
    if moe:  # mixture-of-experts models: experts over 2 data-parallel ranks, and pipeline 2
        # (tensor parallelism: megatron-core's MoE layers train only with sequence parallelism,
        # which needs Transformer Engine)
        # with a router load-balancing loss (micro-batches of the same rows in both backends)
        cases = [(d, "ep2", 1, 1, 2, None, AUX) for d in model_dirs]
        cases += [(model_dirs[0], "pp2", 1, 2, 1, None, AUX)]
        # a token budget of 12: the two ranks' rows need 4 and 3 micro-batches
        cases += [(model_dirs[0], "ep2-budget", 1, 1, 2, 12)]
    for model_dir, name, tp, pp, ep, budget, *aux in cases:
        res = run_layout(rank, world, Path(model_dir), tp, pp, ep, budget, *aux)
        gathered = [None] * world
        dist.all_gather_object(gathered, res)
        results[f"{Path(model_dir).name}/{name}"] = merge(gathered)
    if rank == 0:
        Path(out_path).write_text(json.dumps(results, indent=1))
    dist.destroy_process_group()


def preload() -> None:
    """Import what the workers of these scripts import (the megatron-core modules the backend
    loads lazily, the torch backend, transformers' Llama and Qwen2) once, in the parent: its
    forked workers (:func:`start`) then share them instead of each paying the imports. Nothing
    here starts a thread or joins a process group."""
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        import megatron.core.dist_checkpointing.optimizer
        import megatron.core.dist_checkpointing.serialization
        import megatron.core.dist_checkpointing.strategies.fully_parallel
        import megatron.core.distributed
        import megatron.core.models.gpt.gpt_layer_specs
        import megatron.core.optimizer
        import megatron.core.pipeline_parallel
        import megatron.core.tensor_parallel  # noqa: F401
        import transformers.models.llama.modeling_llama
        import transformers.models.mixtral.modeling_mixtral
        import transformers.models.qwen2.modeling_qwen2
        import transformers.models.qwen3_moe.modeling_qwen3_moe  # noqa: F401

        import ppojob_trainer.backends.megatron_backend
        import ppojob_trainer.backends.megatron_logprobs
        import ppojob_trainer.backends.torch_backend.policy
        import ppojob_trainer.backends.torch_backend.value
        import ppojob_trainer.models  # noqa: F401


def start(worker: Any, args: tuple, nprocs: int) -> None:  # type: ignore[type-arg]
    """``torch.multiprocessing.spawn``'s ``worker(rank, *args)`` in ``nprocs`` processes, forked
    from this (undistributed, single-threaded) process after :func:`preload`: each is fresh
    (no megatron-core state of another run) but pays no imports of its own."""
    import torch.multiprocessing as mp

    os.environ.setdefault("OMP_NUM_THREADS", "1")
    preload()
    mp.start_processes(worker, args=args, nprocs=nprocs, start_method="fork")


def main() -> None:
    from ppojob_trainer.distributed import free_port

    moe = sys.argv[1] == "--moe"
    out_path, model_dirs = sys.argv[1 + moe], sys.argv[2 + moe :]
    start(_worker, (2, free_port(), model_dirs, out_path, moe), 2)


if __name__ == "__main__":
    main()
