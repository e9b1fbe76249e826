"""Fixtures of the operator tests: manifests, strict schema validators, kmock + operator."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import jsonschema
import pytest

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

from ophelpers import crd_validator  # noqa: E402


@pytest.fixture(scope="session")
def validators() -> dict[tuple[str, str], jsonschema.Draft7Validator]:
    return {
        ("ray.io/v1", "RayJob"): crd_validator("ray.io_rayjobs.yaml", "v1"),
        ("scheduling.x-k8s.io/v1alpha1", "PodGroup"): crd_validator(
            "scheduling.x-k8s.io_podgroups.yaml", "v1alpha1"
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
    from kmockenv import Emulator, kube

    from ppojob_operator import k8s

    with Emulator() as em:
        k8s.configure(em.url)
        ns = {"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": "ns1"}}
        kube.request("POST", "/api/v1/namespaces", ns)
        try:
            yield em
        finally:
            kube.close()
