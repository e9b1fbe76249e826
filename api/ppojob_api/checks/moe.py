"""Checks of mixture-of-experts models and routing replay (`algorithm.routingReplay`)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Literal

from ppojob_api.checks.megatron import megatron_roles
from ppojob_api.memory_plan import KNOWN_SHAPES, MOE_KEYS, Shape
from ppojob_api.problems import Problem
from ppojob_api.training import TrainingHalf
from ppojob_api.trainspec.constants import BUILTIN_MOE_MODELS

REPLAY_MODEL_TYPES = ("qwen3_moe", "mixtral")
"""Hugging Face ``model_type`` values whose routers routing replay drives (the trainer's
``moe.ROUTER_CLASSES``; a trainer test keeps the two in step), and the MoE architectures the
megatron backend converts."""
_MOE_BUILTINS = [f"builtin:{m}" for m in BUILTIN_MOE_MODELS]

MoeKind = Literal["replayable", "other-moe", "dense"]


def moe_kind(path: str) -> MoeKind | None:
    """What ``model.path`` is: a MoE model routing replay drives (``replayable``), another MoE
    architecture, a dense model, or None when it cannot be told here (a hub id the memory plan
    does not know, a directory without a readable config.json)."""
    if path.startswith("builtin:"):
        return "replayable" if path[8:] in BUILTIN_MOE_MODELS else "dense"
    try:
        config = json.loads((Path(path).expanduser() / "config.json").read_text())
    except (OSError, ValueError):
        known = _known(path)  # a hub id the plan knows: its MoE shapes are all Qwen3-MoE/Mixtral
        return None if known is None else ("replayable" if known.experts else "dense")
    if not isinstance(config, dict):
        return None
    if config.get("model_type") in REPLAY_MODEL_TYPES:
        return "replayable"
    if any(config.get(k) for k in MOE_KEYS):
        return "other-moe"
    return "dense"


def experts_of(path: str) -> int | None:
    """The number of experts per MoE layer of ``model.path``: a built-in's, or a local
    directory's config.json (``num_experts``, ``num_local_experts``, ``n_routed_experts``); None
    when it cannot be told here (a dense model, a hub id, no readable config.json)."""
    if path.startswith("builtin:"):
        found = BUILTIN_MOE_MODELS.get(path[8:])
        return found[0] if found else None
    try:
        config = json.loads((Path(path).expanduser() / "config.json").read_text())
    except (OSError, ValueError):
        known = _known(path)
        return known.experts if known is not None and known.experts else None
    if not isinstance(config, dict):
        return None
    for key in MOE_KEYS:
        value = config.get(key)
        if isinstance(value, int) and not isinstance(value, bool) and value > 0:
            return value
    return None


def _known(path: str) -> Shape | None:
    """The memory plan's shape of a hub id (an ``-Instruct`` suffix ignored), or None."""
    return KNOWN_SHAPES.get(path) or KNOWN_SHAPES.get(path.removesuffix("-Instruct"))


def _model_of(half: TrainingHalf, role: str) -> str:
    """The model a trained role runs (the critic's ``model.criticPath`` when set)."""
    critic = half.model.critic_path if role == "critic" else None
    return critic or half.model.path


def check_routing_replay(half: TrainingHalf, prefix: str = "spec") -> list[Problem]:
    """`routingReplay: rollout` needs a MoE model whose routers the trainer can drive and
    single-turn generation (the multi-turn engine calls do not record routing). Both actor
    backends replay: torch through hooks on its routers, megatron through the top-k hook of
    megatron-core's router (trainer's megatron_routing.py)."""
    algo = half.algorithm
    if algo.routing_replay != "rollout":
        return []
    field = f"{prefix}.algorithm.routingReplay"
    problems = _router_model(half, field, "routing replay", "set routingReplay: none")
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


def check_router_aux_loss(half: TrainingHalf, prefix: str = "spec") -> list[Problem]:
    """`routerAuxLossCoefficient` > 0 needs a MoE model whose routers the trainer reads
    (Qwen3-MoE, Mixtral): on a dense model the loss would not exist."""
    if not half.algorithm.router_aux_loss_coefficient:
        return []
    field = f"{prefix}.algorithm.routerAuxLossCoefficient"
    return _router_model(
        half, field, "a router load-balancing loss", "set routerAuxLossCoefficient: 0"
    )


def _router_model(half: TrainingHalf, field: str, what: str, off: str) -> list[Problem]:
    """``what`` (a feature that drives the routers) refused on a dense model or a MoE model of
    an architecture whose routers the trainer does not know; ``off`` turns it off."""
    path = half.model.path
    kind = moe_kind(path)
    if kind == "dense":
        return [
            Problem(
                field,
                f"{what} needs a mixture-of-experts model, but {path} is dense (it has no router)",
                f"{off}, or use a MoE model ({', '.join(_MOE_BUILTINS)}, or a Qwen3-MoE or "
                "Mixtral checkpoint)",
            )
        ]
    if kind == "other-moe":
        return [
            Problem(
                field,
                f"{path} is a mixture-of-experts model of an architecture whose routers the "
                f"trainer does not drive (it drives {', '.join(REPLAY_MODEL_TYPES)})",
                f"{off}, or use a Qwen3-MoE or Mixtral checkpoint",
            )
        ]
    return []


def check_moe_backends(half: TrainingHalf, prefix: str = "spec") -> list[Problem]:
    """A MoE model on a megatron role: the megatron backend converts the Llama, Qwen2,
    Qwen3-MoE and Mixtral architectures, so another MoE architecture is refused before the job
    starts instead of at the first conversion (a Qwen3-MoE or Mixtral model trains there, its
    experts split by ``parallelism.expert``)."""
    problems: list[Problem] = []
    for name, _ in megatron_roles(half):
        path = _model_of(half, name)
        if moe_kind(path) == "other-moe":
            problems.append(
                Problem(
                    f"{prefix}.roles.{name}.backend",
                    f"{path} is a mixture-of-experts model of an architecture the megatron "
                    "backend does not convert (it converts Llama, Qwen2, Qwen3-MoE and Mixtral)",
                    f"set roles.{name}.backend: torch (FSDP2 shards MoE models), or use a "
                    "Qwen3-MoE or Mixtral checkpoint",
                )
            )
    return problems


def check_expert_parallel(half: TrainingHalf, prefix: str = "spec") -> list[Problem]:
    """``parallelism.expert`` on a megatron role (the other backends refuse any above 1:
    ``check_backends``): it splits a mixture-of-experts model's experts, so a dense model has
    none to split; megatron-core's ``tp-cp-ep-dp-pp`` layout takes the expert-parallel ranks
    from the data-parallel ones, so it divides the data-parallel size (workers / (tensor x
    pipeline x context)); and each rank holds experts / expert of every MoE layer, so it
    divides the model's number of experts where that can be told here."""
    problems: list[Problem] = []
    for name, spec in megatron_roles(half):
        mp = spec.parallelism
        if mp.expert == 1:
            continue
        field = f"{prefix}.roles.{name}.parallelism.expert"
        path = _model_of(half, name)
        if moe_kind(path) == "dense":
            problems.append(
                Problem(
                    field,
                    f"expert {mp.expert} splits the experts of a mixture-of-experts model, but "
                    f"{path} is dense (it has no experts)",
                    "set expert: 1 (tensor, pipeline and data parallelism split a dense model), "
                    "or use a MoE model",
                )
            )
            continue
        workers = half.roles.workers_of(name, half.algorithm.needs_critic)
        if workers % mp.model_parallel == 0:  # otherwise check_backends says why
            dp = workers // mp.model_parallel
            if dp % mp.expert:
                problems.append(
                    Problem(
                        field,
                        f"expert {mp.expert} does not divide the data-parallel size {dp} "
                        f"({workers} workers / (tensor x pipeline x context = "
                        f"{mp.model_parallel})); megatron-core takes the expert-parallel ranks "
                        "from the data-parallel ones",
                        f"use an expert size that divides {dp}, or more workers",
                    )
                )
        experts = experts_of(path)
        if experts is not None and experts % mp.expert:
            problems.append(
                Problem(
                    field,
                    f"expert {mp.expert} does not divide the {experts} experts of {path} (each "
                    "rank holds the same number of every layer's experts)",
                    f"use an expert size that divides {experts}",
                )
            )
    return problems


def check_moe_tensor_parallel(half: TrainingHalf, prefix: str = "spec") -> list[Problem]:
    """A mixture-of-experts model on a megatron role under tensor parallelism needs sequence
    parallelism: megatron-core 0.16's MoE layer refuses to train without it."""
    problems: list[Problem] = []
    for name, spec in megatron_roles(half):
        mp = spec.parallelism
        path = _model_of(half, name)
        if mp.tensor > 1 and not mp.sequence_parallel and moe_kind(path) == "replayable":
            problems.append(
                Problem(
                    f"{prefix}.roles.{name}.parallelism.sequenceParallel",
                    f"{path} is a mixture-of-experts model, which megatron-core trains under "
                    f"tensor parallelism ({mp.tensor}) only with sequence parallelism",
                    "set sequenceParallel: true (GPUs with Transformer Engine), or tensor: 1 "
                    "and parallelism.expert to split the experts",
                )
            )
    return problems
