"""Leader election on a ``coordination.k8s.io/v1`` Lease: of several operators (replicas, two
releases, a pod on a NotReady node still running), one acts and the others wait.

kopf's own peering is no mutual exclusion (operators of the same priority only warn about each
other and keep running, and it needs its own KopfPeering CRDs), so the operator runs kopf
standalone and elects itself first, as client-go's ``leaderelection`` does: the holder renews
``spec.renewTime`` every ``retry_s``; another candidate takes the Lease once its record
(holder, renewTime) has not changed for ``leaseDurationSeconds`` of the candidate's own clock
(so clocks need not agree); every write carries the resourceVersion read, so of two candidates
one wins and the other gets 409. A leader that cannot renew for ``renew_deadline_s`` (or sees
another holder) exits at once: no handler of a deposed leader runs on. A leader stopped
gracefully releases the Lease (empty holder), so a waiting one takes over without waiting out
the lease.

:func:`claim` is pure; :class:`Elector` does the Lease's I/O through ``k8s``.
"""

from __future__ import annotations

import asyncio
import logging
import os
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any

from ppojob_operator import k8s

log = logging.getLogger(__name__)

LEASE = ("coordination.k8s.io/v1", "Lease")


@dataclass(frozen=True)
class Timing:
    """client-go's defaults: a 15 s lease, renewed every 2 s, given up after 10 s unrenewed."""

    lease_s: int = 15
    renew_deadline_s: float = 10.0
    retry_s: float = 2.0

    @classmethod
    def for_lease(cls, lease_s: int) -> Timing:
        """The timing of a ``lease_s`` lease, in client-go's proportions (15 / 10 / 2)."""
        return cls(lease_s, lease_s * 2 / 3, lease_s * 2 / 15)


def microtime(epoch: float) -> str:
    """A ``MicroTime`` (RFC 3339 with microseconds, UTC)."""
    whole = time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(epoch))
    return f"{whole}.{int(epoch % 1 * 1e6):06d}Z"


def claim(
    lease: dict[str, Any] | None,
    namespace: str,
    name: str,
    identity: str,
    lease_s: int,
    *,
    expired: bool,
    now: float,
) -> dict[str, Any] | None:
    """The Lease to write to take or renew it (with the resourceVersion read), or None while
    another holder's lease has not ``expired``. Releasing is holding by ``identity`` ""."""
    spec = (lease or {}).get("spec") or {}
    holder = spec.get("holderIdentity") or ""
    if holder and holder != identity and not expired:
        return None
    ours = bool(holder) and holder == identity
    transitions = int(spec.get("leaseTransitions") or 0)
    meta: dict[str, Any] = {"name": name, "namespace": namespace}
    if lease is not None:
        meta["resourceVersion"] = lease["metadata"]["resourceVersion"]
        transitions += 0 if ours or not identity else 1
    return {
        "apiVersion": LEASE[0],
        "kind": LEASE[1],
        "metadata": meta,
        "spec": {
            "holderIdentity": identity,
            "leaseDurationSeconds": lease_s,
            "acquireTime": spec.get("acquireTime") if ours else microtime(now),
            "renewTime": microtime(now),
            "leaseTransitions": transitions,
        },
    }


def _exit_now() -> None:
    log.error("exiting: another operator may act now")
    logging.shutdown()
    os._exit(1)


class Elector:
    """One candidate for the Lease ``namespace/name``."""

    def __init__(
        self,
        namespace: str,
        name: str,
        identity: str,
        timing: Timing | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.namespace, self.name, self.identity = namespace, name, identity
        self.timing = timing or Timing()
        self._clock = clock
        self._seen: tuple[Any, float] | None = None  # (holder, renewTime), when first seen
        self.holder = ""
        self._renewed = -float("inf")

    def _expired(self, lease: dict[str, Any], now: float) -> bool:
        spec = lease.get("spec") or {}
        record = (spec.get("holderIdentity"), spec.get("renewTime"))
        if self._seen is None or self._seen[0] != record:
            self._seen = (record, now)
        duration = spec.get("leaseDurationSeconds") or self.timing.lease_s
        return now - self._seen[1] >= duration

    async def try_hold(self) -> bool:
        """One round: read the Lease, take or renew it if this candidate may. Whether it holds
        it now (any API failure: not)."""
        path = k8s.path_for(*LEASE, self.namespace, self.name)
        try:
            lease = await k8s.aget(*LEASE, self.namespace, self.name)
            now = self._clock()
            expired = lease is None or self._expired(lease, now)
            self.holder = ((lease or {}).get("spec") or {}).get("holderIdentity") or ""
            body = claim(
                lease,
                self.namespace,
                self.name,
                self.identity,
                self.timing.lease_s,
                expired=expired,
                now=time.time(),
            )
            if body is None:
                return False
            if lease is None:
                await k8s.arequest("POST", k8s.path_for(*LEASE, self.namespace), body)
            else:
                await k8s.arequest("PUT", path, body)
        except Exception as exc:  # 409: another candidate wrote first; anything else: retried
            log.debug("lease %s/%s: %s", self.namespace, self.name, exc)
            return False
        self.holder, self._renewed = self.identity, now
        return True

    async def acquire(self) -> None:
        """Wait until this candidate holds the Lease."""
        log.info(
            "waiting for the leader lease %s/%s as %s", self.namespace, self.name, self.identity
        )
        while not await self.try_hold():
            await asyncio.sleep(self.timing.retry_s)
        log.info("became the leader (lease %s/%s, %s)", self.namespace, self.name, self.identity)

    async def keep(self) -> None:
        """Renew the Lease every ``retry_s``; return once leadership is lost: another holder
        seen, or no renewal for ``renew_deadline_s``."""
        while True:
            await asyncio.sleep(self.timing.retry_s)
            # a round never outlasts the renew deadline (the client's own retries and timeouts
            # would take minutes against a black-holed API server, while a standby takes over)
            left = self.timing.renew_deadline_s - (self._clock() - self._renewed)
            try:
                if await asyncio.wait_for(self.try_hold(), timeout=max(left, 0.0)):
                    continue
            except asyncio.TimeoutError:
                log.warning("renewing the leader lease took longer than the renew deadline")
            if self.holder not in ("", self.identity):
                log.error("lost the leader lease to %s", self.holder)
                return
            if self._clock() - self._renewed >= self.timing.renew_deadline_s:
                log.error(
                    "could not renew the leader lease for %.0fs", self.timing.renew_deadline_s
                )
                return

    async def release(self) -> None:
        """Give the Lease up (an empty holder) if this candidate holds it: a graceful stop."""
        try:
            lease = await k8s.aget(*LEASE, self.namespace, self.name)
            if ((lease or {}).get("spec") or {}).get("holderIdentity") != self.identity:
                return
            body = claim(lease, self.namespace, self.name, "", 1, expired=True, now=time.time())
            path = k8s.path_for(*LEASE, self.namespace, self.name)
            await k8s.arequest("PUT", path, body)
        except Exception as exc:  # the lease expires anyway
            log.warning("could not release the leader lease: %s", exc)


async def lead(
    elector: Elector, operate: Awaitable[Any], on_lost: Callable[[], None] = _exit_now
) -> None:
    """Run ``operate`` (kopf) while ``elector`` holds its Lease; on loss call ``on_lost`` (by
    default: exit the process at once); on a graceful end release the Lease."""
    work = asyncio.ensure_future(operate)
    keep = asyncio.ensure_future(elector.keep())
    try:
        done, _ = await asyncio.wait({work, keep}, return_when=asyncio.FIRST_COMPLETED)
        if keep in done:
            on_lost()
            work.cancel()
            return
        work.result()
    finally:
        keep.cancel()
        if not work.done():
            work.cancel()
        await elector.release()


async def standby(elector: Elector, address: str, port: int) -> None:
    """Wait for the Lease, answering ``/healthz`` meanwhile (a waiting replica is alive; kopf,
    which serves it once leading, has not started)."""
    from aiohttp import web

    runner = None
    if port:

        async def healthz(_: web.Request) -> web.Response:
            return web.json_response({"leader": False, "holder": elector.holder})

        app = web.Application()
        app.router.add_get("/healthz", healthz)
        runner = web.AppRunner(app)
        await runner.setup()
        await web.TCPSite(runner, address, port).start()
    try:
        await elector.acquire()
    finally:
        if runner is not None:
            await runner.cleanup()
