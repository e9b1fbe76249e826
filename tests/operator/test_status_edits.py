"""How the operator tells an outside write of its status keys from its own, and reads a Kueue
Workload that may not answer."""

from __future__ import annotations

import asyncio

import aiohttp
import pytest

from ppojob_operator import k8s
from ppojob_operator.scheduling import KUEUE_QUEUE_LABEL
from ppojob_operator.suspend import held_workload
from ppojob_operator.sync import edited_meanwhile, merge_patched, newest_known


@pytest.mark.parametrize(
    ("current", "patch", "result"),
    [  # RFC 7386, appendix A
        ({"a": "b"}, {"a": "c"}, {"a": "c"}),
        ({"a": "b"}, {"b": "c"}, {"a": "b", "b": "c"}),
        ({"a": "b"}, {"a": None}, {}),
        ({"a": "b", "b": "c"}, {"a": None}, {"b": "c"}),
        ({"a": ["b"]}, {"a": "c"}, {"a": "c"}),
        ({"a": {"b": "c"}}, {"a": {"b": "d", "c": None}}, {"a": {"b": "d"}}),
        ({"a": [{"b": "c"}]}, {"a": [1]}, {"a": [1]}),
        (["a", "b"], ["c", "d"], ["c", "d"]),
        ({"e": None}, {"a": 1}, {"e": None, "a": 1}),
        ([1, 2], {"a": "b", "c": None}, {"a": "b"}),
        ({}, {"a": {"bb": {"ccc": None}}}, {"a": {"bb": {}}}),
    ],
)
def test_merge_patched_is_rfc_7386(current, patch, result) -> None:
    assert merge_patched(current, patch) == result


BEFORE = {"phase": "Pending", "gpus": 0, "lastRestart": {"attempt": 1, "reason": "x"}}


def test_the_answer_to_the_operators_own_patch_shows_no_edit() -> None:
    patch = {"phase": "Running", "lastRestart": {"reason": None}}
    after = {"phase": "Running", "gpus": 0, "lastRestart": {"attempt": 1}}
    desired = {"phase": "Running", "gpus": 0, "lastRestart": {"attempt": 1}}
    assert edited_meanwhile(BEFORE, patch, after, desired) == []


def test_a_key_the_patch_left_alone_changed_in_between_is_an_edit() -> None:
    after = {"phase": "Running", "gpus": 99, "lastRestart": BEFORE["lastRestart"]}
    desired = {"phase": "Running", "gpus": 0, "lastRestart": BEFORE["lastRestart"]}
    assert edited_meanwhile(BEFORE, {"phase": "Running"}, after, desired) == ["gpus"]


def test_a_value_the_operator_wants_anyway_is_no_edit() -> None:
    """A stale ``before`` (the watch lagging behind the operator's own earlier write) makes the
    answer differ from it, but not from what the operator wants: nothing to put back."""
    after = {"phase": "Running", "gpus": 2, "lastRestart": BEFORE["lastRestart"]}
    desired = {**after}
    assert edited_meanwhile(BEFORE, {"phase": "Running"}, after, desired) == []


def test_the_newest_known_status_is_the_operators_write_unless_the_body_is_newer() -> None:
    mine = (10, {"phase": "Running"})
    old = {"metadata": {"resourceVersion": "9"}, "status": {"phase": "Pending"}}
    new = {"metadata": {"resourceVersion": "11"}, "status": {"phase": "Failed"}}
    assert newest_known(mine, old)["phase"] == "Running"
    assert newest_known(mine, new)["phase"] == "Failed"
    assert newest_known(None, old)["phase"] == "Pending"


@pytest.mark.parametrize(
    "error",
    [
        aiohttp.ClientConnectionError("reset"),
        asyncio.TimeoutError(),
        ValueError("not JSON"),
        k8s.ApiError(403, "Forbidden", "{}"),
    ],
)
def test_a_workload_that_cannot_be_read_leaves_only_the_explanation_out(monkeypatch, error) -> None:
    """The Kueue Workload only explains a hold: failing to read it (the API server unreachable
    after retries, an answer that is no JSON, RBAC) must not stop the status from syncing."""

    async def failing(*_a, **_kw):
        raise error

    monkeypatch.setattr(k8s, "alist", failing)
    rayjob = {
        "metadata": {
            "name": "demo",
            "namespace": "ns1",
            "uid": "u",
            "labels": {KUEUE_QUEUE_LABEL: "q"},
        },
        "status": {"jobDeploymentStatus": "Suspended"},
    }
    assert asyncio.run(held_workload(rayjob)) is None


def test_the_answer_to_a_post_never_replaces_a_newer_watched_copy() -> None:
    from ppojob_operator.reconcile import newer_known

    def rj(uid, rv):
        return {"metadata": {"uid": uid, "resourceVersion": rv}}

    assert newer_known(rj("a", "12"), rj("a", "10"))  # KubeRay wrote since: keep the watch's
    assert not newer_known(rj("a", "10"), rj("a", "10"))
    assert not newer_known(None, rj("a", "10"))
    assert not newer_known(rj("old", "12"), rj("a", "10"))  # an earlier attempt's RayJob
