"""Issue 40, finding 8 (FSDP half): a weight sync from an FSDP actor whose shards are float32
sends bf16; the shards are cast before they are gathered, so each gather moves bf16 bytes (half)
and no whole float32 tensor is made. Two processes over real gloo; ``DTensor.full_tensor`` (the
gather ``stream_state_dict`` calls) is wrapped to record the dtype and bytes each gather moves.
The streamed tensors equal the float32 gather cast afterwards, bit for bit (a cast is
elementwise)."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

pytestmark = pytest.mark.slow
WORLD = 2


class Blocks(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(3)
        self.layers = torch.nn.ModuleList(torch.nn.Linear(16, 16) for _ in range(3))
        self.head = torch.nn.Linear(16, 5)


def _worker(rank: int, port: int, out: str) -> None:
    import torch.distributed as dist
    from torch.distributed.tensor import DTensor

    from ppojob_trainer.backends.torch_backend.sharding import shard_module, stream_state_dict

    torch.set_num_threads(1)
    dist.init_process_group(
        "gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=WORLD
    )
    group = dist.new_group(list(range(WORLD)), backend="gloo")
    model = shard_module(Blocks(), group, torch.device("cpu"))
    # the reference: every tensor gathered in float32, cast after
    expected = {k: v.full_tensor().to(torch.bfloat16) for k, v in model.state_dict().items()}
    gathered: list[tuple[torch.dtype, int]] = []
    full_tensor = DTensor.full_tensor

    def recorded(self, *args, **kwargs):  # type: ignore[no-untyped-def]
        out = full_tensor(self, *args, **kwargs)
        gathered.append((out.dtype, out.numel() * out.element_size()))
        return out

    DTensor.full_tensor = recorded
    try:
        got = stream_state_dict(model, torch.bfloat16, 1 << 20).materialise()
    finally:
        DTensor.full_tensor = full_tensor
    fp32 = sum(v.numel() * 4 for v in expected.values())
    torch.save(
        {
            "dtypes": sorted({str(d) for d, _ in gathered}),
            "gathered_bytes": sum(n for _, n in gathered),
            "fp32_bytes": fp32,
            "equal": list(got) == list(expected)
            and all(
                got[k].dtype == v.dtype and torch.equal(got[k], v) for k, v in expected.items()
            ),
        },
        Path(out) / f"rank{rank}.pt",
    )
    dist.destroy_process_group()


def test_fsdp_shards_are_cast_before_they_are_gathered(tmp_path: Path) -> None:
    import torch.multiprocessing as mp

    from ppojob_trainer.distributed import free_port

    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    mp.spawn(_worker, args=(free_port(), str(tmp_path)), nprocs=WORLD)
    for rank in range(WORLD):
        r = torch.load(tmp_path / f"rank{rank}.pt", weights_only=False)
        assert r["equal"], rank
        assert r["dtypes"] == ["torch.bfloat16"], r["dtypes"]  # every gather moved bf16
        assert r["gathered_bytes"] * 2 == r["fp32_bytes"]  # half the float32 bytes
