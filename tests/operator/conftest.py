"""Fixtures of the operator tests: manifests, strict schema validators, kmock + operator."""

from __future__ import annotations

from typing import Any

import jsonschema
import pytest

from tests.helpers.ophelpers import crd_validator


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
    from ppojob_operator import k8s
    from tests.helpers.kmockenv import Emulator, kube

    with Emulator() as em:
        k8s.configure(em.url)
        ns = {"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": "ns1"}}
        kube.request("POST", "/api/v1/namespaces", ns)
        # the gang schedulers are "installed": their CRDs exist (the operator checks)
        from ppojob_operator.capabilities import SCHEDULER_CRDS

        for crd, (kind, version) in zip(
            SCHEDULER_CRDS.values(),
            [
                ("Workload", "v1beta1"),
                ("PodGroup", "v1alpha1"),
                ("PodGroup", "v1beta1"),
                ("Queue", "v2"),
            ],
            strict=True,
        ):
            plural, group = crd.split(".", 1)
            kube.request(
                "POST",
                "/apis/apiextensions.k8s.io/v1/customresourcedefinitions",
                {
                    "apiVersion": "apiextensions.k8s.io/v1",
                    "kind": "CustomResourceDefinition",
                    "metadata": {"name": crd},
                    "spec": {
                        "group": group,
                        "scope": "Namespaced",
                        "names": {"plural": plural, "singular": kind.lower(), "kind": kind},
                        "versions": [{"name": version, "served": True, "storage": True}],
                    },
                },
            )
        try:
            yield em
        finally:
            kube.close()
