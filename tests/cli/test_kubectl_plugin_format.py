"""`kubectl ppojob`'s pure parts: which pods hold a role's logs (a colocated role runs in the
actor's pods), the list table and the watch line. The commands themselves run against the real
control plane in tests/cluster/test_kubectl_plugin.py."""

from __future__ import annotations

import datetime as dt

import pytest

from ppojob_cli.kubectl_plugin import PluginError, format_list, pods_of_role, watch_line


def _pod(name: str, role: str) -> dict:
    return {"metadata": {"name": name, "labels": {"ppojob.io/role": role}}, "spec": {}}


JOB = {
    "metadata": {"name": "j", "namespace": "ns", "creationTimestamp": "2026-01-01T00:00:00Z"},
    "spec": {"roles": {"rollout": {"colocateWithActor": True}, "critic": {"replicas": 1}}},
    "status": {
        "phase": "Running",
        "progress": {"step": 7, "totalSteps": 10, "rewardMean": 0.5, "tokensPerSecond": 99.6},
    },
}
PODS = [_pod("j-head", "head"), _pod("j-actor-b", "actor"), _pod("j-actor-a", "actor")]


def test_a_colocated_role_is_found_in_the_actors_pods() -> None:
    pods, found = pods_of_role(JOB, PODS, "rollout")
    assert found == "actor" and [p["metadata"]["name"] for p in pods] == ["j-actor-a", "j-actor-b"]
    assert pods_of_role(JOB, PODS, "head")[0] == [PODS[0]]
    with pytest.raises(PluginError, match=r"no pods of role critic \(pods of roles: actor, head\)"):
        pods_of_role(JOB, PODS, "critic")  # its own pods, none yet


def test_list_and_watch_line() -> None:
    now = dt.datetime(2026, 1, 1, 2, 0, tzinfo=dt.timezone.utc)
    lines = format_list([JOB], True, now).splitlines()
    assert lines[0].split() == ["NAMESPACE", "NAME", "PHASE", "STEP", "REWARD", "TOKENS/S", "AGE"]
    assert lines[1].split() == ["ns", "j", "Running", "7/10", "0.5", "100", "2h"]
    assert format_list([], False, now) == "No PPOJobs found."
    assert watch_line(JOB) == "j  phase=Running  step=7/10  reward=0.5  kl=-  tokens/s=100"
