"""The training half of a PPOJob: the model (`spec.model`, LoRA); how `model.path` resolves."""

from __future__ import annotations

import re
from typing import Literal

from pydantic import Field

from ppojob_api.base import ApiModel

from .constants import BUILTIN_MODELS


class LoraSpec(ApiModel):
    """Low-rank adapters (LoRA, through PEFT) on the actor: only the adapters train, checkpoint
    and go to the rollout engines."""

    rank: int = Field(8, ge=1, le=1024)
    """Rank r of each adapter (A: r x in, B: out x r)."""

    alpha: float = Field(16.0, gt=0)
    """Scaling numerator: an adapter adds (alpha / rank) x B A to its weight."""

    target_modules: list[str] = Field(
        default_factory=lambda: ["q_proj", "k_proj", "v_proj", "o_proj"], min_length=1
    )
    """Names (the last part of the module path) of the linear layers that get adapters, e.g.
    `q_proj`, `v_proj`, `gate_proj`, `up_proj`, `down_proj` for Llama and Qwen2, or the single
    value `all-linear` (every linear layer but the output head)."""

    dropout: float = Field(0.0, ge=0, lt=1)
    """Dropout on the adapters' input in training."""

    modules_to_save: list[Literal["lm_head", "embed_tokens"]] = Field(
        default_factory=list, max_length=2
    )
    """Modules trained in full next to the adapters (PEFT's `modules_to_save`): `lm_head` (the
    output head) and/or `embed_tokens`. A model whose head was never trained (a randomly
    initialised one, such as the built-in models, or new tokens) cannot learn through adapters
    alone: its frozen head caps what the policy can express. Their full weights then train,
    checkpoint and go with the adapters at each weight sync (torch engines; SGLang engines
    load adapters only, so this is refused with them); the reference policy uses the original
    modules."""

    export_merged: bool = False
    """The Hugging Face export (`training.exportHuggingFace`) writes the adapter (PEFT's
    `adapter_config.json` + `adapter_model.safetensors`); with this, also the base model with
    the adapter merged in, under `merged/`."""


class ModelSpec(ApiModel):
    """The policy (actor) and value (critic) models."""

    path: str = Field("builtin:tiny-llama", min_length=1)
    """The actor (and reference) model: a Hugging Face model directory in the trainer image or a
    volume (absolute, or relative to the working directory), a Hugging Face hub id such as
    `Qwen/Qwen2.5-7B-Instruct` (downloaded through huggingface_hub into its cache, HF_HOME;
    offline with HF_HUB_OFFLINE=1), or `builtin:<name>` for the tiny randomly initialised CPU
    models (`builtin:tiny-llama`, `builtin:tiny-qwen2`, `builtin:small-llama`, and the
    mixture-of-experts `builtin:tiny-qwen3-moe` and `builtin:tiny-mixtral`: 8 experts, 2 per
    token). An existing directory wins over a hub id of the same name."""

    critic_path: str | None = Field(None, min_length=1)
    """The model the critic's backbone starts from, in the same forms as `path`. Defaults to
    `path`. Only for estimators that use a critic (`gae`)."""

    trust_remote_code: bool = False
    """Allow the model's own Python code (`auto_map` in its config) to run when loading the
    model and tokenizer, in every backend. Only for models you trust."""

    lora: LoraSpec | None = None
    """Train the actor as low-rank adapters on its frozen base model (torch backend). The
    reference policy is then the base model with the adapters disabled (no second copy), and
    the weight sync sends only the adapters (an sglang engine loads them with its LoRA adapter
    loading). Unset: full fine-tuning."""

    dtype: Literal["float32", "bfloat16", "float16"] = "float32"
    """Compute dtype. Use `bfloat16` on GPUs, `float32` on CPU. The torch backend trains with
    float32 master weights and optimizer state and computes in this dtype (autocast); the frozen
    reference and the rollout engines hold their weights in it. `float16` has no loss scaling in
    the torch backend and is rejected there."""


HUB_ID = re.compile(r"^(?:[A-Za-z0-9][\w.-]{0,95}/)?[A-Za-z0-9][\w.-]{0,95}$")
"""A Hugging Face hub repo id (`org/name` or `name`); no `--` or `..` (huggingface_hub's
rule)."""


def model_path_kind(path: str) -> Literal["builtin", "local", "hub"]:
    """How `model.path` is resolved (the trainer and `ppojob validate` share this rule):
    `builtin:<name>`, a local directory (absolute, `./`, `../` or `~`), or a string that may be a
    hub id, which the trainer loads from a local directory of that name when one exists and
    from the hub otherwise. Raises ValueError("why; fix") for anything else."""
    if path.startswith("builtin:"):
        if path[8:] not in BUILTIN_MODELS:
            raise ValueError(
                f"unknown built-in model {path!r}; "
                f"use one of {[f'builtin:{m}' for m in BUILTIN_MODELS]}"
            )
        return "builtin"
    if path.startswith(("/", "./", "../", "~")):
        return "local"
    if "://" in path:
        raise ValueError(
            f"{path!r}: URIs are not loaded by the trainer; copy the model into the image or a "
            "volume and give its directory, or give a Hugging Face hub id (org/name)"
        )
    if HUB_ID.match(path) and "--" not in path and ".." not in path:
        return "hub"
    raise ValueError(
        f"{path!r} is neither a directory path nor a Hugging Face hub id; give an absolute "
        "directory, ./relative/dir, org/name, or builtin:<name>"
    )
