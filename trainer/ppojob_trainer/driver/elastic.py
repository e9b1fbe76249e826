"""Pools of workers that come and go during a run: elastic rollout engines
(``roles.rollout.elastic``: dropped when lost, topped up to maxReplicas, admitted with the
current weights) and the reward workers (``roles.reward``: started again when lost)."""

from __future__ import annotations

import contextlib
import logging
import time
from dataclasses import dataclass
from typing import Any

import ray
from ray.exceptions import RayActorError

from ppojob_api.trainspec.roles import ElasticRollout

from ..watchdog import WATCHDOG, StallError
from .cluster import Cluster
from .groups import Groups, ranges, step_seed
from .weights import ElasticSync

log = logging.getLogger(__name__)


class RolloutCapacityError(RuntimeError):
    """Fewer elastic rollout engines than ``minReplicas`` are left and none could be started."""


@dataclass
class Part:
    """One elastic engine's share of a step's generation."""

    lo: int
    hi: int
    """The step's samples ``[lo, hi)``."""
    examples: list[Any]
    first_sample: int
    seed: int
    host: Any
    batch: Any
    """Ref of the batch (a return value of the call: owned by the driver, so the ref outlives
    the engine; a batch above Ray's inline size lives in the engine's node until fetched)."""
    info: Any
    """Ref of the rest of the result (metrics, span, version)."""


@dataclass
class Starting:
    """An elastic engine being started: its host, placement-group slot (None: outside the
    group) and the refs of its start-up calls."""

    host: Any
    slot: int | None
    ready: Any
    started: Any


def surviving(refs: list[Any]) -> list[Any]:
    """The values of finished ``refs``, less those of engines lost."""
    out = []
    for ref in refs:
        with contextlib.suppress(RayActorError):
            out.append(WATCHDOG.get(ref, "rollout", "generate ahead"))
    return out


class RewardWorkers:
    """The reward workers of ``roles.reward`` (none when unset), and how each was started."""

    def __init__(self, cluster: Cluster, stall_timeout: float | None) -> None:
        self.cluster, self.stall_timeout = cluster, stall_timeout
        self.hosts, self.how = cluster.start_reward()
        self.ranks = list(range(len(self.hosts)))
        self.replaced = 0
        """Reward workers found lost and started again so far."""
        self.released: list[str] = []
        """Actor ids (hex) of the reward workers let go of (lost, or replacements that could
        not start): :attr:`ElasticEngines.released`."""

    def scored(self) -> list[int]:
        """Samples each reward worker scored so far."""
        return WATCHDOG.get(
            [h.scored_count.remote() for h in self.hosts], "reward", "count", self.ranks
        )

    def replace_lost(self, engine_groups: list[list[Any]]) -> None:
        """Reward workers found lost (their process gone; the engines already sent their parts
        to the others) are started again in their slot, and every engine scores on the new
        set: a step after a loss has the role's full capacity. A replacement that cannot start
        is left out (the engines go on with the workers left)."""
        if not self.hosts:
            return
        pings = [h.scored_count.remote() for h in self.hosts]
        dead = []
        for i, ping in enumerate(pings):
            try:
                WATCHDOG.get(ping, "reward", "ping", [self.ranks[i]])
            except RayActorError:
                dead.append(i)
        if not dead:
            return
        new = {}
        for i in dead:
            self.released.append(self.hosts[i]._actor_id.hex())
            with contextlib.suppress(Exception):  # (a process unreachable but alive)
                ray.kill(self.hosts[i])
            new[i] = self.cluster.start_reward_worker(*self.how[self.ranks[i]])
        hosts, ranks = [], []
        for i, (host, rank) in enumerate(zip(self.hosts, self.ranks, strict=True)):
            if i in new:
                if not self._started(new[i]):
                    continue
                host = new[i]
                self.replaced += 1
            hosts.append(host)
            ranks.append(rank)
        log.warning(
            "roles.reward: %d reward worker(s) were lost, %d started again",
            len(dead),
            len(hosts) - len(self.hosts) + len(dead),
        )
        self.hosts, self.ranks = hosts, ranks
        refs = [g[0].set_reward_workers.remote(self.hosts) for g in engine_groups]
        WATCHDOG.get(refs, "rollout", "set reward workers")

    def _started(self, host: Any) -> bool:
        """Whether a new reward worker started (within stallTimeoutSeconds); killed if not."""
        ref = host.ready.remote()
        error = "not ready within stallTimeoutSeconds"
        try:
            if WATCHDOG.first_ready([ref], WATCHDOG.limit):  # (None: wait)
                error = WATCHDOG.get(ref, "reward", "start").get("error")
        except RayActorError as exc:
            error = f"its process died ({type(exc).__name__})"
        if error:
            log.warning("roles.reward: a new reward worker could not start: %s", error)
            self.released.append(host._actor_id.hex())
            with contextlib.suppress(Exception):
                ray.kill(host)
        return not error


class ElasticEngines:
    """Elastic engines: lost ones are dropped (their prompts generated again elsewhere), new
    ones started up to maxReplicas, in free slots of the placement group or beside it, and
    admitted with the current weights; weights reach them through the object store
    (:attr:`sync`, any engine count)."""

    def __init__(
        self,
        spec: ElasticRollout,
        cluster: Cluster,
        groups: Groups,
        helpers: tuple[RewardWorkers, list[Any]],
        samples_per_prompt: int,
        stall_timeout: float | None,
    ) -> None:
        self.spec, self.cluster, self.groups = spec, cluster, groups
        self.rewards, self.sandboxes = helpers
        self.k, self.stall_timeout = samples_per_prompt, stall_timeout
        self.sync = ElasticSync(groups, cluster.topo.partial, self.drop)
        self.slots = {id(h): i for i, h in enumerate(groups.rollout.handles)}
        self.free_slots: list[int] = []
        self.seq = len(groups.rollout.handles)
        self.starting: list[Starting] = []
        self.lost = 0
        """Engines lost so far."""
        self.failed_starts = 0
        """Engines that could not start so far."""
        self.released: list[str] = []
        """Actor ids (hex) of the engines let go of (lost, or failed to start). The GCS lists
        such an actor alive for a while after its process is gone (until its node is marked
        dead), and its node drains meanwhile (a pod deleted: ``ray start`` got its SIGTERM): the
        run no longer needs it, so that drain is no reason to stop the job
        (:meth:`~.trainer.PPOTrainer.expendable_actors`). Appended to only (read from the stop
        watcher's thread)."""
        self.lost_at_step = 0
        self.requeued = 0
        """Prompts of the current step generated again after their engine was lost."""
        self.top_up()

    # ---- the pool ----------------------------------------------------------------------------
    def begin_step(self) -> None:
        """Engines started since join now (with the current weights); at least minReplicas."""
        self.lost_at_step, self.requeued = self.lost, 0
        self.top_up()
        self.ensure()

    def metrics(self) -> dict[str, float]:
        """The step's engines, prompts re-queued and engines lost."""
        return {
            "rollout/engines": float(len(self.groups.rollout.handles)),
            "rollout/requeued": float(self.requeued),
            "rollout/lost": float(self.lost - self.lost_at_step),
        }

    def drop(self, hosts: list[Any]) -> None:
        """Forget lost engines (each once), free their placement-group slots and start
        replacements where there is room."""
        for host in hosts:
            aid = host._actor_id.hex()
            if aid not in self.released:  # (before it leaves the live list: read meanwhile)
                self.released.append(aid)
            if not self.groups.drop_engine(host):
                continue  # (already dropped)
            slot = self.slots.pop(id(host), None)
            if slot is not None:
                self.free_slots.append(slot)
            self.lost += 1
            log.warning(
                "a rollout engine was lost; %d left (minReplicas %d)",
                len(self.groups.rollout.handles),
                self.spec.min_replicas,
            )
            try:  # (a process that is unreachable but alive must not hold its slot)
                ray.kill(host)
            except Exception:
                log.debug("could not kill a lost engine", exc_info=True)
        self.top_up()

    def top_up(self) -> None:
        """Start engines until live and starting ones make maxReplicas: each in a free slot of
        the placement group, else outside it (it joins when there is room for it)."""
        world = self.spec.max_replicas
        while len(self.groups.rollout.handles) + len(self.starting) < world:
            slot = self.free_slots.pop(0) if self.free_slots else None
            opts = self.cluster.engine_options(slot)
            rank = self.seq % world
            self.seq += 1
            host = self.cluster.start_engine(opts, rank, world)
            ready = host.ready.remote()
            rewarders, sandboxes = self.rewards.hosts or None, self.sandboxes or None
            started = host.start_rollout.remote(None, rewarders, sandboxes)
            self.starting.append(Starting(host, slot, ready, started))

    def admit(self, wait_s: float = 0.0) -> None:
        """Engines whose start finished join: each first takes the current weights. Waits up
        to ``wait_s`` seconds, and only while fewer than minReplicas are live; an engine that
        failed to start is dropped (its slot is tried again later)."""
        deadline = time.monotonic() + wait_s
        while self.starting:
            below = len(self.groups.rollout.handles) < self.spec.min_replicas
            timeout = max(deadline - time.monotonic(), 0.0) if below else 0.0
            refs = [s.started for s in self.starting]
            ready = WATCHDOG.first_ready(refs, timeout)
            if not ready:
                return
            new = next(s for s in self.starting if s.started == ready[0])
            # (still listed as starting while it joins: expendable, should its node drain)
            error = self._join(new)
            if error:
                log.warning("a new rollout engine could not start: %s", error)
                self.released.append(new.host._actor_id.hex())
                self.starting.remove(new)
                self.failed_starts += 1
                if new.slot is not None:
                    self.free_slots.append(new.slot)
                try:
                    ray.kill(new.host)
                except Exception:
                    log.debug("could not kill an engine that failed to start", exc_info=True)
                continue
            self.groups.add_engine(new.host)
            self.starting.remove(new)
            if new.slot is not None:
                self.slots[id(new.host)] = new.slot

    def _join(self, new: Starting) -> str | None:
        """A started engine takes the current weights, before it generates; why it cannot."""
        try:
            ident = WATCHDOG.get(new.ready, "rollout", "start")
            error = ident.get("error") or WATCHDOG.get(new.started, "rollout", "start")
            if not error:
                WATCHDOG.get(self.sync.push([new.host]), "rollout", "weight sync")
        except RayActorError as exc:
            error = f"its process died ({type(exc).__name__})"
        except StallError as exc:  # a new engine that hangs is dropped, as one that died
            error = str(exc)
            WATCHDOG.stalled = []  # the run goes on: it did not stall
        return error

    def ensure(self) -> None:
        """At least minReplicas engines, waiting for new ones only while there are fewer (at
        most startTimeoutSeconds); else :class:`RolloutCapacityError`."""
        spec = self.spec
        self.admit(float(spec.start_timeout_seconds))  # (waits only while below)
        live = len(self.groups.rollout.handles)
        if live < spec.min_replicas:
            raise RolloutCapacityError(
                f"roles.rollout: {live} rollout engine(s) left, fewer than "
                f"elastic.minReplicas {spec.min_replicas}, and no new one started within "
                f"startTimeoutSeconds {spec.start_timeout_seconds} "
                f"({self.lost} lost, "
                f"{self.failed_starts} failed to start, "
                f"{len(self.starting)} still starting); fix: give the rollout pods room "
                "(or lower elastic.minReplicas)"
            )

    # ---- generation on the pool --------------------------------------------------------------
    def generate_on(
        self, host: Any, lo: int, examples: list[Any], first_sample: int, seed: int
    ) -> Part:
        """Launch an engine's share: samples ``[lo, lo + len(examples) * k)``."""
        batch, info = host.generate_elastic.remote(examples, first_sample, seed)
        return Part(
            lo, lo + len(examples) * self.k, examples, first_sample, seed, host, batch, info
        )

    def settle(self, parts: list[Part]) -> tuple[list[tuple[int, int]], list[Any], list[int]]:
        """Wait for a step's generation; the prompts of an engine lost meanwhile are generated
        again, split over the engines left (and those started to replace it), under their own
        sample numbers, so every prompt group is trained on once. Returns the step's ranges,
        refs of its results (with their batches) and engine numbers; counts the prompts
        re-queued (:meth:`metrics`)."""
        todo, done = list(parts), []
        attempt = 0
        while todo:
            WATCHDOG.wait([("rollout", i, "generate", p.info) for i, p in enumerate(todo)])
            lost = []
            for part in todo:
                try:
                    done.append((part, WATCHDOG.get(part.info, "rollout", "generate")))
                except RayActorError:
                    lost.append(part)
            if not lost:
                break
            self.drop([p.host for p in lost])
            self.ensure()
            attempt += 1
            todo = [again for part in lost for again in self._requeue(part, attempt)]
        done.sort(key=lambda d: d[0].lo)
        spans = [(p.lo, p.hi) for p, _ in done]
        gens = [ray.put({**info, "batch": p.batch}) for p, info in done]
        return spans, gens, list(range(len(done)))

    def _requeue(self, part: Part, attempt: int) -> list[Part]:
        """A lost engine's share, generated again over the live engines."""
        self.requeued += len(part.examples)
        live, k, out = self.groups.rollout.handles, self.k, []
        for j, (lo, hi) in enumerate(ranges(len(part.examples), len(live))):
            if lo == hi:
                continue
            seed = step_seed(part.seed, attempt, j)
            first = part.first_sample + lo * k
            out.append(
                self.generate_on(live[j], part.lo + lo * k, part.examples[lo:hi], first, seed)
            )
        return out
