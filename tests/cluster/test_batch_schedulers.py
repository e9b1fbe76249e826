"""KubeRay's batch schedulers, for real: what KubeRay (v1.6.1) itself creates for our RayJob when
it runs with ``--batch-scheduler=volcano``, ``yunikorn`` or ``kai-scheduler``, checked against
the gang our builders compute; and the operator reading that setting from a KubeRay Deployment.

Volcano's, YuniKorn's and KAI's own controllers are not built here (Volcano's and YuniKorn's Go
modules are refused by the module proxy), so their pods stay Pending: these tests prove
KubeRay's side of the contract (the PodGroup, task groups or labels it writes from our RayJob),
not the schedulers' placement.
The session's KubeRay and ppojob operator step aside for the module and come back after it.
"""

from __future__ import annotations

import json
import uuid
from pathlib import Path
from typing import Any

import pytest

from ppojob_api.checks.sizes import quantity_bytes
from ppojob_api.spec import PPOJob
from ppojob_operator import builders, scheduling
from tests.cluster.conftest import OPERATOR_NS, RELEASE, OperatorProcess, chart_rbac
from tests.helpers.cluster_jobs import gpu_job, pods, status, wait_children
from tests.helpers.controlplane import RESOURCES, wait_until

RESOURCES.setdefault(
    "podgroup.scheduling.volcano.sh", ("apis/scheduling.volcano.sh/v1beta1", "podgroups", True)
)
RESOURCES.setdefault("deployment.apps", ("apis/apps/v1", "deployments", True))
# Volcano's own PodGroup CRD (vendored, see tests/external-crds/README.md): its schema prunes
# any field KubeRay writes that Volcano does not define
VOLCANO_CRD = Path(__file__).parents[1] / "external-crds" / "scheduling.volcano.sh_podgroups.yaml"
PRIORITY = "ppojob-test-gang-high"


def stored(cp, name: str, ns: str) -> PPOJob:
    doc = cp.get("ppojobs.ppojob.io", name, ns)
    return PPOJob.model_validate(doc, by_alias=True, by_name=False)


def amounts(resources: dict[str, Any]) -> dict[str, float]:
    """A ResourceList as numbers (KubeRay and our builders write the same amount differently)."""
    return {k: quantity_bytes(str(v)) for k, v in resources.items() if quantity_bytes(str(v))}


@pytest.fixture()
def kuberay_with(cp, operator, request):
    """Run KubeRay with ``--batch-scheduler=<name>`` and an operator told so, then restore."""
    started: list[OperatorProcess] = []

    def start(name: str) -> OperatorProcess:
        cp.restart_kuberay([f"--batch-scheduler={name}"])
        operator.stop()
        op = OperatorProcess(
            cp,
            operator.kubeconfig,
            extra_args=[f"--kuberay-batch-scheduler={name}"],
            name=f"ppojob-operator-{name}-{uuid.uuid4().hex[:4]}",
        )
        started.append(op)
        op.start()
        return op

    try:
        yield start
    finally:
        for op in started:
            op.stop()
        cp.restart_kuberay([])
        operator.start()


def test_kuberay_with_volcano_makes_the_podgroup_our_builders_compute(cp, kuberay_with, ns):
    cp.kubectl("apply", "-f", str(VOLCANO_CRD))
    cp.kubectl("wait", "--for=condition=Established", "crd/podgroups.scheduling.volcano.sh")
    cp.apply(
        {
            "apiVersion": "scheduling.k8s.io/v1",
            "kind": "PriorityClass",
            "metadata": {"name": PRIORITY},
            "value": 1000,
        }
    )
    try:
        kuberay_with("volcano")
        doc = gpu_job("vol", ns, scheduler="volcano", actor=2, critic=1, rollout=1, queue="q1")
        doc["spec"]["scheduling"]["priorityClassName"] = PRIORITY
        cp.apply(doc)
        wait_children(cp, "vol", ns)
        pg = wait_until(
            lambda: cp.get("podgroup.scheduling.volcano.sh", "ray-vol-pg", ns),
            60,
            "KubeRay's Volcano PodGroup ray-vol-pg",
        )
        job = stored(cp, "vol", ns)
        count, totals = scheduling.gang_totals(builders.gang_members(job))
        spec = pg["spec"]
        # what KubeRay made from our RayJob is the gang we compute: head + 4 workers, and
        # their requests plus the SidecarMode submitter's (KubeRay adds it to minResources)
        assert spec["minMember"] == count == 5
        assert amounts(spec["minResources"]) == amounts(totals)
        assert spec["queue"] == "q1" and spec["priorityClassName"] == PRIORITY
        [ref] = pg["metadata"]["ownerReferences"]
        assert (ref["kind"], ref["name"]) == ("RayJob", "vol")
        # every pod goes to Volcano, in that PodGroup, with the queue
        got = wait_until(lambda: len(p := pods(cp, "vol", ns)) == 5 and p, 60, "the 5 pods")
        for p in got:
            assert p["spec"]["schedulerName"] == "volcano"
            assert p["metadata"]["annotations"]["scheduling.k8s.io/group-name"] == "ray-vol-pg"
            assert p["metadata"]["labels"]["volcano.sh/queue-name"] == "q1"
            assert p["spec"]["priorityClassName"] == PRIORITY
        # a job this KubeRay cannot run is refused, not queued for ever
        cp.apply(gpu_job("plain", ns, scheduler="none", actor=1, critic=1, rollout=1))
        st = wait_until(
            lambda: (s := status(cp, "plain", ns)).get("reason") == "BatchSchedulerMismatch" and s,
            60,
            "BatchSchedulerMismatch on a gangScheduler: none job",
        )
        assert st["phase"] == "Failed"
        assert cp.get("rayjob.ray.io", "plain", ns) is None
    finally:
        cp.kubectl("delete", "ppojob", "--all", "-n", ns, "--wait=false", check=False)
        cp.kubectl("delete", "priorityclass", PRIORITY, "--wait=false", check=False)


def test_an_elastic_rollout_group_runs_kuberays_autoscaler_and_volcano_counts_its_minimum(
    cp, kuberay_with, ns
):
    """Issue 24: an elastic rollout group turns on KubeRay's in-tree autoscaler. What KubeRay v1.5
    makes of it: an ``autoscaler`` container in the head pod (``ray kuberay-autoscaler``, with our
    resources), its Role bound to the head's (our trainer's) service account, and, since its
    autoscaler is on, a Volcano PodGroup counting the group's minReplicas: the gang our builders
    compute. KubeRay's minResources leave the autoscaler container out (its
    ``CalculateMinResources`` reads the head's template, where KubeRay has not added it)."""
    kuberay_with("volcano")
    cp.kubectl("apply", "-f", str(VOLCANO_CRD))
    cp.kubectl("wait", "--for=condition=Established", "crd/podgroups.scheduling.volcano.sh")
    doc = gpu_job("el", ns, scheduler="volcano", actor=1, critic=1, rollout=2, queue="q1")
    doc["spec"]["algorithm"] = {"advantageEstimator": "grpo"}
    del doc["spec"]["roles"]["critic"]
    doc["spec"]["roles"]["rollout"]["elastic"] = {"minReplicas": 1, "maxReplicas": 3}
    cp.apply(doc)
    try:
        wait_children(cp, "el", ns)
        pg = wait_until(
            lambda: cp.get("podgroup.scheduling.volcano.sh", "ray-el-pg", ns),
            60,
            "KubeRay's Volcano PodGroup ray-el-pg",
        )
        job = stored(cp, "el", ns)
        count, totals = scheduling.gang_totals(builders.gang_members(job, autoscaler=True))
        assert pg["spec"]["minMember"] == count == 1 + 1 + 1  # head, actor, rollout minimum
        own = builders.AUTOSCALER_RESOURCES["requests"]
        expected = {
            k: v - quantity_bytes(own[k]) if k in own else v for k, v in amounts(totals).items()
        }
        assert amounts(pg["spec"]["minResources"]) == expected
        rj = cp.get("rayjob.ray.io", "el", ns)
        cluster_name = rj["status"]["rayClusterName"]
        cluster = cp.get("raycluster.ray.io", cluster_name, ns)
        assert cluster["spec"]["enableInTreeAutoscaling"] is True
        group = {g["groupName"]: g for g in cluster["spec"]["workerGroupSpecs"]}["rollout"]
        assert (group["replicas"], group["minReplicas"], group["maxReplicas"]) == (2, 1, 3)
        # the head pod runs KubeRay's autoscaler beside the Ray head, with our resources
        head = wait_until(
            lambda: [
                p
                for p in pods(cp, "el", ns)
                if p["metadata"]["labels"].get("ray.io/node-type") == "head"
            ],
            60,
            "the head pod",
        )[0]
        containers = {c["name"]: c for c in head["spec"]["containers"]}
        autoscaler = containers["autoscaler"]
        assert "ray kuberay-autoscaler" in " ".join(autoscaler["args"])
        assert amounts(autoscaler["resources"]["requests"]) == amounts(own)
        assert autoscaler["image"] == containers["ray-head"]["image"]
        # KubeRay's autoscaler Role, bound to the service account the head pod runs as (ours)
        sa = head["spec"]["serviceAccountName"]
        assert sa == builders.trainer_name("el")
        binding = wait_until(
            lambda: cp.get("rolebinding.rbac.authorization.k8s.io", cluster_name, ns),
            60,
            "KubeRay's autoscaler RoleBinding",
        )
        assert [(s["kind"], s["name"]) for s in binding["subjects"]] == [("ServiceAccount", sa)]
        rules = cp.get("role.rbac.authorization.k8s.io", cluster_name, ns)["rules"]
        assert any("rayclusters" in r["resources"] and "patch" in r["verbs"] for r in rules)
    finally:
        cp.kubectl("delete", "ppojob", "el", "-n", ns, "--wait=false", check=False)


def test_kuberay_with_yunikorn_writes_the_task_groups_our_builders_compute(cp, kuberay_with, ns):
    kuberay_with("yunikorn")
    doc = gpu_job("yk", ns, scheduler="yunikorn", actor=2, critic=1, rollout=1, queue="root.ml")
    cp.apply(doc)
    wait_children(cp, "yk", ns)
    rj = cp.get("rayjob.ray.io", "yk", ns)
    app = rj["metadata"]["labels"]["yunikorn.apache.org/app-id"]
    assert app == scheduling.yunikorn_app_id(
        ns, "yk", cp.get("ppojobs.ppojob.io", "yk", ns)["metadata"]["uid"], 0
    )
    got = wait_until(lambda: len(p := pods(cp, "yk", ns)) == 5 and p, 60, "the 5 pods")
    want = sorted(
        (m.replicas, sorted(amounts(m.requests).items()))
        for m in builders.gang_members(stored(cp, "yk", ns))
    )
    timeout = stored(cp, "yk", ns).spec.scheduling.timeout_seconds
    for p in got:
        meta = p["metadata"]
        assert p["spec"]["schedulerName"] == "yunikorn"
        # YuniKorn's own pod labels, which KubeRay derives from ours
        assert meta["labels"]["applicationId"] == app and meta["labels"]["queue"] == "root.ml"
        groups = json.loads(meta["annotations"]["yunikorn.apache.org/task-groups"])
        have = sorted((g["minMember"], sorted(amounts(g["minResource"]).items())) for g in groups)
        assert have == want, (have, want)
        names = {g["name"] for g in groups}
        assert meta["annotations"]["yunikorn.apache.org/task-group-name"] in names
        assert meta["annotations"]["yunikorn.apache.org/schedulingPolicyParameters"] == (
            f"placeholderTimeoutInSeconds={timeout} gangSchedulingStyle=Hard"
        )
    cp.kubectl("delete", "ppojob", "--all", "-n", ns, "--wait=false", check=False)


def kuberay_deployment(name: str, ns: str, args: list[str], **extra: Any) -> dict[str, Any]:
    """A KubeRay operator Deployment as KubeRay's chart writes it (replicas 0: never runs)."""
    labels = {"app.kubernetes.io/name": "kuberay-operator", "app.kubernetes.io/instance": name}
    container = {"name": "kuberay-operator", "image": "kuberay/operator:v1.5.0"}
    container.update(command=["/manager"], args=args, **extra.pop("container", {}))
    return {
        "apiVersion": "apps/v1",
        "kind": "Deployment",
        "metadata": {"name": name, "namespace": ns, "labels": labels},
        "spec": {
            "replicas": 0,
            "selector": {"matchLabels": labels},
            "template": {
                "metadata": {"labels": labels},
                "spec": {"containers": [container], **extra},
            },
        },
    }


KAI_QUEUE_CRD = Path(__file__).parents[1] / "external-crds" / "scheduling.run.ai_queues.yaml"


def test_kuberay_with_kai_sends_every_pod_to_kai_in_the_jobs_queue(cp, kuberay_with, ns):
    """KubeRay >= 1.6 with ``--batch-scheduler=kai-scheduler`` (KAI's own controllers are not
    built here: its pods stay Pending): a ``gangScheduler: kai`` job's pods, the head with the
    SidecarMode submitter in it, all go to ``kai-scheduler`` with the job's queue label, which
    KAI's pod grouper makes one PodGroup of. A job for another gang scheduler is refused."""
    cp.kubectl("apply", "-f", str(KAI_QUEUE_CRD))
    cp.kubectl("wait", "--for=condition=Established", "crd/queues.scheduling.run.ai")
    try:
        kuberay_with("kai-scheduler")
        cp.apply(
            gpu_job("kai", ns, scheduler="kai", actor=2, critic=1, rollout=1, queue="research")
        )
        wait_children(cp, "kai", ns)
        got = wait_until(lambda: len(p := pods(cp, "kai", ns)) == 5 and p, 60, "the 5 pods")
        for p in got:
            assert p["spec"]["schedulerName"] == "kai-scheduler", p["metadata"]["name"]
            assert p["metadata"]["labels"]["kai.scheduler/queue"] == "research"
        head = next(p for p in got if p["metadata"]["labels"].get("ray.io/node-type") == "head")
        assert "ray-job-submitter" in [c["name"] for c in head["spec"]["containers"]]
        cp.apply(gpu_job("plain", ns, scheduler="none", actor=1, critic=1, rollout=1))
        st = wait_until(
            lambda: (s := status(cp, "plain", ns)).get("reason") == "BatchSchedulerMismatch" and s,
            60,
            "BatchSchedulerMismatch on a gangScheduler: none job",
        )
        assert st["phase"] == "Failed" and cp.get("rayjob.ray.io", "plain", ns) is None
    finally:
        cp.kubectl("delete", "ppojob", "--all", "-n", ns, "--wait=false", check=False)


def test_the_operator_reads_kuberays_batch_scheduler_from_its_deployment(cp, operator, ns):
    """``kuberay.batchScheduler: auto`` (the default): the operator reads, at start-up, KubeRay's
    Deployment in ``kuberay.namespace`` (here with KubeRay's ``--config`` file, whose ConfigMap
    decides), with the chart's Role in that namespace only: a KubeRay-like Deployment elsewhere
    is not looked at and cannot be listed, and no Deployment can be listed cluster-wide. A job
    that cannot run with what it read is refused."""
    kr = f"kr-{uuid.uuid4().hex[:6]}"
    cp.kubectl("create", "namespace", kr)
    op: OperatorProcess | None = None
    try:
        # the chart's RBAC with KubeRay's namespace, as `helm install` would make it
        cp.apply(chart_rbac(cp, RELEASE, OPERATOR_NS, f"kuberay.namespace={kr}"))
        sa = f"system:serviceaccount:{OPERATOR_NS}:{RELEASE}"

        def can(*args: str) -> bool:
            got = cp.kubectl("auth", "can-i", *args, f"--as={sa}", check=False).stdout.strip()
            return got == "yes"

        assert can("list", "deployments.apps", "-n", kr)
        assert not can("list", "deployments.apps", "-n", ns)
        assert not can("list", "deployments.apps", "--all-namespaces")
        cp.apply(
            {
                "apiVersion": "v1",
                "kind": "ConfigMap",
                "metadata": {"name": "kuberay-operator-config", "namespace": kr},
                "data": {"config.yaml": "batchScheduler: yunikorn\nreconcileConcurrency: 1\n"},
            }
        )
        mount = {"name": "operator-config", "mountPath": "/etc/kuberay", "readOnly": True}
        cp.apply(
            kuberay_deployment(
                "kuberay-operator",
                kr,
                ["--config", "/etc/kuberay/config.yaml", "--batch-scheduler=volcano"],
                container={"volumeMounts": [mount]},
                volumes=[
                    {"name": "operator-config", "configMap": {"name": "kuberay-operator-config"}}
                ],
            )
        )
        # a look-alike in a tenant's namespace: not KubeRay's namespace, never read
        cp.apply(kuberay_deployment("kuberay-operator", ns, ["--batch-scheduler=volcano"]))
        operator.stop()
        op = OperatorProcess(
            cp,
            operator.kubeconfig,
            ["--kuberay-batch-scheduler=auto", f"--kuberay-namespace={kr}"],
            namespaces=[ns],
            name="ppojob-operator-auto",
        )
        op.start()
        assert op.comp is not None
        wait_until(
            lambda: f"KubeRay's batch scheduler (Deployment in {kr}): yunikorn" in op.comp.tail(),
            30,
            "the batch scheduler read from KubeRay's Deployment",
        )
        cp.apply(gpu_job("plain", ns, scheduler="none"))
        st = wait_until(
            lambda: (s := status(cp, "plain", ns)).get("reason") == "BatchSchedulerMismatch" and s,
            60,
            "BatchSchedulerMismatch: KubeRay's file says yunikorn",
        )
        assert st["phase"] == "Failed" and "batchScheduler yunikorn" in json.dumps(st), st
        assert cp.get("rayjob.ray.io", "plain", ns) is None
    finally:
        if op is not None:
            op.stop()
        operator.start()
        cp.kubectl("delete", "ppojob", "--all", "-n", ns, "--wait=false", check=False)
        cp.kubectl("delete", "deployment", "--all", "-n", ns, check=False)
        cp.kubectl("delete", "namespace", kr, "--wait=false", check=False)
