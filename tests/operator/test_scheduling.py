"""One strategy per gang scheduler, called directly: the labels, annotations, scheduler name and
objects each adds, the gang's totals, and when KubeRay's installation-wide batch scheduler
disagrees with a job's."""

from __future__ import annotations

import hashlib
from typing import Any

import pytest

from ppojob_api.validation import validate_manifest
from ppojob_operator import scheduling
from ppojob_operator.scheduling import GangMember, gang_totals, kuberay_disagreement, plan
from tests.helpers.manifests import base_manifest

MEMBERS = [
    GangMember(1, {"cpu": "1", "memory": "2Gi"}),
    GangMember(3, {"cpu": "500m", "memory": "512Mi", "nvidia.com/gpu": "2", "rdma/ib": "0"}),
]


def job(**scheduling_spec: Any):
    return validate_manifest(base_manifest(scheduling=scheduling_spec))


def gang_plan(scheduler: str, **scheduling_spec: Any) -> scheduling.GangPlan:
    return plan(
        job(gangScheduler=scheduler, **scheduling_spec),
        name="demo",
        namespace="ns1",
        scheduler=scheduler,
        members=MEMBERS,
        owner_refs=[{"kind": "PPOJob", "name": "demo", "uid": "u1"}],
        uid="u1",
        attempt=2,
    )


def test_gang_totals_add_every_member_and_drop_zero_resources() -> None:
    count, resources = gang_totals(MEMBERS)
    assert count == 4
    assert resources == {
        "cpu": "2500m",
        "memory": str(2 * 2**30 + 3 * 512 * 2**20),
        "nvidia.com/gpu": "6",
    }
    assert gang_totals([GangMember(2, {"cpu": "1500m"})]) == (2, {"cpu": "3"})
    assert gang_totals([GangMember(3, {"memory": "1k"})]) == (3, {"memory": "3000"})
    assert gang_totals([]) == (0, {})


def test_volcano_labels_the_rayjob_for_kuberay() -> None:
    out = gang_plan("volcano", queue="research", priorityClassName="high")
    assert out.rayjob_labels == {
        "ray.io/gang-scheduling-enabled": "true",
        "volcano.sh/queue-name": "research",
        "ray.io/priority-class-name": "high",
    }
    assert (out.pod_labels, out.pod_annotations, out.objects) == ({}, {}, [])
    assert out.scheduler_name is None and out.create_suspended is False
    bare = gang_plan("volcano")
    assert bare.rayjob_labels == {"ray.io/gang-scheduling-enabled": "true"}


def test_yunikorn_names_the_application_per_attempt_and_asks_for_a_hard_gang() -> None:
    out = gang_plan("yunikorn", queue="root.ml", timeoutSeconds=90)
    assert out.rayjob_labels == {
        "ray.io/gang-scheduling-enabled": "true",
        "yunikorn.apache.org/app-id": scheduling.yunikorn_app_id("ns1", "demo", "u1", 2),
        "yunikorn.apache.org/queue": "root.ml",
    }
    assert out.pod_annotations == {
        "yunikorn.apache.org/schedulingPolicyParameters": (
            "placeholderTimeoutInSeconds=90 gangSchedulingStyle=Hard"
        )
    }
    assert out.objects == [] and out.create_suspended is False
    strategy = scheduling.strategy("yunikorn")
    assert strategy.attempt_labels("ns1", "demo", "u1", 3) == {
        "yunikorn.apache.org/app-id": scheduling.yunikorn_app_id("ns1", "demo", "u1", 3)
    }
    assert "yunikorn.apache.org/queue" not in gang_plan("yunikorn").rayjob_labels


def test_kueue_creates_the_rayjob_suspended_in_its_queue() -> None:
    out = gang_plan("kueue", queue="team-a")
    assert out.rayjob_labels == {"kueue.x-k8s.io/queue-name": "team-a"}
    assert out.create_suspended is True
    assert (out.pod_labels, out.pod_annotations, out.objects) == ({}, {}, [])
    assert scheduling.strategy("kueue").owns_suspend is True
    assert not any(s.owns_suspend for n, s in scheduling.STRATEGIES.items() if n != "kueue")
    assert scheduling.strategy("kueue").attempt_labels("ns1", "demo", "u1", 1) == {}


def test_scheduler_plugins_get_our_podgroup_and_scheduler() -> None:
    out = gang_plan("scheduler-plugins", timeoutSeconds=600, permitTimeoutSeconds=120)
    assert out.pod_labels == {"scheduling.x-k8s.io/pod-group": "demo"}
    assert out.scheduler_name == "scheduler-plugins-scheduler"
    assert out.rayjob_labels == {} and out.create_suspended is False
    assert out.objects == [
        {
            "apiVersion": "scheduling.x-k8s.io/v1alpha1",
            "kind": "PodGroup",
            "metadata": {
                "name": "demo",
                "namespace": "ns1",
                "labels": {
                    "app.kubernetes.io/managed-by": "ppojob-operator",
                    "ppojob.io/job": "demo",
                },
                "ownerReferences": [{"kind": "PPOJob", "name": "demo", "uid": "u1"}],
            },
            "spec": {
                "minMember": 4,
                "minResources": gang_totals(MEMBERS)[1],
                "scheduleTimeoutSeconds": 120,
            },
        }
    ]
    unowned = scheduling.scheduler_plugins_podgroup(
        name="x", namespace="n", members=MEMBERS, timeout_seconds=5
    )
    assert "ownerReferences" not in unowned["metadata"]


def test_no_gang_adds_nothing() -> None:
    out = gang_plan("none")
    assert out == scheduling.GangPlan()


@pytest.mark.parametrize(
    ("scheduler", "kuberay", "verdict"),
    [
        ("volcano", None, None),
        ("volcano", "volcano", None),
        ("yunikorn", "yunikorn", None),
        ("kueue", "", None),
        ("scheduler-plugins", "", None),
        ("none", "", None),
        ("none", "scheduler-plugins", "supports RayCluster only"),
        ("kai", "kai-scheduler", None),
        ("kueue", "kai-scheduler", "gangScheduler is kueue, but KubeRay runs with batchScheduler"),
        ("kai", "", "runs without a batchScheduler, so nothing would create the kai gang"),
        (
            "kueue",
            "volcano",
            "gangScheduler is kueue, but KubeRay runs with batchScheduler volcano",
        ),
        ("none", "yunikorn", "Set spec.scheduling.gangScheduler: yunikorn"),
        ("volcano", "", "runs without a batchScheduler, so nothing would create the volcano gang"),
        ("yunikorn", "", "batchScheduler.name=yunikorn"),
    ],
)
def test_kuberay_disagreement(scheduler: str, kuberay: str | None, verdict: str | None) -> None:
    why = kuberay_disagreement(scheduler, kuberay)
    if verdict is None:
        assert why is None
    else:
        assert why is not None and verdict in why


def test_effective_scheduler_names_a_known_default_or_refuses() -> None:
    assert scheduling.effective_scheduler(job(), "yunikorn") == "yunikorn"
    assert scheduling.effective_scheduler(job(), "") == "none"
    with pytest.raises(ValueError, match="unknown gang scheduler 'slurm'"):
        scheduling.effective_scheduler(job(), "slurm")


def test_a_gang_of_half_a_cpu_keeps_it() -> None:
    assert gang_totals([GangMember(1, {"cpu": "500m", "memory": "0"})]) == (1, {"cpu": "500m"})


def test_yunikorn_app_id_is_a_readable_prefix_and_a_hash_of_the_whole_identity() -> None:
    """At most 63 characters (a label value): `ppojob-<name>` cut to fit, then 10 hex digits of
    the SHA-256 of namespace/name/uid/attempt; the first attempt is 0."""

    def digest(ident: str) -> str:
        return hashlib.sha256(ident.encode()).hexdigest()[:10]

    assert (
        scheduling.yunikorn_app_id("ns1", "demo", "u1") == f"ppojob-demo-{digest('ns1/demo/u1/0')}"
    )
    assert scheduling.yunikorn_app_id("ns1", "demo", None, 4) == (
        f"ppojob-demo-{digest('ns1/demo//4')}"
    )
    long = "a" * 40 + "-" + "b" * 20
    got = scheduling.yunikorn_app_id("ns1", long, "u1")
    assert got == f"ppojob-{long}"[:52] + "-" + digest(f"ns1/{long}/u1/0")
    assert len(got) == 63
    # a cut that ends on '-' or '.' drops it: the value stays a valid label
    dashed = "a" * 44 + "-.b"
    assert scheduling.yunikorn_app_id("n", dashed, "u").startswith(f"ppojob-{'a' * 44}-")
    assert "--" not in scheduling.yunikorn_app_id("n", dashed, "u")
    first = plan(
        job(gangScheduler="yunikorn"),
        name="demo",
        namespace="ns1",
        scheduler="yunikorn",
        members=MEMBERS,
        uid="u1",
    )
    assert first.rayjob_labels["yunikorn.apache.org/app-id"] == scheduling.yunikorn_app_id(
        "ns1", "demo", "u1", 0
    )


def test_kuberay_disagreement_says_what_to_change() -> None:
    assert kuberay_disagreement("none", "scheduler-plugins") == (
        "KubeRay runs with batchScheduler scheduler-plugins, which supports RayCluster only: "
        'KubeRay fails every RayJob ("currently only RayCluster is supported"), so no PPOJob '
        "can start. Unset KubeRay's batchScheduler (ppojob creates scheduler-plugins PodGroups "
        "itself) and set the ppojob operator's kuberay.batchScheduler to match"
    )
    assert kuberay_disagreement("kueue", "volcano") == (
        "spec.scheduling.gangScheduler is kueue, but KubeRay runs with batchScheduler volcano, "
        "which it applies to every RayJob (the pods would go to volcano, not kueue). Set "
        "spec.scheduling.gangScheduler: volcano, or run a KubeRay without a batchScheduler"
    )
    assert kuberay_disagreement("yunikorn", "") == (
        "spec.scheduling.gangScheduler is yunikorn, but KubeRay runs without a batchScheduler, "
        "so nothing would create the yunikorn gang. Start KubeRay with "
        "batchScheduler.name=yunikorn (and tell the ppojob operator: "
        "kuberay.batchScheduler=yunikorn), or choose kueue, scheduler-plugins or none"
    )
