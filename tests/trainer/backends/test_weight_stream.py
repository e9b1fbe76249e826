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
