"""Checks of where the job's inputs come from: the reward function, the prompt datasets and the
model paths."""

from __future__ import annotations

import re
import string
from urllib.parse import urlsplit

from ppojob_api.base import HOOK_PATTERN
from ppojob_api.checks.distill import teacher_alone
from ppojob_api.problems import Problem
from ppojob_api.training import JudgeRewardSource, TrainingHalf
from ppojob_api.trainspec.constants import BUILTIN_MODELS, BUILTIN_TASKS
from ppojob_api.trainspec.data import JUDGE_PLACEHOLDERS, REWARD_KINDS
from ppojob_api.trainspec.model import model_path_kind

_BUILTIN_TASK_FIX = f"use one of {[f'builtin:{t}' for t in BUILTIN_TASKS]}"
_NEEDS_REWARD = ("a dataset needs a reward function", "set rewardFunction: package.module:function")


def check_reward_function(half: TrainingHalf, prefix: str = "spec") -> list[Problem]:
    """`rewardFunction` is a known built-in or a `module:function` hook."""
    value = half.data.reward_function
    if value is None:
        return []
    return _function_problem(value, f"{prefix}.data.rewardFunction")


def _function_problem(value: str, path: str) -> list[Problem]:
    """A reward function is a known built-in or a `module:function` hook."""
    if value.startswith("builtin:"):
        if value.removeprefix("builtin:") in BUILTIN_TASKS:
            return []
        return [Problem(path, f"unknown built-in reward {value!r}", _BUILTIN_TASK_FIX)]
    if re.match(HOOK_PATTERN, value):
        return []
    return [
        Problem(
            path,
            f"{value!r} is not `module:function`",
            "write it as `package.module:function` or `builtin:<task>`",
        )
    ]


def check_rewards(half: TrainingHalf, prefix: str = "spec") -> list[Problem]:
    """`rewards`: not beside rewardFunction; each source is exactly one of function, model and
    http, of a non-zero weight, with a unique name, and its function, model path and URL are of
    a form the trainer loads."""
    data = half.data
    path = f"{prefix}.data.rewards"
    p: list[Problem] = []
    if data.rewards and data.reward_function is not None:
        p.append(
            Problem(
                path,
                "rewards and rewardFunction are both set (rewardFunction is the shorthand of "
                "one function source)",
                f"move rewardFunction into rewards as {{function: {data.reward_function}}}, "
                "or remove rewards",
            )
        )
    seen: dict[str, int] = {}
    for i, src in enumerate(data.rewards):
        at = f"{path}[{i}]"
        given = [k for k in REWARD_KINDS if getattr(src, k) is not None]
        if len(given) != 1:
            p.append(
                Problem(
                    at,
                    "needs exactly one of function, model, http and judge"
                    + (f" (has {' and '.join(given)})" if given else " (has none)"),
                    (
                        "give each source its own entry in rewards"
                        if given
                        else "set one: function: module:function, model: {path: DIR}, "
                        "http: {url: URL} or judge: {model: policy}"
                    ),
                )
            )
        if src.weight == 0:
            p.append(
                Problem(
                    f"{at}.weight",
                    "a weight of 0 computes this source's reward and ignores it",
                    "give it a non-zero weight, or remove the source",
                )
            )
        if src.function is not None:
            p += _function_problem(src.function, f"{at}.function")
        if src.model is not None:
            model_path = src.model.path
            if model_path.startswith("builtin:") or "://" in model_path:
                p.append(
                    Problem(
                        f"{at}.model.path",
                        f"{model_path!r} is not a directory (reward models are loaded from a "
                        "directory only)",
                        "copy the reward model into the image or a volume and give its directory",
                    )
                )
        url = urlsplit(src.http.url) if src.http is not None else None
        if url is not None and (url.username is not None or url.password is not None):
            p.append(
                Problem(
                    f"{at}.http.url",
                    "credentials never go in a PPOJob, the reward endpoint's URL included",
                    "remove user:password@ and send a bearer token with tokenEnv, filled from a "
                    "Secret (spec.podTemplate.env, valueFrom.secretKeyRef)",
                )
            )
        elif src.http is not None and url is not None and not url.hostname:
            p.append(
                Problem(
                    f"{at}.http.url",
                    f"{src.http.url!r} names no host",
                    "write it as http://host[:port]/path or https://...",
                )
            )
        if src.judge is not None:
            p += _judge_problems(src.judge, f"{at}.judge")
        name = src.default_name()
        if len(given) != 1:  # no name of its own to compare
            continue
        if name in seen:
            p.append(
                Problem(
                    f"{at}.name",
                    f"{name!r} is also the name of {path}[{seen[name]}] (names key the metrics "
                    "reward/<name>_mean)",
                    "give each source a unique name",
                )
            )
        else:
            seen[name] = i
    return p


def check_reward_role(half: TrainingHalf, prefix: str = "spec") -> list[Problem]:
    """`roles.reward` holds the reward models of data.rewards: it needs one, its GPUs need a
    model that runs on them, and its workers are data parallel only (each holds whole
    models)."""
    role = half.roles.reward
    if role is None:
        return []
    path = f"{prefix}.roles.reward"
    p: list[Problem] = []
    if not any(src.model is not None for src in half.data.rewards):
        p.append(
            Problem(
                path,
                "its workers hold the reward models of data.rewards, but no source there has a "
                "model",
                "add a source {model: {path: DIR}} to data.rewards, or remove roles.reward",
            )
        )
    models = [src.model for src in half.data.rewards if src.model is not None]
    if role.resources.gpus > 0 and models and all(m.device == "cpu" for m in models):
        p.append(
            Problem(
                f"{path}.resources.gpus",
                f"{role.resources.gpus} GPU(s) per reward worker, but every reward model of "
                "data.rewards runs on the CPU (device: cpu), so they would stay idle",
                "set roles.reward.resources.gpus: 0, or the models' device: auto",
            )
        )
    if role.parallelism.model_parallel > 1 or role.parallelism.sequence_parallel:
        p.append(
            Problem(
                f"{path}.parallelism",
                "reward workers are data parallel only (each holds whole reward models)",
                "remove roles.reward.parallelism; add replicas or GPUs for more throughput",
            )
        )
    return p


def _judge_problems(judge: JudgeRewardSource, at: str) -> list[Problem]:
    """A judge: a model it can load, a template with the placeholders it fills, a pattern that
    compiles with one group, and a score range holding its default."""
    p: list[Problem] = []
    if judge.model != "policy":
        if judge.model.startswith("builtin:"):
            if judge.model.removeprefix("builtin:") not in BUILTIN_MODELS:
                p.append(
                    Problem(
                        f"{at}.model",
                        f"unknown built-in model {judge.model!r}",
                        f"use policy, one of {[f'builtin:{m}' for m in BUILTIN_MODELS]} or a "
                        "model directory",
                    )
                )
        elif "://" in judge.model:
            p.append(
                Problem(
                    f"{at}.model",
                    f"{judge.model!r} is not a directory (judges are loaded from a directory)",
                    "copy the judge model into the image or a volume and give its directory, "
                    "or use policy",
                )
            )
    try:
        fields = [f for _, f, _, _ in string.Formatter().parse(judge.template) if f is not None]
    except ValueError as exc:
        p.append(
            Problem(
                f"{at}.template",
                f"is not a format string ({exc})",
                "write placeholders as {prompt} and {response}, a literal brace as {{ or }}",
            )
        )
    else:
        unknown = sorted({f for f in fields if f not in JUDGE_PLACEHOLDERS})
        if unknown:
            p.append(
                Problem(
                    f"{at}.template",
                    f"has unknown placeholder(s) {unknown}",
                    f"use only {['{' + f + '}' for f in JUDGE_PLACEHOLDERS]}; write a literal "
                    "brace as {{ or }}",
                )
            )
        elif "response" not in fields:
            p.append(
                Problem(
                    f"{at}.template",
                    "has no {response} placeholder, so the judge never sees the response",
                    "put {response} (and {prompt}) in the template",
                )
            )
    try:
        groups = re.compile(judge.score_pattern).groups
    except re.error as exc:
        p.append(
            Problem(
                f"{at}.scorePattern",
                f"does not compile ({exc})",
                r"write a Python regular expression such as (-?\d+(?:\.\d+)?)",
            )
        )
    else:
        if groups != 1:
            p.append(
                Problem(
                    f"{at}.scorePattern",
                    f"has {groups} groups; the score is read from exactly one",
                    "keep one capturing group around the number; make the others (?:...)",
                )
            )
    if judge.min_score >= judge.max_score:
        p.append(
            Problem(
                f"{at}.minScore",
                f"{judge.min_score:g} is not below maxScore {judge.max_score:g}",
                "give a range with minScore < maxScore",
            )
        )
    elif not judge.min_score <= judge.default_score <= judge.max_score:
        p.append(
            Problem(
                f"{at}.defaultScore",
                f"{judge.default_score:g} is outside [minScore, maxScore] = "
                f"[{judge.min_score:g}, {judge.max_score:g}]",
                "give a default score within the range",
            )
        )
    return p


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
    if data.reward_function is None and not data.rewards and not teacher_alone(half):
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
    if data.reward_function is None and not data.rewards and data.prompts.startswith("builtin:"):
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
    if data.reward_function is None and not data.rewards:
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
