"""PPOJob -> children -> the real KubeRay -> RayCluster and pods; deletion, suspension, repair."""

from __future__ import annotations

import json
from datetime import datetime, timezone

import pytest

from tests.helpers.cluster_jobs import (
    CHILDREN,
    JOB_LABEL,
    PPOJOB,
    condition,
    controller_uid,
    gpu_job,
    job,
    pods,
    running,
    status,
    wait_children,
)
from tests.helpers.controlplane import ControlPlaneError, wait_until

ROLES = ("actor", "critic", "rollout")


def restarted(cp, name: str, ns: str) -> dict:
    """Wait for the job's next attempt (its RayJob of attempt 1, made) and return its status."""

    def next_attempt() -> dict | None:
        rj = cp.get("rayjob.ray.io", name, ns) or {}
        ann = (rj.get("metadata") or {}).get("annotations") or {}
        return rj if ann.get("ppojob.io/attempt") == "1" else None

    wait_until(next_attempt, 60, "the next attempt's RayJob")
    return wait_until(
        lambda: (s := status(cp, name, ns)).get("lastRestart", {}).get("recreated") and s,
        30,
        "lastRestart.recreated",
    )


def rayjob_deployment(cp, name: str, ns: str) -> str:
    """The RayJob's jobDeploymentStatus ("" before KubeRay has written one)."""
    rj = cp.get("rayjob.ray.io", name, ns) or {}
    return (rj.get("status") or {}).get("jobDeploymentStatus", "")


def test_children_then_kuberay_makes_the_cluster_and_pods(cp, operator, ns):
    cp.apply(gpu_job("demo", ns, actor=2, critic=1, rollout=1))
    children = wait_children(cp, "demo", ns)
    uid = job(cp, "demo", ns)["metadata"]["uid"]
    for obj in children.values():
        ref = obj["metadata"]["ownerReferences"][0]
        assert ref["uid"] == uid and ref["kind"] == "PPOJob" and ref["controller"] is True
    rj = children["rayjob.ray.io"]
    assert rj["spec"]["submissionMode"] == "SidecarMode"
    assert "trainer.yaml" in children["configmap"]["data"]

    # the real KubeRay: a RayCluster with one worker group per role, then the pods
    def cluster():
        name = ((cp.get("rayjob.ray.io", "demo", ns) or {}).get("status") or {}).get(
            "rayClusterName"
        )
        return cp.get("raycluster.ray.io", name, ns) if name else None

    rc = wait_until(cluster, 60, "KubeRay's RayCluster")
    groups = {g["groupName"]: g for g in rc["spec"]["workerGroupSpecs"]}
    assert set(groups) == set(ROLES)
    assert {g: groups[g]["replicas"] for g in ROLES} == {"actor": 2, "critic": 1, "rollout": 1}

    want = 1 + 2 + 1 + 1
    made = wait_until(
        lambda: (p := pods(cp, "demo", ns)) and len(p) == want and all(map(running, p)) and p,
        90,
        f"{want} pods Running (KubeRay + kube-scheduler + KWOK)",
    )
    heads = [p for p in made if p["metadata"]["labels"].get("ray.io/node-type") == "head"]
    assert len(heads) == 1
    containers = [c["name"] for c in heads[0]["spec"]["containers"]]
    assert "ray-job-submitter" in containers, containers
    per_group: dict[str, int] = {}
    for p in made:
        if p is heads[0]:
            continue
        g = p["metadata"]["labels"]["ray.io/group"]
        per_group[g] = per_group.get(g, 0) + 1
        gpus = p["spec"]["containers"][0]["resources"]["limits"]["nvidia.com/gpu"]
        assert str(gpus) == "1", p["metadata"]["name"]
    assert per_group == {"actor": 2, "critic": 1, "rollout": 1}
    # the PPOJob follows the RayJob out of Pending
    wait_until(
        lambda: status(cp, "demo", ns).get("phase") in ("Initializing", "Running"),
        60,
        "PPOJob phase Initializing/Running",
    )


def test_deleting_the_ppojob_garbage_collects_every_child(cp, operator, ns):
    cp.apply(gpu_job("gc", ns))
    wait_children(cp, "gc", ns)
    wait_until(lambda: pods(cp, "gc", ns), 60, "the job's pods")
    cp.kubectl("delete", PPOJOB, "gc", "-n", ns, "--wait=false")

    def gone() -> bool:
        left = [r for r, s in CHILDREN if cp.get(r, "gc" + s, ns) is not None]
        left += [p["metadata"]["name"] for p in cp.get("pods", namespace=ns)["items"]]
        left += [c["metadata"]["name"] for c in cp.get("rayclusters.ray.io", namespace=ns)["items"]]
        return not left

    wait_until(gone, 120, "every child, the RayCluster and the pods garbage-collected")


def test_suspend_and_resume(cp, operator, ns):
    cp.apply(gpu_job("sus", ns))
    wait_children(cp, "sus", ns)
    wait_until(lambda: len(pods(cp, "sus", ns)) == 5, 60, "the job's 5 pods")
    cp.kubectl("patch", PPOJOB, "sus", "-n", ns, "--type=merge", "-p", '{"spec":{"suspend":true}}')
    wait_until(
        lambda: cp.get("rayjob.ray.io", "sus", ns)["spec"].get("suspend") is True,
        30,
        "RayJob suspended",
    )
    wait_until(lambda: not cp.get("pods", namespace=ns)["items"], 90, "KubeRay deleting the pods")
    wait_until(lambda: status(cp, "sus", ns).get("phase") == "Suspended", 60, "phase Suspended")
    assert condition(status(cp, "sus", ns), "Suspended").get("status") == "True"
    cp.kubectl("patch", PPOJOB, "sus", "-n", ns, "--type=merge", "-p", '{"spec":{"suspend":false}}')
    wait_until(
        lambda: len([p for p in pods(cp, "sus", ns) if running(p)]) == 5,
        90,
        "the 5 pods back after resume",
    )
    wait_until(
        lambda: status(cp, "sus", ns).get("phase") in ("Initializing", "Running"),
        60,
        "phase after resume",
    )


@pytest.mark.parametrize(
    "resource,suffix",
    [
        ("rayjob.ray.io", ""),
        ("configmap", "-trainer"),
        ("role.rbac.authorization.k8s.io", "-trainer"),
    ],
    ids=["rayjob", "configmap", "role"],
)
def test_a_child_deleted_by_hand_is_recreated(cp, operator, ns, resource, suffix):
    cp.apply(gpu_job("fix", ns))
    before = wait_children(cp, "fix", ns)[resource]["metadata"]["uid"]
    cp.kubectl("delete", resource, "fix" + suffix, "-n", ns)

    def recreated() -> bool:
        obj = cp.get(resource, "fix" + suffix, ns)
        return bool(obj) and obj["metadata"]["uid"] != before

    wait_until(recreated, 60, f"{resource} fix{suffix} recreated by the operator")
    owner = job(cp, "fix", ns)["metadata"]["uid"]
    assert controller_uid(cp.get(resource, "fix" + suffix, ns)) == owner


def test_delete_and_recreate_the_same_name_gets_children_and_status(cp, operator, ns):
    cp.apply(gpu_job("again", ns))
    old = wait_children(cp, "again", ns)
    old_uid = controller_uid(old["rayjob.ray.io"])
    # delete and apply at once: the old children are still there, owned by the old uid
    cp.kubectl("delete", PPOJOB, "again", "-n", ns, "--wait=false")
    cp.apply(gpu_job("again", ns))
    new_uid = job(cp, "again", ns)["metadata"]["uid"]
    assert new_uid != old_uid
    # once the garbage collector removed the old children, the new job gets its own
    wait_children(cp, "again", ns, timeout=120)
    st = wait_until(
        lambda: status(cp, "again", ns).get("phase") and status(cp, "again", ns),
        60,
        "a status on the new job",
    )
    assert st["rayJobName"] == "again"
    labelled = cp.get("rayjobs.ray.io", namespace=ns)["items"]
    assert [r["metadata"]["labels"].get(JOB_LABEL) for r in labelled] == ["again"]


def test_an_object_we_do_not_own_is_never_adopted(cp, operator, ns):
    """A ConfigMap with a child's name and no owner: the job waits (ChildConflict, a Warning
    event), the object is left as it is, and the job proceeds once its owner removes it."""
    stray = {
        "apiVersion": "v1",
        "kind": "ConfigMap",
        "metadata": {"name": "mine-trainer", "namespace": ns},
        "data": {"trainer.yaml": "someone else's"},
    }
    cp.apply([stray])
    cp.apply(gpu_job("mine", ns))
    wait_until(
        lambda: condition(status(cp, "mine", ns), "SpecApplied").get("reason") == "ChildConflict",
        60,
        "SpecApplied reason ChildConflict",
    )
    st = status(cp, "mine", ns)
    assert st["phase"] == "Pending"
    assert "not adopted" in condition(st, "SpecApplied")["message"]
    events = cp.get("events", namespace=ns)["items"]
    assert any(e["reason"] == "ChildConflict" and e["type"] == "Warning" for e in events)
    assert cp.get("rayjob.ray.io", "mine", ns) is None
    cm = cp.get("configmap", "mine-trainer", ns)
    assert "ownerReferences" not in cm["metadata"] and cm["data"] == stray["data"]
    cp.kubectl("delete", "configmap", "mine-trainer", "-n", ns)
    # retried with backoff (1 s doubling): the job gets its own children
    children = wait_children(cp, "mine", ns, timeout=90)
    assert "trainer.yaml" in children["configmap"]["data"]
    assert children["configmap"]["data"] != stray["data"]


@pytest.mark.parametrize("made", [2, 7], ids=["first-two", "all-but-the-status"])
def test_an_operator_that_died_half_way_leaves_no_duplicate(cp, operator, ns, made):
    """The children a previous operator run made before it died (the first two in creation
    order; or all of them, the RayJob too, but not the status) are kept as they are (same uid:
    not deleted and made again, a RayJob never re-run) and the rest made; then a status."""
    from ppojob_api.validation import validate_manifest
    from ppojob_operator import builders

    operator.stop()
    try:
        cp.apply(gpu_job("half", ns))
        stored = job(cp, "half", ns)
        uid = stored["metadata"]["uid"]
        children = builders.build_children(validate_manifest(stored), namespace=ns, uid=uid)
        assert [c["kind"] for c in children][-1] == "RayJob" and len(children) == 7
        made_before = children[:made]
        cp.apply(made_before)
        kept = {}
        for c in made_before:
            resource = {
                "Role": "role.rbac.authorization.k8s.io",
                "RoleBinding": "rolebinding.rbac.authorization.k8s.io",
                "PodDisruptionBudget": "poddisruptionbudget.policy",
                "NetworkPolicy": "networkpolicy.networking.k8s.io",
                "RayJob": "rayjob.ray.io",
            }.get(c["kind"], c["kind"].lower())
            name = c["metadata"]["name"]
            kept[(resource, name)] = cp.get(resource, name, ns)["metadata"]["uid"]
    finally:
        operator.start()
    wait_children(cp, "half", ns)
    wait_until(lambda: status(cp, "half", ns).get("rayJobName") == "half", 60, "a status")
    for (resource, name), obj_uid in kept.items():
        assert cp.get(resource, name, ns)["metadata"]["uid"] == obj_uid, (resource, name)


def test_a_child_the_api_server_refuses_reaches_the_status_with_its_message(cp, operator, ns):
    """A ResourceQuota allowing no RayJob: the PPOJob says so at once (the API server's own
    message, not a silent kopf retry), and runs once the quota is gone."""
    quota = {
        "apiVersion": "v1",
        "kind": "ResourceQuota",
        "metadata": {"name": "no-rayjobs", "namespace": ns},
        "spec": {"hard": {"count/rayjobs.ray.io": "0"}},
    }
    cp.apply(quota)
    # the quota's usage, as kube-controller-manager's quota controller (not run here) would
    # write it; the API server's quota admission refuses by it
    used = {"hard": {"count/rayjobs.ray.io": "0"}, "used": {"count/rayjobs.ray.io": "0"}}
    path = f"/api/v1/namespaces/{ns}/resourcequotas/no-rayjobs"
    cp.request("PATCH", path + "/status", {"status": used}, "application/merge-patch+json")
    cp.apply(gpu_job("quota", ns))
    refused = wait_until(
        lambda: (
            (c := condition(status(cp, "quota", ns), "SpecApplied")).get("reason")
            == "ChildCreateFailed"
            and c
        ),
        30,
        "ChildCreateFailed",
    )
    assert status(cp, "quota", ns)["phase"] == "Pending"
    assert "RayJob" in refused["message"] and "exceeded quota" in refused["message"]
    assert "HTTP 403" in refused["message"]
    cp.request("DELETE", path)
    wait_until(lambda: cp.get("rayjob.ray.io", "quota", ns), 90, "the RayJob after the quota")


def test_an_eviction_of_a_pod_of_a_protected_job_is_refused(cp, operator, ns):
    """The job's PodDisruptionBudget (minAvailable: every pod of the job): a drain's eviction
    of one of its Ready pods is refused with 429 and the pod stays, one that is not Ready is
    evicted; a job without one (failurePolicy) is evictable."""
    protected = gpu_job("pdb", ns, actor=1, critic=1, rollout=1)
    # with the pod-template escape hatch: the API server admits the pods KubeRay makes of it
    protected["spec"]["podTemplate"] = {
        "annotations": {"karpenter.sh/do-not-disrupt": "true"},
        "env": [{"name": "HF_TOKEN", "valueFrom": {"secretKeyRef": {"name": "hf", "key": "t"}}}],
        "volumes": [{"name": "scratch", "emptyDir": {}}],
        "volumeMounts": [{"name": "scratch", "mountPath": "/scratch"}],
    }
    bare = gpu_job("bare", ns, actor=1, critic=1, rollout=1)
    bare["spec"]["failurePolicy"] = {"podDisruptionBudget": False}
    cp.apply([protected, bare])

    def pods_of(name: str) -> list:
        p = pods(cp, name, ns)
        return p if len(p) == 4 and all(map(running, p)) else []

    mine = wait_until(lambda: pods_of("pdb"), 90, "the protected job's 4 pods Running")
    theirs = wait_until(lambda: pods_of("bare"), 90, "the bare job's 4 pods Running")
    # the trainer's token only in the head pod (KubeRay keeps the templates' setting)
    for p in mine:
        head = p["metadata"]["labels"].get("ray.io/node-type") == "head"
        assert p["spec"].get("automountServiceAccountToken", True) is head
        assert p["spec"]["terminationGracePeriodSeconds"] == 120
        assert p["metadata"]["annotations"]["karpenter.sh/do-not-disrupt"] == "true"
        env = {e["name"]: e for e in p["spec"]["containers"][0]["env"]}
        assert env["HF_TOKEN"]["valueFrom"]["secretKeyRef"] == {"name": "hf", "key": "t"}
        assert {"name": "scratch", "emptyDir": {}} in p["spec"]["volumes"]
    pdb = cp.get("poddisruptionbudget.policy", "pdb", ns)
    assert pdb["spec"]["minAvailable"] == 4  # head, actor, critic, rollout
    assert pdb["spec"]["selector"]["matchLabels"] == {JOB_LABEL: "pdb"}
    # kept by the API server (a field it did not know would be dropped from what it stores)
    assert pdb["spec"]["unhealthyPodEvictionPolicy"] == "AlwaysAllow"
    assert cp.get("poddisruptionbudget.policy", "bare", ns) is None
    # The PDB's status, as kube-controller-manager's disruption controller computes it from the
    # 4 Ready pods: none may go. (With maxUnavailable it could not: a RayCluster has no scale
    # subresource, and the budget read SyncFailed.) The eviction API decides by it.

    def synced() -> dict | None:
        st = (cp.get("poddisruptionbudget.policy", "pdb", ns) or {}).get("status") or {}
        return st if st.get("observedGeneration") == pdb["metadata"]["generation"] else None

    status = wait_until(synced, 60, "the disruption controller's status of the budget")
    assert (status["currentHealthy"], status["desiredHealthy"], status["expectedPods"]) == (
        4,
        4,
        4,
    ), status
    assert status["disruptionsAllowed"] == 0, status
    allowed = {c["type"]: c for c in status["conditions"]}["DisruptionAllowed"]
    assert (allowed["status"], allowed["reason"]) == ("False", "InsufficientPods"), allowed

    def evict(pod: dict) -> str:
        name = pod["metadata"]["name"]
        eviction = {
            "apiVersion": "policy/v1",
            "kind": "Eviction",
            "metadata": {"name": name, "namespace": ns},
        }
        try:
            cp.request("POST", f"/api/v1/namespaces/{ns}/pods/{name}/eviction", eviction)
        except ControlPlaneError as exc:
            return str(exc)
        return "evicted"

    refused = evict(mine[0])
    assert ": 429 " in refused and "disruption budget" in refused, refused
    assert (
        cp.get("pod", mine[0]["metadata"]["name"], ns)["metadata"].get("deletionTimestamp") is None
    )
    assert evict(theirs[0]) == "evicted"
    # a Running pod of the protected job that is not Ready (crash-looping) is evictable all the
    # same (unhealthyPodEvictionPolicy AlwaysAllow): it does not hold its node's drain
    sick = mine[1]["metadata"]["name"]
    ready_false = {"status": {"conditions": [{"type": "Ready", "status": "False"}]}}
    path = f"/api/v1/namespaces/{ns}/pods/{sick}/status"
    cp.request("PATCH", path, ready_false, "application/strategic-merge-patch+json")
    assert evict(mine[1]) == "evicted"


def test_a_lost_head_pod_restarts_the_job_uncounted(cp, operator, ns):
    """The real KubeRay fails the RayJob ("Ray head pod not found."); the failure policy calls
    that a disruption: the RayJob is replaced by the next attempt's, without counting against
    backoffLimit (0 here), with the Restarted condition and a Normal event, and the new
    attempt's pods come up."""
    cp.apply(gpu_job("hp", ns, actor=1, critic=1, rollout=1))

    def four_running() -> list:
        p = pods(cp, "hp", ns)
        return p if len(p) == 4 and all(map(running, p)) else []

    before = wait_until(four_running, 90, "4 pods Running")
    # a head lost while the RayJob is still Initializing is only recreated by KubeRay's
    # RayCluster controller: the job's attempt fails only once it runs
    wait_until(lambda: rayjob_deployment(cp, "hp", ns) == "Running", 60, "the RayJob Running")
    (head,) = [p for p in before if p["metadata"]["labels"].get("ray.io/node-type") == "head"]
    cp.request("DELETE", f"/api/v1/namespaces/{ns}/pods/{head['metadata']['name']}")

    st = restarted(cp, "hp", ns)
    assert (st["disruptions"], st["restarts"]) == (1, 0)
    assert st["lastRestart"]["reason"] == "RestartingAfterDisruption"
    assert "Ray head pod not found" in st["lastRestart"]["message"]
    assert st["phase"] != "Failed"
    assert condition(st, "Restarted")["reason"] == "RestartingAfterDisruption"
    events = cp.get("event", namespace=ns)["items"]
    assert any(e["reason"] == "RestartingAfterDisruption" and e["type"] == "Normal" for e in events)
    after = wait_until(four_running, 90, "the next attempt's 4 pods Running")
    assert {p["metadata"]["uid"] for p in after}.isdisjoint(p["metadata"]["uid"] for p in before)


def test_a_failed_submitter_container_retries_the_job_counted(cp, operator, ns):
    """The head pod's ``ray-job-submitter`` container ends with exit code 1 (``ray job submit``
    could not follow the job): the real KubeRay fails the RayJob with SubmissionFailed, and the
    failure policy retries it as an application error, counted against backoffLimit (1 here),
    never as the trainer's exit code 1 (a refused config, which would fail at once)."""
    doc = gpu_job("sf", ns, actor=1, critic=1, rollout=1)
    doc["spec"]["backoffLimit"] = 1
    cp.apply(doc)

    def four_running() -> list:
        p = pods(cp, "sf", ns)
        return p if len(p) == 4 and all(map(running, p)) else []

    before = wait_until(four_running, 90, "4 pods Running")
    wait_until(lambda: rayjob_deployment(cp, "sf", ns) == "Running", 60, "the RayJob Running")
    (head,) = [p for p in before if p["metadata"]["labels"].get("ray.io/node-type") == "head"]
    statuses = head["status"]["containerStatuses"]
    assert "ray-job-submitter" in {c["name"] for c in statuses}
    # finished now: KubeRay reads a submitter that ended over 30 s ago as a grace-period timeout
    now = datetime.now(timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")
    failed = {
        "name": "ray-job-submitter",
        "state": {
            "terminated": {
                "exitCode": 1,
                "reason": "Error",
                "startedAt": now,
                "finishedAt": now,
            }
        },
    }
    patch = {"status": {"containerStatuses": [failed]}}
    cp.kubectl(
        "patch",
        "pod",
        head["metadata"]["name"],
        "-n",
        ns,
        "--subresource=status",
        "--type=strategic",
        "-p",
        json.dumps(patch),
    )

    st = restarted(cp, "sf", ns)
    assert (st["restarts"], st["disruptions"]) == (1, 0)
    last = st["lastRestart"]
    assert (last["failureClass"], last["reason"]) == ("Application", "RestartingAfterError")
    assert "SubmissionFailed" in last["message"] and "ray-job-submitter" in last["message"]
    assert st["phase"] != "Failed"
    assert condition(st, "Restarted")["reason"] == "RestartingAfterError"
    events = cp.get("event", namespace=ns)["items"]
    assert any(e["reason"] == "RestartingAfterError" for e in events)
    after = wait_until(four_running, 90, "the next attempt's 4 pods Running")
    assert {p["metadata"]["uid"] for p in after}.isdisjoint(p["metadata"]["uid"] for p in before)


def test_a_job_that_never_fits_fails_at_its_queue_timeout_with_the_schedulers_reason(
    cp, operator, ns
):
    """Worker pods asking for more GPUs than any node has stay Pending: after
    spec.scheduling.queueTimeoutSeconds the job is Failed (QueueTimeout) with kube-scheduler's
    own message, and its RayJob (with the pods holding the head's node) is deleted."""
    doc = gpu_job("nofit", ns, actor=1, critic=1, rollout=1, gpus=16)  # nodes have 8
    doc["spec"]["scheduling"]["queueTimeoutSeconds"] = 15
    cp.apply(doc)
    failed = wait_until(
        lambda: (
            (c := condition(status(cp, "nofit", ns), "Failed")).get("reason") == "QueueTimeout"
            and c
        ),
        90,
        "QueueTimeout",
    )
    assert "Insufficient nvidia.com/gpu" in failed["message"], failed["message"]
    assert "queueTimeoutSeconds" in failed["message"]
    wait_until(lambda: cp.get("rayjob.ray.io", "nofit", ns) is None, 60, "the RayJob deleted")
    assert status(cp, "nofit", ns)["phase"] == "Failed"
