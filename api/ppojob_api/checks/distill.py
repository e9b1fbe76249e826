"""Checks of on-policy distillation (`algorithm.distillation`) against the rest of the spec."""

from __future__ import annotations

from ppojob_api.problems import Problem
from ppojob_api.training import TrainingHalf
from ppojob_api.trainspec.constants import BUILTIN_TEACHERS, GROUP_ESTIMATORS
from ppojob_api.trainspec.model import model_path_kind


def teacher_path_problem(path: str, field: str) -> list[Problem]:
    """A teacher path is a built-in teacher, or any form `model.path` takes."""
    if path.removeprefix("builtin:") in BUILTIN_TEACHERS and path.startswith("builtin:"):
        return []
    try:
        model_path_kind(path)
    except ValueError as exc:
        why, _, fix = str(exc).rpartition("; ")
        if path.startswith("builtin:"):
            fix += f", or {[f'builtin:{t}' for t in BUILTIN_TEACHERS]}"
        return [Problem(field, why, fix)]
    return []


def check_distillation(half: TrainingHalf, prefix: str = "spec") -> list[Problem]:
    """The teacher is loadable, its signal reaches the advantages or the loss, and the
    actor's backend hosts it; a teacher-only job leaves no reward setting unused."""
    algo, data = half.algorithm, half.data
    d = algo.distillation
    if d is None:
        return []
    field = f"{prefix}.algorithm.distillation"
    found = teacher_path_problem(d.teacher, f"{field}.teacher")
    if d.mode == "reward" and algo.advantage_estimator in GROUP_ESTIMATORS:
        found.append(
            Problem(
                f"{field}.mode",
                f"{algo.advantage_estimator} compares outcome rewards within a group, which "
                "discards a per-token reverse-KL reward",
                "set distillation.mode: loss, or advantageEstimator gae or reinforce_plus_plus",
            )
        )
    if half.roles.actor.backend == "megatron":
        found.append(
            Problem(
                f"{field}.teacher",
                "the teacher is held beside the policy by the torch backend's actor workers; "
                "the megatron actor does not host one yet",
                "set roles.actor.backend: torch, or unset distillation",
            )
        )
    if d.task_reward:
        return found
    ignored = [
        name
        for name, given in (
            ("data.rewardFunction", data.reward_function is not None),
            ("data.rewards", bool(data.rewards)),
            ("algorithm.overlongShaping", algo.overlong_shaping is not None),
            ("algorithm.dynamicSampling", algo.dynamic_sampling is not None),
        )
        if given
    ]
    if ignored:
        found.append(
            Problem(
                f"{field}.taskReward",
                f"false leaves the reward out of the advantages, so {', '.join(ignored)} "
                "would do nothing",
                f"set taskReward: true, or unset {', '.join(ignored)}",
            )
        )
    return found


def teacher_alone(half: TrainingHalf) -> bool:
    """Whether the teacher is the only signal (no reward needed)."""
    d = half.algorithm.distillation
    return d is not None and not d.task_reward
