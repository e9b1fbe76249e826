"""Pure: what a job's pods say that KubeRay does not — an image that cannot be had, and how a pod
went away (:func:`pod_loss`: the evidence of a disruption).

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
