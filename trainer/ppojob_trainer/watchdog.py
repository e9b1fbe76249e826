"""Stall watchdog: a step whose workers stop reporting is named, not waited on forever.

The driver holds one ObjectRef per worker and phase of the step (generate, values, prepare,
train, wake, weight sync). :func:`wait_or_name` waits for all of them at most
``TrainerConfig.stall_timeout_seconds`` (``spec.failurePolicy.stallTimeoutSeconds``); when some
are still pending it raises :class:`StallError`, whose one line names the role, rank and phase
of each worker that did not report. It reaches the PPOJob (``status.progress.error``, reason
``Stalled``) and the failure policy decides: restart (a hung collective, a lost node) or fail.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

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


__all__ = ["StallError", "wait_or_name"]
