"""Starting the run's worker processes: the placement group, the processes of the actor, the
critic and the engines, the reward and sandbox workers, and (elastic) engines started later."""

from __future__ import annotations

import logging
import os
from typing import Any

import ray

from ppojob_api.training import TrainerConfig

from ..distributed import nccl_env, rendezvous_port
from ..errors import StartupError
from ..models import BUILTIN_PREFIX, cache_root, materialize_builtin
from ..placement import cluster_pins_roles, plan_placement, reserve_placement, wait_for_gang
from ..watchdog import WATCHDOG
from ..workers.host import FAULT_GATE_ENV, HANG_GATE_ENV, PartialRolloutHost, RemoteWorkerHost
from ..workers.reward import REWARD_FAULT_GATE_ENV, RemoteRewardHost
from ..workers.sandbox import RemoteSandboxHost
from .groups import Group, Groups, ranges
from .topology import Topology, dp_leaders, gang_config

log = logging.getLogger(__name__)

CLOSE_S = 60.0
"""How long shutdown waits for engines and sandbox workers to stop their own processes."""
CLOSE_AFTER_STALL_S = 5.0
"""The same after a stall (a hung worker's host never answers: it is killed after this) or a
stop (SIGTERM: the grace period runs)."""


def worker_env() -> dict[str, str]:
    """Environment of the worker processes: idle OpenMP threads must not spin (they would starve
    Ray's own threads of the few cores between two tasks: measured +100 ms per step on 2
    cores); one NCCL setting for all of them, what SGLang's engine sets in its own
    (:func:`~..distributed.nccl_env`), before any of them creates a process group; and the
    tests' fault-injection gate, when one is set."""
    env = {"GOMP_SPINCOUNT": os.environ.get("GOMP_SPINCOUNT", "20000"), **nccl_env()}
    for gate in (FAULT_GATE_ENV, REWARD_FAULT_GATE_ENV, HANG_GATE_ENV):
        if os.environ.get(gate):
            env[gate] = os.environ[gate]
    return env


def rendezvous_address() -> tuple[str, int]:
    """Address and a free port on this node, for a process group's rendezvous, with no store
    left at its path by a killed run (:func:`~..distributed.rendezvous_port`): the role's ranks
    meet in a ``FileStore`` named after the port on a local run."""
    host = ray.util.get_node_ip_address()
    return host, rendezvous_port(host)


class Cluster:
    """The placement group and every process the driver starts in it (or, elastic engines
    beyond the group, beside it); :meth:`shutdown` kills them all."""

    def __init__(self, cfg: TrainerConfig, topo: Topology, threads: dict[str, int] | None):
        self.cfg, self.topo, self.threads = cfg, topo, threads or {}
        self.cfg_json = cfg.model_dump_json(by_alias=True)
        # On an operator-made cluster every pod advertises its role (`ppojob-actor`, ...): wait
        # for all of them (KubeRay submits before the workers join), then pin each role's
        # bundles to its own pods. A local Ray has no such resources. One timeout for both.
        budget = float(cfg.placement_timeout_seconds)
        # (elastic engines: the gang and the group hold minReplicas engines, see gang_config)
        gang = gang_config(cfg)
        waited = wait_for_gang(gang, budget)
        plan = plan_placement(gang, pin_roles=cluster_pins_roles(ray.cluster_resources()))
        self.placement = reserve_placement(plan, max(budget - waited, 1.0))
        self.started: list[Any] = []
        """Every process started, in start order (those lost since too)."""
        self.hosts: dict[str, list[Any]] = {"actor": [], "critic": [], "rollout": []}
        """The processes of :meth:`start_hosts`, by hosted role, as they start."""
        self.engine_threads = 1
        """Torch threads of an engine's process (how an elastic engine is started later)."""

    def _options(self, role: str, rank: int) -> tuple[dict[str, Any], int]:
        """Ray options of a role's worker slot, and its torch thread count."""
        opts = self.placement.host_options(role, rank)
        # Idle OpenMP threads must not spin: they would starve Ray's own threads of the few
        # cores between two tasks (measured: +100 ms per step on 2 cores).
        opts["runtime_env"] = {"env_vars": worker_env()}
        return opts, self.threads.get(role) or max(1, round(opts["num_cpus"]))

    def engine_class(self) -> Any:
        """The Ray actor class of a rollout engine's process: with partial rollout one with a
        ``sync`` concurrency group, where weights are offered while the engine's own calls
        (one at a time, in order) generate."""
        return PartialRolloutHost if self.topo.partial else RemoteWorkerHost

    def start_hosts(self) -> tuple[dict[str, list[Any]], list[Any]]:
        """The processes of the actor, the critic and the engines (colocated roles in the
        actor's): by hosted role, and each once in start order."""
        # Built-in models are written once, here, before the workers of this machine load them
        # (workers writing the same one at once have been seen to remove each other's copy).
        for path in {self.cfg.model.path, self.cfg.model.critic_path or self.cfg.model.path}:
            if path.startswith(BUILTIN_PREFIX):
                materialize_builtin(path[len(BUILTIN_PREFIX) :], self.cfg.training.seed)
        hosts = self.hosts
        all_hosts: list[Any] = []
        for owner, world in self.topo.layout:
            # Ray sets CUDA_VISIBLE_DEVICES to the GPUs a process holds: one per trained worker,
            # an engine's `tp` for a rollout process.
            device = self.topo.device(owner)
            rendezvous = self._rendezvous(owner) if world > 1 and owner != "rollout" else None
            for rank in range(world):
                hosted = self.topo.hosted_roles(owner, rank, world)
                opts, nthreads = self._options(owner, rank)
                if owner == "rollout":
                    self.engine_threads = nthreads
                host_class = self.engine_class() if owner == "rollout" else RemoteWorkerHost
                handle = host_class.options(**opts).remote(
                    self.cfg_json,
                    hosted,
                    rendezvous,
                    nthreads,
                    device,
                    str(cache_root()),
                    one_process=self.topo.one_process,
                )
                for r in hosted:
                    hosts[r].append(handle)
                all_hosts.append(handle)
                self.started.append(handle)
        return hosts, all_hosts

    def _rendezvous(self, owner: str) -> tuple[str, int]:
        """The rendezvous of a role's process group, on the node of its rank 0 (a task in rank
        0's bundle, holding its CPU share only while it runs)."""
        opts0 = {**self.placement.scheduling_options(owner, 0), "num_gpus": 0}
        ref = ray.remote(rendezvous_address).options(**opts0).remote()
        return tuple(WATCHDOG.get(ref, owner, "rendezvous"))

    def start_reward(self) -> tuple[list[Any], dict[int, tuple[dict[str, Any], tuple[Any, ...]]]]:
        """The reward workers of ``roles.reward`` (none when unset), one per worker slot of the
        role's bundles, each loading every model source of data.rewards on its device; with
        how each was started, by rank (to start it again)."""
        world = self.topo.reward_workers
        hosts, how = [], {}
        for rank in range(world):
            opts, nthreads = self._options("reward", rank)
            args = (self.cfg_json, rank, world, nthreads, self.topo.device("reward"))
            hosts.append(self.start_reward_worker(opts, args))
            how[rank] = (opts, args)
        return hosts, how

    def start_reward_worker(self, opts: dict[str, Any], args: tuple[Any, ...]) -> Any:
        handle = RemoteRewardHost.options(**opts).remote(*args)
        self.started.append(handle)
        return handle

    def start_sandbox(self) -> list[Any]:
        """The sandbox workers of ``roles.sandbox`` (none when unset), one per worker slot of
        the role's bundles, each with its pool of tool processes for data.agent."""
        world = self.topo.sandbox_workers
        hosts = []
        for rank in range(world):
            opts, _ = self._options("sandbox", rank)
            hosts.append(RemoteSandboxHost.options(**opts).remote(self.cfg_json, rank, world))
            self.started.append(hosts[-1])
        return hosts

    def groups(
        self, hosts: dict[str, list[Any]], all_hosts: list[Any], helpers: list[Any]
    ) -> Groups:
        """The role groups of :meth:`start_hosts`' processes, once every one of them (and
        ``helpers``: reward and sandbox workers) reported ready; :class:`StartupError` naming
        one that could not start."""
        identities = WATCHDOG.get([h.ready.remote() for h in all_hosts], "worker", "start")
        extra_ids = WATCHDOG.get([h.ready.remote() for h in helpers], "helper", "start")
        failed = [i for i in [*identities, *extra_ids] if "error" in i]
        if failed:
            roles_ = " and ".join(failed[0]["roles"])
            raise StartupError(f"the {roles_} worker could not start: {failed[0]['error']}")
        # Model-parallel workers (megatron) of one data-parallel rank share its samples: ranges
        # are per data-parallel rank, and one worker per rank (its leader) speaks for it.
        by_handle = {id(h): ident for h, ident in zip(all_hosts, identities, strict=True)}
        n, role_groups = self.topo.samples_per_step, {}
        for role in ("actor", "critic"):
            leaders = dp_leaders([by_handle[id(h)][role] for h in hosts[role]])
            sizes = ranges(n, len(leaders)) if hosts[role] else None
            role_groups[role] = Group(hosts[role], leaders, sizes)
        tp, engines = self.topo.tp, self.topo.engines
        if self.topo.colocated:
            engine_groups = [hosts["actor"][e * tp : (e + 1) * tp] for e in range(engines)]
        else:
            engine_groups = [[h] for h in hosts["rollout"]]
        return Groups(
            role_groups["actor"],
            role_groups["critic"],
            Group(hosts["rollout"]),
            engine_groups,
            all_hosts,
            identities,
        )

    def start_rollout(self, groups: Groups, rewarders: list[Any], sandboxes: list[Any]) -> None:
        """Every engine starts on the GPUs of its processes; it gets the reward workers'
        handles (roles.reward: it asks them itself) and the sandbox workers' (roles.sandbox:
        it sends them its tool calls)."""
        gpus = {
            id(h): ident["gpus"]
            for h, ident in zip(groups.all_hosts, groups.identities, strict=True)
        }

        def visible(group: list[Any]) -> list[str] | None:
            return [g for h in group for g in gpus[id(h)]] if len(group) > 1 else None

        errors = WATCHDOG.get(
            [
                g[0].start_rollout.remote(visible(g), rewarders or None, sandboxes or None)
                for g in groups.engine_groups
            ],
            "rollout",
            "start",
        )
        if any(errors):
            error = next(e for e in errors if e)
            raise StartupError(f"the rollout worker could not start: {error}")

    def engine_options(self, slot: int | None) -> dict[str, Any]:
        """Ray options of an elastic engine: a free slot of the placement group, else (None) a
        worker slot's resources outside it."""
        if slot is not None:
            opts = self.placement.host_options("rollout", slot)
        else:
            whole = self.placement.worker_slice("rollout")
            opts = {"num_cpus": whole.get("CPU", 0), "num_gpus": whole.get("GPU", 0)}
            custom = {k: v for k, v in whole.items() if k not in ("CPU", "GPU")}
            if custom:
                opts["resources"] = custom
        opts["runtime_env"] = {"env_vars": worker_env()}
        return opts

    def start_engine(self, opts: dict[str, Any], rank: int, world: int) -> Any:
        """An elastic engine's process (rank ``rank`` of ``world``), not yet started."""
        device = self.topo.device("rollout")
        handle = (
            self.engine_class()
            .options(**opts)
            .remote(
                self.cfg_json,
                {"rollout": (rank, world)},
                None,
                self.engine_threads,
                device,
                str(cache_root()),
            )
        )
        self.started.append(handle)
        return handle

    def shutdown(self, closing: list[Any], stopping: bool = False) -> None:
        """Kill every process started and release the placement group (safe to call twice);
        ``closing`` (engines and sandbox workers, which own processes of their own: sglang,
        tool pools) are asked to stop those first."""
        hosts, self.started = self.started, []
        # after a stall a hung worker would hold its host's close call for the whole bound; so
        # would an engine still generating or evaluating when a stop ended the run, whose grace
        # period is running
        bound = CLOSE_AFTER_STALL_S if WATCHDOG.stalled or stopping else CLOSE_S
        try:
            WATCHDOG.get_within([h.close.remote() for h in closing], bound)
        except Exception:  # a dead or stuck host: killing it below is all that is left
            log.debug("could not close every engine", exc_info=True)
        for h in hosts:
            try:
                ray.kill(h)
            except Exception:  # already dead: keep releasing the rest
                log.debug("could not kill a worker host", exc_info=True)
        self.placement.release()
