"""Pure and in-process parts of leader election (``leader.py``): what a candidate writes to the
Lease (:func:`leader.claim`), when it may take another holder's Lease (its record unchanged
for the lease time on the candidate's own clock), and that losing the Lease stops the
operator. The election itself, between two operator processes, runs in
tests/cluster/test_leader.py."""

from __future__ import annotations

import asyncio
from typing import Any

from ppojob_operator import leader


def lease(holder: str, renew: str = "2026-01-01T00:00:00.000000Z", rv: str = "7") -> dict:
    spec = {
        "holderIdentity": holder,
        "leaseDurationSeconds": 15,
        "acquireTime": "2026-01-01T00:00:00.000000Z",
        "renewTime": renew,
        "leaseTransitions": 3,
    }
    return {"metadata": {"name": "l", "namespace": "ns", "resourceVersion": rv}, "spec": spec}


def test_claim_takes_a_free_or_expired_lease_renews_its_own_and_waits_otherwise() -> None:
    now = 1767225600.5  # 2026-01-01T00:00:00.5Z
    new = leader.claim(None, "ns", "l", "me", 15, expired=True, now=now)
    assert new is not None and "resourceVersion" not in new["metadata"]
    assert new["spec"]["holderIdentity"] == "me" and new["spec"]["leaseTransitions"] == 0
    assert new["spec"]["renewTime"] == "2026-01-01T00:00:00.500000Z"
    assert leader.claim(lease("other"), "ns", "l", "me", 15, expired=False, now=now) is None
    taken = leader.claim(lease("other"), "ns", "l", "me", 15, expired=True, now=now)
    assert taken is not None
    assert taken["metadata"]["resourceVersion"] == "7"  # 409 if anyone wrote since the read
    assert taken["spec"]["leaseTransitions"] == 4
    assert taken["spec"]["acquireTime"] == "2026-01-01T00:00:00.500000Z"
    renewed = leader.claim(lease("me"), "ns", "l", "me", 15, expired=False, now=now)
    assert renewed is not None and renewed["spec"]["leaseTransitions"] == 3
    assert renewed["spec"]["acquireTime"] == "2026-01-01T00:00:00.000000Z"
    released = leader.claim(lease(""), "ns", "l", "me", 15, expired=False, now=now)
    assert released is not None and released["spec"]["holderIdentity"] == "me"


def test_another_holders_lease_expires_on_the_candidates_own_clock() -> None:
    """Not by comparing renewTime with this host's clock: the record must stand still for the
    lease time from when this candidate first saw it."""
    t = [1000.0]
    el = leader.Elector("ns", "l", "me", clock=lambda: t[0])
    old = lease("other", renew="2000-01-01T00:00:00.000000Z")  # a renewTime long past
    assert not el._expired(old, t[0])
    t[0] += 14.9
    assert not el._expired(old, t[0])
    renewed = lease("other", renew="2000-01-01T00:00:10.000000Z")
    t[0] += 10
    assert not el._expired(renewed, t[0])  # a renewal restarts the count
    t[0] += 15
    assert el._expired(renewed, t[0])


class _Lost:
    """An elector whose Lease is lost at once."""

    holder = "other"

    async def keep(self) -> None:
        return None

    async def release(self) -> None:
        self.released = True


def test_losing_the_lease_stops_the_operator() -> None:
    calls: list[str] = []

    async def scenario() -> asyncio.Future[Any]:
        work = asyncio.get_running_loop().create_future()  # kopf, running until cancelled
        await leader.lead(_Lost(), work, on_lost=lambda: calls.append("lost"))  # type: ignore[arg-type]
        return work

    work = asyncio.run(scenario())
    assert calls == ["lost"]
    assert work.cancelled()


def test_a_renewal_that_hangs_gives_the_lease_up_at_the_renew_deadline(monkeypatch) -> None:
    """The API server stops answering (a black-holed connection): the leader's renewal round is
    cut at the renew deadline and ``keep`` returns (the operator stops) well before a standby
    may take the Lease, whatever the client's own retries and timeouts would have waited."""
    from ppojob_operator import k8s

    async def hangs(*args: Any, **kwargs: Any) -> Any:
        await asyncio.Event().wait()  # never answers

    monkeypatch.setattr(k8s, "aget", hangs)
    timing = leader.Timing(lease_s=3, renew_deadline_s=0.4, retry_s=0.05)
    elector = leader.Elector("ns", "l", "me", timing)
    elector.holder = "me"

    async def scenario() -> float:
        loop = asyncio.get_running_loop()
        elector._renewed = elector._clock()
        t = loop.time()
        await asyncio.wait_for(elector.keep(), timeout=timing.lease_s)
        return loop.time() - t

    took = asyncio.run(scenario())
    assert took < timing.lease_s, took
