"""The real kopf operator against kmock (an in-memory Kubernetes API).

What a real API server can show is tested on one (``tests/cluster``: children, RBAC, garbage
collection, suspend/resume through KubeRay and Kueue, progress with the job's token, restarts,
faults). These tests stay on kmock because each needs a state the real control plane cannot hold
still:
- RayJob statuses set by hand (Initializing, Running, Failed with a reason, Suspended): on a real
  cluster KubeRay owns that status and moves it only with a live Ray cluster behind the pods;
- an old job's child left in place (no garbage collector), and the moment before Kueue has made
  a Workload (real Kueue closes it in milliseconds);
- installations the built control plane does not have (an old KubeRay CRD, YuniKorn);
- an exact record of the operator's requests (which writes it made, and to what).
"""

from __future__ import annotations

import asyncio
import threading

import pytest

from ppojob_operator import k8s
from tests.helpers.kmockenv import Operator, OperatorFailed, job_pod, kube, wait_for
from tests.helpers.manifests import base_manifest

PPO = ("ppojob.io/v1alpha1", "PPOJob")
RJ = ("ray.io/v1", "RayJob")
CHILD_KINDS = [
    ("v1", "ConfigMap", "demo-trainer"),
    ("v1", "ServiceAccount", "demo-trainer"),
    ("rbac.authorization.k8s.io/v1", "Role", "demo-trainer"),
    ("rbac.authorization.k8s.io/v1", "RoleBinding", "demo-trainer"),
    ("policy/v1", "PodDisruptionBudget", "demo"),
    ("networking.k8s.io/v1", "NetworkPolicy", "demo"),
    ("ray.io/v1", "RayJob", "demo"),
]


def create_job(name="demo", uid="uid-demo", **spec):
    body = base_manifest(name=name, **spec)
    body["metadata"]["uid"] = uid  # kmock assigns none
    kube.request("POST", k8s.path_for(*PPO, "ns1"), body)


def events():
    return kube.request("GET", k8s.path_for("v1", "Event", "ns1"))["items"]


def job_status(name="demo"):
    return (kube.get(*PPO, "ns1", name) or {}).get("status") or {}


def phase_is(phase, name="demo"):
    return lambda: job_status(name).get("phase") == phase


def set_rayjob_status(status, name="demo"):
    kube.patch(*RJ, "ns1", name, {"status": status}, "status")


def start_running_job():
    """The job created and its RayJob reported Running (as KubeRay would), the run started."""
    create_job()
    wait_for(phase_is("Pending"))
    running = {"jobDeploymentStatus": "Running", "jobStatus": "RUNNING"}
    set_rayjob_status({**running, "startTime": "2026-01-01T00:00:00Z"})
    wait_for(phase_is("Running"))


def creates(em, plural):
    return [
        r for r in em.requests() if r.method.value == "POST" and r.url.path.endswith("/" + plural)
    ]


def test_the_operators_network_policy_settings_reach_the_jobs(cluster):
    """--network-policy as the operator got it: off makes no NetworkPolicy; settings of its own
    are the policy's dashboard peers."""
    from ppojob_operator.builders import NetworkPolicySettings

    peer = {"ipBlock": {"cidr": "10.0.0.0/24"}}
    with Operator(
        cluster.url, ["ns1"], network_policy=NetworkPolicySettings(dashboard_from=[peer])
    ):
        create_job()
        policy = wait_for(lambda: kube.get("networking.k8s.io/v1", "NetworkPolicy", "ns1", "demo"))
        assert policy["spec"]["ingress"][1]["from"][-1] == peer
    with Operator(cluster.url, ["ns1"], network_policy=None):
        create_job(name="other", uid="uid-other")
        wait_for(lambda: kube.get("ray.io/v1", "RayJob", "ns1", "other"))
        assert kube.get("networking.k8s.io/v1", "NetworkPolicy", "ns1", "other") is None


def test_status_the_operator_owns_is_restored_after_an_outside_edit(cluster):
    """The trainer's token may patch the job's status (for status.progress): a write of the
    operator's keys (here a forged Succeeded) is put back at once, with a Warning event; the
    trainer's own progress reports are left alone and raise no event."""
    with Operator(cluster.url, ["ns1"]):
        start_running_job()
        before = job_status()
        kube.patch(*PPO, "ns1", "demo", {"status": {"progress": {"step": 3}}}, "status")
        kube.patch(
            *PPO, "ns1", "demo", {"status": {"phase": "Succeeded", "reason": "Forged"}}, "status"
        )
        wait_for(lambda: [e for e in events() if e["reason"] == "StatusEdited"])
        wait_for(phase_is("Running"))
        after = job_status()
        assert {k: after.get(k) for k in ("phase", "reason", "conditions")} == {
            k: before.get(k) for k in ("phase", "reason", "conditions")
        }
        assert after["progress"] == {"step": 3}
        [edited] = [e for e in events() if e["reason"] == "StatusEdited"]
        assert "phase='Succeeded'" in edited["message"] and edited["type"] == "Warning"


def test_an_outside_edit_between_the_operators_read_and_write_is_restored(cluster, monkeypatch):
    """An outside write landing after the operator read the job and before its own status patch,
    on a key that patch leaves alone (here status.gpus during the Pending -> Running write), is
    put back in the same pass, with a Warning event; it is not taken for the operator's own."""
    original = k8s.apatch_job_status
    forged = []

    async def racing(namespace, name, status):
        if status.get("phase") == "Running" and not forged:
            forged.append(await original(namespace, name, {"gpus": 99}))
        return await original(namespace, name, status)

    monkeypatch.setattr(k8s, "apatch_job_status", racing)
    with Operator(cluster.url, ["ns1"]):
        start_running_job()
        assert forged and forged[0]["status"]["gpus"] == 99  # the edit did land in between
        [edited] = wait_for(lambda: [e for e in events() if e["reason"] == "StatusEdited"])
        assert "gpus=99" in edited["message"]
        assert job_status()["gpus"] == 0 and job_status()["phase"] == "Running"


def test_a_pod_the_scheduler_cannot_place_is_the_reason_the_job_waits(cluster):
    """While the Ray cluster starts, a pod of it that the scheduler cannot place (its
    PodScheduled condition False) names the wait: reason Unschedulable with the scheduler's
    message; once placed, the job is back to plain Initializing."""
    with Operator(cluster.url, ["ns1"]):
        create_job()
        wait_for(phase_is("Pending"))
        set_rayjob_status({"jobDeploymentStatus": "Initializing", "rayClusterName": "demo-abc"})
        wait_for(phase_is("Initializing"))
        said = "0/3 nodes are available: 3 Insufficient nvidia.com/gpu."
        unplaced = {"type": "PodScheduled", "status": "False", "reason": "Unschedulable"}
        pod = job_pod({"conditions": [{**unplaced, "message": said}]})
        pod["metadata"]["labels"]["ray.io/cluster"] = "demo-abc"
        kube.request("POST", "/api/v1/namespaces/ns1/pods", pod)
        wait_for(lambda: job_status().get("reason") == "Unschedulable")
        running = next(c for c in job_status()["conditions"] if c["type"] == "Running")
        assert running["reason"] == "Unschedulable"
        assert f"pod demo-head-x: {said}" in running["message"]
        placed = {"conditions": [{"type": "PodScheduled", "status": "True"}]}
        kube.patch("v1", "Pod", "ns1", "demo-head-x", {"status": placed}, "status")
        wait_for(lambda: job_status().get("reason") == "RayJobInitializing")


def test_each_attempts_wait_to_run_is_observed_once(cluster):
    """ppojob_admission_wait_seconds: from the attempt's RayJob creation to a running trainer,
    observed once when the job turns Running (not again on later events of a running job)."""
    import datetime as dt

    from prometheus_client import REGISTRY

    def sample(suffix):
        labels = {"scheduler": "none"}
        return REGISTRY.get_sample_value(f"ppojob_admission_wait_seconds_{suffix}", labels) or 0

    count, total = sample("count"), sample("sum")
    with Operator(cluster.url, ["ns1"]):
        create_job()
        wait_for(phase_is("Pending"))
        made = dt.datetime.now(dt.timezone.utc) - dt.timedelta(seconds=40)
        stamp = made.strftime("%Y-%m-%dT%H:%M:%SZ")
        kube.patch(*RJ, "ns1", "demo", {"metadata": {"creationTimestamp": stamp}})
        set_rayjob_status({"jobDeploymentStatus": "Initializing"})
        wait_for(phase_is("Initializing"))
        set_rayjob_status({"jobDeploymentStatus": "Running", "jobStatus": "RUNNING"})
        wait_for(phase_is("Running"))
        wait_for(lambda: sample("count") == count + 1)
        assert 40 <= sample("sum") - total < 70
        kube.patch(*PPO, "ns1", "demo", {"status": {"progress": {"step": 1}}}, "status")
        set_rayjob_status({"jobDeploymentStatus": "Running", "message": "still"})
        wait_for(lambda: kube.get(*RJ, "ns1", "demo")["status"].get("message") == "still")
    assert sample("count") == count + 1


def test_create_makes_children_and_follows_rayjob_status(cluster):
    with Operator(cluster.url, ["ns1"]):
        create_job()
        wait_for(phase_is("Pending"))
        for api_version, kind, name in CHILD_KINDS:
            child = kube.get(api_version, kind, "ns1", name)
            assert child is not None, kind
            assert child["metadata"]["ownerReferences"][0]["uid"] == "uid-demo"
        st = job_status()
        assert st["rayJobName"] == "demo" and st["gpus"] == 0
        set_rayjob_status({"jobDeploymentStatus": "Initializing"})
        wait_for(phase_is("Initializing"))
        set_rayjob_status(
            {
                "jobDeploymentStatus": "Running",
                "jobStatus": "RUNNING",
                "dashboardURL": "demo-head-svc:8265",
                "startTime": "2026-01-01T00:00:00Z",
            }
        )
        wait_for(phase_is("Running"))
        assert job_status()["dashboardURL"] == "demo-head-svc:8265"
        set_rayjob_status(
            {
                "jobDeploymentStatus": "Failed",
                "jobStatus": "FAILED",
                "reason": "DeadlineExceeded",
                "message": "past the deadline",
                "endTime": "2026-01-01T01:00:00Z",
            }
        )
        wait_for(phase_is("Failed"))
        st = job_status()
        failed = next(c for c in st["conditions"] if c["type"] == "Failed")
        assert (failed["status"], failed["reason"], failed["message"]) == (
            "True",
            "DeadlineExceeded",
            "past the deadline",
        )
        assert st["completionTime"] == "2026-01-01T01:00:00Z"


def test_suspend_and_resume(cluster):
    with Operator(cluster.url, ["ns1"]):
        create_job()
        wait_for(phase_is("Pending"))
        kube.patch(*PPO, "ns1", "demo", {"spec": {"suspend": True}})
        wait_for(lambda: kube.get(*RJ, "ns1", "demo")["spec"]["suspend"] is True)
        set_rayjob_status({"jobDeploymentStatus": "Suspended"})
        wait_for(phase_is("Suspended"))
        kube.patch(*PPO, "ns1", "demo", {"spec": {"suspend": False}})
        wait_for(lambda: kube.get(*RJ, "ns1", "demo")["spec"]["suspend"] is False)
        set_rayjob_status({"jobDeploymentStatus": "Running", "jobStatus": "RUNNING"})
        wait_for(phase_is("Running"))
        # Any other change to a started job is refused visibly: condition + Warning event.
        kube.patch(*PPO, "ns1", "demo", {"spec": {"training": {"steps": 5}}})

        def refused():
            conds = {c["type"]: c for c in job_status().get("conditions", [])}
            return conds.get("SpecApplied", {}).get("reason") == "SpecChangeRefused"

        wait_for(refused)
        wait_for(
            lambda: any(
                e["reason"] == "SpecChangeRefused" and "spec.training.steps" in e["message"]
                for e in events()
            )
        )
        assert (
            kube.get("v1", "ConfigMap", "ns1", "demo-trainer")["data"]["trainer.yaml"].count(
                "steps: 100"
            )
            == 1
        )


def test_invalid_spec_gets_no_children(cluster):
    with Operator(cluster.url, ["ns1"]):
        create_job(name="bad", uid="uid-bad", roles={"actor": {"replicas": 0}})
        wait_for(phase_is("Invalid", "bad"))
        cond = job_status("bad")["conditions"][0]
        assert cond["type"] == "Valid" and cond["status"] == "False"
        assert "spec.roles.actor.replicas" in cond["message"]
        assert kube.get(*RJ, "ns1", "bad") is None
        assert kube.get("v1", "ConfigMap", "ns1", "bad-trainer") is None
        wait_for(
            lambda: any(e["type"] == "Warning" and e["reason"] == "InvalidSpec" for e in events())
        )
        # Fixing the spec reconciles it like a new job.
        kube.patch(*PPO, "ns1", "bad", {"spec": {"roles": {"actor": {"replicas": 1}}}})
        wait_for(phase_is("Pending", "bad"))
        assert kube.get(*RJ, "ns1", "bad") is not None


def test_a_trainer_failure_reaches_the_failed_condition(cluster):
    """The trainer's one-line failure (its progress reporter) is what `kubectl describe` shows."""
    from kubernetes import client

    from ppojob_trainer.k8s_progress import KubernetesProgressReporter

    line = "the rollout worker could not start: data.rewardFunction: 'nope:f': cannot import"
    with Operator(cluster.url, ["ns1"]):
        create_job()
        wait_for(phase_is("Pending"))
        cfg = client.Configuration()
        cfg.host = cluster.url
        api = client.CustomObjectsApi(client.ApiClient(cfg))
        KubernetesProgressReporter("demo", "ns1", api=api).fail(line)
        set_rayjob_status(
            {"jobDeploymentStatus": "Failed", "jobStatus": "FAILED", "reason": "AppFailed"}
        )
        wait_for(phase_is("Failed"))
        # The RayJob's event and the trainer's status patch may reach the operator in either
        # order: the condition converges to the trainer's line once both have.
        wait_for(lambda: cond("Failed").get("reason") == "TrainerFailed")
        failed = cond("Failed")
        assert (failed["reason"], failed["message"]) == ("TrainerFailed", line)


# ---------------------------------------------------------------------------------------------
# Issue 10: self-healing, recreate races, Kueue, invalid edits, installation refusals
# ---------------------------------------------------------------------------------------------
def cond(type_, name="demo"):
    return next((c for c in job_status(name).get("conditions", []) if c["type"] == type_), {})


def delete(api_version, kind, name, ns="ns1"):
    kube.request("DELETE", k8s.path_for(api_version, kind, ns, name))


def test_children_deleted_by_hand_are_recreated_until_the_run_starts(cluster):
    """Item 5: ConfigMap/ServiceAccount/Role/RoleBinding/RayJob come back; a RayJob deleted after
    its run started turns the job Failed (RayJobDeleted) and is not re-run."""
    with Operator(cluster.url, ["ns1"]):
        create_job()
        wait_for(phase_is("Pending"))
        for api_version, kind, name in CHILD_KINDS:
            delete(api_version, kind, name)
            wait_for(lambda a=api_version, k=kind, n=name: kube.get(a, k, "ns1", n), timeout=20)
            owner = kube.get(api_version, kind, "ns1", name)["metadata"]["ownerReferences"][0]
            assert owner["uid"] == "uid-demo", kind
        # a refused edit does not reach a recreated child: it is rebuilt from the applied spec
        kube.patch(*PPO, "ns1", "demo", {"spec": {"training": {"steps": 5}}})
        wait_for(lambda: cond("SpecApplied").get("reason") == "SpecChangeRefused")
        delete("v1", "ConfigMap", "demo-trainer")
        wait_for(lambda: kube.get("v1", "ConfigMap", "ns1", "demo-trainer"), timeout=20)
        text = kube.get("v1", "ConfigMap", "ns1", "demo-trainer")["data"]["trainer.yaml"]
        assert "steps: 100" in text and "steps: 5\n" not in text
        set_rayjob_status(
            {
                "jobDeploymentStatus": "Running",
                "jobStatus": "RUNNING",
                "startTime": "2026-01-01T00:00:00Z",
            }
        )
        wait_for(lambda: job_status().get("startTime"))
        n_created = len(creates(cluster, "rayjobs"))
        delete(*RJ, "demo")
        wait_for(phase_is("Failed"), timeout=20)
        failed = cond("Failed")
        assert failed["reason"] == "RayJobDeleted" and "recreate the PPOJob" in failed["message"]
        assert job_status()["rayJobName"] == "demo"  # the names stay for the record
        assert kube.get(*RJ, "ns1", "demo") is None
        assert len(creates(cluster, "rayjobs")) == n_created


def _stale_config_map(owner_uid):
    cm = {
        "apiVersion": "v1",
        "kind": "ConfigMap",
        "metadata": {"name": "demo-trainer", "namespace": "ns1", "labels": {}},
        "data": {"trainer.yaml": "old"},
    }
    if owner_uid:
        cm["metadata"]["ownerReferences"] = [
            {
                "apiVersion": "ppojob.io/v1alpha1",
                "kind": "PPOJob",
                "name": "demo",
                "uid": owner_uid,
                "controller": True,
                "blockOwnerDeletion": True,
            }
        ]
    kube.request("POST", k8s.path_for("v1", "ConfigMap", "ns1"), cm)


def test_recreated_job_waits_for_the_old_jobs_children_with_backoff(cluster):
    """Item 6: a name held by an earlier PPOJob's child (not yet garbage-collected) makes the new
    job wait and retry, with its status saying so, instead of a permanent error."""
    _stale_config_map("uid-old")
    with Operator(cluster.url, ["ns1"], retry_max_s=1.0):
        create_job()
        wait_for(lambda: cond("SpecApplied").get("reason") == "WaitingForOldChildren")
        assert job_status()["phase"] == "Pending"
        assert "garbage collector" in cond("SpecApplied")["message"]
        assert kube.get(*RJ, "ns1", "demo") is None
        delete("v1", "ConfigMap", "demo-trainer")  # the garbage collector gets there
        wait_for(lambda: kube.get(*RJ, "ns1", "demo"), timeout=20)
        wait_for(lambda: cond("SpecApplied").get("reason") == "SpecApplied")
        cm = kube.get("v1", "ConfigMap", "ns1", "demo-trainer")
        assert cm["metadata"]["ownerReferences"][0]["uid"] == "uid-demo"
        assert cm["data"]["trainer.yaml"] != "old"


# Kueue before v0.15 serves only v1beta1: kmock serves no v1beta2, so these tests also cover the
# operator's fallback to v1beta1 (tests/cluster/test_kueue.py runs Kueue v0.19, v1beta2).
WL = ("kueue.x-k8s.io/v1beta1", "Workload")
KUEUE = {"gangScheduler": "kueue", "queue": "lq"}


def _kueue_makes_workload(name="demo"):
    wl = {
        "apiVersion": "kueue.x-k8s.io/v1beta1",
        "kind": "Workload",
        "metadata": {
            "name": f"rayjob-{name}-abc12",
            "namespace": "ns1",
            "ownerReferences": [
                {"apiVersion": "ray.io/v1", "kind": "RayJob", "name": name, "controller": True}
            ],
        },
        "spec": {"queueName": "lq", "active": True},
    }
    kube.request("POST", k8s.path_for(*WL, "ns1"), wl)
    return wl["metadata"]["name"]


def test_kueue_suspend_and_resume_go_through_the_workload(cluster):
    """Item 4: Kueue owns RayJob.spec.suspend; the operator suspends and resumes through the
    Workload's spec.active, and no spec edit ever unsuspends a job Kueue is holding.

    The real flow runs in tests/cluster/test_kueue.py. This one stays because kmock has no Kueue
    behind it: every write to RayJob.spec.suspend here is the test's, so it shows that the
    operator itself only ever writes Workload.spec.active (with the real Kueue, Kueue's own
    writes of RayJob.spec.suspend would hide a stray one of ours)."""
    with Operator(cluster.url, ["ns1"]):
        create_job(scheduling=KUEUE)
        wait_for(lambda: kube.get(*RJ, "ns1", "demo"))
        assert kube.get(*RJ, "ns1", "demo")["spec"]["suspend"] is True
        wl = _kueue_makes_workload()
        wait_for(lambda: cond("Running").get("reason") == "WaitingForAdmission")
        # a refused edit while Kueue holds the job leaves it held
        kube.patch(*PPO, "ns1", "demo", {"spec": {"training": {"steps": 5}}})
        wait_for(lambda: cond("SpecApplied").get("reason") == "SpecChangeRefused")
        assert kube.get(*RJ, "ns1", "demo")["spec"]["suspend"] is True
        kube.patch(*PPO, "ns1", "demo", {"spec": {"training": {"steps": 100}}})
        wait_for(lambda: cond("SpecApplied").get("reason") == "SpecApplied")
        assert kube.get(*RJ, "ns1", "demo")["spec"]["suspend"] is True
        # Kueue admits: it unsuspends the RayJob
        kube.patch(*RJ, "ns1", "demo", {"spec": {"suspend": False}})
        set_rayjob_status({"jobDeploymentStatus": "Running", "jobStatus": "RUNNING"})
        wait_for(phase_is("Running"))
        # the user suspends: the Workload is deactivated, RayJob.spec.suspend is Kueue's
        kube.patch(*PPO, "ns1", "demo", {"spec": {"suspend": True}})
        wait_for(lambda: kube.get(*WL, "ns1", wl)["spec"]["active"] is False)
        assert kube.get(*RJ, "ns1", "demo")["spec"]["suspend"] is False
        # Kueue evicts: suspends the RayJob; the job shows Suspended
        kube.patch(*RJ, "ns1", "demo", {"spec": {"suspend": True}})
        set_rayjob_status({"jobDeploymentStatus": "Suspended"})
        wait_for(phase_is("Suspended"))
        kube.patch(*PPO, "ns1", "demo", {"spec": {"suspend": False}})
        wait_for(lambda: kube.get(*WL, "ns1", wl)["spec"]["active"] is True)
        assert kube.get(*RJ, "ns1", "demo")["spec"]["suspend"] is True  # Kueue readmits it
        wait_for(lambda: job_status().get("phase") == "Pending")  # waiting for admission


def test_a_kueue_preemption_shows_as_such_and_readmission_runs_again(cluster):
    """Kueue preempts a running job (evicts its Workload by Preempted, suspends the RayJob):
    the job shows Pending, reason KueuePreempted, with Kueue's message; re-admitted it runs."""
    with Operator(cluster.url, ["ns1"]):
        create_job(scheduling=KUEUE)
        wait_for(lambda: kube.get(*RJ, "ns1", "demo"))
        wl = _kueue_makes_workload()
        kube.patch(*RJ, "ns1", "demo", {"spec": {"suspend": False}})
        set_rayjob_status({"jobDeploymentStatus": "Running", "jobStatus": "RUNNING"})
        wait_for(phase_is("Running"))
        evicted = {
            "type": "Evicted",
            "status": "True",
            "reason": "Preempted",
            "message": "Preempted to accommodate a workload (UID: u2, JobUID: j2) due to "
            "prioritization in the ClusterQueue",
            "lastTransitionTime": "2026-01-01T00:00:00Z",
        }
        kube.patch(*WL, "ns1", wl, {"status": {"conditions": [evicted]}}, "status")
        kube.patch(*RJ, "ns1", "demo", {"spec": {"suspend": True}})
        set_rayjob_status({"jobDeploymentStatus": "Suspended"})
        wait_for(lambda: job_status().get("reason") == "KueuePreempted")
        assert job_status()["phase"] == "Pending"
        assert "prioritization in the ClusterQueue" in cond("Running")["message"]
        readmitted = {**evicted, "status": "False", "reason": "QuotaReserved"}
        kube.patch(*WL, "ns1", wl, {"status": {"conditions": [readmitted]}}, "status")
        kube.patch(*RJ, "ns1", "demo", {"spec": {"suspend": False}})
        set_rayjob_status({"jobDeploymentStatus": "Running", "jobStatus": "RUNNING"})
        wait_for(phase_is("Running"))


def test_invalid_edit_of_a_running_job_keeps_its_status(cluster):
    """Item 10."""
    with Operator(cluster.url, ["ns1"]):
        create_job()
        wait_for(phase_is("Pending"))
        set_rayjob_status(
            {
                "jobDeploymentStatus": "Running",
                "jobStatus": "RUNNING",
                "dashboardURL": "demo-head-svc:8265",
                "startTime": "2026-01-01T00:00:00Z",
            }
        )
        wait_for(phase_is("Running"))
        before = job_status()
        kube.patch(*PPO, "ns1", "demo", {"spec": {"roles": {"actor": {"replicas": 0}}}})
        wait_for(lambda: cond("SpecApplied").get("reason") == "InvalidSpec")
        after = job_status()
        for key in ("phase", "rayJobName", "dashboardURL", "gpus", "startTime"):
            assert after[key] == before[key], key
        assert "spec.roles.actor.replicas" in cond("SpecApplied")["message"]
        assert cond("Valid")["status"] == "True" and cond("Running")["status"] == "True"


def test_a_gang_scheduler_that_is_not_installed_is_reported_not_waited_for(cluster):
    """Kueue's CRD gone (not installed): a Kueue job fails at once with the reason and makes no
    RayJob; once the CRD is there, the next job runs."""
    crds = "/apis/apiextensions.k8s.io/v1/customresourcedefinitions"
    wl_crd = kube.request("GET", f"{crds}/workloads.kueue.x-k8s.io")
    kube.request("DELETE", f"{crds}/workloads.kueue.x-k8s.io")
    with Operator(cluster.url, ["ns1"]):
        create_job(scheduling=KUEUE)
        wait_for(phase_is("Failed"))
        failed = next(c for c in job_status()["conditions"] if c["type"] == "Failed")
        assert failed["reason"] == "SchedulerNotInstalled"
        assert "workloads.kueue.x-k8s.io" in failed["message"] and "kueue" in failed["message"]
        assert kube.get(*RJ, "ns1", "demo") is None
        wl_crd["metadata"].pop("resourceVersion", None)
        kube.request("POST", crds, wl_crd)
        create_job(name="later", uid="uid-later", scheduling=KUEUE)
        wait_for(lambda: kube.get(*RJ, "ns1", "later"))
        # found once, remembered: the next job reads no CRD
        create_job(name="third", uid="uid-third", scheduling=KUEUE)
        wait_for(lambda: kube.get(*RJ, "ns1", "third"))
        reads = [
            r
            for r in cluster.requests()
            if r.method.value == "GET" and r.url.path == f"{crds}/workloads.kueue.x-k8s.io"
        ]
        assert len(reads) == 3, reads  # the test's own, the missing one, the one found


def test_jobs_this_installation_cannot_run_are_refused_clearly(cluster):
    """Items 3 and 7: KubeRay too old for SidecarMode; a gang scheduler KubeRay's batchScheduler
    defeats. No children; Failed with the reason; fixing the spec starts the job."""
    with Operator(cluster.url, ["ns1"], kuberay_batch_scheduler="", sidecar_supported=False):
        create_job(name="old", uid="uid-old")
        wait_for(phase_is("Failed", "old"))
        assert cond("Failed", "old")["reason"] == "KubeRayTooOld"
        assert "1.5.0" in cond("Failed", "old")["message"]
        create_job(name="vol", uid="uid-vol", scheduling={"gangScheduler": "volcano"})
        wait_for(phase_is("Failed", "vol"))
        assert cond("Failed", "vol")["reason"] == "BatchSchedulerMismatch"
        assert kube.get(*RJ, "ns1", "old") is None and kube.get(*RJ, "ns1", "vol") is None
        assert kube.get("v1", "ConfigMap", "ns1", "old-trainer") is None
        kube.patch(*PPO, "ns1", "old", {"spec": {"submissionMode": "K8sJobMode"}})
        wait_for(phase_is("Pending", "old"))
        assert kube.get(*RJ, "ns1", "old")["spec"]["submissionMode"] == "K8sJobMode"


def test_operator_reads_kuberay_version_from_the_rayjob_crd_at_start(cluster):
    """Item 3: with a pre-1.5 RayJob CRD installed, a SidecarMode job is refused (never a job
    that silently never starts); K8sJobMode still runs."""
    from tests.helpers.ophelpers import RAYJOB_CRD, pre_1_5

    crd = pre_1_5(RAYJOB_CRD)
    crd["metadata"] = {"name": "rayjobs.ray.io"}
    crd.pop("status", None)
    kube.request(
        "POST", k8s.path_for("apiextensions.k8s.io/v1", "CustomResourceDefinition", None), crd
    )
    with Operator(cluster.url, ["ns1"]):
        create_job(name="side", uid="uid-side")
        create_job(name="k8sjob", uid="uid-k8sjob", submissionMode="K8sJobMode")
        wait_for(phase_is("Failed", "side"))
        assert cond("Failed", "side")["reason"] == "KubeRayTooOld"
        wait_for(phase_is("Pending", "k8sjob"))
        assert kube.get(*RJ, "ns1", "side") is None


def test_yunikorn_gets_a_fresh_application_per_attempt(cluster):
    """Item 9: KubeRay copies the RayJob's labels to every new RayCluster; the operator changes
    the app id while KubeRay retries (Retrying lasts until the old pods are gone) and on resume."""
    app = "yunikorn.apache.org/app-id"

    def app_id():
        return kube.get(*RJ, "ns1", "demo")["metadata"]["labels"][app]

    with Operator(cluster.url, ["ns1"]):
        create_job(scheduling={"gangScheduler": "yunikorn"})
        wait_for(lambda: kube.get(*RJ, "ns1", "demo"))
        first = app_id()
        set_rayjob_status({"jobDeploymentStatus": "Retrying", "failed": 1})
        wait_for(lambda: app_id() != first)
        second = app_id()
        set_rayjob_status({"jobDeploymentStatus": "Running", "jobStatus": "RUNNING", "failed": 1})
        wait_for(phase_is("Running"))
        assert app_id() == second
        kube.patch(*PPO, "ns1", "demo", {"spec": {"suspend": True}})
        wait_for(lambda: kube.get(*RJ, "ns1", "demo")["spec"]["suspend"] is True)
        assert app_id() == second
        kube.patch(*PPO, "ns1", "demo", {"spec": {"suspend": False}})
        wait_for(lambda: kube.get(*RJ, "ns1", "demo")["spec"]["suspend"] is False)
        assert app_id() not in (first, second)
        assert len(app_id()) <= 63


def test_kueue_suspend_before_the_workload_exists_is_retried(cluster):
    """Item 4: a suspend that arrives before Kueue made the Workload is applied once it exists
    (retried with backoff), never by writing RayJob.spec.suspend.

    Stays on kmock: the real Kueue makes the Workload within milliseconds of the RayJob, so a
    real control plane cannot hold the window open; here the test makes the Workload late."""
    with Operator(cluster.url, ["ns1"], retry_max_s=0.5):
        create_job(scheduling=KUEUE)
        wait_for(lambda: kube.get(*RJ, "ns1", "demo"))
        wait_for(lambda: job_status().get("rayJobName"))
        kube.patch(*PPO, "ns1", "demo", {"spec": {"suspend": True}})
        # the operator looked for the Workload and found none
        wait_for(
            lambda: any(
                r.method.value == "GET" and r.url.path.endswith("/workloads")
                for r in cluster.requests()
            )
        )
        wl = _kueue_makes_workload()
        wait_for(lambda: kube.get(*WL, "ns1", wl)["spec"]["active"] is False, timeout=20)
        assert kube.get(*RJ, "ns1", "demo")["spec"]["suspend"] is True  # as created, Kueue's


def test_a_rayjob_deleted_during_a_heal_pass_is_not_run_again(cluster, monkeypatch):
    """A heal pass (here: for a deleted ConfigMap) of a job whose run has started, and the
    RayJob deleted by hand just before that pass reads it: the pass must not post the RayJob
    again (a re-run); the job turns Failed/RayJobDeleted. kmock: the deletion is injected at
    that exact point of the pass (the operator runs in this process), which no real server
    timing gives reliably."""
    real_aget = k8s.aget
    armed = {"on": False}

    async def aget_deleting_first(api_version, kind, namespace, name):
        if armed["on"] and kind == "RayJob":
            armed["on"] = False
            await k8s.arequest("DELETE", k8s.path_for(api_version, kind, namespace, name))
        return await real_aget(api_version, kind, namespace, name)

    with Operator(cluster.url, ["ns1"]):
        start_running_job()
        n_created = len(creates(cluster, "rayjobs"))
        monkeypatch.setattr(k8s, "aget", aget_deleting_first)
        armed["on"] = True
        delete("v1", "ConfigMap", "demo-trainer")
        wait_for(phase_is("Failed"), timeout=20)
        assert cond("Failed")["reason"] == "RayJobDeleted"
        assert not armed["on"]  # the pass did read the RayJob after the deletion
        assert kube.get(*RJ, "ns1", "demo") is None
        assert len(creates(cluster, "rayjobs")) == n_created


def _collect_old_children(old_uid):
    """kmock has no garbage collector: the test removes what the old PPOJob owned."""
    for api_version, kind, name in CHILD_KINDS:
        obj = kube.get(api_version, kind, "ns1", name)
        refs = (obj or {}).get("metadata", {}).get("ownerReferences") or [{}]
        if refs[0].get("uid") == old_uid:
            delete(api_version, kind, name)


def test_a_job_recreated_under_a_finished_ones_name_runs_again(cluster):
    """Delete a finished PPOJob and create it again (what RayJobDeleted tells users to do):
    until the old RayJob is collected the new job waits (never takes the old RayJob or its
    verdict over), then gets a RayJob of its own. kmock: the collector's timing is the test's."""
    with Operator(cluster.url, ["ns1"], retry_max_s=1.0):
        create_job(uid="uid-old")
        wait_for(phase_is("Pending"))
        set_rayjob_status(
            {
                "jobDeploymentStatus": "Complete",
                "jobStatus": "SUCCEEDED",
                "startTime": "2026-01-01T00:00:00Z",
                "endTime": "2026-01-01T01:00:00Z",
            }
        )
        wait_for(phase_is("Succeeded"))
        delete(*PPO, "demo")
        create_job(uid="uid-new")
        wait_for(lambda: cond("SpecApplied").get("reason") == "WaitingForOldChildren")
        assert job_status()["phase"] == "Pending"
        _collect_old_children("uid-old")

        def new_rayjob():
            rj = kube.get(*RJ, "ns1", "demo")
            return rj and rj["metadata"]["ownerReferences"][0]["uid"] == "uid-new"

        wait_for(new_rayjob)
        wait_for(lambda: cond("SpecApplied").get("reason") == "SpecApplied")
        assert job_status()["phase"] == "Pending"


def test_a_pass_that_read_the_rayjob_before_its_deletion_writes_no_status(cluster, monkeypatch):
    """A heal pass reads the RayJob, which is deleted right after; the deletion's own pass
    writes Failed/RayJobDeleted first. The first pass must not then write a status from its
    copy of the dead RayJob (the phase would flap Failed -> Running -> Failed)."""
    from ppojob_operator import reconcile

    real_aget, real_cog = k8s.aget, k8s.acreate_or_get
    real_patch, real_reconcile = k8s.apatch_job_status, reconcile.reconcile_children
    gate = {"armed": False, "hold": False}
    phases: list = []
    finished = []

    async def aget_then_delete(api_version, kind, namespace, name):
        obj = await real_aget(api_version, kind, namespace, name)
        if gate["armed"] and kind == "RayJob" and obj is not None:
            gate["armed"], gate["hold"] = False, True
            await k8s.arequest("DELETE", k8s.path_for(api_version, kind, namespace, name))
        return obj

    async def create_after_the_verdict(obj, **kw):
        if gate["hold"]:  # the reading pass waits until the deletion's pass wrote Failed
            gate["hold"] = False
            for _ in range(400):
                job = await real_aget(*PPO, "ns1", "demo")
                if ((job or {}).get("status") or {}).get("phase") == "Failed":
                    break
                await asyncio.sleep(0.05)
        return await real_cog(obj, **kw)

    async def recording_patch(namespace, name, patch):
        phases.append((patch or {}).get("phase"))
        return await real_patch(namespace, name, patch)

    async def counted_reconcile(state, body):
        try:
            return await real_reconcile(state, body)
        finally:
            finished.append(1)

    with Operator(cluster.url, ["ns1"]):
        start_running_job()
        monkeypatch.setattr(k8s, "aget", aget_then_delete)
        monkeypatch.setattr(k8s, "acreate_or_get", create_after_the_verdict)
        monkeypatch.setattr(k8s, "apatch_job_status", recording_patch)
        monkeypatch.setattr(reconcile, "reconcile_children", counted_reconcile)
        gate["armed"] = True
        delete("v1", "ConfigMap", "demo-trainer")
        wait_for(lambda: len(finished) >= 2, timeout=20)  # the reading pass and the deletion's
        assert job_status()["phase"] == "Failed"
        assert "Failed" in phases and "Running" not in phases[phases.index("Failed") :], phases
        assert kube.get(*RJ, "ns1", "demo") is None


# ---------------------------------------------------------------------------------------------
# The harness: an exception in the operator's thread fails the test
# ---------------------------------------------------------------------------------------------
def test_an_operator_failing_at_shutdown_fails_the_test(cluster, monkeypatch):
    async def boom() -> None:
        raise RuntimeError("boom at shutdown")

    monkeypatch.setattr(k8s, "aclose", boom)  # the operator's last call (kube's is its own)
    with pytest.raises(OperatorFailed) as failed:
        with Operator(cluster.url, ["ns1"]):
            create_job()
            wait_for(phase_is("Pending"))
    assert "boom at shutdown" in str(failed.value.__cause__)


def test_an_operator_failing_at_start_fails_the_test_at_once(cluster, monkeypatch):
    from ppojob_operator import handlers

    def broken(*_, **__):
        raise RuntimeError("no registry")

    monkeypatch.setattr(handlers, "build_registry", broken)
    with pytest.raises(OperatorFailed) as failed:  # not the 30 s readiness TimeoutError
        Operator(cluster.url, ["ns1"]).__enter__()
    assert "no registry" in str(failed.value.__cause__)


def test_an_operator_dying_while_a_test_waits_fails_the_wait(cluster, monkeypatch):
    import kopf

    crash = threading.Event()

    async def dies_when_told(*, ready_flag, **_):
        ready_flag.set()
        await asyncio.get_running_loop().run_in_executor(None, crash.wait)
        raise RuntimeError("the operator died")

    monkeypatch.setattr(kopf, "operator", dies_when_told)
    try:
        with pytest.raises(OperatorFailed):  # and again when the operator is left
            with Operator(cluster.url, ["ns1"]):
                crash.set()
                with pytest.raises(OperatorFailed) as failed:  # not wait_for's TimeoutError
                    wait_for(lambda: False, timeout=20)
                assert "the operator died" in str(failed.value.__cause__)
    finally:
        crash.set()  # never leave the executor thread waiting


def test_an_unowned_object_holding_a_childs_name_is_never_adopted(cluster):
    """A ConfigMap with the job's child's name and no owner (someone else's): the job waits in
    Pending/ChildConflict with a Warning event, retrying, and never takes the object over."""
    _stale_config_map(None)
    path = k8s.path_for("v1", "ConfigMap", "ns1", "demo-trainer")
    with Operator(cluster.url, ["ns1"], retry_max_s=0.5):
        create_job()
        wait_for(lambda: cond("SpecApplied").get("reason") == "ChildConflict")
        assert job_status()["phase"] == "Pending"
        assert "not adopted" in cond("SpecApplied")["message"]
        wait_for(
            lambda: any(
                e["type"] == "Warning"
                and e["reason"] == "ChildConflict"
                and "demo-trainer" in e["message"]
                for e in events()
            )
        )
        wait_for(lambda: len(creates(cluster, "configmaps")) >= 4)  # ours, then 3 tries
        cm = kube.get("v1", "ConfigMap", "ns1", "demo-trainer")
        assert "ownerReferences" not in cm["metadata"] and cm["data"]["trainer.yaml"] == "old"
        writes = [
            r
            for r in cluster.requests()
            if r.method.value in ("PATCH", "PUT", "DELETE") and r.url.path == path
        ]
        assert writes == []
        assert kube.get(*RJ, "ns1", "demo") is None
        assert cond("SpecApplied").get("reason") == "ChildConflict"


def test_a_pod_that_cannot_get_its_image_fails_the_job_and_suspends_its_rayjob(cluster):
    """KubeRay keeps such a RayJob Initializing for ever; the operator reads the kubelet's
    waiting reason from the pod, fails the job naming the image, and suspends the RayJob so
    KubeRay removes its pods. (On real pods: tests/realnode, an image that does not exist.)"""
    with Operator(cluster.url, ["ns1"]):
        create_job()
        wait_for(lambda: kube.get(*RJ, "ns1", "demo"))
        wait_for(phase_is("Pending"))
        waiting = {"reason": "ErrImageNeverPull", "message": "image is not present"}
        status = {
            "containerStatuses": [
                {"name": "ray-head", "image": "reg/trainer:bad", "state": {"waiting": waiting}}
            ]
        }
        pod = job_pod(status, image="reg/trainer:bad", container="ray-head")
        kube.request("POST", "/api/v1/namespaces/ns1/pods", pod)
        wait_for(phase_is("Failed"), timeout=20)
        failed = cond("Failed")
        assert failed["reason"] == "ImageUnavailable"
        assert "reg/trainer:bad" in failed["message"] and "ErrImageNeverPull" in failed["message"]
        wait_for(lambda: kube.get(*RJ, "ns1", "demo")["spec"].get("suspend") is True, timeout=20)
        # the RayJob's later statuses do not turn the verdict back
        set_rayjob_status({"jobDeploymentStatus": "Suspended"})
        kube.patch(*PPO, "ns1", "demo", {"metadata": {"labels": {"touch": "1"}}})
        wait_for(lambda: kube.get(*PPO, "ns1", "demo")["metadata"]["labels"].get("touch"))
        assert job_status()["phase"] == "Failed"
        assert any(e["reason"] == "ImageUnavailable" for e in events())
