"""Generate the PPOJob CustomResourceDefinition from the typed models (like controller-gen).

Pydantic emits JSON Schema (draft 2020-12) with `$ref`s, `anyOf` for optional fields and
`exclusiveMinimum` as a number. Kubernetes wants a *structural* OpenAPI v3.0 schema: every node
typed, no `$ref`, nullability as `nullable: true`, free-form maps marked with
`x-kubernetes-preserve-unknown-fields`. `structural_schema` does that translation; `build_crd`
wraps it into the CRD with the status subresource and printer columns.
"""

from __future__ import annotations

import copy
import hashlib
import json
from typing import Any

import yaml

from ppojob_api.cel import attach_rules, bound_schema
from ppojob_api.spec import GROUP, KIND, PLURAL, SHORT_NAMES, SINGULAR, VERSION, PPOJob

_DROP = {"title", "$defs", "discriminator"}

PRINTER_COLUMNS = [
    {
        "name": "Phase",
        "type": "string",
        "jsonPath": ".status.phase",
        "description": "Lifecycle phase of the job",
    },
    {
        "name": "Reason",
        "type": "string",
        "jsonPath": ".status.reason",
        "description": "Why the job is in its phase (see the troubleshooting guide)",
    },
    {
        "name": "Step",
        "type": "integer",
        "jsonPath": ".status.progress.step",
        "description": "Last completed training step",
    },
    {
        "name": "Steps",
        "type": "integer",
        "jsonPath": ".status.progress.totalSteps",
        "description": "Steps the job will run",
    },
    {
        "name": "Reward",
        "type": "number",
        "jsonPath": ".status.progress.rewardMean",
        "description": "Mean reward of the last step",
    },
    {
        "name": "KL",
        "type": "number",
        "jsonPath": ".status.progress.kl",
        "priority": 1,
        "description": "KL to the reference policy in the last step",
    },
    {
        "name": "GPUs",
        "type": "integer",
        "jsonPath": ".status.gpus",
        "description": "GPUs requested by all the job's pods",
    },
    {
        "name": "RayJob",
        "type": "string",
        "jsonPath": ".status.rayJobName",
        "priority": 1,
        "description": "The RayJob running this job",
    },
    {"name": "Age", "type": "date", "jsonPath": ".metadata.creationTimestamp"},
]

_TOP_DESCRIPTIONS = {
    "apiVersion": "APIVersion defines the versioned schema of this representation of an object.",
    "kind": "Kind is a string value representing the REST resource this object represents.",
    "metadata": "Standard object metadata.",
    "metadata.name": "The job's name: KubeRay names its RayCluster, services and PodGroup after "
    "it, so at most 47 characters of lower-case letters, digits and '-', starting with a letter.",
    "spec": "Desired state of the PPOJob.",
    "status": "Observed state of the PPOJob, written by the operator and the trainer.",
}


def _one_line(text: str) -> str:
    return " ".join(text.split())


def structural_schema(schema: dict[str, Any]) -> dict[str, Any]:
    """Translate a pydantic JSON schema into a structural OpenAPI v3.0 schema."""
    defs = schema.get("$defs", {})

    def conv(node: dict[str, Any]) -> dict[str, Any]:
        node = dict(node)
        if "$ref" in node:
            target = defs[node.pop("$ref").split("/")[-1]]
            merged = {**copy.deepcopy(target), **node}  # the use site's description wins
            return conv(merged)
        out: dict[str, Any] = {}
        nullable = False
        if "oneOf" in node:
            out = _merge_members([conv(o) for o in node.pop("oneOf")])
            out.update(conv(node))  # the use site's description
        elif "anyOf" in node:
            options = [o for o in node.pop("anyOf") if o.get("type") != "null"]
            if len(options) != 1:
                raise ValueError(f"cannot express a union of {len(options)} types structurally")
            out = conv(options[0])
            out.update(conv(node))  # the use site's description and default
            nullable = True
        else:
            for key, value in node.items():
                if key in _DROP:
                    continue
                if key == "properties":
                    out["properties"] = {k: conv(v) for k, v in value.items()}
                elif key == "items":
                    out["items"] = conv(value)
                elif key == "additionalProperties":
                    if isinstance(value, dict) and value:
                        out["additionalProperties"] = conv(value)
                    # `false` (unknown fields are pruned anyway) and `true` are dropped;
                    # free-form maps carry x-kubernetes-preserve-unknown-fields instead.
                elif key == "const":
                    out["enum"] = [value]
                elif key == "exclusiveMinimum":
                    out["minimum"], out["exclusiveMinimum"] = value, True
                elif key == "exclusiveMaximum":
                    out["maximum"], out["exclusiveMaximum"] = value, True
                elif key == "description":
                    out["description"] = _one_line(value)
                elif key == "default":
                    if value is not None:
                        out["default"] = value
                else:
                    out[key] = value
        if nullable and "enum" in out:
            # The API server checks a null it keeps (nullable) against the enum, which no null
            # satisfies (not even a listed one): `gangScheduler: null` would be refused while
            # `ppojob validate` reads it as unset. Not nullable, the null is pruned and the field
            # is unset in the stored object too, the same verdict; a null that meant anything
            # but the default could not be stored at all.
            if "default" in out:
                raise ValueError(f"a nullable enum with a default cannot take null: {out}")
            nullable = False
        if nullable:
            out["nullable"] = True
        if "enum" in out and "type" not in out:
            out["type"] = "string"
        if (
            out.get("type") == "object"
            and "properties" not in out
            and ("additionalProperties" not in out)
        ):
            out["x-kubernetes-preserve-unknown-fields"] = True
        return out

    return conv(schema)


def _merge_members(members: list[dict[str, Any]]) -> dict[str, Any]:
    """A discriminated union (pydantic's `oneOf`) as one structural object: every member's
    properties, the discriminator's enum of every tag, required only what all members require.
    Defaults are dropped (the API server would fill one member's default into the others; the
    operator's validation fills them per member). Members share their tag's description and
    say in each of their fields' descriptions which members have it."""
    tag_field = next(iter(members[0]["properties"]))  # each member's first field is its tag
    tags = [v for m in members for v in m["properties"][tag_field].get("enum", [])]
    props: dict[str, Any] = {}
    for member in members:
        for name, prop in member["properties"].items():
            props.setdefault(name, {k: v for k, v in prop.items() if k != "default"})
    texts = list(dict.fromkeys(m["properties"][tag_field].get("description") for m in members))
    props[tag_field] = {"type": "string", "enum": tags}
    if texts != [None]:
        props[tag_field]["description"] = " ".join(t for t in texts if t)
    required = set.intersection(*(set(m.get("required", [])) for m in members))
    out: dict[str, Any] = {"type": "object", "properties": props}
    if required:
        out["required"] = [n for n in props if n in required]
    return out


def openapi_schema() -> dict[str, Any]:
    """The PPOJob's openAPIV3Schema."""
    raw = PPOJob.model_json_schema(by_alias=True, mode="validation")
    schema = structural_schema(raw)
    schema["required"] = ["spec"]
    # The API server refuses a CRD whose root `metadata` schema holds anything but `type: object`
    # and rules on name or generateName (a description included): "must not specify anything
    # other than name and generateName". The name's rules are in `cel.ADMISSION_RULES`.
    name_schema = {"type": "string", "description": _TOP_DESCRIPTIONS["metadata.name"]}
    schema["properties"]["metadata"] = {"type": "object", "properties": {"name": name_schema}}
    for name, text in _TOP_DESCRIPTIONS.items():
        if not name.startswith("metadata"):
            schema["properties"][name]["description"] = text
    schema["description"] = _one_line(PPOJob.__doc__ or "")
    # apiVersion and kind are checked by the API server itself; no enum/default there.
    for name in ("apiVersion", "kind"):
        schema["properties"][name] = {
            "type": "string",
            "description": _TOP_DESCRIPTIONS[name],
        }
    bound_schema(schema["properties"]["spec"])
    attach_rules(schema)
    return schema


SCHEMA_HASH_ANNOTATION = "ppojob.io/schema-hash"
"""The CRD's annotation holding :func:`schema_hash` of its ``spec``: the operator compares the
installed CRD's with its own at start-up (Helm installs ``crds/`` once and never upgrades it)."""


def schema_hash(crd_spec: dict[str, Any]) -> str:
    """``sha256:<hex>`` of a CRD's ``spec`` as canonical JSON (sorted keys, no spaces)."""
    text = json.dumps(crd_spec, sort_keys=True, separators=(",", ":"), ensure_ascii=True)
    return "sha256:" + hashlib.sha256(text.encode()).hexdigest()


def build_crd() -> dict[str, Any]:
    """The complete apiextensions.k8s.io/v1 CustomResourceDefinition, annotated with the hash of
    its spec (:data:`SCHEMA_HASH_ANNOTATION`)."""
    spec = _crd_spec()
    return {
        "apiVersion": "apiextensions.k8s.io/v1",
        "kind": "CustomResourceDefinition",
        "metadata": {
            "name": f"{PLURAL}.{GROUP}",
            "annotations": {
                "ppojob.io/generated-by": "ppojob crd (from ppojob_api)",
                SCHEMA_HASH_ANNOTATION: schema_hash(spec),
            },
        },
        "spec": spec,
    }


def _crd_spec() -> dict[str, Any]:
    return {
        "group": GROUP,
        "names": {
            "kind": KIND,
            "listKind": f"{KIND}List",
            "plural": PLURAL,
            "singular": SINGULAR,
            "shortNames": list(SHORT_NAMES),
            "categories": ["all", "ml"],
        },
        "scope": "Namespaced",
        "versions": [
            {
                "name": VERSION,
                "served": True,
                "storage": True,
                "subresources": {"status": {}},
                "additionalPrinterColumns": PRINTER_COLUMNS,
                "schema": {"openAPIV3Schema": openapi_schema()},
            }
        ],
    }


def crd_yaml() -> str:
    """The CRD as the YAML committed at crds/ppojob.io_ppojobs.yaml."""
    header = "# Generated by `ppojob crd` from ppojob_api/spec.py. Do not edit by hand.\n"
    return header + yaml.safe_dump(build_crd(), sort_keys=False, width=100)
