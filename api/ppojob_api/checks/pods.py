"""Checks of what the operator copies into pods, by Kubernetes' own rules (`ppojob_api.k8s_rules`):
the image, node selectors, tolerations, affinity keys, the priority class, the Volcano queue and
NFS paths. The API server stores a PPOJob whatever these hold; without these checks the job
would be accepted and its pods refused later, on the cluster."""

from __future__ import annotations

import difflib
import posixpath
import re
from typing import Any

from ppojob_api import k8s_rules
from ppojob_api.k8s_types import VOLUME_TYPES
from ppojob_api.problems import Problem
from ppojob_api.quantity import quantity_value
from ppojob_api.spec import PPOJobSpec
from ppojob_api.training import Resources, Toleration


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


AFFINITY_TYPES: dict[str, dict[str, str]] = {
    "V1Affinity": {
        "nodeAffinity": "V1NodeAffinity",
        "podAffinity": "V1PodAffinity",
        "podAntiAffinity": "V1PodAntiAffinity",
    },
    "V1NodeAffinity": {
        "preferredDuringSchedulingIgnoredDuringExecution": "List[V1PreferredSchedulingTerm]",
        "requiredDuringSchedulingIgnoredDuringExecution": "V1NodeSelector",
    },
    "V1PreferredSchedulingTerm": {"preference": "V1NodeSelectorTerm", "weight": "int"},
    "V1NodeSelectorTerm": {
        "matchExpressions": "List[V1NodeSelectorRequirement]",
        "matchFields": "List[V1NodeSelectorRequirement]",
    },
    "V1NodeSelectorRequirement": {"key": "str", "operator": "str", "values": "List[str]"},
    "V1NodeSelector": {"nodeSelectorTerms": "List[V1NodeSelectorTerm]"},
    "V1PodAffinity": {
        "preferredDuringSchedulingIgnoredDuringExecution": "List[V1WeightedPodAffinityTerm]",
        "requiredDuringSchedulingIgnoredDuringExecution": "List[V1PodAffinityTerm]",
    },
    "V1PodAntiAffinity": {
        "preferredDuringSchedulingIgnoredDuringExecution": "List[V1WeightedPodAffinityTerm]",
        "requiredDuringSchedulingIgnoredDuringExecution": "List[V1PodAffinityTerm]",
    },
    "V1WeightedPodAffinityTerm": {"podAffinityTerm": "V1PodAffinityTerm", "weight": "int"},
    "V1PodAffinityTerm": {
        "labelSelector": "V1LabelSelector",
        "matchLabelKeys": "List[str]",
        "mismatchLabelKeys": "List[str]",
        "namespaceSelector": "V1LabelSelector",
        "namespaces": "List[str]",
        "topologyKey": "str",
    },
    "V1LabelSelector": {
        "matchExpressions": "List[V1LabelSelectorRequirement]",
        "matchLabels": "Dict[str, str]",
    },
    "V1LabelSelectorRequirement": {"key": "str", "operator": "str", "values": "List[str]"},
}
"""core/v1 Affinity, every level: each type's fields (JSON names) and their types, written as
the `kubernetes` client's models write them (tests/api checks this table against those models).
The operator copies `affinity` into pods as written, and the API server refuses any other
field, so a misspelt key anywhere in it fails only on the cluster without this check."""

SELECTOR_OPERATORS = {
    "V1NodeSelectorRequirement": ("In", "NotIn", "Exists", "DoesNotExist", "Gt", "Lt"),
    "V1LabelSelectorRequirement": ("In", "NotIn", "Exists", "DoesNotExist"),
}


QUANTITY_FIELDS = {
    ("V1EmptyDirVolumeSource", "sizeLimit"): "quantity",
    ("V1ResourceFieldSelector", "divisor"): "quantity",
    ("V1VolumeResourceRequirements", "limits"): "Dict[str, quantity]",
    ("V1VolumeResourceRequirements", "requests"): "Dict[str, quantity]",
}
"""Fields the client types `str` (or a map of `str`) that hold resource.Quantity values, which
JSON also takes as numbers."""


def _shape_problem(value: Any, type_: str, path: str, explain: str) -> Problem | None:
    want: Any = {
        "str": str,
        "datetime": str,
        "int": int,
        "bool": bool,
        "Dict[str, str]": dict,
        "Dict[str, quantity]": dict,
        "quantity": (str, int, float),
    }.get(type_)
    if type_.startswith("List["):
        want = list
    elif type_.startswith("V1"):
        want = dict
    if want is None or (isinstance(value, want) and (want is bool or not isinstance(value, bool))):
        return None
    article = {
        dict: "a mapping",
        list: "a list",
        str: "a string",
        int: "a whole number",
        bool: "true or false",
    }.get(want, "a quantity such as 1Gi")
    fix = "quote it" if want is str else f"see `kubectl explain {explain}`"
    return Problem(path, f"must be {article}", fix)


def _requirement_problems(req: dict[str, Any], type_: str, path: str, field: bool) -> list[Problem]:
    """ValidateNodeSelectorRequirement / validateNodeFieldSelectorRequirement /
    ValidateLabelSelectorRequirement of Kubernetes' validation."""
    p: list[Problem] = []
    op, values = req.get("operator"), req.get("values") or []
    ops = ("In", "NotIn") if field else SELECTOR_OPERATORS[type_]
    if op is None:
        p.append(Problem(f"{path}.operator", "a requirement needs an operator", f"use {ops[0]}"))
    elif op not in ops:
        p.append(
            Problem(
                f"{path}.operator", f"{op!r} is not a selector operator", f"use {', '.join(ops)}"
            )
        )
    elif field and len(values) != 1:
        p.append(Problem(f"{path}.values", "a matchFields requirement takes one value", "give one"))
    elif op in ("In", "NotIn") and not values:
        p.append(Problem(f"{path}.values", f"operator {op} needs values", "list the values"))
    elif op in ("Exists", "DoesNotExist") and values:
        p.append(Problem(f"{path}.values", f"operator {op} takes no values", "remove values"))
    elif op in ("Gt", "Lt") and len(values) != 1:
        p.append(Problem(f"{path}.values", f"operator {op} takes one value", "give one number"))
    if type_ == "V1LabelSelectorRequirement":  # ValidateLabelSelectorRequirement
        for i, v in enumerate(values):
            if isinstance(v, str):
                p += _one(f"{path}.values[{i}]", v, k8s_rules.label_value(v), "use a label value")
    key = req.get("key")
    if field:
        if key != "metadata.name":
            p.append(
                Problem(
                    f"{path}.key",
                    f"{key!r}: matchFields selects only metadata.name",
                    "use key: metadata.name (the node's name), or matchExpressions for labels",
                )
            )
    elif not isinstance(key, str) or not key:
        p.append(Problem(f"{path}.key", "a requirement needs a key", "give the label key"))
    else:
        p += _one(
            f"{path}.key",
            key,
            k8s_rules.qualified_name(key),
            "use a label key, e.g. kubernetes.io/hostname or app.kubernetes.io/name",
        )
    return p


def _rules(value: dict[str, Any], type_: str, path: str) -> list[Problem]:
    """The value rules of Kubernetes' affinity validation, beyond field names and shapes."""
    p: list[Problem] = []
    if type_ in ("V1PreferredSchedulingTerm", "V1WeightedPodAffinityTerm"):
        weight = value.get("weight")
        if not isinstance(weight, int) or isinstance(weight, bool) or not 1 <= weight <= 100:
            p.append(Problem(f"{path}.weight", f"{weight!r}: must be 1 to 100", "set a weight"))
    if type_ == "V1NodeSelector" and not value.get("nodeSelectorTerms"):
        p.append(
            Problem(f"{path}.nodeSelectorTerms", "needs at least one term", "add a term or remove")
        )
    if type_ == "V1PodAffinityTerm":
        for i, ns in enumerate(value.get("namespaces") or []):
            if isinstance(ns, str):
                p += _one(
                    f"{path}.namespaces[{i}]",
                    ns,
                    k8s_rules.dns1123_label(ns),
                    "use a namespace's name (kubectl get namespaces)",
                )
        keys = {"matchLabelKeys": value.get("matchLabelKeys") or []}
        keys["mismatchLabelKeys"] = value.get("mismatchLabelKeys") or []
        for name, listed in keys.items():
            if listed and value.get("labelSelector") is None:
                p.append(
                    Problem(
                        f"{path}.{name}",
                        "must not be set without a labelSelector (it adds to the selector)",
                        "add a labelSelector, or remove it",
                    )
                )
            for i, k in enumerate(listed):
                if isinstance(k, str):
                    p += _one(
                        f"{path}.{name}[{i}]",
                        k,
                        k8s_rules.qualified_name(k),
                        "use a pod label key such as app.kubernetes.io/instance",
                    )
                if name == "matchLabelKeys" and k in keys["mismatchLabelKeys"]:
                    p.append(
                        Problem(
                            f"{path}.matchLabelKeys[{i}]",
                            f"{k!r} is in both matchLabelKeys and mismatchLabelKeys",
                            "keep it in one of them",
                        )
                    )
        key = value.get("topologyKey")
        if not isinstance(key, str) or not key:
            p.append(
                Problem(
                    f"{path}.topologyKey",
                    "a pod affinity term needs a topology key",
                    "e.g. topologyKey: kubernetes.io/hostname",
                )
            )
        else:
            p += _one(
                f"{path}.topologyKey",
                key,
                k8s_rules.qualified_name(key),
                "use a node label key such as kubernetes.io/hostname",
            )
    if type_ == "V1LabelSelector":
        for k, v in (value.get("matchLabels") or {}).items():
            p += _one(
                f"{path}.matchLabels.{k}",
                str(k),
                k8s_rules.qualified_name(str(k)),
                "use a label key such as app.kubernetes.io/name",
            )
            if isinstance(v, str):  # (the walk refuses any other value)
                p += _one(
                    f"{path}.matchLabels.{k}", v, k8s_rules.label_value(v), "use the label's value"
                )
    return p


def _walk(
    value: Any,
    type_: str,
    path: str,
    types: dict[str, dict[str, str]],
    explain: str,
    field: bool = False,
) -> list[Problem]:
    bad = _shape_problem(value, type_, path, explain)
    if bad is not None:
        return [bad]
    if type_.startswith("List["):
        inner = type_[5:-1]
        return [
            q
            for i, item in enumerate(value)
            for q in _walk(item, inner, f"{path}[{i}]", types, explain, field)
        ]
    if type_ in ("Dict[str, str]", "Dict[str, quantity]"):
        kind = type_[10:-1]
        return [
            q
            for k, item in value.items()
            if (q := _shape_problem(item, kind, f"{path}.{k}", explain)) is not None
        ]
    if not type_.startswith("V1"):
        return []
    fields = types[type_]
    p: list[Problem] = []
    for key, item in value.items():
        if key not in fields:
            near = difflib.get_close_matches(str(key), fields, n=1, cutoff=0.6)
            listed = f" ({', '.join(fields)})" if len(fields) <= 8 else ""
            p.append(
                Problem(
                    f"{path}.{key}",
                    f"not a field of a Kubernetes {type_[2:]}{listed}",
                    f"did you mean `{near[0]}`?"
                    if near
                    else (
                        "remove it"
                        if listed
                        else f"remove it (its fields: kubectl explain {explain})"
                    ),
                )
            )
            continue
        inner_type = fields[key]
        inner_type = QUANTITY_FIELDS.get((type_, key), inner_type)
        p += _walk(item, inner_type, f"{path}.{key}", types, explain, field or key == "matchFields")
    if type_ in SELECTOR_OPERATORS:
        p += _requirement_problems(value, type_, path, field)
    return p + _rules(value, type_, path)


def affinity_problems(affinity: dict[str, Any], path: str) -> list[Problem]:
    """A Kubernetes affinity checked at every level: misspelt keys, wrong shapes, and the value
    rules the API server applies (selector operators and their values, weights 1-100, topology
    keys, namespaces, label keys and values)."""
    return _walk(affinity, "V1Affinity", path, AFFINITY_TYPES, "pod.spec.affinity")


VOLUME_SOURCES = tuple(k for k in VOLUME_TYPES["V1Volume"] if k != "name")


def volume_problems(volume: dict[str, Any], path: str) -> list[Problem]:
    """A Kubernetes Volume checked at every level against the client's models (misspelt keys,
    wrong shapes, the label-selector rules), with exactly one source (validateVolumeSource: a
    volume without one would be defaulted to an emptyDir, and two are refused)."""
    p = _walk(volume, "V1Volume", path, VOLUME_TYPES, "pod.spec.volumes")
    sources = [k for k in volume if k in VOLUME_SOURCES]
    if len(sources) > 1:
        p.append(
            Problem(
                path,
                f"has {len(sources)} sources ({', '.join(sources)}); a volume has exactly one",
                "keep one, or make each its own volume",
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
        if name != "head":
            p += hugepage_problems(pod.resources, f"{prefix}.{name}.resources")
    sched = spec.scheduling
    if sched.priority_class_name:
        p += _one(
            f"{prefix}.scheduling.priorityClassName",
            sched.priority_class_name,
            k8s_rules.dns1123_subdomain(sched.priority_class_name),
            "use the PriorityClass's name (kubectl get priorityclasses)",
        )
    if sched.workload_priority_class:
        p += _one(
            f"{prefix}.scheduling.workloadPriorityClass",
            sched.workload_priority_class,
            k8s_rules.dns1123_subdomain(sched.workload_priority_class),
            "use the WorkloadPriorityClass's name (kubectl get workloadpriorityclasses)",
        )
    if sched.queue and sched.gang_scheduler == "volcano":
        p += _one(
            f"{prefix}.scheduling.queue",
            sched.queue,
            k8s_rules.dns1123_subdomain(sched.queue),
            "use the Volcano Queue's name (kubectl get queues)",
        )
    if sched.queue and sched.gang_scheduler == "yunikorn":
        p += _one(
            f"{prefix}.scheduling.queue",
            sched.queue,
            yunikorn_queue(sched.queue),
            "use the queue's full path from YuniKorn's queues.yaml, e.g. root.team-a",
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


ROLES = ("actor", "critic", "rollout", "reward", "sandbox")

YUNIKORN_QUEUE_NAME = re.compile(r"^[a-zA-Z0-9_:#/@-]{1,64}$")
"""yunikorn-core's QueueNameRegExp (pkg/common/configs/configvalidator.go, since 1.6: before,
`^[a-zA-Z0-9_-]{1,64}$`). ':', '#', '/' and '@' are refused anyway: the queue travels as the
value of the label yunikorn.apache.org/queue, which checks/cluster.py checks as a label value."""


def yunikorn_queue(queue: str) -> list[str]:
    """A YuniKorn queue as its placement rule (`provided`) reads the pods' queue label: a fully
    qualified path `root.a.b` is split at the dots and each part must be a queue name; any
    other value is one child queue name, its dots replaced by `_dot_` (placement/rule.go
    replaceDot), created under the parent rule's queue."""
    if queue.startswith("root."):
        bad = [part for part in queue.split(".") if not YUNIKORN_QUEUE_NAME.match(part)]
        if not bad:
            return []
        return [
            "each part of a YuniKorn queue path root.a.b is 1 to 64 letters, digits, '-' or "
            f"'_' (not {bad[0]!r})"
        ]
    name = queue.replace(".", "_dot_")
    if YUNIKORN_QUEUE_NAME.match(name):
        return []
    return [
        f"a queue not starting with root. is one YuniKorn queue name, {name[:80]!r} with its dots "
        "written as _dot_: 1 to 64 letters, digits, '-' or '_'"
    ]


def hugepage_problems(res: Resources, path: str) -> list[Problem]:
    """Huge pages as the API server and the kubelet take them: a page size (a power of two of
    bytes, as nodes report `hugepages-2Mi`, `hugepages-1Gi`) and an amount that is a whole
    number of pages (validateResourceQuantityHugePageValue). `extra` refuses them
    (checks/cluster.py)."""
    p: list[Problem] = []
    for size, amount in res.hugepages.items():
        here = f"{path}.hugepages.{size}"
        try:
            page = quantity_value(size)
        except ValueError:
            page = 0.0
        if page < 4096 or page != int(page) or int(page) & (int(page) - 1):
            p.append(
                Problem(
                    here,
                    f"{size!r} is not a huge page size (a power of two of bytes, as a node "
                    "reports it in hugepages-<size>)",
                    "write the page size as the nodes list it, e.g. 2Mi or 1Gi",
                )
            )
            continue
        total = quantity_value(amount)
        if total <= 0 or total % page:
            p.append(
                Problem(
                    here,
                    f"{amount} is not a whole number of {size} pages",
                    f"use a multiple of {size}, e.g. {_binary(max(1, round(total / page)) * page)}",
                )
            )
    return p


def _binary(n: float) -> str:
    """Bytes as the largest binary unit that divides them (1Gi, 512Mi, 4Ki)."""
    for unit, size in (("Gi", 2**30), ("Mi", 2**20), ("Ki", 2**10)):
        if n % size == 0:
            return f"{int(n // size)}{unit}"
    return str(int(n))
