"""Checks of elastic rollout engines (``roles.rollout.elastic``) against the rest of the spec."""

from __future__ import annotations

from ppojob_api.problems import Problem
from ppojob_api.training import TrainingHalf


def check_elastic(half: TrainingHalf, prefix: str = "spec") -> list[Problem]:
    """Elastic engines are disaggregated torch engines, one per pod, started ``replicas`` strong
    within ``minReplicas..maxReplicas``."""
    rollout = half.roles.rollout
    elastic = rollout.elastic
    if elastic is None:
        return []
    field = f"{prefix}.roles.rollout.elastic"
    found = []
    if rollout.colocate_with_actor:
        found.append(
            Problem(
                field,
                "elastic engines come and go in pods of their own, but a colocated rollout "
                "runs inside the actor's worker processes",
                "set roles.rollout.colocateWithActor: false, or unset elastic",
            )
        )
    if rollout.backend == "sglang":
        found.append(
            Problem(
                field,
                "a new SGLang engine could not take the current weights: SGLang's weight-update "
                "session is a fixed-size NCCL group of the actor and the engines started with "
                "the job, which a replacement cannot join (elastic engines load the weights "
                "from Ray's object store, which only the torch engine does)",
                "set roles.rollout.backend: torch, or unset elastic",
            )
        )
    gpus = rollout.resources.gpus
    if gpus > 1:
        found.append(
            Problem(
                f"{prefix}.roles.rollout.resources.gpus",
                f"elastic engines are counted in pods, one engine each, but {gpus} GPUs per pod "
                "would run that many engines in one pod",
                "set resources.gpus to 0 or 1 and scale with replicas, or unset elastic",
            )
        )
    if half.algorithm.dynamic_sampling is not None:
        found.append(
            Problem(
                field,
                "dynamic sampling assembles a step from the groups each engine keeps, so a lost "
                "engine would lose groups already generated",
                "unset algorithm.dynamicSampling, or unset elastic",
            )
        )
    lo, hi = elastic.min_replicas, elastic.max_replicas
    if lo > hi:
        found.append(
            Problem(
                f"{field}.minReplicas",
                f"minReplicas {lo} is more than maxReplicas {hi}",
                f"set minReplicas <= {hi}, or maxReplicas >= {lo}",
            )
        )
    elif not lo <= rollout.replicas <= hi:
        found.append(
            Problem(
                f"{prefix}.roles.rollout.replicas",
                f"{rollout.replicas} engines would start, outside elastic's bounds "
                f"minReplicas {lo} .. maxReplicas {hi}",
                f"set replicas between {lo} and {hi}",
            )
        )
    return found
