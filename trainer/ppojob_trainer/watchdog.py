"""Stall watchdog: a step whose workers stop reporting is named, not waited on forever.

The driver holds one ObjectRef per worker and phase of the step (generate, values, prepare,
train, wake, weight sync). :func:`wait_or_name` waits for all of them at most
``TrainerConfig.stall_timeout_seconds`` (``spec.failurePolicy.stallTimeoutSeconds``); when some
are still pending it raises :class:`StallError`, whose one line names the role, rank and phase
of each worker that did not report. It reaches the PPOJob (``status.progress.error``, reason
``Stalled``) and the failure policy decides: restart (a hung collective, a lost node) or fail.

Every blocking wait of the driver goes through :data:`WATCHDOG` (``tests/trainer/
test_watchdog_coverage.py`` fails on a ``ray.get``/``ray.wait`` elsewhere in ``driver/``): the
step's phases, the reward-worker ping before a step, memory release, weight sync, checkpoint
save and resume, start-up (unbounded until the first step: :data:`STARTUP_PHASES`). Its limit
is derived from the steps measured: the larger of ``stall_timeout_seconds`` (the floor) and
:data:`STEP_FACTOR` times the slowest step seen, so a job whose steps are long is not killed by
a limit set for short ones.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Any

STEP_FACTOR = 3.0
"""The stall limit is at least this many times the slowest step seen."""

STARTUP_PHASES = frozenset({"start", "rendezvous", "resume"})
"""Phases that wait without a limit until the first step has completed: starting the workers
(downloading and loading the models, starting engines), forming their groups and loading a
checkpoint take as long as the model's size says, and no step time exists yet to size a limit
by; a join later in the run (an elastic engine) has one. A hung rendezvous still ends at
torch.distributed's own timeout."""

Labelled = tuple[str, int, str, Any]
"""(role, rank, phase, ObjectRef)."""


class StallError(RuntimeError):
    """No step progress within the stall timeout."""

    reason = "Stalled"

    def __init__(self, timeout: float, pending: Sequence[tuple[str, int, str]]) -> None:
        self.pending = list(pending)
        names = ", ".join(f"{role} rank {rank} ({phase})" for role, rank, phase in pending[:12])
        more = f" and {len(pending) - 12} more" if len(pending) > 12 else ""
        super().__init__(
            f"no step progress for {timeout:.0f}s: {names}{more} did not report "
            "(spec.failurePolicy.stallTimeoutSeconds)"
        )


def wait_or_name(labelled: Sequence[Labelled], timeout: float | None) -> None:
    """Wait until every ref is ready; raise :class:`StallError` naming those still pending after
    ``timeout`` seconds (no limit when ``timeout`` is falsy)."""
    if not timeout or not labelled:
        return
    import ray

    refs = [ref for *_, ref in labelled]
    _, pending = ray.wait(refs, num_returns=len(refs), timeout=timeout, fetch_local=False)
    if pending:
        waiting = set(pending)
        raise StallError(timeout, [(r, k, p) for r, k, p, ref in labelled if ref in waiting])


class Watchdog:
    """The driver's waits, each bounded by :attr:`limit` and named by role, rank and phase."""

    def __init__(self) -> None:
        self.floor: float | None = None
        self.factor = STEP_FACTOR
        self.slowest = 0.0
        self.stalled: list[tuple[str, int, str]] = []
        """What the last :class:`StallError` named (empty: no stall this run)."""

    def configure(self, floor: float | None, factor: float = STEP_FACTOR) -> None:
        """A new run: ``floor`` is ``stall_timeout_seconds`` (None or 0: no limit)."""
        self.floor, self.factor, self.slowest = floor or None, factor, 0.0
        self.stalled = []

    @property
    def limit(self) -> float | None:
        """max(floor, factor x the slowest step seen); None: waits are unbounded."""
        if not self.floor:
            return None
        return max(self.floor, self.factor * self.slowest)

    def limit_for(self, phases: Iterable[str]) -> float | None:
        """The limit of a wait on ``phases``: :attr:`limit`, but none for a start-up wait
        (every phase in :data:`STARTUP_PHASES`) before the first step has completed."""
        if not self.slowest and all(p in STARTUP_PHASES for p in phases):
            return None
        return self.limit

    def step_took(self, seconds: float) -> None:
        """A completed step's wall time (raises the limit when it is the slowest yet)."""
        self.slowest = max(self.slowest, float(seconds))

    def wait(self, labelled: Sequence[Labelled]) -> None:
        """Wait for every ref of ``labelled``; :class:`StallError` names those late (and
        :attr:`stalled` keeps them: shutdown then does not wait long on a hung worker)."""
        try:
            wait_or_name(labelled, self.limit_for(phase for _, _, phase, _ in labelled))
        except StallError as exc:
            self.stalled = exc.pending
            raise

    def get(self, refs: Any, role: str, phase: str, ranks: Sequence[int] | None = None) -> Any:
        """``ray.get(refs)`` (one ref or a list) once :meth:`wait` has seen every one ready;
        ``ranks``: the rank of each ref (default: its position)."""
        import ray

        one = not isinstance(refs, list)
        many = [refs] if one else list(refs)
        ranks = list(ranks) if ranks is not None else list(range(len(many)))
        self.wait([(role, k, phase, ref) for k, ref in zip(ranks, many, strict=True)])
        out = ray.get(many)
        return out[0] if one else out

    def get_labelled(self, labelled: Sequence[Labelled]) -> list[Any]:
        """The values of ``labelled``'s refs once :meth:`wait` has seen every one ready."""
        import ray

        self.wait(labelled)
        return list(ray.get([ref for *_, ref in labelled]))

    def first_ready(self, refs: list[Any], timeout: float | None) -> list[Any]:
        """The refs ready within ``timeout`` seconds (at least one, unless none were): a wait
        with its own explicit bound (0: a poll; None, the stall limit off: unbounded)."""
        import ray

        if not refs:
            return []
        ready, _ = ray.wait(refs, num_returns=1, timeout=timeout, fetch_local=False)
        return list(ready)

    def done(self, refs: list[Any]) -> list[Any]:
        """The refs already finished (a poll: no wait)."""
        import ray

        if not refs:
            return []
        ready, _ = ray.wait(refs, num_returns=len(refs), timeout=0, fetch_local=False)
        return list(ready)

    def get_within(self, refs: list[Any], timeout: float) -> list[Any]:
        """``ray.get`` with an explicit bound (closing processes at shutdown)."""
        import ray

        return list(ray.get(refs, timeout=timeout))


WATCHDOG = Watchdog()
"""The driver's (one run per process at a time)."""

__all__ = ["STARTUP_PHASES", "STEP_FACTOR", "WATCHDOG", "StallError", "Watchdog", "wait_or_name"]
