"""Pure: which jobs a KubeRay installation can run (issue 10, items 3, 7, 8)."""

from __future__ import annotations

import copy
import json

import pytest

from ppojob_api.validation import validate_manifest
from ppojob_operator import capabilities
from ppojob_operator.capabilities import refusal, sidecar_supported
from tests.helpers.manifests import base_manifest
from tests.helpers.ophelpers import RAYJOB_CRD, pre_1_5


def test_sidecar_support_is_read_from_the_rayjob_crd() -> None:
    assert sidecar_supported(RAYJOB_CRD) is True
    assert sidecar_supported(pre_1_5(RAYJOB_CRD)) is False
    assert sidecar_supported(None) is None


def job(**spec):
    return validate_manifest(base_manifest(**spec))


@pytest.mark.parametrize(
    ("spec", "kwargs", "reason"),
    [
        ({}, {"sidecar": False}, "KubeRayTooOld"),
        ({"submissionMode": "K8sJobMode"}, {"sidecar": False}, None),
        ({}, {"sidecar": True}, None),
        ({}, {"sidecar": None}, None),
        (
            {"scheduling": {"gangScheduler": "volcano"}},
            {"kuberay_batch_scheduler": ""},
            "BatchSchedulerMismatch",
        ),
        (
            {"scheduling": {"gangScheduler": "volcano"}},
            {"kuberay_batch_scheduler": "volcano"},
            None,
        ),
        (
            {"scheduling": {"gangScheduler": "none"}},
            {"kuberay_batch_scheduler": "volcano"},
            "BatchSchedulerMismatch",
        ),
        ({}, {"kuberay_batch_scheduler": "scheduler-plugins"}, "BatchSchedulerMismatch"),
        # gangScheduler unset: the operator's default decides
        ({"scheduling": {"queue": "q"}}, {"gang_default": "kueue"}, None),
        (
            {"scheduling": {"queue": "q"}},
            {"gang_default": "volcano", "kuberay_batch_scheduler": "volcano"},
            None,
        ),
        ({}, {"gang_default": "kueue"}, "QueueRequired"),
        (
            {"scheduling": {"gangScheduler": "kueue", "queue": "q"}},
            {"missing_crd": "workloads.kueue.x-k8s.io"},
            "SchedulerNotInstalled",
        ),
        ({"scheduling": {"queue": "Team_A"}}, {"gang_default": "kueue"}, "InvalidQueue"),
        ({"scheduling": {"queue": "team-a"}}, {"gang_default": "kueue"}, None),
        ({"scheduling": {"queue": "q"}}, {}, "NoGangScheduler"),
        ({"scheduling": {"workloadPriorityClass": "high"}}, {}, "NotKueue"),
        ({"scheduling": {"topology": {"level": "rack"}}}, {}, "NotKueue"),
        (
            {"scheduling": {"queue": "lq", "topology": {"level": "rack"}}},
            {"gang_default": "kueue"},
            None,
        ),
        # kai as the operator's default: KubeRay would requeue these RayJobs with no status
        (
            {"submissionMode": "K8sJobMode", "scheduling": {"queue": "q"}},
            {"gang_default": "kai", "kuberay_batch_scheduler": "kai-scheduler"},
            "KaiNeedsSidecarMode",
        ),
        ({}, {"gang_default": "kai", "kuberay_batch_scheduler": "kai-scheduler"}, "QueueRequired"),
        (
            {"scheduling": {"gangScheduler": "kai", "queue": "q"}},
            {"kuberay_batch_scheduler": "kai-scheduler", "kuberay_1_6": False},
            "KubeRayTooOld",
        ),
        (
            {"scheduling": {"gangScheduler": "kai", "queue": "q"}},
            {"kuberay_batch_scheduler": "kai-scheduler", "kuberay_1_6": True},
            None,
        ),
        (
            {"scheduling": {"queue": "q", "workloadPriorityClass": "high"}},
            {"gang_default": "kueue"},
            None,
        ),
        (
            {"scheduling": {"queue": "q"}},
            {"gang_default": "volcano", "kuberay_batch_scheduler": ""},
            "BatchSchedulerMismatch",
        ),
    ],
)
def test_refusals(spec, kwargs, reason) -> None:
    args = {"gang_default": None, "kuberay_batch_scheduler": None, "sidecar": None, **kwargs}
    got = refusal(job(**spec), **args)
    assert (got[0] if got else None) == reason, got
    if got:
        assert got[1]  # a message saying what to change


def test_a_crd_without_this_operators_schema_hash_is_stale() -> None:
    """Helm never upgrades crds/: the operator compares the installed CRD's
    ``ppojob.io/schema-hash`` with the hash of the CRD it was built with, and names the fix."""
    from ppojob_api.crd import SCHEMA_HASH_ANNOTATION, build_crd, schema_hash

    crd = build_crd()
    expected = schema_hash(crd["spec"])
    assert crd["metadata"]["annotations"][SCHEMA_HASH_ANNOTATION] == expected
    assert capabilities.crd_staleness(crd, expected) is None
    assert capabilities.crd_staleness(None, expected) is None  # kopf waits for the CRD itself
    # an older CRD: another schema (one field fewer), or from before the annotation
    older = copy.deepcopy(crd)
    props = older["spec"]["versions"][0]["schema"]["openAPIV3Schema"]["properties"]["spec"]
    props["properties"].pop(next(iter(props["properties"])))
    older["metadata"]["annotations"][SCHEMA_HASH_ANNOTATION] = schema_hash(older["spec"])
    why = capabilities.crd_staleness(older, expected)
    assert why is not None and "stale" in why and "kubectl apply" in why and "crds/" in why
    assert schema_hash(older["spec"]) in why and expected in why
    del older["metadata"]["annotations"][SCHEMA_HASH_ANNOTATION]
    why = capabilities.crd_staleness(older, expected)
    assert why is not None and f"no {SCHEMA_HASH_ANNOTATION} annotation" in why
    # the hash is of the schema, whatever the key order
    shuffled = json.loads(json.dumps(crd["spec"], sort_keys=True))
    assert schema_hash(shuffled) == expected


def _kuberay(name: str, args: list[str], **pod: object) -> dict:
    labels = {"app.kubernetes.io/name": "kuberay-operator"}
    container: dict = {"name": "kuberay-operator", "command": ["/manager"], "args": args}
    container.update(pod.pop("container", {}))  # type: ignore[arg-type]
    return {
        "metadata": {"name": name, "labels": labels},
        "spec": {"template": {"spec": {"containers": [container], **pod}}},
    }


def test_kuberays_batch_scheduler_is_read_from_its_deployment_as_kuberay_reads_its_flags() -> None:
    """``--kuberay-batch-scheduler=auto``: what KubeRay's own Deployment says, however KubeRay's
    chart wrote it; None (not checked) when there is no single answer."""
    of = capabilities.kuberay_batch_scheduler_of
    assert of([], {}) is None
    assert of([_kuberay("kuberay-operator", ["--batch-scheduler=volcano"])], {}) == "volcano"
    assert of([_kuberay("kuberay-operator", ["--batch-scheduler", "yunikorn"])], {}) == "yunikorn"
    assert of([_kuberay("kuberay-operator", ["-batch-scheduler=yunikorn"])], {}) == "yunikorn"
    assert of([_kuberay("kuberay-operator", ["--enable-batch-scheduler"])], {}) == "volcano"
    assert of([_kuberay("kuberay-operator", ["--enable-batch-scheduler=false"])], {}) == ""
    assert of([_kuberay("kuberay-operator", ["--metrics-addr=:8080"])], {}) == ""
    other = _kuberay("web", ["--batch-scheduler=volcano"])
    other["metadata"]["labels"] = {"app.kubernetes.io/name": "web"}
    assert of([other], {}) is None  # not KubeRay's
    # KubeRay's chart with configuration.enabled: flags ignored, the file decides
    mount = {"name": "operator-config", "mountPath": "/etc/kuberay", "readOnly": True}
    with_file = _kuberay(
        "kuberay-operator",
        ["--config", "/etc/kuberay/config.yaml", "--batch-scheduler=volcano"],
        container={"volumeMounts": [mount]},
        volumes=[{"name": "operator-config", "configMap": {"name": "kuberay-operator-config"}}],
    )
    cm = {"data": {"config.yaml": "batchScheduler: yunikorn\nreconcileConcurrency: 1\n"}}
    assert of([with_file], {"kuberay-operator-config": cm}) == "yunikorn"
    assert of([with_file], {}) is None  # the file unreadable: unknown
    legacy = {"data": {"config.yaml": "enableBatchScheduler: true\n"}}
    assert of([with_file], {"kuberay-operator-config": legacy}) == "volcano"
    # two KubeRays that disagree: no single answer; that agree: the answer
    two = [_kuberay("a", ["--batch-scheduler=volcano"]), _kuberay("b", ["--batch-scheduler=x"])]
    assert of(two, {}) is None
    assert of([two[0], _kuberay("b", ["--batch-scheduler=volcano"])], {}) == "volcano"


def test_token_auth_support_is_read_from_the_rayjob_crd() -> None:
    """KubeRay 1.6 added ``spec.rayClusterSpec.authOptions`` to the RayJob CRD."""
    assert capabilities.dashboard_auth_supported(RAYJOB_CRD) is True
    older = copy.deepcopy(RAYJOB_CRD)
    for v in older["spec"]["versions"]:
        if v["name"] != "v1":
            continue
        spec = v["schema"]["openAPIV3Schema"]["properties"]["spec"]["properties"]
        del spec["rayClusterSpec"]["properties"]["authOptions"]
    assert capabilities.dashboard_auth_supported(older) is False
    assert capabilities.dashboard_auth_supported(None) is None
    assert capabilities.ray_supports_auth("2.52.0") and capabilities.ray_supports_auth("3.0")
    assert not capabilities.ray_supports_auth("2.51.9") and not capabilities.ray_supports_auth("")


@pytest.mark.parametrize(
    ("crd", "ray_auth", "want"),
    [
        ("1.6", None, (True, True)),  # auto: token where KubeRay has authOptions
        ("1.5", None, (False, False)),
        ("1.6", False, (True, False)),  # --ray-auth=off: the version is still known
        (None, None, (None, False)),  # no CRD readable: nothing refused, no token
    ],
)
def test_start_up_reads_kuberay_1_6_and_token_support_from_the_rayjob_crd(
    monkeypatch, crd, ray_auth, want
) -> None:
    """handlers.detect_kuberay: one read of the RayJob CRD gives whether KubeRay is >= 1.6 (kai
    needs it) and, unless the command line said, whether jobs get token authentication."""
    import asyncio

    from ppojob_operator import handlers, k8s
    from ppojob_operator.state import OperatorConfig, State

    older = copy.deepcopy(RAYJOB_CRD)
    for v in older["spec"]["versions"]:
        if v["name"] == "v1":
            props = v["schema"]["openAPIV3Schema"]["properties"]["spec"]["properties"]
            del props["rayClusterSpec"]["properties"]["authOptions"]
    found = {"1.6": RAYJOB_CRD, "1.5": older, None: None}[crd]

    async def aget(api_version, kind, namespace, name):  # type: ignore[no-untyped-def]
        assert (kind, name) == ("CustomResourceDefinition", "rayjobs.ray.io")
        return found

    monkeypatch.setattr(k8s, "aget", aget)
    state = State(OperatorConfig(sidecar_supported=True, dashboard_auth=ray_auth))
    asyncio.run(handlers.detect_kuberay(state))
    assert (state.config.kuberay_1_6, bool(state.config.dashboard_auth)) == want
