"""Critic overrides: the critic's training settings are the actor's with a few keys on top
(`spec.roles.critic.overrides`, or the trainer's `--critic-config-path` file)."""

from __future__ import annotations

import re
from typing import Any

from ppojob_api.problems import Problem, SpecError, pydantic_problems
from ppojob_api.trainspec.settings import TrainingSettings
from ppojob_api.yamlio import load_yaml


def _norm(key: str) -> str:
    return re.sub(r"[^a-z0-9]", "", key.lower())


# Normalised key -> field name. camelCase and snake_case spellings normalise alike.
_OVERRIDABLE = {_norm(name): name for name in TrainingSettings.model_fields}
_OVERRIDABLE |= {"lr": "learning_rate", "minlr": "min_learning_rate"}

# Keys (normalised: lower case, no separators) that would change GPU allocation or node counts.
_ALLOCATION_KEYS = {
    "replicas",
    "gpus",
    "numgpus",
    "gpuspernode",
    "numgpuspernode",
    "nodes",
    "numnodes",
    "nnodes",
    "criticnumnodes",
    "criticnumgpuspernode",
    "actornumnodes",
    "actornumgpuspernode",
    "resources",
    "cpus",
    "memory",
    "colocate",
    "colocatewithactor",
    "colocatecritic",
    "parallelism",
    "tensor",
    "pipeline",
    "context",
    "tensorparallel",
    "tensormodelparallelsize",
    "pipelinemodelparallelsize",
    "contextparallelsize",
    "worldsize",
    "nodeselector",
    "tolerations",
    "numworkers",
    "workers",
}


def overridable_field(key: str) -> str | None:
    """The TrainingSettings field a critic override key sets (any spelling), or None."""
    return _OVERRIDABLE.get(_norm(key))


def check_critic_overrides(overrides: Any, path: str) -> list[Problem]:
    """Problems with a critic overrides mapping (forbidden, unknown or ill-typed keys)."""
    if not isinstance(overrides, dict):
        return [
            Problem(
                path,
                f"must be a mapping, got {type(overrides).__name__}",
                "write `overrides: {learningRate: 1e-5}`",
            )
        ]
    problems = []
    for key in overrides:
        norm = _norm(str(key))
        if norm in _ALLOCATION_KEYS:
            problems.append(
                Problem(
                    f"{path}.{key}",
                    "critic overrides may not change GPU allocation or node counts",
                    "size the critic with spec.roles.critic.replicas, resources and parallelism",
                )
            )
        elif norm not in _OVERRIDABLE:
            allowed = ", ".join(f.alias or n for n, f in TrainingSettings.model_fields.items())
            problems.append(
                Problem(f"{path}.{key}", "not a training setting", f"use one of: {allowed}")
            )
    if problems:
        return problems
    user_key = {_OVERRIDABLE[_norm(str(k))]: str(k) for k in overrides}
    try:
        TrainingSettings.model_validate(_canonical_overrides(overrides))
    except Exception as exc:  # pydantic.ValidationError
        for problem in pydantic_problems(exc, path):
            field = problem.path.removeprefix(f"{path}.")
            shown = f"{path}.{user_key.get(field, field)}"
            problems.append(Problem(shown, problem.message, problem.fix))
    return problems


def _canonical_overrides(overrides: dict[str, Any]) -> dict[str, Any]:
    return {_OVERRIDABLE[_norm(str(k))]: v for k, v in overrides.items()}


def apply_critic_overrides(base: TrainingSettings, overrides: dict[str, Any]) -> TrainingSettings:
    """The critic's settings: `base` with `overrides` on top; unspecified keys inherit."""
    problems = check_critic_overrides(overrides, "spec.roles.critic.overrides")
    if problems:
        raise SpecError(problems)
    data = {name: getattr(base, name) for name in TrainingSettings.model_fields}
    data.update(_canonical_overrides(overrides))
    return TrainingSettings.model_validate(data)


def parse_critic_override_file(text: str, source: str = "critic config") -> dict[str, Any]:
    """Parse the trainer's `--critic-config-path` file: `critic: [{name: default, overrides: {}}]`.

    Returns the overrides mapping, validated with the same rules as spec.roles.critic.overrides.
    """
    fmt = "critic: [{name: default, overrides: {learningRate: 1e-5}}]"
    doc = load_yaml(text, source)  # strict: duplicate keys are errors, 1e-5 is a number
    if not isinstance(doc, dict) or set(doc) != {"critic"}:
        got = sorted(doc) if isinstance(doc, dict) else type(doc).__name__
        raise SpecError(
            [Problem(source, f"expected one top-level key `critic`, got {got}", f"write {fmt}")],
            source,
        )
    entries = doc["critic"]
    if not isinstance(entries, list) or len(entries) != 1:
        n = len(entries) if isinstance(entries, list) else type(entries).__name__
        raise SpecError(
            [Problem("critic", f"must be a list of exactly one entry, got {n}", f"write {fmt}")],
            source,
        )
    entry = entries[0]
    if not isinstance(entry, dict) or not isinstance(entry.get("name"), str):
        raise SpecError(
            [
                Problem(
                    "critic[0]", "needs a string `name` and an `overrides` mapping", f"write {fmt}"
                )
            ],
            source,
        )
    extra = set(entry) - {"name", "overrides"}
    problems = [
        Problem(f"critic[0].{k}", "unknown key", "use only name and overrides") for k in extra
    ]
    overrides = entry.get("overrides", {}) or {}
    problems += check_critic_overrides(overrides, "critic[0].overrides")
    if problems:
        raise SpecError(problems, source)
    return dict(overrides)
