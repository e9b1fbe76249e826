"""Pure: what a job's pods say that KubeRay does not — an image that cannot be had.

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

REASON = "ImageUnavailable"
PERMANENT = frozenset({"ErrImageNeverPull", "InvalidImageName"})
RETRYING = frozenset({"ErrImagePull", "ImagePullBackOff"})
PULL_GRACE_S = 300.0


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
