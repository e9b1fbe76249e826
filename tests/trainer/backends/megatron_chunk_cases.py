"""The megatron actor's chunked vocabulary projection against megatron-core's output layer, on CPU.

Run as a script (``python megatron_chunk_cases.py OUT.json MODEL_DIR TIED_MODEL_DIR``): 2
processes in one gloo world; for each layout (tensor 2, tensor 1 with data 2, pipeline 2, and
tensor 2 of a model whose output layer is its input embedding) two actors are built from the
same weights: the backend's, projecting ``CHUNK`` positions at a time (several chunks per
micro-batch), and the actor as it was before chunking (:func:`_unchunked`: megatron-core's
output layer makes the micro-batch's whole [L, b, V/tp] logits, the entropy from the gathered
vocabulary). Both compute the log-probs (no gradient) and one update whose loss weighs the
log-probs and the entropy alike, so that the entropy's gradient counts, then the same update
with the entropy as a metric only (no gradient through it); the updates' entropies and each
rank's local gradients (captured instead of the optimizer step) are compared.

Every logits tensor is recorded (rows x V/tp): each call of ``_vocab_logits`` (the backend's one
projection onto the vocabulary) and each output of the model's output layer as wide as the
vocabulary slice; and how many projections each phase made (backward recomputes each chunk).
Calls of megatron-core's ``gather_from_tensor_model_parallel_region`` (which gathers the whole
vocabulary) by the backend are counted too. Rank 0 writes, per layout, the worst rank's figures
as JSON; ``test_megatron.py::test_megatron_logits_are_projected_a_chunk_at_a_time`` asserts on
them.
"""

from __future__ import annotations

import json
import sys
import warnings
from pathlib import Path
from typing import Any

import torch
from megatron_cases import _cfg  # (this script's directory is on sys.path)

CHUNK = 3


def _unchunked(actor: Any) -> None:
    """``actor`` as before chunking: megatron-core's output layer computes the logits of every
    position, read at the response positions, in float32 over the temperature; megatron-core's
    vocabulary-parallel cross entropy; the entropy of the gathered vocabulary."""
    from megatron.core.tensor_parallel import gather_from_tensor_model_parallel_region

    from ppojob_trainer.backends import megatron_logprobs as mlp_

    if actor.m.last:
        del actor.m.model.output_layer.forward  # the class's own forward again

    def stats(model, output, mb, entropy=None):  # type: ignore[no-untyped-def]
        logits = mlp_._at_index(output, mb).float() / actor.temperature
        logp = mlp_.vocab_parallel_logprobs(logits, mb["response_ids"])
        if entropy is None:
            return logp, None
        with torch.set_grad_enabled(entropy == "grad" and torch.is_grad_enabled()):
            full = torch.log_softmax(gather_from_tensor_model_parallel_region(logits), -1)
            return logp, -(full.exp() * full).sum(-1)

    actor._token_stats = stats


def _entropy_loss(into: list) -> Any:
    """A loss of log-probs and entropy with equal weight (so the entropy's gradient is as
    large as the log-probs'), recording each micro-batch's entropy."""

    def loss_fn(logp, ent, mb):  # type: ignore[no-untyped-def]
        into.append(ent.detach().clone())
        mask = mb["response_mask"].float()
        loss = -((logp * mb["advantages"] + ent) * mask).sum() / mask.sum()
        return loss, {"loss": loss.detach()}

    return loss_fn


def _rel(a: list[torch.Tensor], b: list[torch.Tensor]) -> float:
    """Max abs difference of two lists of tensors, relative to the second's largest entry."""
    scale = max(float(y.abs().max()) for y in b)
    return max(float((x - y).abs().max()) for x, y in zip(a, b, strict=True)) / scale


def run_layout(rank: int, world: int, model_dir: Path, tp: int, pp: int) -> dict[str, float]:
    import megatron.core.tensor_parallel as mtp
    from megatron.core import parallel_state as ps

    from ppojob_trainer.backends import megatron_backend as mb_
    from ppojob_trainer.backends import megatron_logprobs as mlp_
    from ppojob_trainer.distributed import identity
    from tests.helpers.batches import mixed_batch

    shard = identity("actor", rank, world, tp, pp, 1)
    batch = mixed_batch(seed=3)
    n = batch["response_ids"].shape[0]
    lo, hi = shard.dp_rank * n // shard.dp_size, (shard.dp_rank + 1) * n // shard.dp_size
    mine = {k: v[lo:hi] for k, v in batch.items()}
    mask = mine["response_mask"]

    calls: list[tuple[int, int]] = []
    gathers = [0]
    project, gather = mlp_._vocab_logits, mtp.gather_from_tensor_model_parallel_region

    def recording(hidden, weight, temperature):  # type: ignore[no-untyped-def]
        out = project(hidden, weight, temperature)
        calls.append((out.shape[0], out.shape[-1]))
        return out

    def counting(*args, **kwargs):  # type: ignore[no-untyped-def]
        gathers[0] += 1
        return gather(*args, **kwargs)

    mlp_._vocab_logits, mtp.gather_from_tensor_model_parallel_region = recording, counting
    res: dict[str, dict[str, Any]] = {}
    try:
        for variant in ("chunked", "megatron"):
            cfg = _cfg(tp, pp, microBatchSize=2)
            actor = mb_.MegatronPolicyTrainer(cfg, model_dir, shard, need_reference=False)
            assert actor.need_entropy and actor.entropy_grad
            actor.logits_chunk = CHUNK
            outputs: list[tuple[int, int]] = []
            if actor.m.last:
                width = mlp_.output_weight(actor.m.model).shape[0]

                def hook(module, args, output, into=outputs, width=width):  # type: ignore[no-untyped-def]
                    if output[0].shape[-1] == width:  # logits, not hidden states
                        into.append((output[0].numel() // width, width))

                actor.m.model.output_layer.register_forward_hook(hook)
            if variant == "megatron":
                _unchunked(actor)
            grads: list = []

            def capture(trainer: Any = actor, into: list = grads) -> dict[str, float]:
                into.append(
                    [
                        torch.zeros_like(p) if p.grad is None else p.grad.clone()
                        for p in trainer.m.params
                    ]
                )
                for p in trainer.m.params:
                    p.grad = None
                return {}

            actor.m._step = capture
            r: dict[str, Any] = {}
            calls.clear()
            r["logp"] = actor.logprobs(mine)
            r["logp_calls"] = list(calls)
            calls.clear()
            gathers[0] = 0
            ents: list = []
            actor.update(mine, _entropy_loss(ents), 2)
            r["update_calls"], r["gathers"] = list(calls), gathers[0]
            r["logits"] = r["logp_calls"] + r["update_calls"] + outputs
            r["ent"], r["grad"] = ents, grads[0]
            actor.entropy_grad = False  # the entropy as a metric only: no gradient
            r["ent_nograd"] = []
            actor.update(mine, _entropy_loss(r["ent_nograd"]), 2)
            r["grad_nograd"] = grads[1]
            res[variant] = r
            ps.destroy_model_parallel()
    finally:
        mlp_._vocab_logits, mtp.gather_from_tensor_model_parallel_region = project, gather

    chunked, whole = res["chunked"], res["megatron"]
    out: dict[str, float] = {
        "grad_rel": _rel(chunked["grad"], whole["grad"]),
        "grad_nograd_rel": _rel(chunked["grad_nograd"], whole["grad_nograd"]),
        # the entropy's gradient counted: the two updates' gradients differ
        "entropy_grad_share": _rel(chunked["grad"], chunked["grad_nograd"]),
        "grad_scale": max(float(g.abs().max()) for g in whole["grad"]),
        "gathers": chunked["gathers"],
    }
    if shard.pp_rank != shard.pp_size - 1:  # not the last stage: no logits at all
        assert not chunked["logp_calls"] and not chunked["update_calls"], (
            "logits off the last stage"
        )
        return out
    out["logp_rel"] = float((chunked["logp"] - whole["logp"])[mask].abs().max()) / float(
        whole["logp"][mask].abs().max()
    )
    ent_c, ent_w = (
        torch.cat([e.flatten() for e in chunked["ent"]]),
        torch.cat([e.flatten() for e in whole["ent"]]),
    )
    out["ent_rel"] = float((ent_c - ent_w).abs().max()) / float(ent_w.abs().max())
    ent_n = torch.cat([e.flatten() for e in chunked["ent_nograd"]])
    ent_nw = torch.cat([e.flatten() for e in whole["ent_nograd"]])
    out["ent_nograd_rel"] = float((ent_n - ent_nw).abs().max()) / float(ent_nw.abs().max())
    for name, r in (("chunked", chunked), ("megatron", whole)):
        out[f"{name}_max_rows"] = max(rows for rows, _ in r["logits"])
        out[f"{name}_vocab_cols"] = max(cols for _, cols in r["logits"])
    out["chunked_logp_calls"] = len(chunked["logp_calls"])
    out["chunked_update_calls"] = len(chunked["update_calls"])
    out["micro_batches"] = len(chunked["ent"])
    return out


def _worker(rank: int, world: int, port: int, dirs: list[str], out_path: str) -> None:
    warnings.filterwarnings("ignore")
    import torch.distributed as dist

    torch.set_num_threads(1)
    dist.init_process_group(
        "gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world
    )
    results = {}
    cases = [("tp2", dirs[0], 2, 1), ("tp1", dirs[0], 1, 1), ("pp2", dirs[0], 1, 2)]
    cases.append(("tp2_tied", dirs[1], 2, 1))
    for name, model_dir, tp, pp in cases:
        res = run_layout(rank, world, Path(model_dir), tp, pp)
        gathered: list[Any] = [None] * world
        dist.all_gather_object(gathered, res)
        keys = set().union(*gathered)
        results[name] = {k: max(r[k] for r in gathered if k in r) for k in keys}
    if rank == 0:
        Path(out_path).write_text(json.dumps(results, indent=1))
    dist.destroy_process_group()


def main() -> None:
    from megatron_cases import start

    from ppojob_trainer.distributed import free_port

    out_path, dirs = sys.argv[1], sys.argv[2:]
    start(_worker, (2, free_port(), dirs, out_path), 2)


if __name__ == "__main__":
    main()
