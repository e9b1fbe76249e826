"""Pure: what a job's pods say that KubeRay does not — an image that cannot be had, a job
submitter that died before KubeRay looks at it (:func:`failed_submitter`), and how a pod went
away (:func:`pod_loss`: the evidence of a disruption).

KubeRay (v1.5) keeps a RayJob ``Initializing`` for as long as a pod waits for its image: the
RayJob's own status never names the cause, and the job would wait until its deadline (or for
ever). The kubelet's waiting reason on the container says it at once:

- ``ErrImageNeverPull`` (``imagePullPolicy: Never`` and the image is not on the node) and
  ``InvalidImageName`` cannot get better by waiting: the job fails at once;
- ``ErrImagePull`` / ``ImagePullBackOff`` may be a registry's bad minute: the job fails once a
  pod has waited :data:`PULL_GRACE_S` seconds since it was created.

The verdict is the job's ``Failed`` condition (reason :data:`REASON`), with the pod, container,
image and the kubelet's message.
"""

from __future__ import annotations

import datetime as dt
from typing import Any

from ppojob_api.failures import DISRUPTION_TARGET_REASONS, PodLoss
from ppojob_operator.builders import SUBMITTER_CONTAINER

REASON = "ImageUnavailable"
PERMANENT = frozenset({"ErrImageNeverPull", "InvalidImageName"})
RETRYING = frozenset({"ErrImagePull", "ImagePullBackOff"})
PULL_GRACE_S = 300.0
LOST_STATUS_REASONS = frozenset({"Evicted", "NodeLost"})
"""A pod's status reason when the kubelet evicted it (node pressure) or its node was lost."""


def _age_s(pod: dict[str, Any], now: dt.datetime) -> float:
    created = (pod.get("metadata") or {}).get("creationTimestamp")
    if not created:
        return 0.0
    try:
        t = dt.datetime.fromisoformat(str(created).replace("Z", "+00:00"))
    except ValueError:
        return 0.0
    return (now - t).total_seconds()


def unavailable_image(pod: dict[str, Any], now: dt.datetime) -> str | None:
    """Why ``pod`` cannot start because of an image, as one line; None when it can (or may)."""
    status = pod.get("status") or {}
    name = (pod.get("metadata") or {}).get("name", "?")
    statuses = [
        *(status.get("initContainerStatuses") or []),
        *(status.get("containerStatuses") or []),
    ]
    for cs in statuses:
        waiting = (cs.get("state") or {}).get("waiting") or {}
        reason = waiting.get("reason") or ""
        if reason in PERMANENT or (reason in RETRYING and _age_s(pod, now) >= PULL_GRACE_S):
            detail = (waiting.get("message") or "").strip()
            return (
                f"pod {name}, container {cs.get('name', '?')}: image {cs.get('image', '?')!r} "
                f"cannot be used ({reason}{': ' + detail if detail else ''}); fix spec.image "
                "(or spec.imagePullPolicy / spec.imagePullSecrets) and recreate the job"
            )
    return None


def failed_submitter(pod: dict[str, Any]) -> str | None:
    """KubeRay's account of the head pod's ``ray-job-submitter`` container when it terminated with
    a nonzero exit code, and the pod is not going away; None otherwise.

    KubeRay (v1.6 ``rayjob_controller.go``) reads that container only once the RayJob is
    ``Running``; while it is ``Initializing`` (its RayCluster not yet Ready: a worker pod still
    starting), a submitter that failed (``ray job submit`` answered ``500 No available agent to
    submit job`` when the head's dashboard agent came up more than 10 s after the dashboard, or
    the job failed at once) is never looked at again: the head pod's restartPolicy is Never, so
    nothing submits, and the RayJob stays ``Initializing`` for ever. A pod being deleted or
    disrupted is left to its loss (:func:`pod_loss`): its submitter dies with it."""
    meta = pod.get("metadata") or {}
    status = pod.get("status") or {}
    if meta.get("deletionTimestamp") or pod_loss(pod, deleted=False) is not None:
        return None
    for cs in status.get("containerStatuses") or []:
        if cs.get("name") != SUBMITTER_CONTAINER:
            continue
        ended = (cs.get("state") or {}).get("terminated") or {}
        code = ended.get("exitCode")
        if not ended or not code:
            return None
        why = ended.get("reason") or "Error"
        return (
            f"Ray head pod container {SUBMITTER_CONTAINER} terminated with exit code {code}: "
            f"{why} (kubectl logs -n {meta.get('namespace', '?')} {meta.get('name', '?')} "
            f"-c {SUBMITTER_CONTAINER})"
        )
    return None


def _epoch(raw: object) -> float | None:
    try:
        return dt.datetime.fromisoformat(str(raw).replace("Z", "+00:00")).timestamp()
    except ValueError:
        return None


def pod_loss(pod: dict[str, Any], deleted: bool) -> PodLoss | None:
    """How ``pod`` went away, from what Kubernetes wrote on it: its ``DisruptionTarget``
    condition (True) and the condition's reason and time, else an ``Evicted``/``NodeLost``
    status reason, else a plain deletion (``deleted``: a DELETED event or a deletionTimestamp)
    dated by its request (``deletionTimestamp - deletionGracePeriodSeconds``); None when the pod
    is neither disrupted nor deleted."""
    meta = pod.get("metadata") or {}
    status = pod.get("status") or {}
    name = meta.get("name") or "?"
    for c in status.get("conditions") or []:
        if c.get("type") == "DisruptionTarget" and c.get("status") == "True":
            reason = c.get("reason") if c.get("reason") in DISRUPTION_TARGET_REASONS else None
            return PodLoss(name, reason or "DisruptionTarget", _epoch(c.get("lastTransitionTime")))
    if status.get("reason") in LOST_STATUS_REASONS:
        return PodLoss(name, status["reason"], None)
    if not deleted:
        return None
    at = _epoch(meta.get("deletionTimestamp"))
    if at is not None:
        at -= float(meta.get("deletionGracePeriodSeconds") or 0)
    return PodLoss(name, None, at)


def merged(old: PodLoss | None, new: PodLoss) -> PodLoss:
    """One pod's evidence seen twice (a deletionTimestamp, then DELETED): the one with a cause
    (a reason) wins; the earliest known time is kept."""
    if old is None:
        return new
    best = new if old.reason is None and new.reason is not None else old
    times = [t for t in (old.at, new.at) if t is not None]
    return PodLoss(best.pod, best.reason, min(times) if times else None)
