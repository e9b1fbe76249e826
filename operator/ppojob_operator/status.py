"""Pure: RayJob status (+ the PPOJob's spec) -> PPOJob ``status`` (all but ``progress``).

``status.progress`` belongs to the trainer (its ProgressReporter patches it); the operator
never writes it.

RayJob ``jobDeploymentStatus`` / ``jobStatus`` -> PPOJob ``phase``:

=================================  ======================  ====================================
jobDeploymentStatus                jobStatus               phase
=================================  ======================  ====================================
"" / New                           any                     Pending (Suspended if spec.suspend)
Initializing / Retrying / Waiting  any                     Initializing
Running                            RUNNING                 Running
Running                            SUCCEEDED / FAILED /    Running (finishing: KubeRay is
                                   STOPPED                 completing the RayJob)
Running                            other                   Initializing (submitting)
Complete                           SUCCEEDED               Succeeded
Complete                           FAILED / STOPPED        Failed
Failed / ValidationFailed          any                     Failed (RayJob's reason and message)
Suspending / Suspended             any                     Suspended (Pending while Kueue has
                                                           not admitted an unsuspended job)
=================================  ======================  ====================================

Conditions (always the same six types, ``lastTransitionTime`` kept while the status holds):
``Valid``, ``SpecApplied`` (False with reason ``SpecChangeRefused`` when the spec of a started
job changed in anything but ``suspend``: the API server refuses such an edit, so only one made
before ``status.rayJobName`` was written, or under an older CRD, gets here), ``Running``,
``Succeeded``, ``Failed``, ``Suspended``; and, once the operator has restarted the job
(``restarts.py``), ``Restarted`` with the last restart's reason and cause. While a decided
restart waits for its new RayJob the phase is ``Initializing`` with that reason.
"""

from __future__ import annotations

import json
import re
from typing import Any

from ppojob_api.memory_plan import memory_status
from ppojob_api.problems import Problem
from ppojob_api.spec import PPOJob, total_gpus
from ppojob_operator.builders import APPLIED_SPEC_ANNOTATION, applied_spec
from ppojob_operator.restarts import attempt_of

CONDITION_TYPES = ("Valid", "SpecApplied", "Running", "Succeeded", "Failed", "Suspended")
OPERATOR_KEYS = (
    "phase",
    "reason",
    "conditions",
    "observedGeneration",
    "rayJobName",
    "rayClusterName",
    "dashboardURL",
    "gpus",
    "memoryPlan",
    "startTime",
    "completionTime",
    "restarts",
    "disruptions",
    "lastRestart",
)
RESTART_KEYS = ("restarts", "disruptions", "lastRestart")
"""Kept from the previous status by every status this module computes (``restarts``)."""


TRAINER_REASONS = ("GangIncomplete", "Preempted", "Stalled")
"""Reasons the trainer itself names (``<Reason>: ...`` in ``status.progress.error``, and
``ppojob-train: <Reason>: ...`` in its last log line, which Ray keeps in the job's message)."""
_TRAINER_REASON = re.compile(r"(?:^|ppojob-train: )(" + "|".join(TRAINER_REASONS) + r"): ")


def trainer_reason(message: str) -> str | None:
    """The reason the trainer gave for failing, if it named one of :data:`TRAINER_REASONS`."""
    m = _TRAINER_REASON.search(message or "")
    return m.group(1) if m else None


def kueue_waiting(conditions: list[dict[str, Any]] | None) -> tuple[str, str] | None:
    """(reason, message) of a job Kueue holds, from its Workload's conditions: evicted (by a
    preemption: ``Evicted`` True with reason ``Preempted``, Kueue's WorkloadEvictedByPreemption;
    or another eviction), or not admitted for want of quota (``QuotaReserved`` False, with
    Kueue's message). None: nothing to add to "waiting for Kueue". Kueue resets ``Evicted`` to
    False when it admits the Workload again (workload.SetQuotaReservation)."""
    conds = {c.get("type"): c for c in conditions or []}
    evicted = conds.get("Evicted") or {}
    if evicted.get("status") == "True":
        msg = evicted.get("message") or ""
        if evicted.get("reason") == "Preempted":
            return "KueuePreempted", f"preempted by Kueue: {msg}; waiting to be admitted again"
        why = evicted.get("reason") or "Evicted"
        return "KueueEvicted", f"evicted by Kueue ({why}): {msg}; waiting to be admitted again"
    quota = conds.get("QuotaReserved") or {}
    if quota.get("status") == "False" and quota.get("message"):
        return "WaitingForAdmission", f"waiting for Kueue to admit the job: {quota['message']}"
    return None


WAITING_FOR_PODS = ("RayJobInitializing", "RayJobWaiting", "RayJobRetrying", "Submitting")
"""Reasons of an Initializing job that a pod the scheduler cannot place explains better."""


def phase_of(
    rayjob: dict[str, Any],
    *,
    suspend: bool,
    kueue: bool,
    workload: list[dict[str, Any]] | None = None,
) -> tuple[str, str, str]:
    """(phase, reason, message) of a job from its RayJob (and under Kueue, the conditions of
    its Workload while Kueue holds it: ``workload``)."""
    st = rayjob.get("status") or {}
    dep = st.get("jobDeploymentStatus") or ""
    js = st.get("jobStatus") or ""
    message = st.get("message") or ""
    reason = trainer_reason(message) or st.get("reason") or ""
    if dep == "Complete":
        if js == "SUCCEEDED":
            return "Succeeded", "RayJobSucceeded", message or "the Ray job succeeded"
        return "Failed", reason or f"RayJob{js.title() or 'Failed'}", message or f"jobStatus {js}"
    if dep == "Failed":
        return "Failed", reason or "RayJobFailed", message or "the RayJob failed"
    if dep == "ValidationFailed":  # KubeRay rejected the RayJob; it never retries it
        return (
            "Failed",
            reason or "ValidationFailed",
            message or "KubeRay rejected the RayJob (see its events)",
        )
    held = kueue_waiting(workload) if kueue and not suspend else None
    if dep in ("Suspended", "Suspending"):
        if held is not None:
            return "Pending", *held
        if kueue and not suspend:
            return "Pending", "WaitingForAdmission", "waiting for Kueue to admit the job"
        return "Suspended", f"RayJob{dep}", "the job is suspended (spec.suspend)"
    if dep == "Running":
        if js == "RUNNING":
            return "Running", "RayJobRunning", "the trainer is running"
        if js in ("SUCCEEDED", "FAILED", "STOPPED"):
            # the Ray job ended and KubeRay has not marked the RayJob Complete yet (it waits for
            # its submitter to exit): the job ran, and its phase does not step back
            return (
                "Running",
                "RayJobFinishing",
                f"the Ray job ended ({js}); KubeRay is completing it",
            )
        return "Initializing", "Submitting", f"the Ray cluster is up; job status {js or 'unset'}"
    if dep in ("Initializing", "Retrying", "Waiting"):
        why = "retrying with a new Ray cluster" if dep == "Retrying" else "starting the Ray cluster"
        return "Initializing", f"RayJob{dep}", message or why
    if dep in ("", "New"):
        if suspend:
            return "Suspended", "Suspended", "the job is suspended (spec.suspend)"
        if held is not None:
            return "Pending", *held
        if kueue:
            return "Pending", "WaitingForAdmission", "waiting for Kueue to admit the job"
        return "Pending", "RayJobCreated", "waiting for KubeRay"
    return "Pending", "UnknownDeploymentStatus", f"RayJob jobDeploymentStatus {dep!r}"


def _cond(type_: str, ok: bool, reason: str, message: str, gen: int | None) -> dict[str, Any]:
    out: dict[str, Any] = {
        "type": type_,
        "status": "True" if ok else "False",
        "reason": reason,
        "message": message,
    }
    if gen is not None:
        out["observedGeneration"] = gen
    return out


def _phase_cond(
    type_: str, phase: str, reason: str, message: str, gen: int | None
) -> dict[str, Any]:
    """Condition ``type_`` of a job in ``phase``: True with the reason and message when the
    phase is ``type_``, otherwise False with the phase as its reason."""
    on = phase == type_
    return _cond(type_, on, reason if on else phase, message if on else "", gen)


def _running_cond(phase: str, reason: str, message: str, gen: int | None) -> dict[str, Any]:
    """``Running``: True with the reason while running. Pending and Initializing have no
    condition of their own, so on the way there ``Running`` is False with *their* reason and
    message (``WaitingForAdmission``, ``RayJobCreated``, ``RayJobInitializing``, ``Submitting``,
    ...); otherwise False with the phase as its reason."""
    if phase == "Running":
        return _cond("Running", True, reason, message, gen)
    if phase in ("Pending", "Initializing"):
        return _cond("Running", False, reason, message, gen)
    return _cond("Running", False, phase, "", gen)


def _restart_keys(previous: dict[str, Any] | None, rayjob: dict[str, Any] | None) -> dict:
    """The restart counters and record of ``previous``; ``lastRestart.recreated`` turns True
    once ``rayjob`` is another RayJob than the one that failed."""
    prev = previous or {}
    out = {k: prev[k] for k in RESTART_KEYS if prev.get(k) is not None}
    last = out.get("lastRestart")
    recreated = rayjob is not None and attempt_of(rayjob) != last.get("attempt") if last else False
    if last and not last.get("recreated") and recreated:
        out["lastRestart"] = {**last, "recreated": True}
    return out


def _restarted_cond(keys: dict[str, Any], gen: int | None) -> list[dict[str, Any]]:
    last = keys.get("lastRestart")
    if not last:
        return []
    reason = last.get("reason") or "RestartingAfterDisruption"
    return [_cond("Restarted", True, reason, last.get("message", ""), gen)]


def _with_times(conds: list[dict[str, Any]], previous: list[dict[str, Any]], now: str) -> list:
    prev = {c.get("type"): c for c in previous or []}
    for c in conds:
        p = prev.get(c["type"])
        same = p is not None and p.get("status") == c["status"]
        c["lastTransitionTime"] = p.get("lastTransitionTime", now) if same else now  # type: ignore[union-attr]
    return conds


def changed_fields(applied: Any, current: Any, path: str = "spec") -> list[str]:
    """Paths of the fields that differ between two spec dicts (suspend excluded)."""
    if isinstance(applied, dict) and isinstance(current, dict):
        out: list[str] = []
        for key in sorted(set(applied) | set(current)):
            if path == "spec" and key == "suspend":
                continue
            out += changed_fields(applied.get(key), current.get(key), f"{path}.{key}")
        return out
    return [] if applied == current else [path]


def invalid_status(
    problems: list[Problem], *, generation: int | None, previous: dict[str, Any] | None, now: str
) -> dict[str, Any]:
    """Status of a job whose spec is invalid: no children exist."""
    msg = "; ".join(str(p) for p in problems)
    conds = [_cond("Valid", False, "InvalidSpec", msg, generation)]
    conds += [_cond(t, False, "InvalidSpec", "", generation) for t in CONDITION_TYPES[1:]]
    return {
        "phase": "Invalid",
        "reason": "InvalidSpec",
        "conditions": _with_times(conds, (previous or {}).get("conditions", []), now),
        "observedGeneration": generation,
        **_restart_keys(previous, None),
    }


def desired_status(
    job: PPOJob,
    rayjob: dict[str, Any],
    *,
    generation: int | None,
    previous: dict[str, Any] | None,
    now: str,
    scheduler: str = "none",
    trainer_error: str | None = None,
    workload: list[dict[str, Any]] | None = None,
    unplaced: str | None = None,
) -> dict[str, Any]:
    """The operator's part of a valid, started job's status, from its RayJob (``workload``: the
    conditions of its Kueue Workload while Kueue holds it; ``unplaced``: the scheduler's word on
    a pod of the attempt it cannot place, ``pod X: 0/3 nodes are available: ...``).

    ``trainer_error`` is the trainer's own account of a failure (``status.progress.error``, one
    line naming the field and the cause); a failed job's condition carries it."""
    kueue = scheduler == "kueue"
    phase, reason, message = phase_of(
        rayjob, suspend=job.spec.suspend, kueue=kueue, workload=workload
    )
    if phase == "Failed" and trainer_error:
        reason, message = trainer_reason(trainer_error) or "TrainerFailed", trainer_error
    kept = _restart_keys(previous, rayjob)
    last = kept.get("lastRestart") or {}
    if last and not last.get("recreated") and phase == "Failed":
        # the failed attempt is being replaced (restarts.py): not a failed job
        phase, reason, message = "Initializing", last.get("reason", "Restarting"), last["message"]
    elif unplaced and phase == "Initializing" and reason in WAITING_FOR_PODS:
        reason = "Unschedulable"
        message = f"the scheduler cannot place every pod of the job yet: {unplaced}"
    st = rayjob.get("status") or {}
    g = generation
    try:
        applied = json.loads(rayjob["metadata"]["annotations"][APPLIED_SPEC_ANNOTATION])
    except (KeyError, TypeError, ValueError):
        applied = None
    current = applied_spec(job) if applied is not None else None
    # equal dicts (the usual case, on every event of a job) need no walk field by field
    diff = changed_fields(applied, current) if applied is not None and applied != current else []
    if diff:
        spec_cond = _cond(
            "SpecApplied",
            False,
            "SpecChangeRefused",
            "a started job's spec can only change spec.suspend; changed: "
            + ", ".join(diff[:20])
            + ". Revert them, or delete and recreate the job",
            g,
        )
    else:
        spec_cond = _cond("SpecApplied", True, "SpecApplied", "the RayJob matches the spec", g)
    conds = [
        _cond("Valid", True, "SpecValid", "the spec is valid", g),
        spec_cond,
        _running_cond(phase, reason, message, g),
        _phase_cond("Succeeded", phase, reason, message, g),
        _phase_cond("Failed", phase, reason, message, g),
        _phase_cond("Suspended", phase, reason, message, g),
        *_restarted_cond(kept, g),
    ]
    out: dict[str, Any] = {
        "phase": phase,
        "reason": reason or phase,
        "conditions": _with_times(conds, (previous or {}).get("conditions", []), now),
        "observedGeneration": generation,
        "rayJobName": rayjob.get("metadata", {}).get("name"),
        "gpus": total_gpus(job.spec),
        "memoryPlan": memory_status(job.spec),
        **kept,
    }
    for src, dst in (
        ("rayClusterName", "rayClusterName"),
        ("dashboardURL", "dashboardURL"),
        ("startTime", "startTime"),
    ):
        if st.get(src):
            out[dst] = st[src]
    if phase in ("Succeeded", "Failed") and st.get("endTime"):
        out["completionTime"] = st["endTime"]
    return out


def applied_job(rayjob: dict[str, Any], name: str | None) -> PPOJob | None:
    """The job as its RayJob was built (the spec in the RayJob's applied-spec annotation)."""
    from ppojob_api.spec import PPOJobSpec

    try:
        spec = json.loads(rayjob["metadata"]["annotations"][APPLIED_SPEC_ANNOTATION])
        return PPOJob(metadata={"name": name}, spec=PPOJobSpec.model_validate(spec))
    except (KeyError, TypeError, ValueError):
        return None


def invalid_edit_status(
    rayjob: dict[str, Any],
    problems: list[Problem],
    *,
    name: str | None,
    suspend: bool,
    generation: int | None,
    previous: dict[str, Any] | None,
    now: str,
    scheduler: str = "none",
) -> dict[str, Any] | None:
    """Status of a started job whose spec was edited into an invalid one: the RayJob runs on
    unchanged, so phase, rayJobName, dashboardURL, gpus and times still follow it; only
    ``SpecApplied`` turns False (reason ``InvalidSpec``). None if the RayJob's applied spec is
    unreadable."""
    job = applied_job(rayjob, name)
    if job is None:
        return None
    job.spec.suspend = suspend
    out = desired_status(
        job, rayjob, generation=generation, previous=previous, now=now, scheduler=scheduler
    )
    msg = "the new spec is invalid; the running RayJob is unchanged: " + "; ".join(
        str(p) for p in problems
    )
    conds = [
        _cond("SpecApplied", False, "InvalidSpec", msg, generation)
        if c["type"] == "SpecApplied"
        else c
        for c in out["conditions"]
    ]
    out["conditions"] = _with_times(conds, (previous or {}).get("conditions", []), now)
    return out


KEPT_ON_NOTE = ("rayJobName", "rayClusterName", "dashboardURL", "startTime", "completionTime")


def note_status(
    job: PPOJob,
    phase: str,
    reason: str,
    message: str,
    *,
    generation: int | None,
    previous: dict[str, Any] | None,
    now: str,
) -> dict[str, Any]:
    """Status of a valid job that has no RayJob to follow: refused by this installation
    (``Failed``), waiting for a child's name (``Pending``), held before Kueue admission
    (``Suspended``), or whose RayJob was deleted mid-run (``Failed``). The child names and times
    already known are kept."""
    g = generation
    conds = [
        _cond("Valid", True, "SpecValid", "the spec is valid", g),
        _cond("SpecApplied", False, reason, message, g),
        _cond("Running", False, phase, "", g),
        _cond("Succeeded", False, phase, "", g),
        _phase_cond("Failed", phase, reason, message, g),
        _phase_cond("Suspended", phase, reason, message, g),
    ]
    prev = previous or {}
    kept = _restart_keys(prev, None)
    conds += _restarted_cond(kept, g)
    out: dict[str, Any] = {
        "phase": phase,
        "reason": reason,
        "conditions": _with_times(conds, prev.get("conditions", []), now),
        "observedGeneration": generation,
        "gpus": total_gpus(job.spec),
        "memoryPlan": memory_status(job.spec),
        **kept,
    }
    for key in KEPT_ON_NOTE:
        if prev.get(key):
            out[key] = prev[key]
    if phase == "Failed" and not out.get("completionTime"):
        out["completionTime"] = now
    return out


def status_patch(current: dict[str, Any] | None, desired: dict[str, Any]) -> dict[str, Any]:
    """Merge patch turning the operator's keys of ``current`` into ``desired`` ({} if equal)."""
    current = current or {}
    out: dict[str, Any] = {}
    for key in OPERATOR_KEYS:
        want = desired.get(key)
        if current.get(key) != want:
            out[key] = want  # None deletes the key (JSON merge patch)
    return out
