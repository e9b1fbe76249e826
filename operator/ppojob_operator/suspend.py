"""``spec.suspend`` of a started job, applied to its run: under Kueue through its Workload's
``spec.active`` (Kueue owns ``RayJob.spec.suspend``: it evicts and suspends the RayJob, and
unsuspends it on readmission), otherwise through ``RayJob.spec.suspend``. Also reads the Kueue
Workload whose conditions explain a held job. (The run of a job the operator failed is stopped by
``timers.stop_failed``: under Kueue by deleting its RayJob, never by writing a field Kueue owns.)"""

from __future__ import annotations

import asyncio
import logging
from typing import Any

import aiohttp

from ppojob_api.spec import PPOJob
from ppojob_operator import k8s, timers
from ppojob_operator.scheduling import (
    KUEUE_QUEUE_LABEL,
    GangScheduler,
    effective_scheduler,
    strategy,
)
from ppojob_operator.state import JobState, State, event_once, key_of
from ppojob_operator.sync import sync_status

log = logging.getLogger(__name__)

# Newest first: Kueue serves v1beta2 from 0.15 and stores it from 0.16 (v1beta1 converted by its
# webhook, to be dropped), and a v1beta1 write to an admitted Workload fails there (Kueue v0.17:
# the v1beta1 schema's CEL rule on priorityClassSource, a field v1beta2 dropped, finds "no such
# key": HTTP 422). Kueue before 0.15 serves only v1beta1.
WORKLOAD_VERSIONS = ("kueue.x-k8s.io/v1beta2", "kueue.x-k8s.io/v1beta1")
KUEUE_JOB_UID_LABEL = "kueue.x-k8s.io/job-uid"


HELD = ("", "New", "Suspending", "Suspended")
"""RayJob deployment states in which Kueue may hold a job (not admitted, or evicted)."""


async def held_workload(rayjob: dict[str, Any]) -> list[dict[str, Any]] | None:
    """The conditions of a Kueue-queued RayJob's Workload while the RayJob is held (so the
    status tells a preemption or Kueue's reason from plain waiting); None otherwise."""
    labels = (rayjob.get("metadata") or {}).get("labels") or {}
    dep = (rayjob.get("status") or {}).get("jobDeploymentStatus") or ""
    if KUEUE_QUEUE_LABEL not in labels or dep not in HELD:
        return None
    try:
        found = await find_workload(rayjob)
    except (k8s.ApiError, aiohttp.ClientError, asyncio.TimeoutError, ValueError) as exc:
        # only an explanation: the status is synced without it (the next event tries again)
        log.warning(
            "cannot read the Kueue Workload of RayJob %s: %s", rayjob["metadata"]["name"], exc
        )
        return None
    return ((found[1].get("status") or {}).get("conditions") or None) if found else None


async def find_workload(rayjob: dict[str, Any]) -> tuple[str, dict[str, Any]] | None:
    """The Kueue Workload of a RayJob: Kueue labels it ``kueue.x-k8s.io/job-uid: <RayJob uid>``
    and makes the RayJob its controller owner. Returns (apiVersion, workload)."""
    meta = rayjob.get("metadata") or {}
    uid, name, ns = meta.get("uid"), meta.get("name"), meta.get("namespace")
    for version in WORKLOAD_VERSIONS:
        selector = f"{KUEUE_JOB_UID_LABEL}={uid}" if uid else None
        items = await k8s.alist(version, "Workload", ns, selector)
        if items is None:
            continue
        for wl in items:
            for ref in (wl.get("metadata") or {}).get("ownerReferences") or []:
                same_uid = not uid or ref.get("uid") in (None, uid)
                if ref.get("kind") == "RayJob" and ref.get("name") == name and same_uid:
                    return version, wl
        return None
    return None


async def apply_suspend(
    state: State, st: JobState, body: dict[str, Any], job: PPOJob, rayjob_name: str
) -> None:
    """Make the RayJob's run follow ``spec.suspend``. Under Kueue through the Workload's
    ``spec.active`` (Kueue evicts and suspends the RayJob, and unsuspends it on readmission);
    otherwise through ``RayJob.spec.suspend``."""
    gang = strategy(effective_scheduler(job, state.config.gang_default))
    if gang.owns_suspend:
        await _suspend_workload(state, st, body, job.spec.suspend, rayjob_name)
    else:
        await _suspend_rayjob(st, body, job.spec.suspend, rayjob_name, gang)


async def _suspend_workload(
    state: State, st: JobState, body: dict[str, Any], suspend: bool, rayjob_name: str
) -> None:
    """Under Kueue: the Workload's ``spec.active`` (retried until Kueue has made it)."""
    key = st.key
    rj = st.rayjob
    if rj is None:
        rj = await k8s.aget("ray.io/v1", "RayJob", key[0], rayjob_name)
    if rj is None:
        return
    found = await find_workload(rj)
    if found is None:
        if suspend:  # Kueue has not made the Workload yet: try again shortly
            why = "waiting for Kueue's Workload to suspend it"
            timers.retry_later(state, st, why, _suspend_again)
        return
    version, wl = found
    active = (wl.get("spec") or {}).get("active", True) is not False
    if active == (not suspend):
        return
    wl_meta = wl["metadata"]
    patch = {"spec": {"active": not suspend}}
    if await k8s.apatch(version, "Workload", key[0], wl_meta["name"], patch) is not None:
        await event_once(
            st,
            body,
            "Normal",
            "SuspendChanged",
            f"Kueue Workload {wl_meta['name']} "
            + ("deactivated (job suspended)" if suspend else "reactivated (job queued)"),
        )


async def _suspend_rayjob(
    st: JobState, body: dict[str, Any], suspend: bool, rayjob_name: str, gang: GangScheduler
) -> None:
    """Without Kueue: ``RayJob.spec.suspend`` (a resumed run is a new attempt)."""
    key = st.key
    rj = st.rayjob
    differs = rj is None or bool((rj.get("spec") or {}).get("suspend")) != suspend
    if not differs:
        return
    patch: dict[str, Any] = {"spec": {"suspend": suspend}}
    if not suspend:
        # the new Ray cluster is a new attempt (YuniKorn: a fresh application)
        labels = gang.attempt_labels(key[0], key[1], body["metadata"].get("uid"), st.attempts + 1)
        if labels:
            st.attempts += 1
            patch["metadata"] = {"labels": labels}
    if await k8s.apatch("ray.io/v1", "RayJob", key[0], rayjob_name, patch) is not None:
        if rj is not None:
            rj.setdefault("spec", {})["suspend"] = suspend
        await event_once(
            st,
            body,
            "Normal",
            "SuspendChanged",
            f"RayJob {rayjob_name} " + ("suspended" if suspend else "resumed"),
        )


async def _suspend_again(state: State, body: dict[str, Any]) -> None:
    st = state.get(key_of(body))
    if st is None:
        return
    job, _ = st.parse(body)
    name = (body.get("status") or {}).get("rayJobName")
    if job is not None and name:
        await apply_suspend(state, st, body, job, name)
        await sync_status(state, st)
