"""The real kopf operator against kmock (an in-memory Kubernetes API)."""

from __future__ import annotations

from kmockenv import Operator, wait_for
from ophelpers import base_manifest
from ppojob_operator import k8s

PPO = ("ppojob.io/v1alpha1", "PPOJob")
RJ = ("ray.io/v1", "RayJob")
CHILD_KINDS = [
    ("v1", "ConfigMap", "demo-trainer"),
    ("v1", "ServiceAccount", "demo-trainer"),
    ("rbac.authorization.k8s.io/v1", "Role", "demo-trainer"),
    ("rbac.authorization.k8s.io/v1", "RoleBinding", "demo-trainer"),
    ("ray.io/v1", "RayJob", "demo"),
]


def create_job(name="demo", uid="uid-demo", **spec):
    body = base_manifest(name=name, **spec)
    body["metadata"]["uid"] = uid  # kmock assigns none
    k8s.request("POST", k8s.path_for(*PPO, "ns1"), body)


def events():
    return k8s.request("GET", k8s.path_for("v1", "Event", "ns1"))["items"]


def job_status(name="demo"):
    return (k8s.get(*PPO, "ns1", name) or {}).get("status") or {}


def phase_is(phase, name="demo"):
    return lambda: job_status(name).get("phase") == phase


def set_rayjob_status(status, name="demo"):
    k8s.patch(*RJ, "ns1", name, {"status": status}, "status")


def creates(em, plural):
    return [
        r for r in em.requests() if r.method.value == "POST" and r.url.path.endswith("/" + plural)
    ]


def test_create_makes_children_and_follows_rayjob_status(cluster):
    with Operator(cluster.url, ["ns1"]):
        create_job()
        wait_for(phase_is("Pending"))
        for api_version, kind, name in CHILD_KINDS:
            child = k8s.get(api_version, kind, "ns1", name)
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
        k8s.patch(*PPO, "ns1", "demo", {"spec": {"suspend": True}})
        wait_for(lambda: k8s.get(*RJ, "ns1", "demo")["spec"]["suspend"] is True)
        set_rayjob_status({"jobDeploymentStatus": "Suspended"})
        wait_for(phase_is("Suspended"))
        k8s.patch(*PPO, "ns1", "demo", {"spec": {"suspend": False}})
        wait_for(lambda: k8s.get(*RJ, "ns1", "demo")["spec"]["suspend"] is False)
        set_rayjob_status({"jobDeploymentStatus": "Running", "jobStatus": "RUNNING"})
        wait_for(phase_is("Running"))
        # Any other change to a started job is refused visibly: condition + Warning event.
        k8s.patch(*PPO, "ns1", "demo", {"spec": {"training": {"steps": 5}}})

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
            k8s.get("v1", "ConfigMap", "ns1", "demo-trainer")["data"]["trainer.yaml"].count(
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
        assert k8s.get(*RJ, "ns1", "bad") is None
        assert k8s.get("v1", "ConfigMap", "ns1", "bad-trainer") is None
        wait_for(
            lambda: any(e["type"] == "Warning" and e["reason"] == "InvalidSpec" for e in events())
        )
        # Fixing the spec reconciles it like a new job.
        k8s.patch(*PPO, "ns1", "bad", {"spec": {"roles": {"actor": {"replicas": 1}}}})
        wait_for(phase_is("Pending", "bad"))
        assert k8s.get(*RJ, "ns1", "bad") is not None


def test_restart_mid_way_makes_no_duplicate(cluster):
    # A previous operator run created some children and died before the RayJob and the status.
    from ppojob_operator import builders
    from ppojob_operator.api import validate_manifest

    job = validate_manifest(base_manifest())
    children = builders.build_children(job, namespace="ns1", uid="uid-demo")
    create_job()
    for child in children[:2]:
        meta = child["metadata"]
        k8s.request(
            "POST", k8s.path_for(child["apiVersion"], child["kind"], meta["namespace"]), child
        )
    with Operator(cluster.url, ["ns1"]):
        wait_for(phase_is("Pending"))
    with Operator(cluster.url, ["ns1"]):  # and once more: nothing new
        set_rayjob_status({"jobDeploymentStatus": "Running", "jobStatus": "RUNNING"})
        wait_for(phase_is("Running"))
    # Re-runs of the create handler hit 409 and adopt what exists: exactly one of each child.
    assert creates(cluster, "rayjobs")
    for api_version, kind, name in CHILD_KINDS:
        items = k8s.request("GET", k8s.path_for(api_version, kind, "ns1"))["items"]
        assert [i["metadata"]["name"] for i in items] == [name], kind


def test_trainer_progress_patch_appears_in_status(cluster):
    from kubernetes import client
    from ppojob_trainer.k8s_progress import KubernetesProgressReporter

    with Operator(cluster.url, ["ns1"]):
        create_job()
        wait_for(phase_is("Pending"))
        cfg = client.Configuration()
        cfg.host = cluster.url
        api = client.CustomObjectsApi(client.ApiClient(cfg))
        rep = KubernetesProgressReporter("demo", "ns1", api=api, min_interval=3600)
        rep.start(total_steps=10)
        rep.report(
            3,
            {
                "step": 3,
                "reward_mean": 0.5,
                "kl": 0.01,
                "value_loss": 0.2,
                "tokens_per_second": 1234.0,
            },
        )  # throttled: not written
        rep.finish({"step": 10, "reward_mean": 0.9})
        wait_for(lambda: (job_status().get("progress") or {}).get("step") == 10)
        prog = job_status()["progress"]
        assert prog["totalSteps"] == 10 and prog["rewardMean"] == 0.9 and prog["updatedAt"]
        assert rep.failures == 0
        # The operator's status sync never overwrites the trainer's progress.
        set_rayjob_status({"jobDeploymentStatus": "Running", "jobStatus": "RUNNING"})
        wait_for(phase_is("Running"))
        assert job_status()["progress"]["step"] == 10


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
        failed = next(c for c in job_status()["conditions"] if c["type"] == "Failed")
        assert (failed["reason"], failed["message"]) == ("TrainerFailed", line)
