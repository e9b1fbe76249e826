"""Which models train at a given step: critic warm-up and critic updates per step.

Steps are 0-based. With a critic, the critic trains ``critic_updates_per_step`` times at every
step and the actor does not train during the first ``critic_warmup_steps`` steps (steps
``0 .. critic_warmup_steps - 1``), so the critic's values are sensible before they steer the
policy. Without a critic, ``critic_warmup_steps`` and ``critic_updates_per_step`` are ignored:
no critic update, and the actor trains at every step.
"""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["StepPlan", "plan_step"]


@dataclass(frozen=True)
class StepPlan:
    """What trains at one step: ``critic_updates`` critic updates, then the actor if
    ``actor_trains``."""

    critic_updates: int
    actor_trains: bool


def _int(value: int, name: str, minimum: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise ValueError(f"{name} must be an integer, got {value!r}")
    if value < minimum:
        raise ValueError(f"{name} must be >= {minimum}, got {value}")
    return value


def plan_step(
    step: int,
    *,
    has_critic: bool,
    critic_warmup_steps: int,
    critic_updates_per_step: int,
) -> StepPlan:
    """The :class:`StepPlan` for 0-based ``step`` (see the module docstring).

    ``ValueError`` when ``step < 0`` or ``critic_warmup_steps < 0``, or, with a critic, when
    ``critic_updates_per_step < 1``.
    """
    _int(step, "step", 0)
    if not has_critic:
        return StepPlan(critic_updates=0, actor_trains=True)
    warmup = _int(critic_warmup_steps, "critic_warmup_steps", 0)
    updates = _int(critic_updates_per_step, "critic_updates_per_step", 1)
    return StepPlan(critic_updates=updates, actor_trains=step >= warmup)
