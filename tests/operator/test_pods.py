"""The image verdict and a failed submitter from a pod's container statuses
(operator/ppojob_operator/pods.py), and the attempt a failed submitter ends (restarts.py)."""

from __future__ import annotations

import datetime as dt

import pytest

from ppojob_api.failures import classify
from ppojob_operator.pods import PULL_GRACE_S, failed_submitter, unavailable_image
from ppojob_operator.restarts import attempt_failed, submission_failed

NOW = dt.datetime(2026, 12, 1, 12, 0, tzinfo=dt.timezone.utc)


def pod(reason: str | None, age_s: float = 10, init: bool = False, message: str = "") -> dict:
    created = (NOW - dt.timedelta(seconds=age_s)).isoformat().replace("+00:00", "Z")
    state = {"waiting": {"reason": reason, "message": message}} if reason else {"running": {}}
    cs = {"name": "ray-head", "image": "reg/trainer:bad", "state": state}
    key = "initContainerStatuses" if init else "containerStatuses"
    return {"metadata": {"name": "job-head-x", "creationTimestamp": created}, "status": {key: [cs]}}


@pytest.mark.parametrize(
    ("reason", "age_s", "init", "fails"),
    [
        ("ErrImageNeverPull", 1, False, True),  # cannot get better: at once
        ("InvalidImageName", 1, False, True),
        ("ErrImageNeverPull", 1, True, True),  # an init container's image counts too
        ("ErrImagePull", 1, False, False),  # may be a registry's bad minute
        ("ImagePullBackOff", PULL_GRACE_S - 1, False, False),
        ("ImagePullBackOff", PULL_GRACE_S, False, True),  # ... not for ever
        ("ErrImagePull", PULL_GRACE_S + 60, False, True),
        ("ContainerCreating", PULL_GRACE_S * 10, False, False),  # a big image still unpacking
        ("CrashLoopBackOff", PULL_GRACE_S * 10, False, False),  # not an image problem
        (None, PULL_GRACE_S * 10, False, False),  # running
    ],
)
def test_which_waits_fail_the_job(
    reason: str | None, age_s: float, init: bool, fails: bool
) -> None:
    assert (unavailable_image(pod(reason, age_s, init), NOW) is not None) is fails


def test_the_verdict_names_pod_container_image_reason_and_the_fix() -> None:
    why = unavailable_image(
        pod("ErrImageNeverPull", message='Container image "reg/trainer:bad" is not present'), NOW
    )
    assert why is not None
    for part in ("job-head-x", "ray-head", "'reg/trainer:bad'", "ErrImageNeverPull", "not present"):
        assert part in why
    assert "spec.image" in why and "\n" not in why


def test_a_pod_without_a_creation_time_never_times_out() -> None:
    p = pod("ImagePullBackOff")
    del p["metadata"]["creationTimestamp"]
    assert unavailable_image(p, NOW) is None


# ------------------------------------------------------------------ a failed SidecarMode submitter


def head_pod(submitter: dict, *, deleting: bool = False, disrupted: bool = False) -> dict:
    meta: dict = {"name": "job-head-x", "namespace": "ns1"}
    if deleting:
        meta["deletionTimestamp"] = "2026-12-01T12:00:00Z"
    conditions = []
    if disrupted:
        conditions.append(
            {"type": "DisruptionTarget", "status": "True", "reason": "EvictionByEvictionAPI"}
        )
    statuses = [
        {"name": "ray-head", "state": {"running": {}}},
        {"name": "ray-job-submitter", "state": submitter},
    ]
    return {"metadata": meta, "status": {"conditions": conditions, "containerStatuses": statuses}}


EXITED_1 = {"terminated": {"exitCode": 1, "reason": "Error"}}


@pytest.mark.parametrize(
    ("submitter", "deleting", "disrupted", "failed"),
    [
        (EXITED_1, False, False, True),
        ({"terminated": {"exitCode": 0, "reason": "Completed"}}, False, False, False),
        ({"running": {}}, False, False, False),
        ({"waiting": {"reason": "PodInitializing"}}, False, False, False),
        (EXITED_1, True, False, False),  # the pod is going: its loss says why, not this
        (EXITED_1, False, True, False),  # an eviction under way: a disruption, not this
    ],
)
def test_a_head_pods_submitter_that_exited_nonzero_is_reported_in_kuberays_words(
    submitter: dict, deleting: bool, disrupted: bool, failed: bool
) -> None:
    line = failed_submitter(head_pod(submitter, deleting=deleting, disrupted=disrupted))
    if not failed:
        assert line is None
        return
    assert line is not None
    assert line.startswith("Ray head pod container ray-job-submitter terminated with exit code 1")
    assert "kubectl logs -n ns1 job-head-x -c ray-job-submitter" in line
    # classified by the failure policy as KubeRay's own line for it is: never as exit code 1
    # of the trainer's (a refused config, which would fail at once)
    assert classify(line) == "Application"


def test_only_an_initializing_rayjob_is_ended_by_its_failed_submitter() -> None:
    line = failed_submitter(head_pod(EXITED_1))
    initializing = {"metadata": {"name": "rj"}, "status": {"jobDeploymentStatus": "Initializing"}}
    ended = submission_failed(initializing, line)
    assert attempt_failed(ended) and not attempt_failed(initializing)
    assert ended["status"]["reason"] == "SubmissionFailed"
    assert ended["status"]["message"] == f"{line}, while the RayJob was Initializing"
    assert initializing["status"]["jobDeploymentStatus"] == "Initializing"  # not changed
    assert submission_failed(initializing, None) is initializing
    suspended = {**initializing, "spec": {"suspend": True}}  # (Kueue's eviction): left alone
    assert submission_failed(suspended, line) is suspended
    # a Running RayJob's failed submitter is KubeRay's to see (it fails the RayJob itself)
    running = {"metadata": {"name": "rj"}, "status": {"jobDeploymentStatus": "Running"}}
    assert submission_failed(running, line) is running
