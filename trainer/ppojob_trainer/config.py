"""The training half of a PPOJob: the trainer's own configuration model.

This module imports neither torch nor ray, so the operator can validate a spec with it and render it
into the trainer's ConfigMap, and `ppojob run` can feed it to a local trainer. Every field's
docstring becomes its description in the generated CRD (`kubectl explain`).

Semantic rules that a schema cannot express live in `check_training_half`, which returns *every*
problem with its field path and a fix; `SpecError` carries them as a `ValueError`.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field
from pydantic.alias_generators import to_camel

HOOK_PATTERN = r"^[A-Za-z_]\w*(\.[A-Za-z_]\w*)*:[A-Za-z_]\w*(\.[A-Za-z_]\w*)*$"
QUANTITY_PATTERN = r"^[0-9]+(\.[0-9]+)?(Ki|Mi|Gi|Ti|Pi|Ei|k|M|G|T|P|E|m)?$"

BUILTIN_MODELS = ("tiny-llama", "tiny-qwen2", "small-llama")
BUILTIN_CONTEXT = 2048
"""Longest sequence (prompt + response tokens) a built-in model takes (its position table)."""
BUILTIN_SHAPES = {
    "tiny-llama": (64, 256, 2),
    "tiny-qwen2": (64, 256, 2),
    "small-llama": (128, 512, 5),
}
"""(hidden, intermediate, layers) of each built-in model, for the size checks (`models.py` builds
them; a test keeps the two in step)."""
BUILTIN_TASKS = ("count-up", "reverse")
ESTIMATORS_WITHOUT_CRITIC = ("grpo", "reinforce_plus_plus", "reinforce_plus_plus_baseline", "rloo")
GROUP_ESTIMATORS = ("grpo", "reinforce_plus_plus_baseline", "rloo")
# Estimators whose advantages are whitened over the step's tokens when normalizeAdvantages is unset
WHITENING_BY_DEFAULT = ("gae", "reinforce_plus_plus", "reinforce_plus_plus_baseline")


class _Model(BaseModel):
    """Base of every API model: camelCase on the wire, unknown fields rejected."""

    model_config = ConfigDict(
        alias_generator=to_camel,
        populate_by_name=True,
        extra="forbid",
        use_attribute_docstrings=True,
        validate_assignment=True,
        # Types as the API server checks them: `steps: true` or `"3"` is not an integer, `1` not
        # a boolean; NaN and infinities are never numbers.
        strict=True,
        allow_inf_nan=False,
    )

    def explicit(self, name: str) -> bool:
        """Whether this field was given (as opposed to taking its default).

        Never use it to *validate*: the API server fills in the CRD's defaults before the operator
        reads a job, so a check based on presence gives a stored job another verdict than the
        manifest as written. Checks judge values (see `check_training_half`)."""
        return name in self.model_fields_set


# ---------------------------------------------------------------------------------------------
# Model
# ---------------------------------------------------------------------------------------------
class ModelSpec(_Model):
    """The policy (actor) and value (critic) models."""

    path: str = Field("builtin:tiny-llama", min_length=1)
    """The actor (and reference) model: a Hugging Face model directory in the trainer image or a
    volume (absolute, or relative to the working directory), a Hugging Face hub id such as
    `Qwen/Qwen2.5-7B-Instruct` (downloaded through huggingface_hub into its cache, HF_HOME;
    offline with HF_HUB_OFFLINE=1), or `builtin:<name>` for the tiny randomly initialised CPU
    models (`builtin:tiny-llama`, `builtin:tiny-qwen2`, `builtin:small-llama`). An existing
    directory wins over a hub id of the same name."""

    critic_path: str | None = Field(None, min_length=1)
    """The model the critic's backbone starts from, in the same forms as `path`. Defaults to
    `path`. Only for estimators that use a critic (`gae`)."""

    trust_remote_code: bool = False
    """Allow the model's own Python code (`auto_map` in its config) to run when loading the
    model and tokenizer, in every backend. Only for models you trust."""

    dtype: Literal["float32", "bfloat16", "float16"] = "float32"
    """Compute dtype. Use `bfloat16` on GPUs, `float32` on CPU. The torch backend trains with
    float32 master weights and optimizer state and computes in this dtype (autocast); the frozen
    reference and the rollout engines hold their weights in it. `float16` has no loss scaling in
    the torch backend and is rejected there."""


# ---------------------------------------------------------------------------------------------
# Roles
# ---------------------------------------------------------------------------------------------
class Resources(_Model):
    """What one replica (one pod) of a role requests and is limited to."""

    gpus: int = Field(0, ge=0, le=64)
    """GPUs per replica. 0 runs the role on CPU, one worker per replica; otherwise one worker per
    GPU."""

    cpus: float = Field(1.0, gt=0, le=1024)
    """CPU cores per replica."""

    memory: str = Field("4Gi", pattern=QUANTITY_PATTERN)
    """Memory per replica, as a Kubernetes quantity such as `64Gi`."""

    extra: dict[str, int] = Field(default_factory=dict)
    """Extended resources per replica (requested and limited), e.g. `{rdma/ib: 1}` for NCCL over
    InfiniBand through an RDMA device plugin."""


class Toleration(_Model):
    """A Kubernetes toleration for the role's pods."""

    key: str | None = None
    """Taint key the toleration applies to; empty matches all keys (with operator Exists)."""

    operator: Literal["Exists", "Equal"] = "Equal"
    """`Equal` matches key and value; `Exists` matches any value of the key."""

    value: str | None = None
    """Taint value to match with operator Equal."""

    effect: Literal["NoSchedule", "PreferNoSchedule", "NoExecute"] | None = None
    """Taint effect to match; empty matches all effects."""

    toleration_seconds: int | None = Field(None, ge=0)
    """For NoExecute: how long the pod stays bound after the taint appears."""


class EnvVar(_Model):
    """An environment variable set in the role's containers."""

    name: str = Field(min_length=1, pattern=r"^[-._a-zA-Z][-._a-zA-Z0-9]*$")
    """Variable name."""

    value: str = ""
    """Variable value."""


class Parallelism(_Model):
    """Model parallelism of a role. Data parallelism is derived: workers / (tensor x pipeline x
    context)."""

    tensor: int = Field(1, ge=1, le=64)
    """Tensor-parallel size (megatron and sglang backends)."""

    pipeline: int = Field(1, ge=1, le=64)
    """Pipeline-parallel size (megatron backend)."""

    context: int = Field(1, ge=1, le=64)
    """Context-parallel size (megatron backend)."""

    sequence_parallel: bool = False
    """Megatron sequence parallelism: split the activations outside the tensor-parallel layers
    along the sequence over the tensor-parallel ranks (megatron backend on GPUs with Transformer
    Engine installed; needs tensor > 1)."""

    @property
    def model_parallel(self) -> int:
        return self.tensor * self.pipeline * self.context


class _Role(_Model):
    replicas: int = Field(1, ge=1, le=4096)
    """Number of pods of this role. All of them are scheduled together with the rest of the job
    (gang scheduling)."""

    resources: Resources = Field(default_factory=Resources)
    """Per-replica resources."""

    node_selector: dict[str, str] = Field(default_factory=dict)
    """Node labels the role's pods must match, e.g. `nvidia.com/gpu.product: H100-SXM`."""

    tolerations: list[Toleration] = Field(default_factory=list)
    """Tolerations of the role's pods."""

    env: list[EnvVar] = Field(default_factory=list)
    """Extra environment variables of the role's containers."""

    capabilities: list[Literal["IPC_LOCK", "SYS_RESOURCE", "SYS_NICE"]] = Field(
        default_factory=list
    )
    """Linux capabilities added to the role's containers (all others stay dropped), e.g.
    `IPC_LOCK` for RDMA memory registration (see the gang-scheduling guide, "NCCL over
    RDMA")."""

    parallelism: Parallelism = Field(default_factory=Parallelism)
    """Tensor, pipeline and context parallelism; data parallelism is derived."""

    def workers(self) -> int:
        """Worker processes of this role: one per GPU, or one per replica on CPU."""
        return self.replicas * max(self.resources.gpus, 1)

    def total_gpus(self) -> int:
        return self.replicas * self.resources.gpus


class ActorRole(_Role):
    """The policy being trained; it also computes old and reference log-probs."""

    backend: Literal["torch", "megatron"] = "torch"
    """Training backend: `torch` (Hugging Face models, CPU or GPU, data parallel) or `megatron`
    (megatron-core, Llama and Qwen2 architectures: tensor and pipeline parallel on CPU in float32
    or on GPUs; context parallel on GPUs only)."""


class CriticRole(_Role):
    """The value model (GAE only)."""

    backend: Literal["torch", "megatron"] = "torch"
    """Training backend of the critic, as for the actor."""

    colocate_with_actor: bool = False
    """Run the critic on the actor's pods and GPUs (time-shared) instead of its own pods. A
    colocated critic takes its worker count from the actor; do not set its replicas, resources,
    nodeSelector or tolerations."""

    overrides: dict[str, Any] = Field(
        default_factory=dict, json_schema_extra={"x-kubernetes-preserve-unknown-fields": True}
    )
    """Training settings of the critic that differ from `spec.training` (e.g. `learningRate`,
    `miniBatchSize`, `ppoEpochs`); every key not given inherits the actor's value. Keys that change
    GPU allocation or node counts are rejected: size the critic with its replicas and resources."""


class RolloutRole(_Role):
    """The generation engines."""

    backend: Literal["torch", "sglang"] = "torch"
    """Generation backend: `torch` (Hugging Face generate with KV cache) or `sglang` (GPU)."""

    colocate_with_actor: bool = False
    """Run the engines on the actor's GPUs, time-shared with training, instead of their own pods.
    A colocated rollout takes its worker count from the actor."""

    offload: bool = True
    """With colocateWithActor: release the engines' weights and KV cache while the actor trains."""

    gpu_memory_fraction: float = Field(0.85, gt=0, le=1)
    """Fraction of GPU memory an sglang engine may use for weights and KV cache."""

    weight_sync_bucket_mb: float = Field(512.0, gt=0, le=65536)
    """Weight sync moves the actor's weights to the engines in buckets of at most this many
    MiB (a larger tensor goes alone): the extra memory a sync needs on each side."""


class Roles(_Model):
    """The three roles of PPO. Each is data parallel over its workers."""

    actor: ActorRole = Field(default_factory=ActorRole)
    """The policy being trained."""

    critic: CriticRole | None = None
    """The value model. Only for `gae`; when omitted, a critic colocated with the actor is used."""

    rollout: RolloutRole = Field(default_factory=RolloutRole)
    """The generation engines."""

    def effective_critic(self, needs_critic: bool) -> CriticRole | None:
        """The critic the trainer runs: the given one, a colocated default, or none."""
        if not needs_critic:
            return None
        return self.critic or CriticRole(colocate_with_actor=True)

    def workers_of(self, role: str, needs_critic: bool = True) -> int:
        """Worker count of a role, following colocation."""
        if role == "actor":
            return self.actor.workers()
        spec = self.effective_critic(needs_critic) if role == "critic" else self.rollout
        if spec is None:
            return 0
        return self.actor.workers() if spec.colocate_with_actor else spec.workers()


# ---------------------------------------------------------------------------------------------
# Algorithm
# ---------------------------------------------------------------------------------------------
class KLSpec(_Model):
    """The KL penalty against the reference (initial) policy."""

    coefficient: float = Field(0.0, ge=0)
    """KL coefficient (the initial one when `target` is set). 0 disables the KL term and the
    reference model."""

    estimator: Literal["k1", "k2", "k3", "low_var_kl"] = "k1"
    """Per-token KL estimator: `k1` = log p - log q, `k2` = (log p - log q)^2 / 2, `k3` = the
    non-negative unbiased estimator, `low_var_kl` = k3 clamped. A KL loss needs k2, k3 or
    low_var_kl."""

    mode: Literal["reward", "loss"] = "reward"
    """`reward`: subtract coefficient x KL from every token's reward; `loss`: add coefficient x KL
    to the policy loss."""

    target: float | None = Field(None, gt=0)
    """Target KL per sequence for the adaptive controller (Ziegler et al. 2019). Unset keeps the
    coefficient fixed. Only with mode `reward`."""

    horizon: int = Field(10000, ge=1)
    """Horizon (in samples) of the adaptive KL controller."""


class Algorithm(_Model):
    """The RL algorithm: advantage estimation, clipping, KL and critic schedule."""

    advantage_estimator: Literal[
        "gae", "grpo", "reinforce_plus_plus", "reinforce_plus_plus_baseline", "rloo"
    ] = "gae"
    """How advantages are computed. `gae` trains a critic; the others use outcome rewards only."""

    gamma: float = Field(1.0, ge=0, le=1)
    """Discount factor."""

    lam: float = Field(0.95, ge=0, le=1, alias="lambda")
    """GAE lambda."""

    clip_range_low: float = Field(0.2, gt=0, lt=1)
    """Lower PPO clip range: the ratio is clipped below at 1 - clipRangeLow."""

    clip_range_high: float = Field(0.2, gt=0, le=10)
    """Upper PPO clip range: the ratio is clipped above at 1 + clipRangeHigh ("clip higher")."""

    dual_clip: float | None = Field(None, gt=1)
    """Dual-clip constant c > 1 bounding the loss for negative advantages. Unset disables it."""

    value_clip: float | None = Field(0.2, gt=0)
    """Clip range of the value loss around the old values. Unset disables value clipping."""

    kl: KLSpec = Field(default_factory=KLSpec)
    """KL penalty settings."""

    entropy_coefficient: float = Field(0.0, ge=0)
    """Weight of the entropy bonus in the policy loss."""

    normalize_advantages: bool | None = None
    """Whiten the final advantages over the whole step's response tokens (every data-parallel
    worker's) before the update. Unset: on for `gae`, `reinforce_plus_plus` and
    `reinforce_plus_plus_baseline` (their definitions whiten), off for `grpo` and `rloo` (already
    normalised within each prompt group; whitening again over tokens can flip signs and undoes
    grpoNormByStd: false) and for a customAdvantageFunction. true or false is honoured for every
    estimator; whitening happens once, never twice."""

    grpo_norm_by_std: bool = True
    """For `grpo`: divide by the group's reward standard deviation (false gives Dr. GRPO)."""

    loss_aggregation: Literal["token-mean", "seq-mean-token-sum", "seq-mean-token-mean"] = (
        "token-mean"
    )
    """How per-token losses are reduced to one number."""

    critic_warmup_steps: int = Field(0, ge=0)
    """Steps at the start during which only the critic trains."""

    critic_updates_per_step: int = Field(1, ge=1, le=100)
    """Critic training passes per step."""

    tis_cap: float | None = Field(None, gt=0)
    """Truncated importance sampling: weigh each token's policy loss by min(pi_old / pi_rollout,
    tisCap), where pi_rollout is the engine's sampling log-prob and pi_old the actor's
    recomputed one, to correct for rollout engines whose numerics differ from the trainer's
    (as verl and slime offer; 2 is a common cap). Unset: no correction. Every step reports the
    mismatch as rollout/logprob_diff_mean and rollout/logprob_diff_max either way."""

    custom_advantage_function: str | None = Field(None, pattern=HOOK_PATTERN)
    """`module:function` computing advantages and returns instead of the estimator; loaded in the
    trainer only. See the trainer guide for its arguments."""

    @property
    def needs_critic(self) -> bool:
        return self.advantage_estimator == "gae"

    @property
    def whitens_advantages(self) -> bool:
        """normalizeAdvantages as set, or its estimator-dependent default when unset."""
        if self.normalize_advantages is not None:
            return self.normalize_advantages
        if self.custom_advantage_function is not None:
            return False
        return self.advantage_estimator in WHITENING_BY_DEFAULT


# ---------------------------------------------------------------------------------------------
# Data
# ---------------------------------------------------------------------------------------------
class DataSpec(_Model):
    """Prompts, reward and sampling."""

    prompts: str = Field("builtin:count-up", min_length=1)
    """Prompt dataset: a `.jsonl`, `.json` (a list of objects) or `.parquet` file, a directory
    written by `datasets`' `save_to_disk` (a DatasetDict's `train` split is used), all as paths
    the trainer's pods can read, or `builtin:<task>` (`builtin:count-up`, `builtin:reverse`)."""

    prompt_key: str = Field("prompt", min_length=1)
    """Column holding the prompt text in a dataset file."""

    label_key: str = Field("label", min_length=1)
    """Column holding the reference answer passed to the reward function (may be absent)."""

    reward_function: str | None = Field(None, min_length=1)
    """`module:function` scoring each completion, or `builtin:<task>`. Defaults to the built-in
    task's reward."""

    rollout_batch_size: int = Field(16, ge=1, le=1_000_000)
    """Prompts per training step."""

    samples_per_prompt: int = Field(8, ge=1, le=1024)
    """Completions sampled per prompt (the group size of grpo and rloo)."""

    max_prompt_length: int = Field(512, ge=1, le=1_048_576)
    """Prompts longer than this many tokens are truncated from the left."""

    max_response_length: int = Field(512, ge=1, le=1_048_576)
    """Maximum generated tokens per completion."""

    temperature: float = Field(1.0, gt=0, le=10)
    """Sampling temperature."""

    top_p: float = Field(1.0, gt=0, le=1)
    """Nucleus sampling threshold. Below 1 the policy (pi_old, the trained policy and the
    reference) is the top-p truncated distribution the engines sample from."""

    shuffle: bool = True
    """Shuffle prompts every epoch (seeded by spec.training.seed)."""

    eval_prompts: str | None = Field(None, min_length=1)
    """Held-out prompts to evaluate on, in the formats of `prompts` (`builtin:<task>`: a fixed
    set of 64 of that task's prompts). Every spec.training.evalInterval steps and after the last
    step, each prompt gets one greedy completion, scored by the reward function, reported as
    eval/reward_mean. Unset: no evaluation."""
    apply_chat_template: bool | None = None
    """Render each prompt with the tokenizer's chat template (a plain string becomes one user
    message; a prompt given as chat messages `[{role, content}, ...]` needs the template).
    Unset: on exactly when the tokenizer has a chat template."""

    @property
    def samples_per_step(self) -> int:
        return self.rollout_batch_size * self.samples_per_prompt


# ---------------------------------------------------------------------------------------------
# Training
# ---------------------------------------------------------------------------------------------
class TrainingSettings(_Model):
    """Optimisation settings. These are the keys that spec.roles.critic.overrides may change."""

    learning_rate: float = Field(1e-6, gt=0, le=1)
    """Peak learning rate (Adam)."""

    min_learning_rate: float = Field(0.0, ge=0)
    """Final learning rate of the cosine and linear schedules."""

    lr_scheduler: Literal["constant", "cosine", "linear"] = "constant"
    """Learning-rate schedule after warmup."""

    lr_warmup_steps: int = Field(0, ge=0)
    """Linear warmup, in optimizer updates."""

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
    """Save every this many steps (and at the end). 0 saves only at the end."""

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


# ---------------------------------------------------------------------------------------------
# The training half and the trainer config
# ---------------------------------------------------------------------------------------------
class TrainingHalf(_Model):
    """The fields of a PPOJob spec that the trainer reads."""

    model: ModelSpec = Field(default_factory=ModelSpec)
    """Models of the actor and critic."""

    roles: Roles = Field(default_factory=Roles)
    """Actor, critic and rollout: replicas, resources, parallelism, backend, colocation."""

    algorithm: Algorithm = Field(default_factory=Algorithm)
    """The RL algorithm."""

    data: DataSpec = Field(default_factory=DataSpec)
    """Prompts, reward and sampling."""

    training: Training = Field(default_factory=Training)
    """Steps, optimisation and checkpoints."""


class TrainerConfig(TrainingHalf):
    """What the trainer runs: the training half plus the few cluster facts it needs."""

    placement_timeout_seconds: int = Field(600, ge=1)
    """How long to wait for the placement group before failing (spec.scheduling.timeoutSeconds)."""

    job_name: str | None = None
    """Name of the PPOJob, for logs and progress reports."""

    def critic_training(self) -> TrainingSettings:
        """The critic's training settings: the actor's, with the critic overrides on top."""
        critic = self.roles.effective_critic(self.algorithm.needs_critic)
        overrides = critic.overrides if critic else {}
        return apply_critic_overrides(self.training, overrides)


# ---------------------------------------------------------------------------------------------
# Problems
# ---------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Problem:
    """One thing wrong with a spec: where, what, and how to fix it."""

    path: str
    message: str
    fix: str = ""

    def __str__(self) -> str:
        return f"{self.path}: {self.message}" + (f" (fix: {self.fix})" if self.fix else "")


class SpecError(ValueError):
    """Every problem found in a spec, raised together."""

    def __init__(self, problems: list[Problem], source: str = "") -> None:
        self.problems = list(problems)
        self.source = source
        head = f"{source}: " if source else ""
        lines = "\n".join(f"  - {p}" for p in self.problems)
        super().__init__(f"{head}{len(self.problems)} problem(s):\n{lines}")


def pydantic_problems(exc: Exception, prefix: str = "") -> list[Problem]:
    """Turn a pydantic ValidationError into Problems with camelCase field paths."""
    problems = []
    for err in exc.errors():  # type: ignore[attr-defined]
        parts = [prefix] if prefix else []
        for loc in err["loc"]:
            if isinstance(loc, int):
                parts[-1:] = [f"{parts[-1]}[{loc}]"] if parts else [f"[{loc}]"]
            elif not (isinstance(loc, str) and "[" in loc and loc.endswith("]")):
                parts.append(str(loc))
        path = ".".join(parts) or prefix or "<root>"
        kind = err["type"]
        if kind == "extra_forbidden":
            problems.append(Problem(path, "unknown field", "remove it or check its spelling"))
        elif kind == "missing":
            problems.append(Problem(path, "required field is missing", "add it"))
        else:
            got = err.get("input")
            shown = repr(got) if not isinstance(got, dict | list) else type(got).__name__
            problems.append(Problem(path, f"{err['msg']} (got {shown[:80]})", _fix_for(err)))
    return problems


_TYPE_FIXES = {
    "int_type": "write a whole number, without quotes",
    "int_from_float": "write a whole number",
    "bool_type": "write true or false, without quotes",
    "float_type": "write a number, without quotes",
    "finite_number": "write a finite number (.nan and .inf are not numbers)",
    "string_type": "write a string (quote it)",
    "dict_type": "write a mapping (key: value)",
    "list_type": "write a list",
    "model_type": "write a mapping of this object's fields",
}


def _fix_for(err: dict[str, Any]) -> str:
    if err.get("type") in _TYPE_FIXES:
        return _TYPE_FIXES[err["type"]]
    ctx = err.get("ctx") or {}
    if "expected" in ctx:
        return f"use one of {ctx['expected']}"
    if "pattern" in ctx:
        if ctx["pattern"] == HOOK_PATTERN:
            return "write it as `package.module:function`"
        if ctx["pattern"] == QUANTITY_PATTERN:
            return "use a Kubernetes quantity such as `16Gi`"
        return f"match the pattern {ctx['pattern']}"
    for key, word in (("ge", ">="), ("gt", ">"), ("le", "<="), ("lt", "<")):
        if key in ctx:
            return f"use a value {word} {ctx[key]}"
    return ""


# ---------------------------------------------------------------------------------------------
# Strict YAML
# ---------------------------------------------------------------------------------------------
class _Loader(getattr(yaml, "CSafeLoader", yaml.SafeLoader)):  # type: ignore[misc]
    """PyYAML's safe loader, reading `1e-5` as a number (as kubectl and YAML 1.2 do)."""


_Loader.add_implicit_resolver(
    "tag:yaml.org,2002:float",
    re.compile(r"^[-+]?(?:[0-9][0-9_]*)(?:\.[0-9_]*)?[eE][-+]?[0-9]+$"),
    list("-+0123456789"),
)
_MERGE = "tag:yaml.org,2002:merge"


def _duplicate_keys(node: yaml.Node, path: str, out: list[Problem]) -> None:
    if isinstance(node, yaml.MappingNode):
        seen: dict[Any, int] = {}
        for key_node, value_node in node.value:
            if key_node.tag == _MERGE or not isinstance(key_node, yaml.ScalarNode):
                continue
            key = key_node.value
            here = f"{path}.{key}" if path else str(key)
            line = key_node.start_mark.line + 1
            if key in seen:
                out.append(
                    Problem(
                        here,
                        f"duplicate key (line {line}; first at line {seen[key]}): YAML keeps only "
                        "one of them",
                        "write each key once; merge the two blocks",
                    )
                )
            else:
                seen[key] = line
            _duplicate_keys(value_node, here, out)
    elif isinstance(node, yaml.SequenceNode):
        for i, item in enumerate(node.value):
            _duplicate_keys(item, f"{path}[{i}]", out)


def load_yaml_documents(text: str, source: str = "") -> list[Any]:
    """Every document of a YAML stream, read strictly: a duplicate key is an error (naming its
    path and lines) instead of the last one silently winning; `1e-5` is a number. Raises
    SpecError."""
    loader = _Loader(text)
    docs: list[Any] = []
    problems: list[Problem] = []
    try:
        while loader.check_node():
            node = loader.get_node()
            dup: list[Problem] = []
            _duplicate_keys(node, "", dup)
            problems += [Problem(f"{len(docs) + 1}\0{d.path}", d.message, d.fix) for d in dup]
            docs.append(loader.construct_document(node))
    except yaml.YAMLError as exc:
        raise SpecError(
            [Problem("<file>", f"not valid YAML: {exc}", "fix the YAML syntax")], source
        ) from None
    finally:
        loader.dispose()
    if problems:
        many = len([d for d in docs if d is not None]) > 1
        shown = []
        for pr in problems:
            index, _, where = pr.path.partition("\0")
            shown.append(
                Problem(f"document {index}: {where}" if many else where, pr.message, pr.fix)
            )
        raise SpecError(shown, source)
    return docs


def load_yaml(text: str, source: str = "") -> Any:
    """The single document of a YAML text, read as strictly as `load_yaml_documents`."""
    docs = load_yaml_documents(text, source)
    return docs[0] if docs else None


# ---------------------------------------------------------------------------------------------
# Critic overrides
# ---------------------------------------------------------------------------------------------
def _norm(key: str) -> str:
    return re.sub(r"[^a-z0-9]", "", key.lower())


# Normalised key -> field name. camelCase and snake_case spellings normalise alike.
_OVERRIDABLE = {_norm(name): name for name in TrainingSettings.model_fields}
_OVERRIDABLE |= {"lr": "learning_rate", "minlr": "min_learning_rate"}

# Keys (normalised: lower case, no separators) that would change GPU allocation or node counts.
_ALLOCATION_KEYS = {
    "replicas",
    "gpus",
    "numgpus",
    "gpuspernode",
    "numgpuspernode",
    "nodes",
    "numnodes",
    "nnodes",
    "criticnumnodes",
    "criticnumgpuspernode",
    "actornumnodes",
    "actornumgpuspernode",
    "resources",
    "cpus",
    "memory",
    "colocate",
    "colocatewithactor",
    "colocatecritic",
    "parallelism",
    "tensor",
    "pipeline",
    "context",
    "tensorparallel",
    "tensormodelparallelsize",
    "pipelinemodelparallelsize",
    "contextparallelsize",
    "worldsize",
    "nodeselector",
    "tolerations",
    "numworkers",
    "workers",
}


def check_critic_overrides(overrides: Any, path: str) -> list[Problem]:
    """Problems with a critic overrides mapping (forbidden, unknown or ill-typed keys)."""
    if not isinstance(overrides, dict):
        return [
            Problem(
                path,
                f"must be a mapping, got {type(overrides).__name__}",
                "write `overrides: {learningRate: 1e-5}`",
            )
        ]
    problems = []
    for key in overrides:
        norm = _norm(str(key))
        if norm in _ALLOCATION_KEYS:
            problems.append(
                Problem(
                    f"{path}.{key}",
                    "critic overrides may not change GPU allocation or node counts",
                    "size the critic with spec.roles.critic.replicas, resources and parallelism",
                )
            )
        elif norm not in _OVERRIDABLE:
            allowed = ", ".join(f.alias or n for n, f in TrainingSettings.model_fields.items())
            problems.append(
                Problem(f"{path}.{key}", "not a training setting", f"use one of: {allowed}")
            )
    if problems:
        return problems
    user_key = {_OVERRIDABLE[_norm(str(k))]: str(k) for k in overrides}
    try:
        TrainingSettings.model_validate(_canonical_overrides(overrides))
    except Exception as exc:  # pydantic.ValidationError
        for problem in pydantic_problems(exc, path):
            field = problem.path.removeprefix(f"{path}.")
            shown = f"{path}.{user_key.get(field, field)}"
            problems.append(Problem(shown, problem.message, problem.fix))
    return problems


def _canonical_overrides(overrides: dict[str, Any]) -> dict[str, Any]:
    return {_OVERRIDABLE[_norm(str(k))]: v for k, v in overrides.items()}


def apply_critic_overrides(base: TrainingSettings, overrides: dict[str, Any]) -> TrainingSettings:
    """The critic's settings: `base` with `overrides` on top; unspecified keys inherit."""
    problems = check_critic_overrides(overrides, "spec.roles.critic.overrides")
    if problems:
        raise SpecError(problems)
    data = {name: getattr(base, name) for name in TrainingSettings.model_fields}
    data.update(_canonical_overrides(overrides))
    return TrainingSettings.model_validate(data)


def parse_critic_override_file(text: str, source: str = "critic config") -> dict[str, Any]:
    """Parse the trainer's `--critic-config-path` file: `critic: [{name: default, overrides: {}}]`.

    Returns the overrides mapping, validated with the same rules as spec.roles.critic.overrides.
    """
    fmt = "critic: [{name: default, overrides: {learningRate: 1e-5}}]"
    doc = load_yaml(text, source)  # strict: duplicate keys are errors, 1e-5 is a number
    if not isinstance(doc, dict) or set(doc) != {"critic"}:
        got = sorted(doc) if isinstance(doc, dict) else type(doc).__name__
        raise SpecError(
            [Problem(source, f"expected one top-level key `critic`, got {got}", f"write {fmt}")],
            source,
        )
    entries = doc["critic"]
    if not isinstance(entries, list) or len(entries) != 1:
        n = len(entries) if isinstance(entries, list) else type(entries).__name__
        raise SpecError(
            [Problem("critic", f"must be a list of exactly one entry, got {n}", f"write {fmt}")],
            source,
        )
    entry = entries[0]
    if not isinstance(entry, dict) or not isinstance(entry.get("name"), str):
        raise SpecError(
            [
                Problem(
                    "critic[0]", "needs a string `name` and an `overrides` mapping", f"write {fmt}"
                )
            ],
            source,
        )
    extra = set(entry) - {"name", "overrides"}
    problems = [
        Problem(f"critic[0].{k}", "unknown key", "use only name and overrides") for k in extra
    ]
    overrides = entry.get("overrides", {}) or {}
    problems += check_critic_overrides(overrides, "critic[0].overrides")
    if problems:
        raise SpecError(problems, source)
    return dict(overrides)


# ---------------------------------------------------------------------------------------------
# Semantic validation of the training half
# ---------------------------------------------------------------------------------------------
# Rules judge values, never whether a field was written: the API server stores a job with the
# CRD's defaults filled in, and a manifest and its stored form must get the same verdict.
def _default(model: type[BaseModel], field: str) -> Any:
    """The default of a model field (what the API server fills in when it is omitted)."""
    return model.model_fields[field].get_default(call_default_factory=True)


def check_training_half(half: TrainingHalf, prefix: str = "spec") -> list[Problem]:
    """Every semantic problem of the training half, with field paths under `prefix`."""
    p: list[Problem] = []
    algo, roles, data = half.algorithm, half.roles, half.data
    needs_critic = algo.needs_critic
    path = f"{prefix}.roles"

    # --- critic present when the estimator needs none
    if not needs_critic:
        why = f"advantageEstimator {algo.advantage_estimator} uses no critic"
        if roles.critic is not None:
            p.append(Problem(f"{path}.critic", why, "remove spec.roles.critic or use gae"))
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
            if value != _default(Algorithm, field) and not (
                field == "value_clip" and value is None
            ):
                p.append(
                    Problem(
                        f"{prefix}.algorithm.{alias}",
                        f"{why}, so {alias}: {value} has no effect",
                        "remove it or use gae",
                    )
                )

    # --- colocation: a colocated role runs on the actor's pods and counts no GPU of its own
    actor = roles.actor
    colocated = [("critic", roles.critic), ("rollout", roles.rollout)]
    for name, spec in colocated:
        if spec is None or not spec.colocate_with_actor:
            continue
        for field, alias in (
            ("replicas", "replicas"),
            ("resources", "resources"),
            ("node_selector", "nodeSelector"),
            ("tolerations", "tolerations"),
        ):
            # judged by value: the default (what the API server stores when it is omitted) or
            # the actor's own value are both fine; anything else would count GPUs twice
            mine, theirs = getattr(spec, field), getattr(actor, field)
            if mine != theirs and mine != _default(type(spec), field):
                p.append(
                    Problem(
                        f"{path}.{name}.{alias}",
                        f"a colocated {name} runs on the actor's pods and GPUs, so its {alias} "
                        f"cannot differ from the actor's (GPUs would be counted twice)",
                        f"remove spec.roles.{name}.{alias} or set colocateWithActor: false",
                    )
                )

    # --- backends and parallelism
    for name in ("actor", "critic", "rollout"):
        spec = getattr(roles, name)
        if spec is None:
            continue
        rpath = f"{path}.{name}"
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
        workers = roles.workers_of(name, needs_critic=True)
        if workers % mp.model_parallel:
            p.append(
                Problem(
                    f"{rpath}.parallelism",
                    f"{workers} GPU(s)/workers are not divisible by tensor x pipeline x context = "
                    f"{mp.tensor} x {mp.pipeline} x {mp.context} = {mp.model_parallel}",
                    f"make replicas x resources.gpus a multiple of {mp.model_parallel}",
                )
            )
        if (
            name == "rollout"
            and spec.colocate_with_actor
            and actor.backend == "megatron"
            and spec.backend == "sglang"
        ):
            p.append(
                Problem(
                    f"{rpath}.colocateWithActor",
                    "a megatron actor gathers its weights on one worker, but a colocated sglang "
                    "engine takes them from the actor workers on its own GPUs",
                    "give the rollout its own pods (colocateWithActor: false)",
                )
            )
        # an engine spans `tensor` GPUs of one pod (one node): they must tile the pod's GPUs
        if name == "rollout" and gpus > 0 and gpus % mp.tensor:
            owner = "the actor's pod" if spec.colocate_with_actor else "its pod"
            p.append(
                Problem(
                    f"{rpath}.parallelism.tensor",
                    f"an engine spans {mp.tensor} GPUs of one pod, which does not fit "
                    f"{owner}'s {gpus} GPU(s) ({gpus} is not a multiple of {mp.tensor})",
                    "use a tensor size that divides resources.gpus",
                )
            )

    p += check_megatron(half, prefix)
    for name in ("actor", "critic", "rollout"):
        spec = getattr(roles, name)
        if spec is not None and spec.backend != "megatron" and spec.parallelism.sequence_parallel:
            p.append(
                Problem(
                    f"{path}.{name}.parallelism.sequenceParallel",
                    f"the {spec.backend} backend has no sequence parallelism (only megatron has)",
                    "remove it",
                )
            )

    # --- precision of the torch trainers
    if half.model.dtype == "float16":
        for name, spec in (
            ("actor", roles.actor),
            ("critic", roles.effective_critic(needs_critic)),
        ):
            if spec is not None and spec.backend == "torch":
                p.append(
                    Problem(
                        f"{prefix}.model.dtype",
                        f"float16 needs loss scaling, which the torch backend ({name}) does not do",
                        "use bfloat16 (or float32)",
                    )
                )
                break

    # --- batch sizes
    n = data.samples_per_step
    dp_actor = max(roles.workers_of("actor") // actor.parallelism.model_parallel, 1)
    p += _check_batches(half.training, n, dp_actor, f"{prefix}.training", "actor")
    critic = roles.effective_critic(needs_critic)
    if critic is not None:
        opath = f"{path}.critic.overrides"
        op = check_critic_overrides(critic.overrides, opath)
        p += op
        if not op:
            dp_critic = max(roles.workers_of("critic") // critic.parallelism.model_parallel, 1)
            merged = apply_critic_overrides(half.training, critic.overrides)
            for problem in _check_batches(merged, n, dp_critic, opath, "critic"):
                if problem not in p:
                    p.append(problem)
    if algo.advantage_estimator in GROUP_ESTIMATORS and data.samples_per_prompt < 2:
        p.append(
            Problem(
                f"{prefix}.data.samplesPerPrompt",
                f"{algo.advantage_estimator} "
                "compares samples of the same prompt and needs at least 2",
                "set samplesPerPrompt >= 2",
            )
        )
    if half.training.min_learning_rate > half.training.learning_rate:
        p.append(
            Problem(
                f"{prefix}.training.minLearningRate",
                "exceeds learningRate",
                "set minLearningRate <= learningRate",
            )
        )

    # --- KL consistency
    kl, kpath = algo.kl, f"{prefix}.algorithm.kl"
    if kl.target is not None and kl.coefficient == 0:
        p.append(
            Problem(
                f"{kpath}.target",
                "an adaptive KL target needs a starting coefficient",
                "set kl.coefficient > 0 or remove kl.target",
            )
        )
    if kl.target is not None and kl.mode == "loss":
        p.append(
            Problem(
                f"{kpath}.target",
                "the adaptive controller acts on the KL in the reward",
                "set kl.mode: reward or remove kl.target",
            )
        )
    if kl.coefficient > 0 and kl.mode == "loss" and kl.estimator == "k1":
        p.append(
            Problem(
                f"{kpath}.estimator",
                "k1 as a loss has a gradient that does not minimise KL",
                "use k2, k3 or low_var_kl with mode: loss",
            )
        )
    if kl.coefficient > 0 and kl.mode == "reward" and algo.advantage_estimator in GROUP_ESTIMATORS:
        p.append(
            Problem(
                f"{kpath}.mode",
                f"{algo.advantage_estimator} compares outcome rewards "
                "within a group, which discards a per-token KL penalty",
                "set kl.mode: loss (with k3 or low_var_kl)",
            )
        )
    changed = [
        f"{alias}: {getattr(kl, field)}"
        for field, alias in (("estimator", "estimator"), ("mode", "mode"))
        if getattr(kl, field) != _default(KLSpec, field)
    ]
    if kl.coefficient == 0 and changed:
        p.append(
            Problem(
                f"{kpath}.coefficient",
                f"KL settings are given ({', '.join(changed)}) but the coefficient is 0, "
                "so KL is off",
                "set kl.coefficient > 0 or remove kl",
            )
        )

    # --- hooks and sources
    for field, value in (("data.rewardFunction", data.reward_function),):
        if value is None:
            continue
        if value.startswith("builtin:"):
            if value.removeprefix("builtin:") not in BUILTIN_TASKS:
                p.append(
                    Problem(
                        f"{prefix}.{field}",
                        f"unknown built-in reward {value!r}",
                        f"use one of {[f'builtin:{t}' for t in BUILTIN_TASKS]}",
                    )
                )
        elif not re.match(HOOK_PATTERN, value):
            p.append(
                Problem(
                    f"{prefix}.{field}",
                    f"{value!r} is not `module:function`",
                    "write it as `package.module:function` or `builtin:<task>`",
                )
            )
    if data.prompts.startswith("builtin:"):
        if data.prompts.removeprefix("builtin:") not in BUILTIN_TASKS:
            p.append(
                Problem(
                    f"{prefix}.data.prompts",
                    f"unknown built-in task {data.prompts!r}",
                    f"use one of {[f'builtin:{t}' for t in BUILTIN_TASKS]}",
                )
            )
    elif "." in data.prompts.rstrip("/").rsplit("/", 1)[-1] and not re.search(
        r"\.(jsonl|json|parquet)/?$", data.prompts
    ):  # a name with another extension; a name without one is a save_to_disk directory
        p.append(
            Problem(
                f"{prefix}.data.prompts",
                "expected a .jsonl, .json or .parquet file or a directory saved with "
                "`datasets`' save_to_disk",
                "point it at such a dataset or use builtin:<task>",
            )
        )
    elif data.reward_function is None:
        p.append(
            Problem(
                f"{prefix}.data.rewardFunction",
                "a dataset needs a reward function",
                "set rewardFunction: package.module:function",
            )
        )
    ev = data.eval_prompts
    if ev is not None and ev.startswith("builtin:") and ev[8:] not in BUILTIN_TASKS:
        p.append(
            Problem(
                f"{prefix}.data.evalPrompts",
                f"unknown built-in task {ev!r}",
                f"use one of {[f'builtin:{t}' for t in BUILTIN_TASKS]}",
            )
        )
    elif ev is not None and not ev.startswith("builtin:") and data.reward_function is None:
        missing = Problem(
            f"{prefix}.data.rewardFunction",
            "a dataset needs a reward function",
            "set rewardFunction: package.module:function",
        )
        if missing not in p:
            p.append(missing)
    for field, value in (
        ("model.path", half.model.path),
        ("model.criticPath", half.model.critic_path),
    ):
        if value is not None:
            try:
                model_path_kind(value)
            except ValueError as exc:
                why, _, fix = str(exc).partition("; ")
                p.append(Problem(f"{prefix}.{field}", why, fix))
    p += check_sizes(half, prefix)
    return p


_DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}
_QUANTITY_SUFFIX = {"Ki": 2**10, "Mi": 2**20, "Gi": 2**30, "Ti": 2**40, "Pi": 2**50, "Ei": 2**60}
_QUANTITY_SUFFIX |= {"k": 1e3, "M": 1e6, "G": 1e9, "T": 1e12, "P": 1e15, "E": 1e18, "m": 1e-3}


def quantity_bytes(value: str) -> float:
    """A Kubernetes memory quantity (`4Gi`, `512M`, `1000`) in bytes."""
    for suffix in sorted(_QUANTITY_SUFFIX, key=len, reverse=True):
        if value.endswith(suffix):
            return float(value[: -len(suffix)]) * _QUANTITY_SUFFIX[suffix]
    return float(value)


def _gib(n: float) -> str:
    return f"{n / 2**30:.1f} GiB"


def check_sizes(half: TrainingHalf, prefix: str = "spec") -> list[Problem]:
    """Sizes that cannot work, found before anything starts (a small independent bound, not a
    memory plan): a sequence longer than a built-in model's context, and a rollout or training
    batch whose KV cache or activations alone exceed a CPU pod's memory. Lower bounds only, so a
    job this refuses could never have run."""
    data, roles = half.data, half.roles
    path = half.model.path
    if not path.startswith("builtin:") or path[8:] not in BUILTIN_SHAPES:
        return []  # real models: the backend's memory plan sizes them from the model's config
    problems: list[Problem] = []
    seq = data.max_prompt_length + data.max_response_length
    if seq > BUILTIN_CONTEXT:
        problems.append(
            Problem(
                f"{prefix}.data.maxResponseLength",
                f"maxPromptLength + maxResponseLength = {data.max_prompt_length} + "
                f"{data.max_response_length} = {seq} tokens, but {path} takes at most "
                f"{BUILTIN_CONTEXT}",
                f"keep maxPromptLength + maxResponseLength <= {BUILTIN_CONTEXT}",
            )
        )
        return problems
    hidden, inter, layers = BUILTIN_SHAPES[path[8:]]
    width = _DTYPE_BYTES[half.model.dtype]
    n = data.samples_per_step
    for name, per_token, what in (
        ("rollout", 2 * layers * hidden * width, "KV cache of its share of the rollout batch"),
        ("actor", layers * (4 * hidden + 2 * inter) * 4, "activations of one micro-batch"),
    ):
        spec = getattr(roles, name)
        owner = roles.actor if getattr(spec, "colocate_with_actor", False) else spec
        if owner.resources.gpus:
            continue  # GPU memory is the backend's memory plan's business
        workers = max(roles.workers_of(name, needs_critic=True), 1)
        dp = max(workers // spec.parallelism.model_parallel, 1)
        share = -(-n // dp)
        if name == "actor":
            mini = half.training.mini_batch_size or n
            share = half.training.micro_batch_size or max(mini // dp, 1)
        need = share * seq * per_token
        have = quantity_bytes(owner.resources.memory) / max(owner.resources.gpus, 1)
        if need > have:
            where = "actor" if owner is roles.actor else name
            problems.append(
                Problem(
                    f"{prefix}.roles.{where}.resources.memory",
                    f"the {name}'s {what} ({share} samples x {seq} tokens) needs at least "
                    f"{_gib(need)}, more than the pod's {owner.resources.memory}",
                    "raise the memory, or lower rolloutBatchSize, samplesPerPrompt, "
                    "maxResponseLength or microBatchSize",
                )
            )
    return problems


# What the megatron backend splits in the built-in models (models.BUILTIN_MODELS, which needs
# torch): family, hidden, intermediate, layers, heads, key/value heads, vocabulary. A trainer test
# checks they agree with the models.
BUILTIN_MEGATRON_SHAPES = {
    "tiny-llama": ("llama", 64, 256, 2, 4, 4, 14),
    "tiny-qwen2": ("qwen2", 64, 256, 2, 4, 4, 14),
    "small-llama": ("llama", 128, 512, 5, 4, 4, 14),
}


def check_megatron(half: TrainingHalf, prefix: str = "spec") -> list[Problem]:
    """Problems of the roles on the megatron backend: context parallelism without GPUs, a CPU
    run in half precision, a colocated actor and critic with different layouts, and (for the
    built-in models, whose shapes are known here) tensor or pipeline sizes that do not split the
    model. A model directory's architecture and shape are checked when the trainer loads it,
    with the same messages (``backends/megatron_convert.py``)."""
    p: list[Problem] = []
    roles = half.roles
    critic = roles.effective_critic(half.algorithm.needs_critic)
    on = [
        (n, s)
        for n, s in (("actor", roles.actor), ("critic", critic))
        if s is not None and s.backend == "megatron"
    ]
    if roles.actor.backend == "megatron" and half.data.top_p < 1.0:
        p.append(
            Problem(
                f"{prefix}.data.topP",
                "the megatron actor computes pi_old and pi_theta over the full "
                "tensor-parallel vocabulary, so top-p sampling would make the rollout "
                "policy differ from pi_old",
                "set data.topP: 1.0, or use backend: torch for the actor",
            )
        )
    for name, spec in on:
        rpath = f"{prefix}.roles.{name}"
        owner = roles.actor if getattr(spec, "colocate_with_actor", False) else spec
        mp = spec.parallelism
        if owner.resources.gpus == 0 and mp.context > 1:
            p.append(
                Problem(
                    f"{rpath}.parallelism.context",
                    "context parallelism needs GPUs (megatron-core runs it with "
                    "Transformer Engine's attention), but resources.gpus is 0",
                    "set context: 1, or give the role GPUs",
                )
            )
        if mp.sequence_parallel and (owner.resources.gpus == 0 or mp.tensor == 1):
            p.append(
                Problem(
                    f"{rpath}.parallelism.sequenceParallel",
                    "sequence parallelism splits activations over tensor-parallel GPUs "
                    f"(here tensor {mp.tensor}, {owner.resources.gpus} GPU(s) per pod)",
                    "remove it, or use GPUs with tensor > 1",
                )
            )
        if owner.resources.gpus == 0 and half.model.dtype != "float32":
            p.append(
                Problem(
                    f"{prefix}.model.dtype",
                    f"the megatron backend on CPU ({rpath}) trains in float32",
                    "set model.dtype: float32, or give the role GPUs",
                )
            )
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
    if (
        len(on) == 2
        and critic is not None
        and critic.colocate_with_actor
        and critic.parallelism != roles.actor.parallelism
    ):
        p.append(
            Problem(
                f"{prefix}.roles.critic.parallelism",
                "a colocated critic shares the actor's processes, and megatron-core "
                "holds one parallel layout per process",
                "give the critic the actor's parallelism",
            )
        )
    return p


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


def _check_batches(
    settings: TrainingSettings, n: int, dp: int, path: str, role: str
) -> list[Problem]:
    problems = []
    mini = settings.mini_batch_size or n
    if n % mini:
        problems.append(
            Problem(
                f"{path}.miniBatchSize",
                f"{mini} does not divide the {n} samples of a step (rolloutBatchSize x "
                f"samplesPerPrompt)",
                f"use a divisor of {n}",
            )
        )
    elif mini % dp:
        problems.append(
            Problem(
                f"{path}.miniBatchSize",
                f"the {role}'s mini-batch of {mini} samples does not split over its {dp} "
                f"data-parallel workers",
                f"use a multiple of {dp}",
            )
        )
    elif settings.micro_batch_size and (mini // dp) % settings.micro_batch_size:
        problems.append(
            Problem(
                f"{path}.microBatchSize",
                f"{settings.micro_batch_size} does not divide the {role} worker's share of a "
                f"mini-batch ({mini} / {dp} = {mini // dp})",
                f"use a divisor of {mini // dp}",
            )
        )
    return problems


def load_trainer_config(path: str | Path) -> TrainerConfig:
    """Read a trainer config file (the ConfigMap's YAML) and validate it completely."""
    text = Path(path).read_text()
    doc = load_yaml(text, str(path)) or {}
    if not isinstance(doc, dict):
        raise SpecError([Problem(str(path), "expected a mapping")])
    try:
        cfg = TrainerConfig.model_validate(doc)
    except Exception as exc:
        raise SpecError(pydantic_problems(exc), str(path)) from None
    problems = check_training_half(cfg, prefix="config")
    if problems:
        raise SpecError(problems, str(path))
    return cfg
