"""Pure: a failed attempt (RayJob status + the trainer's own error) -> restart or fail, by the
job's ``spec.failurePolicy`` (``ppojob_api.failures`` classifies and decides).

The operator owns retries (the RayJob's own ``backoffLimit`` is 0): KubeRay counts every failure,
and a job on a preemptible cluster must not spend its retries on evictions. A restart deletes the
failed RayJob and creates a new one of the same name, which resumes from the newest checkpoint.
Each attempt is told apart by its RayJob's uid and its ``ppojob.io/attempt`` annotation: the
failed one is deleted only with its uid as the delete's precondition (``timers.delete_rayjob``),
so a restart decided about attempt N never deletes attempt N+1.

The restart counters and the last restart live in the PPOJob's status (``restarts``,
``disruptions``, ``lastRestart``), so a restarted operator carries on where it stopped.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from ppojob_api.failures import Decision, PodLoss, classify_evidence, decide, exit_code_of
from ppojob_api.spec import PPOJob
from ppojob_operator.builders import ATTEMPT_ANNOTATION


def attempt_of(rayjob: dict[str, Any] | None) -> int:
    """The RayJob's attempt number (0 when unannotated)."""
    ann = ((rayjob or {}).get("metadata") or {}).get("annotations") or {}
    try:
        return int(ann.get(ATTEMPT_ANNOTATION, 0))
    except (TypeError, ValueError):
        return 0


def next_attempt(status: dict[str, Any]) -> int:
    """The attempt number of the job's next RayJob: one per restart made."""
    return int(status.get("restarts") or 0) + int(status.get("disruptions") or 0)


def attempt_failed(rayjob: dict[str, Any]) -> bool:
    """Whether the RayJob's attempt has ended in failure (KubeRay will not move it again)."""
    st = rayjob.get("status") or {}
    dep = st.get("jobDeploymentStatus") or ""
    return dep == "Failed" or (dep == "Complete" and st.get("jobStatus") not in ("SUCCEEDED",))


def submission_failed(rayjob: dict[str, Any], submitter: str | None) -> dict[str, Any]:
    """The RayJob as failed (``SubmissionFailed``, KubeRay's own reason and line for a failed
    submitter container) when its head pod's submitter exited nonzero (``submitter``:
    ``pods.failed_submitter``) while KubeRay keeps it ``Initializing``, which it would for ever
    (KubeRay v1.6 reads the submitter only once ``Running``); else the RayJob as it is. The
    copy's attempt ends like one KubeRay failed: classified, then restarted or failed."""
    st = rayjob.get("status") or {}
    if not submitter or st.get("jobDeploymentStatus") != "Initializing":
        return rayjob
    if (rayjob.get("spec") or {}).get("suspend"):
        return rayjob  # being suspended (Kueue's eviction, spec.suspend): its pods are going
    failed = {
        **st,
        "jobDeploymentStatus": "Failed",
        "reason": "SubmissionFailed",
        "message": f"{submitter}, while the RayJob was Initializing",
    }
    return {**rayjob, "status": failed}


def failure_cause(rayjob: dict[str, Any], trainer_error: str | None) -> str:
    """One line: KubeRay's reason and the trainer's account (else KubeRay's message)."""
    st = rayjob.get("status") or {}
    reason = st.get("reason") or ""
    text = trainer_error or st.get("message") or f"jobStatus {st.get('jobStatus') or 'unset'}"
    return f"{reason}: {text}" if reason else text


def decision(
    job: PPOJob,
    rayjob: dict[str, Any],
    status: dict[str, Any],
    trainer_error: str | None,
    losses: Sequence[PodLoss] = (),
    error_at: float | None = None,
) -> Decision | None:
    """What to do about the RayJob's failed attempt; None when it has not failed, or when this
    attempt's restart was already decided (``status.lastRestart.attempt``). ``losses``: what
    Kubernetes said of the attempt's pods that went away while it ran; ``error_at``: when the
    trainer wrote ``trainer_error`` (else KubeRay's ``endTime`` dates the failure). The class
    comes from the evidence (``failures.classify_evidence``): the trainer's exit code and
    account first; a pod loss turns only Ray's word for a lost worker (an ActorDiedError names
    no cause), or no account at all, into a disruption, never an error of the trainer's own."""
    if not attempt_failed(rayjob):
        return None
    last = status.get("lastRestart") or {}
    if last and last.get("attempt") == attempt_of(rayjob):
        return None
    if job.spec.suspend:
        return None  # a suspended job is not restarted (resuming it starts a new attempt)
    cause = failure_cause(rayjob, trainer_error)
    st = rayjob.get("status") or {}
    failed_at = error_at if trainer_error else epoch(st.get("endTime"))
    klass, used = classify_evidence(
        cause,
        trainer_error=trainer_error,
        exit_code=exit_code_of(st.get("message")),
        losses=losses,
        failed_at=failed_at,
    )
    if used:
        cause = f"{cause}; {'; '.join(loss.line for loss in used)}"
    policy = job.spec.failure_policy
    if policy.on_stall == "Fail" and "Stalled: " in cause:
        klass = "Permanent"  # spec.failurePolicy.onStall: Fail
    return decide(
        klass,
        cause,
        backoff_limit=job.spec.backoff_limit,
        counted_restarts=int(status.get("restarts") or 0),
        disruption_restarts=int(status.get("disruptions") or 0),
        max_disruptions=policy.max_disruptions,
        on_application_error=policy.on_application_error,
        retry_delay_seconds=policy.retry_delay_seconds,
        resumable=job.spec.checkpoint_volume is not None,
    )


def restart_status(
    status: dict[str, Any], d: Decision, rayjob: dict[str, Any], now: str
) -> dict[str, Any]:
    """The status keys a restart changes: the counters and ``lastRestart``."""
    restarts = int(status.get("restarts") or 0) + (1 if d.counts else 0)
    disruptions = int(status.get("disruptions") or 0)
    if d.failure_class == "Disruption":
        disruptions += 1
    return {
        "restarts": restarts,
        "disruptions": disruptions,
        "lastRestart": {
            "failureClass": d.failure_class,
            "reason": d.reason,
            "message": d.message,
            "time": now,
            "attempt": attempt_of(rayjob),
            "recreated": False,
        },
    }


def pending_restart(status: dict[str, Any], rayjob: dict[str, Any] | None) -> bool:
    """Whether a restart was decided and its new RayJob not yet made: the failed RayJob (or
    none) is what the job has."""
    last = status.get("lastRestart") or {}
    if not last or last.get("recreated"):
        return False
    if rayjob is None:
        return True
    return attempt_of(rayjob) == last.get("attempt")


def restart_delay(status: dict[str, Any], delay_seconds: int, now_s: float) -> float:
    """Seconds left of the restart's delay (counted from ``lastRestart.time``)."""
    from datetime import datetime

    raw = (status.get("lastRestart") or {}).get("time")
    try:
        at = datetime.fromisoformat(str(raw).replace("Z", "+00:00")).timestamp()
    except ValueError:
        return float(delay_seconds)
    return max(0.0, at + delay_seconds - now_s)


def epoch(raw: object) -> float | None:
    """Seconds since the epoch of an RFC 3339 time (``2026-01-02T03:04:05Z``); None if not one."""
    from datetime import datetime

    try:
        return datetime.fromisoformat(str(raw).replace("Z", "+00:00")).timestamp()
    except ValueError:
        return None


def queue_deadline(job: PPOJob, rayjob: dict[str, Any], phase: str, started: bool) -> float | None:
    """When the attempt's queueing ends (epoch seconds, from its RayJob's creation and
    ``spec.scheduling.queueTimeoutSeconds``); None when unbounded or the attempt is past
    queueing (running, or run before, or finished, or suspended)."""
    limit = job.spec.scheduling.queue_timeout_seconds
    if limit is None or started or phase not in ("Pending", "Initializing") or job.spec.suspend:
        return None
    created = epoch((rayjob.get("metadata") or {}).get("creationTimestamp"))
    if created is None:  # (an emulator without creation times: KubeRay's start of the attempt)
        created = epoch((rayjob.get("status") or {}).get("startTime"))
    return None if created is None else created + limit


def unschedulable(pods: list[dict[str, Any]]) -> str | None:
    """The scheduler's message for the first of ``pods`` it could not place (its PodScheduled
    condition), e.g. ``0/10 nodes are available: 2 Insufficient nvidia.com/gpu``."""
    for pod in pods:
        for c in (pod.get("status") or {}).get("conditions") or []:
            if c.get("type") == "PodScheduled" and c.get("status") == "False" and c.get("message"):
                name = (pod.get("metadata") or {}).get("name")
                return f"pod {name}: {c['message']}"
    return None


def queue_timeout_message(
    job: PPOJob, reason: str, message: str, pods: list[dict[str, Any]]
) -> str:
    """Why an attempt's queueing ended: the wait, what it waited for, the scheduler's word."""
    limit = job.spec.scheduling.queue_timeout_seconds
    out = f"not running {limit}s after its RayJob was made (spec.scheduling.queueTimeoutSeconds)"
    out += f"; it was {reason}" + (f": {message}" if message else "")
    why = unschedulable(pods)
    return out + (f"; {why}" if why and why not in out else "")


__all__ = [
    "ATTEMPT_ANNOTATION",
    "attempt_failed",
    "attempt_of",
    "decision",
    "epoch",
    "failure_cause",
    "next_attempt",
    "pending_restart",
    "queue_deadline",
    "queue_timeout_message",
    "restart_delay",
    "restart_status",
    "submission_failed",
    "unschedulable",
]
