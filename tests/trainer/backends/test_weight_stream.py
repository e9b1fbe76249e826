"""``WeightStream``: buckets made in the plan's order, the previous one dropped before the next
is made (a sharded backend's gathers are collectives: every worker must make them in the same
order)."""

from __future__ import annotations

import pytest
import torch

from ppojob_trainer.backends.weight_sync import WeightStream


def test_buckets_are_made_in_order_and_one_at_a_time() -> None:
    made: list[list[str]] = []
    held: list[int] = []
    stream: WeightStream

    def produce(names: list[str]) -> dict[str, torch.Tensor]:
        held.append(0 if stream._current is None else len(stream._current))
        made.append(names)
        return {n: torch.zeros(2) for n in names}

    stream = WeightStream([["a", "b"], ["c"], ["d"]], produce)
    assert list(stream.bucket(0)) == ["a", "b"]
    assert stream.bucket(0) is stream.bucket(0)  # the current bucket again: not made twice
    with pytest.raises(RuntimeError, match="bucket 2 asked for after 0"):
        stream.bucket(2)
    stream.bucket(1)
    stream.drain()
    assert made == [["a", "b"], ["c"], ["d"]]
    assert held == [0, 0, 0]  # nothing of the previous bucket held while the next is made


def test_a_stream_over_whole_weights_plans_buckets_of_the_bound() -> None:
    weights = {n: torch.full((4,), float(i)) for i, n in enumerate("abc")}  # 16 bytes each
    stream = WeightStream.of(weights, 32)
    assert stream.plan == [["a", "b"], ["c"]]
    assert {k: v.tolist() for k, v in stream.materialise().items()} == {
        k: v.tolist() for k, v in weights.items()
    }
    assert not WeightStream.of({}, 32)


def test_a_packed_bucket_is_unpadded_cut_where_unaligned_and_received_by_layout_alone() -> None:
    """Issue 40, finding 8: the broadcast bucket is packed as SGLang lays it out from names,
    dtypes and shapes (no padding), cut where a tensor would start unaligned; the torch
    engine's receiver (``unpack_empty``) lays it out from the same announcement alone, and a
    reused staging buffer gives the same bytes (SGLang's own receiver: test_sglang_group.py)."""
    from ppojob_trainer.backends.weight_sync import bucket_meta, pack, packed_groups, unpack_empty

    g = torch.Generator().manual_seed(0)
    named = [
        ("a", torch.randn(3, 3, generator=g)),  # 36 bytes
        ("b", torch.randn(3, generator=g).to(torch.bfloat16)),  # 6 bytes: 42
        ("c", torch.randn(2, generator=g)),  # float32 at 42: unaligned, a new run
        ("d", torch.arange(3)),  # int64 at 8: aligned
    ]
    runs = packed_groups(named)
    assert [[n for n, _ in r] for r in runs] == [["a", "b"], ["c", "d"]]
    staging = torch.full((64,), 255, dtype=torch.uint8)
    for run in runs:
        sent = pack(run, "cpu")
        assert sent.flattened_tensor.numel() == sum(t.numel() * t.element_size() for _, t in run)
        assert torch.equal(pack(run, "cpu", out=staging).flattened_tensor, sent.flattened_tensor)
        names = [n for n, _ in run]
        received = unpack_empty(*bucket_meta(dict(run), names), "cpu")
        assert received.metadata == sent.metadata
        received.flattened_tensor.copy_(sent.flattened_tensor)  # what the broadcast does
        for (n, t), (m, r) in zip(run, received.tensors(), strict=True):
            assert n == m and r.dtype == t.dtype and torch.equal(r, t)
    with pytest.raises(ValueError, match="unaligned"):
        pack(named[:3], "cpu")  # a run that was not cut
