"""The restart timer (``timers.schedule_restart``) holds one attempt: the uid of the failed
RayJob it deletes. A timer of an earlier attempt still waiting when a later attempt fails is
stale: it is cancelled, and the later attempt gets its own timer (deleting that attempt's
RayJob, by its uid), never none."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest

from ppojob_operator import k8s, timers
from ppojob_operator.state import OperatorConfig, State


def rayjob(uid: str, attempt: int) -> dict[str, Any]:
    meta = {"name": "race", "uid": uid, "annotations": {"ppojob.io/attempt": str(attempt)}}
    return {"apiVersion": "ray.io/v1", "kind": "RayJob", "metadata": meta}


@pytest.fixture()
def deleted(monkeypatch: pytest.MonkeyPatch) -> list[tuple[str, str | None]]:
    calls: list[tuple[str, str | None]] = []

    async def adelete(api_version: str, kind: str, ns: str, name: str, *, uid=None) -> bool:
        calls.append((name, uid))
        return True

    monkeypatch.setattr(k8s, "adelete", adelete)
    return calls


def test_a_later_attempts_failure_replaces_an_earlier_attempts_waiting_timer(deleted):
    state = State(OperatorConfig())
    st = state.track(("ns1", "race"))

    async def scenario() -> asyncio.Task[None]:
        st.rayjob = rayjob("uid-0", 0)
        timers.schedule_restart(state, st, 3600)  # attempt 0's retry delay, not over yet
        first = st.restart
        st.rayjob = rayjob("uid-1", 1)  # attempt 0 replaced (deleted by hand), 1 failed too
        timers.schedule_restart(state, st, 0)
        assert st.restart is not first, "attempt 1 got no restart timer of its own"
        assert st.restart is not None and first is not None
        await st.restart
        await asyncio.gather(first, return_exceptions=True)  # its cancellation delivered
        return first

    first = asyncio.run(scenario())
    assert first.cancelled()
    assert deleted == [("race", "uid-1")]


def test_the_same_attempt_scheduled_again_keeps_its_one_timer(deleted):
    state = State(OperatorConfig())
    st = state.track(("ns1", "race"))

    async def scenario() -> None:
        st.rayjob = rayjob("uid-0", 0)
        timers.schedule_restart(state, st, 0)
        first = st.restart
        timers.schedule_restart(state, st, 0)  # a status pass re-run (an operator restart)
        assert st.restart is first
        assert first is not None
        await first

    asyncio.run(scenario())
    assert deleted == [("race", "uid-0")]
