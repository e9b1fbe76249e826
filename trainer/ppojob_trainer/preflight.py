"""What `ppojob run` checks before it starts Ray (15-25 s later a worker would find the same):
local paths exist, hook modules import, and hooks take the arguments the trainer passes. Each
problem is one line naming the field. Imports neither torch nor Ray; the workers load hooks with
the same function (`ppojob_trainer.hookload.load_function`)."""

from __future__ import annotations

import os
import sys
from pathlib import Path

from ppojob_api.training import TrainerConfig
from ppojob_api.trainspec.model import model_path_kind
from ppojob_trainer.hookload import call_problem, load_function

REWARD_CALL = "fn(prompts, completions, labels), three lists of one length"
ADVANTAGE_CALL = (
    "fn(token_rewards=, scores=, values=, response_masks=, group_ids=, gamma=, lam=) by keyword"
)


def dataset_problem(field: str, value: str) -> str | None:
    """Why the dataset `value` of `field` cannot be read here (it does not exist; a hub id is
    named as such), or None. The trainer's dataset loader says the same."""
    if value.startswith("builtin:") or Path(value).expanduser().exists():
        return None
    where = f"{field}: {value!r} does not exist (relative to {os.getcwd()})"
    looks_like_hub_id = "/" in value and not value.startswith(("/", ".", "~"))
    if looks_like_hub_id and "." not in value.rsplit("/", 1)[-1]:
        return (
            f"{where}; a Hugging Face hub dataset id is not downloaded by the trainer: load it "
            "with `datasets` and save_to_disk, then give that directory"
        )
    return f"{where}; give a .jsonl, .json or .parquet file or a save_to_disk directory"


def model_dir_problem(field: str, value: str) -> str | None:
    """An existing directory that holds no Hugging Face model (no config.json), or None. The
    trainer's model loader says the same."""
    local = Path(value).expanduser()
    if local.is_dir() and not (local / "config.json").is_file():
        return (
            f"{field}: directory {value!r} holds no config.json, so it is not a Hugging Face "
            "model directory (write one with save_pretrained, or give a hub id)"
        )
    return None


def preflight(cfg: TrainerConfig) -> list[str]:
    """Every problem a local run would meet at start-up, as `field: what (fix)` lines."""
    problems: list[str] = []
    data = cfg.data
    for field, value in (("data.prompts", data.prompts), ("data.evalPrompts", data.eval_prompts)):
        if value is not None:
            problem = dataset_problem(field, value)
            if problem:
                problems.append(problem)
    for field, value in (
        ("model.path", cfg.model.path),
        ("model.criticPath", cfg.model.critic_path),
    ):
        local = value is not None and model_path_kind(value) == "local"
        if local and not Path(str(value)).expanduser().is_dir():
            problems.append(f"{field}: model directory {value!r} does not exist")
        elif value is not None:
            problem = model_dir_problem(field, value)
            if problem:
                problems.append(problem)
    for i, src in enumerate(data.rewards):
        if src.model is not None:
            field, value = f"data.rewards[{i}].model.path", src.model.path
            if not Path(value).expanduser().is_dir():
                problems.append(f"{field}: reward model directory {value!r} does not exist")
            else:
                problem = model_dir_problem(field, value)
                if problem:
                    problems.append(problem)
    cwd = os.getcwd()
    added = cwd not in sys.path
    if added:
        sys.path.insert(0, cwd)  # `ppojob run` from a project directory imports its modules
    try:
        hooks = (
            ("data.rewardFunction", data.reward_function, (["p"], ["c"], [None]), {}, REWARD_CALL),
            (
                "algorithm.customAdvantageFunction",
                cfg.algorithm.custom_advantage_function,
                (),
                dict.fromkeys(("token_rewards", "scores", "values", "response_masks", "group_ids"))
                | {"gamma": 1.0, "lam": 1.0},
                ADVANTAGE_CALL,
            ),
        )
        hooks += tuple(
            (f"data.rewards[{i}].function", src.function, (["p"], ["c"], [None]), {}, REWARD_CALL)
            for i, src in enumerate(data.rewards)
        )
        for field, path, args, kwargs, call in hooks:
            if not path or path.startswith("builtin:"):
                continue
            try:
                fn = load_function(path, field)
            except ValueError as exc:
                problems.append(str(exc))
                continue
            why = call_problem(fn, args, kwargs, call)
            if why:
                problems.append(f"{field}: {path!r}: {why}")
    finally:
        if added:
            sys.path.remove(cwd)
    return problems
