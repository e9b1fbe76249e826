"""Fixtures of the operator tests: manifests, strict schema validators, kmock + operator."""

from __future__ import annotations

import copy
import sys
from pathlib import Path
from typing import Any

import jsonschema
import pytest
import yaml

HERE = Path(__file__).resolve().parent
REPO = HERE.parents[1]
EXTERNAL_CRDS = REPO.parent / "shared" / "external-crds"
sys.path.insert(0, str(HERE))


def base_manifest(name: str = "demo", namespace: str = "ns1", **spec: Any) -> dict[str, Any]:
    body: dict[str, Any] = {"image": "ghcr.io/example/ppojob-trainer:1"}
    body.update(spec)
    return {
        "apiVersion": "ppojob.io/v1alpha1",
        "kind": "PPOJob",
        "metadata": {"name": name, "namespace": namespace},
        "spec": body,
    }


def _strict(schema: Any) -> Any:
    """Close every object schema that lists properties (unless it preserves unknown fields)."""
    if isinstance(schema, dict):
        out = {k: _strict(v) for k, v in schema.items()}
        if (
            "properties" in out
            and "additionalProperties" not in out
            and not out.get("x-kubernetes-preserve-unknown-fields")
        ):
            out["additionalProperties"] = False
        if out.get("x-kubernetes-int-or-string") and "type" not in out:
            out["anyOf"] = [{"type": "integer"}, {"type": "string"}]
        return out
    if isinstance(schema, list):
        return [_strict(v) for v in schema]
    return schema


def crd_validator(filename: str, version: str) -> jsonschema.Draft7Validator:
    crd = yaml.safe_load((EXTERNAL_CRDS / filename).read_text())
    for v in crd["spec"]["versions"]:
        if v["name"] == version:
            schema = _strict(copy.deepcopy(v["schema"]["openAPIV3Schema"]))
            return jsonschema.Draft7Validator(schema)
    raise LookupError(f"{filename} has no version {version}")


@pytest.fixture(scope="session")
def validators() -> dict[tuple[str, str], jsonschema.Draft7Validator]:
    return {
        ("ray.io/v1", "RayJob"): crd_validator("ray.io_rayjobs.yaml", "v1"),
        ("scheduling.x-k8s.io/v1alpha1", "PodGroup"): crd_validator(
            "scheduling.x-k8s.io_podgroups.yaml", "v1alpha1"
        ),
        ("scheduling.volcano.sh/v1beta1", "PodGroup"): crd_validator(
            "scheduling.volcano.sh_podgroups.yaml", "v1beta1"
        ),
    }


@pytest.fixture()
def validate_child(validators: dict) -> Any:
    import kubernetes_validate

    def check(obj: dict[str, Any]) -> None:
        key = (obj["apiVersion"], obj["kind"])
        if key in validators:
            errors = sorted(validators[key].iter_errors(obj), key=lambda e: list(e.path))
            assert not errors, "\n".join(f"{list(e.path)}: {e.message}" for e in errors[:10])
        else:
            kubernetes_validate.validate(obj, "1.33", strict=True)

    return check


@pytest.fixture()
def cluster() -> Any:
    """kmock serving a namespace `ns1`, and a function starting the real operator on it."""
    from kmockenv import Emulator
    from ppojob_operator import k8s

    with Emulator() as em:
        k8s.configure(em.url)
        ns = {"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": "ns1"}}
        k8s.request("POST", "/api/v1/namespaces", ns)
        yield em
