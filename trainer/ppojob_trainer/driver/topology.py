"""The driver's layout and modes, resolved once from the config (pure: no Ray, no workers).

Which roles share a process, how many engines there are and how many GPUs each spans, whether
the engines are colocated (and offloaded), elastic, partial or run ahead (bounded staleness),
and so how the actor's weights reach them: everything the rest of the driver branches on is a
field of :class:`Topology`, read from the config in one place (:func:`resolve_topology`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from ppojob_api.training import TrainerConfig
from ppojob_api.trainspec.roles import ElasticRollout

WeightSyncMode = Literal["colocated", "store", "deferred", "broadcast"]
"""How the actor's weights reach the engines (:mod:`.weights`): ``colocated`` engines load the
buckets their GPUs' actor workers stage; ``store``: through the object store, loaded by each
engine (offered mid-generation with partial rollout); ``deferred``: the same, each engine's
load queued ahead of its next generation and waited on at the next step; ``broadcast``: the
actor's leader broadcasts to every engine over a process group of their own."""


def engine_tensor_size(cfg: TrainerConfig) -> int:
    """GPUs one rollout engine spans: `parallelism.tensor` for sglang, else 1."""
    rollout = cfg.roles.rollout
    if rollout.backend != "sglang":
        return 1
    return rollout.parallelism.tensor


def gang_config(cfg: TrainerConfig) -> TrainerConfig:
    """The config the gang and the placement group are planned from (pure): ``cfg`` itself, or,
    with elastic engines (``roles.rollout.elastic``), ``cfg`` with ``minReplicas`` engines, so
    that the trainer never waits for rollout capacity beyond the minimum (the other engines
    start outside the placement group, when there is room)."""
    rollout = cfg.roles.rollout
    if rollout.elastic is None or rollout.colocate_with_actor:
        return cfg
    fewer = rollout.model_copy(update={"replicas": rollout.elastic.min_replicas})
    roles = cfg.roles.model_copy(update={"rollout": fewer})
    return cfg.model_copy(update={"roles": roles})


def engine_count(cfg: TrainerConfig) -> int:
    """Rollout engines: the rollout's GPUs (the actor's when colocated) / tensor size."""
    return cfg.roles.workers_of("rollout") // engine_tensor_size(cfg)


def adapters_through_store(cfg: TrainerConfig) -> bool:
    """Whether disaggregated engines take the actor's weights through the object store rather
    than a broadcast: LoRA adapters for SGLang engines, which load an adapter only from tensors
    handed to them (SGLang 0.5.23 has no LoRA load from a broadcast group); adapters are small."""
    rollout = cfg.roles.rollout
    return (
        cfg.model.lora is not None
        and rollout.backend == "sglang"
        and not rollout.colocate_with_actor
    )


def dp_leaders(shards: list[dict[str, int]]) -> list[int]:
    """Index of the worker that speaks for each data-parallel rank (tensor, pipeline and
    context rank 0), in data-parallel order."""
    leaders = {
        s["dp_rank"]: i
        for i, s in enumerate(shards)
        if s["tp_rank"] == 0 and s["pp_rank"] == 0 and s["cp_rank"] == 0
    }
    return [leaders[d] for d in range(len(leaders))]


@dataclass(frozen=True)
class Topology:
    """The run's processes and modes (see the module's docstring)."""

    samples_per_step: int
    layout: tuple[tuple[str, int], ...]
    """The processes each owner role starts, in start order: the actor's, the critic's when it
    has its own, the engines' when they have their own."""
    tp: int
    """GPUs (actor workers, when colocated) one engine spans."""
    engines: int
    """Engines started with the run (elastic: minReplicas, the placement group's)."""
    has_critic: bool
    critic_with_actor: bool
    """The critic lives in the actor workers' processes."""
    colocated: bool
    """Engines share the actor workers' processes and GPUs."""
    offload: bool
    """Colocated engines release their memory while the actor trains
    (``RolloutRole.releases_memory``: ``offload``, for the backends whose engines free any)."""
    elastic: ElasticRollout | None
    """``roles.rollout.elastic`` (engines of their own only): engines may be lost and join."""
    partial: bool
    """Partial rollout: syncs are offered to engines mid-generation."""
    max_staleness: int
    weight_sync: WeightSyncMode
    weight_backend: Literal["nccl", "gloo"]
    """The broadcast group's backend (``weight_sync == "broadcast"``)."""
    gpu_roles: frozenset[str]
    """Roles whose processes hold GPUs."""
    reward_workers: int
    sandbox_workers: int

    @property
    def one_process(self) -> bool:
        """The whole run is one worker process: one actor worker, its engine and its critic (if
        any) colocated with it, so every role reads what another role wrote in that process
        (the rollout batch, the values, the returns) and hands it over in memory
        (:mod:`~ppojob_trainer.workers.handoff`). Reward and sandbox workers do not read those.
        Not with generation launched ahead (``maxStaleness``, which validation refuses for
        colocated engines): a later step's batch, put before this step's dynamic-sampling
        pick, would be dropped as stale when this step reads its own."""
        return self.colocated and self.layout == (("actor", 1),) and self.max_staleness == 0

    @property
    def critic_apart(self) -> bool:
        """The critic in processes of its own: its values reach the actor's prepare nested."""
        return self.has_critic and not self.critic_with_actor

    def device(self, role: str) -> str:
        return "cuda" if role in self.gpu_roles else "cpu"

    def hosted_roles(self, owner: str, rank: int, world: int) -> dict[str, tuple[int, int]]:
        """The roles (rank, world) a process of ``owner`` hosts: colocated ones live with the
        actor worker of their rank; a colocated engine, spanning ``tp`` actor GPUs, with the
        first actor worker of them."""
        hosted = {owner: (rank, world)}
        if owner == "actor" and self.critic_with_actor:
            hosted["critic"] = (rank, world)
        if owner == "actor" and self.colocated and rank % self.tp == 0:
            hosted["rollout"] = (rank // self.tp, self.engines)
        return hosted


def _weight_sync(cfg: TrainerConfig, elastic: ElasticRollout | None, partial: bool) -> str:
    rollout = cfg.roles.rollout
    if rollout.colocate_with_actor:
        return "colocated"
    if elastic is not None or partial or adapters_through_store(cfg):
        return "store"  # (any engine count; partial: offered beside a generation)
    if cfg.algorithm.max_staleness > 0 and rollout.resources.gpus == 0:
        return "deferred"
    return "broadcast"


def resolve_topology(cfg: TrainerConfig) -> Topology:
    """Every layout fact and mode of a run, from its config."""
    roles = cfg.roles
    critic = roles.effective_critic(cfg.algorithm.needs_critic)
    colocated = roles.rollout.colocate_with_actor
    critic_with_actor = critic is not None and critic.colocate_with_actor
    engines = engine_count(gang_config(cfg))
    layout: list[tuple[str, int]] = [("actor", roles.workers_of("actor"))]
    if critic is not None and not critic_with_actor:
        layout.append(("critic", roles.workers_of("critic")))
    if not colocated:
        layout.append(("rollout", engines))
    elastic = None if colocated else roles.rollout.elastic
    partial = cfg.algorithm.partial_rollout and not colocated
    specs = {"actor": roles.actor, "critic": critic, "rollout": roles.rollout}
    specs.update(reward=roles.reward, sandbox=roles.sandbox)
    gpu = roles.actor.resources.gpus > 0 and roles.rollout.resources.gpus > 0
    return Topology(
        samples_per_step=cfg.data.samples_per_step,
        layout=tuple(layout),
        tp=engine_tensor_size(cfg),
        engines=engines,
        has_critic=critic is not None,
        critic_with_actor=critic_with_actor,
        colocated=colocated,
        offload=roles.rollout.releases_memory,
        elastic=elastic,
        partial=partial,
        max_staleness=cfg.algorithm.max_staleness,
        weight_sync=_weight_sync(cfg, elastic, partial),  # type: ignore[arg-type]
        weight_backend="nccl" if gpu else "gloo",
        gpu_roles=frozenset(r for r, s in specs.items() if s is not None and s.resources.gpus > 0),
        reward_workers=roles.workers_of("reward"),
        sandbox_workers=roles.workers_of("sandbox"),
    )
