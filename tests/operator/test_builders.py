"""Pure tests of the builders: every role layout, colocation mode and gang scheduler; every child
validated strictly against the real schemas (KubeRay, Volcano, scheduler-plugins) and
kubernetes-validate (built-in kinds)."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
import yaml

from ppojob_api.checks.sizes import quantity_bytes
from ppojob_api.spec import PPOJob, Topology, total_gpus
from ppojob_api.validation import validate_manifest
from ppojob_operator import builders, scheduling
from tests.helpers.manifests import GPU, LAYOUTS, SCHEDULING, base_manifest
from tests.helpers.ophelpers import REPO, kuberay_resources_map, ray_start_resources

EXPECTED_GROUPS = {
    "grpo-colocated-rollout": ["actor"],
    "grpo-separate-rollout": ["actor", "rollout"],
    "gae-default-critic": ["actor", "rollout"],
    "gae-colocated-critic": ["actor", "rollout"],
    "gae-separate-all": ["actor", "critic", "rollout"],
    "gae-all-colocated": ["actor"],
}


def make(layout: str = "gae-default-critic", sched: str = "none", **extra):
    spec = json.loads(json.dumps(LAYOUTS[layout]))
    if SCHEDULING[sched]:
        spec["scheduling"] = SCHEDULING[sched]
    spec.update(extra)
    return validate_manifest(base_manifest(**spec))


def by_kind(children):
    return {c["kind"]: c for c in children}


@pytest.mark.parametrize("sched", list(SCHEDULING))
@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_children_validate_strictly(layout, sched, validate_child):
    job = make(layout, sched)
    children = builders.build_children(job, namespace="ns1", uid="uid-1")
    for child in children:
        validate_child(child)
        refs = child["metadata"]["ownerReferences"]
        assert refs == [builders.owner_reference("demo", "uid-1")] and refs[0]["controller"]
    kinds = [c["kind"] for c in children]
    assert kinds[:4] == ["ConfigMap", "ServiceAccount", "Role", "RoleBinding"]
    assert kinds[-1] == "RayJob"
    assert ("PodGroup" in kinds) == (sched == "scheduler-plugins")
    rj = children[-1]
    groups = rj["spec"]["rayClusterSpec"]["workerGroupSpecs"]
    assert [g["groupName"] for g in groups] == EXPECTED_GROUPS[layout]
    for g in groups:
        assert g["replicas"] == g["minReplicas"] == g["maxReplicas"] >= 1
        res = kuberay_resources_map(g["rayStartParams"]["resources"])
        assert list(res) == [f"ppojob-{g['groupName']}"]


def test_gpu_resources_and_role_marks():
    job = make("gae-separate-all")
    rj = builders.build_children(job, namespace="ns1")[-1]
    groups = {g["groupName"]: g for g in rj["spec"]["rayClusterSpec"]["workerGroupSpecs"]}
    c = groups["critic"]["template"]["spec"]["containers"][0]
    assert (
        c["resources"]["requests"]
        == c["resources"]["limits"]
        == {"cpu": "8", "memory": "64Gi", "nvidia.com/gpu": "2"}
    )
    assert groups["rollout"]["replicas"] == 3
    assert kuberay_resources_map(groups["actor"]["rayStartParams"]["resources"]) == {
        "ppojob-actor": 2
    }
    assert total_gpus(job.spec) == 12


def test_rayjob_lifecycle_fields_and_pod_security():
    job = make(activeDeadlineSeconds=3600, backoffLimit=2, ttlSecondsAfterFinished=60)
    rj = builders.build_children(job, namespace="ns1")[-1]
    spec = rj["spec"]
    assert spec["submissionMode"] == "SidecarMode"
    assert spec["shutdownAfterJobFinishes"] is True
    assert spec["ttlSecondsAfterFinished"] == 60
    assert spec["activeDeadlineSeconds"] == 3600
    assert spec["backoffLimit"] == 0  # the operator retries by failure class, not KubeRay
    assert spec["suspend"] is False
    assert spec["entrypoint"] == builders.default_entrypoint(job)
    templates = [spec["rayClusterSpec"]["headGroupSpec"]["template"]] + [
        g["template"] for g in spec["rayClusterSpec"]["workerGroupSpecs"]
    ]
    for t in templates:
        pod = t["spec"]
        assert pod["securityContext"]["runAsNonRoot"] is True
        assert pod["serviceAccountName"] == "demo-trainer"
        for c in pod["containers"]:
            assert c["securityContext"]["allowPrivilegeEscalation"] is False
            env = {e["name"]: e for e in c["env"]}
            assert env["PPOJOB_NAME"]["valueFrom"]["fieldRef"]["fieldPath"] == (
                "metadata.labels['ppojob.io/job']"
            )
            assert env["PPOJOB_NAMESPACE"]["valueFrom"]["fieldRef"]["fieldPath"] == (
                "metadata.namespace"
            )
            assert {"name": "trainer-config", "mountPath": "/etc/ppojob", "readOnly": True} in (
                c["volumeMounts"]
            )
        assert t["metadata"]["labels"]["ppojob.io/job"] == "demo"
    assert make(submissionMode="K8sJobMode", suspend=True).spec.submission_mode == "K8sJobMode"
    rj2 = builders.build_children(make(submissionMode="K8sJobMode", suspend=True), namespace="ns1")[
        -1
    ]
    assert rj2["spec"]["submissionMode"] == "K8sJobMode" and rj2["spec"]["suspend"] is True


@pytest.mark.parametrize(
    "volume",
    [
        {"persistentVolumeClaim": {"claimName": "ckpt"}},
        {"nfs": {"server": "nfs.local", "path": "/export/ckpt"}},
    ],
)
def test_checkpoint_volume_mounted_in_every_pod(volume, validate_child):
    job = make(checkpointVolume=volume, training={"checkpointDir": "/checkpoints"})
    rj = builders.build_children(job, namespace="ns1")[-1]
    validate_child(rj)
    spec = rj["spec"]["rayClusterSpec"]
    groups = [spec["headGroupSpec"]] + spec["workerGroupSpecs"]
    for t in [g["template"] for g in groups]:
        vols = {v["name"]: v for v in t["spec"]["volumes"]}
        assert {k: v for k, v in vols["checkpoints"].items() if k != "name"} == volume
        mounts = {m["name"]: m for m in t["spec"]["containers"][0]["volumeMounts"]}
        assert mounts["checkpoints"]["mountPath"] == "/checkpoints"


def test_config_map_is_the_trainer_config():
    from ppojob_api.training import TrainerConfig

    job = make(training={"steps": 7})
    cm = builders.build_children(job, namespace="ns1")[0]
    cfg = TrainerConfig.model_validate(yaml.safe_load(cm["data"]["trainer.yaml"]))
    assert cfg.training.steps == 7 and cfg.job_name == "demo"


def test_trainer_role_allows_only_own_status():
    role = builders.build_children(make(), namespace="ns1")[2]
    assert role["rules"] == [
        {
            "apiGroups": ["ppojob.io"],
            "resources": ["ppojobs/status"],
            "resourceNames": ["demo"],
            "verbs": ["get", "patch"],
        }
    ]


def test_gang_labels_per_scheduler():
    def labels(sched):
        return builders.build_children(make("gae-separate-all", sched), namespace="ns1")[-1]

    v = labels("volcano")["metadata"]["labels"]
    assert v["ray.io/gang-scheduling-enabled"] == "true"
    assert v["volcano.sh/queue-name"] == "q1" and v["ray.io/priority-class-name"] == "high"
    y = labels("yunikorn")["metadata"]["labels"]
    assert y["yunikorn.apache.org/queue"] == "root.ml" and y["yunikorn.apache.org/app-id"]
    k = labels("kueue")
    assert k["metadata"]["labels"]["kueue.x-k8s.io/queue-name"] == "lq"
    assert "kueue.x-k8s.io/priority-class" not in k["metadata"]["labels"]
    wpc = make("gae-separate-all", "kueue")
    wpc.spec.scheduling.workload_priority_class = "urgent"
    rj = builders.build_children(wpc, namespace="ns1")[-1]
    assert rj["metadata"]["labels"]["kueue.x-k8s.io/priority-class"] == "urgent"
    assert k["spec"]["suspend"] is True
    # Kueue's Topology-Aware Scheduling: each worker group's pod template asks, the head's not
    for mode, key in (("required", "podset-required"), ("preferred", "podset-preferred")):
        tas = make("gae-separate-all", "kueue")
        tas.spec.scheduling.topology = Topology(level="cloud.provider.com/topology-rack", mode=mode)
        spec = builders.build_children(tas, namespace="ns1")[-1]["spec"]["rayClusterSpec"]
        assert len(spec["workerGroupSpecs"]) == 3
        for g in spec["workerGroupSpecs"]:
            annotations = g["template"]["metadata"]["annotations"]
            assert annotations[f"kueue.x-k8s.io/{key}-topology"] == (
                "cloud.provider.com/topology-rack"
            )
        head = spec["headGroupSpec"]["template"]["metadata"].get("annotations", {})
        assert not any("topology" in a for a in head), head
    assert not any(
        "topology" in a
        for a in k["spec"]["rayClusterSpec"]["headGroupSpec"]["template"]["metadata"].get(
            "annotations", {}
        )
    )
    kai = labels("kai")
    assert kai["metadata"]["labels"]["kai.scheduler/queue"] == "research"
    assert kai["spec"]["submissionMode"] == "SidecarMode"
    sp = labels("scheduler-plugins")
    for g in [sp["spec"]["rayClusterSpec"]["headGroupSpec"]] + sp["spec"]["rayClusterSpec"][
        "workerGroupSpecs"
    ]:
        assert g["template"]["metadata"]["labels"]["scheduling.x-k8s.io/pod-group"] == "demo"
        assert g["template"]["spec"]["schedulerName"] == "scheduler-plugins-scheduler"
    assert "ray.io/gang-scheduling-enabled" not in labels("none")["metadata"]["labels"]


def test_scheduler_plugins_podgroup_sums_the_gang():
    job = make("gae-separate-all", "scheduler-plugins")
    pg = by_kind(builders.build_children(job, namespace="ns1"))["PodGroup"]
    # head (2 cpu, 8Gi, plus KubeRay's SidecarMode submitter container: 500m, 200Mi)
    # + 6 worker pods of 8 cpu, 64Gi, 2 GPUs
    assert pg["spec"]["minMember"] == 7
    assert pg["spec"]["minResources"] == {
        "cpu": "50500m",
        "memory": str((8 + 6 * 64) * 2**30 + 200 * 2**20),
        "nvidia.com/gpu": "12",
    }
    assert pg["spec"]["scheduleTimeoutSeconds"] == 120
    # K8sJobMode: the submitter is a pod of its own, outside the gang
    job = make("gae-separate-all", "scheduler-plugins", submissionMode="K8sJobMode")
    pg = by_kind(builders.build_children(job, namespace="ns1"))["PodGroup"]
    assert pg["spec"]["minMember"] == 7
    assert pg["spec"]["minResources"]["cpu"] == "50"
    assert pg["spec"]["minResources"]["memory"] == str((8 + 6 * 64) * 2**30)


def test_elastic_rollout_group_has_its_bounds_and_the_gang_counts_its_minimum(validate_child):
    """roles.rollout.elastic: the rollout worker group starts `replicas` pods and scales within
    minReplicas..maxReplicas; the gang (here the scheduler-plugins PodGroup) holds the head, the
    actor and the minimum of the rollout group only. The actor's group keeps fixed bounds."""
    rollout = {"cpus": 4, "memory": "8Gi"}
    job = validate_manifest(
        base_manifest(
            algorithm={"advantageEstimator": "grpo"},
            roles={
                "actor": {"replicas": 2, "resources": GPU},
                "rollout": {
                    "replicas": 3,
                    "resources": rollout,
                    "elastic": {"minReplicas": 1, "maxReplicas": 5},
                },
            },
            scheduling=SCHEDULING["scheduler-plugins"],
        )
    )
    children = builders.build_children(job, namespace="ns1")
    for child in children:
        validate_child(child)
    rj = children[-1]
    groups = {g["groupName"]: g for g in rj["spec"]["rayClusterSpec"]["workerGroupSpecs"]}
    bounds = {n: (g["replicas"], g["minReplicas"], g["maxReplicas"]) for n, g in groups.items()}
    assert bounds == {"actor": (2, 2, 2), "rollout": (3, 1, 5)}
    pg = by_kind(children)["PodGroup"]
    assert pg["spec"]["minMember"] == 1 + 2 + 1  # head, actor pods, one rollout pod
    # 2 + 0.5 (submitter) + 0.1 (KubeRay's autoscaler) + 2 x 8 + 4
    assert pg["spec"]["minResources"]["cpu"] == "22600m"
    assert pg["spec"]["minResources"]["memory"] == str(
        (8 + 2 * 64 + 8) * 2**30 + 200 * 2**20 + 512 * 2**20
    )
    cluster = rj["spec"]["rayClusterSpec"]
    assert cluster["enableInTreeAutoscaling"] is True  # the autoscaler grows the rollout group
    assert cluster["autoscalerOptions"]["resources"] == builders.AUTOSCALER_RESOURCES
    # without elastic, the same job's gang holds all three rollout pods, and no autoscaler runs
    plain = json.loads(json.dumps(job.model_dump(by_alias=True, exclude_none=True)))
    del plain["spec"]["roles"]["rollout"]["elastic"]
    children = builders.build_children(validate_manifest(plain), namespace="ns1")
    pg = by_kind(children)["PodGroup"]
    assert pg["spec"]["minMember"] == 1 + 2 + 3
    assert pg["spec"]["minResources"]["cpu"] == "30500m"  # 2 + 0.5 + 2 x 8 + 3 x 4
    assert "enableInTreeAutoscaling" not in children[-1]["spec"]["rayClusterSpec"]


REWARD_JOB = {
    "algorithm": {"advantageEstimator": "grpo"},
    "roles": {
        "actor": {"replicas": 2, "resources": GPU},
        "rollout": {"colocateWithActor": True},
        "reward": {
            "replicas": 3,
            "resources": {"gpus": 1, "cpus": 4, "memory": "16Gi"},
            "nodeSelector": {"pool": "reward"},
        },
    },
    "data": {"prompts": "/data/p.jsonl", "rewards": [{"model": {"path": "/models/rm"}}]},
}


def test_reward_workers_are_a_worker_group_counted_in_the_gang(validate_child):
    """roles.reward: a `reward` worker group of its replicas, advertising `ppojob-reward` (one
    unit per GPU), placed by its own nodeSelector, and every one of its pods and GPUs counted
    in the gang (here the scheduler-plugins PodGroup)."""
    job = validate_manifest(base_manifest(**REWARD_JOB, scheduling=SCHEDULING["scheduler-plugins"]))
    children = builders.build_children(job, namespace="ns1")
    for child in children:
        validate_child(child)
    groups = {g["groupName"]: g for g in children[-1]["spec"]["rayClusterSpec"]["workerGroupSpecs"]}
    assert list(groups) == ["actor", "reward"]
    reward = groups["reward"]
    assert (reward["replicas"], reward["minReplicas"], reward["maxReplicas"]) == (3, 3, 3)
    assert _advertised(reward)["ppojob-reward"] == 1.0
    assert reward["template"]["spec"]["nodeSelector"]["pool"] == "reward"
    pg = by_kind(children)["PodGroup"]
    assert pg["spec"]["minMember"] == 1 + 2 + 3  # head, actor pods, reward pods
    assert pg["spec"]["minResources"]["nvidia.com/gpu"] == str(2 * 2 + 3 * 1)
    assert pg["spec"]["minResources"]["cpu"] == "30500m"  # 2 + 0.5 (submitter) + 2 x 8 + 3 x 4
    assert total_gpus(job.spec) == 7


SANDBOX_JOB = {
    "algorithm": {"advantageEstimator": "grpo"},
    "roles": {
        "actor": {"replicas": 2, "resources": GPU},
        "rollout": {"colocateWithActor": True},
        "sandbox": {
            "replicas": 3,
            "resources": {"cpus": 2, "memory": "4Gi"},
            "runtimeClassName": "gvisor",
            "tolerations": [{"key": "sandbox", "operator": "Exists", "effect": "NoSchedule"}],
        },
    },
    "data": {"prompts": "builtin:calculator", "agent": {"function": "builtin:calculator"}},
}


def test_sandbox_workers_are_a_worker_group_under_their_runtime_class_in_the_gang(
    validate_child,
):
    """roles.sandbox: a `sandbox` worker group of its replicas, advertising `ppojob-sandbox`,
    its pods under the role's RuntimeClass (the other roles' pods under the default runtime),
    with the role's tolerations, and every one of its pods counted in the gang (here the
    scheduler-plugins PodGroup)."""
    job = validate_manifest(
        base_manifest(**SANDBOX_JOB, scheduling=SCHEDULING["scheduler-plugins"])
    )
    children = builders.build_children(job, namespace="ns1")
    for child in children:
        validate_child(child)
    groups = {g["groupName"]: g for g in children[-1]["spec"]["rayClusterSpec"]["workerGroupSpecs"]}
    assert list(groups) == ["actor", "sandbox"]
    sandbox = groups["sandbox"]
    assert (sandbox["replicas"], sandbox["minReplicas"], sandbox["maxReplicas"]) == (3, 3, 3)
    assert _advertised(sandbox)["ppojob-sandbox"] == 1.0
    pod = sandbox["template"]["spec"]
    assert pod["runtimeClassName"] == "gvisor"
    assert pod["tolerations"][0]["key"] == "sandbox"
    assert sandbox["template"]["metadata"]["labels"][builders.ROLE_LABEL] == "sandbox"
    assert "runtimeClassName" not in groups["actor"]["template"]["spec"]
    head = children[-1]["spec"]["rayClusterSpec"]["headGroupSpec"]["template"]["spec"]
    assert "runtimeClassName" not in head
    pg = by_kind(children)["PodGroup"]
    assert pg["spec"]["minMember"] == 1 + 2 + 3  # head, actor pods, sandbox pods
    assert pg["spec"]["minResources"]["cpu"] == "24500m"  # 2 + 0.5 (submitter) + 2 x 8 + 3 x 2
    assert total_gpus(job.spec) == 4


def test_sandbox_pods_may_reach_only_the_jobs_pods_and_dns():
    """roles.sandbox: a second NetworkPolicy, selecting the job's sandbox pods only, of type
    Egress, whose only rules are: any port to the job's own pods (Ray's GCS on the head, the
    raylets and object stores, the engines) and port 53 (UDP and TCP) to kube-system's DNS
    pods. It is made even with the operator's ingress policy off; without roles.sandbox there
    is none."""
    job = validate_manifest(base_manifest(**SANDBOX_JOB))
    policies = [
        c for c in builders.build_children(job, namespace="ns1") if c["kind"] == "NetworkPolicy"
    ]
    assert [p["metadata"]["name"] for p in policies] == ["demo", "demo-sandbox"]
    spec = policies[1]["spec"]
    assert spec == {
        "podSelector": {
            "matchLabels": {builders.JOB_LABEL: "demo", builders.ROLE_LABEL: "sandbox"}
        },
        "policyTypes": ["Egress"],
        "egress": [
            {"to": [{"podSelector": {"matchLabels": {builders.JOB_LABEL: "demo"}}}]},
            {
                "to": [
                    {
                        "namespaceSelector": {
                            "matchLabels": {"kubernetes.io/metadata.name": "kube-system"}
                        },
                        "podSelector": {"matchLabels": {"k8s-app": "kube-dns"}},
                    }
                ],
                "ports": [{"protocol": "UDP", "port": 53}, {"protocol": "TCP", "port": 53}],
            },
        ],
    }
    # the job's pods carry the label its egress rule allows, the sandbox pods the one it selects
    rj = builders.build_children(job, namespace="ns1")[-1]["spec"]["rayClusterSpec"]
    head_labels = rj["headGroupSpec"]["template"]["metadata"]["labels"]
    assert head_labels[builders.JOB_LABEL] == "demo"
    off = builders.build_children(job, namespace="ns1", network=None)
    assert [c["metadata"]["name"] for c in off if c["kind"] == "NetworkPolicy"] == ["demo-sandbox"]
    plain = [c for c in builders.build_children(make(), namespace="ns1")]
    assert [c["metadata"]["name"] for c in plain if c["kind"] == "NetworkPolicy"] == ["demo"]


def test_an_elastic_group_under_kueue_runs_no_autoscaler(validate_child):
    """Kueue 0.17 refuses ``enableInTreeAutoscaling`` on the RayJobs it manages (outside its
    workload-slicing gate): under Kueue the elastic group keeps its replicas, and the head's
    gang member holds no autoscaler container."""
    job = validate_manifest(
        base_manifest(
            algorithm={"advantageEstimator": "grpo"},
            roles={
                "actor": {"replicas": 1, "resources": GPU},
                "rollout": {
                    "replicas": 2,
                    "resources": {"cpus": 4, "memory": "8Gi"},
                    "elastic": {"minReplicas": 1, "maxReplicas": 3},
                },
            },
            scheduling=SCHEDULING["kueue"],
        )
    )
    rj = builders.build_children(job, namespace="ns1")[-1]
    validate_child(rj)
    assert "enableInTreeAutoscaling" not in rj["spec"]["rayClusterSpec"]
    assert "autoscalerOptions" not in rj["spec"]["rayClusterSpec"]
    autoscaler = builders.gang_members(job, autoscaler=True)[0].requests
    assert builders.gang_members(job)[0].requests != autoscaler


def test_operator_default_scheduler_applies_only_when_spec_names_none():
    assert scheduling.effective_scheduler(make(), "volcano") == "volcano"
    explicit = validate_manifest(base_manifest(scheduling={"gangScheduler": "none"}))
    assert scheduling.effective_scheduler(explicit, "volcano") == "none"
    assert scheduling.effective_scheduler(make(), None) == "none"


def test_unset_gang_scheduler_survives_storage_and_takes_the_operator_default():
    """Item 8: the CRD has no default for gangScheduler, so the stored form of
    `scheduling: {queue: q}` still means "the operator's default"."""
    from ppojob_api.crd import build_crd

    crd = build_crd()
    sched = crd["spec"]["versions"][0]["schema"]["openAPIV3Schema"]["properties"]["spec"][
        "properties"
    ]["scheduling"]["properties"]["gangScheduler"]
    assert "default" not in sched
    job = validate_manifest(base_manifest(scheduling={"queue": "q"}))
    # stored: the scheduling object as the API server fills it in from the CRD's defaults
    stored_sched = builders.dump(job.spec.scheduling)
    assert "gangScheduler" not in stored_sched
    stored = validate_manifest(base_manifest(scheduling=stored_sched))
    for j in (job, stored):
        assert scheduling.effective_scheduler(j, "kueue") == "kueue"
        assert scheduling.effective_scheduler(j, "volcano") == "volcano"
    rj = builders.build_children(stored, namespace="ns1", gang_default="kueue")[-1]
    assert rj["metadata"]["labels"]["kueue.x-k8s.io/queue-name"] == "q"
    assert rj["spec"]["suspend"] is True


def test_ray_start_resources_are_what_kuberay_parses():
    """Also: rayStartParams.resources is single-quoted JSON, which KubeRay's getResourcesMap
    reads (it trims quotes and json-unmarshals) and the shell hands to `ray start` intact."""
    job = make("gae-separate-all")
    rj = builders.build_children(job, namespace="ns1")[-1]
    groups = rj["spec"]["rayClusterSpec"]["workerGroupSpecs"]
    head = rj["spec"]["rayClusterSpec"]["headGroupSpec"]
    for g, want in [(head, {"ppojob-head": 1.0})] + [
        (g, {f"ppojob-{g['groupName']}": 2.0}) for g in groups
    ]:
        value = g["rayStartParams"]["resources"]
        assert (
            value
            == "'" + json.dumps({k: int(v) for k, v in want.items()}, separators=(",", ":")) + "'"
        )
        assert kuberay_resources_map(value) == want
        assert ray_start_resources(value) == want
    # the old form (JSON-in-a-JSON-string) is what KubeRay could not read
    with pytest.raises(ValueError):
        kuberay_resources_map(json.dumps(json.dumps({"ppojob-actor": 8})))


def test_yunikorn_hard_gang_fresh_app_ids_and_no_truncation_collisions():
    """Item 9."""
    job = make(
        "gae-separate-all", "yunikorn", scheduling={**SCHEDULING["yunikorn"], "timeoutSeconds": 321}
    )
    rj = builders.build_children(job, namespace="ns1", uid="u1")[-1]
    cluster = rj["spec"]["rayClusterSpec"]
    for g in [cluster["headGroupSpec"], *cluster["workerGroupSpecs"]]:
        ann = g["template"]["metadata"]["annotations"]
        assert ann["yunikorn.apache.org/schedulingPolicyParameters"] == (
            "placeholderTimeoutInSeconds=321 gangSchedulingStyle=Hard"
        )
    app = rj["metadata"]["labels"]["yunikorn.apache.org/app-id"]
    again = builders.build_children(job, namespace="ns1", uid="u1", attempt=1)[-1]
    assert again["metadata"]["labels"]["yunikorn.apache.org/app-id"] != app
    # two long names that agree on their first 63 characters, in one namespace
    a = "a" * 40 + "-x"
    b = "a" * 40 + "-y"
    ids = {
        scheduling.yunikorn_app_id("n" * 63, a, "u"),
        scheduling.yunikorn_app_id("n" * 63, b, "u"),
        scheduling.yunikorn_app_id("n" * 63, a, "u2"),
        scheduling.yunikorn_app_id("n" * 62, a, "u"),
    }
    assert len(ids) == 4 and all(len(i) <= 63 and i[-1].isalnum() for i in ids)


@pytest.mark.parametrize(
    ("kuberay", "ok"),
    [
        (None, {"volcano", "yunikorn", "kueue", "scheduler-plugins", "kai", "none"}),
        ("", {"kueue", "scheduler-plugins", "none"}),
        ("volcano", {"volcano"}),
        ("yunikorn", {"yunikorn"}),
        ("scheduler-plugins", set()),
        ("kai-scheduler", {"kai"}),
    ],
)
def test_kuberay_batch_scheduler_matrix(kuberay, ok):
    """Item 7: which gang schedulers work with KubeRay's installation-wide batchScheduler."""
    for sched in scheduling.GANG_SCHEDULERS:
        why = scheduling.kuberay_disagreement(sched, kuberay)
        assert (why is None) == (sched in ok), (sched, kuberay, why)
        if why:
            assert "batchScheduler" in why


def test_head_placement_extra_resources_and_capabilities(validate_child):
    """Also: head tolerations/affinity; per-role extended resources and IPC_LOCK; the
    priorityClassName works without a gang scheduler."""
    taint = [{"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"}]
    affinity = {
        "nodeAffinity": {
            "requiredDuringSchedulingIgnoredDuringExecution": {
                "nodeSelectorTerms": [
                    {"matchExpressions": [{"key": "pool", "operator": "In", "values": ["cpu"]}]}
                ]
            }
        }
    }
    job = make(
        "gae-separate-all",
        head={"tolerations": taint, "affinity": affinity, "nodeSelector": {"pool": "cpu"}},
        scheduling={"priorityClassName": "high"},
        roles={
            "actor": {
                "resources": {**GPU, "extra": {"rdma/ib": 1}},
                "capabilities": ["IPC_LOCK"],
                "tolerations": taint,
            },
            "critic": {"colocateWithActor": True},
            "rollout": {"colocateWithActor": True},
        },
    )
    children = builders.build_children(job, namespace="ns1", uid="u")
    for c in children:
        validate_child(c)
    cluster = children[-1]["spec"]["rayClusterSpec"]
    head = cluster["headGroupSpec"]["template"]["spec"]
    assert head["tolerations"] == taint and head["affinity"] == affinity
    assert head["priorityClassName"] == "high"
    actor = cluster["workerGroupSpecs"][0]["template"]["spec"]
    c = actor["containers"][0]
    assert c["resources"]["limits"]["rdma/ib"] == "1" == c["resources"]["requests"]["rdma/ib"]
    assert c["securityContext"]["capabilities"] == {"drop": ["ALL"], "add": ["IPC_LOCK"]}
    assert actor["priorityClassName"] == "high"
    assert head["containers"][0]["securityContext"]["capabilities"] == {"drop": ["ALL"]}
    # an explicit gangScheduler: none keeps the priority class (it was rejected before)
    none = validate_manifest(
        base_manifest(scheduling={"gangScheduler": "none", "priorityClassName": "high"})
    )
    rj = builders.build_children(none, namespace="ns1")[-1]
    head_spec = rj["spec"]["rayClusterSpec"]["headGroupSpec"]["template"]["spec"]
    assert head_spec["priorityClassName"] == "high"


@pytest.mark.parametrize(
    ("roles", "path"),
    [
        (
            {"critic": {"colocateWithActor": True, "capabilities": ["IPC_LOCK"]}},
            "spec.roles.critic.capabilities",
        ),
        ({"actor": {"resources": {"extra": {"cpu": 1}}}}, "spec.roles.actor.resources.extra.cpu"),
        ({"actor": {"resources": {"extra": {"ib": 1}}}}, "spec.roles.actor.resources.extra.ib"),
        (
            {"actor": {"resources": {"extra": {"rdma/ib": 0}}}},
            "spec.roles.actor.resources.extra.rdma/ib",
        ),
    ],
)
def test_extra_resources_and_capabilities_are_checked(roles, path):
    from ppojob_api.problems import SpecError

    with pytest.raises(SpecError) as exc:
        validate_manifest(base_manifest(roles=roles))
    assert path in [p.path for p in exc.value.problems]


def test_ray_version_has_one_source_of_truth():
    """Also: spec.rayVersion defaults to the Ray the trainer image installs (constraints.txt,
    used by images/trainer.Dockerfile) and the one installed here."""
    import ray

    from ppojob_api.spec import RAY_VERSION

    pins = dict(
        line.split("==")
        for line in (REPO / "constraints.txt").read_text().splitlines()
        if "==" in line and not line.startswith("#")
    )
    assert pins["ray"] == RAY_VERSION == ray.__version__
    assert make().spec.ray_version == RAY_VERSION
    from hack import lock

    # the image's dependencies come from its lock, which holds that Ray (the built image's Ray
    # is compared on a real node: tests/realnode, test_the_images_ray_is_the_spec_default)
    assert (
        lock.read_lock("trainer-cpu")["ray"] == lock.read_lock("trainer-gpu")["ray"] == RAY_VERSION
    )
    dockerfile = (REPO / "images" / "trainer.Dockerfile").read_text()
    assert (
        "pip install --no-cache-dir --require-hashes --no-deps -r /tmp/requirements.txt"
        in dockerfile
    )


def test_finished_jobs_free_their_gpus_within_a_minute_and_keep_their_output():
    """Item 11: the RayCluster goes 60 s after the end by default; with a checkpoint volume the
    trainer's output goes onto it."""
    job = make()
    rj = builders.build_children(job, namespace="ns1")[-1]
    assert rj["spec"]["ttlSecondsAfterFinished"] == 60 and rj["spec"]["shutdownAfterJobFinishes"]
    vol = make(
        checkpointVolume={"persistentVolumeClaim": {"claimName": "ckpt"}},
        training={"checkpointDir": "/ckpt"},
    )
    rj = builders.build_children(vol, namespace="ns1")[-1]
    assert rj["spec"]["entrypoint"].endswith("--out /ckpt/output")


def test_strict_validation_catches_unknown_fields(validate_child):
    rj = builders.build_children(make(), namespace="ns1")[-1]
    rj["spec"]["rayClusterSpec"]["headGroupSpec"]["template"]["spec"]["containers"][0][
        "bogusField"
    ] = 1
    with pytest.raises(AssertionError, match="bogusField"):
        validate_child(rj)


def test_job_name_limits():
    from ppojob_api.problems import SpecError

    with pytest.raises(
        SpecError
    ) as info:  # validation (ppojob validate and the operator) refuses it
        validate_manifest(base_manifest(name="x" * 48))
    assert [p.path for p in info.value.problems] == ["metadata.name"]
    assert builders.check_job(make()) == []


def test_render_cli_prints_the_builders_output(tmp_path):
    path = tmp_path / "job.yaml"
    path.write_text(yaml.safe_dump(base_manifest(scheduling=SCHEDULING["scheduler-plugins"])))
    out = subprocess.run(
        [sys.executable, "-m", "ppojob_cli", "render", str(path)],
        capture_output=True,
        text=True,
        cwd=REPO,
        check=True,
    ).stdout
    docs = [d for d in yaml.safe_load_all(out) if d]
    job = validate_manifest(base_manifest(scheduling=SCHEDULING["scheduler-plugins"]))
    assert docs == builders.build_children(job, namespace="ns1")


def _advertised(group: dict) -> dict[str, float]:
    """What Ray sees on one pod of a group: rayStartParams, else what KubeRay derives from the
    container's limits (num-cpus: the CPU limit rounded up; num-gpus: nvidia.com/gpu)."""
    import math

    params = group["rayStartParams"]
    limits = group["template"]["spec"]["containers"][0]["resources"]["limits"]
    out = ray_start_resources(params["resources"])
    if "num-cpus" in params:
        out["CPU"] = float(params["num-cpus"])
    else:
        out["CPU"] = float(math.ceil(quantity_bytes(limits["cpu"])))
    gpus = int(limits.get("nvidia.com/gpu", 0))
    if gpus:
        out["GPU"] = float(gpus)
    return out


CPU_ROLES = {
    "roles": {
        "actor": {"replicas": 2, "resources": {"cpus": 1.5, "memory": "2Gi"}},
        "critic": {"replicas": 1, "resources": {"cpus": 3, "memory": "2Gi"}},
        "rollout": {"replicas": 3, "resources": {"cpus": 0.5, "memory": "1Gi"}},
    }
}


@pytest.mark.parametrize("layout", [*LAYOUTS, "cpu-fractional", "reward-workers", "sandbox"])
def test_pods_hold_exactly_the_trainers_pinned_bundles(layout):
    """The trainer pins each bundle to its role's pods with one unit of `ppojob-<role>`: every
    role pod must advertise one unit per worker on it, CPUs for its bundles, and the head none
    (nor any CPU), so the trainer's placement group fits exactly and never lands on the head."""
    from ppojob_api.validation import trainer_config_from_spec
    from ppojob_trainer.placement import plan_placement, role_resource

    if layout == "cpu-fractional":
        job = validate_manifest(base_manifest(**CPU_ROLES))
    elif layout == "reward-workers":
        job = validate_manifest(base_manifest(**REWARD_JOB))
    elif layout == "sandbox":
        job = validate_manifest(base_manifest(**SANDBOX_JOB))
    else:
        job = make(layout)
    rj = builders.build_children(job, namespace="ns1")[-1]
    cluster = rj["spec"]["rayClusterSpec"]
    head = _advertised(cluster["headGroupSpec"])
    assert head == {"ppojob-head": 1.0, "CPU": 0.0}
    plan = plan_placement(trainer_config_from_spec(job.spec, "demo"), pin_roles=True)
    for group in cluster["workerGroupSpecs"]:
        role, pod = group["groupName"], _advertised(group)
        res = dict(job.spec.roles).get(role) or job.spec.roles.actor
        assert pod[role_resource(role)] == max(res.resources.gpus, 1)
        assert [k for k in pod if k.startswith("ppojob-")] == [role_resource(role)]
        mine = [b for b in plan.bundles if b.get(role_resource(role))]
        per_pod = int(pod[role_resource(role)])
        assert len(mine) == group["replicas"] * per_pod, role
        for i in range(group["replicas"]):  # the bundles of one pod fit that pod
            chunk = mine[i * per_pod : (i + 1) * per_pod]
            for key in {k for b in chunk for k in b}:
                assert sum(b.get(key, 0.0) for b in chunk) <= pod.get(key, 0.0) + 1e-9, (role, key)
    assert all(any(k.startswith("ppojob-") for k in b) for b in plan.bundles)


def test_trainer_pods_run_as_the_trainer_images_user():
    """The pods' runAsUser must be the image's USER: HOME (/home/ppojob, the model cache) and
    /workspace belong to it and are not writable by any other uid."""
    import re

    text = (REPO / "images" / "trainer.Dockerfile").read_text()
    users = re.findall(r"^USER\s+(\d+)(?::(\d+))?", text, flags=re.M)
    assert users, "trainer.Dockerfile sets no numeric USER"
    uid, gid = users[-1]
    rj = builders.build_children(make(), namespace="ns1")[-1]
    cluster = rj["spec"]["rayClusterSpec"]
    for g in [cluster["headGroupSpec"], *cluster["workerGroupSpecs"]]:
        sc = g["template"]["spec"]["securityContext"]
        assert sc["runAsUser"] == int(uid)
        assert sc["runAsGroup"] == int(gid or uid)


def test_every_gang_scheduler_of_the_spec_has_one_strategy():
    """The registry and the spec agree: each gangScheduler value has a strategy of that name, and
    each strategy asks KubeRay for a batchScheduler the operator can be told about."""
    from typing import get_args

    field = type(make().spec.scheduling).model_fields["gang_scheduler"].annotation
    values = {v for arg in get_args(field) for v in get_args(arg)}
    assert set(scheduling.STRATEGIES) == values
    for name, strategy in scheduling.STRATEGIES.items():
        assert strategy.name == name
        assert strategy.kuberay_batch_scheduler in scheduling.KUBERAY_BATCH_SCHEDULERS
    with pytest.raises(ValueError, match="unknown gang scheduler 'slurm'"):
        scheduling.strategy("slurm")


def test_render_children_yaml_in_process():
    """The YAML stream `ppojob render` prints: a header naming the job, then each child as its own
    document, keys in the builders' order; the job's namespace wins over the default one."""
    job = validate_manifest(base_manifest(scheduling=SCHEDULING["scheduler-plugins"]))
    text = builders.render_children_yaml(job, namespace="elsewhere")
    assert text.startswith("# children of PPOJob ns1/demo (ownerReferences added in-cluster)\n---")
    docs = list(yaml.safe_load_all(text))
    expected = builders.build_children(job, namespace="ns1")
    assert docs == expected
    assert [list(d) for d in docs] == [list(d) for d in expected]  # not sorted
    assert text.count("\n---") == len(expected)
    # no namespace in the manifest: the given one; a gang default reaches the scheduler choice
    bare = base_manifest()
    del bare["metadata"]["namespace"]
    job = validate_manifest(bare)
    text = builders.render_children_yaml(job)
    assert text.startswith("# children of PPOJob default/demo ")
    assert {d["metadata"]["namespace"] for d in yaml.safe_load_all(text)} == {"default"}
    gang = builders.render_children_yaml(job, gang_default="scheduler-plugins")
    with_default = builders.build_children(
        job, namespace="default", gang_default="scheduler-plugins"
    )
    assert list(yaml.safe_load_all(gang)) == with_default
    assert with_default != list(yaml.safe_load_all(text))


def test_trainer_children_are_named_after_the_job_and_owned_by_it():
    """ConfigMap, ServiceAccount, Role and RoleBinding: `<job>-trainer` in the job's namespace,
    each with a controller ownerReference that blocks the PPOJob's deletion until it is gone."""
    children = builders.build_children(make(), namespace="ns1", uid="u-1")
    owner = {
        "apiVersion": "ppojob.io/v1alpha1",
        "kind": "PPOJob",
        "name": "demo",
        "uid": "u-1",
        "controller": True,
        "blockOwnerDeletion": True,
    }
    for child in children:
        assert child["metadata"]["namespace"] == "ns1", child["kind"]
        assert child["metadata"]["ownerReferences"] == [owner], child["kind"]
        assert child["metadata"]["labels"]["app.kubernetes.io/managed-by"]
    by_kind = {c["kind"]: c for c in children}
    for kind in ("ConfigMap", "ServiceAccount", "Role", "RoleBinding"):
        assert by_kind[kind]["metadata"]["name"] == "demo-trainer", kind
    binding = by_kind["RoleBinding"]
    assert binding["roleRef"]["name"] == "demo-trainer"
    assert binding["subjects"] == [
        {"kind": "ServiceAccount", "name": "demo-trainer", "namespace": "ns1"}
    ]
    # without a uid (`ppojob render`) there is no owner to name
    assert all(
        "ownerReferences" not in c["metadata"]
        for c in builders.build_children(make(), namespace="ns1")
    )


def test_check_job_names():
    """Only the operator checks what KubeRay accepts of the name: its length and DNS-1035."""
    from ppojob_api.problems import Problem

    def named(name):
        job = make()
        job.metadata.name = name
        return builders.check_job(job)

    longest = "a" * builders.MAX_NAME_LENGTH
    assert named(longest) == [] and named("demo-1") == [] and named(None) == []
    assert named(longest + "b") == [
        Problem(
            "metadata.name",
            f"is {len(longest) + 1} characters; KubeRay accepts RayJob names of at most "
            f"{builders.MAX_NAME_LENGTH}",
            "use a shorter name",
        )
    ]
    [problem] = named("1demo")
    assert (problem.path, problem.fix) == ("metadata.name", "rename the job")
    assert problem.message.startswith("'1demo' is not a DNS-1035 label")


def test_applied_spec_is_the_spec_but_suspend():
    job = make(suspend=True)
    spec = builders.applied_spec(job)
    assert "suspend" not in spec
    assert spec == builders.applied_spec(make(suspend=False))
    assert spec["image"] == job.spec.image


def test_trainer_config_yaml_is_camel_case_in_field_order():
    """The trainer's config file reads like a manifest: camelCase keys, in the models' field
    order (not sorted), nulls written out."""
    job = make(algorithm={"valueClip": None})
    data = yaml.safe_load(builders.trainer_config_yaml(job))
    assert "learningRate" in data["training"] and "learning_rate" not in data["training"]
    assert data["algorithm"]["valueClip"] is None
    keys = list(data["training"])
    assert keys != sorted(keys)
    from ppojob_api.training import TrainerConfig

    assert list(data) == [
        f.alias or n for n, f in TrainerConfig.model_fields.items() if (f.alias or n) in data
    ]


def test_pods_are_placed_secured_and_configured_as_the_spec_says():
    tol = {"key": "gpu", "operator": "Exists", "effect": "NoSchedule"}
    # PPOJob.model_validate, not validate_manifest: validation refuses a reserved variable
    # (check_env); the builder must still never let a stored job spoof the operator's own
    job = PPOJob.model_validate(
        base_manifest(
            imagePullSecrets=[{"name": "regcred"}],
            head={"nodeSelector": {"pool": "cpu"}, "tolerations": [tol]},
            roles={
                "actor": {
                    "nodeSelector": {"pool": "train"},
                    "tolerations": [tol],
                    "env": [
                        {"name": "PPOJOB_ROLE", "value": "spoofed"},
                        {"name": "HF_HOME", "value": "/cache"},
                    ],
                    "resources": {"extra": {"rdma/ib": 1}},
                },
            },
            checkpointVolume={"persistentVolumeClaim": {"claimName": "c"}},
            training={"checkpointDir": "/ckpt/"},
        )
    )
    children = builders.build_children(job, namespace="ns1", entrypoint="python -m my.trainer")
    rj = children[-1]
    assert rj["spec"]["entrypoint"] == "python -m my.trainer"
    cluster = rj["spec"]["rayClusterSpec"]
    head = cluster["headGroupSpec"]["template"]["spec"]
    actor = next(g for g in cluster["workerGroupSpecs"] if g["groupName"] == "actor")
    worker = actor["template"]["spec"]
    assert head["nodeSelector"] == {"pool": "cpu"} and head["tolerations"] == [tol]
    assert worker["nodeSelector"] == {"pool": "train"} and worker["tolerations"] == [tol]
    for pod in (head, worker):
        assert pod["imagePullSecrets"] == [{"name": "regcred"}]
        assert pod["securityContext"]["runAsNonRoot"] is True
        assert pod["containers"][0]["securityContext"]["runAsNonRoot"] is True
        assert {"name": "trainer-config", "configMap": {"name": "demo-trainer"}} in pod["volumes"]
        # shared memory for Ray's object store and torch's data loaders
        assert {"name": "dshm", "emptyDir": {"medium": "Memory"}} in pod["volumes"]
        mounts = pod["containers"][0]["volumeMounts"]
        assert {"name": "dshm", "mountPath": "/dev/shm"} in mounts
    env = {e["name"]: e.get("value") for e in worker["containers"][0]["env"]}
    assert env["PPOJOB_ROLE"] == "actor" and env["HF_HOME"] == "/cache"  # no spoofing
    # the trainer's output lands on the checkpoint volume (one slash)
    default = builders.build_children(job, namespace="ns1")[-1]["spec"]["entrypoint"]
    assert default.endswith("--out /ckpt/output")
    # the applied spec is stored with sorted keys, so equal specs give equal annotations
    text = rj["metadata"]["annotations"][builders.APPLIED_SPEC_ANNOTATION]
    keys = list(json.loads(text, object_pairs_hook=lambda pairs: dict(pairs)))
    assert keys == sorted(keys)
    # gang members: the head asks for no GPU; a worker's extended resources count
    members = builders.gang_members(job)
    assert "nvidia.com/gpu" not in members[0].requests
    assert members[1].requests["rdma/ib"] == "1"
    k8s_job = validate_manifest(base_manifest(submissionMode="K8sJobMode"))
    head_requests = builders.gang_members(k8s_job)[0].requests  # no submitter container
    assert set(head_requests) == {"cpu", "memory"}
    assert head_requests["memory"] == k8s_job.spec.head.memory


def test_a_gangs_objects_are_owned_and_namespaced_like_the_rest():
    job = make("gae-separate-all", "scheduler-plugins")
    children = builders.build_children(job, namespace="ns2", uid="u-9")
    podgroups = [c for c in children if c["kind"] == "PodGroup"]
    assert podgroups
    for pg in podgroups:
        assert pg["metadata"]["namespace"] == "ns2"
        assert pg["metadata"]["ownerReferences"][0]["uid"] == "u-9"
        assert pg["metadata"]["ownerReferences"][0]["name"] == "demo"


def test_what_kubernetes_and_kuberay_read_from_the_children():
    """Values read by the API server, the kubelet, KubeRay or Ray rather than by our code."""
    job = make()
    children = builders.build_children(job, namespace="ns1")
    by_kind = {c["kind"]: c for c in children}
    assert by_kind["RoleBinding"]["roleRef"] == {
        "apiGroup": "rbac.authorization.k8s.io",
        "kind": "Role",
        "name": "demo-trainer",
    }
    cluster = by_kind["RayJob"]["spec"]["rayClusterSpec"]
    head = cluster["headGroupSpec"]
    assert head["rayStartParams"]["dashboard-host"] == "0.0.0.0"
    assert head["template"]["spec"]["containers"][0]["name"] == "ray-head"
    assert head["template"]["metadata"]["labels"][builders.ROLE_LABEL] == "head"
    for group in [head, *cluster["workerGroupSpecs"]]:
        pod = group["template"]["spec"]
        assert pod["securityContext"]["seccompProfile"] == {"type": "RuntimeDefault"}
        env = {e["name"]: e.get("value") for e in pod["containers"][0]["env"]}
        assert env["RAY_USAGE_STATS_ENABLED"] == "0"
    assert {
        g["template"]["spec"]["containers"][0]["name"] for g in cluster["workerGroupSpecs"]
    } == {"ray-worker"}


def test_output_dir_keeps_the_checkpoint_dir_as_written():
    job = make(
        checkpointVolume={"persistentVolumeClaim": {"claimName": "c"}},
        training={"checkpointDir": "/mnt/XX"},
    )
    assert builders.output_dir(job) == "/mnt/XX/output"


def test_a_checkpoint_volume_without_a_source_mounts_nothing():
    """Validation refuses it; the builder still builds (no checkpoints volume)."""
    from ppojob_api.spec import PPOJob

    job = PPOJob.model_validate(base_manifest(checkpointVolume={}))
    volumes, mounts = builders._volumes(job)
    assert "checkpoints" not in {v["name"] for v in volumes} | {m["name"] for m in mounts}


def test_the_uid_reaches_the_gang_and_no_uid_means_no_owner():
    """YuniKorn's application id covers the PPOJob's uid (a recreated job is a new app)."""
    job = make("gae-separate-all", "yunikorn")

    def app_id(uid):
        rj = builders.build_children(job, namespace="ns1", uid=uid)[-1]
        return rj["metadata"]["labels"]["yunikorn.apache.org/app-id"]

    assert app_id("u-7") != app_id("u-8")
    for child in builders.build_children(
        make("gae-separate-all", "scheduler-plugins"), namespace="ns1"
    ):
        assert "ownerReferences" not in child["metadata"], child["kind"]


def test_the_operators_own_environment_variables_are_reserved_in_the_api() -> None:
    """A role's env may not set what the operator sets (the API refuses it at validate time
    instead of the operator dropping it silently)."""
    from ppojob_api.checks.settings import RESERVED_ENV
    from ppojob_operator import builders

    own = {e["name"] for role in ("head", "actor") for e in builders._env(role, [], 30)}
    assert own <= set(RESERVED_ENV), own - set(RESERVED_ENV)


def test_worker_roles_get_their_affinity_and_huge_pages(validate_child):
    """A role's affinity reaches its worker group's pods as written; huge pages are requested and
    limited as hugepages-<size>, mounted through HugePages emptyDirs (one medium per size when
    there are several) and counted in the gang's minimum resources."""
    anti = {
        "podAntiAffinity": {
            "preferredDuringSchedulingIgnoredDuringExecution": [
                {
                    "weight": 10,
                    "podAffinityTerm": {
                        "topologyKey": "kubernetes.io/hostname",
                        "labelSelector": {"matchLabels": {"ppojob.io/role": "rollout"}},
                    },
                }
            ]
        }
    }
    job = make(
        "gae-separate-all",
        sched="volcano",
        roles={
            "actor": {"resources": {**GPU, "hugepages": {"2Mi": "1Gi", "1Gi": "2Gi"}}},
            "critic": {"colocateWithActor": True},
            "rollout": {
                "replicas": 2,
                "affinity": anti,
                "resources": {**GPU, "hugepages": {"1Gi": "4Gi"}},
            },
        },
    )
    children = builders.build_children(job, namespace="ns1", uid="u")
    for c in children:
        validate_child(c)
    groups = {
        g["groupName"]: g["template"]["spec"]
        for g in children[-1]["spec"]["rayClusterSpec"]["workerGroupSpecs"]
    }
    actor, rollout = groups["actor"], groups["rollout"]
    assert rollout["affinity"] == anti and "affinity" not in actor
    res = actor["containers"][0]["resources"]
    for part in ("requests", "limits"):
        assert res[part]["hugepages-2Mi"] == "1Gi" and res[part]["hugepages-1Gi"] == "2Gi"
    media = {v["name"]: v["emptyDir"]["medium"] for v in actor["volumes"] if "emptyDir" in v}
    assert media["hugepages-2mi"] == "HugePages-2Mi" and media["hugepages-1gi"] == "HugePages-1Gi"
    mounts = {m["name"]: m["mountPath"] for m in actor["containers"][0]["volumeMounts"]}
    assert mounts["hugepages-2mi"] == "/dev/hugepages-2Mi"
    assert mounts["hugepages-1gi"] == "/dev/hugepages-1Gi"
    one = {v["name"]: v for v in rollout["volumes"]}["hugepages"]
    assert one["emptyDir"]["medium"] == "HugePages"
    assert {"name": "hugepages", "mountPath": "/dev/hugepages"} in rollout["containers"][0][
        "volumeMounts"
    ]
    # the gang's minimum: actor 2 GiB of 1Gi pages + 2 rollout pods x 4 GiB
    _, totals = scheduling.gang_totals(builders.gang_members(job))
    assert quantity_bytes(totals["hugepages-1Gi"]) == 10 * 2**30
    assert quantity_bytes(totals["hugepages-2Mi"]) == 2**30


def test_the_network_policy_admits_only_the_jobs_pods_kuberay_and_the_submitter(validate_child):
    """Every pod of the job is under the policy; ingress on any port only from the job's own
    pods, and to the dashboard's port also from KubeRay's operator and its submitter Job's pods
    (the Job controller labels them with the Job's name, KubeRay names the Job after the RayJob).
    The head keeps Ray's default dashboard port, the one the policy opens."""
    job = make("gae-separate-all")
    children = builders.build_children(job, namespace="ns1", uid="u")
    for c in children:
        validate_child(c)
    [policy] = [c for c in children if c["kind"] == "NetworkPolicy"]
    rayjob = children[-1]
    assert policy["metadata"]["ownerReferences"][0]["uid"] == "u"
    selector = policy["spec"]["podSelector"]["matchLabels"]
    cluster = rayjob["spec"]["rayClusterSpec"]
    templates = [cluster["headGroupSpec"]["template"]] + [
        g["template"] for g in cluster["workerGroupSpecs"]
    ]
    assert len(templates) == 4
    for t in templates:
        assert selector.items() <= t["metadata"]["labels"].items()
    assert policy["spec"]["policyTypes"] == ["Ingress"]
    own, dashboard = policy["spec"]["ingress"]
    assert own == {"from": [{"podSelector": {"matchLabels": selector}}]}
    assert dashboard["ports"] == [{"protocol": "TCP", "port": 8265}]
    submitter = {"matchLabels": {"batch.kubernetes.io/job-name": rayjob["metadata"]["name"]}}
    kuberay = builders.kuberay_operator_peer("default")
    assert dashboard["from"] == [{"podSelector": submitter}, kuberay]
    assert "dashboard-port" not in cluster["headGroupSpec"]["rayStartParams"]
    # operator settings: other peers and extra rules; off: no policy
    extra = [{"ports": [{"port": 8080}], "from": [{"namespaceSelector": {}}]}]
    peer = {"ipBlock": {"cidr": "10.0.0.0/24"}}
    settings = builders.NetworkPolicySettings(dashboard_from=[peer], extra_ingress=extra)
    custom = builders.network_policy(job, "ns1", settings=settings)
    validate_child(custom)
    assert custom["spec"]["ingress"][1]["from"] == [{"podSelector": submitter}, kuberay, peer]
    assert custom["spec"]["ingress"][2:] == extra
    kinds = [c["kind"] for c in builders.build_children(job, namespace="ns1", network=None)]
    assert "NetworkPolicy" not in kinds


def test_the_dashboard_is_reachable_from_kuberays_namespace_only():
    """Security: a tenant can label a pod of their own ``app.kubernetes.io/name:
    kuberay-operator`` in any namespace they write to; the dashboard (Ray's unauthenticated job
    API: code execution in the head pod) is open only to KubeRay's operator pods in KubeRay's
    own namespace, named by ``kubernetes.io/metadata.name`` (set by the API server, not
    forgeable), and to pods of the job's own namespace. No peer selects every namespace."""
    job = make("gae-separate-all")
    for ns in ("default", "kuberay-system"):
        settings = builders.NetworkPolicySettings(kuberay_namespace=ns)
        policy = builders.network_policy(job, "ns1", settings=settings)
        peers = [p for rule in policy["spec"]["ingress"] for p in rule["from"]]
        cross = [p for p in peers if "namespaceSelector" in p]
        assert cross == [
            {
                "namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": ns}},
                "podSelector": {"matchLabels": {"app.kubernetes.io/name": "kuberay-operator"}},
            }
        ]
        # the others select pods of the policy's (the job's) namespace only
        assert all(set(p) == {"podSelector"} for p in peers if p not in cross)
    # the flag reaches the policy
    from ppojob_operator.__main__ import build_parser, operator_config

    args = build_parser().parse_args(["--kuberay-namespace=ray-system"])
    assert operator_config(args).network_policy.kuberay_namespace == "ray-system"
    assert operator_config(build_parser().parse_args([])).network_policy.kuberay_namespace == (
        "default"
    )
    args = build_parser().parse_args(
        ["--kuberay-namespace=ray-system", '--network-policy={"dashboardFrom": []}']
    )
    assert operator_config(args).network_policy.kuberay_namespace == "ray-system"


@pytest.mark.parametrize(
    ("value", "error"),
    [
        ("{", "not JSON"),
        ("[]", "only dashboardFrom and extraIngress"),
        ('{"dashboardFrom": {}}', "dashboardFrom must be a list of objects"),
        ('{"extraIngress": [1]}', "extraIngress must be a list of objects"),
        ('{"ingress": []}', "only dashboardFrom and extraIngress"),
    ],
)
def test_network_policy_flag_errors_name_the_problem(value, error):
    from ppojob_operator.__main__ import network_settings

    with pytest.raises(ValueError, match=error):
        network_settings(value)


def test_tracker_secrets_reach_the_head_container_only(tmp_path, capsys, validate_child):
    """spec.trackers[].secretRef: each Secret once, as envFrom of the head's container (where the
    trainer's driver logs to the trackers), after the podTemplate's; no worker pod gets it."""
    from ppojob_cli.main import main as ppojob

    template = {"envFrom": [{"configMapRef": {"name": "settings"}}]}
    trackers = [
        {"type": "tensorboard"},
        {"type": "mlflow", "trackingUri": "http://mlflow:5000", "secretRef": {"name": "ml"}},
        {"type": "wandb", "project": "p", "secretRef": {"name": "wb"}},
        {"type": "wandb", "project": "q", "secretRef": {"name": "ml"}},
    ]
    job = make(trackers=trackers, podTemplate=template)
    children = builders.build_children(job, namespace="ns1")
    for child in children:
        validate_child(child)
    rj = children[-1]["spec"]["rayClusterSpec"]
    head = rj["headGroupSpec"]["template"]["spec"]["containers"][0]
    assert head["envFrom"] == [
        {"configMapRef": {"name": "settings"}},
        {"secretRef": {"name": "ml"}},
        {"secretRef": {"name": "wb"}},
    ]
    assert rj["workerGroupSpecs"]
    for group in rj["workerGroupSpecs"]:
        assert group["template"]["spec"]["containers"][0]["envFrom"] == template["envFrom"]
    without = builders.build_children(make(trackers=trackers[:1]), namespace="ns1")[-1]
    assert (
        "envFrom"
        not in without["spec"]["rayClusterSpec"]["headGroupSpec"]["template"]["spec"]["containers"][
            0
        ]
    )
    path = tmp_path / "job.yaml"
    path.write_text(
        yaml.safe_dump(base_manifest(**{**LAYOUTS["gae-default-critic"], "trackers": trackers}))
    )
    assert ppojob(["render", str(path)]) == 0
    rendered = list(yaml.safe_load_all(capsys.readouterr().out))
    (rayjob,) = [d for d in rendered if d and d["kind"] == "RayJob"]
    head = rayjob["spec"]["rayClusterSpec"]["headGroupSpec"]["template"]["spec"]["containers"][0]
    assert head["envFrom"] == [{"secretRef": {"name": "ml"}}, {"secretRef": {"name": "wb"}}]


def test_k8sjobmode_submitter_pod_is_hardened_and_has_no_token() -> None:
    """KubeRay takes submitterPodTemplate whole (GetSubmitterTemplate): the template carries
    the head's image, KubeRay's default resources, restartPolicy Never, the restricted
    profile's securityContext, and no service account token. SidecarMode sets none (KubeRay
    ignores it there)."""
    rj = by_kind(builders.build_children(make(submissionMode="K8sJobMode"), namespace="ns1"))[
        "RayJob"
    ]
    pod = rj["spec"]["submitterPodTemplate"]["spec"]
    assert pod["restartPolicy"] == "Never" and pod["automountServiceAccountToken"] is False
    assert pod["securityContext"]["runAsNonRoot"] is True
    assert pod["securityContext"]["seccompProfile"] == {"type": "RuntimeDefault"}
    (c,) = pod["containers"]
    assert c["name"] == "ray-job-submitter" and c["image"] == "ghcr.io/example/ppojob-trainer:1"
    assert c["securityContext"] == {
        "allowPrivilegeEscalation": False,
        "runAsNonRoot": True,
        "capabilities": {"drop": ["ALL"]},
    }
    assert c["resources"]["requests"] == {"cpu": "500m", "memory": "200Mi"}
    sidecar = by_kind(builders.build_children(make(), namespace="ns1"))["RayJob"]
    assert "submitterPodTemplate" not in sidecar["spec"]


@pytest.mark.parametrize(
    ("supported", "ray_version", "want"),
    [
        (True, "2.60.0", True),
        (True, "2.52.0", True),
        (True, "2.51.1", False),
        (False, "2.60.0", False),
    ],
)
def test_ray_token_auth_where_kuberay_and_the_ray_version_support_it(
    validate_child, supported: bool, ray_version: str, want: bool
) -> None:
    """KubeRay >= 1.6 (``authOptions`` in its CRD) and rayVersion >= 2.52 (KubeRay refuses
    token mode below that): the Ray cluster's dashboard and RPCs need the token KubeRay keeps
    in a Secret; otherwise no authOptions (a KubeRay 1.5 API server would prune it, and KubeRay
    1.6 would fail the RayJob for the Ray version)."""
    job = make(rayVersion=ray_version)
    rj = builders.build_children(job, namespace="ns1", dashboard_auth=supported)[-1]
    validate_child(rj)
    cluster = rj["spec"]["rayClusterSpec"]
    assert cluster.get("authOptions") == ({"mode": "token"} if want else None)
