"""The PPOJob API (`ppojob.io/v1alpha1`), defined once as typed models.

The CRD's schema (`crd.py`), the operator's validation, the docs' reference and the trainer's config
all come from these models. The training half of the spec is the trainer's own config model
(`ppojob_api.training.TrainingHalf`); this module adds the cluster half and the status.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import Field

from ppojob_api.base import ApiModel
from ppojob_api.quantity import CpuQuantity, MemoryQuantity
from ppojob_api.training import ModelSpec, SecretRef, Toleration, TrainingHalf

RAY_VERSION = "2.60.0"
"""The Ray release in the trainer image: the one source of truth. `constraints.txt` pins
`ray==RAY_VERSION`, the trainer image installs with it, and `spec.rayVersion` defaults to it (a test
checks all three agree)."""

GROUP = "ppojob.io"
VERSION = "v1alpha1"
API_VERSION = f"{GROUP}/{VERSION}"
KIND = "PPOJob"
PLURAL = "ppojobs"
SINGULAR = "ppojob"
SHORT_NAMES = ["ppo"]

PHASES = ("Pending", "Initializing", "Running", "Succeeded", "Failed", "Suspended", "Invalid")


class Topology(ApiModel):
    """Kueue Topology-Aware Scheduling: how close together each group of the job's pods must
    run. The cluster describes its topology to Kueue (a Topology object listing node labels
    from the widest domain to the node, and a ResourceFlavor whose topologyName names it);
    the job names one of those labels."""

    level: str = Field(min_length=1, max_length=317)
    """The node label of the domain each worker group (actor, critic, rollout, ...) is placed
    in, one of the Topology's levels (e.g. `cloud.provider.com/topology-rack`, or
    `kubernetes.io/hostname` for one node). Each group gets one domain of this level, chosen
    group by group (two groups may share one or not). A level the ClusterQueue's flavor's
    Topology does not list, or a flavor without a topology, keeps the job queued with
    Kueue's reason on its Workload (`queueTimeoutSeconds` bounds that)."""

    mode: Literal["required", "preferred"] = "required"
    """`required` (Kueue's `podset-required-topology`): the job is admitted only when every
    worker group fits in one domain of the level; until then it waits. `preferred` (its
    `podset-preferred-topology`): Kueue tries the level, then each wider one, and a group that
    fits in no single domain is admitted spread over several."""


class Scheduling(ApiModel):
    """Gang scheduling: all pods of the job (head and every worker) start together or not at all."""

    gang_scheduler: (
        Literal["volcano", "yunikorn", "kueue", "scheduler-plugins", "kai", "none"] | None
    ) = None
    """Which gang scheduler admits the job. Unset: the operator's default (its
    `--gang-scheduler` flag, chart value `defaultGangScheduler`; `none` when that is unset).
    KubeRay must be configured for it (see the gang-scheduling guide); `none` relies on the
    default scheduler (no all-or-nothing guarantee)."""

    queue: str | None = Field(None, min_length=1)
    """Queue of the gang scheduler (Volcano queue, YuniKorn queue, Kueue LocalQueue, KAI Queue).
    Required for kueue, where it names a LocalQueue in the job's namespace (lower case, e.g.
    `team-a`), and for kai (the KAI Queue; KubeRay copies it onto every pod)."""

    priority_class_name: str | None = Field(None, min_length=1)
    """PriorityClass of the job's pods (with every gang scheduler, `none` included). Under
    kueue without `workloadPriorityClass`, Kueue also takes the Workload's priority from it."""

    workload_priority_class: str | None = Field(None, min_length=1, max_length=253)
    """kueue only: the Kueue WorkloadPriorityClass of the job's Workload (the label
    `kueue.x-k8s.io/priority-class` on its RayJob): its order in the queue and for Kueue's
    preemption, apart from the pods' own PriorityClass (`priorityClassName`, which the kubelet
    and kube-scheduler use). Unset: Kueue takes the pods' PriorityClass."""

    topology: Topology | None = None
    """kueue only: Topology-Aware Scheduling of each worker group (Kueue's
    podset-required-topology or podset-preferred-topology annotation on the worker groups'
    pod templates; the head is one pod and gets none). Unset: no request of the job's own
    (Kueue still places pods by topology in a ClusterQueue whose flavors all have one)."""

    timeout_seconds: int = Field(600, ge=1, le=604800)
    """How long the job may wait for all its resources: YuniKorn's placeholder timeout, and the
    trainer's wait for every role's pods to join and for its placement group."""

    queue_timeout_seconds: int | None = Field(None, ge=1, le=2592000)
    """Bound on queueing: an attempt that has not started running this many seconds after its
    RayJob was created (waiting for admission, for nodes, for its pods) fails with reason
    `QueueTimeout`, naming what it waited for and the scheduler's own message for a pod that
    could not be placed, and its RayJob is deleted (nothing stays held). Unset: wait as long as
    it takes."""

    permit_timeout_seconds: int = Field(60, ge=1, le=604800)
    """scheduler-plugins: how long the pods of a partly placed gang hold their nodes at the
    Coscheduling plugin's Permit stage before they are released and the whole gang retries (the
    PodGroup's scheduleTimeoutSeconds; the plugin's own default is 60). Keep it short: while it
    runs, one pod that cannot fit keeps the others' GPUs from every other job. The smaller of
    this and timeoutSeconds applies."""


class PVCSource(ApiModel):
    """A PersistentVolumeClaim to mount."""

    claim_name: str = Field(min_length=1)
    """Name of the PersistentVolumeClaim in the job's namespace."""


class NFSSource(ApiModel):
    """An NFS export to mount."""

    server: str = Field(min_length=1)
    """NFS server host name or address."""

    path: str = Field(min_length=1)
    """Exported path."""


class CheckpointVolume(ApiModel):
    """A volume mounted at spec.training.checkpointDir in every trainer pod, so checkpoints
    survive pod restarts, RayJob retries and suspend/resume. Set exactly one source."""

    persistent_volume_claim: PVCSource | None = None
    """Mount this PersistentVolumeClaim (ReadWriteMany when pods span nodes)."""

    nfs: NFSSource | None = None
    """Mount this NFS export."""


class FailurePolicy(ApiModel):
    """What a failed attempt leads to, by its class (in the spirit of JobSet's failurePolicy and
    PyTorchJob's ExitCode restart policy; see the troubleshooting guide's failure classes).

    A disruption (the trainer's Preempted exit after a SIGTERM, an evicted or deleted pod, a lost
    node, the Ray head pod gone) restarts the job from the newest checkpoint without counting
    against spec.backoffLimit. An application error (the reward function raised, a worker was
    OOMKilled) counts one retry of spec.backoffLimit, or fails at once. A refused config fails at
    once. Each restart is a `Restarted` condition and an event naming its cause."""

    max_disruptions: int = Field(10, ge=0, le=1000)
    """Restarts after disruptions before the job fails (they do not count against
    spec.backoffLimit). 0: a disruption fails the job."""

    on_application_error: Literal["Restart", "Fail"] = "Restart"
    """`Restart`: an application error is retried while spec.backoffLimit allows. `Fail`: it
    fails the job at once."""

    retry_delay_seconds: int = Field(30, ge=0, le=3600)
    """Seconds to wait before retrying after an application error (disruptions restart at
    once)."""

    stall_timeout_seconds: int = Field(1800, ge=0, le=604800)
    """Stall watchdog: every blocking wait of the trainer's driver (a step's phases: generate,
    values, prepare, train, wake, weight sync; the reward-worker ping before a step, memory
    release, checkpoint save, resume, start-up) that has not seen all its workers report within
    the stall limit ends the attempt with reason `Stalled`, naming each role, rank and phase
    that did not report; a hung collective costs this long, not forever. The limit is the larger
    of this value (a floor) and 3 times the slowest step measured so far, so long steps are not
    cut short. The attempt is then restarted like a disruption (or failed: onStall). 0: off."""

    on_stall: Literal["Restart", "Fail"] = "Restart"
    """What a stalled attempt leads to: `Restart` (from the newest checkpoint, counted as a
    disruption) or `Fail`."""

    pod_disruption_budget: bool = True
    """Create a PodDisruptionBudget over the job's pods (`minAvailable`: every pod the job can
    have; a RayCluster has no scale subresource, so `maxUnavailable` would never sync): an
    eviction through the Eviction API (a node drain, Karpenter consolidation, the cluster
    autoscaler) is refused (HTTP 429) instead of killing one pod of the gang, which would end
    the attempt. A drain then waits for the job to finish (or for someone to delete the pods:
    the trainer answers that with a checkpoint). Scheduler preemption, suspend and deletion are
    not evictions."""

    termination_grace_period_seconds: int = Field(120, ge=1, le=86400)
    """Grace period of the job's pods (their `terminationGracePeriodSeconds`). On SIGTERM the
    trainer finishes the step in flight, writes a checkpoint and exits `Preempted` (code 75)
    within it. A step that cannot finish in time is abandoned: before its training starts, with
    a checkpoint of the completed steps; once training started, the newest checkpoint stands.
    So it must cover a step's training plus a checkpoint: the trainer checkpoints the first
    step of each attempt to time one (whatever `checkpointInterval`) and reports when it does
    not."""


class KeyRef(ApiModel):
    """One key of a Secret or ConfigMap in the job's namespace."""

    name: str = Field(min_length=1)
    """Name of the Secret or ConfigMap."""

    key: str = Field(min_length=1)
    """The key whose value the variable takes."""


class EnvValueFrom(ApiModel):
    """Where a variable's value comes from: set exactly one."""

    secret_key_ref: KeyRef | None = None
    """A key of a Secret (the value never appears in the PPOJob)."""

    config_map_key_ref: KeyRef | None = None
    """A key of a ConfigMap."""


class EnvFromRef(ApiModel):
    """A Secret or ConfigMap whose every key becomes a variable: set exactly one."""

    secret_ref: SecretRef | None = None
    """All keys of this Secret."""

    config_map_ref: SecretRef | None = None
    """All keys of this ConfigMap (`name`)."""

    prefix: str | None = Field(None, min_length=1)
    """Prefix of every variable name."""


class EnvFromSourceVar(ApiModel):
    """A variable whose value is read from a Secret or ConfigMap key."""

    name: str = Field(min_length=1, pattern=r"^[-._a-zA-Z][-._a-zA-Z0-9]*$")
    """Variable name."""

    value_from: EnvValueFrom
    """The Secret or ConfigMap key."""


class VolumeMount(ApiModel):
    """Where a volume of spec.podTemplate.volumes appears in the containers."""

    name: str = Field(min_length=1)
    """Name of a volume in spec.podTemplate.volumes."""

    mount_path: str = Field(min_length=1)
    """Absolute path in the container."""

    read_only: bool = False
    """Mount read-only."""

    sub_path: str | None = Field(None, min_length=1)
    """A path inside the volume to mount instead of its root."""


class PodTemplate(ApiModel):
    """Additions to every pod of the job (head and workers), checked and shown by
    `ppojob render`: what the spec has no field of its own for."""

    labels: dict[str, str] = Field(default_factory=dict)
    """Labels added to every pod (the operator's own labels and the gang scheduler's cannot be
    overridden)."""

    annotations: dict[str, str] = Field(default_factory=dict)
    """Annotations added to every pod, e.g. `karpenter.sh/do-not-disrupt: "true"` or
    `cluster-autoscaler.kubernetes.io/safe-to-evict: "false"`."""

    env: list[EnvFromSourceVar] = Field(default_factory=list)
    """Variables read from Secret or ConfigMap keys (a token stays out of the PPOJob)."""

    env_from: list[EnvFromRef] = Field(default_factory=list)
    """Secrets and ConfigMaps whose every key becomes a variable."""

    volumes: list[dict[str, Any]] = Field(
        default_factory=list,
        json_schema_extra={
            "items": {"type": "object", "x-kubernetes-preserve-unknown-fields": True}
        },
    )
    """Extra Kubernetes volumes (each a `Volume` as in a pod spec, with a unique `name` and one
    source); `ppojob validate` checks every level of each by Kubernetes' Volume schema."""

    volume_mounts: list[VolumeMount] = Field(default_factory=list)
    """Where the extra volumes appear in every trainer container."""


class HeadSpec(ApiModel):
    """Resources of the Ray head pod."""

    cpus: CpuQuantity = 2.0
    """CPU cores of the head pod: a number (`2`, `0.5`) or a Kubernetes quantity (`"500m"`)."""

    memory: MemoryQuantity = "8Gi"
    """Memory of the head pod, as a Kubernetes quantity such as `8Gi`; a bare number is
    bytes, as in a pod."""

    node_selector: dict[str, str] = Field(default_factory=dict)
    """Node labels the head pod must match."""

    tolerations: list[Toleration] = Field(default_factory=list)
    """Tolerations of the head pod (on a cluster whose every node is tainted, the head needs
    them too)."""

    affinity: dict[str, Any] = Field(
        default_factory=dict, json_schema_extra={"x-kubernetes-preserve-unknown-fields": True}
    )
    """A Kubernetes `affinity` (nodeAffinity, podAffinity, podAntiAffinity) for the head pod,
    copied into its pod spec as written; `ppojob validate` checks it at every level by the API
    server's rules (field names, selector operators and values, weights, topology keys)."""


class JobModelSpec(ModelSpec):
    """The policy (actor) and value (critic) models. A PPOJob names its model: there is no
    default (a job that forgot it would train a built-in tiny model and report Succeeded)."""

    path: str = Field(min_length=1)
    """Required. The actor (and reference) model: a Hugging Face model directory in the trainer
    image or a volume (absolute, or relative to the working directory), a Hugging Face hub id
    such as `Qwen/Qwen2.5-7B-Instruct` (downloaded through huggingface_hub into its cache,
    HF_HOME; offline with HF_HUB_OFFLINE=1), or `builtin:<name>` for the tiny randomly
    initialised CPU models (`builtin:tiny-llama`, `builtin:tiny-qwen2`, `builtin:small-llama`,
    and the mixture-of-experts `builtin:tiny-qwen3-moe` and `builtin:tiny-mixtral`). An
    existing directory wins over a hub id of the same name."""


class PPOJobSpec(TrainingHalf):
    """Desired state of a PPOJob: the cluster half (image, scheduling, lifecycle) and the training
    half (model, roles, algorithm, data, training)."""

    model: JobModelSpec
    """Models of the actor and critic; `path` is required."""

    image: str = Field(min_length=1)
    """Trainer container image (torch, ray, megatron-core, sglang and the ppojob trainer)."""

    image_pull_policy: Literal["Always", "IfNotPresent", "Never"] = "IfNotPresent"
    """Pull policy of the trainer image."""

    image_pull_secrets: list[SecretRef] = Field(default_factory=list)
    """Secrets for pulling the trainer image."""

    head: HeadSpec = Field(default_factory=HeadSpec)
    """The Ray head pod, which runs the PPO driver (no GPUs)."""

    scheduling: Scheduling = Field(default_factory=Scheduling)
    """Gang scheduling settings."""

    checkpoint_volume: CheckpointVolume | None = None
    """Volume mounted at spec.training.checkpointDir in every trainer pod."""

    pod_template: PodTemplate = Field(default_factory=PodTemplate)
    """Labels, annotations, variables from Secrets and ConfigMaps, and extra volumes for every
    pod of the job."""

    submission_mode: Literal["SidecarMode", "K8sJobMode"] = "SidecarMode"
    """How KubeRay submits the trainer: `SidecarMode` (a container in the head pod, inside the
    gang; KubeRay >= 1.5.0: older releases accept the field and never submit, and the operator
    refuses such a job) or `K8sJobMode` (a separate submitter pod outside the gang; any
    KubeRay)."""

    suspend: bool = False
    """Suspend the job: its pods are deleted; setting it back to false starts it again (resuming
    from the newest checkpoint)."""

    active_deadline_seconds: int | None = Field(None, ge=1)
    """Fail the job if one attempt runs longer than this many seconds. KubeRay counts from the
    start of each attempt (it resets the RayJob's startTime for every retry and every resume), so
    with retries the whole job can run up to (backoffLimit + 1) times this."""

    backoff_limit: int = Field(0, ge=0, le=100)
    """Retries of a run failed by an application error (disruptions are not counted: see
    spec.failurePolicy). Each retry creates a new Ray cluster and resumes from the newest
    checkpoint."""

    failure_policy: FailurePolicy = Field(default_factory=FailurePolicy)
    """Restarts by failure class (disruption, application error), their delay, and the pods'
    grace period for a checkpoint on SIGTERM."""

    ttl_seconds_after_finished: int = Field(60, ge=0)
    """Seconds after the job finishes before its Ray cluster (every pod, every GPU) is deleted.
    The final progress stays in the PPOJob's status; checkpoints and the trainer's output stay on
    the checkpoint volume. Raise it to keep the pods (and their GPUs) for debugging."""

    ray_version: str = Field(RAY_VERSION, min_length=1)
    """Ray version inside the trainer image (KubeRay uses it for compatibility). The default is
    the Ray of the ppojob trainer image; set it only for an image with another Ray."""


class Condition(ApiModel):
    """A standard Kubernetes condition."""

    type: str
    """Condition type: Valid, SpecApplied, Running, Succeeded, Failed, Suspended."""

    status: Literal["True", "False", "Unknown"]
    """Whether the condition holds."""

    reason: str = Field(
        min_length=1, max_length=1024, pattern=r"^[A-Za-z]$|^[A-Za-z][A-Za-z0-9_,:]*[A-Za-z0-9_]$"
    )
    """CamelCase reason (see the troubleshooting guide); never empty (metav1.Condition)."""

    message: str = Field("", max_length=32768)
    """Human-readable detail."""

    last_transition_time: str = Field(json_schema_extra={"format": "date-time"})
    """When the status last changed (RFC 3339)."""

    observed_generation: int | None = None
    """The spec generation this condition was computed from."""


class CheckpointRecord(ApiModel):
    """A complete checkpoint the trainer keeps."""

    step: int = Field(ge=0)
    """Training step the checkpoint was taken after."""

    path: str = Field(min_length=1)
    """Its directory as the trainer's pods see it (on spec.checkpointVolume when set)."""


class Progress(ApiModel):
    """Live training progress, written by the trainer."""

    step: int | None = None
    """Last completed training step."""

    total_steps: int | None = None
    """Steps the job will run."""

    reward_mean: float | None = None
    """Mean reward of the last step's samples."""

    kl: float | None = None
    """Mean KL to the reference policy in the last step."""

    value_loss: float | None = None
    """Critic loss of the last step."""

    tokens_per_second: float | None = None
    """Throughput of the last step (generated tokens per second)."""

    eval_reward_mean: float | None = None
    """Mean reward of the last evaluation on spec.data.evalPrompts (greedy decoding)."""

    step_seconds: float | None = None
    """Wall time of the last step."""

    phase_seconds: dict[str, float] | None = None
    """Wall time of the last step's phases, by phase: `generate`, `prepare` (rewards and
    reference log-probs), `values`, `trainCritic`, `trainActor`, `weightSync` (those the step
    ran)."""

    logprob_diff_mean: float | None = None
    """Mean absolute difference between the rollout engine's and the actor's log-probs of the
    last step's tokens (rollout/logprob_diff_mean)."""

    logprob_diff_max: float | None = None
    """Largest such difference in the last step (rollout/logprob_diff_max)."""

    entropy: float | None = None
    """Mean entropy of the policy over the last step's response tokens (actor/entropy)."""

    weight_version: int | None = Field(None, ge=0)
    """Policy version the generation engines hold: each weight sync numbers the weights it
    sends, and the engines report the number they loaded (0: the initial weights)."""

    rollout_version: int | None = Field(None, ge=0)
    """Oldest policy version the last step's samples were generated with, as the engines
    reported it with their samples."""

    staleness_mean: float | None = Field(None, ge=0)
    """Mean age, in policy versions, of the last step's trained tokens (0 on-policy;
    spec.algorithm.maxStaleness bounds it) (staleness/mean)."""

    staleness_max: float | None = Field(None, ge=0)
    """Largest such age in the last step (staleness/max)."""

    checkpoints: list[CheckpointRecord] | None = None
    """The complete checkpoints the trainer keeps (spec.training.keepCheckpoints), oldest
    first; a restart resumes from the newest."""

    updated_at: str | None = None
    """When the trainer wrote this (RFC 3339)."""

    error: str | None = None
    """Why the trainer failed, when it did: one line naming the field and the cause (also the
    message of the Failed condition)."""

    warning: str | None = None
    """A problem the trainer found that does not stop it, as `<Reason>: <one line naming the
    field and the fix>` (e.g. `GracePeriodTooShort`: the pods' grace period is shorter than a
    step and a checkpoint as measured); the operator posts it as a Warning event."""


class RestartRecord(ApiModel):
    """The last restart the operator made, and why."""

    failure_class: Literal["Disruption", "Application", "Permanent"]
    """Class of the failure that caused it (see spec.failurePolicy)."""

    reason: str = Field(min_length=1)
    """CamelCase reason: RestartingAfterDisruption or RestartingAfterError."""

    message: str = ""
    """The cause, as the trainer or KubeRay gave it."""

    time: str | None = None
    """When the operator decided to restart (RFC 3339)."""

    attempt: int = Field(0, ge=0)
    """Number of the failed attempt (its RayJob's `ppojob.io/attempt` annotation; the first is
    0). The operator deletes that RayJob and creates the next attempt's."""

    recreated: bool = False
    """Whether the new RayJob exists yet."""


class ProcessMemory(ApiModel):
    """One GPU process of the memory plan."""

    name: str
    """The process: actor (with what is colocated on its GPUs), critic, rollout or reward."""

    peak_gib: float = Field(alias="peakGiB")
    """Its planned peak per GPU, GiB."""

    peak_phase: str | None = None
    """The phase of that peak (actor update, generation, ...)."""


class MemoryPlanStatus(ApiModel):
    """The job's per-GPU memory plan as the operator computed it (`ppojob validate --plan`
    prints it by part): an estimate from the model's shape and the spec, not a measurement."""

    gpu_gib: float | None = Field(None, alias="gpuGiB")
    """GPU memory assumed per GPU, GiB (the node selector's GPU product label, else 80 GB)."""

    peak_gib: float | None = Field(None, alias="peakGiB")
    """The largest planned peak of any GPU process, GiB (unset: no plan here)."""

    processes: list[ProcessMemory] = Field(default_factory=list)
    """Each GPU process's peak."""

    engine_fraction: float | None = None
    """The sglang engine's gpuMemoryFraction (colocated and unset: sized by the plan)."""

    engine_fraction_source: Literal["spec", "auto", "default"] | None = None
    """Where the fraction comes from: as written, sized by the plan, or the default (0.85) of an
    engine on its own GPUs."""

    message: str | None = None
    """The verdict in one line, or why there is no plan (a model whose shape only the trainer
    can read is planned by the trainer at start)."""


class PPOJobStatus(ApiModel):
    """Observed state of a PPOJob."""

    phase: (
        Literal["Pending", "Initializing", "Running", "Succeeded", "Failed", "Suspended", "Invalid"]
        | None
    ) = None
    """Pending, Initializing, Running, Succeeded, Failed, Suspended or Invalid."""

    conditions: list[Condition] = Field(
        default_factory=list,
        json_schema_extra={
            "x-kubernetes-list-type": "map",
            "x-kubernetes-list-map-keys": ["type"],
        },
    )
    """Conditions with reasons and messages (metav1.Condition, one per type)."""

    reason: str | None = None
    """CamelCase reason of the current phase (the `Reason` column of `kubectl get ppojobs`)."""

    observed_generation: int | None = None
    """The spec generation the operator last acted on."""

    ray_job_name: str | None = None
    """Name of the RayJob running this job."""

    ray_cluster_name: str | None = None
    """Name of the current RayCluster (a new one per retry)."""

    dashboard_url: str | None = Field(None, alias="dashboardURL")
    """Ray dashboard address of the running cluster."""

    gpus: int | None = None
    """GPUs requested by all the job's pods together."""

    memory_plan: MemoryPlanStatus | None = None
    """The per-GPU memory plan: each GPU process's peak and the sglang engine's memory
    fraction."""

    start_time: str | None = None
    """When the job started running (RFC 3339)."""

    completion_time: str | None = None
    """When the job finished (RFC 3339)."""

    progress: Progress | None = None
    """Live training progress written by the trainer."""

    restarts: int | None = None
    """Restarts after application errors (counted against spec.backoffLimit)."""

    disruptions: int | None = None
    """Restarts after disruptions (not counted; bounded by spec.failurePolicy.maxDisruptions)."""

    last_restart: RestartRecord | None = None
    """The last restart and its cause."""


class ObjectMeta(ApiModel):
    """The subset of metadata the API reads."""

    model_config = ApiModel.model_config | {"extra": "allow"}

    name: str | None = None
    namespace: str | None = None


class PPOJob(ApiModel):
    """PPO training of a language model on Ray, gang-scheduled all-or-nothing."""

    api_version: Literal["ppojob.io/v1alpha1"] = Field(API_VERSION, alias="apiVersion")
    kind: Literal["PPOJob"] = "PPOJob"
    metadata: ObjectMeta = Field(default_factory=ObjectMeta)
    spec: PPOJobSpec
    status: PPOJobStatus | None = None


def total_gpus(spec: PPOJobSpec) -> int:
    """GPUs all the job's pods request (colocated roles have no pods of their own)."""
    roles = spec.roles
    total = roles.actor.total_gpus()
    critic = roles.effective_critic(spec.algorithm.needs_critic)
    if critic is not None and not critic.colocate_with_actor:
        total += critic.total_gpus()
    if not roles.rollout.colocate_with_actor:
        total += roles.rollout.total_gpus()
    if roles.reward is not None:
        total += roles.reward.total_gpus()
    if roles.sandbox is not None:
        total += roles.sandbox.total_gpus()
    return total
