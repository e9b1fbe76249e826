"""Where the tensors of a collective live: the one place that decides it.

NCCL only communicates CUDA tensors; gloo only CPU ones. Every tensor this trainer hands to a
``torch.distributed`` collective (or point-to-point call) is placed by :func:`to_group` or made
by :func:`group_empty`, which ask the group's backend (:func:`group_backend`) for the device
(:func:`collective_device`). ``tests/helpers/collective_check.py`` holds the code to this: it
names every group "nccl" and records any tensor our code hands to a collective that these two
did not place.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

__all__ = [
    "all_reduce_max",
    "all_reduce_sum",
    "collective_device",
    "group_backend",
    "group_device",
    "group_empty",
    "to_group",
]


def group_backend(group: object | None = None) -> str:
    """The backend name of ``group`` (None: the default group), as
    ``torch.distributed.get_backend`` gives it."""
    import torch.distributed as dist

    return str(dist.get_backend(group))


def collective_device(backend: str, cuda_index: int | None = None) -> torch.device:
    """Where a tensor must be for a collective of a group with ``backend`` (its name, as
    ``torch.distributed.get_backend`` gives it): NCCL only reduces CUDA tensors, so the current
    CUDA device (or ``cuda:cuda_index``) for ``nccl``; the CPU for every other backend (gloo...)."""
    if str(backend).lower() == "nccl":
        index = torch.cuda.current_device() if cuda_index is None else cuda_index
        return torch.device("cuda", index)
    return torch.device("cpu")


def group_device(group: object | None = None) -> torch.device:
    """:func:`collective_device` of ``group``'s backend."""
    return collective_device(group_backend(group))


def to_group(t: torch.Tensor, group: object | None = None) -> torch.Tensor:
    """``t`` on the device ``group``'s collectives need: ``t`` itself when it is there already
    (a collective on it then works in place), else a copy there."""
    dev = group_device(group)
    return t if t.device == dev else t.to(dev)


def group_empty(
    group: object | None, shape: Sequence[int], dtype: torch.dtype = torch.float32
) -> torch.Tensor:
    """An uninitialised buffer of ``shape`` on the device ``group``'s collectives need (what a
    ``recv``, ``broadcast`` or ``all_gather`` fills)."""
    return torch.empty(tuple(shape), dtype=dtype, device=group_device(group))


def all_reduce_sum(t: torch.Tensor, group: object | None = None) -> torch.Tensor:
    """``all_reduce(SUM)`` of ``t`` over ``group``, whatever the group's backend: the tensor goes
    to the device the backend needs (:func:`to_group`) and the sum comes back on ``t``'s
    device. Returns a new tensor when it moved, else ``t`` itself (reduced in place)."""
    import torch.distributed as dist

    moved = to_group(t, group)
    dist.all_reduce(moved, op=dist.ReduceOp.SUM, group=group)
    return moved if moved is t else moved.to(t.device)


def all_reduce_max(value: int, group: object | None = None) -> int:
    """The largest of every member's ``value`` over ``group`` (on the device its backend
    needs)."""
    import torch.distributed as dist

    t = to_group(torch.tensor([int(value)], dtype=torch.long), group)
    dist.all_reduce(t, op=dist.ReduceOp.MAX, group=group)
    return int(t.item())
