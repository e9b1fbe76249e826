"""Checks of `data.agent`: the hook's form, and the backends that honour the environment-token
mask (the torch rollout engine and the torch training backend)."""

from __future__ import annotations

import re

from ppojob_api.base import HOOK_PATTERN
from ppojob_api.problems import Problem
from ppojob_api.training import BUILTIN_AGENTS, TrainingHalf


def check_agent(half: TrainingHalf, prefix: str = "spec") -> list[Problem]:
    """`agent.function` is a known built-in or `module:function`; multi-turn rollouts run on
    the torch rollout engine and the torch training backend only (for now)."""
    agent = half.data.agent
    if agent is None:
        return []
    path = f"{prefix}.data.agent"
    p: list[Problem] = []
    fn = agent.function
    if fn.startswith("builtin:"):
        name = fn.removeprefix("builtin:")
        if name not in BUILTIN_AGENTS:
            p.append(
                Problem(
                    f"{path}.function",
                    f"unknown built-in agent {fn!r}",
                    f"use one of {[f'builtin:{a}' for a in BUILTIN_AGENTS]} or module:function",
                )
            )
        elif half.data.prompts != f"builtin:{name}":
            p.append(
                Problem(
                    f"{path}.function",
                    f"the built-in agent {fn!r} answers only its own task's prompts",
                    f"set data.prompts: builtin:{name}, or write your own agent hook",
                )
            )
    elif not re.match(HOOK_PATTERN, fn):
        p.append(
            Problem(
                f"{path}.function",
                f"{fn!r} is not `module:function`",
                "write it as `package.module:function` or `builtin:<agent>`",
            )
        )
    why = "cannot mask the environment's tokens out of the loss yet"
    if half.roles.rollout.backend != "torch":
        p.append(
            Problem(
                f"{prefix}.roles.rollout.backend",
                f"multi-turn rollouts (data.agent) run on the torch engine; "
                f"{half.roles.rollout.backend} drives no agent turns yet",
                "use backend: torch for the rollout role, or remove data.agent",
            )
        )
    roles = [("actor", half.roles.actor)]
    critic = half.roles.effective_critic(half.algorithm.needs_critic)
    if critic is not None:
        roles.append(("critic", critic))
    for name, role in roles:
        if role.backend != "torch":
            p.append(
                Problem(
                    f"{prefix}.roles.{name}.backend",
                    f"{role.backend} {why} (data.agent)",
                    f"use backend: torch for the {name} role, or remove data.agent",
                )
            )
    return p
