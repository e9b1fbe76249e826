"""Sample sharding between the workers of a role.

(The process groups themselves and the workers' shard identity live in
:mod:`ppojob_trainer.distributed`.)

Samples of a step are numbered ``0 .. N-1``; a role with ``dp`` data-parallel workers gives
worker ``r`` the contiguous range :func:`shard_range`. Routing between roles of different sizes is
by those ranges (:func:`overlap`), never by worker index.
"""

from __future__ import annotations

from collections.abc import Sequence


def shard_range(n: int, size: int, rank: int) -> tuple[int, int]:
    """The ``[start, end)`` sample range of worker ``rank`` of ``size`` over ``n`` samples."""
    if size < 1 or not 0 <= rank < size:
        raise ValueError(f"shard_range: rank {rank} not in a group of size {size}")
    base, extra = divmod(n, size)
    start = rank * base + min(rank, extra)
    return start, start + base + (1 if rank < extra else 0)


def overlap(a: tuple[int, int], b: tuple[int, int]) -> tuple[int, int] | None:
    """The intersection of two ranges, or None when empty."""
    lo, hi = max(a[0], b[0]), min(a[1], b[1])
    return (lo, hi) if lo < hi else None


def balanced_split(tokens: Sequence[int], parts: int) -> list[list[int]]:
    """Positions ``0 .. len(tokens)-1`` dealt into ``parts`` lists of equal size (``parts``
    must divide the count) with balanced token sums: longest first, each round of ``parts``
    positions gives its longest to the part with the fewest tokens so far (a part never
    takes two of one round). Every list is in ascending order."""
    n = len(tokens)
    if parts < 1 or n % parts:
        raise ValueError(f"balanced_split: {n} samples do not split into {parts} equal parts")
    order = sorted(range(n), key=lambda i: (-tokens[i], i))
    out: list[list[int]] = [[] for _ in range(parts)]
    load = [0] * parts
    for r in range(0, n, parts):
        for i, p in zip(
            order[r : r + parts], sorted(range(parts), key=lambda p: (load[p], p)), strict=True
        ):
            out[p].append(i)
            load[p] += tokens[i]
    return [sorted(o) for o in out]


def balanced_shares(
    tokens: Sequence[int], order: Sequence[int], mini_batch: int, dp: int, rank: int
) -> list[list[int]]:
    """Worker ``rank``'s samples of each mini-batch of a step, balanced by tokens over the
    ``dp`` data-parallel workers: the step's samples in ``order`` (the same on every worker)
    cut into mini-batches of ``mini_batch`` (all workers together), each dealt by
    :func:`balanced_split` of its samples' ``tokens``."""
    shares = []
    for s in range(0, len(order), mini_batch):
        mb = list(order[s : s + mini_batch])
        split = balanced_split([tokens[i] for i in mb], dp)
        shares.append([mb[j] for j in split[rank]])
    return shares
