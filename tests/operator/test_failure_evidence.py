"""A failed attempt's class from evidence (issue 42, finding 3): the trainer's exit code and its
account, the pods' ``DisruptionTarget`` condition, eviction and node-loss reasons, and the order
in which they came. An application error stays an application error when a pod of the attempt
is deleted during it or after it (a reward function that raises is not a disruption because a
user or KubeRay's ``ttlSecondsAfterFinished: 0`` clean-up deleted a pod); Ray's word for a lost
worker (``ActorDiedError``, which names no cause) is a disruption only when a pod's loss explains
it. Pure functions: pod JSON as Kubernetes writes it -> ``pods.pod_loss`` -> ``restarts.decision``.
"""

from __future__ import annotations

from datetime import datetime, timezone
from typing import Any

import pytest

from ppojob_operator import pods, restarts
from tests.operator.test_restart_policy import job, rayjob

ERROR_AT = 1_000_000.0
"""When the trainer wrote its account (``status.progress.updatedAt``)."""
BEFORE, AFTER = ERROR_AT - 30, ERROR_AT + 30

APP = "training failed: ValueError: reward function raised: boom (data.rewardFunction)"
LOST = "training failed: a Ray worker died: The actor died unexpectedly before finishing this task"
PREEMPTED = "Preempted: SIGTERM: finished the step in flight; 3 completed steps are in /ckpt/3"


def stamp(t: float) -> str:
    return datetime.fromtimestamp(t, timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")


def pod(
    name: str = "demo-worker-1",
    *,
    deleted_at: float | None = None,
    target: str | None = None,
    target_at: float | None = None,
    reason: str | None = None,
) -> dict[str, Any]:
    """A pod of the attempt as Kubernetes leaves it: ``deleted_at`` the deletion's request
    (its deletionTimestamp is that plus the grace period), ``target`` a DisruptionTarget reason
    written at ``target_at``, ``reason`` the pod's status reason."""
    meta: dict[str, Any] = {"name": name, "namespace": "ns1"}
    if deleted_at is not None:
        meta["deletionTimestamp"] = stamp(deleted_at + 30)
        meta["deletionGracePeriodSeconds"] = 30
    status: dict[str, Any] = {"phase": "Running", "conditions": []}
    if target is not None:
        at = target_at if target_at is not None else deleted_at
        status["conditions"].append(
            {
                "type": "DisruptionTarget",
                "status": "True",
                "reason": target,
                "lastTransitionTime": stamp(at or 0),
            }
        )
    if reason is not None:
        status["phase"], status["reason"] = "Failed", reason
    return {"metadata": meta, "status": status}


APP_FAILED = {"reason": "AppFailed", "message": "Job entrypoint command failed with exit code 2"}
EXIT_75 = {"reason": "AppFailed", "message": "Job entrypoint command failed with exit code 75"}
EXIT_1 = {"reason": "AppFailed", "message": "Job entrypoint command failed with exit code 1"}
NO_WORD = {"reason": "AppFailed", "endTime": stamp(ERROR_AT)}

# (case, trainer error, RayJob status, pods) -> class
TABLE = [
    ("app error, then a pod deleted (ttl 0 clean-up)", APP, APP_FAILED,
     [pod(deleted_at=AFTER)], "Application"),
    ("app error, then a pod preempted", APP, APP_FAILED,
     [pod(deleted_at=AFTER, target="PreemptionByScheduler")], "Application"),
    ("a pod deleted by a user, then an app error", APP, APP_FAILED,
     [pod(deleted_at=BEFORE)], "Application"),
    ("a pod evicted (drain), then an app error", APP, APP_FAILED,
     [pod(deleted_at=BEFORE, target="EvictionByEvictionAPI")], "Application"),
    ("kubelet terminated a pod, then an app error", APP, APP_FAILED,
     [pod(target="TerminationByKubelet", target_at=BEFORE, reason="Evicted")], "Application"),
    ("app error, node lost", APP, APP_FAILED,
     [pod(deleted_at=AFTER, target="DeletionByTaintManager")], "Application"),
    ("app error alone", APP, APP_FAILED, [], "Application"),
    ("a pod preempted, then a lost worker", LOST, APP_FAILED,
     [pod(deleted_at=BEFORE, target="PreemptionByScheduler")], "Disruption"),
    ("a pod evicted (drain), then a lost worker", LOST, APP_FAILED,
     [pod(deleted_at=BEFORE, target="EvictionByEvictionAPI")], "Disruption"),
    ("a pod deleted (no DisruptionTarget), then a lost worker", LOST, APP_FAILED,
     [pod(deleted_at=BEFORE)], "Disruption"),
    ("kubelet eviction (not deleted), then a lost worker", LOST, APP_FAILED,
     [pod(target="TerminationByKubelet", target_at=BEFORE, reason="Evicted")], "Disruption"),
    ("a lost worker, then its pod deleted (clean-up)", LOST, APP_FAILED,
     [pod(deleted_at=AFTER)], "Application"),
    ("a lost worker, then a pod preempted", LOST, APP_FAILED,
     [pod(deleted_at=AFTER, target="PreemptionByScheduler")], "Application"),
    ("a lost worker, its node lost (taint manager, noticed late)", LOST, APP_FAILED,
     [pod(deleted_at=AFTER + 300, target="DeletionByTaintManager")], "Disruption"),
    ("a lost worker, its node gone (pod GC, noticed late)", LOST, APP_FAILED,
     [pod(deleted_at=AFTER + 600, target="DeletionByPodGC")], "Disruption"),
    ("a lost worker, pod NodeLost", LOST, APP_FAILED, [pod(reason="NodeLost")], "Disruption"),
    ("a lost worker alone (OOM inside, a crash)", LOST, APP_FAILED, [], "Application"),
    ("trainer said Preempted, exit 75", PREEMPTED, EXIT_75, [], "Disruption"),
    ("trainer said Preempted, its pod deleted after", PREEMPTED, EXIT_75,
     [pod(deleted_at=AFTER)], "Disruption"),
    ("exit 75, no account written", None, EXIT_75, [], "Disruption"),
    ("exit 1 (config refused), a pod deleted before", None, EXIT_1,
     [pod(deleted_at=BEFORE)], "Permanent"),
    ("exit 2, no account written, a pod deleted after", None,
     {**APP_FAILED, "endTime": stamp(ERROR_AT)}, [pod(deleted_at=AFTER)], "Application"),
    ("no word from the trainer, head deleted before the end", None, NO_WORD,
     [pod("demo-head-x", deleted_at=BEFORE)], "Disruption"),
    ("no word from the trainer, a pod deleted after the end", None, NO_WORD,
     [pod(deleted_at=AFTER)], "Application"),
]  # fmt: skip


def losses(seen: list[dict[str, Any]]) -> list:
    out = [pods.pod_loss(p, deleted="deletionTimestamp" in p["metadata"]) for p in seen]
    return [loss for loss in out if loss is not None]


@pytest.mark.parametrize(
    ("case", "error", "rj_status", "seen", "klass"), TABLE, ids=[row[0] for row in TABLE]
)
def test_the_failure_class_comes_from_the_evidence(case, error, rj_status, seen, klass) -> None:
    j = job(backoffLimit=3)
    rj = rayjob(j, **rj_status)
    d = restarts.decision(j, rj, {}, error, losses(seen), ERROR_AT if error else None)
    assert d is not None
    assert d.failure_class == klass, f"{case}: {d.failure_class} ({d.message})"


def test_a_raising_reward_function_with_a_deleted_pod_fails_with_backoff_limit_zero() -> None:
    """The symptom of the issue: Fail became Restart (an uncounted disruption)."""
    j = job(backoffLimit=0)
    seen = [pod(deleted_at=AFTER), pod("demo-head-x", deleted_at=AFTER)]
    d = restarts.decision(j, rayjob(j, **APP_FAILED), {}, APP, losses(seen), ERROR_AT)
    assert d is not None and (d.action, d.reason) == ("Fail", "BackoffLimitExceeded")
    assert "was deleted" not in d.message


def test_the_disruption_names_the_pod_and_the_kubernetes_reason() -> None:
    j = job(backoffLimit=0)
    seen = [pod(deleted_at=BEFORE, target="PreemptionByScheduler")]
    d = restarts.decision(j, rayjob(j, **APP_FAILED), {}, LOST, losses(seen), ERROR_AT)
    assert d is not None and (d.action, d.failure_class) == ("Restart", "Disruption")
    assert "pod demo-worker-1 was disrupted (PreemptionByScheduler)" in d.message


def test_a_stop_the_trainer_reported_names_the_pod_whose_deletion_stopped_it() -> None:
    """The trainer's word decides the class (Preempted: a disruption); the head pod deleted
    before it is named beside it (the restart's message says what stopped the attempt), a pod
    deleted after the account is not."""
    j = job(backoffLimit=0)
    seen = [pod("demo-head-x", deleted_at=BEFORE), pod("demo-worker-9", deleted_at=AFTER)]
    d = restarts.decision(j, rayjob(j, **EXIT_75), {}, PREEMPTED, losses(seen), ERROR_AT)
    assert d is not None and (d.action, d.failure_class) == ("Restart", "Disruption")
    assert "pod demo-head-x was deleted" in d.message and PREEMPTED in d.message
    assert "demo-worker-9" not in d.message


def test_a_pod_neither_deleted_nor_disrupted_is_no_evidence() -> None:
    assert pods.pod_loss(pod(), deleted=False) is None
    disrupted = pods.pod_loss(pod(target="EvictionByEvictionAPI", target_at=BEFORE), False)
    assert disrupted is not None and disrupted.reason == "EvictionByEvictionAPI"
    assert disrupted.at == BEFORE


def test_a_pods_deletion_is_dated_by_its_request_not_its_deadline() -> None:
    loss = pods.pod_loss(pod(deleted_at=BEFORE), deleted=True)
    assert loss is not None and loss.at == BEFORE and loss.reason is None


def test_the_same_pod_seen_twice_keeps_its_cause_and_earliest_time() -> None:
    plain = pods.pod_loss(pod(deleted_at=BEFORE), deleted=True)
    marked = pods.pod_loss(pod(deleted_at=BEFORE + 5, target="PreemptionByScheduler"), True)
    assert plain is not None and marked is not None
    for first, second in ((plain, marked), (marked, plain)):
        both = pods.merged(first, second)
        assert (both.reason, both.at) == ("PreemptionByScheduler", BEFORE)
