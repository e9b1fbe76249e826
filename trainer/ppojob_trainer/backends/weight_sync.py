"""Weight sync in buckets of bounded size: plan them, flatten a bucket into one byte tensor,
rebuild its tensors.

The actor's weights reach the generation engines one bucket at a time, so the extra memory a
sync needs is one bucket, not a second copy of the model. A bucket holds whole tensors in the
order the actor exported them; a tensor larger than the bound gets a bucket of its own.

The flattened layout is SGLang's ``flattened_bucket`` format (``FlattenedTensorBucket``): every
tensor viewed as bytes (``uint8``) and concatenated; per tensor its name, shape, dtype and byte
range ``[start_idx, end_idx)`` with ``numel`` = its byte count. ``TensorMeta`` carries exactly
those fields, so the sglang adapter converts it field by field (the contract tests check the
field names against SGLang's source). A colocated bucket pads each tensor's start to
:data:`ALIGN` (SGLang reads the byte ranges it is given); a broadcast bucket is packed without
padding (:func:`pack`), because there SGLang's receiver computes the byte ranges itself from
the names, dtypes and shapes alone: one collective per bucket (:func:`broadcast_stream`).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch

ALIGN = 16
"""Byte alignment of each tensor's start in a flat bucket (the readers slice by start_idx and
end_idx, so padding between tensors is invisible to them)."""


@dataclass(frozen=True)
class TensorMeta:
    """Where one tensor lies in a flattened bucket (SGLang's ``FlattenedTensorMetadata``)."""

    name: str
    shape: tuple[int, ...]
    dtype: torch.dtype
    start_idx: int
    end_idx: int
    numel: int  # bytes


@dataclass
class FlatBucket:
    """One bucket: its tensors' bytes in one ``uint8`` tensor, and where each tensor lies."""

    flattened_tensor: torch.Tensor
    metadata: list[TensorMeta]

    def tensors(self) -> list[tuple[str, torch.Tensor]]:
        """The bucket's tensors (views into the flat tensor), in order."""
        flat = self.flattened_tensor
        return [
            (m.name, flat[m.start_idx : m.end_idx].view(m.dtype).view(m.shape))
            for m in self.metadata
        ]

    @property
    def names(self) -> list[str]:
        return [m.name for m in self.metadata]


def nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


def plan_buckets(sizes: Iterable[tuple[str, int]], max_bytes: int) -> list[list[str]]:
    """Names grouped into consecutive buckets of at most ``max_bytes`` (one oversized tensor
    makes a bucket alone). ``sizes``: (name, bytes) in sync order."""
    if max_bytes <= 0:
        raise ValueError(f"bucket size must be > 0 bytes, got {max_bytes}")
    buckets: list[list[str]] = []
    current: list[str] = []
    used = 0
    for name, size in sizes:
        if current and used + size > max_bytes:
            buckets.append(current)
            current, used = [], 0
        current.append(name)
        used += size
    if current:
        buckets.append(current)
    return buckets


def plan_weight_buckets(weights: Mapping[str, torch.Tensor], max_bytes: int) -> list[list[str]]:
    """:func:`plan_buckets` over a state dict, in its order."""
    return plan_buckets(((k, nbytes(v)) for k, v in weights.items()), max_bytes)


def flatten(
    named: Iterable[tuple[str, torch.Tensor]],
    device: str | torch.device,
    align: int = ALIGN,
    out: torch.Tensor | None = None,
) -> FlatBucket:
    """One bucket of ``named`` tensors, flattened into a byte tensor on ``device``, each tensor
    starting at a multiple of ``align`` bytes (1: packed, :func:`pack`). ``out``: a ``uint8``
    buffer on ``device`` at least the bucket's size that several tensors are copied into (its
    head; reused from bucket to bucket, it is allocated and first touched once)."""
    parts, metas, pos = [], [], 0
    for name, t in named:
        pad = -pos % align  # every tensor starts aligned, so its bytes view back as its dtype
        if pad:
            parts.append(torch.zeros(pad, dtype=torch.uint8, device=t.device))
            pos += pad
        raw = t.detach().contiguous().reshape(-1).view(torch.uint8)
        metas.append(TensorMeta(name, tuple(t.shape), t.dtype, pos, pos + raw.numel(), raw.numel()))
        parts.append(raw)
        pos += raw.numel()
    if not parts:
        raise ValueError("cannot flatten an empty bucket")
    if len(parts) == 1:  # a tensor alone is sent as it lies (no copy on its device)
        return FlatBucket(parts[0].to(device), metas)
    moved = [p.to(device) for p in parts]
    if out is not None and out.numel() >= pos:
        return FlatBucket(torch.cat(moved, out=out[:pos]), metas)
    return FlatBucket(torch.cat(moved), metas)


class WeightStream:
    """The actor's weights for one sync, made one bucket at a time in the plan's order.

    A backend whose weights are sharded gathers a bucket's tensors only when it is asked for
    it, on the device they live on, and lets go of the previous bucket first: the extra memory
    of an export is one bucket (the largest tensor when it alone exceeds the bound), not the
    model. Under FSDP every worker of the group asks for every bucket in the same order (each
    gather is a collective). ``produce(names)`` makes one bucket, ``{name: tensor}``."""

    def __init__(
        self, plan: list[list[str]], produce: Callable[[list[str]], dict[str, torch.Tensor]]
    ) -> None:
        self.plan = plan
        self._produce = produce
        self._index = -1
        self._current: dict[str, torch.Tensor] | None = None

    @classmethod
    def of(
        cls,
        weights: Mapping[str, torch.Tensor],
        max_bytes: int | None = None,
        plan: list[list[str]] | None = None,
    ) -> WeightStream:
        """A stream over weights already held whole (``plan``, else buckets of ``max_bytes``)."""
        if plan is None:
            if max_bytes is None:
                raise ValueError("WeightStream.of needs a plan or a bucket size")
            plan = plan_weight_buckets(weights, max_bytes)
        return cls(plan, lambda names: {n: weights[n] for n in names})

    def __bool__(self) -> bool:
        return bool(self.plan)

    def mapped(
        self, fn: Callable[[dict[str, torch.Tensor]], dict[str, torch.Tensor]]
    ) -> WeightStream:
        """The same buckets, each made by this stream and then passed through ``fn`` (names
        changed, tensors split: the engine's layout)."""
        return WeightStream(self.plan, lambda names: fn(self._produce(names)))

    def bucket(self, index: int) -> dict[str, torch.Tensor]:
        """Bucket ``index``: the current one again, or the next (the one before is dropped)."""
        if index == self._index and self._current is not None:
            return self._current
        if index != self._index + 1:
            raise RuntimeError(
                f"weight buckets are made in order: bucket {index} asked for after {self._index}"
            )
        self._current = None  # the previous bucket goes before this one is gathered
        self._current = self._produce(self.plan[index])
        self._index = index
        return self._current

    def drain(self) -> None:
        """Make every bucket not made yet and drop it (a worker joining a collective export)."""
        for i in range(self._index + 1, len(self.plan)):
            self.bucket(i)
            self._current = None

    def materialise(self) -> dict[str, torch.Tensor]:
        """Every bucket from the first, gathered into one CPU dict (the whole model)."""
        out: dict[str, torch.Tensor] = {}
        for i in range(len(self.plan)):
            out.update((k, v.cpu()) for k, v in self.bucket(i).items())
        self._current = None
        return out


def bucket_meta(
    weights: Mapping[str, torch.Tensor], names: list[str]
) -> tuple[list[str], list[str], list[list[int]]]:
    """(names, dtype names, shapes) of a bucket, as ``update_weights_from_distributed`` takes
    them (dtypes as ``torch`` attribute names: ``bfloat16``, ``float32``...)."""
    dtypes = [str(weights[n].dtype).removeprefix("torch.") for n in names]
    shapes = [list(weights[n].shape) for n in names]
    return list(names), dtypes, shapes


# ---------------------------------------------------------------------------------------------
# Packed buckets: one collective per bucket (the disaggregated sync)
# ---------------------------------------------------------------------------------------------
# SGLang's receiver of ``update_weights_from_distributed(load_format="flattened_bucket")``
# (``FlattenedTensorBucket.empty``) lays a bucket out from (names, dtypes, shapes) alone: the
# tensors' bytes back to back in that order, no padding, and it refuses a tensor whose byte
# offset is not a multiple of its element size (its bytes could not be viewed as its dtype).
# So the sender packs exactly so, and starts a new collective where a tensor would land
# unaligned (mixed dtypes only: a bf16 tensor of odd length before a float32 one).


def packed_groups(
    named: Iterable[tuple[str, torch.Tensor]],
) -> list[list[tuple[str, torch.Tensor]]]:
    """``named`` (one bucket) cut into consecutive runs each packable without padding: a run
    ends before a tensor whose packed byte offset is not a multiple of its element size."""
    groups: list[list[tuple[str, torch.Tensor]]] = []
    current: list[tuple[str, torch.Tensor]] = []
    pos = 0
    for name, t in named:
        if current and pos % t.element_size():
            groups.append(current)
            current, pos = [], 0
        current.append((name, t))
        pos += nbytes(t)
    if current:
        groups.append(current)
    return groups


def pack(
    named: Iterable[tuple[str, torch.Tensor]],
    device: str | torch.device,
    out: torch.Tensor | None = None,
) -> FlatBucket:
    """One packed bucket (SGLang's ``FlattenedTensorBucket`` layout: no padding); ``named``
    must be one of :func:`packed_groups`' runs; ``out``: as :func:`flatten`'s."""
    bucket = flatten(named, device, align=1, out=out)
    for m in bucket.metadata:
        if m.start_idx % m.dtype.itemsize:
            raise ValueError(f"{m.name}: byte offset {m.start_idx} unaligned for {m.dtype}")
    return bucket


def unpack_empty(
    names: Sequence[str],
    dtypes: Sequence[str],
    shapes: Sequence[Sequence[int]],
    device: str | torch.device,
) -> FlatBucket:
    """The receiving side of :func:`pack`: an empty flat tensor the size of the bucket and where
    each tensor will lie (the torch engine's receiver; SGLang's is its own)."""
    metas, pos = [], 0
    for name, dtype, shape in zip(names, dtypes, shapes, strict=True):
        dt = getattr(torch, dtype)
        size = math.prod(shape) * dt.itemsize
        if pos % dt.itemsize:
            raise ValueError(f"{name}: byte offset {pos} unaligned for {dt}")
        metas.append(TensorMeta(name, tuple(shape), dt, pos, pos + size, size))
        pos += size
    if not metas:
        raise ValueError("cannot receive an empty bucket")
    return FlatBucket(torch.empty(pos, dtype=torch.uint8, device=device), metas)


@dataclass
class SendStats:
    """What one disaggregated sync sent: seconds, payload bytes and collectives."""

    seconds: float = 0.0
    bytes: int = 0
    collectives: int = 0


def broadcast_stream(
    stream: WeightStream,
    group: Any,
    device: str | torch.device,
    receive: Callable[[list[str], list[str], list[list[int]], bool], Any],
    wait: Callable[[Any], Any] = lambda _: None,
) -> SendStats:
    """The sender of a disaggregated sync (rank 0 of ``group``): per bucket of ``stream``, per
    packed run of it (:func:`packed_groups`; one run unless alignment cuts it), the engines are
    told what comes (``receive(names, dtypes, shapes, last)``, whose result ``wait`` waits for
    after the collective) and the run goes as ONE broadcast of its packed bytes."""
    import time

    import torch.distributed as dist

    stats = SendStats()
    t0 = time.perf_counter()
    runs = len(stream.plan)
    staging: torch.Tensor | None = None  # the packing buffer, reused (at most one bucket)
    for i in range(runs):
        groups = packed_groups(stream.bucket(i).items())
        for j, named in enumerate(groups):
            size = sum(nbytes(t) for _, t in named)
            if len(named) > 1 and (staging is None or staging.numel() < size):
                staging = None  # (the smaller one goes before the larger is made)
                staging = torch.empty(size, dtype=torch.uint8, device=device)
            bucket = pack(named, device, out=staging)
            last = i == runs - 1 and j == len(groups) - 1
            names = [n for n, _ in named]
            meta = bucket_meta(dict(named), names)
            pending = receive(*meta, last)
            dist.broadcast(bucket.flattened_tensor, src=0, group=group)
            stats.bytes += bucket.flattened_tensor.numel()
            stats.collectives += 1
            del bucket
            wait(pending)
    stats.seconds = time.perf_counter() - t0
    return stats


# ---------------------------------------------------------------------------------------------
# The weight-update process group (disaggregated engines)
# ---------------------------------------------------------------------------------------------
def init_custom_group(
    backend: str,
    master_address: str,
    master_port: int,
    world_size: int,
    rank: int,
    group_name: str,
    timeout_s: float = 600.0,
) -> Any:
    """Join a process group *beside* the process's default one (if any): rank 0 is the actor's
    leader, ranks ``rank_offset + tp_rank`` the engines' tensor-parallel ranks.

    It is formed the way SGLang's engines form theirs in ``init_weights_update_group`` (a TCP
    rendezvous at ``master_address:master_port``: rank 0 serves the ``TCPStore`` the others
    dial; the store prefixed with ``group_name``), so the actor's side and an SGLang engine's
    side meet in one group. On this host alone (a loopback address) rank 0's store listens on
    ``127.0.0.1`` only and gloo's pairs bind loopback; SGLang dials it all the same.
    """
    from datetime import timedelta

    from torch.distributed import distributed_c10d as c10d

    from ..distributed import is_loopback, loopback_tcp_store

    timeout = timedelta(seconds=timeout_s)
    if is_loopback(master_address):
        store = loopback_tcp_store(master_address, master_port, world_size, rank == 0, timeout)
    else:
        url = f"tcp://{master_address}:{master_port}"
        store, rank, world_size = next(c10d.rendezvous(url, rank, world_size, timeout=timeout))
    store.set_timeout(timeout)
    store = c10d.PrefixStore(group_name, store)
    group, _ = c10d._new_process_group_helper(
        world_size,
        rank,
        [],
        c10d.Backend(backend),
        store,
        group_name=group_name,
        timeout=timeout,
    )
    c10d._world.pg_group_ranks[group] = {i: i for i in range(world_size)}
    return group
