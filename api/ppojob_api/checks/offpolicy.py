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


def check_partial_rollout(half: TrainingHalf, prefix: str = "spec") -> list[Problem]:
    """Partial rollout interrupts generations in flight at a weight sync: there are some only
    with maxStaleness > 0, and only the torch engine's single-turn generation takes new
    weights between two tokens."""
    algo = half.algorithm
    if not algo.partial_rollout:
        return []
    field = f"{prefix}.algorithm.partialRollout"
    found: list[Problem] = []
    if algo.max_staleness == 0:
        found.append(
            Problem(
                field,
                "partial rollout lets a weight sync interrupt generations in flight, but with "
                "maxStaleness 0 no generation runs during a sync",
                "set algorithm.maxStaleness to 1 or more, or partialRollout: false",
            )
        )
    if half.roles.rollout.backend != "torch":
        found.append(
            Problem(
                field,
                f"partial rollout is implemented for torch engines, not "
                f"{half.roles.rollout.backend} (its generations finish with the weights they "
                "started with)",
                "set roles.rollout.backend: torch, or partialRollout: false",
            )
        )
    if half.data.agent is not None:
        found.append(
            Problem(
                field,
                "multi-turn agent rollouts (data.agent) take new weights between turns, not "
                "between two tokens of a turn",
                "unset data.agent, or set partialRollout: false",
            )
        )
    return found
