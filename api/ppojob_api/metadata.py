"""Names Kubernetes and KubeRay accept: the job's name and namespace, its metadata's fields,
labels and annotations, label values, Kueue queues."""

from __future__ import annotations

import difflib
import re
from typing import Any

from ppojob_api.k8s_rules import (
    ANNOTATIONS_MAX_BYTES,
    annotations_size,
    label_value,
    qualified_name,
)
from ppojob_api.problems import Problem

MAX_NAME_LENGTH = 47
"""KubeRay derives the RayCluster (name + 6 characters), its services and the PodGroup from the
RayJob's name, which is the PPOJob's; it refuses RayJob names longer than 47 characters."""
_DNS1035 = re.compile(r"^[a-z]([-a-z0-9]*[a-z0-9])?$")
_DNS1123_LABEL = re.compile(r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?$")
_LABEL_VALUE = re.compile(r"^(([A-Za-z0-9][-A-Za-z0-9_.]*)?[A-Za-z0-9])?$")
_DNS1123_SUBDOMAIN = re.compile(
    r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*$"
)
GENERATE_NAME_SUFFIX = 5  # characters the API server appends to metadata.generateName


def check_name(
    name: Any, field: str = "metadata.name", max_length: int = MAX_NAME_LENGTH
) -> list[Problem]:
    """Problems of a job name: a DNS-1035 label of at most `max_length` characters."""
    if not isinstance(name, str) or not name:
        return [
            Problem(field, "required field is missing", "add metadata.name, e.g. `name: my-job`")
        ]
    problems = []
    if len(name) > max_length:
        problems.append(
            Problem(
                field,
                f"is {len(name)} characters; at most {max_length} (KubeRay derives its RayCluster, "
                "service and PodGroup names from it)",
                "use a shorter name",
            )
        )
    if not _DNS1035.fullmatch(name):
        problems.append(
            Problem(
                field,
                f"{name!r} is not a DNS-1035 label: lower-case letters, digits and '-', starting "
                "with a letter and ending with a letter or digit (no '_', '.', upper case or "
                "non-ASCII)",
                f"rename it, e.g. {_suggest_name(name)!r}",
            )
        )
    return problems


def _suggest_name(name: str) -> str:
    out = re.sub(r"[^a-z0-9-]+", "-", name.lower()).strip("-")
    out = re.sub(r"^[^a-z]+", "", out)[:MAX_NAME_LENGTH].rstrip("-")
    return out or "my-job"


def check_namespace(namespace: Any, field: str = "metadata.namespace") -> list[Problem]:
    """Problems of a namespace name: a DNS-1123 label (at most 63 characters)."""
    if namespace is None:
        return []
    if (
        not isinstance(namespace, str)
        or len(namespace) > 63
        or not _DNS1123_LABEL.fullmatch(namespace)
    ):
        return [
            Problem(
                field,
                f"{namespace!r} is not a DNS-1123 label: at most 63 lower-case letters, digits and "
                "'-', starting and ending with a letter or digit",
                "use a valid namespace name",
            )
        ]
    return []


def check_label_value(value: str | None, field: str) -> list[Problem]:
    """Problems of a value the operator writes into a Kubernetes label."""
    if value is None or (len(value) <= 63 and _LABEL_VALUE.fullmatch(value)):
        return []
    return [
        Problem(
            field,
            f"{value!r} is written into a label, and a label value is at most 63 characters of "
            "letters, digits, '-', '_' and '.', starting and ending with a letter or digit",
            "use a shorter name of those characters",
        )
    ]


def check_kueue_queue(queue: str | None) -> list[Problem]:
    """Kueue's webhook refuses a RayJob whose ``kueue.x-k8s.io/queue-name`` is not a DNS-1123
    subdomain (a LocalQueue's name; Kueue v0.17 ``jobframework.ValidateQueueName``)."""
    if not queue or _DNS1123_SUBDOMAIN.fullmatch(queue):
        return []
    return [
        Problem(
            "spec.scheduling.queue",
            f"{queue!r} cannot name a Kueue LocalQueue (Kueue refuses the RayJob): it must be "
            "lower-case letters, digits, '-' and '.', starting and ending with a letter or digit",
            "use the LocalQueue's name, e.g. team-a",
        )
    ]


OBJECT_META_FIELDS = (
    "name",
    "generateName",
    "namespace",
    "labels",
    "annotations",
    "uid",
    "resourceVersion",
    "generation",
    "creationTimestamp",
    "deletionTimestamp",
    "deletionGracePeriodSeconds",
    "ownerReferences",
    "finalizers",
    "managedFields",
    "selfLink",
)
"""The fields of Kubernetes' ObjectMeta (k8s.io/apimachinery/pkg/apis/meta/v1/types.go); the API
server refuses any other under kubectl's strict field validation (and drops it otherwise)."""


def _string_map(value: Any, field: str, kind: str) -> tuple[dict[str, str], list[Problem]]:
    if value is None:
        return {}, []
    if not isinstance(value, dict):
        return {}, [
            Problem(field, f"must be a mapping of {kind}", f"write {field}: {{key: value}}")
        ]
    problems = [
        Problem(
            f"{field}.{k}",
            f"{kind} values are strings, got {type(v).__name__}",
            f'quote it: {k}: "{v}"',
        )
        for k, v in value.items()
        if not isinstance(v, str)
    ]
    return {str(k): v for k, v in value.items() if isinstance(v, str)}, problems


def check_labels_and_annotations(meta: dict[str, Any]) -> list[Problem]:
    """metadata.labels and metadata.annotations by Kubernetes' rules (`ppojob_api.k8s_rules`)."""
    labels, problems = _string_map(meta.get("labels"), "metadata.labels", "label")
    for key, value in labels.items():
        for what, errs in ((key, qualified_name(key)), (value, label_value(value))):
            if errs:
                problems.append(
                    Problem(
                        f"metadata.labels.{key}",
                        f"{what[:80]!r}: {'; '.join(errs)}",
                        "use a key such as team or example.com/team, and a value of at most 63 "
                        "letters, digits, '-', '_', '.'",
                    )
                )
    annotations, more = _string_map(meta.get("annotations"), "metadata.annotations", "annotation")
    problems += more
    for key in annotations:
        errs = qualified_name(key.lower())
        if errs:
            problems.append(
                Problem(
                    f"metadata.annotations.{key}",
                    f"{key[:80]!r}: {'; '.join(errs)}",
                    "use a key such as example.com/note",
                )
            )
    size = annotations_size(annotations)
    if size > ANNOTATIONS_MAX_BYTES:
        problems.append(
            Problem(
                "metadata.annotations",
                f"are {size:,} bytes; Kubernetes takes at most {ANNOTATIONS_MAX_BYTES:,} "
                "(256 KiB, keys and values together)",
                "keep large data out of annotations (a ConfigMap, or the volume)",
            )
        )
    return problems


def check_metadata(meta: Any) -> list[Problem]:
    """Problems of a job's metadata: its name (or generateName) and namespace, unknown fields,
    labels and annotations."""
    if not isinstance(meta, dict):
        return [Problem("metadata", "required field is missing", "add metadata: {name: my-job}")]
    problems: list[Problem] = []
    for key in meta:
        if key not in OBJECT_META_FIELDS:
            near = difflib.get_close_matches(str(key), OBJECT_META_FIELDS, n=1, cutoff=0.6)
            problems.append(
                Problem(
                    f"metadata.{key}",
                    "unknown field (not a field of Kubernetes' ObjectMeta)",
                    f"check its spelling: did you mean `{near[0]}`?" if near else "remove it",
                )
            )
    problems += check_labels_and_annotations(meta)
    name, generate = meta.get("name"), meta.get("generateName")
    if name is not None and not isinstance(name, str):
        wrong = Problem(
            "metadata.name",
            f"must be a string, got {type(name).__name__} {name!r}",
            "write a name of lower-case letters, digits and '-', e.g. `name: my-job`",
        )
        return [*problems, wrong]
    if not name and isinstance(generate, str) and generate:
        # the API server appends 5 characters; the result must still be a valid name
        problems += check_name(
            generate + "a" * GENERATE_NAME_SUFFIX,
            "metadata.generateName",
            MAX_NAME_LENGTH,
        )
    else:
        problems += check_name(name)
    return problems + check_namespace(meta.get("namespace"))
