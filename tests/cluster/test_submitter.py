"""A SidecarMode submitter that fails while the real KubeRay (1.6.1) keeps its RayJob
``Initializing`` (issue 42): KubeRay reads that container only once the RayJob is ``Running``,
and its RayCluster is not Ready while a worker waits for GPUs, so without the operator the job
would wait for ever. The head pod runs on a KWOK node; its container statuses are written as the
kubelet would leave them after ``ray job submit`` exited 1."""

from __future__ import annotations

import json
import uuid

from tests.helpers.cluster_jobs import bound, gpu_job, pods, pool_nodes, status, wait_children
from tests.helpers.controlplane import wait_until


def test_a_submitter_failed_while_kuberay_keeps_the_rayjob_initializing_ends_the_attempt(
    cp, operator, ns
):
    pool = f"sub-{uuid.uuid4().hex[:6]}"
    pool_nodes(cp, pool, {f"{pool}-a": 1})  # the head fits; no 2-GPU worker does
    doc = gpu_job("sub", ns, actor=1, critic=1, rollout=1, gpus=2, pool=pool)
    doc["spec"]["backoffLimit"] = 1
    doc["spec"]["failurePolicy"] = {"retryDelaySeconds": 0}
    cp.apply(doc)
    wait_children(cp, "sub", ns)

    def head() -> dict | None:
        found = [
            p for p in pods(cp, "sub", ns) if p["metadata"]["labels"]["ray.io/node-type"] == "head"
        ]
        return (
            found[0]
            if found and bound(found[0]) and found[0]["status"].get("phase") == "Running"
            else None
        )

    pod = wait_until(head, 90, "the head pod running on its KWOK node")
    names = [c["name"] for c in pod["spec"]["containers"]]
    assert names[-1] == "ray-job-submitter", names  # KubeRay's, appended after the Ray container
    rj = cp.get("rayjob.ray.io", "sub", ns)
    assert rj["status"]["jobDeploymentStatus"] == "Initializing", rj["status"]
    statuses = [
        {
            "name": c,
            "image": pod["spec"]["containers"][i]["image"],
            "imageID": "",
            "ready": c != "ray-job-submitter",
            "restartCount": 0,
            "state": (
                {"terminated": {"exitCode": 1, "reason": "Error"}}
                if c == "ray-job-submitter"
                else {"running": {"startedAt": "2026-12-07T00:00:00Z"}}
            ),
        }
        for i, c in enumerate(names)
    ]
    cp.kubectl(
        "patch",
        "pod",
        pod["metadata"]["name"],
        "-n",
        ns,
        "--subresource=status",
        "--type=merge",
        "-p",
        json.dumps({"status": {"containerStatuses": statuses}}),
    )
    last = wait_until(
        lambda: (status(cp, "sub", ns).get("lastRestart") or {}) or None,
        60,
        "the operator ending the attempt",
    )
    assert (last["failureClass"], last["reason"]) == ("Application", "RestartingAfterError")
    assert (
        "SubmissionFailed: Ray head pod container ray-job-submitter terminated with exit"
        in (last["message"])
    )
    assert "while the RayJob was Initializing" in last["message"]  # KubeRay's real state
    assert f"kubectl logs -n {ns} {pod['metadata']['name']} -c ray-job-submitter" in last["message"]
    wait_until(
        lambda: (
            (r := cp.get("rayjob.ray.io", "sub", ns))
            and r["metadata"]["annotations"].get("ppojob.io/attempt") == "1"
        ),
        60,
        "the next attempt's RayJob",
    )
    assert status(cp, "sub", ns).get("restarts") == 1
