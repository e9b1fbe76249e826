"""Checks of the roles on the megatron backend.

A model directory's architecture and shape are checked when the trainer loads it, with the same
messages (``backends/megatron_convert.py``); here only what the spec alone shows."""

from __future__ import annotations

from ppojob_api.problems import Problem
from ppojob_api.training import ActorRole, CriticRole, TrainingHalf
from ppojob_api.trainspec.constants import BUILTIN_MEGATRON_SHAPES


def megatron_roles(half: TrainingHalf) -> list[tuple[str, ActorRole | CriticRole]]:
    """The trained roles (actor, and the critic the trainer runs) on the megatron backend."""
    roles = half.roles
    critic = roles.effective_critic(half.algorithm.needs_critic)
    return [
        (n, s)
        for n, s in (("actor", roles.actor), ("critic", critic))
        if s is not None and s.backend == "megatron"
    ]


def check_megatron_top_p(half: TrainingHalf, prefix: str = "spec") -> list[Problem]:
    """A megatron actor computes log-probs over the full vocabulary: top-p sampling would make
    the rollout policy differ from pi_old."""
    if half.roles.actor.backend != "megatron" or half.data.top_p >= 1.0:
        return []
    return [
        Problem(
            f"{prefix}.data.topP",
            "the megatron actor computes pi_old and pi_theta over the full "
            "tensor-parallel vocabulary, so top-p sampling would make the rollout "
            "policy differ from pi_old",
            "set data.topP: 1.0, or use backend: torch for the actor",
        )
    ]


def check_megatron_devices(half: TrainingHalf, prefix: str = "spec") -> list[Problem]:
    """What a megatron role cannot do: context parallelism (not implemented), half precision
    without GPUs, sequence parallelism without tensor-parallel GPUs."""
    roles = half.roles
    p: list[Problem] = []
    for name, spec in megatron_roles(half):
        rpath = f"{prefix}.roles.{name}"
        owner = roles.actor if getattr(spec, "colocate_with_actor", False) else spec
        gpus, mp = owner.resources.gpus, spec.parallelism
        if mp.context > 1:
            p.append(
                Problem(
                    f"{rpath}.parallelism.context",
                    f"context parallelism ({mp.context}) is not implemented by the megatron "
                    "backend: megatron-core expects each context-parallel rank to hold its "
                    "own part of every sequence, and the backend gives every rank the whole "
                    "sequence",
                    "set context: 1 (tensor and pipeline parallelism, and packing with "
                    "maxTokensPerMicroBatch, bound the memory of long sequences)",
                )
            )
        if mp.sequence_parallel and (gpus == 0 or mp.tensor == 1):
            p.append(
                Problem(
                    f"{rpath}.parallelism.sequenceParallel",
                    "sequence parallelism splits activations over tensor-parallel GPUs "
                    f"(here tensor {mp.tensor}, {gpus} GPU(s) per pod)",
                    "remove it, or use GPUs with tensor > 1",
                )
            )
        if gpus == 0 and half.model.dtype != "float32":
            p.append(
                Problem(
                    f"{prefix}.model.dtype",
                    f"the megatron backend on CPU ({rpath}) trains in float32",
                    "set model.dtype: float32, or give the role GPUs",
                )
            )
    return p


def check_megatron_splits(half: TrainingHalf, prefix: str = "spec") -> list[Problem]:
    """For the built-in models (whose shapes are known here): tensor and pipeline sizes that do
    not split the model."""
    p: list[Problem] = []
    for name, spec in megatron_roles(half):
        rpath = f"{prefix}.roles.{name}"
        mp = spec.parallelism
        path = half.model.critic_path if name == "critic" and half.model.critic_path else None
        path = path or half.model.path
        shape = (
            BUILTIN_MEGATRON_SHAPES.get(path.removeprefix("builtin:"))
            if path.startswith("builtin:")
            else None
        )
        if shape is None:
            continue
        _, hidden, inter, layers, heads, kv, vocab = shape
        for what, n in (
            ("attention heads", heads),
            ("key/value heads", kv),
            ("hidden size", hidden),
            ("intermediate size", inter),
            ("vocabulary size", vocab),
        ):
            if n % mp.tensor:
                p.append(
                    Problem(
                        f"{rpath}.parallelism.tensor",
                        f"tensor {mp.tensor} does not divide the {n} {what} of {path}",
                        f"use a tensor size that divides {n}",
                    )
                )
                break
        if layers % mp.pipeline:
            p.append(
                Problem(
                    f"{rpath}.parallelism.pipeline",
                    f"pipeline {mp.pipeline} does not divide the {layers} layers of {path}",
                    f"use a pipeline size that divides {layers}",
                )
            )
    return p


def check_megatron_colocated_critic(half: TrainingHalf, prefix: str = "spec") -> list[Problem]:
    """A colocated megatron critic shares the actor's processes, which hold one parallel layout
    (tensor, pipeline, context and expert sizes, sequence parallelism)."""
    critic = half.roles.effective_critic(half.algorithm.needs_critic)
    actor = half.roles.actor.parallelism
    if (
        len(megatron_roles(half)) != 2
        or critic is None
        or not critic.colocate_with_actor
        or critic.parallelism == actor
    ):
        return []
    mine = critic.parallelism.model_dump(by_alias=True)
    theirs = actor.model_dump(by_alias=True)
    differ = ", ".join(
        f"{k} {mine[k]} (the actor's {theirs[k]})" for k in mine if mine[k] != theirs[k]
    )
    return [
        Problem(
            f"{prefix}.roles.critic.parallelism",
            "a colocated critic shares the actor's processes, and megatron-core "
            f"holds one parallel layout per process: {differ}",
            "give the critic the actor's parallelism",
        )
    ]
