"""Checks of the efficiency settings: packing and token-budget micro-batches (per role: the
actor's in ``spec.training``, the critic's with its overrides)."""

from __future__ import annotations

from ppojob_api.problems import Problem, SpecError
from ppojob_api.training import Parallelism, TrainingHalf, TrainingSettings
from ppojob_api.trainspec.constants import BUILTIN_MOE_MODELS


def _role_settings(
    half: TrainingHalf, prefix: str
) -> list[tuple[str, dict[str, str], Parallelism, TrainingSettings]]:
    """(role, field -> path of the field that sets it, parallelism, settings) of each trained
    role."""
    from ppojob_api.overrides import apply_critic_overrides, overridable_field

    fields = {"packing": "packing", "max_tokens_per_micro_batch": "maxTokensPerMicroBatch"}
    roles = half.roles
    own = {camel: f"{prefix}.training.{camel}" for camel in fields.values()}
    out = [("actor", own, roles.actor.parallelism, half.training)]
    critic = roles.effective_critic(half.algorithm.needs_critic)
    if critic is not None:
        try:
            settings = apply_critic_overrides(half.training, critic.overrides)
        except SpecError:  # bad overrides have their own problems
            settings = half.training
        paths = dict(own)
        for key in critic.overrides:
            name = overridable_field(key)
            if name in fields:
                paths[fields[name]] = f"{prefix}.roles.critic.overrides.{key}"
        out.append(("critic", paths, critic.parallelism, settings))
    return out


def check_packing(half: TrainingHalf, prefix: str = "spec") -> list[Problem]:
    """Packing and token budgets run on both backends (context parallelism, which would split a
    packed row, is refused for megatron roles: ``check_megatron_devices``); a budget below the
    longest possible sequence (maxPromptLength + maxResponseLength) could never hold it."""
    problems: list[Problem] = []
    longest = half.data.max_prompt_length + half.data.max_response_length
    for name, paths, _, s in _role_settings(half, prefix):
        budget = s.max_tokens_per_micro_batch
        if budget is not None and budget < longest:
            problems.append(
                Problem(
                    paths["maxTokensPerMicroBatch"],
                    f"a sequence of the {name} may have {longest} tokens (data.maxPromptLength "
                    f"+ data.maxResponseLength), more than the budget of {budget}",
                    f"set maxTokensPerMicroBatch to at least {longest}",
                )
            )
    return problems


BUILTIN_LINEAR_MODULES = (
    "q_proj",
    "k_proj",
    "v_proj",
    "o_proj",
    "gate_proj",
    "up_proj",
    "down_proj",
)
"""The linear layers of the built-in models (Llama and Qwen2 blocks; a trainer test keeps this in
step with ``models.py``)."""
BUILTIN_MOE_LINEAR_MODULES = ("q_proj", "k_proj", "v_proj", "o_proj")
"""Those of the built-in MoE models: attention only (their experts are 3-D parameters and their
routers plain weights, no linear layers)."""


SGLANG_LORA_MODULES = (
    "q_proj",
    "k_proj",
    "v_proj",
    "o_proj",
    "qkv_proj",
    "gate_proj",
    "up_proj",
    "down_proj",
    "gate_up_proj",
)
"""The dense-model linear layers SGLang 0.5.23 serves adapters on (its
``SUPPORTED_LORA_TARGET_MODULES`` but the embeddings and MLA/MoE ones; a contract test keeps this
in step with the pinned release)."""


def _sglang_lora_problems(targets: list[str], path: str) -> list[Problem]:
    """What SGLang 0.5.23's adapter loading cannot take (``lora/lora.py``: it stacks q/k/v
    adapters starting from q_proj and reading v_proj, zero-filling only k_proj; an up_proj
    adapter is stacked with its gate_proj, alone it matches no buffer)."""
    if targets == ["all-linear"]:
        return []
    problems = [
        Problem(
            f"{path}.targetModules[{i}]",
            f"{name!r} is no layer SGLang 0.5.23 serves LoRA adapters on",
            f"use some of {', '.join(SGLANG_LORA_MODULES)} (or all-linear), or backend: torch "
            "for the rollout",
        )
        for i, name in enumerate(targets)
        if name not in SGLANG_LORA_MODULES
    ]
    names = set(targets)
    if names & {"q_proj", "k_proj", "v_proj"} and not {"q_proj", "v_proj"} <= names:
        problems.append(
            Problem(
                f"{path}.targetModules",
                "SGLang 0.5.23 stacks attention adapters as q/k/v and needs q_proj and v_proj "
                "among them (only k_proj may be left out)",
                "add q_proj and v_proj to targetModules, or use backend: torch for the rollout",
            )
        )
    if "up_proj" in names and "gate_proj" not in names:
        problems.append(
            Problem(
                f"{path}.targetModules",
                "SGLang 0.5.23 serves an up_proj adapter only stacked with gate_proj's",
                "add gate_proj to targetModules, or use backend: torch for the rollout",
            )
        )
    return problems


def check_lora(half: TrainingHalf, prefix: str = "spec") -> list[Problem]:
    """LoRA is a torch-backend feature of the actor, without FSDP; its target modules must name
    linear layers (for a built-in model, known here; for any other, when the trainer loads
    it)."""
    lora = half.model.lora
    if lora is None:
        return []
    path = f"{prefix}.model.lora"
    problems: list[Problem] = []
    if half.roles.actor.backend != "torch":
        problems.append(
            Problem(
                path,
                "LoRA is implemented in the torch backend only, but the actor runs megatron",
                "use backend: torch for the actor, or remove model.lora",
            )
        )
    if half.training.sharding == "fsdp":
        problems.append(
            Problem(
                f"{prefix}.training.sharding",
                "LoRA trains only small adapters, which each worker keeps whole; FSDP sharding "
                "of a LoRA actor is not implemented",
                "set sharding: none, or remove model.lora",
            )
        )
    if lora.modules_to_save and half.roles.rollout.backend == "sglang":
        problems.append(
            Problem(
                f"{path}.modulesToSave",
                "SGLang engines load LoRA adapters only, not the full weights of "
                f"{', '.join(lora.modules_to_save)}",
                "remove modulesToSave, or use roles.rollout.backend: torch",
            )
        )
    if len(set(lora.modules_to_save)) < len(lora.modules_to_save):
        problems.append(
            Problem(
                f"{path}.modulesToSave",
                "a module is named twice",
                "name each of lm_head and embed_tokens at most once",
            )
        )
    targets = lora.target_modules
    if "all-linear" in targets and len(targets) > 1:
        problems.append(
            Problem(
                f"{path}.targetModules",
                "all-linear already names every linear layer",
                "give either [all-linear] or a list of module names",
            )
        )
    builtin = (
        half.model.path.removeprefix("builtin:") if half.model.path.startswith("builtin:") else None
    )
    linear = BUILTIN_MOE_LINEAR_MODULES if builtin in BUILTIN_MOE_MODELS else BUILTIN_LINEAR_MODULES
    for i, name in enumerate(targets):
        if name == "all-linear":
            continue
        if builtin is not None and name not in linear:
            problems.append(
                Problem(
                    f"{path}.targetModules[{i}]",
                    f"{name!r} is not a linear layer of builtin:{builtin}",
                    f"use some of {', '.join(linear)}, or all-linear",
                )
            )
    if half.roles.rollout.backend == "sglang":
        problems += _sglang_lora_problems(list(targets), path)
    return problems
