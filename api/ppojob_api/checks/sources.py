"""Checks of where the job's inputs come from: the reward function, the prompt datasets and the
model paths."""

from __future__ import annotations

import re

from ppojob_api.base import HOOK_PATTERN
from ppojob_api.problems import Problem
from ppojob_api.training import BUILTIN_TASKS, TrainingHalf, model_path_kind

_BUILTIN_TASK_FIX = f"use one of {[f'builtin:{t}' for t in BUILTIN_TASKS]}"
_NEEDS_REWARD = ("a dataset needs a reward function", "set rewardFunction: package.module:function")


def check_reward_function(half: TrainingHalf, prefix: str = "spec") -> list[Problem]:
    """`rewardFunction` is a known built-in or a `module:function` hook."""
    value = half.data.reward_function
    if value is None:
        return []
    if value.startswith("builtin:"):
        if value.removeprefix("builtin:") in BUILTIN_TASKS:
            return []
        return [
            Problem(
                f"{prefix}.data.rewardFunction",
                f"unknown built-in reward {value!r}",
                _BUILTIN_TASK_FIX,
            )
        ]
    if re.match(HOOK_PATTERN, value):
        return []
    return [
        Problem(
            f"{prefix}.data.rewardFunction",
            f"{value!r} is not `module:function`",
            "write it as `package.module:function` or `builtin:<task>`",
        )
    ]


def _format_problem(value: str, path: str) -> list[Problem]:
    """A dataset path of a format the trainer reads: a name with another extension is refused
    (a name without one is a save_to_disk directory)."""
    name = value.rstrip("/").rsplit("/", 1)[-1]
    if "." in name and not re.search(r"\.(jsonl|json|parquet)/?$", value):
        return [
            Problem(
                path,
                "expected a .jsonl, .json or .parquet file or a directory saved with "
                "`datasets`' save_to_disk",
                "point it at such a dataset or use builtin:<task>",
            )
        ]
    return []


def check_prompts(half: TrainingHalf, prefix: str = "spec") -> list[Problem]:
    """`prompts` is a known built-in task, or a dataset of a format the trainer reads, and a
    dataset comes with a reward function."""
    data = half.data
    if data.prompts.startswith("builtin:"):
        if data.prompts.removeprefix("builtin:") in BUILTIN_TASKS:
            return []
        return [
            Problem(
                f"{prefix}.data.prompts",
                f"unknown built-in task {data.prompts!r}",
                _BUILTIN_TASK_FIX,
            )
        ]
    bad_format = _format_problem(data.prompts, f"{prefix}.data.prompts")
    if bad_format:
        return bad_format
    if data.reward_function is None:
        return [Problem(f"{prefix}.data.rewardFunction", *_NEEDS_REWARD)]
    return []


def check_eval_prompts(half: TrainingHalf, prefix: str = "spec") -> list[Problem]:
    """`evalPrompts` is a known built-in task, or a dataset that comes with a reward function."""
    data = half.data
    ev = data.eval_prompts
    if ev is None:
        return []
    if ev.startswith("builtin:"):
        if ev.removeprefix("builtin:") in BUILTIN_TASKS:
            return []
        return [
            Problem(
                f"{prefix}.data.evalPrompts", f"unknown built-in task {ev!r}", _BUILTIN_TASK_FIX
            )
        ]
    bad_format = _format_problem(ev, f"{prefix}.data.evalPrompts")
    if bad_format:
        return bad_format
    if data.reward_function is None and data.prompts.startswith("builtin:"):
        # the prompts are a built-in task, whose reward scores only its own prompts: the
        # evaluation dataset is what needs the reward function
        return [
            Problem(
                f"{prefix}.data.evalPrompts",
                f"{ev!r} is a dataset, and a dataset needs a reward function (the built-in "
                "task's reward scores only its own prompts)",
                "set rewardFunction: package.module:function, or use builtin:<task>",
            )
        ]
    if data.reward_function is None:
        return [Problem(f"{prefix}.data.rewardFunction", *_NEEDS_REWARD)]
    return []


def check_model_paths(half: TrainingHalf, prefix: str = "spec") -> list[Problem]:
    """`model.path` and `model.criticPath` name something the trainer can load."""
    p: list[Problem] = []
    for field, value in (
        ("model.path", half.model.path),
        ("model.criticPath", half.model.critic_path),
    ):
        if value is None:
            continue
        try:
            model_path_kind(value)
        except ValueError as exc:
            why, _, fix = str(exc).rpartition("; ")  # the path itself may hold "; "
            p.append(Problem(f"{prefix}.{field}", why, fix))
    return p
