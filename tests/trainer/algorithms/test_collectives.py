"""The collective-device rule and its check (``tests/helpers/collective_check.py``) on a
one-process gloo group: a tensor the trainer hands to a collective of an NCCL group must have
been placed for it (``to_group``, ``group_empty``); the check records any other."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from ppojob_trainer.algorithms import collectives as C
from tests.helpers.collective_check import nccl_check


@pytest.fixture
def group(tmp_path: Path) -> Iterator[object]:
    own = not dist.is_initialized()
    if own:
        store = dist.FileStore(str(tmp_path / "store"), 1)
        dist.init_process_group("gloo", store=store, rank=0, world_size=1)
    assert dist.get_world_size() == 1
    try:
        yield dist.new_group([0], backend="gloo")
    finally:
        if own:
            dist.destroy_process_group()


def _as_trainer(source: str, **names: object) -> dict[str, object]:
    """Run ``source`` as if it were a module of the trainer (the check judges only those)."""
    scope = {"__name__": "ppojob_trainer.backends.example", "dist": dist, "torch": torch, **names}
    exec(compile(source, "<trainer code>", "exec"), scope)
    return scope


def test_collective_device_follows_the_backend() -> None:
    assert C.collective_device("gloo") == torch.device("cpu")
    assert C.collective_device("nccl", cuda_index=2) == torch.device("cuda", 2)
    assert C.collective_device(dist.Backend.NCCL, cuda_index=1) == torch.device("cuda", 1)


def test_to_group_moves_to_the_backends_device_and_keeps_a_tensor_already_there(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    t = torch.ones(3)
    monkeypatch.setattr(C, "group_backend", lambda group=None: "gloo")
    assert C.to_group(t) is t
    # an NCCL group on a machine without CUDA: the meta device stands in for cuda:0
    monkeypatch.setattr(C, "group_backend", lambda group=None: "nccl")
    monkeypatch.setattr(
        C, "collective_device", lambda backend, cuda_index=None: torch.device("meta")
    )
    assert C.to_group(t).device.type == "meta"
    assert C.group_empty(None, (2, 5), torch.bfloat16).device.type == "meta"
    assert C.group_empty(None, (2, 5), torch.bfloat16).shape == (2, 5)


def test_a_cpu_tensor_handed_to_an_nccl_named_group_is_a_violation(group: object) -> None:
    with nccl_check() as log:
        scope = _as_trainer(
            "t = torch.tensor([3])\ndist.all_reduce(t, op=dist.ReduceOp.MAX, group=g)", g=group
        )
    assert int(scope["t"]) == 3  # the call itself still ran (on gloo)
    assert [(v["call"], v["device"], v["shape"]) for v in log.violations] == [
        ("all_reduce", "cpu", [1])
    ]
    assert log.violations[0]["site"] == "ppojob_trainer.backends.example:<module>"


def test_placed_tensors_their_views_and_empty_buffers_pass(group: object) -> None:
    with nccl_check() as log:
        _as_trainer(
            "from ppojob_trainer.algorithms import collectives as C\n"
            "t = C.to_group(torch.arange(6.0), g)\n"
            "dist.all_reduce(t[2:4], group=g)\n"
            "out = [C.group_empty(g, (6,)) for _ in range(1)]\n"
            "dist.all_gather(out, t, group=g)\n"
            "s = C.all_reduce_sum(torch.ones(2), g)\n"
            "m = C.all_reduce_max(4, g)\n",
            g=group,
        )
    assert log.violations == []
    assert [c["call"] for c in log.calls] == [
        "all_reduce",
        "all_gather",
        "all_reduce",
        "all_reduce",
    ]


def test_an_unplaced_buffer_in_a_list_is_a_violation(group: object) -> None:
    with nccl_check() as log:
        _as_trainer(
            "from ppojob_trainer.algorithms import collectives as C\n"
            "t = C.to_group(torch.arange(3.0), g)\n"
            "dist.all_gather([torch.empty(3)], t, group=g)\n",
            g=group,
        )
    assert [(v["call"], v["shape"]) for v in log.violations] == [("all_gather", [3])]


def test_calls_from_outside_the_trainer_are_not_judged_and_everything_is_restored(
    group: object,
) -> None:
    real = dist.all_reduce, C.to_group, C.group_backend
    with nccl_check() as log:
        dist.all_reduce(torch.ones(1), group=group)  # this test's own call: not the trainer's
    assert log.calls == [] and log.violations == []
    assert (dist.all_reduce, C.to_group, C.group_backend) == real
    assert C.group_backend(group) == "gloo"
