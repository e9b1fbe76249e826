"""A stale PPOJob CRD on the real API server: the operator reports it at start-up.

Helm installs a chart's ``crds/`` once and never upgrades them, so after ``helm upgrade`` the API
server can keep an older schema (and silently prune the fields it lacks). The CRD carries the
hash of its schema (``ppojob.io/schema-hash``); the operator compares it with its own at start-up
and says so: a log line naming the fix, a Warning event on the CRD and ``ppojob_crd_stale 1``.
"""

from __future__ import annotations

import copy
import json
import urllib.request
from typing import Any

import yaml

from ppojob_api.crd import SCHEMA_HASH_ANNOTATION, build_crd, schema_hash
from tests.cluster.conftest import OperatorProcess
from tests.helpers.controlplane import RESOURCES, free_port, wait_until

RESOURCES.setdefault(
    "customresourcedefinition",
    ("apis/apiextensions.k8s.io/v1", "customresourcedefinitions", False),
)
CRD_NAME = "ppojobs.ppojob.io"


def older_crd() -> dict[str, Any]:
    """This CRD as an earlier release shipped it: a spec field fewer, its own hash."""
    crd = copy.deepcopy(build_crd())
    spec = crd["spec"]["versions"][0]["schema"]["openAPIV3Schema"]["properties"]["spec"]
    del spec["properties"]["ttlSecondsAfterFinished"]
    # as that release had no admission rule on the field either (the API server refuses a rule
    # whose path is not in the schema)
    root = crd["spec"]["versions"][0]["schema"]["openAPIV3Schema"]
    root["x-kubernetes-validations"] = [
        r
        for r in root.get("x-kubernetes-validations", [])
        if "ttlSecondsAfterFinished" not in json.dumps(r)
    ]
    crd["metadata"]["annotations"][SCHEMA_HASH_ANNOTATION] = schema_hash(crd["spec"])
    return crd


def apply_crd(cp, crd: dict[str, Any]) -> None:
    """As the control plane installed it (server-side, field manager kubectl): a field the
    applied CRD lacks is removed."""
    cp.kubectl("apply", "--server-side", "--force-conflicts", "-f", "-", input=yaml.safe_dump(crd))


def metric(port: int, name: str) -> float | None:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as r:
        for line in r.read().decode().splitlines():
            if line.startswith(name + " "):
                return float(line.split()[1])
    return None


def crd_events(cp) -> list[dict[str, Any]]:
    events = cp.get("event", namespace="default")["items"]
    return [
        e
        for e in events
        if e["involvedObject"].get("kind") == "CustomResourceDefinition"
        and e["involvedObject"].get("name") == CRD_NAME
        and e["reason"] == "StaleCRD"
    ]


def test_the_operator_reports_a_stale_crd_at_start_up(cp, operator, ns):
    """An older CRD on the API server: the operator logs the stale schema with the fix, posts a
    Warning event on the CRD and sets ``ppojob_crd_stale`` to 1; with this release's CRD
    applied again, a restarted operator reports 0 and no new event."""
    current = build_crd()
    apply_crd(cp, older_crd())
    stored = cp.get("customresourcedefinition", CRD_NAME)
    props = stored["spec"]["versions"][0]["schema"]["openAPIV3Schema"]["properties"]["spec"]
    assert "ttlSecondsAfterFinished" not in props["properties"]
    assert (
        stored["metadata"]["annotations"][SCHEMA_HASH_ANNOTATION]
        != (current["metadata"]["annotations"][SCHEMA_HASH_ANNOTATION])
    )
    port = free_port()
    # a second operator watching an empty namespace only: it acts on nothing else
    op = OperatorProcess(
        cp, operator.kubeconfig, [f"--metrics-port={port}"], namespaces=[ns], name="crd-check"
    )
    before = len(crd_events(cp))
    try:
        op.start()
        wait_until(lambda: metric(port, "ppojob_crd_stale") == 1.0, 30, "ppojob_crd_stale 1")
        assert op.comp is not None
        log = op.comp.tail(200_000)
        assert "is stale" in log and "kubectl apply" in log and "crds/" in log, log[-3000:]
        [event] = wait_until(lambda: crd_events(cp)[before:], 30, "a StaleCRD event")
        assert event["type"] == "Warning" and "kubectl apply" in event["message"]
        op.stop()

        apply_crd(cp, current)
        op.start()
        wait_until(lambda: metric(port, "ppojob_crd_stale") == 0.0, 30, "ppojob_crd_stale 0")
        assert len(crd_events(cp)) == before + 1
    finally:
        op.stop()
        apply_crd(cp, current)
