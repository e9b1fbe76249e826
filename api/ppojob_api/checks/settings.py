"""Settings that would be silently ignored or overridden: environment variables the operator,
KubeRay, Ray or the device plugin set themselves, the same variable twice, and a megatron tensor
group wider than one pod's GPUs."""

from __future__ import annotations

from ppojob_api.problems import Problem
from ppojob_api.training import TrainingHalf

RESERVED_ENV = {
    "PPOJOB_NAME": "the operator sets it to the job's name",
    "PPOJOB_NAMESPACE": "the operator sets it to the job's namespace",
    "PPOJOB_ROLE": "the operator sets it to the pod's role",
    "RAY_USAGE_STATS_ENABLED": "the operator sets it to 0",
    "PPOJOB_GRACE_SECONDS": "the operator sets it to spec.failurePolicy's grace period",
    "PPOJOB_STOP_FILE": "the operator sets it for the head's preStop hook",
    "PPOJOB_RUNNING_FILE": "the operator sets it for the head's preStop hook",
    "RAY_GRACEFUL_SHUTDOWN_DRAIN_TIMEOUT_S": "the operator sets it to the grace period",
    "RAY_ADDRESS": "KubeRay sets it to the job's own Ray cluster",
    "RAY_AUTH_MODE": "KubeRay sets it when the job's Ray cluster has token authentication",
    "RAY_AUTH_TOKEN": "KubeRay sets it from the Ray cluster's token Secret",
    "CUDA_VISIBLE_DEVICES": "Ray sets it for each worker to the GPUs it assigned",
    "NVIDIA_VISIBLE_DEVICES": "the NVIDIA device plugin sets it to the pod's GPUs",
}
"""Variables a role's `env` may not set: each is set by the operator, KubeRay, Ray or the device
plugin, which either drops the user's value or is overridden by it (a worker would then use
GPUs Ray did not give it, or a driver another Ray cluster). A test keeps the operator's own
names in this list."""


def check_env(half: TrainingHalf, prefix: str = "spec") -> list[Problem]:
    """A role's env neither sets a reserved variable nor the same one twice."""
    p: list[Problem] = []
    for name in ("actor", "critic", "rollout", "reward", "sandbox"):
        role = getattr(half.roles, name)
        if role is None:
            continue
        seen: set[str] = set()
        for i, var in enumerate(role.env):
            path = f"{prefix}.roles.{name}.env[{i}].name"
            if var.name in RESERVED_ENV:
                p.append(
                    Problem(
                        path,
                        f"{var.name} cannot be set here: {RESERVED_ENV[var.name]}",
                        "remove it (choose GPUs with resources.gpus and nodeSelector)",
                    )
                )
            elif var.name in seen:
                p.append(
                    Problem(
                        path,
                        f"{var.name} is set twice; Kubernetes keeps only the last",
                        "set each variable once",
                    )
                )
            seen.add(var.name)
    return p


def check_tensor_within_pod(half: TrainingHalf, prefix: str = "spec") -> list[Problem]:
    """A megatron role on GPUs keeps each tensor-parallel group inside one pod: its ranks
    exchange activations in every layer, over NVLink within a node (pipeline parallelism is
    what spans pods)."""
    p: list[Problem] = []
    roles = half.roles
    for name in ("actor", "critic"):
        spec = getattr(roles, name)
        if spec is None or spec.backend != "megatron":
            continue
        owner = roles.actor if getattr(spec, "colocate_with_actor", False) else spec
        gpus, tensor = owner.resources.gpus, spec.parallelism.tensor
        if gpus and tensor > 1 and gpus % tensor:
            p.append(
                Problem(
                    f"{prefix}.roles.{name}.parallelism.tensor",
                    f"a tensor-parallel group of {tensor} GPUs does not fit the pod's {gpus} "
                    "GPU(s): its ranks would talk across pods in every layer",
                    f"use a tensor size that divides {gpus}, and pipeline parallelism across pods",
                )
            )
    return p
