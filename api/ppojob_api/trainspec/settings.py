"""The training half of a PPOJob: optimisation, steps and checkpoints (`spec.training`).

`TrainingSettings` holds the keys a critic override may change (`ppojob_api.overrides`)."""

from __future__ import annotations

from typing import Literal

from pydantic import Field

from ppojob_api.base import ApiModel


class TrainingSettings(ApiModel):
    """Optimisation settings. These are the keys that spec.roles.critic.overrides may change."""

    learning_rate: float = Field(1e-6, gt=0, le=1)
    """Peak learning rate (Adam)."""

    min_learning_rate: float = Field(0.0, ge=0)
    """Final learning rate of the cosine and linear schedules."""

    lr_scheduler: Literal["constant", "cosine", "linear"] = "constant"
    """Learning-rate schedule after warmup."""

    lr_warmup_steps: int = Field(0, ge=0)
    """Linear warmup, in optimizer updates."""

    lr_decay_steps: int = Field(0, ge=0)
    """Warmup-stable-decay: the cosine or linear decay to minLearningRate takes only the run's
    last ``lrDecaySteps`` optimizer updates; before them the rate stays at learningRate. 0: the
    decay spans every update after the warmup, as does a value longer than the updates after
    the warmup (a shortened run, `--steps 10`; `ppojob validate` warns)."""

    weight_decay: float = Field(0.0, ge=0)
    """Decoupled weight decay (AdamW)."""

    adam_beta1: float = Field(0.9, ge=0, lt=1)
    """Adam beta1."""

    adam_beta2: float = Field(0.999, ge=0, lt=1)
    """Adam beta2."""

    adam_eps: float = Field(1e-8, gt=0)
    """Adam epsilon."""

    grad_clip: float | None = Field(1.0, gt=0)
    """Clip the global gradient norm to this value. Unset disables clipping."""

    ppo_epochs: int = Field(1, ge=1, le=100)
    """Passes over each step's samples."""

    mini_batch_size: int | None = Field(None, ge=1)
    """Samples per optimizer update, over all data-parallel workers. Defaults to all samples of
    the step (one update per epoch). Must divide rolloutBatchSize x samplesPerPrompt and be a
    multiple of the data-parallel size."""

    micro_batch_size: int | None = Field(None, ge=1)
    """Samples per forward/backward pass on one worker (gradient accumulation). Defaults to the
    worker's whole share of a mini-batch."""

    forward_micro_batch_size: int | None = Field(None, ge=1)
    """Samples per forward pass without gradient on one worker (old and reference log-probs,
    values). Defaults to microBatchSize, else the worker's whole share of the step."""

    gradient_checkpointing: bool = False
    """Recompute each transformer block's activations in backward instead of keeping them
    (less memory, about a third more compute). Torch backend."""

    packing: bool = False
    """Pack each micro-batch's sequences into one row without padding (position ids restarting
    per sequence, no attention across sequences: varlen kernels under flash attention, else
    attention one sequence length at a time (rows over 512 tokens) or a block-diagonal causal
    mask) for log-probs, values, the reference and training.
    Same results as padding, less compute when lengths differ. Torch backend: Hugging Face
    models whose attention mask comes from transformers' masking utilities (Llama, Qwen2,
    Mistral, ...). Megatron backend: Transformer Engine's varlen attention (`thd`) where it
    is installed, a block-diagonal causal mask on megatron-core's local attention otherwise."""

    max_tokens_per_micro_batch: int | None = Field(None, ge=1)
    """Size micro-batches (with and without gradient) by tokens instead of samples: each holds
    at most this many tokens as the forward sees them (the sum of prompt + response lengths
    when packed; samples x the longest prompt + the longest response when padded), longest
    samples first. microBatchSize / forwardMicroBatchSize, when set, still cap the samples per
    micro-batch. The loss is normalised exactly as with sample micro-batches. Must be at least
    maxPromptLength + maxResponseLength. Unset: micro-batches by samples. Torch and megatron
    backends."""

    sharding: Literal["none", "fsdp"] = "none"
    """Torch backend across a role's data-parallel workers: `none` keeps a full replica (model,
    gradients, Adam state) on every worker; `fsdp` shards them with FSDP2 (`fully_shard`, one
    unit per transformer block), the actor's reference model too."""


class Training(TrainingSettings):
    """How long to train, optimisation and checkpointing."""

    steps: int = Field(100, ge=1, le=10_000_000)
    """Training steps (one rollout batch each)."""

    seed: int = Field(42, ge=0, le=2**32 - 1)
    """Seed of model init, data order and sampling. Same seed, same run."""

    checkpoint_dir: str = Field("checkpoints", min_length=1)
    """Where checkpoints are written. A relative path is inside the run's output directory; it
    must be absolute when spec.checkpointVolume is set (the volume is mounted there)."""

    checkpoint_interval: int = Field(0, ge=0)
    """Save every this many steps (and at the end). 0 saves only at the end. A stop (SIGTERM)
    always saves the completed steps; in a pod, the first step of each attempt is saved too, to
    time a checkpoint against the grace period (spec.failurePolicy)."""

    eval_interval: int = Field(10, ge=1)
    """Evaluate on spec.data.evalPrompts every this many steps (and after the last step)."""

    resume: bool = True
    """Continue from the newest complete checkpoint in checkpointDir, if there is one."""

    keep_checkpoints: int = Field(2, ge=1)
    """How many complete checkpoints to keep."""

    offload_reference: bool = False
    """Keep the frozen reference model in CPU memory and copy it to the GPU for its forwards
    (torch backend; with `sharding: fsdp` its shards are offloaded)."""

    export_hugging_face: bool = True
    """At the end of training, write the actor (and the critic, with its value head) as Hugging
    Face model directories with their tokenizer under `<checkpointDir>/hf/step-NNNNNN/`."""
