"""The PPOJob API (`ppojob.io/v1alpha1`), defined once as typed models.

The CRD's schema (`crd.py`), the operator's validation, the docs' reference and the trainer's config
all come from these models. The training half of the spec is the trainer's own config model
(`ppojob_trainer.config.TrainingHalf`, importable without torch or Ray); this module adds the
cluster half and the status.
"""

from __future__ import annotations

import functools
import re
from typing import Any, Literal

from ppojob_trainer.config import (
    Problem,
    SpecError,
    Toleration,
    TrainerConfig,
    TrainingHalf,
    _Model,
    check_training_half,
    load_yaml_documents,
    pydantic_problems,
)
from pydantic import Field

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


class Scheduling(_Model):
    """Gang scheduling: all pods of the job (head and every worker) start together or not at all."""

    gang_scheduler: Literal["volcano", "yunikorn", "kueue", "scheduler-plugins", "none"] | None = (
        None
    )
    """Which gang scheduler admits the job. Unset: the operator's default (its
    `--gang-scheduler` flag, chart value `defaultGangScheduler`; `none` when that is unset).
    KubeRay must be configured for it (see the gang-scheduling guide); `none` relies on the
    default scheduler (no all-or-nothing guarantee)."""

    queue: str | None = Field(None, min_length=1)
    """Queue of the gang scheduler (Volcano queue, YuniKorn queue, Kueue LocalQueue). Required
    for kueue, where it names a LocalQueue in the job's namespace (lower case, e.g. `team-a`)."""

    priority_class_name: str | None = Field(None, min_length=1)
    """PriorityClass of the job's pods (with every gang scheduler, `none` included)."""

    timeout_seconds: int = Field(600, ge=1, le=604800)
    """How long the job may wait for all its resources: the PodGroup's schedule timeout, YuniKorn's
    placeholder timeout, and the trainer's wait for every role's pods to join and for its
    placement group."""


class SecretRef(_Model):
    """A reference to a Secret in the job's namespace."""

    name: str = Field(min_length=1)
    """Secret name."""


class PVCSource(_Model):
    """A PersistentVolumeClaim to mount."""

    claim_name: str = Field(min_length=1)
    """Name of the PersistentVolumeClaim in the job's namespace."""


class NFSSource(_Model):
    """An NFS export to mount."""

    server: str = Field(min_length=1)
    """NFS server host name or address."""

    path: str = Field(min_length=1)
    """Exported path."""


class CheckpointVolume(_Model):
    """A volume mounted at spec.training.checkpointDir in every trainer pod, so checkpoints
    survive pod restarts, RayJob retries and suspend/resume. Set exactly one source."""

    persistent_volume_claim: PVCSource | None = None
    """Mount this PersistentVolumeClaim (ReadWriteMany when pods span nodes)."""

    nfs: NFSSource | None = None
    """Mount this NFS export."""


class HeadSpec(_Model):
    """Resources of the Ray head pod."""

    cpus: float = Field(2.0, gt=0)
    """CPU cores of the head pod."""

    memory: str = Field("8Gi", pattern=r"^[0-9]+(\.[0-9]+)?(Ki|Mi|Gi|Ti|Pi|Ei|k|M|G|T|P|E|m)?$")
    """Memory of the head pod, as a Kubernetes quantity."""

    node_selector: dict[str, str] = Field(default_factory=dict)
    """Node labels the head pod must match."""

    tolerations: list[Toleration] = Field(default_factory=list)
    """Tolerations of the head pod (on a cluster whose every node is tainted, the head needs
    them too)."""

    affinity: dict[str, Any] = Field(
        default_factory=dict, json_schema_extra={"x-kubernetes-preserve-unknown-fields": True}
    )
    """A Kubernetes `affinity` (nodeAffinity, podAffinity, podAntiAffinity) for the head pod,
    copied into its pod spec as written."""


class PPOJobSpec(TrainingHalf):
    """Desired state of a PPOJob: the cluster half (image, scheduling, lifecycle) and the training
    half (model, roles, algorithm, data, training)."""

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
    """Retries of a failed run. Each retry creates a new Ray cluster and resumes from the newest
    checkpoint."""

    ttl_seconds_after_finished: int = Field(60, ge=0)
    """Seconds after the job finishes before its Ray cluster (every pod, every GPU) is deleted.
    The final progress stays in the PPOJob's status; checkpoints and the trainer's output stay on
    the checkpoint volume. Raise it to keep the pods (and their GPUs) for debugging."""

    ray_version: str = Field(RAY_VERSION, min_length=1)
    """Ray version inside the trainer image (KubeRay uses it for compatibility). The default is
    the Ray of the ppojob trainer image; set it only for an image with another Ray."""


class Condition(_Model):
    """A standard Kubernetes condition."""

    type: str
    """Condition type: Valid, SpecApplied, Running, Succeeded, Failed, Suspended."""

    status: Literal["True", "False", "Unknown"]
    """Whether the condition holds."""

    reason: str = ""
    """CamelCase reason (see the troubleshooting guide)."""

    message: str = ""
    """Human-readable detail."""

    last_transition_time: str | None = None
    """When the status last changed (RFC 3339)."""

    observed_generation: int | None = None
    """The spec generation this condition was computed from."""


class Progress(_Model):
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

    updated_at: str | None = None
    """When the trainer wrote this (RFC 3339)."""

    error: str | None = None
    """Why the trainer failed, when it did: one line naming the field and the cause (also the
    message of the Failed condition)."""


class PPOJobStatus(_Model):
    """Observed state of a PPOJob."""

    phase: (
        Literal["Pending", "Initializing", "Running", "Succeeded", "Failed", "Suspended", "Invalid"]
        | None
    ) = None
    """Pending, Initializing, Running, Succeeded, Failed, Suspended or Invalid."""

    conditions: list[Condition] = Field(default_factory=list)
    """Conditions with reasons and messages."""

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

    start_time: str | None = None
    """When the job started running (RFC 3339)."""

    completion_time: str | None = None
    """When the job finished (RFC 3339)."""

    progress: Progress | None = None
    """Live training progress written by the trainer."""


class ObjectMeta(_Model):
    """The subset of metadata the API reads."""

    model_config = _Model.model_config | {"extra": "allow"}

    name: str | None = None
    namespace: str | None = None


class PPOJob(_Model):
    """PPO training of a language model on Ray, gang-scheduled all-or-nothing."""

    api_version: Literal["ppojob.io/v1alpha1"] = Field(API_VERSION, alias="apiVersion")
    kind: Literal["PPOJob"] = "PPOJob"
    metadata: ObjectMeta = Field(default_factory=ObjectMeta)
    spec: PPOJobSpec
    status: PPOJobStatus | None = None


# ---------------------------------------------------------------------------------------------
# Validation
# ---------------------------------------------------------------------------------------------
MAX_NAME_LENGTH = 47
"""KubeRay derives the RayCluster (name + 6 characters), its services and the PodGroup from the
RayJob's name, which is the PPOJob's; it refuses RayJob names longer than 47 characters."""
_DNS1035 = re.compile(r"^[a-z]([-a-z0-9]*[a-z0-9])?$")
_DNS1123_LABEL = re.compile(r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?$")
_LABEL_VALUE = re.compile(r"^(([A-Za-z0-9][-A-Za-z0-9_.]*)?[A-Za-z0-9])?$")
_DNS1123_SUBDOMAIN = re.compile(
    r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*$"
)
GENERATE_NAME_SUFFIX = 5  # characters the API server appends to metadata.generateName


def check_name(
    name: Any, field: str = "metadata.name", max_length: int = MAX_NAME_LENGTH
) -> list[Problem]:
    """Problems of a job name: a DNS-1035 label of at most `max_length` characters."""
    if not isinstance(name, str) or not name:
        return [
            Problem(field, "required field is missing", "add metadata.name, e.g. `name: my-job`")
        ]
    problems = []
    if len(name) > max_length:
        problems.append(
            Problem(
                field,
                f"is {len(name)} characters; at most {max_length} (KubeRay derives its RayCluster, "
                "service and PodGroup names from it)",
                "use a shorter name",
            )
        )
    if not _DNS1035.fullmatch(name):
        problems.append(
            Problem(
                field,
                f"{name!r} is not a DNS-1035 label: lower-case letters, digits and '-', starting "
                "with a letter and ending with a letter or digit (no '_', '.', upper case or "
                "non-ASCII)",
                f"rename it, e.g. {_suggest_name(name)!r}",
            )
        )
    return problems


def _suggest_name(name: str) -> str:
    out = re.sub(r"[^a-z0-9-]+", "-", name.lower()).strip("-")
    out = re.sub(r"^[^a-z]+", "", out)[:MAX_NAME_LENGTH].rstrip("-")
    return out or "my-job"


def check_namespace(namespace: Any, field: str = "metadata.namespace") -> list[Problem]:
    """Problems of a namespace name: a DNS-1123 label (at most 63 characters)."""
    if namespace is None:
        return []
    if (
        not isinstance(namespace, str)
        or len(namespace) > 63
        or not _DNS1123_LABEL.fullmatch(namespace)
    ):
        return [
            Problem(
                field,
                f"{namespace!r} is not a DNS-1123 label: at most 63 lower-case letters, digits and "
                "'-', starting and ending with a letter or digit",
                "use a valid namespace name",
            )
        ]
    return []


def check_label_value(value: str | None, field: str) -> list[Problem]:
    """Problems of a value the operator writes into a Kubernetes label."""
    if value is None or (len(value) <= 63 and _LABEL_VALUE.fullmatch(value)):
        return []
    return [
        Problem(
            field,
            f"{value!r} is written into a label, and a label value is at most 63 characters of "
            "letters, digits, '-', '_' and '.', starting and ending with a letter or digit",
            "use a shorter name of those characters",
        )
    ]


def check_kueue_queue(queue: str | None) -> list[Problem]:
    """Kueue's webhook refuses a RayJob whose ``kueue.x-k8s.io/queue-name`` is not a DNS-1123
    subdomain (a LocalQueue's name; Kueue v0.17 ``jobframework.ValidateQueueName``)."""
    if not queue or _DNS1123_SUBDOMAIN.fullmatch(queue):
        return []
    return [
        Problem(
            "spec.scheduling.queue",
            f"{queue!r} cannot name a Kueue LocalQueue (Kueue refuses the RayJob): it must be "
            "lower-case letters, digits, '-' and '.', starting and ending with a letter or digit",
            "use the LocalQueue's name, e.g. team-a",
        )
    ]


def check_metadata(meta: Any) -> list[Problem]:
    """Problems of a job's metadata: its name (or generateName) and namespace."""
    if not isinstance(meta, dict):
        return [Problem("metadata", "required field is missing", "add metadata: {name: my-job}")]
    problems: list[Problem] = []
    name, generate = meta.get("name"), meta.get("generateName")
    if not name and isinstance(generate, str) and generate:
        # the API server appends 5 characters; the result must still be a valid name
        problems += check_name(
            generate + "a" * GENERATE_NAME_SUFFIX,
            "metadata.generateName",
            MAX_NAME_LENGTH,
        )
    else:
        problems += check_name(name)
    return problems + check_namespace(meta.get("namespace"))


def check_spec(spec: PPOJobSpec) -> list[Problem]:
    """Every semantic problem of a spec, cluster half and training half."""
    problems = check_training_half(spec, prefix="spec")
    sched = spec.scheduling
    problems += check_label_value(sched.queue, "spec.scheduling.queue")
    problems += check_label_value(sched.priority_class_name, "spec.scheduling.priorityClassName")
    if sched.gang_scheduler == "kueue" and not sched.queue:
        problems.append(
            Problem(
                "spec.scheduling.queue",
                "kueue needs a LocalQueue name",
                "set spec.scheduling.queue",
            )
        )
    if sched.gang_scheduler == "kueue":
        problems += check_kueue_queue(sched.queue)
    if sched.gang_scheduler == "none" and sched.queue:
        problems.append(
            Problem(
                "spec.scheduling.queue",
                "has no effect without a gang scheduler",
                "set spec.scheduling.gangScheduler",
            )
        )
    for name in ("critic", "rollout"):
        role = getattr(spec.roles, name)
        if role is not None and role.colocate_with_actor and role.capabilities:
            problems.append(
                Problem(
                    f"spec.roles.{name}.capabilities",
                    f"a colocated {name} runs in the actor's pods, which have their own",
                    "set spec.roles.actor.capabilities instead",
                )
            )
    for name in ("actor", "critic", "rollout"):
        role = getattr(spec.roles, name)
        for res, qty in (role.resources.extra if role is not None else {}).items():
            if res in ("cpu", "memory", "nvidia.com/gpu") or not _EXTENDED.fullmatch(res):
                problems.append(
                    Problem(
                        f"spec.roles.{name}.resources.extra.{res}",
                        "is not an extended resource name (domain/name; cpu, memory and GPUs "
                        "have fields of their own)",
                        "use a name such as rdma/ib or rdma/hca_shared_devices_a",
                    )
                )
            elif qty < 1:
                problems.append(
                    Problem(
                        f"spec.roles.{name}.resources.extra.{res}",
                        f"is {qty}; an extended resource is requested in whole units >= 1",
                        "set 1 or more, or remove it",
                    )
                )
    vol = spec.checkpoint_volume
    if vol is not None:
        sources = [s for s in (vol.persistent_volume_claim, vol.nfs) if s is not None]
        if len(sources) != 1:
            problems.append(
                Problem(
                    "spec.checkpointVolume",
                    f"needs exactly one source, got {len(sources)}",
                    "set persistentVolumeClaim or nfs",
                )
            )
        if not spec.training.checkpoint_dir.startswith("/"):
            problems.append(
                Problem(
                    "spec.training.checkpointDir",
                    f"{spec.training.checkpoint_dir!r} is relative, but the checkpoint volume is "
                    "mounted at this path",
                    "use an absolute path such as /checkpoints",
                )
            )
    any_gpu = any(
        r is not None and r.resources.gpus > 0
        for r in (spec.roles.actor, spec.roles.critic, spec.roles.rollout)
    )
    if any_gpu and spec.model.dtype == "float32" and spec.roles.actor.backend == "megatron":
        problems.append(
            Problem(
                "spec.model.dtype",
                "megatron trains in bf16/fp16 mixed precision",
                "set dtype: bfloat16",
            )
        )
    return problems


_EXTENDED = re.compile(r"^[a-z0-9]([-a-z0-9.]*[a-z0-9])?/[A-Za-z0-9]([-A-Za-z0-9_.]*[A-Za-z0-9])?$")


def validate_manifest(doc: Any, source: str = "") -> PPOJob:
    """Parse and validate one PPOJob document; raise SpecError listing every problem."""
    if doc is None:
        raise SpecError([Problem("<document>", "is empty", "write a PPOJob manifest")], source)
    if not isinstance(doc, dict):
        raise SpecError(
            [
                Problem(
                    "<document>",
                    f"expected a mapping, got {type(doc).__name__}",
                    "write a PPOJob manifest (apiVersion, kind, metadata, spec)",
                )
            ],
            source,
        )
    head: list[Problem] = []
    if doc.get("apiVersion") != API_VERSION:
        head.append(
            Problem(
                "apiVersion",
                f"expected {API_VERSION!r}, got {doc.get('apiVersion')!r}",
                f"set apiVersion: {API_VERSION}",
            )
        )
    if doc.get("kind") != KIND:
        head.append(
            Problem("kind", f"expected {KIND!r}, got {doc.get('kind')!r}", f"set kind: {KIND}")
        )
    if head:
        raise SpecError(head, source)
    body = prune_nulls({k: v for k, v in doc.items() if k != "status"})
    meta_problems = check_metadata(body.get("metadata"))
    try:
        job = PPOJob.model_validate(body)
    except Exception as exc:  # pydantic.ValidationError
        raise SpecError(meta_problems + pydantic_problems(exc), source) from None
    problems = meta_problems + check_spec(job.spec)
    if problems:
        raise SpecError(problems, source)
    return job


@functools.cache
def _schema() -> dict[str, Any]:
    from ppojob_operator.crd import openapi_schema  # crd imports this module

    return openapi_schema()


def prune_nulls(doc: dict[str, Any]) -> dict[str, Any]:
    """`doc` as the API server reads it, so `ppojob validate` and the operator judge the same
    object: a null in a field that is not `nullable` is dropped before defaulting (and then takes
    its default), while nulls of nullable fields (where null means "off", like `valueClip: null`)
    are kept; a whole number written as a float (`steps: 100.0`, `1e3`) is an integer, as kubectl
    sends it."""

    def walk(node: Any, schema: dict[str, Any] | None) -> Any:
        if schema is None:
            return node
        if isinstance(node, dict):
            props = schema.get("properties") or {}
            extra = schema.get("additionalProperties")
            out = {}
            for key, value in node.items():
                sub = props.get(key, extra if isinstance(extra, dict) else None)
                if value is None and sub is not None and not sub.get("nullable"):
                    continue
                out[key] = walk(value, sub)
            return out
        if isinstance(node, list):
            return [walk(v, schema.get("items")) for v in node]
        if schema.get("type") == "integer" and isinstance(node, float) and node.is_integer():
            return int(node)
        return node

    return walk(doc, _schema())


def load_manifests(text: str, source: str = "") -> list[PPOJob]:
    """Parse a YAML stream of PPOJobs; raise SpecError listing every problem of every document."""
    docs = [d for d in load_yaml_documents(text, source) if d is not None] or [None]
    jobs, problems = [], []
    for i, doc in enumerate(docs):
        try:
            jobs.append(validate_manifest(doc))
        except SpecError as exc:
            prefix = f"document {i + 1}: " if len(docs) > 1 else ""
            problems += [Problem(prefix + p.path, p.message, p.fix) for p in exc.problems]
    if problems:
        raise SpecError(problems, source)
    return jobs


def trainer_config_from_spec(spec: PPOJobSpec, job_name: str | None = None) -> TrainerConfig:
    """The trainer's config: the training half of the spec plus the placement timeout."""
    half = {name: getattr(spec, name) for name in TrainingHalf.model_fields}
    return TrainerConfig(
        **half,
        placement_timeout_seconds=spec.scheduling.timeout_seconds,
        job_name=job_name,
    )


def total_gpus(spec: PPOJobSpec) -> int:
    """GPUs all the job's pods request (colocated roles have no pods of their own)."""
    roles = spec.roles
    total = roles.actor.total_gpus()
    critic = roles.effective_critic(spec.algorithm.needs_critic)
    if critic is not None and not critic.colocate_with_actor:
        total += critic.total_gpus()
    if not roles.rollout.colocate_with_actor:
        total += roles.rollout.total_gpus()
    return total


__all__ = [
    "API_VERSION",
    "GROUP",
    "KIND",
    "PHASES",
    "PLURAL",
    "VERSION",
    "Condition",
    "PPOJob",
    "PPOJobSpec",
    "PPOJobStatus",
    "Problem",
    "Progress",
    "Scheduling",
    "SpecError",
    "check_label_value",
    "check_metadata",
    "check_name",
    "check_namespace",
    "check_spec",
    "load_manifests",
    "total_gpus",
    "trainer_config_from_spec",
    "validate_manifest",
]


def dump(model: _Model) -> dict[str, Any]:
    """Serialise a model the way it appears in Kubernetes (camelCase, no nulls)."""
    return model.model_dump(by_alias=True, exclude_none=True, mode="json")
