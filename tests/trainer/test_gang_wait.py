"""The trainer waits for every role's pods before planning placement (issue 10, item 2).

A real multi-node Ray on loopback (`ray.cluster_utils.Cluster`): the head advertises
`ppojob-head` as the operator's head pod does, worker "pods" join late with `ppojob-<role>`."""

from __future__ import annotations

import threading

import pytest

from ppojob_api.training import TrainerConfig
from ppojob_trainer.placement import (
    GangIncompleteError,
    cluster_pins_roles,
    gang_missing,
    gang_needs,
    plan_placement,
    wait_for_gang,
)


def cfg(**roles) -> TrainerConfig:
    return TrainerConfig.model_validate({"roles": roles})


GPU_CFG = cfg(
    actor={"replicas": 2, "resources": {"gpus": 2, "cpus": 4}},
    critic={"replicas": 1, "resources": {"gpus": 1}},
    rollout={"colocateWithActor": True},
)


def test_needs_and_missing_lines_per_role() -> None:
    needs = gang_needs(GPU_CFG)
    assert [(n.role, n.pods, n.per_pod) for n in needs] == [("actor", 2, 2), ("critic", 1, 1)]
    lines = gang_missing(needs, {"ppojob-head": 1, "ppojob-actor": 2})
    assert lines == [
        "ppojob-actor: 2 of 4 GPUs joined (1 of 2 pods)",
        "ppojob-critic: 0 of 1 GPUs joined (0 of 1 pods)",
    ]
    assert gang_missing(needs, {"ppojob-actor": 4, "ppojob-critic": 1}) == []


def test_a_cluster_with_only_the_head_is_still_an_operator_cluster() -> None:
    # Before the fix, pinning was decided from `ppojob-actor` alone: a cluster whose workers had
    # not joined yet was taken for a local Ray and its bundles left unpinned.
    assert cluster_pins_roles({"CPU": 0, "ppojob-head": 1})
    assert not cluster_pins_roles({"CPU": 4})


def test_local_ray_is_not_waited_for() -> None:
    assert wait_for_gang(GPU_CFG, 5, totals=lambda: {"CPU": 8.0, "GPU": 8.0}) == 0.0


@pytest.fixture(scope="module")
def ray_cluster():
    import os

    from ppojob_trainer.runtime import LOCAL_RAY_ENV, _pin_loopback_constant, shutdown_ray

    shutdown_ray()
    os.environ.update(LOCAL_RAY_ENV)
    _pin_loopback_constant()
    import ray
    from ray.cluster_utils import Cluster

    cluster = Cluster(
        initialize_head=True,
        head_node_args={
            "num_cpus": 1,
            "resources": {"ppojob-head": 1},
            "include_dashboard": False,
            "node_ip_address": "127.0.0.1",
        },
    )
    ray.init(address=cluster.address, logging_level="WARNING")
    try:
        yield cluster
    finally:
        ray.shutdown()
        cluster.shutdown()


CPU_CFG = cfg(
    actor={"replicas": 2, "resources": {"cpus": 1}},
    rollout={"colocateWithActor": True},
    critic={"colocateWithActor": True},
)


def test_waits_for_late_pods_then_plans_pinned(ray_cluster) -> None:
    ray_cluster.add_node(num_cpus=1, resources={"ppojob-actor": 1}, node_ip_address="127.0.0.1")
    ray_cluster.wait_for_nodes()
    logged: list[str] = []
    saw_missing = threading.Event()

    def log(msg: str) -> None:
        logged.append(msg)
        if "ppojob-actor: 1 of 2 worker slots joined (1 of 2 pods)" in msg:
            saw_missing.set()

    result: dict = {}

    def run() -> None:
        try:
            result["waited"] = wait_for_gang(CPU_CFG, 120, log=log, log_every_s=0.2, poll_s=0.05)
        except BaseException as exc:  # surfaced below
            result["error"] = exc

    t = threading.Thread(target=run)
    t.start()
    assert saw_missing.wait(60), logged
    assert t.is_alive()  # still waiting: one actor pod is missing
    ray_cluster.add_node(num_cpus=1, resources={"ppojob-actor": 1}, node_ip_address="127.0.0.1")
    t.join(60)
    assert not t.is_alive() and "error" not in result, result
    assert result["waited"] > 0
    import ray

    totals = ray.cluster_resources()
    assert totals["ppojob-actor"] == 2
    plan = plan_placement(CPU_CFG, pin_roles=cluster_pins_roles(totals))
    assert all(b.get("ppojob-actor") == 1.0 for b in plan.bundles)


def test_times_out_naming_what_is_missing(ray_cluster) -> None:
    two_roles = cfg(
        actor={"replicas": 2, "resources": {"cpus": 1}},
        rollout={"replicas": 3},
        critic={"colocateWithActor": True},
    )
    with pytest.raises(GangIncompleteError) as exc:
        wait_for_gang(two_roles, 1.0, log=lambda _m: None, poll_s=0.05)
    msg = str(exc.value)
    assert "within 1s (spec.scheduling.timeoutSeconds)" in msg
    assert "ppojob-rollout: 0 of 3 worker slots joined (0 of 3 pods)" in msg
    assert exc.value.reason == "GangIncomplete"


def test_entrypoint_prints_the_reason_the_operator_reads(tmp_path, monkeypatch, capsys) -> None:
    """`ppojob-train: GangIncomplete: ...` is the line the operator maps to the PPOJob's Failed
    reason (tests/operator/test_status.py)."""
    import ppojob_trainer.driver.run as driver_run
    import ppojob_trainer.runtime as runtime
    from ppojob_trainer import entrypoint

    def fail(*_a, **_k):
        raise GangIncompleteError("not every pod of the job joined: ppojob-actor: 0 of 2")

    monkeypatch.setattr(driver_run, "train", fail)
    monkeypatch.setattr(runtime, "connect_ray", lambda: None)
    cfg_file = tmp_path / "trainer.yaml"
    cfg_file.write_text("training: {steps: 1}\n")
    code = entrypoint.main(["--config", str(cfg_file), "--out", str(tmp_path / "o")])
    assert code == 2
    err = capsys.readouterr().err
    assert "ppojob-train: GangIncomplete: not every pod of the job joined" in err
