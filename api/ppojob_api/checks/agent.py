"""Checks of `data.agent`: the hook's form, and the backends that honour the environment-token
mask (the torch rollout engine and the torch training backend)."""

from __future__ import annotations

import re

from ppojob_api import k8s_rules
from ppojob_api.base import HOOK_PATTERN
from ppojob_api.problems import Problem
from ppojob_api.training import AgentSpec, TrainingHalf
from ppojob_api.trainspec.constants import BUILTIN_AGENTS, BUILTIN_TOOLS


def check_agent(half: TrainingHalf, prefix: str = "spec") -> list[Problem]:
    """`agent.function` is a known built-in or `module:function`; multi-turn rollouts run on
    the torch rollout engine and the torch training backend only (for now)."""
    agent = half.data.agent
    if agent is None:
        return []
    path = f"{prefix}.data.agent"
    p: list[Problem] = []
    fn = agent.function
    if fn is not None and agent.tools:
        p.append(
            Problem(
                path,
                "function and tools are both set (the environment is one or the other)",
                "keep function (a hook answering every turn) or tools (calls through the chat "
                "template), not both",
            )
        )
    if fn is None and not agent.tools:
        p.append(
            Problem(
                f"{path}.function",
                "an agent needs its environment: a function or tools",
                "set function: module:function (or builtin:calculator), or declare tools",
            )
        )
    if agent.tools:
        p += _check_tools(half, agent, path)
    if fn is not None and fn.startswith("builtin:"):
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
    elif fn is not None and not re.match(HOOK_PATTERN, fn):
        p.append(
            Problem(
                f"{path}.function",
                f"{fn!r} is not `module:function`",
                "write it as `package.module:function` or `builtin:<agent>`",
            )
        )
    if half.roles.rollout.backend != "torch":
        p.append(
            Problem(
                f"{prefix}.roles.rollout.backend",
                f"multi-turn rollouts (data.agent) run on the torch engine; "
                f"{half.roles.rollout.backend} drives no agent turns yet",
                "use backend: torch for the rollout role, or remove data.agent",
            )
        )
    return p


def _check_tools(half: TrainingHalf, agent: AgentSpec, path: str) -> list[Problem]:
    """Declared tools: unique names, a `module:function` or built-in implementation, an object
    JSON schema of parameters, and a chat template to declare them through."""
    p: list[Problem] = []
    if half.data.apply_chat_template is False:
        p.append(
            Problem(
                f"{path}.tools",
                "tools are declared through the tokenizer's chat template, but "
                "data.applyChatTemplate is false",
                "unset data.applyChatTemplate (or set it true), or use an agent function",
            )
        )
    seen: set[str] = set()
    for i, tool in enumerate(agent.tools):
        at = f"{path}.tools[{i}]"
        if tool.name in seen:
            p.append(Problem(f"{at}.name", f"two tools are named {tool.name!r}", "rename one"))
        seen.add(tool.name)
        fn = tool.function
        if fn.startswith("builtin:"):
            if fn.removeprefix("builtin:") not in BUILTIN_TOOLS:
                p.append(
                    Problem(
                        f"{at}.function",
                        f"unknown built-in tool {fn!r}",
                        f"use one of {[f'builtin:{t}' for t in BUILTIN_TOOLS]} or module:function",
                    )
                )
        elif not re.match(HOOK_PATTERN, fn):
            p.append(
                Problem(
                    f"{at}.function",
                    f"{fn!r} is not `module:function`",
                    "write it as `package.module:function` or `builtin:<tool>`",
                )
            )
        p += _check_parameters(tool.parameters, f"{at}.parameters")
    return p


def _check_parameters(schema: dict, at: str) -> list[Problem]:
    """A tool's parameters: a JSON schema of type object whose `properties` is a mapping of
    schemas and whose `required` names only those properties."""
    fix = "write {type: object, properties: {NAME: {type: string}}, required: [NAME]}"
    if schema.get("type") != "object":
        return [Problem(f"{at}.type", f"is {schema.get('type')!r}, not 'object'", fix)]
    props = schema.get("properties", {})
    if not isinstance(props, dict) or not all(isinstance(v, dict) for v in props.values()):
        return [Problem(f"{at}.properties", "is not a mapping of names to JSON schemas", fix)]
    required = schema.get("required", [])
    if not isinstance(required, list) or not all(isinstance(r, str) for r in required):
        return [Problem(f"{at}.required", "is not a list of property names", fix)]
    missing = [r for r in required if r not in props]
    if missing:
        return [
            Problem(
                f"{at}.required",
                f"names {missing}, which are not in properties",
                "declare them under properties or drop them from required",
            )
        ]
    return []


def check_sandbox_role(half: TrainingHalf, prefix: str = "spec") -> list[Problem]:
    """`roles.sandbox` runs data.agent's tool calls: it needs an agent, runs on CPUs only
    (its tool processes use no GPU), is data parallel only, and its runtimeClassName names a
    RuntimeClass (a DNS-1123 subdomain)."""
    role = half.roles.sandbox
    if role is None:
        return []
    path = f"{prefix}.roles.sandbox"
    p: list[Problem] = []
    if half.data.agent is None:
        p.append(
            Problem(
                path,
                "its workers run the tool calls of data.agent, but data.agent is unset",
                "set data.agent (a function or tools), or remove roles.sandbox",
            )
        )
    if role.resources.gpus > 0:
        p.append(
            Problem(
                f"{path}.resources.gpus",
                f"{role.resources.gpus} GPU(s) per sandbox worker, but its tool processes run "
                "on the CPU, so they would stay idle",
                "set roles.sandbox.resources.gpus: 0 (give it cpus instead)",
            )
        )
    if role.parallelism.model_parallel > 1 or role.parallelism.sequence_parallel:
        p.append(
            Problem(
                f"{path}.parallelism",
                "sandbox workers hold no model: they are data parallel only",
                "remove roles.sandbox.parallelism; add replicas for more tool throughput",
            )
        )
    name = role.runtime_class_name
    if name is not None:
        errs = k8s_rules.dns1123_subdomain(name)
        if errs:
            p.append(
                Problem(
                    f"{path}.runtimeClassName",
                    f"{name!r}: {errs[0]}",
                    "use a RuntimeClass's name (kubectl get runtimeclasses), e.g. gvisor",
                )
            )
    return p
