"""The training half of a PPOJob: the roles (`spec.roles`): actor, critic, rollout, reward and
sandbox workers, their resources, parallelism and backends."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import Field

from ppojob_api.base import ApiModel
from ppojob_api.quantity import CpuQuantity, MemoryQuantity


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

    gpu_memory: MemoryQuantity | None = None
    """Memory of one of the role's GPUs (e.g. `141Gi`), for the memory plan that `ppojob
    validate` and the operator check before any pod starts. Unset: the size a GPU product label
    in the role's `nodeSelector` names (`...-80GB`), else 80 GB is assumed. The trainer plans
    again at start with the GPU it got."""

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

    expert: int = Field(1, ge=1, le=1024)
    """Expert-parallel size (megatron backend, mixture-of-experts models): each MoE layer's
    experts are split over `expert` of the role's data-parallel ranks (megatron-core's
    `expert_model_parallel_size`; the experts keep the role's tensor parallelism). It must
    divide the data-parallel size and the model's number of experts; dense weights stay
    replicated over all data-parallel ranks."""

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


RELEASING_BACKENDS = frozenset({"sglang"})
"""Rollout backends whose engines free memory when released (SGLang's memory saver). The torch
engine keeps its weights and holds no KV cache between generations: for it ``offload`` changes
nothing, so no release or wake is sent to it (:attr:`RolloutRole.releases_memory`)."""


class RolloutRole(_Role):
    """The generation engines."""

    backend: Literal["torch", "sglang"] = "torch"
    """Generation backend: `torch` (Hugging Face generate with KV cache) or `sglang` (GPU)."""

    colocate_with_actor: bool = False
    """Run the engines on the actor's GPUs, time-shared with training, instead of their own pods.
    A colocated rollout takes its worker count from the actor."""

    offload: bool = True
    """With colocateWithActor: sglang engines release their weights and KV cache while the actor
    trains and take them back for the weight sync. The torch engine keeps its copy of the
    weights (the memory plan counts it as held throughout) and holds no KV cache between
    generations: for it the setting changes nothing (the driver sends it no release or resume)."""

    gpu_memory_fraction: float | None = Field(None, gt=0, le=1)
    """Fraction of GPU memory an sglang engine may use for weights and KV cache. Unset: an engine
    colocated with the actor gets the memory plan's (what the actor's weights, gradients,
    optimizer moments and kept activations leave after a training step, less 2 GiB of headroom,
    at most 0.85), an engine on its own GPUs 0.85. A colocated value the plan says cannot wake
    after a training step is refused (`ppojob validate --plan` prints the plan)."""

    weight_sync_bucket_mb: float = Field(512.0, gt=0, le=65536)
    """Weight sync moves the actor's weights to the engines in buckets of at most this many
    MiB (a larger tensor goes alone): the extra memory a sync needs on each side."""

    elastic: ElasticRollout | None = None
    """Elastic engines (their own pods, torch backend): `replicas` engines start, between
    minReplicas and maxReplicas, and more join up to maxReplicas when there is room; the gang
    holds minReplicas of them. An engine lost mid-step does not fail the step. Unset: every
    engine is part of the gang and losing one fails the step."""

    @property
    def releases_memory(self) -> bool:
        """The engines release their memory while the actor trains and wake it for the weight
        sync: colocated, ``offload`` on, and a backend of :data:`RELEASING_BACKENDS`."""
        return self.colocate_with_actor and self.offload and self.backend in RELEASING_BACKENDS


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
