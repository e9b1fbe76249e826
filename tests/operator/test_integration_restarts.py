"""The real kopf operator against kmock: the failure policy applied. A preempted attempt is
restarted (its RayJob deleted, the next attempt's created) without counting against
backoffLimit, with a Normal event and the Restarted condition; an application error after it,
with backoffLimit 0, fails the job with BackoffLimitExceeded and leaves the RayJob in place."""

from __future__ import annotations

from datetime import datetime, timezone

from tests.helpers.kmockenv import Operator, job_pod, kube, wait_for
from tests.operator.test_integration import (
    PPO,
    RJ,
    cond,
    create_job,
    events,
    job_status,
    phase_is,
    set_rayjob_status,
)

RUNNING = {"jobDeploymentStatus": "Running", "jobStatus": "RUNNING"}
PREEMPTED = "Preempted: SIGTERM: finished the step in flight; 3 completed steps are in /ckpt"


def attempt():
    rj = kube.get(*RJ, "ns1", "demo") or {}
    return (rj.get("metadata", {}).get("annotations") or {}).get("ppojob.io/attempt", "0")


def is_event(e, type_, reason, text):
    return e["type"] == type_ and e["reason"] == reason and text in e["message"]


def trainer_error(line, step=3):
    progress = {"step": step, "totalSteps": 10, "error": line}
    kube.patch(*PPO, "ns1", "demo", {"status": {"progress": progress}}, "status")


def test_a_preemption_restarts_uncounted_and_a_later_error_fails(cluster):
    with Operator(cluster.url, ["ns1"]):
        create_job()  # backoffLimit 0
        wait_for(phase_is("Pending"))
        set_rayjob_status({**RUNNING, "startTime": "2026-01-01T00:00:00Z"})
        wait_for(phase_is("Running"))
        # every phase transition is an event with the phase's reason
        wait_for(
            lambda: any(is_event(e, "Normal", "RayJobRunning", "-> Running") for e in events())
        )
        trainer_error(PREEMPTED)
        set_rayjob_status(
            {
                "jobDeploymentStatus": "Failed",
                "jobStatus": "FAILED",
                "reason": "AppFailed",
                "message": "Job entrypoint command failed with exit code 75",
            }
        )
        wait_for(lambda: attempt() == "1", timeout=20)  # deleted and made again
        wait_for(lambda: (job_status().get("lastRestart") or {}).get("recreated") is True)
        st = job_status()
        assert (st["disruptions"], st["restarts"]) == (1, 0)
        assert st["lastRestart"]["reason"] == "RestartingAfterDisruption"
        assert "Preempted: SIGTERM" in st["lastRestart"]["message"]
        assert not st["progress"].get("error")  # the failed attempt's is cleared
        assert st["progress"]["step"] == 3  # the rest of the trainer's progress stays
        assert st["phase"] != "Failed"
        restarted = cond("Restarted")
        assert (restarted["status"], restarted["reason"]) == ("True", "RestartingAfterDisruption")
        ev = [e for e in events() if e["reason"] == "RestartingAfterDisruption"]
        assert ev and ev[0]["type"] == "Normal" and "not counted" in ev[0]["message"]

        # the next attempt fails in the reward function: backoffLimit 0 -> the job fails
        set_rayjob_status(RUNNING)
        wait_for(phase_is("Running"))
        trainer_error("training failed: ValueError: reward function returned 3 scores for 4")
        set_rayjob_status(
            {"jobDeploymentStatus": "Failed", "jobStatus": "FAILED", "reason": "AppFailed"}
        )
        wait_for(phase_is("Failed"))
        wait_for(lambda: any(e["reason"] == "BackoffLimitExceeded" for e in events()))
        assert attempt() == "1"  # not restarted
        st = job_status()
        assert (st["disruptions"], st["restarts"]) == (1, 0)
        assert cond("Failed")["reason"] == "TrainerFailed"
        wait_for(
            lambda: any(
                is_event(e, "Warning", "TrainerFailed", "Running -> Failed: training failed")
                for e in events()
            )
        )


def test_queueing_past_the_queue_timeout_fails_with_the_schedulers_reason(cluster):
    """An attempt still Initializing after spec.scheduling.queueTimeoutSeconds: the job fails
    with QueueTimeout, naming what it waited for and the scheduler's message for its pending
    pod, and its RayJob is deleted (nothing stays held). kmock: a pod written as the scheduler
    would leave it."""
    pod = job_pod(
        {
            "phase": "Pending",
            "conditions": [
                {
                    "type": "PodScheduled",
                    "status": "False",
                    "reason": "Unschedulable",
                    "message": "0/10 nodes are available: 10 Insufficient nvidia.com/gpu.",
                }
            ],
        }
    )
    kube.request("POST", "/api/v1/namespaces/ns1/pods", pod)
    with Operator(cluster.url, ["ns1"]):
        create_job(scheduling={"queueTimeoutSeconds": 2})
        wait_for(phase_is("Pending"))
        # kmock keeps no creationTimestamp: KubeRay's startTime of the attempt stands in
        now = datetime.now(timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")
        set_rayjob_status({"jobDeploymentStatus": "Initializing", "startTime": now})
        wait_for(phase_is("Failed"), timeout=20)
        failed = cond("Failed")
        assert failed["reason"] == "QueueTimeout"
        # what it waited for was that pod: the scheduler's message, once (whether the pod's event
        # reached the status first, "it was Unschedulable: ...", or the timeout did)
        assert "queueTimeoutSeconds" in failed["message"]
        assert failed["message"].count("pod demo-head-x: 0/10 nodes are available") == 1
        wait_for(lambda: kube.get(*RJ, "ns1", "demo") is None)
        assert job_status()["phase"] == "Failed"
        assert any(e["reason"] == "QueueTimeout" for e in events())


def worker_pod(cluster_name: str) -> dict:
    pod = job_pod({"phase": "Running"})
    pod["metadata"]["name"] = "demo-worker-x"
    pod["metadata"]["labels"]["ray.io/cluster"] = cluster_name
    return pod


def test_a_raising_reward_function_stays_an_application_error_when_a_pod_is_deleted(cluster):
    """Issue 42, finding 3: a pod of the attempt disrupted (a DisruptionTarget condition written
    through the status subresource, as the eviction API writes it) and then deleted while the job
    runs, and the trainer's reward function raises: with backoffLimit 0 the job fails
    (BackoffLimitExceeded), it is not restarted as an uncounted disruption."""
    base = "/api/v1/namespaces/ns1/pods"
    kube.request("POST", base, worker_pod("demo-raycluster-x"))
    with Operator(cluster.url, ["ns1"]):
        create_job()  # backoffLimit 0
        wait_for(phase_is("Pending"))
        set_rayjob_status({**RUNNING, "rayClusterName": "demo-raycluster-x"})
        wait_for(phase_is("Running"))
        now = datetime.now(timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")
        target = {
            "type": "DisruptionTarget",
            "status": "True",
            "reason": "EvictionByEvictionAPI",
            "message": "Eviction API: evicting",
            "lastTransitionTime": now,
        }
        kube.patch(
            "v1", "Pod", "ns1", "demo-worker-x", {"status": {"conditions": [target]}}, "status"
        )
        kube.request("DELETE", f"{base}/demo-worker-x")
        wait_for(lambda: kube.get("v1", "Pod", "ns1", "demo-worker-x") is None)
        trainer_error("training failed: ValueError: reward function raised: boom")
        set_rayjob_status(
            {"jobDeploymentStatus": "Failed", "jobStatus": "FAILED", "reason": "AppFailed"}
        )
        wait_for(phase_is("Failed"), timeout=20)
        wait_for(lambda: any(e["reason"] == "BackoffLimitExceeded" for e in events()))
        st = job_status()
        assert attempt() == "0", "the application error was restarted as a disruption"
        assert (st.get("disruptions") or 0, st.get("restarts") or 0) == (0, 0)
        assert not any(e["reason"] == "RestartingAfterDisruption" for e in events())


def head_pod_with_failed_submitter(name: str, cluster_name: str) -> dict:
    submitter = {"terminated": {"exitCode": 1, "reason": "Error"}}
    pod = job_pod({"phase": "Running"}, container="ray-head")
    pod["metadata"]["name"] = name
    pod["metadata"]["labels"].update({"ray.io/cluster": cluster_name, "ray.io/node-type": "head"})
    pod["status"]["containerStatuses"] = [
        {"name": "ray-head", "state": {"running": {}}},
        {"name": "ray-job-submitter", "state": submitter},
    ]
    return pod


def test_a_submitter_that_fails_while_the_rayjob_initializes_ends_the_attempt(cluster):
    """Issue 42: KubeRay (v1.6) reads a SidecarMode submitter only once the RayJob is Running; a
    submitter that exited 1 while it was Initializing (``ray job submit`` refused by a dashboard
    whose agent came up late, seen on the real node after a restart) would leave the job
    Initializing for ever. The operator ends that attempt as KubeRay would a Running one
    (SubmissionFailed, KubeRay's line) and applies the failure policy: with backoffLimit 1 a
    counted restart, then BackoffLimitExceeded, the run stopped (RayJob suspended) and the
    verdict kept whatever the RayJob says next."""
    base = "/api/v1/namespaces/ns1/pods"
    with Operator(cluster.url, ["ns1"]):
        create_job(backoffLimit=1, failurePolicy={"retryDelaySeconds": 0})
        wait_for(phase_is("Pending"))
        set_rayjob_status({"jobDeploymentStatus": "Initializing", "rayClusterName": "demo-rc-a"})
        wait_for(phase_is("Initializing"))
        kube.request("POST", base, head_pod_with_failed_submitter("demo-head-a", "demo-rc-a"))
        wait_for(lambda: attempt() == "1", timeout=20)  # deleted and made again
        st = job_status()
        assert (st.get("restarts"), st.get("disruptions") or 0) == (1, 0)
        last = st["lastRestart"]
        assert (last["failureClass"], last["reason"]) == ("Application", "RestartingAfterError")
        assert (
            "SubmissionFailed: Ray head pod container ray-job-submitter terminated with "
            in (last["message"])
        )
        assert "kubectl logs -n ns1 demo-head-a -c ray-job-submitter" in last["message"]
        assert "while the RayJob was Initializing" in last["message"]

        # the second attempt's submitter fails the same way: no retry left
        set_rayjob_status({"jobDeploymentStatus": "Initializing", "rayClusterName": "demo-rc-b"})
        kube.request("POST", base, head_pod_with_failed_submitter("demo-head-b", "demo-rc-b"))
        wait_for(phase_is("Failed"), timeout=20)
        failed = cond("Failed")
        assert failed["reason"] == "SubmissionFailed", failed  # KubeRay's reason for it
        assert "demo-head-b -c ray-job-submitter" in failed["message"]
        wait_for(lambda: any(e["reason"] == "BackoffLimitExceeded" for e in events()))
        # KubeRay would keep its pods: the operator stops the run
        wait_for(lambda: kube.get(*RJ, "ns1", "demo")["spec"].get("suspend") is True, timeout=20)
        assert attempt() == "1" and job_status()["restarts"] == 1
        set_rayjob_status({"jobDeploymentStatus": "Suspended"})
        kube.patch(*PPO, "ns1", "demo", {"metadata": {"labels": {"touch": "1"}}})
        wait_for(lambda: kube.get(*PPO, "ns1", "demo")["metadata"]["labels"].get("touch"))
        assert job_status()["phase"] == "Failed"
        assert cond("Failed") == failed  # the verdict as first written


def test_the_trainers_warning_is_a_warning_event_once(cluster):
    """``status.progress.warning`` (``<Reason>: <message>``, the trainer's grace-period check)
    becomes one Warning event with that reason, however often the status is synced again."""
    line = (
        "GracePeriodTooShort: spec.failurePolicy.terminationGracePeriodSeconds 5s is shorter "
        "than a step (9.0s) plus a checkpoint (2.0s) with a 20% margin (13s)"
    )
    with Operator(cluster.url, ["ns1"]):
        create_job()
        wait_for(phase_is("Pending"))
        set_rayjob_status(RUNNING)
        wait_for(phase_is("Running"))
        progress = {"step": 2, "totalSteps": 10, "warning": line}
        kube.patch(*PPO, "ns1", "demo", {"status": {"progress": progress}}, "status")
        wanted = line.split(": ", 1)[1]
        wait_for(
            lambda: any(is_event(e, "Warning", "GracePeriodTooShort", wanted) for e in events())
        )
        kube.patch(*PPO, "ns1", "demo", {"metadata": {"labels": {"touch": "1"}}})
        wait_for(lambda: kube.get(*PPO, "ns1", "demo")["metadata"]["labels"].get("touch"))
        set_rayjob_status({**RUNNING, "startTime": "2026-01-01T00:00:00Z"})
        wait_for(lambda: job_status().get("startTime"))
        assert sum(e["reason"] == "GracePeriodTooShort" for e in events()) == 1
