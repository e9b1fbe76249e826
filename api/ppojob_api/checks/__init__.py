"""The semantic checks a schema cannot express, one concern per function (in the manner of
KubeRay's ``utils/validation.go``).

Every check takes the spec (or its training half) and the field-path prefix of its problems, and
returns every problem it finds, each with its field path and a fix. Checks judge values, never
whether a field was written: the API server stores a job with the CRD's defaults filled in, and
a manifest and its stored form must get the same verdict.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import TypeVar

from ppojob_api.checks.agent import check_agent, check_sandbox_role
from ppojob_api.checks.batches import check_batches, check_group_size, check_learning_rate
from ppojob_api.checks.cluster import (
    check_checkpoint_volume,
    check_colocated_capabilities,
    check_extended_resources,
    check_gpu_precision,
    check_ray_memory,
    check_scheduling,
)
from ppojob_api.checks.dapo import (
    check_dynamic_sampling,
    check_overlong_shaping,
    check_policy_loss,
)
from ppojob_api.checks.disruption import check_grace_period
from ppojob_api.checks.distill import check_distillation
from ppojob_api.checks.efficiency import check_lora, check_packing
from ppojob_api.checks.elastic import check_elastic
from ppojob_api.checks.kl import check_kl_mode, check_kl_off, check_kl_target
from ppojob_api.checks.megatron import (
    check_megatron_colocated_critic,
    check_megatron_devices,
    check_megatron_splits,
    check_megatron_top_p,
)
from ppojob_api.checks.memory import check_memory_plan
from ppojob_api.checks.moe import (
    check_expert_parallel,
    check_moe_backends,
    check_moe_tensor_parallel,
    check_router_aux_loss,
    check_routing_replay,
)
from ppojob_api.checks.offpolicy import (
    check_importance_sampling,
    check_partial_rollout,
    check_staleness,
)
from ppojob_api.checks.pods import check_pod_fields
from ppojob_api.checks.podtemplate import check_pod_template
from ppojob_api.checks.roles import (
    check_backends,
    check_colocation,
    check_precision,
    check_sequence_parallel,
    check_sglang_top_p_tis,
    check_unused_critic,
)
from ppojob_api.checks.settings import check_env, check_tensor_within_pod
from ppojob_api.checks.sizes import check_sizes
from ppojob_api.checks.sources import (
    check_eval_prompts,
    check_model_paths,
    check_prompts,
    check_reward_function,
    check_reward_role,
    check_rewards,
)
from ppojob_api.checks.trackers import check_trackers
from ppojob_api.problems import Problem
from ppojob_api.spec import PPOJobSpec
from ppojob_api.training import TrainingHalf

S = TypeVar("S", bound=TrainingHalf)
Check = Callable[[S, str], list[Problem]]

TRAINING_CHECKS: tuple[Check[TrainingHalf], ...] = (
    check_unused_critic,
    check_colocation,
    check_backends,
    check_megatron_top_p,
    check_sglang_top_p_tis,
    check_staleness,
    check_partial_rollout,
    check_elastic,
    check_importance_sampling,
    check_dynamic_sampling,
    check_overlong_shaping,
    check_policy_loss,
    check_megatron_devices,
    check_megatron_splits,
    check_megatron_colocated_critic,
    check_moe_backends,
    check_expert_parallel,
    check_moe_tensor_parallel,
    check_routing_replay,
    check_router_aux_loss,
    check_sequence_parallel,
    check_tensor_within_pod,
    check_env,
    check_precision,
    check_packing,
    check_lora,
    check_batches,
    check_group_size,
    check_learning_rate,
    check_kl_target,
    check_kl_mode,
    check_kl_off,
    check_distillation,
    check_reward_function,
    check_rewards,
    check_reward_role,
    check_agent,
    check_sandbox_role,
    check_prompts,
    check_eval_prompts,
    check_model_paths,
    check_sizes,
    check_trackers,
)
"""The checks of the training half (what `ppojob run` and the trainer's config file get)."""

CLUSTER_CHECKS: tuple[Check[PPOJobSpec], ...] = (
    check_scheduling,
    check_colocated_capabilities,
    check_extended_resources,
    check_checkpoint_volume,
    check_gpu_precision,
    check_pod_fields,
    check_grace_period,
    check_pod_template,
    check_ray_memory,
)
"""The checks of the cluster half (what only a PPOJob has)."""


def run_checks(checks: Iterable[Check[S]], spec: S, prefix: str) -> list[Problem]:
    """Every problem the checks find, in order, each once (two checks may find the same one,
    such as a dataset without a reward function)."""
    found: list[Problem] = []
    for check in checks:
        found += [p for p in check(spec, prefix) if p not in found]
    return found


def check_training_half(half: TrainingHalf, prefix: str = "spec") -> list[Problem]:
    """Every semantic problem of the training half, with field paths under `prefix`; the memory
    plan's verdict last, on a half with no other problem."""
    return run_checks(TRAINING_CHECKS, half, prefix) or check_memory_plan(half, prefix)


def check_spec(spec: PPOJobSpec) -> list[Problem]:
    """Every semantic problem of a spec, training half and cluster half; the memory plan's
    verdict last, on a spec with no other problem."""
    return run_checks((*TRAINING_CHECKS, *CLUSTER_CHECKS), spec, "spec") or check_memory_plan(
        spec, "spec"
    )


__all__ = ["CLUSTER_CHECKS", "TRAINING_CHECKS", "check_spec", "check_training_half", "run_checks"]
