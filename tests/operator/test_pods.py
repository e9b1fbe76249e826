"""The image verdict from a pod's container statuses (operator/ppojob_operator/pods.py)."""

from __future__ import annotations

import datetime as dt

import pytest

from ppojob_operator.pods import PULL_GRACE_S, unavailable_image

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
