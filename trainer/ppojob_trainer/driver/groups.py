"""The worker processes of each role as the step addresses them: a role's handles, the worker
that speaks for each data-parallel rank, and the sample range of each rank."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from ..workers.group import shard_range


def ranges(n: int, size: int) -> list[tuple[int, int]]:
    """``n`` samples split into ``size`` contiguous ranges, one per rank."""
    return [shard_range(n, size, r) for r in range(size)]


def step_seed(seed: int, step: int, engine: int) -> int:
    """The sampling seed of one engine's share of a step's generation."""
    return (seed * 1_000_003 + step * 7919 + engine) % (2**63 - 1)


@dataclass
class Group:
    """One role's worker processes (Ray actor handles)."""

    handles: list[Any] = field(default_factory=list)
    leaders: list[int] = field(default_factory=list)
    """Index of the worker that speaks for each data-parallel rank, in data-parallel order
    (model-parallel workers of one rank share its samples)."""
    ranges: list[tuple[int, int]] | None = None
    """The step's samples of each data-parallel rank (None: a role without workers)."""

    def call(self, method: str, *args: Any, **kwargs: Any) -> list[Any]:
        """``method`` on every worker, in worker order: refs of its results."""
        return [getattr(h, method).remote(*args, **kwargs) for h in self.handles]

    def of_leaders(self, per_worker: list[Any]) -> list[Any]:
        """The entries of ``per_worker`` (one per worker) of the data-parallel leaders."""
        return [per_worker[i] for i in self.leaders]


@dataclass
class Groups:
    """The actor's, the critic's and the engines' processes (colocated roles share them)."""

    actor: Group
    critic: Group
    """No workers when the algorithm needs no critic."""
    rollout: Group
    """One process per engine (its first, when an engine spans several actor workers)."""
    engine_groups: list[list[Any]]
    """The processes on each engine's GPUs, its own first: colocated, the ``tp`` actor workers
    of its bundle; otherwise the engine's own process."""
    all_hosts: list[Any]
    """Every process of the three roles once, in start order (the order of the workers'
    generator states in a checkpoint)."""
    identities: list[dict[str, Any]]
    """What each of ``all_hosts`` reported at start-up (shard identity per role, GPUs)."""

    def by_role(self) -> dict[str, list[Any]]:
        """The handles of each role, by its name."""
        return {r: self.role(r).handles for r in ("actor", "critic", "rollout")}

    def role(self, name: str) -> Group:
        return {"actor": self.actor, "critic": self.critic, "rollout": self.rollout}[name]

    def drop_engine(self, host: Any) -> bool:
        """Forget an engine of its own process (elastic); False if it was already dropped."""
        if not any(h is host for h in self.rollout.handles):
            return False
        self.rollout.handles = [h for h in self.rollout.handles if h is not host]
        self.all_hosts = [h for h in self.all_hosts if h is not host]
        self.engine_groups = [[h] for h in self.rollout.handles]
        return True

    def add_engine(self, host: Any) -> None:
        """An engine of its own process joins (elastic)."""
        self.rollout.handles.append(host)
        self.all_hosts.append(host)
        self.engine_groups = [[h] for h in self.rollout.handles]
