"""`ppojob validate` and the real API server agree (issue 23): what validate accepts the API
server accepts (a dry-run create, with kubectl's strict field validation), and what the API
server refuses validate refuses too, for quantities, key spellings and Kubernetes names."""

from __future__ import annotations

import copy
import json
import urllib.error
import urllib.request
from typing import Any

import pytest
import yaml
from hypothesis import HealthCheck, given, settings

from ppojob_api.problems import SpecError
from ppojob_api.validation import validate_manifest
from ppojob_api.yamlio import load_yaml_documents
from tests.api.test_bad_input import (
    METADATA_ACCEPTED,
    METADATA_REFUSED,
    QUANTITIES_ACCEPTED,
    QUANTITIES_REFUSED,
    SNAKE_CASE,
    TINY,
)
from tests.cli.test_bad_input_corpus import mutated
from tests.helpers.bad_manifests import judge
from tests.helpers.controlplane import ROOT, ControlPlane
from tests.helpers.manifests import set_path


def dry_run(cp: ControlPlane, ns: str, doc: dict[str, Any]) -> tuple[dict[str, Any], str]:
    """A dry-run create of `doc` with strict field validation, as `kubectl apply` sends it:
    (the object the API server would store, pruned and defaulted; "") or ({}, its refusal)."""
    meta = doc.get("metadata") if isinstance(doc.get("metadata"), dict) else {}
    body = json.dumps({**doc, "metadata": {**meta, "namespace": ns}}).encode()
    path = f"/apis/ppojob.io/v1alpha1/namespaces/{ns}/ppojobs?dryRun=All&fieldValidation=Strict"
    req = urllib.request.Request(
        cp.server + path, body, {"Content-Type": "application/json"}, method="POST"
    )
    try:
        with urllib.request.urlopen(req, context=cp._ssl(), timeout=30) as answer:
            return json.loads(answer.read()), ""
    except urllib.error.HTTPError as e:
        return {}, e.read().decode()


def server_refusal(
    cp: ControlPlane, ns: str, doc: dict[str, Any], limit: int | None = 400
) -> str | None:
    """None when the API server would store `doc`, else its message (its first ``limit``
    characters; None: whole)."""
    _, refusal = dry_run(cp, ns, doc)
    return refusal[:limit] if refusal else None


def validate_refusal(doc: dict[str, Any]) -> str | None:
    try:
        validate_manifest(copy.deepcopy(doc))
    except SpecError as exc:
        return str(exc)
    return None


def with_metadata(meta: dict[str, Any]) -> dict[str, Any]:
    doc = copy.deepcopy(TINY)
    doc["metadata"] = meta if "name" in meta else {"name": "job", **meta}
    return doc


def cases() -> list[tuple[str, dict[str, Any], bool]]:
    """(name, manifest, whether the verdicts must be equal: the API server judges metadata
    itself, so there validate must refuse exactly what it refuses)."""
    out = [(f"accepted {p}={v!r}", set_path(TINY, p, v), False) for p, v, _ in QUANTITIES_ACCEPTED]
    out += [(f"refused {p}={v!r}", set_path(TINY, p, v), False) for p, v, *_ in QUANTITIES_REFUSED]
    out += [(f"snake {p}", set_path(TINY, p, v), True) for p, v, _ in SNAKE_CASE]
    out += [(f"metadata {m}"[:90], with_metadata(m), True) for m, *_ in METADATA_REFUSED]
    out += [(f"metadata {m}"[:90], with_metadata(m), True) for m in METADATA_ACCEPTED]
    out += [(f"null in a nullable enum {p}", set_path(TINY, p, v), True) for p, v in NULL_ENUMS]
    return out


NULL_ENUMS: list[tuple[str, Any]] = [
    ("spec.scheduling.gangScheduler", None),
    ("spec.head.tolerations", [{"key": "g", "operator": "Exists", "effect": None}]),
]
"""Nulls in nullable enum fields, which `ppojob validate` reads as unset: the API server must
store them (it checks a null against the enum as well)."""


def test_validate_and_the_api_server_agree(cp: ControlPlane, ns: str) -> None:
    disagreements = []
    for name, doc, exact in cases():
        ours, theirs = validate_refusal(doc), server_refusal(cp, ns, doc)
        if ours is None and theirs is not None:
            disagreements.append(f"{name}: validate accepts, the API server refuses: {theirs}")
        if exact and ours is not None and theirs is None:
            disagreements.append(f"{name}: the API server accepts, validate refuses: {ours}")
    assert not disagreements, "\n".join(disagreements)


@pytest.mark.parametrize(("path", "value", "alias"), SNAKE_CASE[:2])
def test_the_api_server_refuses_snake_case_keys_as_validate_does(
    cp: ControlPlane, ns: str, path: str, value: Any, alias: str
) -> None:
    refusal = server_refusal(cp, ns, set_path(TINY, path, value))
    assert refusal is not None and "unknown field" in refusal, refusal


POD_CASES: list[tuple[str, dict[str, Any]]] = [
    ("Exists with a value", {"tolerations": [{"key": "g", "operator": "Exists", "value": "x"}]}),
    ("seconds without NoExecute", {"tolerations": [{"key": "g", "tolerationSeconds": 3}]}),
    ("empty key with Equal", {"tolerations": [{"operator": "Equal"}]}),
    ("a valid toleration", {"tolerations": [{"key": "g", "effect": "NoExecute", "value": "v"}]}),
    ("a toleration value with a space", {"tolerations": [{"key": "g", "value": "a b"}]}),
    ("a node selector key with a space", {"nodeSelector": {"bad key": "v"}}),
    ("a node selector value with a space", {"nodeSelector": {"gpu": "H100 SXM"}}),
    ("a long node selector value", {"nodeSelector": {"gpu": "x" * 64}}),
    ("a valid node selector", {"nodeSelector": {"nvidia.com/gpu.product": "H100-SXM"}}),
]


def test_pod_field_rules_are_the_api_servers(cp: ControlPlane, ns: str) -> None:
    """Tolerations and node selectors judged by `check_pod_fields` get the verdict the API server
    gives a Pod holding them (a dry-run create)."""
    from ppojob_api.checks.pods import check_pod_fields
    from ppojob_api.spec import PPOJobSpec

    disagreements = []
    for name, fields in POD_CASES:
        model = {"path": "builtin:tiny-llama"}
        spec = PPOJobSpec.model_validate({"image": "trainer:1", "model": model, "head": fields})
        ours = check_pod_fields(spec)
        pod = {
            "apiVersion": "v1",
            "kind": "Pod",
            "metadata": {"name": "p", "namespace": ns},
            "spec": {"containers": [{"name": "c", "image": "trainer:1"}], **fields},
        }
        req = urllib.request.Request(
            f"{cp.server}/api/v1/namespaces/{ns}/pods?dryRun=All",
            json.dumps(pod).encode(),
            {"Content-Type": "application/json"},
            method="POST",
        )
        try:
            with urllib.request.urlopen(req, context=cp._ssl(), timeout=30):
                theirs = None
        except urllib.error.HTTPError as e:
            theirs = e.read().decode()[:300]
        if bool(ours) != (theirs is not None):
            disagreements.append(
                f"{name}: ours {[str(p) for p in ours]}, the API server's {theirs}"
            )
    assert not disagreements, "\n".join(disagreements)


@settings(
    max_examples=150,
    derandomize=True,
    database=None,
    deadline=None,
    suppress_health_check=list(HealthCheck),
)
@given(text=mutated())
def test_what_validate_accepts_in_the_corpus_the_api_server_accepts(
    cp: ControlPlane, ns: str, text: str | bytes
) -> None:
    """The generated corpus of tests/cli/test_bad_input_corpus.py, against the real API server:
    every manifest validate accepts is accepted by a dry-run create."""
    if judge(text).kind != "accepted":
        return
    for doc in load_yaml_documents(text if isinstance(text, str) else text.decode()):
        if doc is not None:
            refusal = server_refusal(cp, ns, doc)
            assert refusal is None, refusal


def spec_fields(schema: dict[str, Any], path: str = "spec") -> list[tuple[str, Any]]:
    """(dotted path, value) for a null in every field of the CRD's spec schema: through objects,
    and in a list of objects as the one field of its one item."""
    out: list[tuple[str, Any]] = []
    for key, sub in (schema.get("properties") or {}).items():
        out.append((f"{path}.{key}", None))
        if sub.get("type") == "object":
            out += spec_fields(sub, f"{path}.{key}")
        items = sub.get("items") or {}
        if sub.get("type") == "array" and items.get("type") == "object":
            out += [(f"{path}.{key}", [{field: None}]) for field in items.get("properties") or {}]
    return out


def test_a_null_anywhere_in_the_spec_gets_the_verdict_of_the_object_stored(
    cp: ControlPlane, ns: str
) -> None:
    """The one API rule for nulls (every field of the spec in turn, and of a list's item):
    `ppojob validate` judges the manifest with the null as the operator judges what the API
    server stores for it (a null pruned and defaulted, or kept where the field is nullable);
    and a manifest validate accepts is stored. A nullable enum failed it: ``gangScheduler:
    null`` accepted, refused by the API server."""
    crd = yaml.safe_load((ROOT / "crds" / "ppojob.io_ppojobs.yaml").read_text())
    schema = crd["spec"]["versions"][0]["schema"]["openAPIV3Schema"]["properties"]["spec"]
    disagreements = []
    fields = spec_fields(schema)
    for field, value in fields:
        doc = set_path(TINY, field, value)
        ours = validate_refusal(doc)
        stored, _ = dry_run(cp, ns, doc)
        if not stored:
            if ours is None:
                disagreements.append(
                    f"{field}={value}: accepted by validate, refused by the server"
                )
            continue
        theirs = validate_refusal(
            {k: stored[k] for k in ("apiVersion", "kind", "metadata", "spec")}
        )
        if ours != theirs:
            disagreements.append(f"{field}={value}: as written {ours!r}; as stored {theirs!r}")
    assert len(fields) > 200, fields
    assert not disagreements, "\n".join(disagreements)
