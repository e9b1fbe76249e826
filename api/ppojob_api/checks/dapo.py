"""Checks of the algorithm pack (DAPO's dynamic sampling and overlong shaping, GSPO) against the
rest of the spec."""

from __future__ import annotations

from ppojob_api.problems import Problem
from ppojob_api.training import TrainingHalf
from ppojob_api.trainspec.constants import GROUP_ESTIMATORS


def check_dynamic_sampling(half: TrainingHalf, prefix: str = "spec") -> list[Problem]:
    """Dynamic sampling filters groups of equal rewards: it needs groups, and generation done at
    the step that trains on it."""
    algo = half.algorithm
    if algo.dynamic_sampling is None:
        return []
    field = f"{prefix}.algorithm.dynamicSampling"
    found = []
    if algo.advantage_estimator not in GROUP_ESTIMATORS:
        found.append(
            Problem(
                field,
                f"dynamic sampling filters prompt groups whose rewards are all equal, which only "
                f"group estimators make worthless, not {algo.advantage_estimator}",
                f"set advantageEstimator to one of {', '.join(GROUP_ESTIMATORS)}, "
                "or unset dynamicSampling",
            )
        )
    if half.data.samples_per_prompt < 2:
        found.append(
            Problem(
                field,
                "dynamic sampling compares the rewards of a prompt's samples, but "
                f"samplesPerPrompt is {half.data.samples_per_prompt}",
                "set data.samplesPerPrompt >= 2, or unset dynamicSampling",
            )
        )
    if algo.max_staleness > 0:
        found.append(
            Problem(
                field,
                "dynamic sampling refills a step by generating at that step, but with "
                f"maxStaleness {algo.max_staleness} a step's generation is launched steps ahead "
                "(and a resumed run would draw its prompts in another order)",
                "set maxStaleness: 0, or unset dynamicSampling",
            )
        )
    return found


def check_overlong_shaping(half: TrainingHalf, prefix: str = "spec") -> list[Problem]:
    """The punishment buffer lies below maxResponseLength."""
    shaping = half.algorithm.overlong_shaping
    if shaping is None or shaping.buffer_length < half.data.max_response_length:
        return []
    return [
        Problem(
            f"{prefix}.algorithm.overlongShaping.bufferLength",
            f"{shaping.buffer_length} is not smaller than data.maxResponseLength "
            f"{half.data.max_response_length}: the buffer is the last bufferLength tokens below it",
            f"set bufferLength below {half.data.max_response_length} "
            "(DAPO: a fifth of the maximum length)",
        )
    ]


def check_policy_loss(half: TrainingHalf, prefix: str = "spec") -> list[Problem]:
    """GSPO clips a sequence-level ratio: the token-level dual clip has no meaning there."""
    algo = half.algorithm
    if algo.policy_loss != "gspo" or algo.dual_clip is None:
        return []
    return [
        Problem(
            f"{prefix}.algorithm.dualClip",
            "dual clip bounds PPO's token-level ratio; policyLoss gspo clips one ratio per "
            "sample and does not use it",
            "unset dualClip, or set policyLoss: ppo",
        )
    ]
