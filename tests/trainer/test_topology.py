"""The driver's topology (ppojob_trainer.driver.topology): every layout fact and mode resolved
once from the config, without Ray."""

from __future__ import annotations

from typing import Any

import pytest

from ppojob_api.training import TrainerConfig
from ppojob_trainer.driver.topology import (
    adapters_through_store,
    dp_leaders,
    engine_count,
    gang_config,
    resolve_topology,
)


def _cfg(roles: dict[str, Any] | None = None, **algorithm: Any) -> TrainerConfig:
    doc: dict[str, Any] = {"roles": roles or {}}
    if algorithm:
        doc["algorithm"] = algorithm
    return TrainerConfig.model_validate(doc)


def _shard(dp: int, tp: int = 0, pp: int = 0, cp: int = 0) -> dict[str, int]:
    return {"dp_rank": dp, "tp_rank": tp, "pp_rank": pp, "cp_rank": cp}


def test_colocated_engines_live_in_the_actor_workers_and_take_staged_buckets() -> None:
    topo = resolve_topology(
        _cfg({"actor": {"replicas": 2}, "rollout": {"colocateWithActor": True}})
    )
    # (offload is on by default, but the torch engine has nothing to release)
    assert topo.colocated and not topo.offload and topo.weight_sync == "colocated"
    assert topo.layout == (("actor", 2),) and topo.engines == 2
    assert topo.elastic is None and not topo.partial
    assert topo.hosted_roles("actor", 1, 2) == {
        "actor": (1, 2),
        "critic": (1, 2),
        "rollout": (1, 2),
    }


def test_only_colocated_sglang_engines_with_offload_release_their_memory() -> None:
    gpus = {"replicas": 2, "resources": {"gpus": 1}}
    sglang = {"colocateWithActor": True, "backend": "sglang"}
    assert resolve_topology(_cfg({"actor": gpus, "rollout": sglang})).offload
    kept = resolve_topology(_cfg({"actor": gpus, "rollout": {**sglang, "offload": False}}))
    assert kept.colocated and not kept.offload
    torch_engine = resolve_topology(_cfg({"actor": gpus, "rollout": {"colocateWithActor": True}}))
    assert torch_engine.colocated and not torch_engine.offload


def test_engines_of_their_own_on_cpus_take_a_broadcast_by_default() -> None:
    topo = resolve_topology(_cfg({"rollout": {"replicas": 3}}))
    assert not topo.colocated and not topo.offload
    assert topo.weight_sync == "broadcast" and topo.weight_backend == "gloo"
    assert topo.layout == (("actor", 1), ("rollout", 3))
    assert topo.hosted_roles("actor", 0, 1) == {"actor": (0, 1), "critic": (0, 1)}
    assert topo.hosted_roles("rollout", 2, 3) == {"rollout": (2, 3)}


def test_a_critic_of_its_own_is_a_layout_entry_and_apart() -> None:
    topo = resolve_topology(_cfg({"critic": {"replicas": 2}}))
    assert topo.has_critic and topo.critic_apart and not topo.critic_with_actor
    assert topo.layout == (("actor", 1), ("critic", 2), ("rollout", 1))
    assert topo.hosted_roles("actor", 0, 1) == {"actor": (0, 1)}


def test_grpo_has_no_critic() -> None:
    topo = resolve_topology(_cfg(advantageEstimator="grpo"))
    assert not topo.has_critic and not topo.critic_apart
    assert topo.hosted_roles("actor", 0, 1) == {"actor": (0, 1)}


def test_bounded_staleness_on_cpu_engines_defers_the_loads() -> None:
    assert resolve_topology(_cfg(maxStaleness=1)).weight_sync == "deferred"
    assert resolve_topology(_cfg(maxStaleness=0)).weight_sync == "broadcast"
    gpus = {
        "actor": {"resources": {"gpus": 1}},
        "rollout": {"resources": {"gpus": 1}},
    }
    topo = resolve_topology(_cfg(gpus, maxStaleness=1))
    assert topo.weight_sync == "broadcast" and topo.weight_backend == "nccl"
    assert topo.gpu_roles == {"actor", "rollout"} and topo.device("critic") == "cpu"
    assert topo.max_staleness == 1


def test_partial_rollout_goes_through_the_store_and_only_with_own_engines() -> None:
    topo = resolve_topology(_cfg(maxStaleness=1, partialRollout=True))
    assert topo.partial and topo.weight_sync == "store"
    coloc = resolve_topology(_cfg({"rollout": {"colocateWithActor": True}}, partialRollout=True))
    assert not coloc.partial and coloc.weight_sync == "colocated"


def test_elastic_engines_start_at_min_replicas_and_take_the_store() -> None:
    elastic = {"minReplicas": 1, "maxReplicas": 3}
    cfg = _cfg({"rollout": {"replicas": 2, "elastic": elastic}})
    topo = resolve_topology(cfg)
    assert topo.elastic is not None and topo.elastic.max_replicas == 3
    assert topo.weight_sync == "store" and topo.engines == 1
    assert topo.layout[-1] == ("rollout", 1)
    assert engine_count(gang_config(cfg)) == 1 and engine_count(cfg) == 2


def test_colocated_engines_are_never_elastic() -> None:
    roles = {"rollout": {"colocateWithActor": True, "elastic": {"maxReplicas": 2}}}
    cfg = _cfg(roles)
    assert resolve_topology(cfg).elastic is None
    assert gang_config(cfg) is cfg


def test_sglang_engines_span_tensor_gpus_of_the_actor() -> None:
    roles = {
        "actor": {"replicas": 4, "resources": {"gpus": 1}},
        "rollout": {
            "backend": "sglang",
            "colocateWithActor": True,
            "parallelism": {"tensor": 2},
        },
    }
    topo = resolve_topology(_cfg(roles))
    assert topo.tp == 2 and topo.engines == 2
    assert "rollout" not in topo.hosted_roles("actor", 1, 4)
    assert topo.hosted_roles("actor", 2, 4)["rollout"] == (1, 2)
    assert topo.device("actor") == "cuda"


def test_lora_adapters_for_sglang_engines_go_through_the_store() -> None:
    doc = {
        "model": {"lora": {"rank": 4}},
        "roles": {
            "actor": {"resources": {"gpus": 1}},
            "rollout": {"backend": "sglang", "resources": {"gpus": 1}},
        },
    }
    cfg = TrainerConfig.model_validate(doc)
    assert adapters_through_store(cfg)
    assert resolve_topology(cfg).weight_sync == "store"
    assert not adapters_through_store(_cfg())


def test_reward_and_sandbox_workers_are_counted() -> None:
    topo = resolve_topology(_cfg({"reward": {"replicas": 2}}))
    assert topo.reward_workers == 2 and topo.sandbox_workers == 0
    assert resolve_topology(_cfg()).reward_workers == 0


def test_dp_leaders_are_the_tp_pp_cp_rank_0_workers_in_dp_order() -> None:
    shards = [_shard(1), _shard(1, tp=1), _shard(0), _shard(0, pp=1), _shard(0, cp=1)]
    assert dp_leaders(shards) == [2, 0]
    assert dp_leaders([_shard(0)]) == [0]
    with pytest.raises(KeyError):
        dp_leaders([_shard(1)])  # a data-parallel rank without its leader


def test_one_process_is_one_actor_worker_with_its_engine_and_critic() -> None:
    colocated = {"colocateWithActor": True}
    assert resolve_topology(_cfg({"actor": {"replicas": 1}, "rollout": colocated})).one_process
    grpo = _cfg({"actor": {"replicas": 1}, "rollout": colocated}, advantageEstimator="grpo")
    assert resolve_topology(grpo).one_process  # (no critic at all)
    two = _cfg({"actor": {"replicas": 2}, "rollout": colocated})
    apart = _cfg({"actor": {"replicas": 1}, "rollout": {"replicas": 1}})
    critic = _cfg(
        {"actor": {"replicas": 1}, "critic": {"colocateWithActor": False}, "rollout": colocated}
    )
    ahead = TrainerConfig.model_validate(  # (refused by validation; never in memory either)
        {
            "roles": {"actor": {"replicas": 1}, "rollout": colocated},
            "algorithm": {"maxStaleness": 1},
        }
    )
    for cfg in (two, apart, critic, ahead):
        assert not resolve_topology(cfg).one_process, cfg.roles
