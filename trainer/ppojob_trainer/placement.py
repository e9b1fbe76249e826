"""One Ray placement group holding every role's bundles.

Separate groups per role can each reserve part of the cluster and wait forever for the rest;
one group reserves everything at once or nothing.

Layout (`plan_placement`, pure): the roles that own bundles come in the order actor, critic,
rollout, reward (`roles.reward`), sandbox (`roles.sandbox`; these two never colocated), each
with a contiguous range of bundles. A colocated critic or rollout owns no bundles: it uses the
actor's range, and every role on a bundle requests an equal fractional share of each worker's
slice of it (actor + colocated critic on a GPU bundle: `{"GPU": 0.5}` each; with a colocated
rollout too: a third each). The process hosting a worker requests the whole slice
(`ReservedPlacement.host_options`): colocated roles live in that one process.

Bundle shapes:
- GPU role (`resources.gpus = g > 0`): one bundle per GPU, `{"GPU": 1, "CPU": cpus / g}`, one
  worker each.
- SGLang rollout (`backend: sglang`, `parallelism.tensor = t`): one bundle per *engine*,
  `{"GPU": t, "CPU": t * cpus / g}`, since an engine spans t GPUs of one node (a bundle always
  lies on one node). Engines = rollout GPUs / t; `ppojob validate` requires t to divide g.
  Colocated with the actor, the actor's bundles take that shape instead (t actor workers of
  one GPU each per bundle; the engine lives in the process of the bundle's first worker and
  spans the bundle's t GPUs).
- CPU role (`gpus = 0`): one worker per replica whose bundle `{"CPU": cpus}` stands in for the
  GPU, with `cpus` the replica's `resources.cpus` (default 1).
Memory is not reserved (Ray's logical memory does not match pod limits); pods enforce it.

Local runs: `ppojob run` starts Ray with `num_cpus = os.cpu_count()` logical CPUs (`--num-cpus`
changes it), and the driver itself holds none. `examples/ppojob-tiny.yaml` (actor `cpus: 2`,
rollout and critic colocated) is one `{"CPU": 2}` bundle, each of the three roles requesting
`{"CPU": 0.6666}` of it; a separate 1-CPU rollout with a colocated critic would be
`[{"CPU": 1}, {"CPU": 1}]`. Both fit a 2-core laptop; on a 1-core machine `--num-cpus 2`
oversubscribes instead of failing.

`wait_for_gang` comes first on an operator-made cluster (one whose head advertises `ppojob-head`):
KubeRay's SidecarMode submits the trainer as soon as the head's dashboard is up, before the
workers have joined. The trainer waits, bounded by `spec.scheduling.timeoutSeconds`, until every
role's pods have joined (each advertises `ppojob-<role>`: its GPUs, or 1), logging what is
missing per role, and only then plans placement, so role pinning is never decided on a partial
cluster. On timeout it raises `GangIncompleteError`; the entrypoint prints
`ppojob-train: GangIncomplete: ...`, which reaches the RayJob's message and the PPOJob's
`Failed` condition (reason `GangIncomplete`).

`reserve_placement` first compares the request with the cluster (totals, and that each bundle fits
some node) and fails at once naming what is missing; then it waits for the group at most
`timeout_s`, logging while it waits; on timeout (or any error, or Ctrl-C) it removes the group and
raises `PlacementError` naming the resources that are not free.
"""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from ppojob_api.training import TrainerConfig

from .driver.topology import engine_tensor_size

ROLES = ("actor", "critic", "rollout", "reward", "sandbox")
SHARE_PRECISION = 10_000  # Ray stores resources with 4 decimal places

log = logging.getLogger(__name__)


class PlacementError(RuntimeError):
    """The placement group cannot be reserved; the message names the missing resources."""

    def __init__(self, message: str, missing: dict[str, float] | None = None) -> None:
        super().__init__(message)
        self.missing = dict(missing or {})


@dataclass(frozen=True)
class RoleSlot:
    """Where a role's workers live in the group."""

    offset: int
    """Index of the role's first bundle."""
    count: int
    """Number of workers of the role (engines, for the rollout)."""
    share: dict[str, float]
    """Resources each worker requests from its bundle (a fraction when roles share a bundle)."""
    owner: str
    """The role whose bundles these are (`actor` for colocated roles)."""
    per_bundle: int = 1
    """Workers of the role in each bundle (t actor workers share an engine's t-GPU bundle)."""


@dataclass(frozen=True)
class PlacementPlan:
    """Bundles of the single placement group and each role's slot in it."""

    bundles: list[dict[str, float]]
    roles: dict[str, RoleSlot]
    strategy: str = "PACK"
    name: str = "ppojob"

    def total(self) -> dict[str, float]:
        """Sum of every bundle's resources."""
        out: dict[str, float] = {}
        for bundle in self.bundles:
            for key, value in bundle.items():
                out[key] = out.get(key, 0.0) + value
        return out

    def describe(self) -> str:
        """One line per role, for logs."""
        parts = []
        for role, slot in self.roles.items():
            last = slot.offset + (slot.count - 1) // slot.per_bundle
            where = f"bundles {slot.offset}..{last}"
            if slot.owner != role:
                where += f" (shared with {slot.owner})"
            parts.append(f"{role}: {slot.count} worker(s) on {where}, each {slot.share}")
        return "; ".join(parts)


def _floor_share(value: float, n: int) -> float:
    return math.floor(value / n * SHARE_PRECISION) / SHARE_PRECISION


def _bundles_of(spec: Any, size: int = 1) -> list[dict[str, float]]:
    """The bundles of a role owning its own; `size` GPUs per bundle (an engine's tensor size)."""
    res = spec.resources
    if res.gpus > 0:
        one = {"GPU": float(size), "CPU": _floor_share(res.cpus * size, res.gpus)}
        if one["CPU"] <= 0:
            del one["CPU"]
        return [dict(one) for _ in range(spec.replicas * res.gpus // size)]
    return [{"CPU": float(res.cpus)} for _ in range(spec.replicas)]


def role_resource(role: str) -> str:
    """The Ray custom resource the operator puts on a role's pods (`ppojob-actor`, ...): one unit
    per worker slot of the pod."""
    return f"ppojob-{role}"


HEAD_RESOURCE = "ppojob-head"
"""The custom resource the operator puts on the head pod (one unit), marking its clusters."""


def cluster_pins_roles(totals: dict[str, float]) -> bool:
    """Whether the Ray cluster marks its pods by role (an operator-made cluster does; a local Ray
    does not). Decided by the head's mark, so a cluster whose workers have not joined yet is
    still recognised."""
    return HEAD_RESOURCE in totals or role_resource("actor") in totals


class GangIncompleteError(PlacementError):
    """Not every role's pods joined the Ray cluster within the timeout."""

    reason = "GangIncomplete"


@dataclass(frozen=True)
class GangNeed:
    """What one role's pods add to the Ray cluster when they have all joined."""

    role: str
    pods: int
    per_pod: int
    """Units of `ppojob-<role>` each pod advertises: its GPUs, or 1 on a CPU pod."""
    gpus: bool

    @property
    def units(self) -> int:
        return self.pods * self.per_pod


def gang_needs(cfg: TrainerConfig) -> list[GangNeed]:
    """Every role that has pods of its own (colocated roles have none), as the operator builds
    them: `replicas` pods each advertising `ppojob-<role>: max(gpus, 1)`."""
    roles = cfg.roles
    specs = [("actor", roles.actor)]
    critic = roles.effective_critic(cfg.algorithm.needs_critic)
    if critic is not None and not critic.colocate_with_actor:
        specs.append(("critic", critic))
    if not roles.rollout.colocate_with_actor:
        specs.append(("rollout", roles.rollout))
    if roles.reward is not None:
        specs.append(("reward", roles.reward))
    if roles.sandbox is not None:
        specs.append(("sandbox", roles.sandbox))
    return [
        GangNeed(role, spec.replicas, max(spec.resources.gpus, 1), spec.resources.gpus > 0)
        for role, spec in specs
    ]


def gang_missing(needs: list[GangNeed], totals: dict[str, float]) -> list[str]:
    """One line per role whose pods have not all joined (pure), e.g.
    `ppojob-actor: 2 of 4 GPUs joined (1 of 2 pods)`."""
    out = []
    for need in needs:
        have = int(totals.get(role_resource(need.role), 0.0) + 1e-6)
        if have >= need.units:
            continue
        what = "GPUs" if need.gpus else "worker slots"
        out.append(
            f"{role_resource(need.role)}: {have} of {need.units} {what} joined "
            f"({have // need.per_pod} of {need.pods} pods)"
        )
    return out


def wait_for_gang(
    cfg: TrainerConfig,
    timeout_s: float,
    log: Callable[[str], None] | None = None,
    log_every_s: float = 5.0,
    poll_s: float = 0.5,
    totals: Callable[[], dict[str, float]] | None = None,
) -> float:
    """Wait until every role's pods have joined an operator-made Ray cluster; return the seconds
    waited. A cluster without the head's mark (a local Ray) is not waited for.

    Raises GangIncompleteError after `timeout_s`, naming per role what is still missing."""
    if timeout_s <= 0:
        raise ValueError(f"timeout_s must be > 0 (spec.scheduling.timeoutSeconds), got {timeout_s}")
    if totals is None:
        import ray

        totals = ray.cluster_resources
    say = log or _default_log
    if not cluster_pins_roles(totals()):
        return 0.0
    needs = gang_needs(cfg)
    start = time.monotonic()
    next_log = start
    while True:
        missing = gang_missing(needs, totals())
        waited = time.monotonic() - start
        if not missing:
            if waited > 0.0 and next_log > start:
                say(f"every role's pods joined after {waited:.1f}s")
            return waited
        if waited >= timeout_s:
            raise GangIncompleteError(
                f"not every pod of the job joined the Ray cluster within {timeout_s:g}s "
                f"(spec.scheduling.timeoutSeconds): {'; '.join(missing)}. The missing pods are "
                "Pending or crashing: see `kubectl get pods -l ppojob.io/job=<name>` and their "
                "events.\n  fix: free or add the resources they need (or use a gang scheduler), "
                "or raise spec.scheduling.timeoutSeconds"
            )
        if time.monotonic() >= next_log:
            say(
                f"waiting for the job's pods to join ({waited:.0f}s of {timeout_s:g}s): "
                + "; ".join(missing)
            )
            next_log = time.monotonic() + log_every_s
        time.sleep(min(poll_s, max(timeout_s - waited, 0.01)))


def plan_placement(
    cfg: TrainerConfig,
    strategy: str = "PACK",
    name: str | None = None,
    pin_roles: bool = False,
) -> PlacementPlan:
    """The bundles and role slots of the job's single placement group (pure).

    With `pin_roles`, every bundle also asks for one unit of its owner's role resource
    (`ppojob-actor`, `ppojob-critic`, `ppojob-rollout`), so a role's workers land on the pods
    the operator made for that role rather than on whichever node has a free GPU.
    """
    if strategy not in ("PACK", "SPREAD", "STRICT_PACK", "STRICT_SPREAD"):
        raise ValueError(
            f"strategy must be PACK, SPREAD, STRICT_PACK or STRICT_SPREAD, got {strategy!r}"
        )
    roles = cfg.roles
    specs = {
        "actor": roles.actor,
        "critic": roles.effective_critic(cfg.algorithm.needs_critic),
        "rollout": roles.rollout,
        "reward": roles.reward,  # (reward-model workers: bundles of their own, when set)
        "sandbox": roles.sandbox,  # (tool-call workers: bundles of their own, when set)
    }
    tp = engine_tensor_size(cfg)
    colocated_rollout = roles.rollout.colocate_with_actor
    bundles: list[dict[str, float]] = []
    owned: dict[str, tuple[int, int, int]] = {}  # role -> (offset, bundles, workers per bundle)
    sharers: dict[str, list[str]] = {"actor": ["actor"]}
    for role in ROLES:
        spec = specs[role]
        if spec is None:
            continue
        if role != "actor" and getattr(spec, "colocate_with_actor", False):
            sharers["actor"].append(role)
            continue
        # GPUs per bundle: an engine's tensor size for the rollout, and for the actor when the
        # engines live on its GPUs; one elsewhere.
        gpu_role = spec.resources.gpus > 0
        engine_bundles = role == "rollout" or (role == "actor" and colocated_rollout)
        size = tp if gpu_role and engine_bundles else 1
        own = _bundles_of(spec, size)
        if pin_roles:
            for bundle in own:
                bundle[role_resource(role)] = float(size if gpu_role else 1)
        per_bundle = size if role != "rollout" else 1
        owned[role] = (len(bundles), len(own), per_bundle)
        sharers.setdefault(role, [role])
        bundles.extend(own)
    slots: dict[str, RoleSlot] = {}
    for owner, members in sharers.items():
        offset, count, per_bundle = owned[owner]
        shape = bundles[offset]
        # each worker's slice of its bundle, split equally between the roles sharing it
        share = {k: _floor_share(v, per_bundle * len(members)) for k, v in shape.items()}
        for role in members:
            if role == "rollout":  # one engine per bundle, in its first worker's process
                slots[role] = RoleSlot(offset, count, share, owner, per_bundle=1)
            else:
                slots[role] = RoleSlot(offset, count * per_bundle, share, owner, per_bundle)
    ordered = {role: slots[role] for role in ROLES if role in slots}
    job = name or f"ppojob-{cfg.job_name or 'local'}"
    return PlacementPlan(bundles=bundles, roles=ordered, strategy=strategy, name=job)


# ---------------------------------------------------------------------------------------------
# Checking against the cluster
# ---------------------------------------------------------------------------------------------
def _fmt(resources: dict[str, float]) -> str:
    return ", ".join(f"{k}: {v:g}" for k, v in sorted(resources.items())) or "nothing"


def shortfall(need: dict[str, float], have: dict[str, float]) -> dict[str, float]:
    """Resources in `need` that `have` lacks, and by how much."""
    eps = 1e-6
    return {k: v - have.get(k, 0.0) for k, v in need.items() if v > have.get(k, 0.0) + eps}


def check_fits(
    plan: PlacementPlan,
    totals: dict[str, float],
    nodes: list[dict[str, float]] | None = None,
) -> None:
    """Raise PlacementError if the cluster can never hold the plan: its total resources are too
    small, or some bundle is larger than every node (PACK/SPREAD place a bundle on one node)."""
    need = plan.total()
    missing = shortfall(need, totals)
    if missing:
        lines = [
            f"  - {k}: the job needs {need[k]:g}, the cluster has {totals.get(k, 0.0):g} in "
            f"total (missing {v:g})"
            for k, v in sorted(missing.items())
        ]
        hint = (
            "add nodes to the Ray cluster, or lower spec.roles.*.replicas / resources"
            if "GPU" not in missing
            else "run on a cluster with GPUs, or set resources.gpus: 0 to run on CPU"
        )
        raise PlacementError(
            f"the Ray cluster is too small for the job's placement group "
            f"({len(plan.bundles)} bundles):\n" + "\n".join(lines) + f"\n  fix: {hint}",
            missing,
        )
    if nodes:
        for i, bundle in enumerate(plan.bundles):
            if not any(not shortfall(bundle, node) for node in nodes):
                biggest = max(nodes, key=lambda n: tuple(n.get(k, 0.0) for k in bundle))
                miss = shortfall(bundle, biggest)
                raise PlacementError(
                    f"bundle {i} ({_fmt(bundle)}) is larger than every Ray node (the largest "
                    f"has {_fmt({k: biggest.get(k, 0.0) for k in bundle})}; missing "
                    f"{_fmt(miss)})\n  fix: lower the role's resources.cpus per GPU/replica, or "
                    f"use bigger nodes",
                    miss,
                )
    if plan.strategy == "STRICT_PACK" and nodes and all(shortfall(need, n) for n in nodes):
        raise PlacementError(f"STRICT_PACK needs one node with {_fmt(need)}; no node has it", need)


def _alive_nodes() -> list[dict[str, float]]:
    import ray

    return [dict(n.get("Resources", {})) for n in ray.nodes() if n.get("Alive")]


# ---------------------------------------------------------------------------------------------
# Reserving
# ---------------------------------------------------------------------------------------------
@dataclass
class ReservedPlacement:
    """A reserved placement group and where each role's workers go in it."""

    plan: PlacementPlan
    group: Any
    """The Ray PlacementGroup."""
    _released: bool = field(default=False, repr=False)

    def bundle_for(self, role: str, worker_index: int) -> tuple[int, dict[str, float]]:
        """Bundle index and the resources a worker of `role` should request from it."""
        slot = self.plan.roles.get(role)
        if slot is None:
            raise KeyError(
                f"role {role!r} has no workers in this plan (roles: {', '.join(self.plan.roles)})"
            )
        if not 0 <= worker_index < slot.count:
            raise IndexError(
                f"{role} worker index {worker_index} out of range: the role has {slot.count} "
                "worker(s)"
            )
        return slot.offset + worker_index // slot.per_bundle, dict(slot.share)

    def worker_slice(self, owner: str) -> dict[str, float]:
        """One worker's whole slice of an `owner` bundle: what the process hosting that worker
        (and every role colocated with it) requests."""
        slot = self.plan.roles[owner]
        shape = self.plan.bundles[slot.offset]
        per = slot.per_bundle if owner != "rollout" else 1
        return {k: (v / per if k == "GPU" else _floor_share(v, per)) for k, v in shape.items()}

    def host_options(self, owner: str, worker_index: int) -> dict[str, Any]:
        """`ActorClass.options(...)` for the process of worker `worker_index` of `owner`: the
        worker's whole slice of its bundle (one GPU of an actor bundle, all t GPUs of an engine
        bundle), so Ray gives every process its own GPUs."""
        opts = self.scheduling_options(owner, worker_index)
        whole = self.worker_slice(owner)
        opts["num_cpus"] = whole.get("CPU", 0)
        opts["num_gpus"] = whole.get("GPU", 0)
        custom = {k: v for k, v in whole.items() if k not in ("CPU", "GPU")}
        if custom:
            opts["resources"] = custom
        return opts

    def scheduling_options(self, role: str, worker_index: int) -> dict[str, Any]:
        """Keyword arguments for `ActorClass.options(...)` placing the worker in its bundle."""
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        index, share = self.bundle_for(role, worker_index)
        custom = {k: v for k, v in share.items() if k not in ("CPU", "GPU")}
        opts: dict[str, Any] = {
            "num_cpus": share.get("CPU", 0),
            "num_gpus": share.get("GPU", 0),
            "scheduling_strategy": PlacementGroupSchedulingStrategy(
                placement_group=self.group,
                placement_group_bundle_index=index,
                placement_group_capture_child_tasks=False,
            ),
        }
        if custom:
            opts["resources"] = custom
        return opts

    def release(self) -> None:
        """Remove the group (and with it the workers placed in it); idempotent."""
        if self._released:
            return
        self._released = True
        _remove(self.group)

    def __enter__(self) -> ReservedPlacement:
        return self

    def __exit__(self, *exc: object) -> None:
        self.release()


def _remove(group: Any) -> None:
    from ray.util import remove_placement_group

    try:
        remove_placement_group(group)
    except Exception as exc:  # pragma: no cover - Ray already gone
        log.warning("could not remove placement group %s: %s", group.id.hex(), exc)


def reserve_placement(
    plan: PlacementPlan,
    timeout_s: float,
    log: Callable[[str], None] | None = None,
    log_every_s: float = 10.0,
) -> ReservedPlacement:
    """Reserve the plan's group, waiting at most `timeout_s`; all or nothing.

    Raises PlacementError at once when the cluster can never fit the plan, and after
    `timeout_s` when it does not fit now (other jobs hold the resources); the group is removed
    before raising, so no half-reserved group is left behind.
    """
    import ray
    from ray.util import placement_group

    if timeout_s <= 0:
        raise ValueError(f"timeout_s must be > 0 (spec.scheduling.timeoutSeconds), got {timeout_s}")
    say = log or _default_log
    check_fits(plan, ray.cluster_resources(), _alive_nodes())
    say(
        f"reserving placement group {plan.name}: {len(plan.bundles)} bundle(s), "
        f"{_fmt(plan.total())}, strategy {plan.strategy}; {plan.describe()}"
    )
    group = placement_group(plan.bundles, strategy=plan.strategy, name=plan.name)
    start = time.monotonic()
    try:
        ready_ref = group.ready()
        while True:
            left = timeout_s - (time.monotonic() - start)
            if left <= 0:
                break
            ready, _ = ray.wait([ready_ref], timeout=min(left, log_every_s))
            if ready:
                ray.get(ready[0])
                say(f"placement group {plan.name} reserved after {time.monotonic() - start:.1f}s")
                return ReservedPlacement(plan=plan, group=group)
            waited = time.monotonic() - start
            if waited < timeout_s:
                missing = shortfall(plan.total(), ray.available_resources())
                say(
                    f"waiting for placement group {plan.name} ({waited:.0f}s of {timeout_s:g}s); "
                    f"not free now: {_fmt(missing) if missing else 'fragmented across nodes'}"
                )
    except BaseException:
        _remove(group)
        raise
    _remove(group)
    missing = shortfall(plan.total(), ray.available_resources())
    detail = _fmt(missing) if missing else "enough in total, but not on the nodes the bundles need"
    raise PlacementError(
        f"placement group {plan.name} ({_fmt(plan.total())}) could not be reserved within "
        f"{timeout_s:g}s (spec.scheduling.timeoutSeconds); missing: {detail}. Other jobs or "
        "actors hold them; the group was removed.\n  fix: free the resources, wait and retry, "
        "or raise spec.scheduling.timeoutSeconds",
        missing,
    )


def _default_log(message: str) -> None:
    log.info(message)
