"""Checks of the cluster half of a spec: queues and priority classes, capabilities and extended
resources, the checkpoint volume, and precision on GPUs."""

from __future__ import annotations

import re

from ppojob_api.metadata import check_kueue_queue, check_label_value
from ppojob_api.problems import Problem
from ppojob_api.spec import PPOJobSpec

_EXTENDED = re.compile(r"^[a-z0-9]([-a-z0-9.]*[a-z0-9])?/[A-Za-z0-9]([-A-Za-z0-9_.]*[A-Za-z0-9])?$")


def check_scheduling(spec: PPOJobSpec, prefix: str = "spec") -> list[Problem]:
    """The queue and priority class are written into labels; Kueue needs a LocalQueue name it
    accepts; a queue without a gang scheduler does nothing."""
    sched = spec.scheduling
    path = f"{prefix}.scheduling"
    p = check_label_value(sched.queue, f"{path}.queue")
    p += check_label_value(sched.priority_class_name, f"{path}.priorityClassName")
    if sched.gang_scheduler == "kueue":
        if not sched.queue:
            p.append(Problem(f"{path}.queue", "kueue needs a LocalQueue name", f"set {path}.queue"))
        p += check_kueue_queue(sched.queue)
    if sched.workload_priority_class:
        p += check_label_value(sched.workload_priority_class, f"{path}.workloadPriorityClass")
        if sched.gang_scheduler not in (None, "kueue"):
            p.append(
                Problem(
                    f"{path}.workloadPriorityClass",
                    f"is Kueue's, and the gang scheduler is {sched.gang_scheduler}",
                    f"use {path}.priorityClassName (the pods' PriorityClass) instead",
                )
            )
    if sched.topology is not None:
        p += _check_topology(sched.topology.level, f"{path}.topology.level")
        if sched.gang_scheduler not in (None, "kueue"):
            p.append(
                Problem(
                    f"{path}.topology",
                    f"is Kueue's Topology-Aware Scheduling, and the gang scheduler is "
                    f"{sched.gang_scheduler}",
                    f"set {path}.gangScheduler: kueue, or remove {path}.topology",
                )
            )
    if sched.gang_scheduler == "kai":
        if not sched.queue:
            p.append(
                Problem(
                    f"{path}.queue",
                    "kai needs the KAI Queue the job's pods are admitted from (KubeRay copies it "
                    "onto every pod)",
                    f"set {path}.queue",
                )
            )
        if spec.submission_mode == "K8sJobMode":
            p.append(
                Problem(
                    f"{prefix}.submissionMode",
                    "KubeRay refuses K8sJobMode under kai-scheduler: its submitter pod is made "
                    "after the Ray cluster, outside the gang",
                    f"set {prefix}.submissionMode: SidecarMode",
                )
            )
    if sched.gang_scheduler == "none" and sched.queue:
        p.append(
            Problem(
                f"{path}.queue",
                "has no effect without a gang scheduler",
                f"set {path}.gangScheduler",
            )
        )
    return p


def check_colocated_capabilities(spec: PPOJobSpec, prefix: str = "spec") -> list[Problem]:
    """A colocated role has no pods of its own, so no capabilities of its own."""
    p: list[Problem] = []
    for name in ("critic", "rollout"):
        role = getattr(spec.roles, name)
        if role is not None and role.colocate_with_actor and role.capabilities:
            p.append(
                Problem(
                    f"{prefix}.roles.{name}.capabilities",
                    f"a colocated {name} runs in the actor's pods, which have their own",
                    "set spec.roles.actor.capabilities instead",
                )
            )
    return p


def check_extended_resources(spec: PPOJobSpec, prefix: str = "spec") -> list[Problem]:
    """`resources.extra` holds extended resources (domain/name) in whole units."""
    p: list[Problem] = []
    for name in ("actor", "critic", "rollout", "reward", "sandbox"):
        role = getattr(spec.roles, name)
        for res, qty in (role.resources.extra if role is not None else {}).items():
            field = f"{prefix}.roles.{name}.resources.extra.{res}"
            if res.startswith("hugepages-"):
                size = res.removeprefix("hugepages-")
                p.append(
                    Problem(
                        field,
                        "huge pages are no extended resource (their amount is memory, and the "
                        "pod needs a HugePages volume)",
                        f"move it to {prefix}.roles.{name}.resources.hugepages as "
                        f"{size}: <amount>, e.g. {size}: 1Gi",
                    )
                )
            elif res in ("cpu", "memory", "nvidia.com/gpu") or not _EXTENDED.fullmatch(res):
                p.append(
                    Problem(
                        field,
                        "is not an extended resource name (domain/name; cpu, memory and GPUs "
                        "have fields of their own)",
                        "use a name such as rdma/ib or rdma/hca_shared_devices_a",
                    )
                )
            elif qty < 1:
                p.append(
                    Problem(
                        field,
                        f"is {qty}; an extended resource is requested in whole units >= 1",
                        "set 1 or more, or remove it",
                    )
                )
    return p


def check_checkpoint_volume(spec: PPOJobSpec, prefix: str = "spec") -> list[Problem]:
    """A checkpoint volume has one source and is mounted at an absolute checkpointDir."""
    vol = spec.checkpoint_volume
    if vol is None:
        return []
    p: list[Problem] = []
    sources = [s for s in (vol.persistent_volume_claim, vol.nfs) if s is not None]
    if len(sources) != 1:
        p.append(
            Problem(
                f"{prefix}.checkpointVolume",
                f"needs exactly one source, got {len(sources)}",
                "set persistentVolumeClaim or nfs",
            )
        )
    if not spec.training.checkpoint_dir.startswith("/"):
        p.append(
            Problem(
                f"{prefix}.training.checkpointDir",
                f"{spec.training.checkpoint_dir!r} is relative, but the checkpoint volume is "
                "mounted at this path",
                "use an absolute path such as /checkpoints",
            )
        )
    return p


def check_gpu_precision(spec: PPOJobSpec, prefix: str = "spec") -> list[Problem]:
    """Megatron on GPUs trains in bf16/fp16 mixed precision, not float32."""
    any_gpu = any(
        r is not None and r.resources.gpus > 0
        for r in (spec.roles.actor, spec.roles.critic, spec.roles.rollout)
    )
    if any_gpu and spec.model.dtype == "float32" and spec.roles.actor.backend == "megatron":
        return [
            Problem(
                f"{prefix}.model.dtype",
                "megatron trains in bf16/fp16 mixed precision",
                "set dtype: bfloat16",
            )
        ]
    return []


RAY_NODE_MIN_MEMORY = 250 * 2**20
"""The least memory a Ray pod starts with: Ray gives its object store 30 % of the pod's memory
(``DEFAULT_OBJECT_STORE_MEMORY_PROPORTION``) and refuses less than 75 MiB
(``OBJECT_STORE_MINIMUM_MEMORY_BYTES``), so ``ray start`` fails in a pod under 250 MiB."""


def check_ray_memory(spec: PPOJobSpec, prefix: str = "spec") -> list[Problem]:
    """The head's and every role's own pods' memory against what ``ray start`` needs."""
    from ppojob_api.checks.sizes import quantity_bytes, shown_memory

    pods = [(f"{prefix}.head.memory", spec.head.memory)]
    roles = spec.roles
    own = {"actor": roles.actor}
    critic = roles.effective_critic(spec.algorithm.needs_critic)
    if critic is not None and not critic.colocate_with_actor:
        own["critic"] = critic
    if not roles.rollout.colocate_with_actor:
        own["rollout"] = roles.rollout
    if roles.reward is not None:
        own["reward"] = roles.reward
    if roles.sandbox is not None:
        own["sandbox"] = roles.sandbox
    pods += [(f"{prefix}.roles.{n}.resources.memory", r.resources.memory) for n, r in own.items()]
    return [
        Problem(
            path,
            f"{shown_memory(memory)} is less than a Ray pod starts with: Ray's object store "
            "takes 30% of the pod's memory and needs at least 75 MiB (ray start fails under 250Mi)",
            "give the pod at least 512Mi; the head, which also runs the trainer's driver, 2Gi or "
            "more",
        )
        for path, memory in pods
        if quantity_bytes(memory) < RAY_NODE_MIN_MEMORY
    ]


def _check_topology(level: str, field: str) -> list[Problem]:
    """A topology level is a node label key (a qualified name, an optional DNS prefix)."""
    from ppojob_api import k8s_rules

    errors = k8s_rules.qualified_name(level)
    if not errors:
        return []
    return [
        Problem(
            field,
            f"{level!r} is not a node label key: {errors[0]}",
            "use one of the node labels your Kueue Topology lists as a level, e.g. "
            "kubernetes.io/hostname",
        )
    ]
