"""Checks of what the operator copies into pods, by Kubernetes' own rules (`ppojob_api.k8s_rules`):
the image, node selectors, tolerations, affinity keys, the priority class, the Volcano queue and
NFS paths. The API server stores a PPOJob whatever these hold; without these checks the job
would be accepted and its pods refused later, on the cluster."""

from __future__ import annotations

import difflib
import posixpath
from typing import Any

from ppojob_api import k8s_rules
from ppojob_api.problems import Problem
from ppojob_api.spec import PPOJobSpec
from ppojob_api.training import Toleration


def _one(path: str, value: str, errs: list[str], fix: str) -> list[Problem]:
    return [Problem(path, f"{value[:80]!r}: {'; '.join(errs)}", fix)] if errs else []


def node_selector_problems(selector: dict[str, str], path: str) -> list[Problem]:
    """Keys are qualified names, values label values (ValidateLabels)."""
    p: list[Problem] = []
    for key, value in selector.items():
        p += _one(
            f"{path}.{key}",
            key,
            k8s_rules.qualified_name(key),
            "use a node label key such as nvidia.com/gpu.product",
        )
        p += _one(
            f"{path}.{key}",
            value,
            k8s_rules.label_value(value),
            "use the node label's value (at most 63 letters, digits, '-', '_', '.')",
        )
    return p


def toleration_problems(tolerations: list[Toleration], path: str) -> list[Problem]:
    """validateTolerations."""
    p: list[Problem] = []
    for i, t in enumerate(tolerations):
        here = f"{path}[{i}]"
        if t.key:
            p += _one(f"{here}.key", t.key, k8s_rules.qualified_name(t.key), "use the taint's key")
        elif t.operator != "Exists":
            p.append(
                Problem(
                    f"{here}.operator",
                    "an empty key (every taint) needs operator Exists",
                    "set operator: Exists, or give the taint's key",
                )
            )
        if t.operator == "Exists" and t.value:
            p.append(
                Problem(
                    f"{here}.value",
                    "operator Exists matches every value and takes none",
                    "remove value, or use operator: Equal",
                )
            )
        if t.operator == "Equal" and t.value:
            p += _one(
                f"{here}.value", t.value, k8s_rules.label_value(t.value), "use the taint's value"
            )
        if t.toleration_seconds is not None and t.effect != "NoExecute":
            p.append(
                Problem(
                    f"{here}.tolerationSeconds",
                    f"only a NoExecute toleration has tolerationSeconds (effect is {t.effect})",
                    "set effect: NoExecute, or remove tolerationSeconds",
                )
            )
    return p


AFFINITY_FIELDS = {
    "nodeAffinity": (
        "requiredDuringSchedulingIgnoredDuringExecution",
        "preferredDuringSchedulingIgnoredDuringExecution",
    ),
    "podAffinity": (
        "requiredDuringSchedulingIgnoredDuringExecution",
        "preferredDuringSchedulingIgnoredDuringExecution",
    ),
    "podAntiAffinity": (
        "requiredDuringSchedulingIgnoredDuringExecution",
        "preferredDuringSchedulingIgnoredDuringExecution",
    ),
}
"""The fields of core/v1 Affinity and its three members, two levels deep: the API server refuses
any other in a pod (the operator copies `affinity` into the head pod as written)."""


def affinity_problems(affinity: dict[str, Any], path: str) -> list[Problem]:
    """Misspelt keys of a Kubernetes affinity (its first two levels)."""
    p: list[Problem] = []
    for key, value in affinity.items():
        if key not in AFFINITY_FIELDS:
            near = difflib.get_close_matches(key, AFFINITY_FIELDS, n=1, cutoff=0.6)
            p.append(
                Problem(
                    f"{path}.{key}",
                    "not a field of a Kubernetes affinity (nodeAffinity, podAffinity, "
                    "podAntiAffinity)",
                    f"did you mean `{near[0]}`?" if near else "remove it",
                )
            )
            continue
        if not isinstance(value, dict):
            p.append(
                Problem(
                    f"{path}.{key}", "must be a mapping", "see `kubectl explain pod.spec.affinity`"
                )
            )
            continue
        for inner in value:
            if inner not in AFFINITY_FIELDS[key]:
                near = difflib.get_close_matches(str(inner), AFFINITY_FIELDS[key], n=1, cutoff=0.6)
                p.append(
                    Problem(
                        f"{path}.{key}.{inner}",
                        f"not a field of {key}",
                        f"did you mean `{near[0]}`?"
                        if near
                        else f"use one of {', '.join(AFFINITY_FIELDS[key])}",
                    )
                )
    return p


def check_pod_fields(spec: PPOJobSpec, prefix: str = "spec") -> list[Problem]:
    """The image, every pod's node selector and tolerations, the priority class, the Volcano
    queue and the NFS path, by the rules the API server and the kubelet apply to pods."""
    p = _one(
        f"{prefix}.image",
        spec.image,
        k8s_rules.image_reference(spec.image),
        "write registry/path:tag, e.g. ghcr.io/org/ppojob-trainer:0.1.0",
    )
    pods = [("head", spec.head), *((f"roles.{n}", getattr(spec.roles, n)) for n in ROLES)]
    for name, pod in pods:
        if pod is None:
            continue
        p += node_selector_problems(pod.node_selector, f"{prefix}.{name}.nodeSelector")
        p += toleration_problems(pod.tolerations, f"{prefix}.{name}.tolerations")
        p += affinity_problems(getattr(pod, "affinity", {}) or {}, f"{prefix}.{name}.affinity")
    sched = spec.scheduling
    if sched.priority_class_name:
        p += _one(
            f"{prefix}.scheduling.priorityClassName",
            sched.priority_class_name,
            k8s_rules.dns1123_subdomain(sched.priority_class_name),
            "use the PriorityClass's name (kubectl get priorityclasses)",
        )
    if sched.queue and sched.gang_scheduler == "volcano":
        p += _one(
            f"{prefix}.scheduling.queue",
            sched.queue,
            k8s_rules.dns1123_subdomain(sched.queue),
            "use the Volcano Queue's name (kubectl get queues)",
        )
    vol = spec.checkpoint_volume
    if vol is not None and vol.nfs is not None and not posixpath.isabs(vol.nfs.path):
        p.append(
            Problem(
                f"{prefix}.checkpointVolume.nfs.path",
                f"{vol.nfs.path!r} is relative; an NFS export is an absolute path",
                "write the exported path from /, e.g. /exports/checkpoints",
            )
        )
    return p


ROLES = ("actor", "critic", "rollout")
