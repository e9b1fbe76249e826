"""The operator's timers: a reconcile retried with backoff, a status re-synced at a queueing
deadline, a failed RayJob deleted after the failure policy's restart delay, and the queue
timeout's verdict. Each timer is one task per job at a time, kept on its :class:`JobState`
(cancelled when the job is forgotten); what a timer runs is handed in, so this module calls
back into no reconcile step."""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable
from typing import Any

from ppojob_api.failures import Decision
from ppojob_operator import k8s, metrics, restarts
from ppojob_operator.builders import JOB_LABEL
from ppojob_operator.scheduling import KUEUE_QUEUE_LABEL
from ppojob_operator.state import JobState, State, event_once

log = logging.getLogger(__name__)

Action = Callable[[State, dict[str, Any]], Awaitable[Any]]
"""A step run again later: ``action(state, body)``."""


def retry_later(state: State, st: JobState, why: str, action: Action) -> None:
    """Run ``action(state, body)`` again after a backoff (1 s, doubling, at most
    ``retry_max_s``); nothing for a job forgotten meanwhile."""
    if not state.current(st) or (st.retry is not None and not st.retry.done()):
        return
    delay = min(2.0**st.backoff, state.config.retry_max_s)
    st.backoff += 1
    log.info("%s/%s: %s; retrying in %.0fs", st.key[0], st.key[1], why, delay)

    async def _again() -> None:
        await asyncio.sleep(delay)
        st.retry = None
        if state.current(st) and st.body is not None:
            await action(state, st.body)

    st.retry = asyncio.get_running_loop().create_task(_again())


def wake_at(
    state: State,
    st: JobState,
    deadline: float,
    action: Callable[[State, JobState], Awaitable[Any]],
) -> None:
    """Run ``action(state, st)`` (a status sync) at ``deadline`` (once per job at a time)."""
    if st.queue_timer is not None and not st.queue_timer.done():
        return

    async def _wake() -> None:
        await asyncio.sleep(max(0.0, deadline - time.time()) + 0.05)
        st.queue_timer = None
        if state.current(st):
            await action(state, st)

    st.queue_timer = asyncio.get_running_loop().create_task(_wake())


async def fail_queued(
    st: JobState, body: dict[str, Any], reason: str, message: str
) -> dict[str, Any] | None:
    """The attempt queued past spec.scheduling.queueTimeoutSeconds: the job's verdict (saying
    what it waited for and, from its pods, the scheduler's own reason) and its Warning event.
    Returns the RayJob to delete (forgotten here, so the next status pass writes the verdict),
    or None when there is nothing to fail."""
    job, _ = st.parse(body)
    if job is None or st.rayjob is None:
        return None
    key = st.key
    pods = await k8s.alist("v1", "Pod", key[0], f"{JOB_LABEL}={key[1]}") or []
    msg = restarts.queue_timeout_message(job, reason, message, pods)
    st.note = ("Failed", "QueueTimeout", msg)
    await event_once(st, body, "Warning", "QueueTimeout", msg)
    rayjob = st.rayjob
    st.rayjob = None
    return rayjob


def uid_of(obj: dict[str, Any] | None) -> str | None:
    """An object's uid (None for none, or an object read without one)."""
    return ((obj or {}).get("metadata") or {}).get("uid")


async def delete_rayjob(key: tuple[str, str], rayjob: dict[str, Any]) -> bool:
    """Delete exactly the RayJob ``rayjob`` (an attempt read earlier), so that nothing it holds
    stays held: its uid is the delete's precondition, so a next attempt made under the same
    name since (by a restart, another operator, a user) is never deleted in its place; that
    409 is logged, not counted as an error. Returns whether it deleted."""
    meta = rayjob.get("metadata") or {}
    name = meta.get("name")
    try:
        return await k8s.adelete("ray.io/v1", "RayJob", key[0], name, uid=meta.get("uid"))
    except k8s.Replaced:
        log.info(
            "%s/%s: RayJob %s of attempt %d was already replaced (uid %s is gone); nothing deleted",
            key[0],
            key[1],
            name,
            restarts.attempt_of(rayjob),
            meta.get("uid"),
        )
    except k8s.ApiError as exc:
        metrics.API_ERRORS.labels("delete").inc()
        log.warning("%s/%s: could not delete RayJob %s: %s", key[0], key[1], name, exc)
    return False


async def after_failure(
    state: State, st: JobState, body: dict[str, Any], decided: Decision | None
) -> None:
    """The I/O of a restart decision: its event, the metric, and (after the policy's delay) the
    failed RayJob's deletion, whose DELETED event makes ``reconcile_children`` create the next
    attempt. A decision already written (a restarted operator) gets its deletion scheduled."""
    if decided is not None:
        normal = decided.action == "Restart" and decided.failure_class == "Disruption"
        why, msg = decided.reason, decided.message  # restarts.py: each reason documented
        await event_once(st, body, "Normal" if normal else "Warning", why, msg)
        if decided.action == "Restart":
            metrics.RESTARTS.labels(decided.failure_class).inc()
    status = st.written or body.get("status") or {}
    if st.rayjob is not None and restarts.pending_restart(status, st.rayjob):
        job, _ = st.parse(body)
        delay = 0
        last = status.get("lastRestart") or {}
        if job is not None and last.get("failureClass") != "Disruption":
            delay = job.spec.failure_policy.retry_delay_seconds
        schedule_restart(state, st, restarts.restart_delay(status, delay, time.time()))


def schedule_restart(state: State, st: JobState, delay: float) -> None:
    """Delete the failed RayJob (the one known now: ``st.rayjob``) after ``delay`` seconds (once
    per attempt at a time; a timer still waiting for an earlier attempt is stale and cancelled).
    At its time the timer deletes nothing when the job's RayJob is another attempt's (the
    watch's word) or, through the delete's uid precondition, when the name holds one (the
    API server's word, where the watch lags)."""
    failed = st.rayjob
    if failed is None:
        return
    uid = uid_of(failed)
    if st.restart is not None and not st.restart.done():
        if st.restart_of == uid:
            return
        st.restart.cancel()
    key = st.key
    st.restart_of = uid

    async def _restart() -> None:
        await asyncio.sleep(delay)
        if not state.current(st) or st.rayjob is None:
            return
        name = (failed.get("metadata") or {}).get("name")
        attempt = restarts.attempt_of(failed)
        if uid_of(st.rayjob) != uid:
            log.info(
                "%s/%s: RayJob %s of attempt %d was already replaced by attempt %d; nothing "
                "deleted",
                *key,
                name,
                attempt,
                restarts.attempt_of(st.rayjob),
            )
            return
        log.info("%s/%s: restarting: deleting RayJob %s of attempt %d", *key, name, attempt)
        await delete_rayjob(key, failed)

    st.restart = asyncio.get_running_loop().create_task(_restart())


async def stop_failed(st: JobState, rayjob: dict[str, Any]) -> None:
    """Stop the run of a job the operator failed (an image that cannot be had, a submitter that
    died before KubeRay looked at it), so that no pod of it keeps holding what it was given.
    Under Kueue, which owns ``RayJob.spec.suspend`` (it
    unsuspends a RayJob whose Workload is admitted), the RayJob itself is deleted, with its uid
    as the precondition (never a next attempt made under its name): Kueue then releases the
    quota and its Workload goes with the RayJob. Otherwise the operator owns
    ``RayJob.spec.suspend`` and suspends it (KubeRay removes every pod; the RayJob stays to
    be looked at)."""
    labels = (rayjob.get("metadata") or {}).get("labels") or {}
    if KUEUE_QUEUE_LABEL in labels:
        await delete_rayjob(st.key, rayjob)
        return
    name = rayjob["metadata"]["name"]
    await k8s.apatch("ray.io/v1", "RayJob", st.key[0], name, {"spec": {"suspend": True}})
