"""Checks of the roles: a critic the estimator does not use, colocation, backends and their
parallelism, sequence parallelism, and the torch backend's precision."""

from __future__ import annotations

from ppojob_api.base import default_of
from ppojob_api.problems import Problem
from ppojob_api.training import Algorithm, TrainingHalf

ROLE_NAMES = ("actor", "critic", "rollout")


def check_unused_critic(half: TrainingHalf, prefix: str = "spec") -> list[Problem]:
    """A critic, a critic model or critic settings given to an estimator that uses no critic."""
    algo = half.algorithm
    if algo.needs_critic:
        return []
    p: list[Problem] = []
    why = f"advantageEstimator {algo.advantage_estimator} uses no critic"
    if half.roles.critic is not None:
        p.append(Problem(f"{prefix}.roles.critic", why, "remove spec.roles.critic or use gae"))
    if half.model.critic_path is not None:
        p.append(Problem(f"{prefix}.model.criticPath", why, "remove it or use gae"))
    for field, alias in (
        ("critic_warmup_steps", "criticWarmupSteps"),
        ("critic_updates_per_step", "criticUpdatesPerStep"),
        ("value_clip", "valueClip"),
        ("lam", "lambda"),
    ):
        # judged by value: the API server stores every default, so presence means nothing
        value = getattr(algo, field)
        if value != default_of(Algorithm, field) and not (field == "value_clip" and value is None):
            p.append(
                Problem(
                    f"{prefix}.algorithm.{alias}",
                    f"{why}, so {alias}: {value} has no effect",
                    "remove it or use gae",
                )
            )
    return p


def check_colocation(half: TrainingHalf, prefix: str = "spec") -> list[Problem]:
    """A colocated role runs on the actor's pods and counts no GPU of its own: its replicas,
    resources, node selector and tolerations are the actor's."""
    roles = half.roles
    actor = roles.actor
    p: list[Problem] = []
    for name, spec in (("critic", roles.critic), ("rollout", roles.rollout)):
        if spec is None or not spec.colocate_with_actor:
            continue
        for field, alias in (
            ("replicas", "replicas"),
            ("resources", "resources"),
            ("node_selector", "nodeSelector"),
            ("tolerations", "tolerations"),
            ("affinity", "affinity"),
        ):
            # judged by value: the default (what the API server stores when it is omitted) or
            # the actor's own value are both fine; anything else would count GPUs twice
            mine, theirs = getattr(spec, field), getattr(actor, field)
            if mine != theirs and mine != default_of(type(spec), field):
                p.append(
                    Problem(
                        f"{prefix}.roles.{name}.{alias}",
                        f"a colocated {name} runs on the actor's pods and GPUs, so its {alias} "
                        f"cannot differ from the actor's (GPUs would be counted twice)",
                        f"remove spec.roles.{name}.{alias} or set colocateWithActor: false",
                    )
                )
    return p


def check_backends(half: TrainingHalf, prefix: str = "spec") -> list[Problem]:
    """Each role's backend against its GPUs and parallelism: sglang needs GPUs, torch is data
    parallel only, sglang is tensor parallel only, expert parallelism is megatron's only,
    workers tile the model-parallel size, and an engine fits its pod."""
    roles = half.roles
    actor = roles.actor
    p: list[Problem] = []
    for name in ROLE_NAMES:
        spec = getattr(roles, name)
        if spec is None:
            continue
        rpath = f"{prefix}.roles.{name}"
        gpu_owner = actor if getattr(spec, "colocate_with_actor", False) else spec
        gpus = gpu_owner.resources.gpus
        if spec.backend == "sglang" and gpus == 0:
            p.append(
                Problem(
                    f"{rpath}.backend",
                    f"{spec.backend} needs GPUs, but resources.gpus is 0",
                    "set resources.gpus >= 1 or use backend torch",
                )
            )
        mp = spec.parallelism
        if spec.backend == "torch" and mp.model_parallel > 1:
            p.append(
                Problem(
                    f"{rpath}.parallelism",
                    "the torch backend is data parallel only",
                    f"set tensor, pipeline and context to 1, or use backend "
                    f"{'sglang' if name == 'rollout' else 'megatron'}",
                )
            )
        if spec.backend == "sglang" and (mp.pipeline > 1 or mp.context > 1):
            p.append(
                Problem(
                    f"{rpath}.parallelism",
                    "sglang rollout supports tensor parallelism only",
                    "set pipeline and context to 1",
                )
            )
        if mp.expert > 1 and spec.backend != "megatron":
            rollout = name == "rollout"
            p.append(
                Problem(
                    f"{rpath}.parallelism.expert",
                    f"the {spec.backend} {'rollout ' if rollout else ''}backend has no expert "
                    f"parallelism: {_NO_EXPERT_PARALLEL[spec.backend, rollout]}",
                    "set expert: 1" + ("" if rollout else ", or use backend megatron"),
                )
            )
        workers = roles.workers_of(name)
        if workers % mp.model_parallel:
            p.append(
                Problem(
                    f"{rpath}.parallelism",
                    f"{workers} GPU(s)/workers are not divisible by tensor x pipeline x context = "
                    f"{mp.tensor} x {mp.pipeline} x {mp.context} = {mp.model_parallel}",
                    f"make replicas x resources.gpus a multiple of {mp.model_parallel}",
                )
            )
        if name != "rollout":
            continue
        # an engine spans `tensor` GPUs of one pod (one node): they must tile the pod's GPUs
        if gpus % mp.tensor:  # 0 GPUs: no engine to fit
            owner = "the actor's pod" if spec.colocate_with_actor else "its pod"
            p.append(
                Problem(
                    f"{rpath}.parallelism.tensor",
                    f"an engine spans {mp.tensor} GPUs of one pod, which does not fit "
                    f"{owner}'s {gpus} GPU(s) ({gpus} is not a multiple of {mp.tensor})",
                    "use a tensor size that divides resources.gpus",
                )
            )
    return p


_NO_EXPERT_PARALLEL = {
    ("torch", False): "FSDP2 (training.sharding: fsdp) shards a MoE model's experts with the "
    "rest of its weights",
    ("torch", True): "each torch engine holds the whole model",
    ("sglang", True): "the engine is started with tensor parallelism only (no ep_size), which "
    "splits every expert over its parallelism.tensor GPUs",
}
"""Why a backend has no ``parallelism.expert`` (keyed by backend, and whether it is the
rollout's): the trainer's sglang engine passes ``tp_size`` and no ``ep_size``."""


def check_sequence_parallel(half: TrainingHalf, prefix: str = "spec") -> list[Problem]:
    """Sequence parallelism on a backend that has none (only megatron has)."""
    p: list[Problem] = []
    for name in ROLE_NAMES:
        spec = getattr(half.roles, name)
        if spec is not None and spec.backend != "megatron" and spec.parallelism.sequence_parallel:
            p.append(
                Problem(
                    f"{prefix}.roles.{name}.parallelism.sequenceParallel",
                    f"the {spec.backend} backend has no sequence parallelism (only megatron has)",
                    "remove it",
                )
            )
    return p


def check_precision(half: TrainingHalf, prefix: str = "spec") -> list[Problem]:
    """float16 needs loss scaling, which the torch backend does not do."""
    if half.model.dtype != "float16":
        return []
    roles = half.roles
    for name, spec in (
        ("actor", roles.actor),
        ("critic", roles.effective_critic(half.algorithm.needs_critic)),
    ):
        if spec is not None and spec.backend == "torch":
            return [
                Problem(
                    f"{prefix}.model.dtype",
                    f"float16 needs loss scaling, which the torch backend ({name}) does not do",
                    "use bfloat16 (or float32)",
                )
            ]
    return []


def check_sglang_top_p_tis(half: TrainingHalf, prefix: str = "spec") -> list[Problem]:
    """SGLang returns the log-probs of the temperature-scaled distribution before its top-p
    truncation (``sampler.py``: ``log_softmax(logits / T)``) while the actor's pi_old is the
    truncated, renormalised one: with topP < 1 the truncated importance weights pi_old /
    pi_rollout would be biased upwards on every sampled token."""
    if half.roles.rollout.backend != "sglang" or half.data.top_p >= 1.0:
        return []
    algo = half.algorithm
    return [
        Problem(
            f"{prefix}.algorithm.{name}",
            "the sglang engine returns log-probs before its top-p truncation while the actor's "
            "are after it, so with data.topP < 1 the importance weights would be biased",
            f"unset algorithm.{name}, or set data.topP: 1.0",
        )
        for name, value in (
            ("tisCap", algo.tis_cap),
            ("importanceSampling", algo.importance_sampling),
        )
        if value is not None
    ]
