"""The status sync of one job: compute the desired status (pure: :func:`desired_of`,
:func:`patch_of`), write it (one merge patch of the keys that changed), then the follow-up
actions (the phase's event, a repaired outside edit's event, a restart's timer, a queue
timeout's verdict).

The operator's status keys are recomputed from the PPOJob and its RayJob
(``status.desired_status``) and patched only when they differ from what is stored (or what we
last wrote), so a quiet job costs no writes.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any

from ppojob_api.failures import Decision
from ppojob_api.problems import Problem
from ppojob_api.spec import PPOJob
from ppojob_operator import k8s, metrics, restarts, timers
from ppojob_operator.scheduling import KUEUE_QUEUE_LABEL, effective_scheduler
from ppojob_operator.state import JobState, State, event_once, now, owned_by, run_started
from ppojob_operator.status import (
    OPERATOR_KEYS,
    desired_status,
    invalid_edit_status,
    invalid_status,
    note_status,
    status_patch,
)


@dataclass
class Desired:
    """What one status pass wants: the status keys, and what the follow-up actions need."""

    status: dict[str, Any]
    decided: Decision | None = None
    """The failure policy's decision on a failed attempt (restarts.decision)."""
    trainer_error: str | None = None
    scheduler: str = "none"
    rayjob: dict[str, Any] | None = None
    deadline: float | None = None
    """The attempt's queueing deadline, not yet passed: the status is synced again then."""
    expired: tuple[str, str] | None = None
    """The deadline passed: the (reason, message) the attempt was queued with."""
    stop: dict[str, Any] | None = None
    """A RayJob the operator failed that KubeRay keeps running (``restarts.submission_failed``):
    the verdict is held (``JobState.note``) and its run stopped (``timers.stop_failed``)."""


@dataclass
class Written:
    """One status pass done: what it wrote, and what its follow-up actions need."""

    body: dict[str, Any]
    want: Desired
    wrote: bool = False
    transition: tuple[str | None, dict[str, Any]] | None = None
    edited: list[str] = field(default_factory=list)
    seen: dict[str, Any] = field(default_factory=dict)


# ---------------------------------------------------------------------------------------------
# Pure: the desired status and its patch
# ---------------------------------------------------------------------------------------------
def desired_of(
    st: JobState,
    body: dict[str, Any],
    parsed: tuple[PPOJob | None, list[Problem]],
    rj: dict[str, Any] | None,
    base: dict[str, Any],
    *,
    gang_default: str | None,
    now: str,
    clock: float,
) -> Desired | None:
    """The status a job should have (None: nothing to write yet). ``base`` is the status as
    last known, ``rj`` the RayJob this PPOJob owns, ``clock`` the time now (epoch seconds)."""
    job, problems = parsed
    generation = body["metadata"].get("generation")
    if problems:
        return Desired(_invalid(body, problems, rj, base, now), rayjob=rj)
    if job is None:
        return None
    note = st.note
    if rj is None or (note is not None and note[0] == "Failed"):
        # a verdict of the operator's own (refused, RayJobDeleted, ImageUnavailable,
        # QueueTimeout) holds over whatever the RayJob says meanwhile, or as it goes
        if note is None:
            return None  # the create handler writes the first status
        status = note_status(job, *note, generation=generation, previous=base, now=now)
        return Desired(status, rayjob=rj)
    return _following(st, body, job, rj, base, gang_default, now, clock)


def _invalid(
    body: dict[str, Any],
    problems: list[Problem],
    rj: dict[str, Any] | None,
    base: dict[str, Any],
    now: str,
) -> dict[str, Any]:
    meta = body["metadata"]
    generation = meta.get("generation")
    desired = None
    if rj is not None:  # a started job edited into an invalid spec
        raw_suspend = (body.get("spec") or {}).get("suspend")
        desired = invalid_edit_status(
            rj,
            problems,
            name=meta.get("name"),
            suspend=raw_suspend is True,
            generation=generation,
            previous=base,
            now=now,
            scheduler=scheduler_of_rayjob(rj),
        )
    if desired is None:  # not started, or its RayJob's applied spec unreadable
        desired = invalid_status(problems, generation=generation, previous=base, now=now)
    return desired


def _following(
    st: JobState,
    body: dict[str, Any],
    job: PPOJob,
    rj: dict[str, Any],
    base: dict[str, Any],
    gang_default: str | None,
    now: str,
    clock: float,
) -> Desired:
    """The status of a job that follows its RayJob (and its failure policy's decision)."""
    sched = effective_scheduler(job, gang_default)
    progress = (body.get("status") or {}).get("progress") or {}
    trainer_error = progress.get("error")
    cluster = (rj.get("status") or {}).get("rayClusterName") or ""
    real = rj
    if not job.spec.suspend:  # (a suspended job is not failed for its stopping submitter)
        rj = restarts.submission_failed(rj, st.failed_submitters.get(cluster))
    lost = list(st.lost_pods.get(cluster, {}).values())
    error_at = restarts.epoch(progress.get("updatedAt")) if trainer_error else None
    decided = restarts.decision(job, rj, base, trainer_error, lost, error_at)
    previous = base
    if decided is not None and decided.action == "Restart":
        previous = {**base, **restarts.restart_status(base, decided, rj, now)}
    desired = desired_status(
        job,
        rj,
        generation=body["metadata"].get("generation"),
        previous=previous,
        now=now,
        scheduler=sched,
        trainer_error=None if previous is not base else trainer_error,
        workload=st.workload,
        unplaced=unplaced(st, cluster),
    )
    out = Desired(desired, decided, trainer_error, sched, rj)
    if rj is not real and decided is not None and decided.action == "Fail":
        out.stop = real  # KubeRay would keep it running: the operator stops it
    started = run_started({**base, "progress": progress})
    deadline = restarts.queue_deadline(job, rj, desired["phase"], started)
    if deadline is not None and clock >= deadline:
        out.expired = desired["reason"], running_message(desired)
    elif deadline is not None:
        out.deadline = deadline
    return out


def trainer_warning(line: str) -> tuple[str, str]:
    """The event (reason, message) of the trainer's ``status.progress.warning``
    (``<Reason>: <message>``; a line without a CamelCase reason is a ``TrainerWarning``)."""
    reason, sep, message = line.partition(": ")
    if sep and reason.isalnum() and reason[:1].isupper():
        return reason, message
    return "TrainerWarning", line


def patch_of(base: dict[str, Any], want: Desired, edited: list[str]) -> dict[str, Any]:
    """The merge patch from ``base`` to the desired status; ``edited`` keys are put back."""
    patch = status_patch(base, want.status)
    for k in edited:
        patch[k] = want.status.get(k)
    decided = want.decided
    if decided is not None and decided.action == "Restart" and want.trainer_error:
        patch["progress"] = {"error": None}  # the failed attempt's: not the next one's
    return patch


def unplaced(st: JobState, cluster: str) -> str | None:
    """The scheduler's message for the first (by name) pod of ``cluster`` it cannot place."""
    for name in sorted(st.unplaced):
        pod_cluster, message = st.unplaced[name]
        if pod_cluster == cluster:
            return message
    return None


def running_message(desired: dict[str, Any]) -> str:
    """The message of the desired status's Running condition."""
    return next(
        (c.get("message", "") for c in desired.get("conditions") or [] if c["type"] == "Running"),
        "",
    )


def scheduler_of_rayjob(rayjob: dict[str, Any]) -> str:
    """The gang scheduler a RayJob was made for, as far as its labels tell."""
    labels = (rayjob.get("metadata") or {}).get("labels") or {}
    return "kueue" if KUEUE_QUEUE_LABEL in labels else "none"


def resource_version(obj: dict[str, Any]) -> int | None:
    """An object's resourceVersion as a number (etcd's revision; None if it is not one)."""
    rv = (obj.get("metadata") or {}).get("resourceVersion")
    return int(rv) if isinstance(rv, str) and rv.isdigit() else None


def outside_edits(stored: tuple[int, dict[str, Any]] | None, body: dict[str, Any]) -> list[str]:
    """The operator's status keys that a write from outside changed: ``body`` is newer than the
    operator's last write (``stored``: its resourceVersion and keys as the API server returned
    them) and holds other values. An event from before that write (the watch lags behind)
    or the trainer's own writes (``status.progress``) are none."""
    rv = resource_version(body)
    if stored is None or rv is None or rv <= stored[0]:
        return []
    status = body.get("status") or {}
    return [k for k in OPERATOR_KEYS if status.get(k) != stored[1].get(k)]


def newest_known(stored: tuple[int, dict[str, Any]] | None, body: dict[str, Any]) -> dict[str, Any]:
    """The operator's status keys as last known: from its own last write's answer, unless the
    watched ``body`` is newer."""
    rv = resource_version(body)
    if stored is not None and (rv is None or rv <= stored[0]):
        return dict(stored[1])
    status = body.get("status") or {}
    return {k: status.get(k) for k in OPERATOR_KEYS}


def merge_patched(current: Any, patch: Any) -> Any:
    """``current`` after a JSON merge patch (RFC 7386): objects merge key by key, null deletes,
    anything else replaces."""
    if not isinstance(patch, dict):
        return patch
    out = dict(current) if isinstance(current, dict) else {}
    for k, v in patch.items():
        if v is None:
            out.pop(k, None)
        else:
            out[k] = merge_patched(out.get(k), v)
    return out


def edited_meanwhile(
    before: dict[str, Any], patch: dict[str, Any], after: dict[str, Any], desired: dict[str, Any]
) -> list[str]:
    """The operator's status keys that the API server's answer to ``patch`` holds with values
    neither ``before`` nor the patch gave them (written from outside in between), and that
    differ from what the operator wants (``desired``)."""
    out = []
    for k in OPERATOR_KEYS:
        want = merge_patched(before.get(k), patch[k]) if k in patch else before.get(k)
        if after.get(k) != want and after.get(k) != desired.get(k):
            out.append(k)
    return out


# ---------------------------------------------------------------------------------------------
# I/O: write, then follow up
# ---------------------------------------------------------------------------------------------
async def sync_status(state: State, st: JobState, rayjob: dict[str, Any] | None = None) -> bool:
    """Write the operator's status keys of one job if they changed, then act on what the status
    says. Returns whether it wrote. A pass holding the state of a job since deleted (or replaced
    by a new one of the same name) writes nothing."""
    done = await _status_pass(state, st, rayjob)
    if done is None:
        return False
    if done.want.expired is not None:
        await _time_out(state, st, done.body, *done.want.expired)
    return done.wrote


async def _status_pass(state: State, st: JobState, rayjob: dict[str, Any] | None) -> Written | None:
    """Compute and write the status, then post its events and act on a restart decision."""
    done = await _write_status(state, st, rayjob)
    if done is None:
        return None
    if done.transition is not None:
        await phase_event(st, done.body, *done.transition)
    if done.edited and done.wrote:
        shown = ", ".join(f"{k}={done.seen.get(k)!r}" for k in done.edited)
        msg = (
            f"status keys the operator owns were changed from outside ({shown}); restored. Only "
            "the operator writes these; the trainer reports in status.progress"
        )
        await k8s.apost_event(done.body, "Warning", "StatusEdited", msg)
    await timers.after_failure(state, st, done.body, done.want.decided)
    warning = ((done.body.get("status") or {}).get("progress") or {}).get("warning")
    if warning:
        await event_once(st, done.body, "Warning", *trainer_warning(str(warning)))
    decided, stop = done.want.decided, done.want.stop
    if stop is not None and decided is not None:
        want = done.want.status  # the verdict as written, held from now on
        failed = next((c for c in want.get("conditions") or [] if c.get("type") == "Failed"), {})
        st.note = ("Failed", want.get("reason") or decided.reason, failed.get("message") or "")
        await timers.stop_failed(st, stop)
    return done


async def _time_out(
    state: State, st: JobState, body: dict[str, Any], reason: str, msg: str
) -> None:
    """The attempt queued past its deadline: fail the job, write that verdict, and delete its
    RayJob. The verdict's write is a second status pass (not a recursion): its RayJob is
    forgotten first, so that pass follows the operator's verdict and cannot time out again."""
    rayjob = await timers.fail_queued(st, body, reason, msg)
    if rayjob is None:
        return
    await _status_pass(state, st, None)
    await timers.delete_rayjob(st.key, rayjob)


async def _write_status(
    state: State, st: JobState, rayjob: dict[str, Any] | None
) -> Written | None:
    """Under the job's lock: the desired status, written if it changed. None: nothing to write
    (no PPOJob, a job forgotten, no status yet) or the PPOJob is gone."""
    async with st.lock:
        body = st.body
        if body is None or not state.current(st):
            return None
        meta = body["metadata"]
        rj = rayjob if rayjob is not None else st.rayjob
        rj = owned_by(rj, meta.get("uid"))  # not an earlier PPOJob's of the same name
        base = st.written or body.get("status") or {}
        gang_default = state.config.gang_default
        parsed = st.parse(body)
        want = desired_of(
            st, body, parsed, rj, base, gang_default=gang_default, now=now(), clock=time.time()
        )
        if want is None:
            return None
        if want.deadline is not None:
            timers.wake_at(state, st, want.deadline, sync_status)
        edited = outside_edits(st.stored, body)
        patch = patch_of(base, want, edited)
        metrics.JOBS.set(st.key, want.status.get("phase"))
        done = Written(body, want, edited=edited)
        done.seen = {k: (body.get("status") or {}).get(k) for k in edited}
        if not patch:
            return done
        return await _apply(st, done, base, patch)


async def _apply(
    st: JobState, done: Written, base: dict[str, Any], patch: dict[str, Any]
) -> Written | None:
    """Patch the status; remember what was written. None: the PPOJob is gone."""
    key, desired = st.key, done.want.status
    before = newest_known(st.stored, done.body)
    got = await k8s.apatch_job_status(key[0], key[1], patch)
    if got is None:
        return None  # the PPOJob is gone
    # an outside write that landed between the read above and this patch, on a key the patch
    # left alone, is in the answer: put back in the same pass (a second write, needed: the
    # first patch left that key alone), or it would be taken for the operator's own from now on
    slipped = edited_meanwhile(before, patch, got.get("status") or {}, desired)
    if slipped:
        done.seen.update({k: (got.get("status") or {}).get(k) for k in slipped})
        done.edited = [*done.edited, *slipped]
        again = await k8s.apatch_job_status(key[0], key[1], {k: desired.get(k) for k in slipped})
        if again is None:
            return None
        got = again
    st.written = desired
    rv = resource_version(got)
    if rv is not None:
        stored = got.get("status") or {}
        st.stored = rv, {k: stored.get(k) for k in OPERATOR_KEYS}
    done.wrote = True
    if "phase" in patch:
        done.transition = (base.get("phase"), desired)
        if desired.get("phase") == "Running" and done.want.rayjob is not None:
            _observe_admission(done.want.rayjob, done.want.scheduler)
    return done


def _observe_admission(rayjob: dict[str, Any], scheduler: str) -> None:
    """The attempt's wait from its RayJob's creation to a running trainer (the metric)."""
    created = restarts.epoch((rayjob.get("metadata") or {}).get("creationTimestamp"))
    if created is not None:
        metrics.ADMISSION_WAIT.labels(scheduler).observe(max(0.0, time.time() - created))


async def phase_event(
    st: JobState, body: dict[str, Any], old: str | None, desired: dict[str, Any]
) -> None:
    """An event for every phase transition (Normal; Warning into Failed or Invalid), with the
    phase's reason and message, so `kubectl describe` and `kubectl get events` tell the story."""
    phase, why = desired.get("phase") or "", desired.get("reason") or "PhaseChanged"
    detail = next(
        (
            c.get("message")
            for c in desired.get("conditions") or []
            if c.get("reason") == why and c.get("message")
        ),
        "",
    )
    msg = f"{old or 'new'} -> {phase}" + (f": {detail}" if detail else "")
    kind = "Warning" if phase in ("Failed", "Invalid") else "Normal"
    await event_once(st, body, kind, why, msg)
