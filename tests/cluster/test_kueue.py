"""``gangScheduler: kueue`` on the real Kueue (v0.19, RayJob integration, its real webhooks), the
real KubeRay and our operator with the chart's RBAC.

Each test makes its own ClusterQueue (quota for cpu, memory and ``nvidia.com/gpu`` in one
ResourceFlavor) and a LocalQueue ``lq`` in its namespace. The job: a head (no GPU) and four
1-GPU workers (actor x2, critic, rollout), 4 GPUs in all; Kueue makes one Workload with a podset
per group and admits all of it or none of it.
"""

from __future__ import annotations

import json
from typing import Any

import pytest
import yaml

from tests.helpers.cluster_jobs import (
    PPOJOB,
    condition,
    gpu_job,
    pods,
    pool_nodes,
    running,
    status,
    wait_children,
)
from tests.helpers.controlplane import KUEUE_API, ControlPlane, wait_until

FLAVOR = "default-flavor"
QUEUE_LABEL = "kueue.x-k8s.io/queue-name"
GROUPS = {"head": 1, "actor": 2, "critic": 1, "rollout": 1}


def make_queue(
    cp: ControlPlane,
    ns: str,
    gpus: int,
    preemption: dict | None = None,
    flavor: tuple[str, dict[str, Any]] = (FLAVOR, {}),
) -> str:
    """A ClusterQueue with ``gpus`` GPUs of quota in ResourceFlavor ``flavor`` (name, spec) and
    LocalQueue ``lq`` in ``ns`` pointing at it; returns the ClusterQueue's name once Kueue
    reports it active."""
    cq = f"cq-{ns}"
    quota = [
        {"name": "cpu", "nominalQuota": "100"},
        {"name": "memory", "nominalQuota": "1Ti"},
        {"name": "nvidia.com/gpu", "nominalQuota": str(gpus)},
    ]
    name, spec = flavor
    cp.apply(
        [
            {
                "apiVersion": KUEUE_API,
                "kind": "ResourceFlavor",
                "metadata": {"name": name},
                **({"spec": spec} if spec else {}),
            },
            {
                "apiVersion": KUEUE_API,
                "kind": "ClusterQueue",
                "metadata": {"name": cq},
                "spec": {
                    "namespaceSelector": {},
                    **({"preemption": preemption} if preemption else {}),
                    "resourceGroups": [
                        {
                            "coveredResources": [q["name"] for q in quota],
                            "flavors": [{"name": name, "resources": quota}],
                        }
                    ],
                },
            },
            {
                "apiVersion": KUEUE_API,
                "kind": "LocalQueue",
                "metadata": {"name": "lq", "namespace": ns},
                "spec": {"clusterQueue": cq},
            },
        ]
    )

    def active(obj: dict[str, Any] | None) -> bool:
        return condition((obj or {}).get("status") or {}, "Active").get("status") == "True"

    wait_until(
        lambda: (
            active(cp.get("clusterqueue.kueue.x-k8s.io", cq))
            and active(cp.get("localqueue.kueue.x-k8s.io", "lq", ns))
        ),
        60,
        f"ClusterQueue {cq} and LocalQueue {ns}/lq active",
    )
    return cq


def workload(cp: ControlPlane, name: str, ns: str) -> dict[str, Any] | None:
    """Kueue's Workload of the job's RayJob (labelled with the RayJob's uid)."""
    rj = cp.get("rayjob.ray.io", name, ns)
    if rj is None:
        return None
    uid = rj["metadata"]["uid"]
    items = cp.get(
        "workload.kueue.x-k8s.io", namespace=ns, selector=f"kueue.x-k8s.io/job-uid={uid}"
    )
    return items["items"][0] if items and items["items"] else None


def wl_cond(wl: dict[str, Any] | None, type_: str) -> dict[str, Any]:
    return condition((wl or {}).get("status") or {}, type_)


def admitted(cp: ControlPlane, name: str, ns: str) -> dict[str, Any] | None:
    wl = workload(cp, name, ns)
    return wl if wl_cond(wl, "Admitted").get("status") == "True" else None


def rayjob_suspended(cp: ControlPlane, name: str, ns: str) -> bool | None:
    rj = cp.get("rayjob.ray.io", name, ns)
    return None if rj is None else bool(rj["spec"].get("suspend"))


def all_running(cp: ControlPlane, name: str, ns: str) -> list[dict[str, Any]] | None:
    p = pods(cp, name, ns)
    want = sum(GROUPS.values())
    return p if len(p) == want and all(map(running, p)) else None


def job_pods(cp: ControlPlane, name: str, ns: str) -> list[dict[str, Any]]:
    """Every pod of the job, by its label (whatever RayCluster made it)."""
    return cp.get("pods", namespace=ns, selector=f"ppojob.io/job={name}")["items"]


def phase(cp: ControlPlane, name: str, ns: str) -> str | None:
    return status(cp, name, ns).get("phase")


def job(name: str, ns: str, **kw: Any) -> dict[str, Any]:
    return gpu_job(name, ns, scheduler="kueue", queue="lq", gpus=1, **kw)


def test_kueue_admits_the_whole_job_and_queues_what_does_not_fit(cp, operator, kueue, ns):
    """(a) a job that fits is admitted whole: one Workload, a podset per group, its RayJob
    unsuspended by Kueue, KubeRay's cluster and pods. (b) a second job that does not fit the
    remaining quota stays queued (RayJob suspended, no pods, Pending/WaitingForAdmission) until
    the first is deleted."""
    cq = make_queue(cp, ns, gpus=6)
    cp.apply(job("first", ns))
    children = wait_children(cp, "first", ns)
    assert children["rayjob.ray.io"]["metadata"]["labels"][QUEUE_LABEL] == "lq"

    wl = wait_until(lambda: admitted(cp, "first", ns), 60, "Kueue admitting the first job")
    assert {p["name"]: p["count"] for p in wl["spec"]["podSets"]} == GROUPS
    assert wl["status"]["admission"]["clusterQueue"] == cq
    wait_until(lambda: rayjob_suspended(cp, "first", ns) is False, 30, "Kueue unsuspending it")
    made = wait_until(lambda: all_running(cp, "first", ns), 90, "the first job's pods Running")
    gpus = [p["spec"]["containers"][0]["resources"]["limits"].get("nvidia.com/gpu") for p in made]
    assert sorted(g for g in gpus if g) == ["1"] * 4
    # SidecarMode: KubeRay adds the submitter to the head pod; Kueue (>= 0.19) counts it in the
    # head podset with KubeRay's default resources, so the quota covers the whole head pod
    head_ps = next(p for p in wl["spec"]["podSets"] if p["name"] == "head")
    head_pod = next(p for p in made if p["metadata"]["labels"].get("ray.io/node-type") == "head")
    counted = {c["name"]: c for c in head_ps["template"]["spec"]["containers"]}
    sidecar = {c["name"]: c for c in head_pod["spec"]["containers"]}["ray-job-submitter"]
    assert list(counted) == ["ray-head", "ray-job-submitter"], list(counted)
    assert counted["ray-job-submitter"]["resources"]["requests"] == sidecar["resources"]["requests"]
    wait_until(
        lambda: phase(cp, "first", ns) in ("Initializing", "Running"),
        60,
        "the first PPOJob out of Pending",
    )

    # 4 of 6 GPUs are taken: the second 4-GPU job waits, whole
    cp.apply(job("second", ns))
    wait_children(cp, "second", ns)
    wl2 = wait_until(
        lambda: (
            (w := workload(cp, "second", ns))
            and wl_cond(w, "QuotaReserved").get("status") == "False"
            and "insufficient" in wl_cond(w, "QuotaReserved").get("message", "").lower()
            and w
        ),
        60,
        "Kueue refusing quota to the second job",
    )
    assert wl_cond(wl2, "Admitted").get("status") != "True"
    assert rayjob_suspended(cp, "second", ns) is True
    assert job_pods(cp, "second", ns) == []
    st = wait_until(
        lambda: (s := status(cp, "second", ns)).get("phase") == "Pending" and s,
        30,
        "the second PPOJob Pending",
    )
    assert condition(st, "Running")["reason"] == "WaitingForAdmission"
    assert condition(st, "Suspended")["status"] == "False"
    # a spec edit of a started job is refused by the API server (the CRD's transition rules)
    # and leaves the queued job held by Kueue: nobody writes the RayJob's spec (a stray
    # unsuspend, even one Kueue reverts at once, bumps its generation)
    generation = cp.get("rayjob.ray.io", "second", ns)["metadata"]["generation"]
    refused = cp.kubectl(
        "patch",
        PPOJOB,
        "second",
        "-n",
        ns,
        "--type=merge",
        "-p",
        '{"spec":{"training":{"steps":5}}}',
        check=False,
    )
    assert refused.returncode != 0 and "spec.training cannot change" in refused.stderr
    assert rayjob_suspended(cp, "second", ns) is True
    assert cp.get("rayjob.ray.io", "second", ns)["metadata"]["generation"] == generation
    assert job_pods(cp, "second", ns) == []

    # the first job goes: its quota comes back and the second is admitted
    cp.kubectl("delete", PPOJOB, "first", "-n", ns, "--wait=false")
    wait_until(lambda: admitted(cp, "second", ns), 90, "Kueue admitting the second job")
    wait_until(lambda: rayjob_suspended(cp, "second", ns) is False, 30, "second RayJob resumed")
    wait_until(lambda: all_running(cp, "second", ns), 90, "the second job's pods Running")
    wait_until(
        lambda: phase(cp, "second", ns) in ("Initializing", "Running"),
        60,
        "the second PPOJob out of Pending",
    )


def test_suspend_and_resume_go_through_kueue(cp, operator, kueue, ns):
    """(c) spec.suspend on an admitted job deactivates its Workload; Kueue evicts it and
    suspends the RayJob, KubeRay deletes the pods, the job is Suspended; resuming reactivates the
    Workload and Kueue admits it again."""
    make_queue(cp, ns, gpus=4)
    cp.apply(job("sus", ns))
    wait_children(cp, "sus", ns)
    wait_until(lambda: all_running(cp, "sus", ns), 120, "the job's pods Running")

    patch = '{"spec":{"suspend":%s}}'
    cp.kubectl("patch", PPOJOB, "sus", "-n", ns, "--type=merge", "-p", patch % "true")
    wait_until(
        lambda: (workload(cp, "sus", ns) or {}).get("spec", {}).get("active") is False,
        30,
        "the Workload deactivated",
    )
    wait_until(lambda: rayjob_suspended(cp, "sus", ns) is True, 60, "Kueue suspending the RayJob")
    wait_until(
        lambda: not job_pods(cp, "sus", ns),
        90,
        "the job's pods gone",
    )
    wait_until(lambda: phase(cp, "sus", ns) == "Suspended", 60, "PPOJob Suspended")
    assert wl_cond(workload(cp, "sus", ns), "Admitted").get("status") != "True"

    cp.kubectl("patch", PPOJOB, "sus", "-n", ns, "--type=merge", "-p", patch % "false")
    wait_until(lambda: admitted(cp, "sus", ns), 60, "Kueue admitting the job again")
    wait_until(lambda: rayjob_suspended(cp, "sus", ns) is False, 30, "RayJob unsuspended")
    wait_until(lambda: all_running(cp, "sus", ns), 120, "the job's pods Running again")
    wait_until(
        lambda: phase(cp, "sus", ns) in ("Initializing", "Running"),
        60,
        "PPOJob out of Suspended",
    )


def test_job_created_suspended_gets_no_rayjob_until_resumed(cp, operator, kueue, ns):
    """(d) under Kueue a job created suspended gets its other children but no RayJob (Kueue
    would admit and unsuspend it); resumed, its RayJob is created, queued and admitted."""
    make_queue(cp, ns, gpus=4)
    cp.apply(job("held", ns, suspend=True))
    st = wait_until(
        lambda: (s := status(cp, "held", ns)).get("phase") == "Suspended" and s,
        60,
        "PPOJob Suspended",
    )
    assert condition(st, "Suspended")["reason"] == "SuspendedBeforeAdmission"
    assert cp.get("configmap", "held-trainer", ns) is not None
    assert cp.get("rayjob.ray.io", "held", ns) is None
    assert not cp.get("workload.kueue.x-k8s.io", namespace=ns)["items"]

    cp.kubectl(
        "patch", PPOJOB, "held", "-n", ns, "--type=merge", "-p", '{"spec":{"suspend":false}}'
    )
    wait_children(cp, "held", ns)
    wait_until(lambda: admitted(cp, "held", ns), 60, "Kueue admitting the resumed job")
    wait_until(lambda: all_running(cp, "held", ns), 120, "the job's pods Running")
    wait_until(
        lambda: phase(cp, "held", ns) in ("Initializing", "Running"),
        60,
        "PPOJob out of Suspended",
    )


def test_kueue_webhook_refuses_a_queue_name_that_is_no_localqueue_name(cp, kueue, ns):
    """Kueue's RayJob webhook refuses a ``queue-name`` that is a valid label value but no
    DNS-1123 subdomain; our validation refuses such a ``spec.scheduling.queue`` for kueue."""
    from ppojob_api.problems import SpecError
    from ppojob_api.validation import validate_manifest
    from ppojob_operator.builders import build_children

    manifest = job("badq", ns)
    rayjob = build_children(validate_manifest(manifest), namespace=ns)[-1]
    proc = cp.kubectl(
        "create", "--dry-run=server", "-f", "-", input=yaml.safe_dump(rayjob), check=False
    )
    assert proc.returncode == 0, proc.stderr  # what we build passes Kueue's webhook

    rayjob["metadata"]["labels"][QUEUE_LABEL] = "Team_A"
    proc = cp.kubectl(
        "create", "--dry-run=server", "-f", "-", input=yaml.safe_dump(rayjob), check=False
    )
    assert proc.returncode != 0 and QUEUE_LABEL in proc.stderr, proc.stderr
    manifest["spec"]["scheduling"]["queue"] = "Team_A"
    with pytest.raises(SpecError) as err:
        validate_manifest(manifest)
    assert [p.path for p in err.value.problems] == ["spec.scheduling.queue"]


def test_a_priority_preemption_shows_as_such_and_the_job_runs_again(cp, operator, kueue, ns):
    """Kueue preempts a running low-priority job for a high-priority one that needs the whole
    quota: the low job shows Pending with reason KueuePreempted and Kueue's message while its
    pods go; when the high one is deleted Kueue admits the low one again and it runs."""
    make_queue(cp, ns, gpus=4, preemption={"withinClusterQueue": "LowerPriority"})
    classes = {"low": 100, "high": 1000}
    cp.apply(
        [
            {
                "apiVersion": "scheduling.k8s.io/v1",
                "kind": "PriorityClass",
                "metadata": {"name": f"{ns}-{name}"},
                "value": value,
            }
            for name, value in classes.items()
        ]
    )

    def prioritized(name: str, level: str) -> dict[str, Any]:
        doc = job(name, ns)
        doc["spec"]["scheduling"]["priorityClassName"] = f"{ns}-{level}"
        return doc

    cp.apply(prioritized("low", "low"))
    wait_until(lambda: all_running(cp, "low", ns), 120, "the low job's pods Running")
    cp.apply(prioritized("high", "high"))
    wait_until(lambda: status(cp, "low", ns).get("reason") == "KueuePreempted", 90, "preempted")
    low = status(cp, "low", ns)
    assert low["phase"] == "Pending", low
    message = condition(low, "Running").get("message", "")
    assert "Preempted to accommodate a workload" in message, message
    wait_until(lambda: admitted(cp, "high", ns), 90, "the high job admitted")
    wait_until(lambda: not job_pods(cp, "low", ns), 90, "the low job's pods gone")
    cp.kubectl("delete", PPOJOB, "high", "-n", ns, "--wait=false")
    wait_until(lambda: admitted(cp, "low", ns), 120, "the low job admitted again")
    wait_until(lambda: all_running(cp, "low", ns), 120, "the low job's pods Running again")
    wait_until(
        lambda: phase(cp, "low", ns) in ("Initializing", "Running"), 60, "low out of Pending"
    )


def test_an_unusable_image_fails_the_job_and_leaves_no_pod_holding_its_gpus(
    cp, operator, kueue, ns
):
    """A worker's image cannot be had (the kubelet's ErrImageNeverPull, set on the KWOK pod's
    status as a kubelet would): the PPOJob turns Failed (ImageUnavailable) and the job stops
    for good: no pod of it left holding GPUs and no Workload of it admitted. (The operator must
    not patch RayJob.spec.suspend, which Kueue owns: Kueue would unsuspend the admitted job.)"""
    make_queue(cp, ns, gpus=4)
    cp.apply(job("img", ns))
    wait_children(cp, "img", ns)
    running_pods = wait_until(lambda: all_running(cp, "img", ns), 120, "the job's pods Running")
    worker = next(p for p in running_pods if p["metadata"]["labels"].get("ray.io/group") == "actor")
    image = worker["spec"]["containers"][0]["image"]
    waiting = {
        "name": worker["spec"]["containers"][0]["name"],
        "image": image,
        "imageID": "",
        "ready": False,
        "restartCount": 0,
        "state": {"waiting": {"reason": "ErrImageNeverPull", "message": "not present"}},
    }
    cp.kubectl(
        "patch",
        "pod",
        worker["metadata"]["name"],
        "-n",
        ns,
        "--subresource=status",
        "--type=strategic",
        "-p",
        json.dumps({"status": {"containerStatuses": [waiting]}}),
    )
    failed = wait_until(
        lambda: (c := condition(status(cp, "img", ns), "Failed")).get("status") == "True" and c,
        60,
        "PPOJob Failed",
    )
    assert failed["reason"] == "ImageUnavailable" and "ErrImageNeverPull" in failed["message"]

    def admitted_workloads() -> list[str]:
        items = cp.get("workload.kueue.x-k8s.io", namespace=ns)["items"]
        return [
            w["metadata"]["name"] for w in items if wl_cond(w, "Admitted").get("status") == "True"
        ]

    def stopped() -> bool:
        left = [p["metadata"]["name"] for p in job_pods(cp, "img", ns)]
        assert not left and not admitted_workloads(), (left, admitted_workloads())
        return True

    wait_until(stopped, 90, "no pod of the failed job left and no Workload of it admitted")
    # stopped for good: the run's RayJob is gone (nothing for Kueue to admit again), no other
    # was made, and the verdict stands
    wait_until(lambda: cp.get("rayjob.ray.io", "img", ns) is None, 60, "the RayJob gone")
    assert (status(cp, "img", ns).get("phase"), admitted_workloads()) == ("Failed", [])
    assert not job_pods(cp, "img", ns)


def test_a_queue_whose_clusterqueue_uses_multikueue_is_refused_before_any_child(
    cp, operator, kueue, ns
):
    """A LocalQueue whose ClusterQueue carries a MultiKueue admission check (Kueue would run the
    RayJob on a worker cluster, without the job's other objects): the job fails at once with
    reason MultiKueueUnsupported, naming the queue, the ClusterQueue and the check, and nothing
    is made for it. The same job on a plain queue of the same namespace gets its RayJob."""
    check, cq = f"mk-{ns}", f"cq-mk-{ns}"
    cp.apply(
        [
            {
                "apiVersion": KUEUE_API,
                "kind": "AdmissionCheck",
                "metadata": {"name": check},
                "spec": {"controllerName": "kueue.x-k8s.io/multikueue"},
            },
            {
                "apiVersion": KUEUE_API,
                "kind": "ClusterQueue",
                "metadata": {"name": cq},
                "spec": {
                    "namespaceSelector": {},
                    "admissionChecksStrategy": {"admissionChecks": [{"name": check}]},
                    "resourceGroups": [
                        {
                            "coveredResources": ["cpu"],
                            "flavors": [
                                {
                                    "name": FLAVOR,
                                    "resources": [{"name": "cpu", "nominalQuota": "1"}],
                                }
                            ],
                        }
                    ],
                },
            },
            {"apiVersion": KUEUE_API, "kind": "ResourceFlavor", "metadata": {"name": FLAVOR}},
            {
                "apiVersion": KUEUE_API,
                "kind": "LocalQueue",
                "metadata": {"name": "mk", "namespace": ns},
                "spec": {"clusterQueue": cq},
            },
        ]
    )
    make_queue(cp, ns, gpus=4)  # "lq": no admission check
    try:
        cp.apply(gpu_job("far", ns, scheduler="kueue", queue="mk", gpus=1))
        cp.apply(job("near", ns))
        st = wait_until(
            lambda: (s := status(cp, "far", ns)).get("phase") == "Failed" and s,
            60,
            "the MultiKueue job refused",
        )
        failed = condition(st, "Failed")
        assert failed.get("reason") == "MultiKueueUnsupported", st
        for named in ("spec.scheduling.queue mk", cq, check):
            assert named in failed["message"], failed["message"]
        wait_children(cp, "near", ns)  # the plain queue's job is made (so the operator has run)
        assert cp.get("rayjob.ray.io", "far", ns) is None
        assert cp.get("configmap", namespace=ns, selector="ppojob.io/job=far")["items"] == []
    finally:
        cp.kubectl("delete", "ppojob", "--all", "-n", ns, "--wait=false", check=False)
        cp.kubectl("delete", "clusterqueue", cq, "--wait=false", check=False)
        cp.kubectl("delete", "admissioncheck", check, "--wait=false", check=False)


def test_a_workload_priority_class_is_the_workloads_priority(cp, operator, kueue, ns):
    """``spec.scheduling.workloadPriorityClass``: Kueue gives the job's Workload that
    WorkloadPriorityClass and its value (the pods keep no PriorityClass of their own)."""
    make_queue(cp, ns, gpus=4)
    wpc = f"{ns}-urgent"
    cp.apply(
        [
            {
                "apiVersion": KUEUE_API,
                "kind": "WorkloadPriorityClass",
                "metadata": {"name": wpc},
                "value": 5000,
            }
        ]
    )
    try:
        doc = job("urgent", ns)
        doc["spec"]["scheduling"]["workloadPriorityClass"] = wpc
        cp.apply(doc)
        wl = wait_until(lambda: workload(cp, "urgent", ns), 60, "the job's Workload")
        assert wl["spec"]["priority"] == 5000, wl["spec"]
        ref = wl["spec"]["priorityClassRef"]
        assert (ref["kind"], ref["name"]) == ("WorkloadPriorityClass", wpc), ref
    finally:
        cp.kubectl("delete", PPOJOB, "--all", "-n", ns, "--wait=false", check=False)
        cp.kubectl("delete", "workloadpriorityclass", wpc, "--wait=false", check=False)


BLOCK = "ppojob.test/block"


def _tas_queue(cp: ControlPlane, ns: str, pool: str) -> None:
    """A Topology (block, then node), a ResourceFlavor of ``pool``'s nodes under it, and a
    ClusterQueue of that flavor behind LocalQueue ``lq`` in ``ns``."""
    topology = f"topo-{ns}"
    levels = [{"nodeLabel": BLOCK}, {"nodeLabel": "kubernetes.io/hostname"}]
    cp.apply(
        [
            {
                "apiVersion": KUEUE_API,
                "kind": "Topology",
                "metadata": {"name": topology},
                "spec": {"levels": levels},
            }
        ]
    )
    spec = {"nodeLabels": {"pool": pool}, "topologyName": topology}
    make_queue(cp, ns, gpus=100, flavor=(f"tas-{ns}", spec))


def test_a_topology_level_keeps_each_pod_group_in_one_domain(cp, operator, kueue, ns):
    """``scheduling.topology`` (Kueue Topology-Aware Scheduling) at the node level: each worker
    group must fit on one node. Of the pool's nodes only one has the 2 GPUs the actor's two
    1-GPU pods need together, so Kueue admits the job with both actor pods assigned to that
    node, and they run there; a job whose 4-pod actor fits on no node is not admitted (the
    same job without a topology would fit the pool's 6 GPUs)."""
    pool = f"tas-{ns}"
    nodes = {
        f"{pool}-a1": ("a", 1),
        f"{pool}-a2": ("a", 1),
        f"{pool}-a3": ("a", 1),
        f"{pool}-b1": ("b", 2),
        f"{pool}-b2": ("b", 1),
    }
    pool_nodes(
        cp,
        pool,
        {name: gpus for name, (_, gpus) in nodes.items()},
        {
            name: {BLOCK: block, "kubernetes.io/hostname": name}
            for name, (block, _) in nodes.items()
        },
    )
    _tas_queue(cp, ns, pool)
    level = {"level": "kubernetes.io/hostname"}
    doc = gpu_job("near", ns, scheduler="kueue", queue="lq", gpus=1, pool=pool)
    doc["spec"]["scheduling"]["topology"] = level
    cp.apply(doc)
    wl = wait_until(lambda: admitted(cp, "near", ns), 90, "Kueue admitting the job by topology")
    assignments = {a["name"]: a for a in wl["status"]["admission"]["podSetAssignments"]}
    actor = assignments["actor"]["topologyAssignment"]
    assert actor["levels"] == ["kubernetes.io/hostname"], actor
    print(json.dumps({k: a.get("topologyAssignment") for k, a in assignments.items()}))
    made = wait_until(lambda: all_running(cp, "near", ns), 90, "the job's pods Running")
    actors = [p for p in made if p["metadata"]["labels"].get("ray.io/group") == "actor"]
    assert [p["spec"]["nodeName"] for p in actors] == [f"{pool}-b1"] * 2

    # the job goes; the actor's four pods of the next fit on no node (at most 2 GPUs a node)
    # though the pool's 6 GPUs are free for its 6: not admitted
    cp.kubectl("delete", PPOJOB, "near", "-n", ns, "--wait=false")
    wait_until(lambda: not job_pods(cp, "near", ns), 90, "the first job's pods gone")
    wait_until(lambda: workload(cp, "near", ns) is None, 90, "the first job's Workload gone")
    doc = gpu_job("far", ns, scheduler="kueue", queue="lq", gpus=1, pool=pool, actor=4)
    doc["spec"]["scheduling"]["topology"] = level
    cp.apply(doc)
    wl = wait_until(
        lambda: (
            (w := workload(cp, "far", ns))
            and wl_cond(w, "QuotaReserved").get("status") == "False"
            and w
        ),
        60,
        "Kueue refusing the job that fits on no node",
    )
    # (with the first job's node still held, 1 of 4 would fit)
    message = wl_cond(wl, "QuotaReserved").get("message", "")
    assert "allows to fit only 2 out of 4 pod(s)" in message, message
    assert rayjob_suspended(cp, "far", ns) is True

    # a level the Topology does not list: Kueue's webhook takes it (a label key), its
    # scheduler keeps the job queued, saying so on the Workload
    doc = gpu_job("typo", ns, scheduler="kueue", queue="lq", gpus=1, pool=pool)
    doc["spec"]["scheduling"]["topology"] = {"level": "ppojob.test/rack"}
    cp.apply(doc)
    wl = wait_until(
        lambda: (
            (w := workload(cp, "typo", ns))
            and "does not contain the requested level"
            in wl_cond(w, "QuotaReserved").get("message", "")
            and w
        ),
        60,
        "Kueue naming the level its Topology lacks",
    )
    assert wl_cond(wl, "QuotaReserved").get("status") == "False"
    cp.kubectl("delete", PPOJOB, "--all", "-n", ns, "--wait=false", check=False)
