"""The training half of a PPOJob: the trainer's own configuration model.

This module imports neither torch nor ray, so the operator can validate a spec with it and render it
into the trainer's ConfigMap, and `ppojob run` can feed it to a local trainer. Every field's
docstring becomes its description in the generated CRD (`kubectl explain`).

Semantic rules that a schema cannot express live in `ppojob_api.checks`, which return *every*
problem with its field path and a fix; `SpecError` carries them as a `ValueError`.
"""

from __future__ import annotations

import re
from typing import Annotated, Any, Literal

from pydantic import Field

from ppojob_api.base import HOOK_PATTERN, NAME_PATTERN, URL_PATTERN, ApiModel
from ppojob_api.quantity import CpuQuantity, MemoryQuantity

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

# What the megatron backend splits in the built-in models (models.BUILTIN_MODELS, which needs
# torch): family, hidden, intermediate, layers, heads, key/value heads, vocabulary. A trainer test
# checks they agree with the models.
BUILTIN_MEGATRON_SHAPES = {
    "tiny-llama": ("llama", 64, 256, 2, 4, 4, 14),
    "tiny-qwen2": ("qwen2", 64, 256, 2, 4, 4, 14),
    "small-llama": ("llama", 128, 512, 5, 4, 4, 14),
}
BUILTIN_TASKS = ("count-up", "reverse", "calculator")
BUILTIN_AGENTS = ("calculator",)
BUILTIN_TOOLS = ("calculate",)
TOOL_NAME_PATTERN = r"^[A-Za-z_][A-Za-z0-9_-]{0,63}$"
ESTIMATORS_WITHOUT_CRITIC = ("grpo", "reinforce_plus_plus", "reinforce_plus_plus_baseline", "rloo")
GROUP_ESTIMATORS = ("grpo", "reinforce_plus_plus_baseline", "rloo")
# Estimators whose advantages are whitened over the step's tokens when normalizeAdvantages is unset
WHITENING_BY_DEFAULT = ("gae", "reinforce_plus_plus", "reinforce_plus_plus_baseline")


# ---------------------------------------------------------------------------------------------
# Model
# ---------------------------------------------------------------------------------------------
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
    models (`builtin:tiny-llama`, `builtin:tiny-qwen2`, `builtin:small-llama`). An existing
    directory wins over a hub id of the same name."""

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


# ---------------------------------------------------------------------------------------------
# Roles
# ---------------------------------------------------------------------------------------------
class Resources(ApiModel):
    """What one replica (one pod) of a role requests and is limited to."""

    gpus: int = Field(0, ge=0, le=64)
    """GPUs per replica. 0 runs the role on CPU, one worker per replica; otherwise one worker per
    GPU."""

    cpus: CpuQuantity = Field(1.0, le=1024)
    """CPU cores per replica: a number (`2`, `0.5`) or a Kubernetes quantity (`"500m"`)."""

    memory: MemoryQuantity = "4Gi"
    """Memory per replica, as a Kubernetes quantity such as `64Gi` (2^30 bytes each) or `64G`
    (10^9); a bare number is bytes, as in a pod."""

    extra: dict[str, int] = Field(default_factory=dict)
    """Extended resources per replica (requested and limited), e.g. `{rdma/ib: 1}` for NCCL over
    InfiniBand through an RDMA device plugin."""

    hugepages: dict[str, MemoryQuantity] = Field(default_factory=dict)
    """Huge pages per replica by page size, e.g. `{2Mi: 1Gi}` or `{1Gi: 4Gi}`: requested and
    limited as `hugepages-<size>` (Kubernetes wants both equal, and a whole number of pages), and
    mounted into the role's containers at `/dev/hugepages` (one size) or `/dev/hugepages-<size>`
    (several). The nodes must have them pre-allocated."""


class Toleration(ApiModel):
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


class EnvVar(ApiModel):
    """An environment variable set in the role's containers."""

    name: str = Field(min_length=1, pattern=r"^[-._a-zA-Z][-._a-zA-Z0-9]*$")
    """Variable name."""

    value: str = ""
    """Variable value."""


class Parallelism(ApiModel):
    """Model parallelism of a role. Data parallelism is derived: workers / (tensor x pipeline x
    context)."""

    tensor: int = Field(1, ge=1, le=64)
    """Tensor-parallel size (megatron and sglang backends)."""

    pipeline: int = Field(1, ge=1, le=64)
    """Pipeline-parallel size (megatron backend)."""

    context: int = Field(1, ge=1, le=64)
    """Context-parallel size. Reserved: the megatron backend does not split sequences over
    context-parallel ranks yet, so validation refuses a value above 1 for megatron roles."""

    sequence_parallel: bool = False
    """Megatron sequence parallelism: split the activations outside the tensor-parallel layers
    along the sequence over the tensor-parallel ranks (megatron backend on GPUs with Transformer
    Engine installed; needs tensor > 1)."""

    @property
    def model_parallel(self) -> int:
        return self.tensor * self.pipeline * self.context


class _Role(ApiModel):
    replicas: int = Field(1, ge=1, le=4096)
    """Number of pods of this role. All of them are scheduled together with the rest of the job
    (gang scheduling)."""

    resources: Resources = Field(default_factory=Resources)
    """Per-replica resources."""

    node_selector: dict[str, str] = Field(default_factory=dict)
    """Node labels the role's pods must match, e.g. `nvidia.com/gpu.product: H100-SXM`."""

    tolerations: list[Toleration] = Field(default_factory=list)
    """Tolerations of the role's pods."""

    affinity: dict[str, Any] = Field(
        default_factory=dict, json_schema_extra={"x-kubernetes-preserve-unknown-fields": True}
    )
    """A Kubernetes `affinity` (nodeAffinity, podAffinity, podAntiAffinity) for the role's pods,
    copied into their pod spec as written; `ppojob validate` checks it at every level by the API
    server's rules."""

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
    or on GPUs; no context parallelism yet)."""


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


class ElasticRollout(ApiModel):
    """Disaggregated rollout engines that may come and go without failing the job: an engine
    lost mid-step loses only its in-flight prompts (generated again on the others), and a new
    one takes the actor's current weights before it generates."""

    min_replicas: int = Field(1, ge=1, le=4096)
    """Fewest engines the job runs with: the trainer's gang waits for these only, and a step that
    is left with fewer (and cannot start new ones in time) fails."""

    max_replicas: int = Field(1, ge=1, le=4096)
    """Most engines the job runs with: the trainer starts engines up to this many, and KubeRay's
    in-tree autoscaler adds rollout pods for them while there is room (not under Kueue); a lost
    engine is replaced."""

    start_timeout_seconds: int = Field(120, ge=1, le=86400)
    """How long the trainer waits for a new engine when fewer than minReplicas are left (with
    at least minReplicas it never waits: a new engine joins the step after it is up)."""


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

    elastic: ElasticRollout | None = None
    """Elastic engines (their own pods, torch backend): `replicas` engines start, between
    minReplicas and maxReplicas, and more join up to maxReplicas when there is room; the gang
    holds minReplicas of them. An engine lost mid-step does not fail the step. Unset: every
    engine is part of the gang and losing one fails the step."""


class RewardRole(_Role):
    """Reward-model workers: every `data.rewards[].model` source is loaded on each of these
    workers (one per GPU, or one per replica on CPU) instead of in every rollout engine's
    process, and the engines send them the texts to score (prompt and completion strings, by
    Ray actor calls from the engine's process, never through the driver). Each engine splits a
    step's samples into one contiguous part per reward worker and sends the parts at once; a
    worker scores its part in batches of the source's batchSize. Judges and HTTP sources stay
    in the engines. The workers are data parallel only: leave `parallelism` unset."""


class SandboxRole(_Role):
    """Sandbox workers: the environment of `data.agent` (its hook, or its declared tools) runs
    on these workers' pods instead of beside every rollout engine. Each worker keeps the same
    pool of tool processes (forked, each call with toolTimeoutSeconds, a CPU-time and an
    address-space limit); the engines send each round's calls to the workers by Ray actor calls
    from the engine's process (JSON strings in and out, never through the driver), split into
    one contiguous part per worker. On a cluster the pods get `runtimeClassName` and a
    NetworkPolicy of their own that allows egress only to the job's pods and to DNS (enforced
    by CNIs that implement NetworkPolicy egress). CPU only: leave `resources.gpus` and
    `parallelism` unset."""

    runtime_class_name: str | None = None
    """The RuntimeClass of the sandbox pods (e.g. `gvisor`, `kata`: a RuntimeClass the cluster
    has, `kubectl get runtimeclasses`). Unset: the cluster's default runtime."""


class Roles(ApiModel):
    """The roles of PPO (actor, critic, rollout) and the optional reward-model and sandbox
    workers. Each is data parallel over its workers."""

    actor: ActorRole = Field(default_factory=ActorRole)
    """The policy being trained."""

    critic: CriticRole | None = None
    """The value model. Only for `gae`; when omitted, a critic colocated with the actor is used."""

    rollout: RolloutRole = Field(default_factory=RolloutRole)
    """The generation engines."""

    reward: RewardRole | None = None
    """Workers of their own (pods, in the gang) holding the reward models of data.rewards and
    scoring every engine's samples. Unset: each rollout engine loads the reward models in its
    own process, on its own device."""

    sandbox: SandboxRole | None = None
    """Workers of their own (pods, in the gang) running data.agent's tool calls for every
    engine, optionally under their own RuntimeClass and with egress limited to the job's pods.
    Unset: each rollout engine runs them in tool processes of its own."""

    def effective_critic(self, needs_critic: bool) -> CriticRole | None:
        """The critic the trainer runs: the given one, a colocated default, or none."""
        if not needs_critic:
            return None
        return self.critic or CriticRole(colocate_with_actor=True)

    def workers_of(self, role: str, needs_critic: bool = True) -> int:
        """Worker count of a role, following colocation."""
        if role == "actor":
            return self.actor.workers()
        if role in ("reward", "sandbox"):
            extra = getattr(self, role)
            return extra.workers() if extra is not None else 0
        spec = self.effective_critic(needs_critic) if role == "critic" else self.rollout
        if spec is None:
            return 0
        return self.actor.workers() if spec.colocate_with_actor else spec.workers()


# ---------------------------------------------------------------------------------------------
# Algorithm
# ---------------------------------------------------------------------------------------------
class KLSpec(ApiModel):
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


class ImportanceSampling(ApiModel):
    """Off-policy correction of the decoupled PPO objective: each token's policy loss is weighed
    by w = pi_old / pi_behaviour, where pi_behaviour is the policy that sampled the token (the
    engine's sampling log-prob, of the weights it held then) and pi_old the proximal policy the
    actor recomputes at the start of the step (the PPO ratio's anchor)."""

    level: Literal["token", "sequence"] = "token"
    """`token`: one weight per token; `sequence`: one weight per sample, the product of its
    tokens' ratios, given to every token of the sample."""

    mode: Literal["truncate", "mask"] = "truncate"
    """`truncate` (TIS): w -> min(w, cap); `mask` (MIS): w -> w when w <= cap, else 0 (the token,
    or the whole sample at level sequence, is left out of the loss)."""

    cap: float = Field(2.0, gt=1, le=1000)
    """The bound C of the weights (> 1; 2 is common at level token, larger at level sequence)."""


class DynamicSampling(ApiModel):
    """DAPO's dynamic sampling (Yu et al. 2025, "DAPO", arXiv 2503.14476): a prompt group whose
    samples all got the same reward has zero advantage under a group estimator and teaches
    nothing, so it is left out of the step; the trainer generates more groups (rounds of
    data.rolloutBatchSize fresh prompts) until the step has rolloutBatchSize groups with
    differing rewards, or maxRounds rounds were generated. Every step reports
    dynamic_sampling/generation_rounds, dynamic_sampling/filtered_groups (groups left out),
    dynamic_sampling/kept_groups and dynamic_sampling/short_groups; reward/mean is then over
    every sample generated in the step's rounds."""

    max_rounds: int = Field(4, ge=1, le=64)
    """Generation rounds per step at most, the first included (1: filter, never refill). When the
    cap is hit the step trains on the groups it has: the missing ones are filled with filtered
    groups whose samples are left out of the loss, and dynamic_sampling/short_groups says how
    many were missing."""


class OverlongShaping(ApiModel):
    """DAPO's soft overlong punishment (Yu et al. 2025, arXiv 2503.14476, eq. 13): with L_max =
    data.maxResponseLength and L_cache = bufferLength, a response of |y| tokens (its stop token
    included) gets the penalty 0 when |y| <= L_max - L_cache, ((L_max - L_cache) - |y|) / L_cache
    inside the buffer (reaching -1 at L_max) and -1 beyond, times penaltyFactor, added to its
    reward before advantages (and before dynamic sampling compares a group's rewards).
    reward/mean stays the task's reward; reward/overlong_penalty_mean reports the mean
    penalty."""

    buffer_length: int = Field(ge=1, le=1_048_576)
    """L_cache: the last this many tokens below data.maxResponseLength are the punishment
    buffer; must be smaller than data.maxResponseLength (DAPO: 4096 of 20480)."""

    penalty_factor: float = Field(1.0, gt=0, le=100)
    """Scale of the penalty (1 in the paper)."""


class Algorithm(ApiModel):
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
    """Lower PPO clip range: the ratio is clipped below at 1 - clipRangeLow. Any value in
    (0, 1), including GSPO's small ones (3e-4)."""

    clip_range_high: float = Field(0.2, gt=0, le=10)
    """Upper PPO clip range: the ratio is clipped above at 1 + clipRangeHigh ("clip higher";
    DAPO uses 0.28 with clipRangeLow 0.2, GSPO 4e-4)."""

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
    """How per-token losses are reduced to one number. `token-mean` is DAPO's token-level
    policy-gradient loss (arXiv 2503.14476, section 3.3): every token of the step weighs the
    same, whatever its sample's length. GSPO's objective is `seq-mean-token-mean`."""

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

    max_staleness: int = Field(0, ge=0, le=16)
    """Bounded staleness: how many policy versions older than the actor a sample's tokens may be
    when it is trained on. 0 (the default) is the synchronous on-policy loop: a step generates,
    then trains. With k > 0 the engines generate the next steps' samples while the actor trains
    (they need engines of their own: roles.rollout.colocateWithActor: false); generation of a
    step is launched only once its samples are sure to be at most k versions old when trained
    on, so none is ever discarded. Every token carries the version that generated it; the step
    reports staleness/mean, staleness/max and time/overlap_share."""

    partial_rollout: bool = False
    """Partial (interruptible) rollout, with maxStaleness > 0: a weight sync reaches the engines
    while they generate, and each loads the new weights between two tokens and samples the rest
    of its in-flight responses from them (re-encoding the tokens so far), instead of finishing
    them with the old ones. A sample's tokens may then come from several policy versions, each
    token tagged with its own, so the off-policy correction stays exact token by token; the
    actor's weights reach the engines through Ray's object store. Torch engines, single-turn
    generation. Reported: rollout/switched_share (the share of samples whose tokens span more
    than one version)."""

    importance_sampling: ImportanceSampling | None = None
    """Off-policy correction (decoupled PPO objective) for stale or mismatched samples: truncated
    (TIS) or masked (MIS) importance weights pi_old / pi_behaviour, per token or per sequence.
    Unset: none. Every step reports is/weight_mean and is/weight_max (before truncation or
    masking) and is/capped_share (the share of tokens truncated or masked)."""

    policy_loss: Literal["ppo", "gspo"] = "ppo"
    """The policy objective. `ppo`: the token-level clipped ratio pi_theta / pi_old. `gspo`:
    Group Sequence Policy Optimization (Zheng et al. 2025, arXiv 2507.18071): one
    length-normalised ratio per sample, s_i = exp(mean over its tokens of log pi_theta -
    log pi_old), clipped at the sequence level, with the paper's GSPO-token gradient
    s_i,t = sg[s_i] pi_theta(y_t) / sg[pi_theta(y_t)]. GSPO's clip ranges are small (the paper
    uses clipRangeLow 3e-4 and clipRangeHigh 4e-4; both are accepted) and its objective averages
    each sample's tokens, then the samples (lossAggregation seq-mean-token-mean). dualClip does
    not apply to it."""

    dynamic_sampling: DynamicSampling | None = None
    """DAPO's dynamic sampling: filter prompt groups whose rewards are all equal and generate
    more to refill the step. Needs a group estimator (grpo, rloo,
    reinforce_plus_plus_baseline), samplesPerPrompt >= 2 and maxStaleness 0. Unset: off."""

    overlong_shaping: OverlongShaping | None = None
    """DAPO's soft overlong punishment of responses near data.maxResponseLength. Unset: off."""

    mask_truncated_samples: bool = False
    """DAPO's overlong filtering (arXiv 2503.14476, section 3.4): samples cut at
    data.maxResponseLength without a stop token are left out of the policy loss (their tokens
    count neither in the loss nor in its average). A step reports response/truncated_share
    either way."""

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
class RewardModelSource(ApiModel):
    """A Hugging Face sequence-classification reward model (`AutoModelForSequenceClassification`
    saved with `num_labels=1`), run on the reward workers when spec.roles.reward is set, else in
    each rollout engine's process, on its device. It reads the prompt as the policy saw it (chat
    template applied when data.applyChatTemplate is on) followed by the completion, tokenized
    with the reward model's own tokenizer; its single output is the reward."""

    path: str = Field(min_length=1)
    """The reward model's directory (config.json, weights and tokenizer) in the trainer image or
    a volume: absolute, or relative to the working directory. Hub ids are not downloaded for
    reward models: download the model into a volume and give its directory."""

    batch_size: int = Field(32, ge=1, le=65_536)
    """Texts scored per forward pass."""

    max_length: int = Field(4096, ge=1, le=1_048_576)
    """Longest prompt + completion, in the reward model's tokens; a longer text loses its
    beginning (the completion's end, which the model's score is read at, is kept)."""

    dtype: Literal["float32", "bfloat16", "float16"] | None = None
    """Dtype of the reward model's weights. Unset: model.dtype."""

    device: Literal["auto", "cpu"] = "auto"
    """`auto`: the device of the process holding the model (a reward worker's GPU when
    roles.reward is set and has GPUs; else the rollout engine's GPU when the rollout role has
    GPUs; else the CPU); `cpu`: always the CPU (no GPU memory, slower)."""


class HttpRewardSource(ApiModel):
    """A remote reward endpoint. The trainer POSTs JSON `{"prompts": [str], "completions": [str],
    "labels": [any]}` (one entry per sample, as a reward function gets them) and expects a 2xx
    answer `{"rewards": [number]}` with one finite number per sample, in order. Connection
    failures, timeouts, 408, 429 and 5xx answers are retried with exponential backoff; any other
    answer, invalid JSON, a wrong count or a non-finite reward fails the step with one line
    naming this source."""

    url: str = Field(min_length=1, pattern=URL_PATTERN)
    """The endpoint, `http://` or `https://`, reachable from the rollout role's pods. No
    credentials in it (`user:password@` is refused: a manifest is not a secret; use tokenEnv);
    messages show it without its query values."""

    timeout_seconds: float = Field(30.0, gt=0, le=3600)
    """Timeout of one request (connecting and reading the answer)."""

    retries: int = Field(2, ge=0, le=20)
    """Retries after a failed attempt (connection error, timeout, 408, 429 or 5xx)."""

    backoff_seconds: float = Field(1.0, ge=0, le=600)
    """Wait before the first retry; doubled before each further one."""

    batch_size: int | None = Field(None, ge=1, le=1_000_000)
    """Samples per request. Unset: all of an engine's samples of the step in one request."""

    token_env: str | None = Field(None, pattern=r"^[-._a-zA-Z][-._a-zA-Z0-9]*$")
    """Name of an environment variable holding a bearer token, sent as `Authorization: Bearer
    <token>`. Never write the token into the PPOJob: fill the variable from a Secret with
    spec.podTemplate.env (`valueFrom.secretKeyRef`)."""


JUDGE_PLACEHOLDERS = ("prompt", "response", "label")


class JudgeRewardSource(ApiModel):
    """A generative judge: a causal LM, run by a rollout engine (the torch engine the trainer
    samples with), reads `template` filled with the prompt and the response and writes a
    verdict; the first match of `scorePattern` in it is the reward, clamped to [minScore,
    maxScore]. A verdict without a number scores defaultScore and is counted in
    `reward/<name>_unparsed` (the step's count)."""

    model: str = Field(min_length=1)
    """`policy`: the policy's own rollout engine (its current weights, no extra memory);
    `builtin:<model>` (seed 0); or the directory of a Hugging Face causal LM in the trainer
    image or a volume (loaded once per rollout engine, on its device; hub ids are not
    downloaded)."""

    template: str = Field(
        "Rate the response to the prompt from 0 to 10.\nPrompt: {prompt}\nResponse: "
        "{response}\nScore:",
        min_length=1,
        max_length=65_536,
    )
    """The judge's prompt, a Python format string with `{prompt}`, `{response}` (required) and
    `{label}`; write a literal brace as `{{` or `}}`. Rendered with the judge's chat template
    when its tokenizer has one (applyChatTemplate)."""

    score_pattern: str = Field(r"(-?\d+(?:\.\d+)?)", min_length=1, max_length=1024)
    """Python regular expression with exactly one group, searched in the verdict (cut at its
    first special token); the group's text, read as a number, is the score."""

    min_score: float = 0.0
    """Scores below are raised to this."""

    max_score: float = 10.0
    """Scores above are lowered to this."""

    default_score: float = 0.0
    """The score of a verdict in which the pattern finds no number (within [minScore,
    maxScore])."""

    max_new_tokens: int = Field(16, ge=1, le=65_536)
    """Longest verdict, in the judge's tokens."""

    temperature: float = Field(0.0, ge=0, le=10)
    """Sampling temperature of the verdict; 0: greedy."""

    max_prompt_length: int = Field(4096, ge=1, le=1_048_576)
    """Longest judge prompt, in the judge's tokens; a longer one loses its beginning."""

    apply_chat_template: bool | None = None
    """Render the judge prompt with the judge tokenizer's chat template (as one user message).
    Unset: when the tokenizer has one."""


class RewardSource(ApiModel):
    """One source of the reward: exactly one of `function`, `model`, `http` and `judge`."""

    name: str | None = Field(None, pattern=NAME_PATTERN)
    """Name in the metrics (`reward/<name>_mean`, the source's unweighted mean). Unset: the
    function's name (`builtin:<task>`: the task), `model`, `http` or `judge`. Names must be
    unique."""

    weight: float = Field(1.0, ge=-1000, le=1000)
    """The reward is the sum over sources of weight x the source's reward."""

    function: str | None = Field(None, min_length=1)
    """`module:function` scoring a batch (as data.rewardFunction), or `builtin:<task>`."""

    model: RewardModelSource | None = None
    """A sequence-classification reward model."""

    http: HttpRewardSource | None = None
    """A remote reward endpoint."""

    judge: JudgeRewardSource | None = None
    """A generative judge (an LLM asked for a score)."""

    @property
    def kind(self) -> str | None:
        """`function`, `model`, `http` or `judge` when exactly one is set, else None."""
        kinds = [k for k in REWARD_KINDS if getattr(self, k) is not None]
        return kinds[0] if len(kinds) == 1 else None

    def default_name(self) -> str:
        """The name in the metrics: `name`, else one derived from the source."""
        if self.name is not None:
            return self.name
        if self.function is not None:
            tail = self.function.rsplit(":", 1)[-1]
            return re.sub(r"[^a-z0-9_.-]", "_", tail.lower()) or "function"
        return next((k for k in REWARD_KINDS[1:] if getattr(self, k) is not None), "http")


REWARD_KINDS = ("function", "model", "http", "judge")


class ToolSpec(ApiModel):
    """A tool the model may call, declared to it through the tokenizer's chat template
    (`apply_chat_template(..., tools=...)`, as an OpenAI-style function description)."""

    name: str = Field(pattern=TOOL_NAME_PATTERN)
    """The function name the model calls (letters, digits, `_` and `-`; unique)."""

    description: str = Field("", max_length=4096)
    """What the tool does, shown to the model."""

    parameters: dict[str, Any] = Field(default_factory=lambda: {"type": "object", "properties": {}})
    """JSON schema of the arguments: `{type: object, properties: {...}, required: [...]}`. A
    call's arguments are checked against it (required names, unknown names, the JSON types of
    `properties` and `enum`); a mismatch is the model's observation, not a call."""

    function: str = Field(min_length=1)
    """`module:function` called with the arguments as keywords, in a child process with
    toolTimeoutSeconds; its return value (a string, or JSON-encoded) is the tool message. Or
    `builtin:calculate` (`expression`: an integer expression of `+ - * //` and parentheses)."""


class AgentSpec(ApiModel):
    """A multi-turn agent: the model's turn (sampled by the rollout engine), then the
    environment's reply, until the agent says done or a budget runs out. The environment's
    tokens are part of the response (the model reads them) but carry no policy or value loss.
    The environment is either a hook (`function`) or declared `tools`."""

    function: str | None = Field(None, min_length=1)
    """`module:function` called as `fn(prompt, label, turns)` after each model turn (`turns`:
    the model's turns so far, decoded), in a child process with a timeout, returning a dict
    with `observation` (text, or None) and `done` (a bool); or `builtin:<agent>`
    (`builtin:calculator`). A crash, timeout or malformed reply becomes the observation text,
    never a failed run. Set this or tools."""

    tools: list[ToolSpec] = Field(default_factory=list, max_length=64)
    """Tools called through the model's own chat template (set this or function; needs a
    tokenizer with a chat template): the prompt is rendered with `tools=`; each model turn's
    `<tool_call>{"name": ..., "arguments": {...}}</tool_call>` blocks (or a turn that is one
    such JSON object) are run and answered as `role: tool` messages rendered by the template; a
    turn without a call ends the conversation. Malformed JSON, an unknown tool or wrong
    arguments are answered with an error message, never a failed run."""

    max_turns: int = Field(4, ge=1, le=64)
    """Most model turns per conversation."""

    max_tool_response_tokens: int = Field(64, ge=1, le=1_048_576)
    """An observation is cut to this many tokens (maxResponseLength bounds the whole
    response, model and environment tokens together)."""

    tool_timeout_seconds: float = Field(10.0, gt=0, le=3600)
    """Wall-clock limit of one environment call (its child process is killed after it; CPU
    time is limited to the same, address space to the trainer's plus 1 GiB)."""


class DataSpec(ApiModel):
    """Prompts, reward and sampling."""

    prompts: str = Field("builtin:count-up", min_length=1)
    """Prompt dataset: a `.jsonl`, `.json` (a list of objects) or `.parquet` file, a directory
    written by `datasets`' `save_to_disk` (a DatasetDict's `train` split is used), all as paths
    the trainer's pods can read, or `builtin:<task>` (`builtin:count-up`, `builtin:reverse`,
    `builtin:calculator`)."""

    prompt_key: str = Field("prompt", min_length=1)
    """Column holding the prompt text in a dataset file."""

    label_key: str = Field("label", min_length=1)
    """Column holding the reference answer passed to the reward function (may be absent)."""

    reward_function: str | None = Field(None, min_length=1)
    """`module:function` scoring each completion, or `builtin:<task>`. Defaults to the built-in
    task's reward. The shorthand of `rewards: [{function: ...}]`; set one or the other."""

    rewards: list[RewardSource] = Field(default_factory=list, max_length=16)
    """Reward sources combined with weights: reward = sum of weight x source reward. Each is a
    `function`, a reward `model`, an `http` endpoint or a generative `judge`; each step reports
    every source's mean as `reward/<name>_mean`. Empty: rewardFunction (or the built-in task's
    reward)."""

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

    agent: AgentSpec | None = None
    """Multi-turn rollouts driven by an agent hook (tool calls and their results). Unset: one
    model turn per sample. The reward function scores the model's last turn."""

    @property
    def samples_per_step(self) -> int:
        return self.rollout_batch_size * self.samples_per_prompt


# ---------------------------------------------------------------------------------------------
# Training
# ---------------------------------------------------------------------------------------------
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
class SecretRef(ApiModel):
    """A reference to a Secret in the job's namespace."""

    name: str = Field(min_length=1)
    """Secret name."""


class TensorBoardTracker(ApiModel):
    """TensorBoard event files."""

    type: Literal["tensorboard"]
    """The tracker: `tensorboard` (TensorBoard event files), `mlflow` (an MLflow tracking server
    or store) or `wandb` (Weights & Biases); the other fields depend on it. All need the
    `trackers` extra (`pip install 'ppojob[trackers]'`)."""

    log_dir: str = Field("tensorboard", min_length=1)
    """TensorBoard: directory of the event files. A relative path is inside the run's output
    directory (`<checkpointDir>/output` on spec.checkpointVolume)."""


class MlflowTracker(ApiModel):
    """An MLflow run: every step's metrics, the resolved config as parameters, the reward curve
    and metrics.jsonl as artifacts (MLflow's client, `mlflow-skinny`, in the `trackers`
    extra)."""

    type: Literal["mlflow"]
    """The tracker: `tensorboard` (TensorBoard event files), `mlflow` (an MLflow tracking server
    or store) or `wandb` (Weights & Biases); the other fields depend on it. All need the
    `trackers` extra (`pip install 'ppojob[trackers]'`)."""

    tracking_uri: str = Field(min_length=1)
    """MLflow: where runs are recorded: `http(s)://host:port` of a tracking server,
    `databricks`, or a store URI such as `file:/path` (MLflow's MLFLOW_TRACKING_URI)."""

    experiment_name: str | None = Field(None, min_length=1, max_length=500)
    """MLflow: the experiment of the run (created when missing). Unset: the PPOJob's name."""

    run_name: str | None = Field(None, min_length=1, max_length=128)
    """MLflow, W&B: the run's name. Unset: the PPOJob's name."""

    secret_ref: SecretRef | None = None
    """MLflow, W&B: the tracker's credentials, a Secret whose every key becomes an environment
    variable of the trainer's head pod (mlflow: MLFLOW_TRACKING_TOKEN, or
    MLFLOW_TRACKING_USERNAME and MLFLOW_TRACKING_PASSWORD; wandb: WANDB_API_KEY, and
    WANDB_BASE_URL for a self-hosted server). `ppojob run` reads them from its own
    environment."""


class WandbTracker(ApiModel):
    """A Weights & Biases run: every step's metrics, the resolved config, the reward curve and
    metrics.jsonl as an artifact (`wandb`, in the `trackers` extra)."""

    type: Literal["wandb"]
    """The tracker: `tensorboard` (TensorBoard event files), `mlflow` (an MLflow tracking server
    or store) or `wandb` (Weights & Biases); the other fields depend on it. All need the
    `trackers` extra (`pip install 'ppojob[trackers]'`)."""

    project: str = Field(min_length=1, max_length=128)
    """W&B: the project (created when missing)."""

    entity: str | None = Field(None, min_length=1)
    """W&B: the user or team owning the project. Unset: the API key's default entity."""

    run_name: str | None = Field(None, min_length=1, max_length=128)
    """MLflow, W&B: the run's name. Unset: the PPOJob's name."""

    mode: Literal["online", "offline"] = "online"
    """W&B: `online` sends to the W&B server (WANDB_BASE_URL, default api.wandb.ai); `offline`
    writes the run under `dir` only, to upload later with `wandb sync`."""

    dir: str = Field("wandb", min_length=1)
    """W&B: directory of the run's files. A relative path is inside the run's output
    directory."""

    secret_ref: SecretRef | None = None
    """MLflow, W&B: the tracker's credentials, a Secret whose every key becomes an environment
    variable of the trainer's head pod (mlflow: MLFLOW_TRACKING_TOKEN, or
    MLFLOW_TRACKING_USERNAME and MLFLOW_TRACKING_PASSWORD; wandb: WANDB_API_KEY, and
    WANDB_BASE_URL for a self-hosted server). `ppojob run` reads them from its own
    environment."""


TrackerSpec = Annotated[
    TensorBoardTracker | MlflowTracker | WandbTracker, Field(discriminator="type")
]
"""An experiment tracker the trainer logs to, besides metrics.jsonl and the PPOJob status."""
TRACKER_TYPES = ("tensorboard", "mlflow", "wandb")


class TrainingHalf(ApiModel):
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

    trackers: list[TrackerSpec] = Field(default_factory=list)
    """Experiment trackers (`type`: tensorboard, mlflow or wandb): every step's metrics under
    the names of metrics.jsonl, the resolved config at the start. Credentials come from a
    Secret (secretRef), never from the PPOJob. A tracker that cannot be reached or written is a
    warning, never a failed run."""


class TrainerConfig(TrainingHalf):
    """What the trainer runs: the training half plus the few cluster facts it needs."""

    placement_timeout_seconds: int = Field(600, ge=1)
    """How long to wait for the placement group before failing (spec.scheduling.timeoutSeconds)."""

    job_name: str | None = None
    """Name of the PPOJob, for logs and progress reports."""

    stall_timeout_seconds: int | None = Field(None, ge=1)
    """Fail a step whose workers have not all reported within this many seconds, naming each
    role, rank and phase still pending (spec.failurePolicy.stallTimeoutSeconds). None: wait."""

    def critic_training(self) -> TrainingSettings:
        """The critic's training settings: the actor's, with the critic overrides on top."""
        from ppojob_api.overrides import apply_critic_overrides  # it builds on this module

        critic = self.roles.effective_critic(self.algorithm.needs_critic)
        overrides = critic.overrides if critic else {}
        return apply_critic_overrides(self.training, overrides)


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
