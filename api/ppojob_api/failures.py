"""Failure classes and the restart decision: pure functions, shared by the trainer (which names its
own failures by exit code and a ``<Reason>: ...`` line) and the operator (which classifies a
failed attempt and applies the decision).

In the spirit of JobSet's ``failurePolicy`` rules and PyTorchJob's ``restartPolicy: ExitCode``:

=================  =============================================  =================================
class              seen as                                        action (spec.failurePolicy)
=================  =============================================  =================================
``Disruption``     the trainer's ``Preempted`` exit (code 75,     restart from the newest
                   SIGTERM -> checkpoint -> exit), a pod evicted   checkpoint without counting
                   or deleted, a node lost, the Ray head pod       against ``backoffLimit``
                   gone, Kueue evicting the workload               (bounded by ``maxDisruptions``)
``Application``    the trainer failed (reward function raised,     ``onApplicationError: Restart``
                   a worker OOMKilled, any other error)            counts one of ``backoffLimit``;
                                                                   ``Fail`` fails at once
``Permanent``      the trainer's config is refused (exit 1,        fail at once
                   ``InvalidConfig``), a worker could not start,
                   the gang can never fit
=================  =============================================  =================================

A pod deleted or disrupted while an attempt ran is evidence, not a verdict
(:func:`classify_evidence`): it makes a disruption of Ray's word for a lost worker (an
``ActorDiedError`` names no cause) when it came first, or when the node was lost; an error of the
trainer's own stays an application error.

Imports nothing beyond the standard library and the API's own models.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal

PREEMPTED_EXIT_CODE = 75
"""The trainer's exit code after a SIGTERM it answered with a checkpoint (sysexits' EX_TEMPFAIL:
"a temporary failure; the user is invited to retry")."""

CONFIG_EXIT_CODE = 1
"""The trainer's exit code for a config it refuses."""

FailureClass = Literal["Disruption", "Application", "Permanent"]

_DISRUPTION_PATTERNS = [
    re.compile(p, re.IGNORECASE)
    for p in (
        r"\bPreempted: ",
        r"\bStalled: ",  # a hung collective or a lost node, named by the trainer's watchdog
        rf"exit(?:ed)? (?:with )?(?:exit )?code {PREEMPTED_EXIT_CODE}\b",
        r"\bevicted\b",
        r"\bDisruptionTarget\b",
        r"\bnode (?:was )?(?:lost|not ready|deleted|drained)\b",
        r"Ray head pod not found",
        r"\bhead pod\b.*\b(?:deleted|not found|gone)\b",
        r"\bpod (?:was )?deleted\b",
        r"\bpod [\w.-]+ (?:was )?deleted\b",  # the operator's own line for a lost pod
        r"\bThe node (?:had|was)\b",
        r"\bits node (?:has )?died\b",
        r"\bnode [\w.:-]+ (?:was|has been) (?:terminated|marked dead|preempted)\b",
    )
]
_PERMANENT_PATTERNS = [
    re.compile(p, re.IGNORECASE)
    for p in (
        r"\bInvalidConfig: ",
        rf"exit(?:ed)? (?:with )?(?:exit )?code {CONFIG_EXIT_CODE}\b",
        r"could not start: ",
        r"\bGangIncomplete: ",
        r"\bcan never fit\b",
        r"^(?:DeadlineExceeded|PreRunningDeadlineExceeded|ValidationFailed)\b",
    )
]

_SUBMITTER_EXIT = re.compile(r"\bcontainer [\w.-]*submitter terminated with exit code \d+", re.I)
"""KubeRay's line for a failed SidecarMode submitter container (``ray-job-submitter``). The
submitter runs ``ray job submit``, which exits 1 both when the Ray job failed, whatever the
trainer's own exit code (75 after a preemption included), and when it could not submit or
follow the job: its code is never read as the trainer's."""


def classify(message: str, *, exit_code: int | None = None) -> FailureClass:
    """The class of a failed attempt from what is known of it: the trainer's exit code when one
    is known, else the messages (the trainer's ``status.progress.error``, the RayJob's message
    and reason, a pod's status reason), joined."""
    if exit_code == PREEMPTED_EXIT_CODE:
        return "Disruption"
    if exit_code == CONFIG_EXIT_CODE:
        return "Permanent"
    text = _SUBMITTER_EXIT.sub("submitter container failed", message or "")
    if any(p.search(text) for p in _DISRUPTION_PATTERNS):
        return "Disruption"
    if any(p.search(text) for p in _PERMANENT_PATTERNS):
        return "Permanent"
    return "Application"


DISRUPTION_TARGET_REASONS = frozenset(
    {
        "PreemptionByScheduler",
        "DeletionByTaintManager",
        "EvictionByEvictionAPI",
        "DeletionByPodGC",
        "TerminationByKubelet",
    }
)
"""The reasons of a pod's ``DisruptionTarget`` condition (``k8s.io/api/core/v1``): the scheduler
preempted it, the taint manager deletes it (a ``NoExecute`` taint, e.g. its node unreachable), the
eviction API evicts it (a drain), pod GC deletes it (its node is gone), the kubelet terminates it
(node pressure, graceful node shutdown)."""

NODE_LOSS_REASONS = frozenset({"DeletionByTaintManager", "DeletionByPodGC", "NodeLost"})
"""A pod lost with its node: Kubernetes notices (and says so) minutes after the worker on it
died, so this evidence explains a lost worker whenever it comes."""

_NAMES_NO_CAUSE = re.compile(
    r"ActorDiedError|RayActorError|ActorUnavailableError|NodeDiedError|WorkerCrashedError|"
    r"OwnerDiedError|ObjectLostError|LocalRayletDiedError|\ba Ray worker died\b|"
    r"\bactor died unexpectedly\b|\braylet (?:died|exited)\b",
    re.IGNORECASE,
)
"""Ray's words for a worker that went away: they name no cause (the pod's evidence does)."""

_EXIT_CODE = re.compile(r"\bfailed with exit code (\d+)\b")
"""Ray's line for a failed entrypoint (KubeRay copies it into the RayJob's message)."""


@dataclass(frozen=True)
class PodLoss:
    """What Kubernetes said about one pod of an attempt that went away (or was told to)."""

    pod: str
    reason: str | None = None
    """The ``DisruptionTarget`` condition's reason, else the pod's status reason (``Evicted``,
    ``NodeLost``); None for a plain deletion (a person, KubeRay's own clean-up)."""
    at: float | None = None
    """When (epoch seconds): the condition's transition, else the deletion's request."""

    @property
    def line(self) -> str:
        if self.reason is None:
            return f"pod {self.pod} was deleted"
        return f"pod {self.pod} was disrupted ({self.reason})"


def exit_code_of(message: str | None) -> int | None:
    """The trainer's exit code in Ray's ``... failed with exit code N`` line; None if absent."""
    found = _EXIT_CODE.search(message or "")
    return int(found.group(1)) if found else None


def names_no_cause(account: str | None) -> bool:
    """Whether the trainer's account of its failure is Ray's word for a lost worker (an
    ``ActorDiedError``, a dead node) rather than an error of its own (a reward function that
    raised)."""
    return bool(account) and _NAMES_NO_CAUSE.search(account or "") is not None


def explains(loss: PodLoss, failed_at: float | None) -> bool:
    """Whether ``loss`` can have caused a failure seen at ``failed_at``: a node's loss always
    can (noticed late); any other loss only if it came first (a pod deleted after the failure,
    e.g. KubeRay's clean-up with ``ttlSecondsAfterFinished: 0``, is its consequence)."""
    if loss.reason in NODE_LOSS_REASONS:
        return True
    return failed_at is None or loss.at is None or loss.at <= failed_at


def classify_evidence(
    cause: str,
    *,
    trainer_error: str | None,
    exit_code: int | None = None,
    losses: Sequence[PodLoss] = (),
    failed_at: float | None = None,
) -> tuple[FailureClass, list[PodLoss]]:
    """The class of a failed attempt from all the evidence, and the pod losses that decided it.

    The trainer's own word comes first: exit 75 or ``Preempted: `` is a disruption (it
    checkpointed on a stop; the pod losses that explain the stop are returned, to be named);
    exit 1 or a refused config is permanent. An error of the trainer's
    own (anything but Ray's word for a lost worker) stays an application error even when a pod
    of the attempt was deleted or disrupted while it ran. A lost worker (or no account at all) is
    a disruption when a pod loss explains it (:func:`explains`), else an application error."""
    klass = classify(cause, exit_code=exit_code)
    if klass == "Disruption":  # the trainer said so; the losses that explain it are named
        return klass, [loss for loss in losses if explains(loss, failed_at)]
    if klass != "Application":
        return klass, []
    if trainer_error and not names_no_cause(trainer_error):
        return "Application", []
    if (
        exit_code is not None
        and exit_code < 128
        and not trainer_error
        and not names_no_cause(cause)
    ):
        return "Application", []  # the trainer exited on its own (not by a signal), unwritten
    used = [loss for loss in losses if explains(loss, failed_at)]
    return ("Disruption", used) if used else ("Application", [])


@dataclass(frozen=True)
class Decision:
    """What to do about one failed attempt."""

    action: Literal["Restart", "Fail"]
    failure_class: FailureClass
    reason: str
    """CamelCase reason of the condition and event (``RestartingAfterDisruption``,
    ``RestartingAfterError``, ``BackoffLimitExceeded``, ``DisruptionLimitExceeded``,
    ``PermanentFailure``, ``ApplicationError``)."""
    message: str
    delay_seconds: int = 0
    """Wait this long before the restart."""
    counts: bool = False
    """Whether this restart counts against backoffLimit."""


def decide(
    failure_class: FailureClass,
    cause: str,
    *,
    backoff_limit: int,
    counted_restarts: int,
    disruption_restarts: int,
    max_disruptions: int,
    on_application_error: Literal["Restart", "Fail"],
    retry_delay_seconds: int,
    resumable: bool,
) -> Decision:
    """The restart decision for a failed attempt of class ``failure_class``, given the restarts
    made so far (``counted_restarts`` against ``backoff_limit``, ``disruption_restarts`` against
    ``max_disruptions``). ``resumable``: a checkpoint volume keeps checkpoints across attempts,
    so a restart loses no completed step (without one a restart starts over)."""
    where = "the newest checkpoint" if resumable else "step 0 (no spec.checkpointVolume)"
    if failure_class == "Permanent":
        return Decision("Fail", failure_class, "PermanentFailure", f"not retried: {cause}")
    if failure_class == "Disruption":
        if disruption_restarts < max_disruptions:
            n = disruption_restarts + 1
            return Decision(
                "Restart",
                failure_class,
                "RestartingAfterDisruption",
                f"disruption {n} of at most {max_disruptions} (not counted against "
                f"backoffLimit); restarting from {where}: {cause}",
                delay_seconds=0,
            )
        return Decision(
            "Fail",
            failure_class,
            "DisruptionLimitExceeded",
            f"{disruption_restarts} disruptions, spec.failurePolicy.maxDisruptions is "
            f"{max_disruptions}: {cause}",
        )
    if on_application_error == "Fail":
        return Decision(
            "Fail",
            failure_class,
            "ApplicationError",
            f"spec.failurePolicy.onApplicationError is Fail: {cause}",
        )
    if counted_restarts < backoff_limit:
        n = counted_restarts + 1
        return Decision(
            "Restart",
            failure_class,
            "RestartingAfterError",
            f"retry {n} of spec.backoffLimit {backoff_limit} in {retry_delay_seconds}s, from "
            f"{where}: {cause}",
            delay_seconds=retry_delay_seconds,
            counts=True,
        )
    return Decision(
        "Fail",
        failure_class,
        "BackoffLimitExceeded",
        f"{counted_restarts} retries, spec.backoffLimit is {backoff_limit}: {cause}",
    )


def grace_problem(
    grace_seconds: int, exposed_seconds: float, checkpoint_seconds: float
) -> str | None:
    """Why ``grace_seconds`` cannot cover what a stop must let finish and then a checkpoint
    (with a 20 % margin), or None when it can. ``exposed_seconds``: the longest part of a step
    that a stop cannot cut short with a checkpoint of the completed steps (the trainer's
    measure: the step's training, from the end of its generation; with colocated engines, its
    generation too when that is longer)."""
    need = 1.2 * (exposed_seconds + checkpoint_seconds)
    if grace_seconds >= need:
        return None
    return (
        f"spec.failurePolicy.terminationGracePeriodSeconds {grace_seconds}s is shorter than "
        f"the part of a step a stop must let finish ({exposed_seconds:.1f}s: its training; "
        f"with colocated engines, its generation too) plus a checkpoint "
        f"({checkpoint_seconds:.1f}s) with a 20% margin ({need:.0f}s): a SIGTERM there "
        f"abandons the step and completed steps since the last checkpoint are lost; raise it "
        f"to at least {int(need) + 1}"
    )


__all__ = [
    "CONFIG_EXIT_CODE",
    "DISRUPTION_TARGET_REASONS",
    "NODE_LOSS_REASONS",
    "PREEMPTED_EXIT_CODE",
    "Decision",
    "FailureClass",
    "PodLoss",
    "classify",
    "classify_evidence",
    "decide",
    "exit_code_of",
    "explains",
    "grace_problem",
    "names_no_cause",
]
