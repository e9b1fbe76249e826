"""Placement: the pure plan, the fail-fast check, the bounded wait, and Ray on loopback only."""

from __future__ import annotations

import ipaddress
import os
import time
from pathlib import Path

import pytest

from ppojob_api.training import TrainerConfig
from ppojob_trainer.driver.topology import gang_config
from ppojob_trainer.placement import (
    PlacementError,
    PlacementPlan,
    check_fits,
    cluster_pins_roles,
    gang_needs,
    plan_placement,
    reserve_placement,
)


def cfg_of(roles: dict | None = None, estimator: str = "gae", **extra) -> TrainerConfig:
    doc = {"roles": roles or {}, "algorithm": {"advantageEstimator": estimator}, **extra}
    if estimator != "gae":
        doc["data"] = {"samplesPerPrompt": 2}
    return TrainerConfig.model_validate(doc)


TINY = {"actor": {"replicas": 1}, "rollout": {"replicas": 1}}  # critic: colocated default


# ---------------------------------------------------------------------------------------------
# The plan (pure)
# ---------------------------------------------------------------------------------------------
def test_tiny_cpu_example_needs_two_cpus_and_shares_the_actor_bundle() -> None:
    plan = plan_placement(cfg_of(TINY))
    assert plan.bundles == [{"CPU": 1.0}, {"CPU": 1.0}]
    assert plan.total() == {"CPU": 2.0}
    assert plan.strategy == "PACK"
    actor, critic, rollout = (plan.roles[r] for r in ("actor", "critic", "rollout"))
    assert (actor.offset, actor.count, actor.share) == (0, 1, {"CPU": 0.5})
    assert (critic.offset, critic.count, critic.share, critic.owner) == (
        0,
        1,
        {"CPU": 0.5},
        "actor",
    )
    assert (rollout.offset, rollout.count, rollout.share) == (1, 1, {"CPU": 1.0})


def test_gpu_roles_one_bundle_per_gpu_with_offsets_and_half_shares() -> None:
    roles = {
        "actor": {"replicas": 2, "resources": {"gpus": 4, "cpus": 16}},
        "critic": {"colocateWithActor": True},
        "rollout": {"replicas": 1, "resources": {"gpus": 2, "cpus": 8}},
    }
    plan = plan_placement(cfg_of(roles, job_name="demo"))
    assert len(plan.bundles) == 10
    assert plan.bundles[0] == {"GPU": 1.0, "CPU": 4.0}
    assert plan.bundles[8] == {"GPU": 1.0, "CPU": 4.0}
    assert plan.total() == {"GPU": 10.0, "CPU": 40.0}
    assert plan.roles["actor"].share == {"GPU": 0.5, "CPU": 2.0}
    assert plan.roles["critic"].offset == 0 and plan.roles["critic"].count == 8
    assert plan.roles["rollout"].offset == 8 and plan.roles["rollout"].count == 2
    assert plan.roles["rollout"].share == {"GPU": 1.0, "CPU": 4.0}
    assert plan.name == "ppojob-demo"


def test_pinned_roles_ask_for_the_operator_role_resources() -> None:
    roles = {
        "actor": {"replicas": 1, "resources": {"gpus": 2, "cpus": 8}},
        "critic": {"colocateWithActor": True},
        "rollout": {"replicas": 1, "resources": {"gpus": 1, "cpus": 4}},
    }
    plan = plan_placement(cfg_of(roles), pin_roles=True)
    assert plan.bundles == [
        {"GPU": 1.0, "CPU": 4.0, "ppojob-actor": 1.0},
        {"GPU": 1.0, "CPU": 4.0, "ppojob-actor": 1.0},
        {"GPU": 1.0, "CPU": 4.0, "ppojob-rollout": 1.0},
    ]
    # the colocated critic shares the actor's bundles, role resource included
    assert plan.roles["critic"].share == {"GPU": 0.5, "CPU": 2.0, "ppojob-actor": 0.5}
    assert cluster_pins_roles({"CPU": 8, "ppojob-actor": 2}) is True
    assert cluster_pins_roles({"CPU": 8}) is False
    assert "ppojob-actor" not in plan_placement(cfg_of(roles)).total()


def test_separate_critic_gets_its_own_range_and_three_way_colocation_floors_shares() -> None:
    roles = {
        "actor": {"replicas": 1, "resources": {"gpus": 2, "cpus": 3}},
        "critic": {"replicas": 1, "resources": {"gpus": 1, "cpus": 2}},
        "rollout": {"colocateWithActor": True},
    }
    plan = plan_placement(cfg_of(roles))
    assert [b["GPU"] for b in plan.bundles] == [1.0, 1.0, 1.0]
    assert plan.roles["critic"].offset == 2 and plan.roles["critic"].owner == "critic"
    assert plan.roles["rollout"].owner == "actor" and plan.roles["rollout"].offset == 0
    assert plan.roles["actor"].share == {"GPU": 0.5, "CPU": 0.75}
    roles["critic"] = {"colocateWithActor": True}
    shares = plan_placement(cfg_of(roles)).roles["actor"].share
    assert shares["GPU"] == 0.3333 and shares["GPU"] * 3 <= 1.0


def test_no_critic_for_grpo() -> None:
    plan = plan_placement(cfg_of(TINY, estimator="grpo"))
    assert set(plan.roles) == {"actor", "rollout"}
    assert plan.roles["actor"].share == {"CPU": 1.0}


def test_elastic_engines_put_only_their_minimum_in_the_gang_and_the_group() -> None:
    """roles.rollout.elastic: the trainer waits for (gang) and reserves (placement group)
    minReplicas engines; without it, the config is planned as it is."""
    elastic = {"replicas": 3, "elastic": {"minReplicas": 1, "maxReplicas": 4}}
    cfg = cfg_of({"actor": {"replicas": 1}, "rollout": elastic})
    gang = gang_config(cfg)
    assert gang.roles.rollout.replicas == 1 and cfg.roles.rollout.replicas == 3
    assert [(n.role, n.pods) for n in gang_needs(gang)] == [("actor", 1), ("rollout", 1)]
    assert plan_placement(gang).roles["rollout"].count == 1
    plain = cfg_of({"actor": {"replicas": 1}, "rollout": {"replicas": 3}})
    assert gang_config(plain) is plain
    assert plan_placement(gang_config(plain)).roles["rollout"].count == 3


def test_reward_workers_own_bundles_after_the_engines_and_are_in_the_gang() -> None:
    """roles.reward: one bundle per reward GPU (one per replica on CPU), after the others,
    pinned to `ppojob-reward` pods, and the trainer waits for those pods; unset, none."""
    roles = {
        "actor": {"replicas": 1, "resources": {"gpus": 2, "cpus": 8}},
        "rollout": {"colocateWithActor": True},
        "reward": {"replicas": 2, "resources": {"gpus": 1, "cpus": 3}},
    }
    cfg = cfg_of(roles, estimator="grpo")
    plan = plan_placement(cfg, pin_roles=True)
    assert plan.bundles[2:] == [{"GPU": 1.0, "CPU": 3.0, "ppojob-reward": 1.0}] * 2
    reward = plan.roles["reward"]
    assert (reward.offset, reward.count, reward.owner) == (2, 2, "reward")
    assert [(n.role, n.pods, n.per_pod) for n in gang_needs(cfg)] == [
        ("actor", 1, 2),
        ("reward", 2, 1),
    ]
    cpu = cfg_of({**TINY, "reward": {"replicas": 3, "resources": {"cpus": 0.5}}})
    assert plan_placement(cpu).bundles[2:] == [{"CPU": 0.5}] * 3
    assert "reward" not in plan_placement(cfg_of(TINY)).roles


def test_sandbox_workers_own_cpu_bundles_after_the_others_and_are_in_the_gang() -> None:
    """roles.sandbox: one CPU bundle per replica, after the reward workers', pinned to
    `ppojob-sandbox` pods, and the trainer waits for those pods; unset, none."""
    roles = {
        "actor": {"replicas": 1, "resources": {"gpus": 2, "cpus": 8}},
        "rollout": {"colocateWithActor": True},
        "reward": {"replicas": 1, "resources": {"gpus": 1, "cpus": 3}},
        "sandbox": {"replicas": 3, "resources": {"cpus": 1.5}},
    }
    cfg = cfg_of(roles, estimator="grpo")
    plan = plan_placement(cfg, pin_roles=True)
    assert plan.bundles[3:] == [{"CPU": 1.5, "ppojob-sandbox": 1.0}] * 3
    sandbox = plan.roles["sandbox"]
    assert (sandbox.offset, sandbox.count, sandbox.owner) == (3, 3, "sandbox")
    assert [(n.role, n.pods, n.per_pod, n.gpus) for n in gang_needs(cfg)][-1] == (
        "sandbox",
        3,
        1,
        False,
    )
    assert cfg.roles.workers_of("sandbox") == 3  # (the sandbox workers the trainer starts)
    assert "sandbox" not in plan_placement(cfg_of(TINY)).roles


def test_bad_strategy_is_a_value_error() -> None:
    with pytest.raises(ValueError, match="strategy"):
        plan_placement(cfg_of(TINY), strategy="TIGHT")


def test_check_fits_names_missing_gpus_and_oversized_bundles() -> None:
    roles = {"actor": {"resources": {"gpus": 2, "cpus": 4}}, "rollout": {}}
    plan = plan_placement(cfg_of(roles))
    with pytest.raises(PlacementError, match=r"GPU: the job needs 2, the cluster has 0") as err:
        check_fits(plan, {"CPU": 64.0})
    assert err.value.missing == {"GPU": 2.0}
    big = PlacementPlan(bundles=[{"CPU": 8.0}], roles={})
    with pytest.raises(PlacementError, match=r"larger than every Ray node.*CPU: 4"):
        check_fits(big, {"CPU": 16.0}, [{"CPU": 4.0}, {"CPU": 4.0}, {"CPU": 4.0}, {"CPU": 4.0}])
    check_fits(big, {"CPU": 16.0}, [{"CPU": 8.0}, {"CPU": 8.0}])


# ---------------------------------------------------------------------------------------------
# Against a real (loopback) Ray
# ---------------------------------------------------------------------------------------------
def _group_states(name: str) -> list[str]:
    import ray

    return [g["state"] for g in ray.util.placement_group_table().values() if g["name"] == name]


def test_cluster_too_small_fails_at_once_and_creates_no_group(local_ray) -> None:
    plan = plan_placement(
        cfg_of({"actor": {"resources": {"cpus": 64}}, "rollout": {}}), name="too-small"
    )
    start = time.monotonic()
    with pytest.raises(PlacementError, match=r"CPU: the job needs 65, the cluster has 4"):
        reserve_placement(plan, timeout_s=600)
    assert time.monotonic() - start < 5
    assert _group_states("too-small") == []


def test_unsatisfiable_now_times_out_and_removes_the_group(local_ray) -> None:
    import ray
    from ray.util import placement_group, remove_placement_group

    blocker = placement_group([{"CPU": 3.0}], name="blocker")
    ray.get(blocker.ready(), timeout=60)
    try:
        plan = plan_placement(cfg_of(TINY), name="starved")  # 2 CPUs: exist in total, 1 free
        messages: list[str] = []
        start = time.monotonic()
        with pytest.raises(PlacementError, match=r"within 1s.*missing: CPU: 1") as err:
            reserve_placement(plan, timeout_s=1.0, log=messages.append, log_every_s=0.3)
        assert time.monotonic() - start < 10
        assert err.value.missing == {"CPU": 1.0}
        assert any("waiting for placement group starved" in m for m in messages)
        assert set(_group_states("starved")) <= {"REMOVED"}
    finally:
        remove_placement_group(blocker)


def test_reserved_group_places_colocated_workers_on_shared_bundles(local_ray) -> None:
    import ray

    @ray.remote
    class Probe:
        def where(self) -> tuple[str, int]:
            ctx = ray.get_runtime_context()
            return ctx.get_placement_group_id(), ctx.get_assigned_resources().get("CPU", 0)

    plan = plan_placement(cfg_of(TINY), name="tiny")
    with reserve_placement(plan, timeout_s=60) as placement:
        assert placement.bundle_for("critic", 0) == (0, {"CPU": 0.5})
        assert placement.bundle_for("rollout", 0) == (1, {"CPU": 1.0})
        with pytest.raises(IndexError, match="rollout worker index 1 out of range"):
            placement.bundle_for("rollout", 1)
        probes = [
            Probe.options(**placement.scheduling_options(role, 0)).remote()
            for role in ("actor", "critic", "rollout")
        ]
        where = ray.get([p.where.remote() for p in probes], timeout=60)
        assert {w[0] for w in where} == {placement.group.id.hex()}
        assert [w[1] for w in where] == [0.5, 0.5, 1.0]
    assert set(_group_states("tiny")) <= {"REMOVED"}


# ---------------------------------------------------------------------------------------------
# Ray listens on loopback only
# ---------------------------------------------------------------------------------------------
def _descendants(root: int) -> set[int]:
    parent: dict[int, int] = {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                stat = (entry / "stat").read_text()
            except OSError:
                continue
            parent[int(entry.name)] = int(stat.rsplit(")", 1)[1].split()[1])
    found, frontier = {root}, [root]
    while frontier:
        pid = frontier.pop()
        kids = [p for p, pp in parent.items() if pp == pid and p not in found]
        found.update(kids)
        frontier.extend(kids)
    return found


def _socket_inodes(pid: int) -> set[str]:
    inodes = set()
    try:
        fds = list(Path(f"/proc/{pid}/fd").iterdir())
    except OSError:
        return inodes
    for fd in fds:
        try:
            target = os.readlink(fd)
        except OSError:
            continue
        if target.startswith("socket:["):
            inodes.add(target[8:-1])
    return inodes


def _listening() -> dict[str, tuple[ipaddress._BaseAddress, int]]:
    """inode -> (address, port) of every listening TCP socket (IPv4 and IPv6)."""
    out = {}
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        for line in Path(table).read_text().splitlines()[1:]:
            fields = line.split()
            if fields[3] != "0A":  # LISTEN
                continue
            hexaddr, hexport = fields[1].split(":")
            raw = bytes.fromhex(hexaddr)
            raw = b"".join(raw[i : i + 4][::-1] for i in range(0, len(raw), 4))
            addr = ipaddress.ip_address(raw)
            out[fields[9]] = (addr, int(hexport, 16))
    return out


def test_ray_listens_only_on_loopback(local_ray) -> None:
    import ray

    @ray.remote
    def ping() -> int:
        return 1

    assert ray.get(ping.remote(), timeout=60) == 1  # a worker process exists too
    listening = _listening()
    ray_sockets = []
    for pid in _descendants(os.getpid()):
        for inode in _socket_inodes(pid):
            if inode in listening:
                ray_sockets.append((pid, *listening[inode]))
    assert len(ray_sockets) >= 4, ray_sockets  # GCS, raylet, object manager, agents, workers
    for pid, addr, port in ray_sockets:
        mapped = getattr(addr, "ipv4_mapped", None)
        cmd = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ")[:200]
        assert (mapped or addr) == ipaddress.ip_address("127.0.0.1"), (pid, str(addr), port, cmd)
