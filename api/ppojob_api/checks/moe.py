"""Checks of mixture-of-experts models and routing replay (`algorithm.routingReplay`)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Literal

from ppojob_api.memory_plan import MOE_KEYS
from ppojob_api.problems import Problem
from ppojob_api.training import TrainingHalf
from ppojob_api.trainspec.constants import BUILTIN_MOE_MODELS

REPLAY_MODEL_TYPES = ("qwen3_moe", "mixtral")
"""Hugging Face ``model_type`` values whose routers routing replay drives (the trainer's
``moe.ROUTER_CLASSES``; a trainer test keeps the two in step)."""
_MOE_BUILTINS = [f"builtin:{m}" for m in BUILTIN_MOE_MODELS]

MoeKind = Literal["replayable", "other-moe", "dense"]


def moe_kind(path: str) -> MoeKind | None:
    """What ``model.path`` is: a MoE model routing replay drives (``replayable``), another MoE
    architecture, a dense model, or None when it cannot be told here (a hub id, a directory
    without a readable config.json)."""
    if path.startswith("builtin:"):
        return "replayable" if path[8:] in BUILTIN_MOE_MODELS else "dense"
    try:
        config = json.loads((Path(path).expanduser() / "config.json").read_text())
    except (OSError, ValueError):
        return None
    if not isinstance(config, dict):
        return None
    if config.get("model_type") in REPLAY_MODEL_TYPES:
        return "replayable"
    if any(config.get(k) for k in MOE_KEYS):
        return "other-moe"
    return "dense"


def check_routing_replay(half: TrainingHalf, prefix: str = "spec") -> list[Problem]:
    """`routingReplay: rollout` needs a MoE model whose routers the trainer can drive, torch
    actor workers (the megatron backend does not replay routing) and single-turn generation
    (the multi-turn engine calls do not record routing)."""
    algo = half.algorithm
    if algo.routing_replay != "rollout":
        return []
    field = f"{prefix}.algorithm.routingReplay"
    problems: list[Problem] = []
    path = half.model.path
    kind = moe_kind(path)
    if kind == "dense":
        problems.append(
            Problem(
                field,
                f"routing replay needs a mixture-of-experts model, but {path} is dense (it has "
                "no router whose choice could be replayed)",
                f"set routingReplay: none, or use a MoE model ({', '.join(_MOE_BUILTINS)}, or a "
                "Qwen3-MoE or Mixtral checkpoint)",
            )
        )
    elif kind == "other-moe":
        problems.append(
            Problem(
                field,
                f"{path} is a mixture-of-experts model of an architecture whose routers the "
                f"trainer cannot replay (it drives {', '.join(REPLAY_MODEL_TYPES)})",
                "set routingReplay: none, or use a Qwen3-MoE or Mixtral checkpoint",
            )
        )
    if half.roles.actor.backend == "megatron":
        problems.append(
            Problem(
                field,
                "the megatron backend does not replay routing (its actor forward routes for "
                "itself)",
                "set roles.actor.backend: torch, or routingReplay: none",
            )
        )
    if half.data.agent is not None:
        problems.append(
            Problem(
                field,
                "multi-turn generation (data.agent) does not record the experts of the tokens "
                "it feeds between turns",
                "set routingReplay: none for a multi-turn job",
            )
        )
    return problems


def check_moe_backends(half: TrainingHalf, prefix: str = "spec") -> list[Problem]:
    """A MoE model on a megatron role: the megatron backend here converts dense Llama/Qwen2
    architectures only (expert parallelism is not built), so the job is refused before it
    starts instead of at the first conversion."""
    problems: list[Problem] = []
    roles = half.roles
    critic = roles.effective_critic(half.algorithm.needs_critic)
    for name, spec in (("actor", roles.actor), ("critic", critic)):
        if spec is None or spec.backend != "megatron":
            continue
        path = half.model.critic_path if name == "critic" and half.model.critic_path else None
        path = path or half.model.path
        if moe_kind(path) in ("replayable", "other-moe"):
            problems.append(
                Problem(
                    f"{prefix}.roles.{name}.backend",
                    f"{path} is a mixture-of-experts model; the megatron backend trains dense "
                    "models only (no expert parallelism)",
                    f"set roles.{name}.backend: torch (FSDP2 shards MoE models)",
                )
            )
    return problems
