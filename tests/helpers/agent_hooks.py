"""A user agent hook and reward function for an end-to-end ``ppojob run`` (``data.agent.function:
tests.helpers.agent_hooks:nines``), loaded by the trainer like any ``module:function``.

Each sample's label is the path of a log file: the hook appends one JSON line per call (the
prompt and the model's turns) there, so the test reads what the hook saw from outside the Ray
workers."""

from __future__ import annotations

import json
from typing import Any

OBSERVATION = "999"


def nines(prompt: str, label: Any, turns: list[str]) -> dict[str, Any]:
    """After the model's first turn, the observation ``999``; after any other, done."""
    with open(str(label), "a") as log:
        log.write(json.dumps({"prompt": prompt, "turns": turns}) + "\n")
    if len(turns) == 1:
        return {"observation": OBSERVATION, "done": False}
    return {"observation": None, "done": True}


def last_turn_nines(prompts: list[str], completions: list[str], labels: list[Any]) -> list[float]:
    """The share of 9s in the model's last turn."""
    return [c.count("9") / max(len(c), 1) for c in completions]
