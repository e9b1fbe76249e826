"""Admission-time validation: the CEL rules (`x-kubernetes-validations`) and the size bounds the
generated CRD carries, so the API server refuses at `kubectl apply` what the operator would only
refuse after the object is stored.

Every rule here restates one Python check exactly (`check` names it), with the check's field path
and fix: a manifest as written (`ppojob validate`) and as stored (the API server) get the same
verdict, and tests/cluster/test_api_cel.py sends each case through both. What CEL cannot state
exactly (the memory plan, hook imports, pod fields judged by Kubernetes' own rules) stays in
`ppojob_api.checks` alone and is judged by the operator after admission.

Two kinds of rules:

- **Admission rules** (`ADMISSION_RULES`): cheap invariants of one object: the job's name (what
  KubeRay derives its children's names from), one checkpoint source, Kueue implies a queue,
  bounded staleness implies engines of their own, ...
- **Started rules** (`started_rules`): once the operator has made the job's RayJob
  (`status.rayJobName` is set) its spec is immutable but for `spec.suspend`, the one field the
  operator applies to a running job (`suspend.py`). CEL on `spec` cannot see `status`, so these
  are transition rules at the root of the schema, one per spec field (`oldSelf.status` says
  whether the job had started; the status subresource keeps `status` unchanged in a spec
  update and `spec` unchanged in a status update). A validating webhook would do the same with a
  TLS endpoint the API server must reach on every write; the API server's own CEL needs nothing.

Bounds (`bound_schema`): every string, list and map of the spec without a bound of its own gets
one (`STRING_MAX`, `LIST_MAX`, `MAP_MAX`), so that the API server's cost estimate of the rules
stays within its budget whatever rules are added; `ppojob validate` checks the same bounds by
walking the same schema (`bound_problems`).
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

from ppojob_api.base import default_of
from ppojob_api.metadata import MAX_NAME_LENGTH
from ppojob_api.problems import Problem
from ppojob_api.spec import PPOJobSpec
from ppojob_api.trainspec.algorithm import Algorithm
from ppojob_api.trainspec.roles import RolloutRole
from ppojob_api.trainspec.settings import Training

STRING_MAX = 32768
"""Characters of a spec string that has no bound of its own (image references, paths, URLs,
hook paths, variable values)."""
LIST_MAX = 256
"""Items of a spec list that has no bound of its own."""
MAP_MAX = 256
"""Keys of a spec map (node selectors, labels, extended resources) that has no bound of its own."""

DNS1035_LABEL = "^[a-z]([-a-z0-9]*[a-z0-9])?$"
LABEL_VALUE = "^(([A-Za-z0-9][-A-Za-z0-9_.]*)?[A-Za-z0-9])?$"
DNS1123_SUBDOMAIN = "^[a-z0-9]([-a-z0-9]*[a-z0-9])?([.][a-z0-9]([-a-z0-9]*[a-z0-9])?)*$"


@dataclass(frozen=True)
class CelRule:
    """One `x-kubernetes-validations` entry: where it sits in the schema (dotted properties from
    the root, `[]` for a list's items), the rule, the message (what is wrong and the fix, as the
    Python check words it) and, where the field is below `at`, the field it names."""

    at: str
    rule: str
    message: str
    check: str
    """The Python check (module:function) that judges the same invariant."""
    field_path: str | None = None

    def entry(self) -> dict[str, Any]:
        out: dict[str, Any] = {"rule": self.rule, "message": self.message}
        if self.field_path:
            out["fieldPath"] = self.field_path
        return out


_CHECKPOINT_DIR = default_of(Training, "checkpoint_dir")
_ROLLOUT_BACKEND = default_of(RolloutRole, "backend")
_STALENESS = default_of(Algorithm, "max_staleness")


def _colocated_capabilities(role: str) -> CelRule:
    return CelRule(
        f"spec.roles.{role}",
        "!self.?colocateWithActor.orValue(false) || !has(self.capabilities) "
        "|| size(self.capabilities) == 0",
        f"a colocated {role} runs in the actor's pods, which have their own (fix: set "
        "spec.roles.actor.capabilities instead)",
        "ppojob_api.checks.cluster:check_colocated_capabilities",
        ".capabilities",
    )


ADMISSION_RULES: tuple[CelRule, ...] = (
    CelRule(
        "metadata.name",
        f"self.size() <= {MAX_NAME_LENGTH}",
        f"is longer than {MAX_NAME_LENGTH} characters; KubeRay derives its RayCluster (the name "
        "+ 6 characters), service and PodGroup names from it (fix: use a shorter name)",
        "ppojob_api.metadata:check_name",
    ),
    CelRule(
        "metadata.name",
        f"self.matches('{DNS1035_LABEL}')",
        "is not a DNS-1035 label: lower-case letters, digits and '-', starting with a letter and "
        "ending with a letter or digit; KubeRay names services after it (fix: rename it, e.g. "
        "my-job)",
        "ppojob_api.metadata:check_name",
    ),
    CelRule(
        "spec.checkpointVolume",
        "(has(self.persistentVolumeClaim) ? 1 : 0) + (has(self.nfs) ? 1 : 0) == 1",
        "needs exactly one source (fix: set persistentVolumeClaim or nfs)",
        "ppojob_api.checks.cluster:check_checkpoint_volume",
    ),
    CelRule(
        "spec",
        "!has(self.checkpointVolume) "
        f"|| self.?training.?checkpointDir.orValue('{_CHECKPOINT_DIR}').startsWith('/')",
        "is relative, but the checkpoint volume is mounted at this path (fix: use an absolute "
        "path such as /checkpoints)",
        "ppojob_api.checks.cluster:check_checkpoint_volume",
        ".training.checkpointDir",
    ),
    CelRule(
        "spec.scheduling",
        "self.?gangScheduler.orValue('') != 'kueue' || has(self.queue)",
        "kueue needs a LocalQueue name (fix: set spec.scheduling.queue)",
        "ppojob_api.checks.cluster:check_scheduling",
        ".queue",
    ),
    CelRule(
        "spec.scheduling",
        "self.?gangScheduler.orValue('') != 'none' || !has(self.queue)",
        "has no effect without a gang scheduler (fix: set spec.scheduling.gangScheduler)",
        "ppojob_api.checks.cluster:check_scheduling",
        ".queue",
    ),
    CelRule(
        "spec.scheduling",
        "self.?gangScheduler.orValue('') != 'kueue' || !has(self.queue) "
        f"|| self.queue.matches('{DNS1123_SUBDOMAIN}')",
        "cannot name a Kueue LocalQueue (Kueue refuses the RayJob): it must be lower-case "
        "letters, digits, '-' and '.', starting and ending with a letter or digit (fix: use the "
        "LocalQueue's name, e.g. team-a)",
        "ppojob_api.metadata:check_kueue_queue",
        ".queue",
    ),
    *(
        CelRule(
            "spec.scheduling",
            f"!has(self.{field}) || (self.{field}.size() <= 63 "
            f"&& self.{field}.matches('{LABEL_VALUE}'))",
            "is written into a label, and a label value is at most 63 characters of letters, "
            "digits, '-', '_' and '.', starting and ending with a letter or digit (fix: use a "
            "shorter name of those characters)",
            "ppojob_api.metadata:check_label_value",
            f".{field}",
        )
        for field in ("queue", "priorityClassName")
    ),
    CelRule(
        "spec",
        f"self.?algorithm.?maxStaleness.orValue({_STALENESS}) == 0 "
        "|| !self.?roles.?rollout.?colocateWithActor.orValue(false)",
        "overlaps generation with training, but a colocated engine shares the actor's worker "
        "process and cannot generate while it trains (fix: set roles.rollout.colocateWithActor: "
        "false, or maxStaleness: 0)",
        "ppojob_api.checks.offpolicy:check_staleness",
        ".algorithm.maxStaleness",
    ),
    CelRule(
        "spec.algorithm",
        f"!self.?partialRollout.orValue(false) || self.?maxStaleness.orValue({_STALENESS}) > 0",
        "partial rollout lets a weight sync interrupt generations in flight, but with "
        "maxStaleness 0 no generation runs during a sync (fix: set algorithm.maxStaleness to 1 "
        "or more, or partialRollout: false)",
        "ppojob_api.checks.offpolicy:check_partial_rollout",
        ".partialRollout",
    ),
    CelRule(
        "spec",
        "!self.?algorithm.?partialRollout.orValue(false) "
        f"|| self.?roles.?rollout.?backend.orValue('{_ROLLOUT_BACKEND}') == 'torch'",
        "partial rollout is implemented for torch engines (an sglang engine's generations finish "
        "with the weights they started with) (fix: set roles.rollout.backend: torch, or "
        "partialRollout: false)",
        "ppojob_api.checks.offpolicy:check_partial_rollout",
        ".algorithm.partialRollout",
    ),
    CelRule(
        "spec.algorithm",
        "!has(self.importanceSampling) || !has(self.tisCap)",
        "tisCap and importanceSampling both weigh the policy loss by pi_old / pi_rollout, so the "
        "loss would be corrected twice (fix: remove tisCap: importanceSampling {level: token, "
        "mode: truncate, cap} is the same correction)",
        "ppojob_api.checks.offpolicy:check_importance_sampling",
        ".importanceSampling",
    ),
    _colocated_capabilities("critic"),
    _colocated_capabilities("rollout"),
    CelRule(
        "spec.podTemplate.env[].valueFrom",
        "has(self.secretKeyRef) != has(self.configMapKeyRef)",
        "needs exactly one of secretKeyRef and configMapKeyRef (fix: set one)",
        "ppojob_api.checks.podtemplate:check_pod_template",
    ),
    CelRule(
        "spec.podTemplate.envFrom[]",
        "has(self.secretRef) != has(self.configMapRef)",
        "needs exactly one of secretRef and configMapRef (fix: set one)",
        "ppojob_api.checks.podtemplate:check_pod_template",
    ),
    CelRule(
        "spec.podTemplate.volumeMounts[]",
        "self.mountPath.startsWith('/')",
        "must be absolute (fix: start it with /)",
        "ppojob_api.checks.podtemplate:check_pod_template",
        ".mountPath",
    ),
)
"""The cheap invariants, each the exact statement of a Python check."""

MUTABLE_WHEN_STARTED = ("suspend",)
"""The spec fields the operator applies to a started job (``suspend.py``): all others are
immutable once ``status.rayJobName`` is set."""
STARTED = "has(oldSelf.status) && has(oldSelf.status.rayJobName)"
"""CEL: the job had started (the operator had made its RayJob) before this update."""


def started_rules() -> tuple[CelRule, ...]:
    """One transition rule per spec field but ``MUTABLE_WHEN_STARTED``, at the schema's root."""
    fields = [
        (info.alias or name)
        for name, info in PPOJobSpec.model_fields.items()
        if (info.alias or name) not in MUTABLE_WHEN_STARTED
    ]
    return tuple(
        CelRule(
            "",
            f"!({STARTED}) || (has(self.spec.{f}) == has(oldSelf.spec.{f}) "
            f"&& (!has(self.spec.{f}) || self.spec.{f} == oldSelf.spec.{f}))",
            f"spec.{f} cannot change once the job has started (its RayJob exists: "
            "status.rayJobName); a started job's spec can only change spec.suspend (fix: revert "
            "the change, or delete and recreate the job: it resumes from the newest checkpoint on "
            "spec.checkpointVolume)",
            "ppojob_operator.status:changed_fields",
            f".spec.{f}",
        )
        for f in fields
    )


def all_rules() -> tuple[CelRule, ...]:
    return (*ADMISSION_RULES, *started_rules())


def _node(schema: dict[str, Any], at: str) -> dict[str, Any]:
    """The schema node at `at` (dotted properties; `x[]` is the items of list x)."""
    node = schema
    for part in [p for p in at.split(".") if p]:
        items = part.endswith("[]")
        node = node["properties"][part.removesuffix("[]")]
        if items:
            node = node["items"]
    return node


def attach_rules(schema: dict[str, Any], rules: tuple[CelRule, ...] | None = None) -> None:
    """Put every rule into the schema, in order."""
    for rule in all_rules() if rules is None else rules:
        node = _node(schema, rule.at)
        node.setdefault("x-kubernetes-validations", []).append(rule.entry())


def _nodes(node: dict[str, Any], path: str) -> Iterator[tuple[str, dict[str, Any]]]:
    yield path, node
    for key, sub in (node.get("properties") or {}).items():
        yield from _nodes(sub, f"{path}.{key}")
    if isinstance(node.get("items"), dict):
        yield from _nodes(node["items"], f"{path}[]")
    if isinstance(node.get("additionalProperties"), dict):
        yield from _nodes(node["additionalProperties"], f"{path}{{}}")


def bound_schema(spec: dict[str, Any]) -> None:
    """Give every unbounded string, list and map of the spec's schema its bound."""
    for _, node in _nodes(spec, "spec"):
        kind = node.get("type")
        if kind == "string" and "enum" not in node:
            node.setdefault("maxLength", STRING_MAX)
        elif kind == "array":
            node.setdefault("maxItems", LIST_MAX)
        elif kind == "object" and isinstance(node.get("additionalProperties"), dict):
            node.setdefault("maxProperties", MAP_MAX)


def bound_problems(value: Any, schema: dict[str, Any], path: str = "spec") -> list[Problem]:
    """Every value of a manifest's spec over its schema's bound (maxLength, maxItems,
    maxProperties), as the API server counts (characters, items, keys)."""
    out: list[Problem] = []
    if isinstance(value, str) and "maxLength" in schema and len(value) > schema["maxLength"]:
        out.append(
            Problem(
                path,
                f"is {len(value)} characters; at most {schema['maxLength']}",
                "shorten it; a long value belongs in a file in the image or on a volume",
            )
        )
    elif isinstance(value, list):
        most = schema.get("maxItems")
        if most is not None and len(value) > most:
            out.append(Problem(path, f"has {len(value)} items; at most {most}", "remove some"))
        items = schema.get("items")
        if isinstance(items, dict):
            for i, item in enumerate(value):
                out += bound_problems(item, items, f"{path}[{i}]")
    elif isinstance(value, dict):
        most = schema.get("maxProperties")
        if most is not None and len(value) > most:
            out.append(Problem(path, f"has {len(value)} keys; at most {most}", "remove some"))
        props = schema.get("properties") or {}
        extra = schema.get("additionalProperties")
        for key, sub_value in value.items():
            sub = props.get(key, extra if isinstance(extra, dict) else None)
            if sub is not None:
                out += bound_problems(sub_value, sub, f"{path}.{key}")
    return out
