"""The weight sync: how the actor's weights reach the engines, one class per way
(:data:`~.topology.WeightSyncMode`), each carrying the policy version.

A sync's calls are submitted in order on each process (Ray runs an actor's calls in order), so
an engine generates with the weights of the last sync launched before its generation call.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from ray.exceptions import RayActorError

from ..watchdog import WATCHDOG
from .groups import Group, Groups
from .topology import Topology

WEIGHT_GROUP = "ppojob-weights"
"""Name of the weight-update process group of disaggregated engines."""


def push_weights(
    actor: Group, version: int, engines: list[Any], *, offer: bool = False
) -> tuple[list[Any], list[Any]]:
    """The actor's current weights (policy ``version``) to ``engines`` through the object store:
    refs of their loads (``offer``: of their offers, which a generation in progress takes
    between two tokens), and of the other actor workers' share of a collective export."""
    leader, *others = actor.handles
    joined = [h.join_export.remote(version) for h in others]
    published = leader.publish_weights.remote(version)
    if offer:
        sends = [
            e.offer_weights.options(concurrency_group="sync").remote(version, published)
            for e in engines
        ]
    else:
        sends = [e.load_weights.remote(version, published) for e in engines]
    return sends, joined


class WeightSync:
    """A way weights reach the engines; ``version`` is the number of syncs so far: the policy
    version the actor and the engines hold between steps."""

    fetched_with_step = True
    """The sync's refs are fetched with the step's other results (one round trip)."""

    def __init__(self, groups: Groups) -> None:
        self.groups = groups
        self.version = 0
        self.reported = 0
        """The policy version the engines last reported holding after a sync (0: the initial
        weights); the step's ``weights/version``."""

    def start(self) -> list[Any]:
        """Start a sync of a new version; refs of its durations (seconds) and of the actor
        workers' shares."""
        self.version += 1
        return self._send()

    def _send(self) -> list[Any]:
        raise NotImplementedError

    def step_sync(self, actor_trained: bool) -> list[Any]:
        """The step's sync (only when the actor trained); the refs the step waits for."""
        return self.start() if actor_trained else []

    def push(self, engines: list[Any]) -> list[Any]:
        """The current weights to ``engines`` (an elastic engine joining); refs to wait for."""
        loaded, joined = push_weights(self.groups.actor, self.version, engines)
        return [*loaded, *joined]

    def release(self) -> None:
        """Engines sharing the actor's GPUs free their weights and KV cache for training."""

    def wake(self, after: list[Any]) -> list[Any]:
        """Engines that released their memory take it back once ``after`` are done."""
        return []

    def durations(self, refs: list[Any], fetched: list[Any]) -> list[float]:
        """The sync's durations, from its refs and (:attr:`fetched_with_step`) their values;
        the versions the engines reported with theirs become :attr:`reported`."""
        return self.read_reports(fetched)

    def read_reports(self, values: list[Any]) -> list[float]:
        """Seconds of each of a sync's calls (an engine's: ``{"seconds", "version"}``, an actor
        worker's share: seconds); the oldest version the engines report becomes
        :attr:`reported` (no engine reporting leaves it)."""
        seconds, versions = [], []
        for v in values:
            if isinstance(v, dict):
                seconds.append(float(v["seconds"]))
                versions.append(int(v["version"]))
            else:
                seconds.append(float(v))
        if versions:
            self.reported = min(versions)
        return seconds


class ColocatedSync(WeightSync):
    """Colocated engines: each loads the buckets its GPUs' actor workers stage; with
    ``offload``, the engines release their memory while the actor trains."""

    def __init__(self, groups: Groups, offload: bool) -> None:
        super().__init__(groups)
        self.offload = offload

    def _send(self) -> list[Any]:
        # Every actor worker exports first, all at once: under FSDP the export is a collective
        # over all of them (megatron: over each data-parallel replica's), and an engine
        # spanning several workers' GPUs asks its peers for their buckets only after its own
        # export (a deadlock otherwise). Each worker runs its calls in order, so its export
        # precedes its buckets.
        for h in self.groups.actor.handles:
            h.export.remote(self.version)
        return [g[0].sync_colocated.remote(self.version, g[1:]) for g in self.groups.engine_groups]

    def step_sync(self, actor_trained: bool) -> list[Any]:
        # A woken engine's weights were released: it takes them even when the actor did not
        # train.
        return self.start() if actor_trained or self.offload else []

    def release(self) -> None:
        if self.offload:
            WATCHDOG.get(self.groups.rollout.call("release_memory"), "rollout", "release memory")

    def wake(self, after: list[Any]) -> list[Any]:
        return self.groups.rollout.call("resume_memory", *after) if self.offload else []


class StoreSync(WeightSync):
    """Through the object store: the actor's leader publishes, every engine loads (``offer``,
    partial rollout: offered beside the generation in progress, loaded between tokens)."""

    def __init__(self, groups: Groups, offer: bool = False) -> None:
        super().__init__(groups)
        self.offer = offer

    def _send(self) -> list[Any]:
        engines = self.groups.rollout.handles
        loaded, joined = push_weights(self.groups.actor, self.version, engines, offer=self.offer)
        return [*loaded, *joined]


class DeferredSync(StoreSync):
    """Bounded staleness with engines of their own on CPUs: the actor's leader publishes each
    sync's weights to the object store and every engine's load of them is queued ahead of its
    next generation, without waiting for it (an engine runs the driver's calls in order, so the
    version tags stay exact); neither the actor nor the driver waits for the engines (a
    broadcast would hold the actor's leader until each engine, still generating a later step,
    joins it). The loads are waited on at the next step."""

    def __init__(self, groups: Groups) -> None:
        super().__init__(groups)
        self.loading: list[Any] = []
        """Refs of the engines' loads of the last sync, not waited on yet."""

    def step_sync(self, actor_trained: bool) -> list[Any]:
        # this step waits for the loads of the previous step's sync, and the loads of its own
        # wait on the engines, ahead of their next generation
        synced = self.start() if actor_trained else []
        loaded_before, self.loading = self.loading, []
        if synced:
            n_engines = len(self.groups.rollout.handles)
            self.loading, synced = synced[:n_engines], synced[n_engines:]
        return [*loaded_before, *synced]


class BroadcastSync(WeightSync):
    """Engines of their own: the actor's leader broadcasts bucket by bucket to every engine over
    a weight-update group of theirs (:meth:`init_group`)."""

    def __init__(self, groups: Groups, backend: str) -> None:
        super().__init__(groups)
        self.backend = backend

    def init_group(self, tp: int) -> None:
        """One weight-update group of the actor's leader (rank 0) and every engine's
        tensor-parallel ranks (engine ``e`` from rank ``1 + e * tp``)."""
        leader, engines = self.groups.actor.handles[0], self.groups.rollout.handles
        host, port = WATCHDOG.get(leader.rendezvous_address.remote(), "actor", "rendezvous")
        world = 1 + len(engines) * tp
        WATCHDOG.get(
            [leader.init_weight_sender.remote(host, port, world, WEIGHT_GROUP, self.backend)]
            + [
                e.init_weights_update_group.remote(
                    host, port, 1 + i * tp, world, WEIGHT_GROUP, self.backend
                )
                for i, e in enumerate(engines)
            ],
            "weight sync",
            "init group",
        )

    def _send(self) -> list[Any]:
        leader, *others = self.groups.actor.handles
        joined = [h.join_export.remote(self.version) for h in others]  # a collective export
        engines = self.groups.rollout.handles
        sent = leader.broadcast_weights.remote(self.version, engines, WEIGHT_GROUP)
        return [sent, *joined]


class ElasticSync(StoreSync):
    """Elastic engines (any count) through the object store: an engine lost in a sync is
    handed to ``drop`` (a replacement takes the weights when it joins)."""

    fetched_with_step = False

    def __init__(self, groups: Groups, offer: bool, drop: Callable[[list[Any]], None]) -> None:
        super().__init__(groups, offer)
        self.drop = drop
        self.targets: list[Any] = []
        """The engines of the last sync."""

    def _send(self) -> list[Any]:
        self.targets = list(self.groups.rollout.handles)
        loaded, joined = push_weights(
            self.groups.actor, self.version, self.targets, offer=self.offer
        )
        return [*loaded, *joined]

    def durations(self, refs: list[Any], fetched: list[Any]) -> list[float]:
        if not refs:  # (no sync at a step whose actor does not train)
            return []
        engines = self.targets
        out, lost = [], []
        for host, ref in zip(engines, refs[: len(engines)], strict=True):
            try:
                out.append(WATCHDOG.get(ref, "rollout", "weight sync"))
            except RayActorError:
                lost.append(host)
        out += WATCHDOG.get(refs[len(engines) :], "actor", "weight sync")
        if lost:
            self.drop(lost)
        return self.read_reports(out)


def weight_sync(topo: Topology, groups: Groups) -> WeightSync:
    """The weight sync of a run without elastic engines (those bring theirs,
    :class:`~.elastic.ElasticEngines`); a broadcast's group is set up here."""
    if topo.weight_sync == "colocated":
        return ColocatedSync(groups, topo.offload)
    if topo.weight_sync == "store":
        return StoreSync(groups, offer=topo.partial)
    if topo.weight_sync == "deferred":
        return DeferredSync(groups)
    sync = BroadcastSync(groups, topo.weight_backend)
    sync.init_group(topo.tp)
    return sync
