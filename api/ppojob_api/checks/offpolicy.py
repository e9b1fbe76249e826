"""Checks of bounded staleness and the off-policy correction against the rest of the spec."""

from __future__ import annotations

from ppojob_api.problems import Problem
from ppojob_api.training import TrainingHalf


def check_staleness(half: TrainingHalf, prefix: str = "spec") -> list[Problem]:
    """Generation overlaps training only on engines of their own: a colocated engine lives in
    the actor's worker process, which runs one call at a time."""
    algo = half.algorithm
    if algo.max_staleness == 0 or not half.roles.rollout.colocate_with_actor:
        return []
    return [
        Problem(
            f"{prefix}.algorithm.maxStaleness",
            f"maxStaleness {algo.max_staleness} overlaps generation with training, but a "
            "colocated engine shares the actor's worker process and cannot generate while it "
            "trains",
            "set roles.rollout.colocateWithActor: false, or maxStaleness: 0",
        )
    ]


def check_importance_sampling(half: TrainingHalf, prefix: str = "spec") -> list[Problem]:
    """tisCap is token-level truncated importance sampling: one correction, not two."""
    algo = half.algorithm
    if algo.importance_sampling is None or algo.tis_cap is None:
        return []
    return [
        Problem(
            f"{prefix}.algorithm.importanceSampling",
            "tisCap and importanceSampling both weigh the policy loss by pi_old / pi_rollout, "
            "so the loss would be corrected twice",
            "remove tisCap (importanceSampling {level: token, mode: truncate, cap} is the same "
            "correction)",
        )
    ]
