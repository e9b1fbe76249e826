"""Pod Security Standards on the real API server (its PodSecurity admission plugin, on by
default) and the real KubeRay: which jobs' pods a namespace's enforced level admits, and the
operator refusing, with the level named, a job that level would refuse.

This control plane runs no Job controller (no real node): where KubeRay makes the K8sJobMode
submitter Job, the test creates its pod from the Job's template, as the Job controller would, so
that PodSecurity admission judges that pod as created.
"""

from __future__ import annotations

import json
import re
from typing import Any

from ppojob_api.checks.podsecurity import check_pod_security
from ppojob_api.validation import validate_manifest
from tests.helpers.cluster_jobs import PPOJOB, condition, gpu_job, pods, running, status
from tests.helpers.controlplane import ControlPlane, wait_until

ENFORCE = "pod-security.kubernetes.io/enforce"
GROUP = "ray.io/group"


def enforce(cp: ControlPlane, ns: str, level: str) -> None:
    cp.kubectl("label", "namespace", ns, f"{ENFORCE}={level}", "--overwrite")


def k8s_job_mode(name: str, ns: str) -> dict[str, Any]:
    doc = gpu_job(name, ns, actor=1, critic=1, rollout=1)
    doc["spec"]["submissionMode"] = "K8sJobMode"
    return doc


def all_pods_running(cp: ControlPlane, name: str, ns: str, n: int) -> list[dict[str, Any]]:
    p = pods(cp, name, ns)
    return p if len(p) == n and all(map(running, p)) else []


def submitter_pod(job: dict[str, Any]) -> dict[str, Any]:
    """The pod the Job controller makes from a Job's template (its labels and owner)."""
    template = job["spec"]["template"]
    meta = template.get("metadata") or {}
    return {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {
            "generateName": job["metadata"]["name"] + "-",
            "labels": {**(meta.get("labels") or {}), "job-name": job["metadata"]["name"]},
        },
        "spec": template["spec"],
    }


def test_a_k8sjobmode_job_runs_in_a_namespace_enforcing_restricted(cp, operator, ns):
    """Every pod of a K8sJobMode job is admitted under ``restricted``: the head and workers
    KubeRay creates, and the submitter pod of the Job KubeRay makes (hardened by the operator's
    submitterPodTemplate, without a service account token)."""
    enforce(cp, ns, "restricted")
    cp.apply(k8s_job_mode("kj", ns))
    wait_until(lambda: all_pods_running(cp, "kj", ns, 4), 120, "head and 3 workers Running")
    job = wait_until(lambda: cp.get("job.batch", "kj", ns), 90, "KubeRay's submitter Job")
    made = cp.kubectl(
        "create",
        "-n",
        ns,
        "-o",
        "json",
        "-f",
        "-",
        input=json.dumps(submitter_pod(job)),
        check=False,
    )
    assert made.returncode == 0, made.stderr
    assert json.loads(made.stdout)["metadata"]["name"].startswith("kj-")
    spec = job["spec"]["template"]["spec"]
    assert spec.get("automountServiceAccountToken") is False  # it talks to Ray, not Kubernetes
    assert status(cp, "kj", ns).get("phase") != "Failed"


def test_the_operator_refuses_a_job_the_namespaces_level_would_refuse(cp, operator, ns):
    """A SidecarMode job (the default) in a namespace enforcing ``restricted``, and a job with
    capabilities and a hostPath volume in one enforcing ``baseline``, fail at once with reason
    PodSecurityViolation naming the enforced level, what it refuses and the level needed; no
    RayJob is made (its pods would be refused one by one, and the Ray cluster never come up).
    Relabelled to a level that admits it, the job is reconciled again and runs."""
    enforce(cp, ns, "restricted")
    cp.apply(gpu_job("side", ns, actor=1, critic=1, rollout=1))
    failed = wait_until(
        lambda: (c := condition(status(cp, "side", ns), "Failed")).get("status") == "True" and c,
        60,
        "the SidecarMode job Failed",
    )
    assert failed["reason"] == "PodSecurityViolation"
    msg = failed["message"]
    assert f'enforces Pod Security "restricted" ({ENFORCE})' in msg, msg
    assert 'needs "baseline"' in msg and "spec.submissionMode" in msg, msg
    assert cp.get("rayjob.ray.io", "side", ns) is None

    doc = k8s_job_mode("caps", ns)
    doc["spec"]["roles"]["actor"]["capabilities"] = ["IPC_LOCK"]
    doc["spec"]["podTemplate"] = {
        "volumes": [{"name": "models", "hostPath": {"path": "/models"}}],
        "volumeMounts": [{"name": "models", "mountPath": "/models"}],
    }
    enforce(cp, ns, "baseline")
    cp.apply(doc)
    failed = wait_until(
        lambda: (c := condition(status(cp, "caps", ns), "Failed")).get("status") == "True" and c,
        60,
        "the job with capabilities and hostPath Failed",
    )
    msg = failed["message"]
    assert failed["reason"] == "PodSecurityViolation"
    assert 'enforces Pod Security "baseline"' in msg and 'needs "privileged"' in msg, msg
    assert "spec.roles.actor.capabilities: adds capability IPC_LOCK" in msg, msg
    assert "spec.podTemplate.volumes[0]: a hostPath volume (models)" in msg, msg
    assert cp.get("rayjob.ray.io", "caps", ns) is None
    events = cp.get("event", namespace=ns)["items"]
    assert {
        e["involvedObject"]["name"] for e in events if e["reason"] == "PodSecurityViolation"
    } >= {
        "side",
        "caps",
    }
    # the SidecarMode job is admitted by baseline: a spec edit reconciles it again
    cp.kubectl(
        "patch",
        PPOJOB,
        "side",
        "-n",
        ns,
        "--type=merge",
        "-p",
        '{"spec":{"ttlSecondsAfterFinished":120}}',
    )
    wait_until(
        lambda: all_pods_running(cp, "side", ns, 4), 120, "the SidecarMode job's 4 pods Running"
    )


def violating_groups(cp: ControlPlane, ns: str, level: str) -> set[str]:
    """The Ray groups of the namespace's pods that PodSecurity admission says violate ``level``
    (its warnings on a server-side dry run of labelling the namespace with it)."""
    out = cp.kubectl(
        "label", "namespace", ns, f"{ENFORCE}={level}", "--overwrite", "--dry-run=server"
    )
    assert f'violate the new PodSecurity enforce level "{level}:latest"' in out.stderr or (
        "Warning" not in out.stderr
    ), out.stderr
    names = set(re.findall(r"Warning: ([a-z0-9-]+): ", out.stderr))
    return {
        p["metadata"]["labels"][GROUP]
        for p in pods(cp, "lvl", ns)
        if p["metadata"]["name"] in names
    }


def test_the_levels_agree_with_podsecurity_admission(cp, operator, ns):
    """In a namespace enforcing nothing, KubeRay makes the pods of a SidecarMode job whose actor
    adds IPC_LOCK; PodSecurity admission's own verdict on those pods (the warnings of labelling
    the namespace, dry run) matches ppojob's table: ``restricted`` refuses the head (KubeRay's
    submitter container) and the actor, ``baseline`` only the actor (IPC_LOCK), ``privileged``
    nothing."""
    doc = gpu_job("lvl", ns, actor=1, critic=1, rollout=1)
    doc["spec"]["roles"]["actor"]["capabilities"] = ["IPC_LOCK"]
    cp.apply(doc)
    wait_until(lambda: all_pods_running(cp, "lvl", ns, 4), 120, "the job's 4 pods Running")
    spec = validate_manifest(doc).spec
    by_path = {"spec.submissionMode": "headgroup", "spec.roles.actor.capabilities": "actor"}
    for level in ("restricted", "baseline", "privileged"):
        ours = {by_path[p.path] for p in check_pod_security(spec, level)}
        assert violating_groups(cp, ns, level) == ours, level
    assert ours == set()
