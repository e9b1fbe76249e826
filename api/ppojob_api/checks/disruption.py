"""Checks of the settings that decide how a job survives disruption: the gang's Permit timeout
against its overall timeout, and the pods' grace period against what a checkpoint needs."""

from __future__ import annotations

from ppojob_api.problems import Problem
from ppojob_api.spec import PPOJobSpec

MIN_GRACE_WITH_VOLUME = 30
"""Below this a preempted trainer can rarely finish a step and write a checkpoint: the model's
shards go to a network volume (the trainer measures the real cost and warns)."""


def check_gang_timeouts(spec: PPOJobSpec, prefix: str = "spec") -> list[Problem]:
    """The pods of a partial gang cannot wait at Permit longer than the whole job waits."""
    sched = spec.scheduling
    if sched.permit_timeout_seconds > sched.timeout_seconds:
        return [
            Problem(
                f"{prefix}.scheduling.permitTimeoutSeconds",
                f"{sched.permit_timeout_seconds} is longer than timeoutSeconds "
                f"{sched.timeout_seconds}",
                f"set it to at most {sched.timeout_seconds}: the pods of a partial gang hold "
                "their GPUs that long",
            )
        ]
    return []


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
