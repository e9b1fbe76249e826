"""The self-healing handlers of the children run for deletions only: a child's creation (four
per job) neither invokes nor logs them; a deletion does, and the child comes back."""

from __future__ import annotations

import logging

from ppojob_operator import k8s
from tests.helpers.kmockenv import Operator, kube, wait_for
from tests.helpers.manifests import base_manifest

PPO = ("ppojob.io/v1alpha1", "PPOJob")
CM = ("v1", "ConfigMap")


def _heal_records(caplog) -> list[str]:
    return [r.getMessage() for r in caplog.records if "'heal-" in r.getMessage()]


def test_heal_handlers_run_on_deletion_only(cluster, caplog):
    caplog.set_level(logging.DEBUG, logger="kopf")
    with Operator(cluster.url, ["ns1"]):
        body = base_manifest(name="demo")
        body["metadata"]["uid"] = "uid-demo"  # kmock assigns none
        kube.request("POST", k8s.path_for(*PPO, "ns1"), body)
        wait_for(lambda: ((kube.get(*PPO, "ns1", "demo") or {}).get("status") or {}).get("phase"))
        assert kube.get(*CM, "ns1", "demo-trainer") is not None
        kube.request("DELETE", k8s.path_for(*CM, "ns1", "demo-trainer"))
        wait_for(lambda: kube.get(*CM, "ns1", "demo-trainer"), timeout=20)
        # Checked last, when every creation event (those of the first children and of the
        # recreated ConfigMap) has long reached the operator: only the deletion ran a handler.
        wait_for(lambda: any("heal-configmaps" in m for m in _heal_records(caplog)))
        healed = {m.split("'")[1] for m in _heal_records(caplog)}
        assert healed == {"heal-configmaps"}, _heal_records(caplog)
