"""The PPO loop: one step written out like a training script (see :meth:`PPOTrainer.step`).

    generate -> reward -> [colocated engines sleep] -> values (refs) -> old/ref log-probs
    -> advantages -> critic updates -> actor update (after warm-up) -> [engines wake]
    -> weight sync -> metrics -> checkpoint

Bounded staleness (``algorithm.maxStaleness`` k): the same step, with the generation of the next
k steps launched at its start (:func:`~ppojob_trainer.algorithms.generation_window`), so the
engines generate them while the actor trains; k = 0 launches only the step's own, which is the
synchronous loop. Every token carries the policy version (weight sync) that generated it; the
actor refuses one older than k versions.

The driver (this module) holds no model and never pulls a tensor: it samples prompts, hands the
workers ObjectRefs and sample ranges, and reads back float metrics. Critic values travel from the
critic workers to the actor workers through the object store, routed by sample range, so actor
and critic may have different data-parallel sizes.
"""

from __future__ import annotations

import contextlib
import logging
import os
import random
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ppojob_api.failures import grace_problem
from ppojob_api.training import TrainerConfig

from .driver.topology import adapters_through_store, dp_leaders, gang_config, resolve_topology
from .preemption import Preempted, StopSignal, watch
from .watchdog import wait_or_name

log = logging.getLogger(__name__)


@dataclass
class TrainResult:
    """What a training run did."""

    steps: int
    """Steps run (including resumed ones)."""
    history: list[dict[str, float]] = field(default_factory=list)
    """Metrics of every step run in this process."""
    wall_s: float = 0.0
    """Wall time of the whole run, Ray start and worker start-up included."""
    setup_s: float = 0.0
    """Of which before the first step (Ray, placement, worker and model start-up)."""
    final_reward: float = float("nan")
    """Mean reward of the last step."""
    checkpoint: str | None = None
    """The last checkpoint written."""
    eval_reward: float | None = None
    """Mean reward of the last evaluation on data.evalPrompts (None without one)."""
    export: str | None = None
    """Where the Hugging Face export of the final models was written."""

    def time_to_reward(self, threshold: float) -> float | None:
        """Wall seconds from the run's start until a step's mean reward first reached
        ``threshold``, or None."""
        for m in self.history:
            if m["reward/mean"] >= threshold:
                return m["time/elapsed"]
        return None


def _rendezvous_address() -> tuple[str, int]:
    """Address and a free port on this node, for a process group's rendezvous."""
    import ray

    from .distributed import free_port

    host = ray.util.get_node_ip_address()
    return host, free_port(host)


def _ranges(n: int, size: int) -> list[tuple[int, int]]:
    from .workers.group import shard_range

    return [shard_range(n, size, r) for r in range(size)]


WEIGHT_GROUP = "ppojob-weights"
"""Name of the weight-update process group of disaggregated engines."""


@dataclass
class _Generation:
    """One step's generation, launched (its refs in flight or done)."""

    step: int
    ranges: list[tuple[int, int]]
    """Sample ranges, one per engine that generates."""
    gens: list[Any]
    """Refs of the engines' results (``{"batch": ref, "metrics", "span", "version"}``)."""
    engines: list[int]
    """The engines, in the order of ``gens``."""
    data_state: tuple[Any, dict[str, Any]] | None = None
    """The data order before this step's prompts were drawn (a checkpoint taken while it is
    in flight rewinds to it, so a resumed run draws the same prompts)."""
    parts: list[_Part] | None = None
    """Elastic engines: what each engine was given, to generate again elsewhere if it is lost
    (``gens`` are then the refs of the results without their batches)."""


@dataclass
class _Part:
    """One elastic engine's share of a step's generation."""

    lo: int
    hi: int
    """The step's samples ``[lo, hi)``."""
    examples: list[Any]
    first_sample: int
    seed: int
    host: Any
    batch: Any
    """Ref of the batch (a return value of the call: owned by the driver, so it outlives the
    engine)."""
    info: Any
    """Ref of the rest of the result (metrics, span, version)."""


@dataclass
class _Starting:
    """An elastic engine being started: its host, placement-group slot (None: outside the
    group) and the refs of its start-up calls."""

    host: Any
    slot: int | None
    ready: Any
    started: Any


class RolloutCapacityError(RuntimeError):
    """Fewer elastic rollout engines than ``minReplicas`` are left and none could be started."""


def _step_seed(seed: int, step: int, engine: int) -> int:
    return (seed * 1_000_003 + step * 7919 + engine) % (2**63 - 1)


class PPOTrainer:
    """Ray worker processes of all roles in one placement group, and the step."""

    def __init__(self, cfg: TrainerConfig, threads: dict[str, int] | None = None) -> None:
        import ray

        from .placement import (
            cluster_pins_roles,
            plan_placement,
            reserve_placement,
            wait_for_gang,
        )

        self.cfg = cfg
        self.topo = topo = resolve_topology(cfg)
        roles = cfg.roles
        critic = roles.effective_critic(cfg.algorithm.needs_critic)
        self.has_critic = topo.has_critic
        # On an operator-made cluster every pod advertises its role (`ppojob-actor`, ...): wait
        # for all of them (KubeRay submits before the workers join), then pin each role's
        # bundles to its own pods. A local Ray has no such resources. One timeout for both.
        budget = float(cfg.placement_timeout_seconds)
        # (elastic engines: the gang and the group hold minReplicas engines, see gang_config)
        gang = gang_config(cfg)
        waited = wait_for_gang(gang, budget)
        plan = plan_placement(gang, pin_roles=cluster_pins_roles(ray.cluster_resources()))
        self.placement = reserve_placement(plan, max(budget - waited, 1.0))
        self.all_hosts: list[Any] = []
        self.syncs = 0
        """Weight syncs so far: the policy version the actor and the engines hold between
        steps."""
        self.pending: dict[int, _Generation] = {}
        """Generation launched ahead of its step (maxStaleness > 0), by step."""
        self.launched = 0
        """Every step before this one has had its generation launched."""
        self.total_steps: int | None = None
        """The run's step count (:func:`train` sets it): no generation is launched past it."""
        self.elastic = topo.elastic
        """``roles.rollout.elastic``: engines may be lost mid-step and new ones join."""
        self.partial = topo.partial
        """Partial rollout: syncs are offered to engines mid-generation (object store)."""
        self.deferred_sync = topo.weight_sync == "deferred"
        """Bounded staleness with engines of their own on CPUs: the actor's leader publishes each
        sync's weights to the object store and the driver queues every engine's load of them
        ahead of its next generation, without waiting for it (an engine runs the driver's calls
        in order, so the version tags stay exact); neither the actor nor the driver waits for
        the engines (a broadcast would hold the actor's leader until each engine, still
        generating a later step, joins it). The loads are waited on at the next step."""
        self.loading: list[Any] = []
        """Refs of the engines' loads of the last deferred sync, not waited on yet."""
        self.starting: list[_Starting] = []
        """Elastic engines being started."""
        self.lost_engines = 0
        """Elastic engines lost so far."""
        self.failed_starts = 0
        """Elastic engines that could not start so far."""
        self.reward_replaced = 0
        """Reward workers (roles.reward) found lost and started again so far."""
        try:
            self._start(cfg, critic, threads)
        except BaseException:
            # A worker that fails to start (bad model path, reward module...) must not leave the
            # placement group and the workers already started holding the cluster.
            self.shutdown()
            raise

    def _start(self, cfg: TrainerConfig, critic: Any, threads: dict[str, int] | None) -> None:
        import ray

        from .models import cache_root
        from .workers.host import RemoteWorkerHost

        algo, roles = cfg.algorithm, cfg.roles
        n = cfg.data.samples_per_step
        cfg_json = cfg.model_dump_json(by_alias=True)

        topo = self.topo
        tp, engines, layout, hosted_roles = topo.tp, topo.engines, topo.layout, topo.hosted_roles
        self.critic_apart = topo.critic_apart
        self.colocated = topo.colocated
        self.offload = topo.offload

        # Built-in models are written once, here, before the workers of this machine load them
        # (workers writing the same one at once have been seen to remove each other's copy).
        from .models import BUILTIN_PREFIX, materialize_builtin

        for path in {cfg.model.path, cfg.model.critic_path or cfg.model.path}:
            if path.startswith(BUILTIN_PREFIX):
                materialize_builtin(path[len(BUILTIN_PREFIX) :], cfg.training.seed)

        self.hosts: dict[str, list[Any]] = {"actor": [], "critic": [], "rollout": []}
        all_hosts = self.all_hosts
        specs = {"actor": roles.actor, "critic": critic, "rollout": roles.rollout}
        for owner, world in layout:
            # Ray sets CUDA_VISIBLE_DEVICES to the GPUs a process holds: one per trained worker,
            # an engine's `tp` for a rollout process.
            device = "cuda" if specs[owner].resources.gpus > 0 else "cpu"
            # The rendezvous of the role's process group is on the node of its rank 0.
            rendezvous = None
            if world > 1 and owner != "rollout":
                # (a task in rank 0's bundle, holding its CPU share only while it runs)
                opts0 = {**self.placement.scheduling_options(owner, 0), "num_gpus": 0}
                address = ray.remote(_rendezvous_address).options(**opts0).remote()
                rendezvous = tuple(ray.get(address))
            for rank in range(world):
                hosted = hosted_roles(owner, rank, world)
                opts = self.placement.host_options(owner, rank)
                cpus = opts["num_cpus"]
                # Idle OpenMP threads must not spin: they would starve Ray's own threads of the
                # few cores between two tasks (measured: +100 ms per step on 2 cores).
                opts["runtime_env"] = {"env_vars": _worker_env()}
                nthreads = (threads or {}).get(owner) or max(1, round(cpus))
                if owner == "rollout":  # (how an elastic engine is started later)
                    self._engine_args = (cfg_json, nthreads, device, str(cache_root()))
                host_class = self._engine_class() if owner == "rollout" else RemoteWorkerHost
                handle = host_class.options(**opts).remote(
                    cfg_json,
                    hosted,
                    rendezvous,
                    nthreads,
                    device,
                    str(cache_root()),
                )
                for r in hosted:
                    self.hosts[r].append(handle)
                all_hosts.append(handle)
        self._reward_args: dict[int, tuple[dict[str, Any], tuple[Any, ...]]] = {}
        self.reward_hosts = self._start_reward(cfg_json, threads)
        self.reward_ranks = list(range(len(self.reward_hosts)))
        self.sandbox_hosts = self._start_sandbox(cfg_json)
        self.identities = ray.get([h.ready.remote() for h in all_hosts])
        extra_ids = ray.get([h.ready.remote() for h in [*self.reward_hosts, *self.sandbox_hosts]])
        failed = [i for i in [*self.identities, *extra_ids] if "error" in i]
        if failed:
            from .errors import StartupError

            roles_ = " and ".join(failed[0]["roles"])
            raise StartupError(f"the {roles_} worker could not start: {failed[0]['error']}")
        # Model-parallel workers (megatron) of one data-parallel rank share its samples: ranges
        # are per data-parallel rank, and one worker per rank (its leader) speaks for it.
        by_handle = {id(h): ident for h, ident in zip(all_hosts, self.identities, strict=True)}
        self.leaders = {
            role: dp_leaders([by_handle[id(h)][role] for h in self.hosts[role]])
            for role in ("actor", "critic")
            if self.hosts[role]
        }
        self.actor_ranges = _ranges(n, len(self.leaders["actor"]))
        self.critic_ranges = _ranges(n, len(self.leaders["critic"])) if self.has_critic else None
        # The processes on each engine's GPUs, its own first: colocated, the `tp` actor workers
        # of its bundle; otherwise the engine's own process.
        if self.colocated:
            actors = self.hosts["actor"]
            self.engine_groups = [actors[e * tp : (e + 1) * tp] for e in range(engines)]
        else:
            self.engine_groups = [[h] for h in self.hosts["rollout"]]
        gpus = {id(h): ident["gpus"] for h, ident in zip(all_hosts, self.identities, strict=True)}

        def visible(group: list[Any]) -> list[str] | None:
            return [g for h in group for g in gpus[id(h)]] if len(group) > 1 else None

        # (roles.reward: every engine gets the reward workers' handles and asks them itself)
        # (roles.sandbox: and the sandbox workers' handles, to send them its tool calls)
        rewarders = self.reward_hosts or None
        sandboxes = self.sandbox_hosts or None
        errors = ray.get(
            [
                g[0].start_rollout.remote(visible(g), rewarders, sandboxes)
                for g in self.engine_groups
            ]
        )
        if any(errors):
            from .errors import StartupError

            error = next(e for e in errors if e)
            raise StartupError(f"the rollout worker could not start: {error}")
        if self.elastic is not None:  # weights go through the object store (any engine count)
            self.engine_slots = {id(h): i for i, h in enumerate(self.hosts["rollout"])}
            self.free_slots: list[int] = []
            self.engine_seq = len(self.hosts["rollout"])
            self._top_up()
        elif (
            not self.colocated
            and not self.partial
            and not self.deferred_sync
            and not adapters_through_store(self.cfg)
        ):
            self._init_weight_group(tp)
        self.data_rng = random.Random(cfg.training.seed)
        from .algorithms import AdaptiveKLController, FixedKLController
        from .tasks import make_task

        self.task = make_task(
            cfg.data.prompts, cfg.data.prompt_key, cfg.data.label_key, cfg.data.shuffle
        )
        self.eval_examples = (
            make_task(
                cfg.data.eval_prompts, cfg.data.prompt_key, cfg.data.label_key, shuffle=False
            ).eval_set()
            if cfg.data.eval_prompts
            else []
        )
        kl = algo.kl
        self.kl_ctl = (
            AdaptiveKLController(kl.coefficient, kl.target, kl.horizon)
            if kl.target is not None
            else FixedKLController(kl.coefficient)
        )

    def _start_reward(self, cfg_json: str, threads: dict[str, int] | None) -> list[Any]:
        """The reward workers of ``roles.reward`` (none when unset), one per worker slot of the
        role's bundles, each loading every model source of data.rewards on its device."""
        from .workers.reward import RemoteRewardHost

        spec = self.cfg.roles.reward
        if spec is None:
            return []
        device = "cuda" if spec.resources.gpus > 0 else "cpu"
        world = self.cfg.roles.workers_of("reward")
        hosts = []
        for rank in range(world):
            opts = self.placement.host_options("reward", rank)
            opts["runtime_env"] = {"env_vars": _worker_env()}
            nthreads = (threads or {}).get("reward") or max(1, round(opts["num_cpus"]))
            args = (cfg_json, rank, world, nthreads, device)
            hosts.append(RemoteRewardHost.options(**opts).remote(*args))
            self._reward_args[rank] = (opts, args)
        return hosts

    def _replace_reward_workers(self) -> None:
        """``roles.reward``: reward workers found lost (their process gone; the engines already
        sent their parts to the others) are started again in their slot, and every engine
        scores on the new set: a step after a loss has the role's full capacity. A replacement
        that cannot start is left out (the engines go on with the workers left)."""
        import ray
        from ray.exceptions import RayActorError

        from .workers.reward import RemoteRewardHost

        if not self.reward_hosts:
            return
        pings = [h.scored_count.remote() for h in self.reward_hosts]
        dead = []
        for i, ping in enumerate(pings):
            try:
                ray.get(ping)
            except RayActorError:
                dead.append(i)
        if not dead:
            return
        new = {}
        for i in dead:
            with contextlib.suppress(Exception):  # (a process unreachable but alive)
                ray.kill(self.reward_hosts[i])
            opts, args = self._reward_args[self.reward_ranks[i]]
            new[i] = RemoteRewardHost.options(**opts).remote(*args)
        hosts, ranks = [], []
        for i, (host, rank) in enumerate(zip(self.reward_hosts, self.reward_ranks, strict=True)):
            if i in new:
                ref = new[i].ready.remote()
                limit = self.cfg.stall_timeout_seconds  # (None: wait)
                error = "not ready within stallTimeoutSeconds"
                try:
                    if ray.wait([ref], timeout=limit)[0]:
                        error = ray.get(ref).get("error")
                except RayActorError as exc:
                    error = f"its process died ({type(exc).__name__})"
                if error:
                    log.warning("roles.reward: a new reward worker could not start: %s", error)
                    with contextlib.suppress(Exception):
                        ray.kill(new[i])
                    continue
                host = new[i]
                self.reward_replaced += 1
            hosts.append(host)
            ranks.append(rank)
        log.warning(
            "roles.reward: %d reward worker(s) were lost, %d started again",
            len(dead),
            len(hosts) - len(self.reward_hosts) + len(dead),
        )
        self.reward_hosts, self.reward_ranks = hosts, ranks
        ray.get([g[0].set_reward_workers.remote(self.reward_hosts) for g in self.engine_groups])

    def _start_sandbox(self, cfg_json: str) -> list[Any]:
        """The sandbox workers of ``roles.sandbox`` (none when unset), one per worker slot of
        the role's bundles, each with its pool of tool processes for data.agent."""
        from .workers.sandbox import RemoteSandboxHost

        if self.cfg.roles.sandbox is None:
            return []
        world = self.cfg.roles.workers_of("sandbox")
        hosts = []
        for rank in range(world):
            opts = self.placement.host_options("sandbox", rank)
            opts["runtime_env"] = {"env_vars": _worker_env()}
            hosts.append(RemoteSandboxHost.options(**opts).remote(cfg_json, rank, world))
        return hosts

    def sandbox_calls(self) -> list[int]:
        """Tool calls each sandbox worker answered so far (``roles.sandbox``; empty when unset)."""
        import ray

        return ray.get([h.call_count.remote() for h in self.sandbox_hosts])

    def reward_scored(self) -> list[int]:
        """Samples each reward worker scored so far (``roles.reward``; empty when unset)."""
        import ray

        return ray.get([h.scored_count.remote() for h in self.reward_hosts])

    def _init_weight_group(self, tp: int) -> None:
        """Disaggregated engines: one weight-update group of the actor's leader (rank 0) and
        every engine's tensor-parallel ranks (engine ``e`` from rank ``1 + e * tp``)."""
        import ray

        leader, engines = self.hosts["actor"][0], self.hosts["rollout"]
        host, port = ray.get(leader.rendezvous_address.remote())
        world = 1 + len(engines) * tp
        gpu = self.cfg.roles.actor.resources.gpus > 0 and self.cfg.roles.rollout.resources.gpus > 0
        backend = "nccl" if gpu else "gloo"
        ray.get(
            [leader.init_weight_sender.remote(host, port, world, WEIGHT_GROUP, backend)]
            + [
                e.init_weights_update_group.remote(
                    host, port, 1 + i * tp, world, WEIGHT_GROUP, backend
                )
                for i, e in enumerate(engines)
            ]
        )

    def _sync_weights(self) -> list[Any]:
        """Start a weight sync; refs of its durations (seconds). Colocated: each engine loads
        the buckets its GPUs' actor workers stage; disaggregated: the actor's leader
        broadcasts bucket by bucket to every engine."""

        self.syncs += 1
        if self.colocated:
            # Every actor worker exports first, all at once: under FSDP the export is a
            # collective over all of them (megatron: over each data-parallel replica's), and an
            # engine spanning several workers' GPUs asks its peers for their buckets only after
            # its own export (a deadlock otherwise).
            # Each worker runs its calls in order, so its export precedes its buckets.
            for h in self.hosts["actor"]:
                h.export.remote(self.syncs)
            return [g[0].sync_colocated.remote(self.syncs, g[1:]) for g in self.engine_groups]
        if self.elastic is not None or adapters_through_store(self.cfg):
            self._sync_targets = list(self.hosts["rollout"])
            loaded, joined = self._push_weights(self._sync_targets, offer=self.partial)
            return [*loaded, *joined]
        if self.partial:  # offered beside the generation in progress, loaded between tokens
            loaded, joined = self._push_weights(self.hosts["rollout"], offer=True)
            return [*loaded, *joined]
        if self.deferred_sync:  # loads queued ahead of the engines' next generation
            loaded, joined = self._push_weights(self.hosts["rollout"])
            return [*loaded, *joined]
        leader, *others = self.hosts["actor"]
        joined = [h.join_export.remote(self.syncs) for h in others]  # a collective export
        sent = leader.broadcast_weights.remote(self.syncs, self.hosts["rollout"], WEIGHT_GROUP)
        return [sent, *joined]

    # ------------------------------------------------------------------------------------------
    def step(self, step: int) -> dict[str, float]:
        """One PPO step; returns its metrics (floats only)."""
        import ray

        from .algorithms import generation_window, plan_step

        cfg, algo = self.cfg, self.cfg.algorithm
        t0 = time.perf_counter()
        # 1. generate + reward: this step's generation, launched now or (maxStaleness > 0) at
        #    an earlier step's start; with it, that of the later steps the admission window
        #    takes (their samples will be at most maxStaleness versions old when trained on).
        window = generation_window(step, self.launched, algo.max_staleness, self.total_steps)
        lost_before = self.lost_engines
        self._replace_reward_workers()  # (roles.reward: lost ones started again)
        if self.elastic is not None:  # engines started since join now (with current weights)
            self._top_up()
            self._ensure_engines()
        for j in window:
            self.pending[j] = self._launch_generation(j)
        self.launched = max(self.launched, window.stop)
        current = self.pending.pop(step)
        ranges, gens, engines = current.ranges, current.gens, current.engines
        requeued = 0
        if self.elastic is not None:  # an engine lost now loses only its prompts (re-queued)
            ranges, gens, engines, requeued = self._settle(current)
        generated: list[dict[str, Any]] | None = None  # every round's results (dynamic sampling)
        ds_metrics: dict[str, float] = {}
        if algo.dynamic_sampling is not None:
            ranges, gens, engines, generated, ds_metrics = self._refill(step, current)
        version = self.syncs  # the actor's weights (and, at their sync, the engines')
        # Engines sharing the actor's GPUs free their weights and KV cache for training.
        if self.offload:
            ray.get([r.release_memory.remote() for r in self.hosts["rollout"]])

        # 2. values: each critic worker puts one object per actor worker; we keep only refs.
        value_lists = []
        if self.has_critic:
            value_lists = [
                c.compute_values.remote(ranges, self.actor_ranges, *gens)
                for c in self.hosts["critic"]
            ]

        # 3. old/ref log-probs, advantages and returns on the actor workers. A critic in
        #    processes of its own: the value refs go nested in a list, which Ray does not
        #    resolve before the call, so an actor worker computes its log-probs while the
        #    critic computes the values, and waits for them only when the advantages need them
        #    (a colocated critic has computed them before, in the same process).
        all_values = value_lists
        value_lists = [value_lists[i] for i in self.leaders.get("critic", [])]
        nested = value_lists if self.critic_apart else None
        prepared = [
            a.prepare.remote(
                ranges,
                self.critic_ranges,
                self.kl_ctl.value,
                *gens,
                *([] if nested is not None else value_lists),
                policy_version=version,
                value_refs=nested,
            )
            for a in self.hosts["actor"]
        ]
        prepared_leaders = [prepared[i] for i in self.leaders["actor"]]

        # 4. critic updates, 5. actor update (after warm-up).
        plan = plan_step(
            step,
            has_critic=self.has_critic,
            critic_warmup_steps=algo.critic_warmup_steps,
            critic_updates_per_step=algo.critic_updates_per_step,
        )
        critic_done = []
        if self.has_critic and plan.critic_updates:
            critic_done = [
                c.train_critic.remote(
                    step, self.actor_ranges, plan.critic_updates, *prepared_leaders
                )
                for c in self.hosts["critic"]
            ]
        actor_done = []
        if plan.actor_trains:
            actor_done = [a.train_actor.remote(step) for a in self.hosts["actor"]]

        # 6. colocated engines wake once training is done on all their GPUs; then every engine
        #    takes the new weights (in order, on the engine's process). A woken engine's weights
        #    were released, so it takes them even when the actor did not train.
        woken = []
        if self.offload:
            after = [*prepared, *critic_done, *actor_done]
            woken = [r.resume_memory.remote(*after) for r in self.hosts["rollout"]]
        synced = self._sync_weights() if plan.actor_trains or self.offload else []
        # (deferred sync: this step waits for the loads of the previous step's sync, and the
        #  loads of its own wait on the engines, ahead of their next generation)
        loaded_before, self.loading = self.loading, []
        if self.deferred_sync and synced:
            n_engines = len(self.hosts["rollout"])
            self.loading, synced = synced[:n_engines], synced[n_engines:]
        synced = [*loaded_before, *synced]

        # 7. metrics (floats only; the driver never fetches a tensor), once every worker has
        #    reported; one that has not within the stall timeout is named (watchdog.py).
        wait_or_name(
            [
                *(("rollout", e, "generate", r) for e, r in zip(engines, gens, strict=True)),
                *(("critic", i, "values", r) for i, r in enumerate(all_values)),
                *(("actor", i, "prepare", r) for i, r in enumerate(prepared)),
                *(("critic", i, "train", r) for i, r in enumerate(critic_done)),
                *(("actor", i, "train", r) for i, r in enumerate(actor_done)),
                *(("rollout", i, "wake", r) for i, r in enumerate(woken)),
                *(("rollout", i, "weight sync", r) for i, r in enumerate(synced)),
            ],
            cfg.stall_timeout_seconds,
        )
        sync_refs = synced
        if self.elastic is not None:  # an engine lost in the sync is dropped below
            synced = []
        groups = [gens, prepared, critic_done, actor_done, woken, synced]
        flat = ray.get([ref for group in groups for ref in group])  # one round trip
        out, pos = [], 0
        for group in groups:
            out.append(flat[pos : pos + len(group)])
            pos += len(group)
        gens, prep, critic_m, actor_m, _, sync_s = out
        if self.elastic is not None:  # (no sync at a step whose actor does not train)
            sync_s = self._collect_sync(sync_refs) if sync_refs else []
        prep = [prep[i] for i in self.leaders["actor"]]
        train_span = (
            min(p[1].pop("span/start") for p in prep),
            max(
                [p[1].pop("span/end") for p in prep]
                + [m.pop("span/end") for m in [*critic_m, *actor_m]]
            ),
        )
        metrics = self._metrics(gens, prep, critic_m, actor_m, sync_s)
        if generated is not None:  # the rewards and lengths of every sample generated
            metrics.update(self._generation_metrics(generated))
            metrics.update(ds_metrics)
        metrics["policy/version"] = float(version)
        if self.elastic is not None:
            metrics["rollout/engines"] = float(len(self.hosts["rollout"]))
            metrics["rollout/requeued"] = float(requeued)
            metrics["rollout/lost"] = float(self.lost_engines - lost_before)
        overlap = self._overlap(train_span, generated or gens)
        if algo.kl.coefficient > 0:
            self.kl_ctl.update(metrics.get("kl/mean", 0.0), cfg.data.samples_per_step)
            metrics["kl/coef"] = self.kl_ctl.value
        metrics["time/step"] = time.perf_counter() - t0
        metrics["time/overlap_share"] = min(overlap / metrics["time/step"], 1.0)
        tokens = metrics["response/length"] * cfg.data.samples_per_step
        metrics["time/tokens_per_second"] = tokens / metrics["time/step"]
        return metrics

    def _refill(
        self, step: int, first: _Generation
    ) -> tuple[list[tuple[int, int]], list[Any], list[int], list[dict[str, Any]], dict]:
        """DAPO's dynamic sampling: generate rounds of fresh prompts until the step has
        ``rolloutBatchSize`` groups whose rewards differ (or ``maxRounds`` rounds), then have
        each engine assemble its picked groups into one rollout part. Returns the step's
        ranges, part refs and engines, every round's (small) results, and the metrics."""
        import ray

        from .algorithms import fill_step

        cfg = self.cfg
        need, k = cfg.data.rollout_batch_size, cfg.data.samples_per_prompt
        max_rounds = cfg.algorithm.dynamic_sampling.max_rounds  # type: ignore[union-attr]
        rounds: list[_Generation] = []
        results: list[list[dict[str, Any]]] = []
        kept = 0
        while not rounds or (kept < need and len(rounds) < max_rounds):
            gen = first if not rounds else self._launch_generation(step, len(rounds))
            wait_or_name(
                [("rollout", e, "generate", r) for e, r in zip(gen.engines, gen.gens, strict=True)],
                cfg.stall_timeout_seconds,
            )
            rounds.append(gen)
            results.append(ray.get(gen.gens))
            kept += sum(len(res["informative"]) for res in results[-1])
        fill = fill_step(
            [
                (
                    [g for res in round_ for g in res["groups"]],
                    [g for res in round_ for g in res["informative"]],
                )
                for round_ in results
            ],
            need,
        )
        # which engine generated each group of each round, and its result's place per engine
        owner: dict[tuple[int, int], tuple[int, int]] = {}
        per_engine: dict[int, list[Any]] = {}
        for r, (gen, round_) in enumerate(zip(rounds, results, strict=True)):
            for e, ref, res in zip(gen.engines, gen.gens, round_, strict=True):
                refs = per_engine.setdefault(e, [])
                for g in res["groups"]:
                    owner[(r, g)] = (e, len(refs))
                refs.append(ref)
        picks: dict[int, list[tuple[int, int, bool]]] = {}
        for r, g, in_loss in fill.picked:
            e, pos = owner[(r, g)]
            picks.setdefault(e, []).append((pos, g, in_loss))
        ranges, parts, engines = [], [], []
        lo = 0
        for e in sorted(picks):
            hi = lo + len(picks[e]) * k
            host = self.hosts["rollout"][e]
            parts.append(host.select_groups.remote(lo, picks[e], *per_engine[e]))
            ranges.append((lo, hi))
            engines.append(e)
            lo = hi
        metrics = {
            "dynamic_sampling/generation_rounds": float(len(rounds)),
            "dynamic_sampling/filtered_groups": float(fill.filtered),
            "dynamic_sampling/kept_groups": float(need - fill.short),
            "dynamic_sampling/short_groups": float(fill.short),
        }
        generated = [res for round_ in results for res in round_]
        # rounds run one after another: generation time is their sum
        metrics["time/generate"] = sum(
            max(res["metrics"]["time/generate"] for res in round_) for round_ in results
        )
        return ranges, parts, engines, generated, metrics

    def _launch_generation(self, step: int, round_: int = 0) -> _Generation:
        """Draw step ``step``'s prompts and launch their generation: each engine samples a
        contiguous range of prompts (an engine left without prompts sits the step out). An
        engine runs its calls in order, so it generates with the weights of the last sync
        launched before this call. ``round_``: dynamic sampling's extra rounds of a step draw
        fresh prompts, numbered after the earlier rounds' (group ids stay distinct)."""
        cfg = self.cfg
        n_prompts = cfg.data.rollout_batch_size
        k = cfg.data.samples_per_prompt
        data_state = None
        if cfg.algorithm.max_staleness > 0:
            data_state = (self.data_rng.getstate(), self.task.state())
        examples = self.task.sample(n_prompts, self.data_rng)
        parts, engines = [], []
        offset = round_ * n_prompts
        elastic: list[_Part] | None = [] if self.elastic is not None else None
        for e, (p_lo, p_hi) in enumerate(_ranges(n_prompts, len(self.hosts["rollout"]))):
            if p_lo == p_hi:
                continue
            seed = _step_seed(cfg.training.seed, step, e + 1_000 * round_)
            host = self.hosts["rollout"][e]
            if elastic is not None:
                part = self._generate_on(
                    host, p_lo * k, examples[p_lo:p_hi], (offset + p_lo) * k, seed
                )
                elastic.append(part)
                ref = part.info
            else:
                ref = host.generate.remote(examples[p_lo:p_hi], (offset + p_lo) * k, seed)
            parts.append((p_lo * k, p_hi * k, ref))
            engines.append(e)
        ranges = [(lo, hi) for lo, hi, _ in parts]
        return _Generation(step, ranges, [ref for _, _, ref in parts], engines, data_state, elastic)

    # ---- elastic engines ---------------------------------------------------------------------
    def _generate_on(
        self, host: Any, lo: int, examples: list[Any], first_sample: int, seed: int
    ) -> _Part:
        """Launch an elastic engine's share: samples ``[lo, lo + len(examples) * k)``."""
        k = self.cfg.data.samples_per_prompt
        batch, info = host.generate_elastic.remote(examples, first_sample, seed)
        return _Part(lo, lo + len(examples) * k, examples, first_sample, seed, host, batch, info)

    def _settle(self, gen: _Generation) -> tuple[list[tuple[int, int]], list[Any], list[int], int]:
        """Wait for a step's elastic generation; the prompts of an engine lost meanwhile are
        generated again, split over the engines left (and those started to replace it), under
        their own sample numbers, so every prompt group is trained on once. Returns the
        step's ranges, refs of its results (with their batches), engine numbers and the count
        of prompts re-queued."""
        import ray
        from ray.exceptions import RayActorError

        k = self.cfg.data.samples_per_prompt
        todo, done = list(gen.parts or []), []
        requeued, attempt = 0, 0
        while todo:
            wait_or_name(
                [("rollout", i, "generate", p.info) for i, p in enumerate(todo)],
                self.cfg.stall_timeout_seconds,
            )
            lost = []
            for part in todo:
                try:
                    done.append((part, ray.get(part.info)))
                except RayActorError:
                    lost.append(part)
            if not lost:
                break
            self._drop_engines([p.host for p in lost])
            self._ensure_engines()
            attempt += 1
            todo = []
            live = self.hosts["rollout"]
            for part in lost:
                requeued += len(part.examples)
                for j, (lo, hi) in enumerate(_ranges(len(part.examples), len(live))):
                    if lo == hi:
                        continue
                    seed = _step_seed(part.seed, attempt, j)
                    todo.append(
                        self._generate_on(
                            live[j],
                            part.lo + lo * k,
                            part.examples[lo:hi],
                            part.first_sample + lo * k,
                            seed,
                        )
                    )
        done.sort(key=lambda d: d[0].lo)
        ranges = [(p.lo, p.hi) for p, _ in done]
        gens = [ray.put({**info, "batch": p.batch}) for p, info in done]
        return ranges, gens, list(range(len(done))), requeued

    def _drop_engines(self, hosts: list[Any]) -> None:
        """Forget lost elastic engines (each once), free their placement-group slots and start
        replacements where there is room."""
        import ray

        for host in hosts:
            if not any(h is host for h in self.hosts["rollout"]):
                continue  # (already dropped)
            self.hosts["rollout"] = [h for h in self.hosts["rollout"] if h is not host]
            self.all_hosts = [h for h in self.all_hosts if h is not host]
            slot = self.engine_slots.pop(id(host), None)
            if slot is not None:
                self.free_slots.append(slot)
            self.lost_engines += 1
            log.warning(
                "a rollout engine was lost; %d left (minReplicas %d)",
                len(self.hosts["rollout"]),
                self.elastic.min_replicas,  # type: ignore[union-attr]
            )
            try:  # (a process that is unreachable but alive must not hold its slot)
                ray.kill(host)
            except Exception:
                log.debug("could not kill a lost engine", exc_info=True)
        self.engine_groups = [[h] for h in self.hosts["rollout"]]
        self._top_up()

    def _top_up(self) -> None:
        """Start elastic engines until live and starting ones make maxReplicas: each in a free
        slot of the placement group, else outside it (it joins when there is room for it)."""

        elastic = self.elastic
        assert elastic is not None
        cfg_json, nthreads, device, cache = self._engine_args
        while len(self.hosts["rollout"]) + len(self.starting) < elastic.max_replicas:
            slot = self.free_slots.pop(0) if self.free_slots else None
            if slot is not None:
                opts = self.placement.host_options("rollout", slot)
            else:
                whole = self.placement.worker_slice("rollout")
                opts = {"num_cpus": whole.get("CPU", 0), "num_gpus": whole.get("GPU", 0)}
                custom = {k: v for k, v in whole.items() if k not in ("CPU", "GPU")}
                if custom:
                    opts["resources"] = custom
            opts["runtime_env"] = {"env_vars": _worker_env()}
            rank = self.engine_seq % elastic.max_replicas
            self.engine_seq += 1
            host = (
                self._engine_class()
                .options(**opts)
                .remote(
                    cfg_json,
                    {"rollout": (rank, elastic.max_replicas)},
                    None,
                    nthreads,
                    device,
                    cache,
                )
            )
            self.starting.append(
                _Starting(
                    host,
                    slot,
                    host.ready.remote(),
                    host.start_rollout.remote(
                        None,
                        getattr(self, "reward_hosts", None) or None,
                        getattr(self, "sandbox_hosts", None) or None,
                    ),
                )
            )

    def _admit_engines(self, wait_s: float = 0.0) -> None:
        """Elastic engines whose start finished join: each first takes the current weights.
        Waits up to ``wait_s`` seconds, and only while fewer than minReplicas are live; an
        engine that failed to start is dropped (its slot is tried again later)."""
        import ray
        from ray.exceptions import RayActorError

        elastic = self.elastic
        assert elastic is not None
        deadline = time.monotonic() + wait_s
        while self.starting:
            below = len(self.hosts["rollout"]) < elastic.min_replicas
            timeout = max(deadline - time.monotonic(), 0.0) if below else 0.0
            refs = [s.started for s in self.starting]
            ready, _ = ray.wait(refs, num_returns=1, timeout=timeout, fetch_local=False)
            if not ready:
                return
            new = next(s for s in self.starting if s.started == ready[0])
            self.starting.remove(new)
            try:
                ident = ray.get(new.ready)
                error = ident.get("error") or ray.get(new.started)
                if not error:  # the current weights, before it generates
                    loaded, joined = self._push_weights([new.host])
                    ray.get([*loaded, *joined])
            except RayActorError as exc:
                error = f"its process died ({type(exc).__name__})"
            if error:
                log.warning("a new rollout engine could not start: %s", error)
                self.failed_starts += 1
                if new.slot is not None:
                    self.free_slots.append(new.slot)
                try:
                    ray.kill(new.host)
                except Exception:
                    log.debug("could not kill an engine that failed to start", exc_info=True)
                continue
            self.hosts["rollout"].append(new.host)
            self.all_hosts.append(new.host)
            self.engine_groups = [[h] for h in self.hosts["rollout"]]
            if new.slot is not None:
                self.engine_slots[id(new.host)] = new.slot

    def _ensure_engines(self) -> None:
        """At least minReplicas elastic engines, waiting for new ones only while there are
        fewer (at most startTimeoutSeconds); else :class:`RolloutCapacityError`."""
        elastic = self.elastic
        assert elastic is not None
        self._admit_engines(float(elastic.start_timeout_seconds))  # (waits only while below)
        live = len(self.hosts["rollout"])
        if live < elastic.min_replicas:
            raise RolloutCapacityError(
                f"roles.rollout: {live} rollout engine(s) left, fewer than "
                f"elastic.minReplicas {elastic.min_replicas}, and no new one started within "
                f"startTimeoutSeconds {elastic.start_timeout_seconds} "
                f"({self.lost_engines} lost, "
                f"{self.failed_starts} failed to start, "
                f"{len(self.starting)} still starting); fix: give the rollout pods room "
                "(or lower elastic.minReplicas)"
            )

    def _engine_class(self) -> Any:
        """The Ray actor class of a rollout engine's process: with partial rollout one with a
        ``sync`` concurrency group, where weights are offered while the engine's own calls
        (one at a time, in order) generate."""
        from .workers.host import PartialRolloutHost, RemoteWorkerHost

        return PartialRolloutHost if self.partial else RemoteWorkerHost

    def _push_weights(
        self, engines: list[Any], *, offer: bool = False
    ) -> tuple[list[Any], list[Any]]:
        """The actor's current weights (policy ``self.syncs``) to ``engines`` through the object
        store: refs of their loads (``offer``: of their offers, which a generation in progress
        takes between two tokens), and of the other actor workers' share of a collective
        export."""
        leader, *others = self.hosts["actor"]
        joined = [h.join_export.remote(self.syncs) for h in others]
        published = leader.publish_weights.remote(self.syncs)
        if offer:
            sends = [
                e.offer_weights.options(concurrency_group="sync").remote(self.syncs, published)
                for e in engines
            ]
        else:
            sends = [e.load_weights.remote(self.syncs, published) for e in engines]
        return sends, joined

    def _collect_sync(self, refs: list[Any]) -> list[float]:
        """The durations of an elastic sync (:meth:`_sync_weights`); an engine lost in it is
        dropped (a replacement takes the weights when it joins)."""
        import ray
        from ray.exceptions import RayActorError

        engines = self._sync_targets
        out, lost = [], []
        for host, ref in zip(engines, refs[: len(engines)], strict=True):
            try:
                out.append(ray.get(ref))
            except RayActorError:
                lost.append(host)
        out += ray.get(refs[len(engines) :])
        if lost:
            self._drop_engines(lost)
        return out

    def _overlap(self, train_span: tuple[float, float], gens: list[dict[str, Any]]) -> float:
        """Seconds of this step's training (prepare to the end of the actor's update) during
        which an engine was generating: this step's samples or, launched ahead, later steps'
        (those finished by now)."""
        import ray

        from .algorithms import interval_overlap

        ahead = [ref for g in self.pending.values() for ref in g.gens]
        done, _ = ray.wait(ahead, num_returns=len(ahead), timeout=0) if ahead else ([], [])
        finished = ray.get(done) if self.elastic is None else _surviving(done)
        spans = [tuple(g["span"]) for g in [*gens, *finished]]
        return interval_overlap(train_span, spans)

    @staticmethod
    def _generation_metrics(gens: list[dict[str, Any]]) -> dict[str, float]:
        """Rewards and responses of the engines' results ``gens``."""
        n = sum(g["metrics"]["n"] for g in gens)

        def mean(key: str) -> float:
            return sum(g["metrics"].get(key, 0.0) for g in gens) / n

        out = {
            "reward/mean": mean("reward_sum"),
            "reward/overlong_penalty_mean": mean("overlong_penalty_sum"),
            "response/length": mean("length_sum"),
            "response/truncated_share": mean("truncated_sum"),
            "time/generate": max(g["metrics"].get("time/generate", 0.0) for g in gens),
        }
        if "switched_sum" in gens[0]["metrics"]:  # partial rollout: samples spanning versions
            out["rollout/switched_share"] = mean("switched_sum")
        for key in gens[0]["metrics"]:  # data.rewards: each source's unweighted mean
            if key.startswith("reward_sum/"):
                out[f"reward/{key.removeprefix('reward_sum/')}_mean"] = mean(key)
            elif key.startswith("reward_count/"):  # judges' unparsed verdicts: a count
                count = sum(g["metrics"].get(key, 0.0) for g in gens)
                out[f"reward/{key.removeprefix('reward_count/')}"] = count
            elif key.startswith("agent/") and key.endswith("_sum"):  # data.agent: per sample
                out[key.removesuffix("_sum") + "_mean"] = mean(key)
        return out

    @staticmethod
    def _metrics(
        gens: list[dict[str, Any]],
        prep: list[tuple[Any, dict[str, float]]],
        critic_m: list[dict[str, float]],
        actor_m: list[dict[str, float]],
        sync_s: list[float],
    ) -> dict[str, float]:
        n = sum(g["metrics"]["n"] for g in gens)
        out = PPOTrainer._generation_metrics(gens)
        out["time/prepare"] = max(p[1]["time/prepare"] for p in prep)
        if any("kl_sum" in p[1] for p in prep):
            out["kl/mean"] = sum(p[1].get("kl_sum", 0.0) for p in prep) / n
        tokens = sum(p[1]["tokens"] for p in prep)
        out["advantage/abs_mean"] = sum(p[1]["adv_abs_sum"] for p in prep) / max(tokens, 1.0)
        # |engine sampling log-prob - actor recomputed log-prob| on the same tokens
        out["rollout/logprob_diff_mean"] = sum(p[1]["logprob_diff_sum"] for p in prep) / max(
            tokens, 1.0
        )
        out["rollout/logprob_diff_max"] = max(p[1]["logprob_diff_max"] for p in prep)
        for group in (critic_m, actor_m):
            if group:
                for key in group[0]:
                    vals = [g[key] for g in group if key in g]
                    agg = max if key.startswith("time/") else (lambda v: sum(v) / len(v))
                    out[key] = agg(vals)
        if sync_s:
            out["time/weight_sync"] = max(sync_s)
        if any("staleness_sum" in p[1] for p in prep):  # per-token policy versions
            out["staleness/mean"] = sum(p[1]["staleness_sum"] for p in prep) / max(tokens, 1.0)
            out["staleness/max"] = max(p[1]["staleness_max"] for p in prep)
            s = 0
            while any(f"staleness_hist_{s}" in p[1] for p in prep):
                count = sum(p[1].get(f"staleness_hist_{s}", 0.0) for p in prep)
                out[f"staleness/share_{s}"] = count / max(tokens, 1.0)
                s += 1
        if any("is_tokens" in p[1] for p in prep):  # importanceSampling's weights
            is_tokens = max(sum(p[1]["is_tokens"] for p in prep), 1.0)
            out["is/weight_mean"] = sum(p[1]["is_raw_sum"] for p in prep) / is_tokens
            out["is/weight_max"] = max(p[1]["is_raw_max"] for p in prep)
            out["is/capped_share"] = sum(p[1]["is_capped"] for p in prep) / is_tokens
        return out

    def eval_due(self, done: int, total: int) -> bool:
        """Whether to evaluate after ``done`` steps of ``total`` (evalInterval, and the end)."""
        every = self.cfg.training.eval_interval
        return bool(self.eval_examples) and (done % every == 0 or done == total)

    def evaluate(self) -> dict[str, float]:
        """Greedy completions of the held-out prompts, split over the engines, scored. Elastic
        engines: the prompts of an engine lost meanwhile are evaluated again on the others
        (greedy decoding with the same weights gives the same completions)."""
        import ray
        from ray.exceptions import RayActorError

        examples = self.eval_examples
        todo, total = [(0, len(examples))], 0.0
        while todo:
            if self.elastic is not None:  # (at least minReplicas, or RolloutCapacityError)
                self._ensure_engines()
            engines = self.hosts["rollout"]
            calls = [
                (engines[e], lo + a, lo + b, engines[e].evaluate.remote(examples[lo + a : lo + b]))
                for lo, hi in todo
                for e, (a, b) in enumerate(_ranges(hi - lo, len(engines)))
                if b > a
            ]
            todo, lost = [], []
            for host, lo, hi, ref in calls:
                try:
                    total += ray.get(ref)["reward_sum"]
                except RayActorError:
                    if self.elastic is None:
                        raise
                    lost.append(host)
                    todo.append((lo, hi))
            if lost:
                self._drop_engines(lost)
        return {"eval/reward_mean": total / len(examples)}

    # ------------------------------------------------------------------------------------------
    def trained_roles(self) -> list[str]:
        return ["actor", "critic"] if self.has_critic else ["actor"]

    def save_workers(self, directory: Path) -> None:
        """Every actor (and critic) worker writes its own shard into ``directory/<role>``; the
        driver passes the path and waits, no tensor comes through it."""
        import ray

        ray.get(
            [
                h.save_checkpoint.remote(role, str(directory / role))
                for role in self.trained_roles()
                for h in self.hosts[role]
            ]
        )

    def state(self, step: int) -> dict[str, Any]:
        """The driver's own (small) checkpoint state: step, data order, KL coefficient, task,
        and every worker process's generators."""
        import ray

        # Generation launched ahead is not saved: a resumed run draws those steps' prompts
        # again, from the data order before the earliest of them.
        rng, task = self.data_rng.getstate(), self.task.state()
        ahead = [g for g in self.pending.values() if g.data_state is not None]
        if ahead:
            rng, task = min(ahead, key=lambda g: g.step).data_state  # type: ignore[misc]
        return {
            "step": step,
            "fingerprint": self.fingerprint(),
            "data_rng": rng,
            "kl_coef": self.kl_ctl.value,
            "task": task,
            # every worker process's generators (dropout, sampling helpers), in host order
            "rng": ray.get([h.rng_state.remote() for h in self.all_hosts]),
        }

    def fingerprint(self) -> dict[str, Any]:
        """The settings and the prompt data a checkpoint of this run depends on."""
        from .checkpoint import config_fingerprint

        return config_fingerprint(self.cfg, self.task.digest())

    def restore(self, state: dict[str, Any], path: Path | None = None) -> int:
        """Load a checkpoint into every worker (each reads its shard under ``path``); returns
        the number of steps already done."""
        import ray

        waits = []
        for role in self.trained_roles():
            if path is not None and (path / role).is_dir():
                waits += [
                    h.load_checkpoint.remote(role, str(path / role)) for h in self.hosts[role]
                ]
            elif role in state:  # a checkpoint written before per-worker shards
                waits += [h.set_state.remote(role, state[role]) for h in self.hosts[role]]
        rng = state.get("rng")
        if rng is not None and len(rng) == len(self.all_hosts):
            waits += [h.set_rng_state.remote(r) for h, r in zip(self.all_hosts, rng, strict=True)]
        else:
            log.warning(
                "checkpoint holds no RNG state for these %d worker processes; "
                "resuming with fresh generators",
                len(self.all_hosts),
            )
        ray.get(waits)
        ray.get(self._sync_weights())
        self.data_rng.setstate(_as_rng_state(state["data_rng"]))
        self.kl_ctl.value = float(state["kl_coef"])
        self.task.load_state(state.get("task", {}))
        return int(state["step"])

    def export_pretrained(self, directory: Path) -> Path:
        """Write the actor (``directory/actor``) and the critic (``directory/critic``, with its
        value head) as Hugging Face model directories with the tokenizer; on request at any
        time between steps, and at the end of :func:`train` (``exportHuggingFace``)."""
        import ray

        roles = []
        for role in self.trained_roles():
            spec = (
                self.cfg.roles.actor if role == "actor" else self.cfg.roles.effective_critic(True)
            )
            if spec is not None and spec.backend != "torch":
                log.warning("no Hugging Face export of the %s: backend %s", role, spec.backend)
            else:
                roles.append(role)
        ray.get(
            [
                h.export_pretrained.remote(role, str(directory / role))
                for role in roles
                for h in self.hosts[role]
            ]
        )
        return directory

    def shutdown(self) -> None:
        """Kill every worker started and release the placement group (safe to call twice)."""
        import ray

        hosts, self.all_hosts = list(getattr(self, "all_hosts", [])), []
        hosts += getattr(self, "reward_hosts", [])
        self.reward_hosts = []
        sandboxes = list(getattr(self, "sandbox_hosts", []))
        hosts += sandboxes
        self.sandbox_hosts = []
        hosts += [s.host for s in getattr(self, "starting", [])]
        self.starting = []
        engines = list(getattr(self, "hosts", {}).get("rollout", []))
        try:  # engines own processes of their own (sglang): stop them before their host
            ray.get([h.close.remote() for h in [*engines, *sandboxes]], timeout=60)
        except Exception:  # a dead or stuck host: killing it below is all that is left
            log.debug("could not close every engine", exc_info=True)
        for h in hosts:
            try:
                ray.kill(h)
            except Exception:  # already dead: keep releasing the rest
                log.debug("could not kill a worker host", exc_info=True)
        placement = getattr(self, "placement", None)
        if placement is not None:
            placement.release()


def _worker_env() -> dict[str, str]:
    """Environment of the worker processes: idle OpenMP threads must not spin (they would starve
    Ray's own threads of the few cores between two tasks: measured +100 ms per step on 2
    cores); and the tests' fault-injection gate, when one is set."""
    from .workers.host import FAULT_GATE_ENV
    from .workers.reward import REWARD_FAULT_GATE_ENV

    env = {"GOMP_SPINCOUNT": os.environ.get("GOMP_SPINCOUNT", "20000")}
    for gate in (FAULT_GATE_ENV, REWARD_FAULT_GATE_ENV):
        if os.environ.get(gate):
            env[gate] = os.environ[gate]
    return env


def _surviving(refs: list[Any]) -> list[Any]:
    """The values of finished ``refs``, less those of engines lost (elastic)."""
    import ray
    from ray.exceptions import RayActorError

    out = []
    for ref in refs:
        with contextlib.suppress(RayActorError):
            out.append(ray.get(ref))
    return out


def _as_rng_state(s: Any) -> tuple[Any, ...]:
    return (s[0], tuple(s[1]), s[2])


def train(
    cfg: TrainerConfig,
    out_dir: Path,
    reporter: Any,
    max_steps: int | None = None,
    threads: dict[str, int] | None = None,
    grace_seconds: float | None = None,
) -> TrainResult:
    """Run the PPO loop for ``cfg.training.steps`` steps (or ``max_steps``) and report progress.

    Starts a loopback-only local Ray unless one is running or ``RAY_ADDRESS`` names a cluster.
    Checkpoints go to ``training.checkpointDir`` (relative to ``out_dir``) every
    ``checkpointInterval`` steps and at the end; with ``resume`` the newest one is loaded first.
    A SIGTERM (or the preStop hook's stop file) ends the run after the step in flight with a
    checkpoint and raises :class:`~ppojob_trainer.preemption.Preempted` (``grace_seconds``, else
    ``$PPOJOB_GRACE_SECONDS``: the grace period it must fit in).
    """
    from .runtime import connect_ray

    t_start = time.perf_counter()
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    os.environ.setdefault("PPOJOB_CACHE_DIR", str(_default_cache(out_dir)))
    connect_ray()
    tr = cfg.training
    total = tr.steps if max_steps is None else min(tr.steps, max_steps)
    ckpt_dir = Path(tr.checkpoint_dir)
    if not ckpt_dir.is_absolute():
        ckpt_dir = out_dir / ckpt_dir
    trainer = PPOTrainer(cfg, threads=threads)
    trainer.total_steps = total
    result = TrainResult(steps=0)
    try:
        with watch(grace_seconds) as stop:
            _run_steps(trainer, cfg, ckpt_dir, reporter, result, total, t_start, stop)
    finally:
        trainer.shutdown()
    return result


def _run_steps(
    trainer: PPOTrainer,
    cfg: TrainerConfig,
    ckpt_dir: Path,
    reporter: Any,
    result: TrainResult,
    total: int,
    t_start: float,
    stop: StopSignal,
) -> None:
    """The steps of :func:`train`; a stop request ends them at a step boundary with a checkpoint
    (:class:`~ppojob_trainer.preemption.Preempted`)."""
    tr = cfg.training
    first = 0
    if tr.resume:
        first = _resume(trainer, ckpt_dir)
        result.checkpoint = _newest(ckpt_dir)
    result.setup_s = time.perf_counter() - t_start
    reporter.start(total, first)
    last_ckpt_step = first
    result.steps = first
    warned = False
    try:
        for step in range(first, total):
            if stop.requested:
                break
            stop.in_step = True
            try:
                metrics = trainer.step(step)
                if trainer.eval_due(step + 1, total):
                    metrics.update(trainer.evaluate())
                    result.eval_reward = metrics["eval/reward_mean"]
            finally:
                stop.in_step = False
            metrics["time/elapsed"] = time.perf_counter() - t_start
            result.history.append(metrics)
            result.steps = step + 1
            reporter.report(step + 1, metrics)
            due = tr.checkpoint_interval and (step + 1) % tr.checkpoint_interval == 0
            if due or stop.requested:
                t_ckpt = time.perf_counter()
                result.checkpoint = _save(
                    trainer, ckpt_dir, step + 1, tr.keep_checkpoints, reporter
                )
                stop.checkpoint_seconds = time.perf_counter() - t_ckpt
                last_ckpt_step = step + 1
                if not warned and stop.grace_seconds is not None:
                    problem = grace_problem(
                        int(stop.grace_seconds), metrics["time/step"], stop.checkpoint_seconds
                    )
                    if problem:
                        log.warning("%s", problem)
                        warned = True
    except KeyboardInterrupt:
        if not stop.abandoned:
            raise
        # the grace period ran out mid-step: what the newest complete checkpoint holds survives
        raise Preempted(last_ckpt_step, _newest(ckpt_dir), stop.cause or "stop", True) from None
    if stop.requested:
        raise Preempted(result.steps, result.checkpoint, stop.cause or "stop", False)
    if result.steps and result.steps != last_ckpt_step:
        result.checkpoint = _save(trainer, ckpt_dir, result.steps, tr.keep_checkpoints, reporter)
    if tr.export_hugging_face and result.steps > first:
        result.export = str(_export(trainer, ckpt_dir, result.steps))
    result.steps = max(result.steps, first)
    if result.history:
        result.final_reward = result.history[-1]["reward/mean"]
    result.wall_s = time.perf_counter() - t_start
    evaluated = {} if result.eval_reward is None else {"eval/reward_mean": result.eval_reward}
    reporter.finish(
        {
            "steps": result.steps,
            "final_reward": result.final_reward,
            "wall_s": result.wall_s,
            "time_to_0.9_s": result.time_to_reward(0.9),
            **evaluated,
        }
    )


def _newest(ckpt_dir: Path) -> str | None:
    from .checkpoint import latest_checkpoint

    path = latest_checkpoint(ckpt_dir)
    return str(path) if path is not None else None


def _default_cache(out_dir: Path) -> Path:
    return Path.home() / ".cache" / "ppojob" if os.access(Path.home(), os.W_OK) else out_dir


def _save(
    trainer: PPOTrainer,
    ckpt_dir: Path,
    step: int,
    keep: int,
    reporter: Any = None,
) -> str | None:
    """A checkpoint: the workers write their shards, then the driver its small state; the
    directory becomes complete (atomically) only after both. The reporter then hears which
    complete checkpoints are kept (`kubectl ppojob checkpoints` reads them from the status)."""
    from .checkpoint import checkpoint_writer, complete_checkpoints, step_dir_name

    with checkpoint_writer(ckpt_dir, step, keep) as writer:
        trainer.save_workers(writer.path)
        for key, value in trainer.state(step).items():
            writer.save(key, value)
    hook = getattr(reporter, "checkpointed", None)  # (reporters of tests may lack it)
    if hook is not None:
        hook([(int(p.name.split("-")[-1]), str(p)) for p in complete_checkpoints(ckpt_dir)])
    return str(ckpt_dir / step_dir_name(step))


def _export(trainer: PPOTrainer, ckpt_dir: Path, step: int) -> Path:
    """Hugging Face export of the actor (and critic) under ``<checkpointDir>/hf/step-N/``."""
    from .checkpoint import step_dir_name

    return trainer.export_pretrained(ckpt_dir / "hf" / step_dir_name(step))


def _resume(trainer: PPOTrainer, ckpt_dir: Path) -> int:
    from .checkpoint import check_fingerprint, latest_checkpoint, load_checkpoint

    path = latest_checkpoint(ckpt_dir)
    if path is None:
        return 0
    log.info("resuming from %s", path)
    state = load_checkpoint(path)
    check_fingerprint(state.get("fingerprint"), trainer.fingerprint(), path)
    return trainer.restore(state, path)


__all__ = ["PPOTrainer", "TrainResult", "train"]
