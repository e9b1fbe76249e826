"""Stale deletes on the real API server: every attempt of a job has the same RayJob name, so a
delete decided from attempt N's RayJob (a restart timer, a queue timeout) must never remove
attempt N+1, made under that name since (by the operator's own reconcile after a user deleted
the failed RayJob, or by another operator).

The operator's own timers and client (``timers.py``, ``k8s.py``) run in this process against
the session's kube-apiserver and KubeRay; the RayJobs carry no ``ppojob.io/job`` label, so the
operator subprocess of other tests leaves them alone.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Iterator
from typing import Any

import pytest
from prometheus_client import REGISTRY

from ppojob_operator import k8s, timers
from ppojob_operator.state import OperatorConfig, State
from tests.helpers.controlplane import ControlPlane, wait_until

NAME = "race"


@pytest.fixture()
def api(cp: ControlPlane, monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """``k8s.py`` in this process, configured from the admin kubeconfig."""
    monkeypatch.setenv("KUBECONFIG", str(cp.admin_kubeconfig))
    k8s.configure()
    yield


def attempt_rayjob(ns: str, attempt: int) -> dict[str, Any]:
    """A suspended RayJob of attempt ``attempt`` (KubeRay makes no cluster for it)."""
    return {
        "apiVersion": "ray.io/v1",
        "kind": "RayJob",
        "metadata": {
            "name": NAME,
            "namespace": ns,
            "annotations": {"ppojob.io/attempt": str(attempt)},
        },
        "spec": {
            "entrypoint": "python -c pass",
            "suspend": True,
            "shutdownAfterJobFinishes": True,
            "rayClusterSpec": {
                "headGroupSpec": {
                    "rayStartParams": {},
                    "template": {"spec": {"containers": [{"name": "ray-head", "image": "ray:2"}]}},
                }
            },
        },
    }


def replaced(cp: ControlPlane, ns: str) -> tuple[dict[str, Any], dict[str, Any]]:
    """Attempt 0's RayJob as read then, and attempt 1's, which holds the name now (attempt 0
    deleted from outside, e.g. by a user, and its successor made)."""
    collection = cp.path("rayjob.ray.io", namespace=ns)
    old = cp.request("POST", collection, attempt_rayjob(ns, 0))
    cp.request("DELETE", cp.path("rayjob.ray.io", NAME, ns))
    wait_until(lambda: cp.get("rayjob.ray.io", NAME, ns) is None, 60, "attempt 0 gone")
    new = cp.request("POST", collection, attempt_rayjob(ns, 1))
    assert new["metadata"]["uid"] != old["metadata"]["uid"]
    return old, new


def assert_untouched(cp: ControlPlane, ns: str, new: dict[str, Any]) -> None:
    now = cp.get("rayjob.ray.io", NAME, ns)
    assert now is not None, "attempt 1's RayJob was deleted by a delete decided about attempt 0"
    assert now["metadata"]["uid"] == new["metadata"]["uid"]
    assert not now["metadata"].get("deletionTimestamp"), "attempt 1's RayJob is being deleted"


def delete_errors() -> float:
    value = REGISTRY.get_sample_value("ppojob_api_errors_total", {"operation": "delete"})
    return value or 0.0


@pytest.mark.parametrize("watch_caught_up", [False, True], ids=["watch-lags", "watch-caught-up"])
def test_a_stale_restart_timer_deletes_nothing_once_the_next_attempt_exists(
    cp, ns, api, caplog, watch_caught_up
):
    """The restart timer of attempt 0 fires after attempt 1 was made: whether the operator's
    watch still shows attempt 0 (only the API server knows: the delete's uid precondition,
    whose 409 is "already replaced", not an error) or already shows attempt 1, attempt 1
    stays."""
    old, new = replaced(cp, ns)
    state = State(OperatorConfig())
    st = state.track((ns, "race-job"))
    st.rayjob = old  # the failed attempt the restart was decided about
    errors = delete_errors()

    async def fire() -> None:
        timers.schedule_restart(state, st, 0)
        if watch_caught_up:
            st.rayjob = new  # delivered before the timer's time came
        assert st.restart is not None
        await st.restart
        await k8s.aclose()

    with caplog.at_level(logging.INFO, logger="ppojob_operator.timers"):
        asyncio.run(fire())
    assert_untouched(cp, ns, new)
    said = "replaced by attempt 1" if watch_caught_up else "replaced (uid "
    assert f"of attempt 0 was already {said}" in caplog.text
    assert delete_errors() == errors


def test_a_stale_queue_timeout_deletes_nothing_once_the_next_attempt_exists(cp, ns, api, caplog):
    """The queue timeout's delete of attempt 0's RayJob, sent once attempt 1 holds the name,
    is refused by the API server (409: already replaced, logged once, not retried, not an
    error), and attempt 1 stays; the same delete of the attempt itself still deletes it."""
    old, new = replaced(cp, ns)
    errors = delete_errors()

    async def stale() -> bool:
        try:
            return await timers.delete_rayjob((ns, "race-job"), old)
        finally:
            await k8s.aclose()

    with caplog.at_level(logging.INFO, logger="ppojob_operator.timers"):
        assert asyncio.run(stale()) is False
    assert_untouched(cp, ns, new)
    assert caplog.text.count("of attempt 0 was already replaced") == 1
    assert delete_errors() == errors

    async def current() -> bool:
        try:
            return await timers.delete_rayjob((ns, "race-job"), new)
        finally:
            await k8s.aclose()

    assert asyncio.run(current()) is True
    wait_until(lambda: cp.get("rayjob.ray.io", NAME, ns) is None, 60, "attempt 1 deleted")
