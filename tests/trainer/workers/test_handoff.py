"""The hand-over of objects between roles (ppojob_trainer.workers.handoff), without Ray: in
memory for a one-process run, else through the object store."""

from __future__ import annotations

from collections.abc import Iterator
from types import SimpleNamespace
from typing import Any

import pytest
import torch

from ppojob_trainer.workers import handoff


@pytest.fixture
def store(monkeypatch: pytest.MonkeyPatch) -> Iterator[dict[str, Any]]:
    """A stand-in object store: ``ray.put`` copies, as the store does."""
    objects: dict[str, Any] = {}

    def put(value: Any) -> str:
        ref = f"ref{len(objects)}"
        objects[ref] = (
            {k: v.clone() for k, v in value.items()} if isinstance(value, dict) else value.clone()
        )
        return ref

    monkeypatch.setattr(handoff, "ray", SimpleNamespace(put=put, get=objects.__getitem__))
    yield objects
    handoff.in_memory(False)


def test_in_memory_the_reader_gets_the_object_itself_once(store: dict[str, Any]) -> None:
    handoff.in_memory(True)
    batch = {"ids": torch.arange(4)}
    ref = handoff.put(batch)
    assert isinstance(ref, handoff.LocalRef) and not store  # nothing went to the store
    assert handoff.held() == 1
    assert handoff.get(ref) is batch
    assert handoff.held() == 0
    with pytest.raises(RuntimeError, match="handed over in memory but is gone"):
        handoff.get(ref)


def test_through_the_store_the_reader_gets_a_copy(store: dict[str, Any]) -> None:
    handoff.in_memory(False)
    values = torch.ones(2, 3)
    ref = handoff.put(values)
    assert ref in store and handoff.held() == 0
    got = handoff.get(ref)
    assert torch.equal(got, values) and got is not values


def test_what_a_step_leaves_unread_is_dropped_when_a_later_step_reads(
    store: dict[str, Any],
) -> None:
    handoff.in_memory(True)
    unread = [handoff.put(torch.zeros(1)) for _ in range(3)]  # a round without picks, say
    step = [handoff.put(torch.ones(1)), handoff.put(torch.ones(2))]
    later = handoff.put(torch.ones(3))  # (put after the step's batches: kept)
    handoff.drop_older_than(step)
    assert handoff.held() == 3
    for ref in unread:
        with pytest.raises(RuntimeError):
            handoff.get(ref)
    assert [handoff.get(r).numel() for r in (*step, later)] == [1, 2, 3]
    handoff.drop_older_than(["an ObjectRef"])  # refs of the store: nothing to drop
    handoff.in_memory(False)


def test_reading_a_steps_batches_drops_what_earlier_steps_left_unread(
    store: dict[str, Any],
) -> None:
    """``fetch_range`` (every role's read of a step's rollout parts) drops the local objects
    of earlier steps: a step abandoned at its commit leaves its batch unread."""
    from ppojob_trainer.workers.actor import fetch_range

    handoff.in_memory(True)

    def batch(n: int) -> dict[str, torch.Tensor]:
        return {"prompt_ids": torch.zeros(n, 2), "response_ids": torch.arange(n)[:, None]}

    abandoned = handoff.put(batch(4))  # generated, never read
    ref = handoff.put(batch(4))
    assert handoff.held() == 2
    got = fetch_range([(0, 4, ref)], 1, 3)
    assert got["response_ids"].flatten().tolist() == [1, 2]
    assert handoff.held() == 0  # the step's batch is read (cached per step), the old one gone
    with pytest.raises(RuntimeError):
        handoff.get(abandoned)
