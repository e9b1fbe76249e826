"""The children are created concurrently, except that a RoleBinding waits for its own Role
(the API server's escalation check refuses a binding to a Role that does not exist yet)."""

from __future__ import annotations

import asyncio

from ppojob_operator import handlers, k8s
from ppojob_operator.api import validate_manifest
from ppojob_operator.builders import build_children


def _children() -> list[dict]:
    job = validate_manifest(
        {
            "apiVersion": "ppojob.io/v1alpha1",
            "kind": "PPOJob",
            "metadata": {"name": "demo", "namespace": "ns1"},
            "spec": {"image": "img:1"},
        }
    )
    return build_children(job, namespace="ns1", uid="u1")[:-1]  # all but the RayJob


def test_role_binding_waits_for_its_role_and_the_rest_run_together(monkeypatch):
    log: list[tuple[str, str]] = []

    async def fake(obj):
        log.append(("start", obj["kind"]))
        for _ in range(3):  # stay in flight across a few turns of the event loop
            await asyncio.sleep(0)
        log.append(("end", obj["kind"]))
        return {**obj, "created": True}, True

    monkeypatch.setattr(k8s, "acreate_or_get", fake)
    objs = _children()
    made = asyncio.run(handlers._create_in_order(objs))

    assert [m["kind"] for m in made] == [o["kind"] for o in objs]  # the order given
    assert all(m["created"] for m in made)
    kinds = [o["kind"] for o in objs]
    assert kinds == ["ConfigMap", "ServiceAccount", "Role", "RoleBinding"]
    # ConfigMap, ServiceAccount and Role are all in flight before any of them is done
    first_end = next(i for i, e in enumerate(log) if e[0] == "end")
    assert {k for s, k in log[:first_end]} == {"ConfigMap", "ServiceAccount", "Role"}
    # the RoleBinding starts only after its Role has been created
    assert log.index(("start", "RoleBinding")) > log.index(("end", "Role"))


def test_a_failed_role_stops_its_binding(monkeypatch):
    posted: list[str] = []

    async def fake(obj):
        posted.append(obj["kind"])
        await asyncio.sleep(0)
        if obj["kind"] == "Role":
            raise k8s.ChildConflict("Role ns1/demo-trainer exists and has no owner")
        return obj, True

    monkeypatch.setattr(k8s, "acreate_or_get", fake)
    try:
        asyncio.run(handlers._create_in_order(_children()))
    except k8s.ChildConflict:
        pass
    else:
        raise AssertionError("the conflict was swallowed")
    assert "RoleBinding" not in posted
