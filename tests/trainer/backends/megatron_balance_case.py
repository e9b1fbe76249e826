"""The megatron router hook's load-balancing loss under sequence parallelism, on CPU.

Run as a script (``python megatron_balance_case.py OUT.json``): two gloo processes each hold
half of one router's tokens (as sequence parallelism splits them) and compute their share of
the loss through :class:`~ppojob_trainer.backends.megatron_routing.ReplayTopK` with the world as
its tensor group, under the collective-device check (``tests/helpers/collective_check.py``);
rank 0 also computes the loss of all the tokens alone. Rank 0 writes the whole loss, each
rank's reported loss, the sum of the shares, how far the two ranks' gradients (concatenated)
are from the whole loss's, and the collective sites judged with their violations."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch


def _worker(rank: int, world: int, port: int, out_path: str) -> None:
    import torch.distributed as dist

    from ppojob_trainer.backends.megatron_routing import ReplayTopK

    dist.init_process_group(
        "gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world
    )
    g = torch.Generator().manual_seed(4)
    tokens, experts, k = 24, 8, 2
    logits = torch.randn(tokens, experts, generator=g) * 2
    logits[:, 0] += 1.5  # a crowded expert
    valid = torch.rand(tokens, generator=g) > 0.25

    def share(
        x: torch.Tensor, mask: torch.Tensor, group: object
    ) -> tuple[float, float, torch.Tensor]:
        x = x.clone().requires_grad_(True)
        hook = ReplayTopK(group)
        hook.valid = mask
        loss = hook._balance_loss(x, x.detach().topk(k, dim=-1).indices)
        loss.backward()
        return float(loss), float(hook.balance), x.grad

    from tests.helpers.collective_check import nccl_check

    half = slice(rank * tokens // 2, (rank + 1) * tokens // 2)
    with nccl_check() as log:  # (the group's tensors placed for NCCL on a GPU)
        mine, reported, grad = share(logits[half], valid[half], dist.group.WORLD)
    shares = torch.tensor([mine])
    dist.all_reduce(shares)
    seen = [None] * world
    dist.all_gather_object(seen, (reported, grad, sorted(log.sites()), log.violations))
    if rank == 0:
        whole, _, whole_grad = share(logits, valid, None)
        grads = torch.cat([g for _, g, _, _ in seen])
        result = {
            "whole": whole,
            "reported": [r for r, _, _, _ in seen],
            "sites": sorted({x for _, _, sites, _ in seen for x in sites}),
            "violations": [v for _, _, _, vs in seen for v in vs],
            "shares_sum": float(shares),
            "grad_max_abs": float((grads - whole_grad).abs().max()),
            "grad_scale": float(whole_grad.abs().max()),
        }
        Path(out_path).write_text(json.dumps(result))
    dist.destroy_process_group()


def main() -> None:
    import torch.multiprocessing as mp

    import ppojob_trainer.backends.megatron_routing  # noqa: F401 (imported once, before the fork)
    from ppojob_trainer.distributed import free_port

    mp.start_processes(_worker, args=(2, free_port(), sys.argv[1]), nprocs=2, start_method="fork")


if __name__ == "__main__":
    main()
