"""Checks of the settings that decide how a job survives disruption: the pods' grace period
against what a checkpoint needs."""

from __future__ import annotations

from ppojob_api.problems import Problem
from ppojob_api.spec import PPOJobSpec

MIN_GRACE_WITH_VOLUME = 30
"""Below this a preempted trainer can rarely finish a step and write a checkpoint: the model's
shards go to a network volume (the trainer measures the real cost and warns)."""


def check_grace_period(spec: PPOJobSpec, prefix: str = "spec") -> list[Problem]:
    """With a checkpoint volume, a preemption checkpoint must have time to be written."""
    grace = spec.failure_policy.termination_grace_period_seconds
    if spec.checkpoint_volume is not None and grace < MIN_GRACE_WITH_VOLUME:
        return [
            Problem(
                f"{prefix}.failurePolicy.terminationGracePeriodSeconds",
                f"{grace}s leaves no time to finish a step and write a checkpoint on SIGTERM",
                f"set at least {MIN_GRACE_WITH_VOLUME}; the trainer logs the step and "
                "checkpoint times it measures when they do not fit",
            )
        ]
    return []
