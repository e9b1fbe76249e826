"""Each semantic check on its own, as a table: a spec that differs from the (valid) defaults in a
few fields, and the field paths of the problems that check alone must find.

Every table has rows that must pass as well as rows that must fail, so a check that always or
never complains fails its table. `test_every_check_has_a_table` keeps a new check from going
untested.
"""

from __future__ import annotations

import os
import re
from pathlib import Path
from typing import Any

import kubernetes.client.models as models
import pytest

from ppojob_api import checks
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
from ppojob_api.checks.pods import AFFINITY_TYPES, check_pod_fields
from ppojob_api.checks.podtemplate import check_pod_template
from ppojob_api.checks.roles import (
    check_backends,
    check_colocation,
    check_precision,
    check_sequence_parallel,
    check_sglang_top_p_tis,
    check_unused_critic,
)
from ppojob_api.checks.settings import RESERVED_ENV, check_env, check_tensor_within_pod
from ppojob_api.checks.sizes import check_sizes, quantity_bytes
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


def spec(**settings: Any) -> PPOJobSpec:
    """The default spec with `settings` (dotted camelCase paths under spec) written over it."""
    doc: dict[str, Any] = {"image": "trainer:1", "model": {"path": "builtin:tiny-llama"}}
    for dotted, value in settings.items():
        node = doc
        *parents, leaf = dotted.split("__")
        for key in parents:
            node = node.setdefault(key, {})
        node[leaf] = value
    return PPOJobSpec.model_validate(doc)


GPU_ACTOR = {"replicas": 1, "resources": {"gpus": 8}, "backend": "megatron"}
MEGATRON_CPU = {"backend": "megatron"}
MEGATRON_TP4 = {"backend": "megatron", "parallelism": {"tensor": 4}}
SGLANG_GPU = {"backend": "sglang", "resources": {"gpus": 1}}

# (check, row id, settings, expected problem paths)
TABLE: list[tuple[Any, str, dict[str, Any], list[str]]] = [
    # --- a critic the estimator does not use
    (check_unused_critic, "gae with a critic", {"roles__critic": {"replicas": 1}}, []),
    (
        check_unused_critic,
        "grpo with a critic and critic settings",
        {
            "algorithm__advantageEstimator": "grpo",
            "data__samplesPerPrompt": 4,
            "roles__critic": {"replicas": 1},
            "model__criticPath": "/models/rm",
            "algorithm__lambda": 0.9,
        },
        ["spec.roles.critic", "spec.model.criticPath", "spec.algorithm.lambda"],
    ),
    (
        check_unused_critic,
        "grpo with the stored defaults of critic settings",
        {"algorithm__advantageEstimator": "grpo", "algorithm__lambda": 0.95},
        [],
    ),
    # --- colocation
    (
        check_colocation,
        "colocated critic with the actor's resources",
        {
            "roles__actor__resources": {"cpus": 2},
            "roles__critic": {"colocateWithActor": True, "resources": {"cpus": 2}},
        },
        [],
    ),
    (
        check_colocation,
        "colocated rollout with its own replicas",
        {"roles__rollout": {"colocateWithActor": True, "replicas": 3}},
        ["spec.roles.rollout.replicas"],
    ),
    (
        check_colocation,
        "a rollout on its own pods may differ",
        {"roles__rollout": {"replicas": 3}},
        [],
    ),
    # --- backends and their parallelism
    (
        check_backends,
        "sglang without GPUs",
        {"roles__rollout": {"backend": "sglang"}},
        ["spec.roles.rollout.backend"],
    ),
    (
        check_backends,
        "torch with tensor parallelism",
        {"roles__actor": {"replicas": 2, "parallelism": {"tensor": 2}}},
        ["spec.roles.actor.parallelism"],
    ),
    (
        check_backends,
        "sglang with pipeline parallelism",
        {
            "roles__rollout": {
                "backend": "sglang",
                "resources": {"gpus": 2},
                "parallelism": {"pipeline": 2},
            }
        },
        ["spec.roles.rollout.parallelism"],
    ),
    (
        check_backends,
        "workers not divisible by the model-parallel size",
        {
            "roles__actor": {
                "replicas": 1,
                "resources": {"gpus": 3},
                "backend": "megatron",
                "parallelism": {"tensor": 2},
            }
        },
        ["spec.roles.actor.parallelism"],
    ),
    (
        check_backends,
        "engine wider than its pod",
        {
            "roles__rollout": {
                "backend": "sglang",
                "replicas": 2,
                "resources": {"gpus": 1},
                "parallelism": {"tensor": 2},
            }
        },
        ["spec.roles.rollout.parallelism.tensor"],
    ),
    (
        check_backends,
        "colocated sglang engine with a megatron actor (every worker streams every bucket)",
        {
            "roles__actor": {**GPU_ACTOR},
            "roles__rollout": {"backend": "sglang", "colocateWithActor": True},
        },
        [],
    ),
    (
        check_backends,
        "sglang on its own GPUs, tensor 2 of 8",
        {
            "roles__rollout": {
                "backend": "sglang",
                "resources": {"gpus": 8},
                "parallelism": {"tensor": 2},
            }
        },
        [],
    ),
    # --- sequence parallelism
    (
        check_sequence_parallel,
        "torch actor",
        {"roles__actor": {"parallelism": {"sequenceParallel": True}}},
        ["spec.roles.actor.parallelism.sequenceParallel"],
    ),
    (
        check_sequence_parallel,
        "megatron actor",
        {"roles__actor": {**MEGATRON_CPU, "parallelism": {"sequenceParallel": True}}},
        [],
    ),
    # --- precision of the torch backend
    (check_precision, "float16 on torch", {"model__dtype": "float16"}, ["spec.model.dtype"]),
    (check_precision, "bfloat16 on torch", {"model__dtype": "bfloat16"}, []),
    (
        check_precision,
        "float16, torch critic only",
        {
            "model__dtype": "float16",
            "roles__actor": {**GPU_ACTOR},
            "roles__critic": {"resources": {"gpus": 1}},
        },
        ["spec.model.dtype"],
    ),
    # --- packing and token budgets
    (
        check_packing,
        "packing and a budget that holds the longest sequence",
        {"training__packing": True, "training__maxTokensPerMicroBatch": 1024},
        [],
    ),
    (
        check_packing,
        "a budget below maxPromptLength + maxResponseLength, actor and inheriting critic",
        {"training__maxTokensPerMicroBatch": 1023},
        ["spec.training.maxTokensPerMicroBatch", "spec.training.maxTokensPerMicroBatch"],
    ),
    (
        check_packing,
        "a critic override budget too small for the critic only",
        {"roles__critic": {"overrides": {"maxTokensPerMicroBatch": 100}}},
        ["spec.roles.critic.overrides.maxTokensPerMicroBatch"],
    ),
    (
        check_packing,
        "packing and a budget with a megatron actor and critic",
        {
            "roles__actor": MEGATRON_CPU,
            "roles__critic": {**MEGATRON_CPU, "colocateWithActor": True},
            "training__packing": True,
            "training__maxTokensPerMicroBatch": 4096,
        },
        [],
    ),
    (
        check_megatron_devices,
        "context parallelism on GPUs (not implemented by the megatron backend)",
        {"roles__actor": {**GPU_ACTOR, "parallelism": {"context": 2}}},
        ["spec.roles.actor.parallelism.context"],
    ),
    # --- LoRA
    (check_lora, "LoRA on a torch actor", {"model__lora": {"rank": 4}}, []),
    (
        check_lora,
        "LoRA training the head in full, torch engines",
        {"model__lora": {"modulesToSave": ["lm_head"]}},
        [],
    ),
    (
        check_lora,
        "LoRA training the head in full on sglang engines, a module named twice",
        {
            "model__lora": {"modulesToSave": ["lm_head", "lm_head"]},
            "roles__rollout": {"backend": "sglang", "resources": {"gpus": 1}},
        },
        ["spec.model.lora.modulesToSave", "spec.model.lora.modulesToSave"],
    ),
    (
        check_lora,
        "LoRA on a megatron actor with FSDP",
        {"model__lora": {}, "roles__actor": MEGATRON_CPU, "training__sharding": "fsdp"},
        ["spec.model.lora", "spec.training.sharding"],
    ),
    (
        check_lora,
        "LoRA target modules a built-in model lacks",
        {"model__lora": {"targetModules": ["q_proj", "qkv_proj", "all-linear"]}},
        ["spec.model.lora.targetModules", "spec.model.lora.targetModules[1]"],
    ),
    (
        check_lora,
        "LoRA targets of a model directory are checked when it loads",
        {"model__path": "/models/x", "model__lora": {"targetModules": ["c_attn"]}},
        [],
    ),
    (
        check_lora,
        "LoRA on an sglang rollout: q/k/v, o and the MLP, or all-linear",
        {
            "roles__rollout": {"backend": "sglang", "resources": {"gpus": 1}},
            "model__lora": {"targetModules": ["q_proj", "v_proj", "gate_proj", "down_proj"]},
        },
        [],
    ),
    (
        check_lora,
        "LoRA on an sglang rollout: a layer SGLang serves no adapter on",
        {
            "model__path": "/models/x",
            "roles__rollout": {"backend": "sglang", "resources": {"gpus": 1}},
            "model__lora": {"targetModules": ["c_attn", "q_proj", "v_proj"]},
        },
        ["spec.model.lora.targetModules[0]"],
    ),
    (
        check_lora,
        "LoRA on an sglang rollout: k_proj without q_proj, up_proj without gate_proj",
        {
            "roles__rollout": {"backend": "sglang", "resources": {"gpus": 1}},
            "model__lora": {"targetModules": ["k_proj", "v_proj", "up_proj"]},
        },
        ["spec.model.lora.targetModules", "spec.model.lora.targetModules"],
    ),
    (
        check_lora,
        "LoRA on an sglang rollout: q_proj without v_proj",
        {
            "roles__rollout": {"backend": "sglang", "resources": {"gpus": 1}},
            "model__lora": {"targetModules": ["q_proj", "k_proj"]},
        },
        ["spec.model.lora.targetModules"],
    ),
    (
        check_lora,
        "all-linear and one more target, which is no layer of the built-in model",
        {"model__lora": {"targetModules": ["all-linear", "c_attn"]}},
        ["spec.model.lora.targetModules", "spec.model.lora.targetModules[1]"],
    ),
    (
        check_lora,
        "LoRA on an sglang rollout: q_proj alone of q/k/v",
        {"roles__rollout": SGLANG_GPU, "model__lora": {"targetModules": ["q_proj", "o_proj"]}},
        ["spec.model.lora.targetModules"],
    ),
    (
        check_lora,
        "LoRA on an sglang rollout: k_proj alone of q/k/v",
        {"roles__rollout": SGLANG_GPU, "model__lora": {"targetModules": ["k_proj", "o_proj"]}},
        ["spec.model.lora.targetModules"],
    ),
    (
        check_lora,
        "LoRA on an sglang rollout: v_proj alone of q/k/v",
        {"roles__rollout": SGLANG_GPU, "model__lora": {"targetModules": ["v_proj", "o_proj"]}},
        ["spec.model.lora.targetModules"],
    ),
    (
        check_lora,
        "LoRA on an sglang rollout: all-linear",
        {"roles__rollout": SGLANG_GPU, "model__lora": {"targetModules": ["all-linear"]}},
        [],
    ),
    (
        check_lora,
        "LoRA on an sglang rollout: q_proj and v_proj, k_proj left out",
        {"roles__rollout": SGLANG_GPU, "model__lora": {"targetModules": ["q_proj", "v_proj"]}},
        [],
    ),
    (
        check_lora,
        "LoRA on an sglang rollout: the MLP only, up_proj with gate_proj",
        {
            "roles__rollout": SGLANG_GPU,
            "model__lora": {"targetModules": ["gate_proj", "up_proj", "down_proj"]},
        },
        [],
    ),
    # --- megatron
    (
        check_megatron_top_p,
        "megatron actor with top-p",
        {"roles__actor": MEGATRON_CPU, "data__topP": 0.9},
        ["spec.data.topP"],
    ),
    (check_megatron_top_p, "torch actor with top-p", {"data__topP": 0.9}, []),
    (
        check_sglang_top_p_tis,
        "sglang engine, top-p and truncated importance sampling",
        {
            "roles__rollout": {"backend": "sglang", "resources": {"gpus": 1}},
            "data__topP": 0.9,
            "algorithm__tisCap": 2.0,
        },
        ["spec.algorithm.tisCap"],
    ),
    (
        check_sglang_top_p_tis,
        "sglang engine, top-p of 1 (no top-p) and truncated importance sampling",
        {"roles__rollout": SGLANG_GPU, "data__topP": 1.0, "algorithm__tisCap": 2.0},
        [],
    ),
    (
        check_sglang_top_p_tis,
        "sglang engine, top-p, no importance sampling",
        {"roles__rollout": {"backend": "sglang", "resources": {"gpus": 1}}, "data__topP": 0.9},
        [],
    ),
    (
        check_sglang_top_p_tis,
        "torch engine, top-p and truncated importance sampling",
        {"data__topP": 0.9, "algorithm__tisCap": 2.0},
        [],
    ),
    (
        check_sglang_top_p_tis,
        "sglang engine, top-p and importanceSampling",
        {
            "roles__rollout": {"backend": "sglang", "resources": {"gpus": 1}},
            "data__topP": 0.9,
            "algorithm__importanceSampling": {"mode": "mask"},
        },
        ["spec.algorithm.importanceSampling"],
    ),
    # --- bounded staleness and the off-policy correction
    (
        check_staleness,
        "staleness with a colocated engine",
        {"roles__rollout": {"colocateWithActor": True}, "algorithm__maxStaleness": 1},
        ["spec.algorithm.maxStaleness"],
    ),
    (check_staleness, "staleness with engines of their own", {"algorithm__maxStaleness": 2}, []),
    (
        check_staleness,
        "colocated engine, on-policy",
        {"roles__rollout": {"colocateWithActor": True}, "algorithm__maxStaleness": 0},
        [],
    ),
    (
        check_partial_rollout,
        "partial rollout, on-policy, on sglang, with an agent",
        {
            "algorithm__partialRollout": True,
            "roles__rollout": {"backend": "sglang", "resources": {"gpus": 1}},
            "data__prompts": "builtin:calculator",
            "data__agent": {"function": "builtin:calculator"},
        },
        [
            "spec.algorithm.partialRollout",
            "spec.algorithm.partialRollout",
            "spec.algorithm.partialRollout",
        ],
    ),
    (
        check_partial_rollout,
        "partial rollout with staleness on torch engines",
        {"algorithm__partialRollout": True, "algorithm__maxStaleness": 1},
        [],
    ),
    (
        check_importance_sampling,
        "tisCap and importanceSampling",
        {"algorithm__tisCap": 2.0, "algorithm__importanceSampling": {"level": "sequence"}},
        ["spec.algorithm.importanceSampling"],
    ),
    (
        check_importance_sampling,
        "importanceSampling alone",
        {"algorithm__importanceSampling": {"level": "sequence", "mode": "mask", "cap": 5.0}},
        [],
    ),
    # --- the algorithm pack (issue 25): DAPO and GSPO against the rest of the spec
    (
        check_dynamic_sampling,
        "dynamic sampling with gae, one sample per prompt, staleness",
        {
            "algorithm__dynamicSampling": {},
            "algorithm__maxStaleness": 1,
            "data__samplesPerPrompt": 1,
        },
        ["spec.algorithm.dynamicSampling"] * 3,
    ),
    (
        check_dynamic_sampling,
        "dynamic sampling with grpo, two samples per prompt",
        {
            "algorithm__advantageEstimator": "grpo",
            "algorithm__dynamicSampling": {"maxRounds": 2},
            "data__samplesPerPrompt": 2,
        },
        [],
    ),
    (
        check_overlong_shaping,
        "an overlong buffer as long as the responses",
        {"algorithm__overlongShaping": {"bufferLength": 64}, "data__maxResponseLength": 64},
        ["spec.algorithm.overlongShaping.bufferLength"],
    ),
    (
        check_overlong_shaping,
        "an overlong buffer below the maximum length",
        {"algorithm__overlongShaping": {"bufferLength": 63}, "data__maxResponseLength": 64},
        [],
    ),
    (
        check_policy_loss,
        "gspo with a dual clip",
        {"algorithm__policyLoss": "gspo", "algorithm__dualClip": 3.0},
        ["spec.algorithm.dualClip"],
    ),
    (
        check_policy_loss,
        "gspo with its small clip ranges",
        {
            "algorithm__policyLoss": "gspo",
            "algorithm__clipRangeLow": 3e-4,
            "algorithm__clipRangeHigh": 4e-4,
        },
        [],
    ),
    (
        check_megatron_devices,
        "megatron on CPU: context parallel, sequence parallel, bfloat16",
        {
            "roles__actor": {
                **MEGATRON_CPU,
                "replicas": 2,
                "parallelism": {"context": 2, "sequenceParallel": True},
            },
            "model__dtype": "bfloat16",
            "algorithm__advantageEstimator": "grpo",
            "data__samplesPerPrompt": 2,
        },
        [
            "spec.roles.actor.parallelism.context",
            "spec.roles.actor.parallelism.sequenceParallel",
            "spec.model.dtype",
        ],
    ),
    (
        check_megatron_devices,
        "megatron on CPU in float32",
        {"roles__actor": MEGATRON_CPU, "model__dtype": "float32"},
        [],
    ),
    (
        check_megatron_splits,
        "tensor 8 does not divide tiny-llama's 4 heads",
        {"roles__actor": {**GPU_ACTOR, "parallelism": {"tensor": 8}}},
        ["spec.roles.actor.parallelism.tensor"],
    ),
    (
        check_megatron_splits,
        "pipeline 4 does not divide tiny-llama's 2 layers",
        {"roles__actor": {**GPU_ACTOR, "parallelism": {"pipeline": 4}}},
        ["spec.roles.actor.parallelism.pipeline"],
    ),
    (
        check_megatron_splits,
        "tensor 2 and pipeline 2 split tiny-llama",
        {"roles__actor": {**GPU_ACTOR, "parallelism": {"tensor": 2, "pipeline": 2}}},
        [],
    ),
    (
        check_megatron_splits,
        "a model directory is checked when loaded",
        {"model__path": "/models/x", "roles__actor": {**GPU_ACTOR, "parallelism": {"tensor": 8}}},
        [],
    ),
    (
        check_megatron_colocated_critic,
        "colocated megatron critic with another layout",
        {
            "roles__actor": {**GPU_ACTOR, "parallelism": {"tensor": 2}},
            "roles__critic": {"backend": "megatron", "colocateWithActor": True},
        },
        ["spec.roles.critic.parallelism"],
    ),
    (
        check_megatron_colocated_critic,
        "colocated megatron critic with the actor's layout",
        {
            "roles__actor": {**GPU_ACTOR, "parallelism": {"tensor": 2}},
            "roles__critic": {
                "backend": "megatron",
                "colocateWithActor": True,
                "parallelism": {"tensor": 2},
            },
        },
        [],
    ),
    # --- batch sizes
    (
        check_batches,
        "mini-batch does not divide the step (no critic)",
        {
            "algorithm__advantageEstimator": "reinforce_plus_plus",
            "data__rolloutBatchSize": 4,
            "data__samplesPerPrompt": 2,
            "training__miniBatchSize": 3,
        },
        ["spec.training.miniBatchSize"],
    ),
    (
        check_batches,
        "mini-batch does not split over 2 actor workers (no critic)",
        {
            "algorithm__advantageEstimator": "reinforce_plus_plus",
            "roles__actor": {"replicas": 2},
            "data__rolloutBatchSize": 3,
            "data__samplesPerPrompt": 1,
            "training__miniBatchSize": 3,
        },
        ["spec.training.miniBatchSize"],
    ),
    (
        check_batches,
        "micro-batch does not divide a worker's share: the actor's and the inheriting critic's",
        {
            "data__rolloutBatchSize": 8,
            "data__samplesPerPrompt": 1,
            "training__miniBatchSize": 8,
            "training__microBatchSize": 3,
        },
        ["spec.training.microBatchSize"],  # once: the critic inherits it, nobody wrote an override
    ),
    (
        check_batches,
        "critic override breaks the critic's batches only",
        {
            "data__rolloutBatchSize": 8,
            "data__samplesPerPrompt": 1,
            "roles__critic": {"overrides": {"microBatchSize": 3}},
        },
        ["spec.roles.critic.overrides.microBatchSize"],
    ),
    (
        check_batches,
        "critic override that changes allocation",
        {"roles__critic": {"overrides": {"replicas": 2}}},
        ["spec.roles.critic.overrides.replicas"],
    ),
    (
        check_batches,
        "valid batches",
        {"data__rolloutBatchSize": 8, "data__samplesPerPrompt": 2, "training__miniBatchSize": 8},
        [],
    ),
    (
        check_group_size,
        "grpo with one sample per prompt",
        {"algorithm__advantageEstimator": "grpo", "data__samplesPerPrompt": 1},
        ["spec.data.samplesPerPrompt"],
    ),
    (
        check_group_size,
        "rloo with two",
        {"algorithm__advantageEstimator": "rloo", "data__samplesPerPrompt": 2},
        [],
    ),
    (check_group_size, "gae with one", {"data__samplesPerPrompt": 1}, []),
    (
        check_learning_rate,
        "min above max",
        {"training__learningRate": 1e-6, "training__minLearningRate": 1e-5},
        ["spec.training.minLearningRate"],
    ),
    (
        check_learning_rate,
        "min equal to max",
        {"training__learningRate": 1e-6, "training__minLearningRate": 1e-6},
        [],
    ),
    (
        check_learning_rate,
        "decay steps with a constant schedule",
        {"training__lrDecaySteps": 100},
        ["spec.training.lrDecaySteps"],
    ),
    (
        check_learning_rate,
        "decay steps with cosine",
        {"training__lrDecaySteps": 100, "training__lrScheduler": "cosine"},
        [],
    ),
    # --- KL
    (
        check_kl_target,
        "target with coefficient 0 and mode loss",
        {"algorithm__kl": {"target": 6.0, "mode": "loss", "estimator": "k3"}},
        ["spec.algorithm.kl.target", "spec.algorithm.kl.target"],
    ),
    (
        check_kl_target,
        "target with a coefficient, in the reward",
        {"algorithm__kl": {"target": 6.0, "coefficient": 0.1}},
        [],
    ),
    (
        check_kl_mode,
        "k1 as a loss",
        {"algorithm__kl": {"coefficient": 0.1, "mode": "loss", "estimator": "k1"}},
        ["spec.algorithm.kl.estimator"],
    ),
    (
        check_kl_mode,
        "KL in the reward of a group estimator",
        {
            "algorithm__advantageEstimator": "grpo",
            "data__samplesPerPrompt": 2,
            "algorithm__kl": {"coefficient": 0.1, "mode": "reward"},
        },
        ["spec.algorithm.kl.mode"],
    ),
    (
        check_kl_mode,
        "k3 as a loss",
        {"algorithm__kl": {"coefficient": 0.1, "mode": "loss", "estimator": "k3"}},
        [],
    ),
    (
        check_kl_off,
        "KL settings with coefficient 0",
        {"algorithm__kl": {"estimator": "k3"}},
        ["spec.algorithm.kl.coefficient"],
    ),
    (check_kl_off, "KL off with its defaults", {"algorithm__kl": {"coefficient": 0}}, []),
    # --- distillation
    (
        check_distillation,
        "a teacher in the reward of a group estimator",
        {
            "algorithm__advantageEstimator": "grpo",
            "algorithm__distillation": {"teacher": "builtin:count-up-teacher"},
        },
        ["spec.algorithm.distillation.mode"],
    ),
    (
        check_distillation,
        "a teacher on a megatron actor, a teacher of unknown form",
        {
            "roles__actor": {"backend": "megatron"},
            "algorithm__distillation": {"teacher": "http://x/t", "mode": "loss"},
        },
        ["spec.algorithm.distillation.teacher", "spec.algorithm.distillation.teacher"],
    ),
    (
        check_distillation,
        "the teacher alone beside a reward function",
        {
            "data__rewardFunction": "builtin:count-up",
            "algorithm__distillation": {"teacher": "builtin:tiny-qwen2", "taskReward": False},
        },
        ["spec.algorithm.distillation.taskReward"],
    ),
    (
        check_distillation,
        "the teacher alone, in the reward of REINFORCE++",
        {
            "algorithm__advantageEstimator": "reinforce_plus_plus",
            "algorithm__distillation": {"teacher": "builtin:count-up-teacher", "taskReward": False},
        },
        [],
    ),
    # --- sources
    (
        check_reward_function,
        "unknown built-in",
        {"data__rewardFunction": "builtin:chess"},
        ["spec.data.rewardFunction"],
    ),
    (
        check_reward_function,
        "not module:function",
        {"data__rewardFunction": "builtin:count-up", "data__prompts": "builtin:count-up"},
        [],
    ),
    (
        check_rewards,
        "a function, a reward model and an endpoint, named apart",
        {
            "data__prompts": "/data/p.jsonl",
            "data__rewards": [
                {"function": "rewards:score"},
                {"model": {"path": "/models/rm"}, "weight": 0.5},
                {"http": {"url": "https://rm.example/score"}, "name": "judge"},
                {"function": "builtin:count-up", "name": "model-2"},
            ],
        },
        [],
    ),
    (
        check_rewards,
        "an endpoint URL with credentials",
        {
            "data__prompts": "/data/p.jsonl",
            "data__rewards": [{"http": {"url": "https://u:p@rm/s"}}],
        },
        ["spec.data.rewards[0].http.url"],
    ),
    (
        check_rewards,
        "a reward model named as a built-in",
        {
            "data__prompts": "/data/p.jsonl",
            "data__rewards": [{"model": {"path": "builtin:small-llama"}}],
        },
        ["spec.data.rewards[0].model.path"],
    ),
    (
        check_rewards,
        "rewards beside rewardFunction",
        {"data__rewardFunction": "m:f", "data__rewards": [{"function": "m:g"}]},
        ["spec.data.rewards"],
    ),
    (
        check_rewards,
        "sources of no kind, two kinds, weight 0, bad function, URI model, duplicate name",
        {
            "data__rewards": [
                {"weight": 1},
                {"function": "m:f", "http": {"url": "http://rm/score"}},
                {"function": "m:f", "weight": 0, "name": "f0"},
                {"function": "rewards.py"},
                {"model": {"path": "s3://bucket/rm"}},
                {"model": {"path": "/models/rm2"}},
                {"http": {"url": "http://:8080/score"}},
            ]
        },
        [
            "spec.data.rewards[0]",
            "spec.data.rewards[1]",
            "spec.data.rewards[2].weight",
            "spec.data.rewards[3].function",
            "spec.data.rewards[4].model.path",
            "spec.data.rewards[5].name",
            "spec.data.rewards[6].http.url",
        ],
    ),
    (
        check_rewards,
        "judges: the policy, a built-in, a directory; a default score at the top of the range",
        {
            "data__prompts": "/data/p.jsonl",
            "data__rewards": [
                {"judge": {"model": "policy"}},
                {
                    "judge": {
                        "model": "builtin:tiny-llama",
                        "template": "{{json}} {prompt} -> {response} ({label})",
                        "scorePattern": r"\[\[(\d+)\]\]",
                        "minScore": -1,
                        "maxScore": 1,
                    },
                    "name": "judge-2",
                },
                {"judge": {"model": "/models/judge"}, "name": "judge-3"},
                {"judge": {"model": "policy", "defaultScore": 10}, "name": "judge-4"},
            ],
        },
        [],
    ),
    (
        check_rewards,
        "bad judges",
        {
            "data__prompts": "/data/p.jsonl",
            "data__rewards": [
                {"judge": {"model": "builtin:gpt", "scorePattern": "(\\d"}, "name": "a"},
                {"judge": {"model": "s3://b/j", "scorePattern": "(a)(b)"}, "name": "b"},
                {"judge": {"model": "policy", "template": "{prompt} {answer}"}, "name": "c"},
                {"judge": {"model": "policy", "template": "{prompt} only"}, "name": "d"},
                {"judge": {"model": "policy", "template": "{response} {"}, "name": "e"},
                {"judge": {"model": "policy", "minScore": 1, "maxScore": 1}, "name": "f"},
                {"judge": {"model": "policy", "defaultScore": 11}, "name": "g"},
                {"judge": {"model": "policy"}, "http": {"url": "http://j/s"}, "name": "h"},
            ],
        },
        [
            "spec.data.rewards[0].judge.model",
            "spec.data.rewards[0].judge.scorePattern",
            "spec.data.rewards[1].judge.model",
            "spec.data.rewards[1].judge.scorePattern",
            "spec.data.rewards[2].judge.template",
            "spec.data.rewards[3].judge.template",
            "spec.data.rewards[4].judge.template",
            "spec.data.rewards[5].judge.minScore",
            "spec.data.rewards[6].judge.defaultScore",
            "spec.data.rewards[7]",
        ],
    ),
    (
        check_prompts,
        "a dataset with reward sources",
        {"data__prompts": "/data/p.jsonl", "data__rewards": [{"function": "m:f"}]},
        [],
    ),
    (
        check_prompts,
        "unknown built-in task",
        {"data__prompts": "builtin:chess"},
        ["spec.data.prompts"],
    ),
    (
        check_prompts,
        "a CSV file",
        {"data__prompts": "/data/p.csv", "data__rewardFunction": "m:f"},
        ["spec.data.prompts"],
    ),
    (
        check_prompts,
        "a dataset without a reward function",
        {"data__prompts": "/data/p.jsonl"},
        ["spec.data.rewardFunction"],
    ),
    (
        check_prompts,
        "a save_to_disk directory with a reward function",
        {"data__prompts": "/data/prompts", "data__rewardFunction": "m:f"},
        [],
    ),
    (
        check_eval_prompts,
        "unknown built-in eval task",
        {"data__evalPrompts": "builtin:chess"},
        ["spec.data.evalPrompts"],
    ),
    (
        check_eval_prompts,
        "eval dataset without a reward function",
        {"data__evalPrompts": "/data/eval.jsonl"},
        ["spec.data.evalPrompts"],  # the eval dataset is what needs it: prompts are built-in
    ),
    (
        check_eval_prompts,
        "eval prompts of a format the trainer does not read",
        {"data__evalPrompts": "/data/eval.csv", "data__rewardFunction": "r:score"},
        ["spec.data.evalPrompts"],
    ),
    (check_eval_prompts, "built-in eval task", {"data__evalPrompts": "builtin:reverse"}, []),
    (
        check_eval_prompts,
        "an eval dataset scored by rewardFunction",
        {"data__evalPrompts": "/data/eval.jsonl", "data__rewardFunction": "r:score"},
        [],
    ),
    (
        check_eval_prompts,
        "an eval dataset scored by data.rewards",
        {"data__evalPrompts": "/data/eval.jsonl", "data__rewards": [{"function": "r:score"}]},
        [],
    ),
    (
        check_model_paths,
        "a URI and an unknown built-in",
        {"model__path": "s3://bucket/model", "model__criticPath": "builtin:huge"},
        ["spec.model.path", "spec.model.criticPath"],
    ),
    (
        check_model_paths,
        "a hub id and a directory",
        {"model__path": "Qwen/Qwen2.5-0.5B", "model__criticPath": "./critic"},
        [],
    ),
    # --- sizes
    (
        check_sizes,
        "longer than the built-in context",
        {"data__maxPromptLength": 2000, "data__maxResponseLength": 100},
        ["spec.data.maxResponseLength"],
    ),
    (
        check_sizes,
        "a rollout batch whose KV cache exceeds the pod",
        {
            "data__rolloutBatchSize": 4096,
            "data__samplesPerPrompt": 8,
            "data__maxPromptLength": 1024,
            "data__maxResponseLength": 1024,
            "roles__rollout": {"resources": {"memory": "64Mi"}},
            "training__microBatchSize": 1,
            "training__miniBatchSize": 32768,
        },
        ["spec.roles.rollout.resources.memory"],
    ),
    (check_sizes, "the defaults", {}, []),
    (
        check_sizes,
        "a KV cache of exactly 1 GiB (4096 x 512 tokens x 512 bytes) in a 1000Mi rollout pod",
        {
            "model__path": "builtin:tiny-llama",
            "model__dtype": "bfloat16",
            "data__rolloutBatchSize": 4096,
            "data__samplesPerPrompt": 1,
            "data__maxPromptLength": 256,
            "data__maxResponseLength": 256,
            "roles__rollout": {"replicas": 1, "resources": {"memory": "1000Mi"}},
            "training__miniBatchSize": 4096,
            "training__microBatchSize": 1,
        },
        ["spec.roles.rollout.resources.memory"],
    ),
    # --- the cluster half
    (
        check_scheduling,
        "kueue without a queue",
        {"scheduling__gangScheduler": "kueue"},
        ["spec.scheduling.queue"],
    ),
    (
        check_scheduling,
        "kueue with a queue Kueue refuses",
        {"scheduling__gangScheduler": "kueue", "scheduling__queue": "Team_A"},
        ["spec.scheduling.queue"],
    ),
    (
        check_scheduling,
        "a priority class name too long for the label it is written into",
        {"scheduling__priorityClassName": "p" * 64},
        ["spec.scheduling.priorityClassName"],
    ),
    (
        check_scheduling,
        "kai without a queue, in K8sJobMode",
        {"scheduling__gangScheduler": "kai", "submissionMode": "K8sJobMode"},
        ["spec.scheduling.queue", "spec.submissionMode"],
    ),
    (
        check_scheduling,
        "a Kueue WorkloadPriorityClass under another gang scheduler",
        {"scheduling__gangScheduler": "volcano", "scheduling__workloadPriorityClass": "high"},
        ["spec.scheduling.workloadPriorityClass"],
    ),
    (
        check_scheduling,
        "a Kueue topology under another gang scheduler",
        {
            "scheduling__gangScheduler": "volcano",
            "scheduling__topology": {"level": "cloud.provider.com/topology-rack"},
        },
        ["spec.scheduling.topology"],
    ),
    (
        check_scheduling,
        "a Kueue topology level that is no label key",
        {
            "scheduling__gangScheduler": "kueue",
            "scheduling__queue": "lq",
            "scheduling__topology": {"level": "rack/a/b"},
        },
        ["spec.scheduling.topology.level"],
    ),
    (
        check_scheduling,
        "a Kueue topology level, preferred",
        {
            "scheduling__gangScheduler": "kueue",
            "scheduling__queue": "lq",
            "scheduling__topology": {"level": "kubernetes.io/hostname", "mode": "preferred"},
        },
        [],
    ),
    (
        check_scheduling,
        "a queue without a gang scheduler",
        {"scheduling__gangScheduler": "none", "scheduling__queue": "q"},
        ["spec.scheduling.queue"],
    ),
    (
        check_scheduling,
        "volcano with a queue",
        {"scheduling__gangScheduler": "volcano", "scheduling__queue": "research"},
        [],
    ),
    (
        check_colocated_capabilities,
        "colocated critic with capabilities",
        {"roles__critic": {"colocateWithActor": True, "capabilities": ["IPC_LOCK"]}},
        ["spec.roles.critic.capabilities"],
    ),
    (
        check_colocated_capabilities,
        "actor with capabilities",
        {"roles__actor": {"capabilities": ["IPC_LOCK"]}},
        [],
    ),
    (
        check_extended_resources,
        "cpu as an extended resource, and zero RDMA",
        {"roles__actor": {"resources": {"extra": {"cpu": 1, "rdma/ib": 0}}}},
        ["spec.roles.actor.resources.extra.cpu", "spec.roles.actor.resources.extra.rdma/ib"],
    ),
    (
        check_extended_resources,
        "one RDMA device",
        {"roles__actor": {"resources": {"extra": {"rdma/ib": 1}}}},
        [],
    ),
    (
        check_checkpoint_volume,
        "two sources and a relative directory",
        {
            "checkpointVolume": {
                "persistentVolumeClaim": {"claimName": "c"},
                "nfs": {"server": "10.0.0.1", "path": "/x"},
            },
            "training__checkpointDir": "ckpt",
        },
        ["spec.checkpointVolume", "spec.training.checkpointDir"],
    ),
    (
        check_checkpoint_volume,
        "one claim at an absolute directory",
        {
            "checkpointVolume": {"persistentVolumeClaim": {"claimName": "c"}},
            "training__checkpointDir": "/checkpoints",
        },
        [],
    ),
    (
        check_gpu_precision,
        "megatron on GPUs in float32",
        {"roles__actor": GPU_ACTOR, "model__dtype": "float32"},
        ["spec.model.dtype"],
    ),
    (
        check_gpu_precision,
        "megatron on GPUs in bfloat16",
        {"roles__actor": GPU_ACTOR, "model__dtype": "bfloat16"},
        [],
    ),
]


# --- boundaries and branches the rows above leave open (found by `make mutation`)
SMALL = {"model__path": "builtin:small-llama", "model__dtype": "bfloat16"}
TABLE += [
    (
        check_batches,
        "one worker per role takes an odd mini-batch",
        {"data__rolloutBatchSize": 3, "data__samplesPerPrompt": 1, "training__miniBatchSize": 3},
        [],
    ),
    (
        check_batches,
        "a critic on its own pods splits the mini-batch over its own workers",
        {
            "roles__critic": {"replicas": 3},
            "data__rolloutBatchSize": 4,
            "data__samplesPerPrompt": 1,
            "training__miniBatchSize": 4,
        },
        ["spec.training.miniBatchSize"],  # the critic inherits it; no override was written
    ),
    (
        check_extended_resources,
        "a GPU or a name without a domain as an extended resource",
        {"roles__actor": {"resources": {"extra": {"nvidia.com/gpu": 1, "ib": 1, "x.io/ib": 2}}}},
        ["spec.roles.actor.resources.extra.nvidia.com/gpu", "spec.roles.actor.resources.extra.ib"],
    ),
    (
        check_gpu_precision,
        "megatron on CPU in float32",
        {"roles__actor": MEGATRON_CPU, "model__dtype": "float32"},
        [],
    ),
    (
        check_gpu_precision,
        "megatron on one GPU in float32",
        {"roles__actor": {**GPU_ACTOR, "resources": {"gpus": 1}}, "model__dtype": "float32"},
        ["spec.model.dtype"],
    ),
    (
        check_megatron_devices,
        "a colocated megatron critic uses the actor's GPUs",
        {
            "roles__actor": GPU_ACTOR,
            "roles__critic": {"backend": "megatron", "colocateWithActor": True},
            "model__dtype": "bfloat16",
        },
        [],
    ),
    (
        check_megatron_devices,
        "a megatron critic on CPU pods of its own next to a GPU actor",
        {
            "roles__actor": GPU_ACTOR,
            "roles__critic": {"backend": "megatron", "replicas": 1},
            "model__dtype": "bfloat16",
        },
        ["spec.model.dtype"],
    ),
    (
        check_megatron_devices,
        "sequence parallel over tensor-parallel GPUs",
        {
            "roles__actor": {**GPU_ACTOR, "parallelism": {"tensor": 2, "sequenceParallel": True}},
            "model__dtype": "bfloat16",
        },
        [],
    ),
    (
        check_megatron_devices,
        "sequence parallel over tensor-parallel single-GPU pods",
        {
            "roles__actor": {
                **GPU_ACTOR,
                "replicas": 2,
                "resources": {"gpus": 1},
                "parallelism": {"tensor": 2, "sequenceParallel": True},
            },
            "model__dtype": "bfloat16",
        },
        [],
    ),
    (
        check_megatron_devices,
        "sequence parallel with tensor 2 on CPU",
        {
            "roles__actor": {
                **MEGATRON_CPU,
                "replicas": 2,
                "parallelism": {"tensor": 2, "sequenceParallel": True},
            },
            "model__dtype": "float32",
        },
        ["spec.roles.actor.parallelism.sequenceParallel"],
    ),
    (
        check_megatron_splits,
        "a critic model of its own: the critic's tensor size is checked against it",
        {
            "model__path": "/models/policy",
            "model__criticPath": "builtin:small-llama",
            "roles__actor": {**GPU_ACTOR, "parallelism": {"tensor": 8}},
            "roles__critic": {**GPU_ACTOR, "parallelism": {"tensor": 8}},
        },
        ["spec.roles.critic.parallelism.tensor"],
    ),
    (
        check_megatron_splits,
        "a critic model of its own: the actor's tensor size is checked against the policy",
        {
            "model__criticPath": "/models/rm",
            "roles__actor": {**GPU_ACTOR, "parallelism": {"tensor": 8}},
            "roles__critic": {**GPU_ACTOR, "parallelism": {"tensor": 8}},
        },
        ["spec.roles.actor.parallelism.tensor"],
    ),
    (
        check_unused_critic,
        "grpo with a value clip of its own",
        {"algorithm__advantageEstimator": "grpo", "algorithm__valueClip": 0.5},
        ["spec.algorithm.valueClip"],
    ),
    (
        check_unused_critic,
        "grpo with the value clip unset",
        {"algorithm__advantageEstimator": "grpo", "algorithm__valueClip": None},
        [],
    ),
    (
        check_backends,
        "sglang with context parallelism",
        {
            "roles__rollout": {
                "backend": "sglang",
                "resources": {"gpus": 2},
                "parallelism": {"context": 2},
            }
        },
        ["spec.roles.rollout.parallelism"],
    ),
    (
        check_precision,
        "float16 with a megatron actor and no critic",
        {
            "model__dtype": "float16",
            "roles__actor": MEGATRON_CPU,
            "algorithm__advantageEstimator": "grpo",
            "data__samplesPerPrompt": 4,
        },
        [],
    ),
    (
        check_prompts,
        "a save_to_disk directory under a dotted parent",
        {"data__prompts": "/data/v1.2/prompts", "data__rewardFunction": "m:f"},
        [],
    ),
    (
        check_prompts,
        "a dotted directory name that is not a dataset format",
        {"data__prompts": "/data/run.v2/", "data__rewardFunction": "m:f"},
        ["spec.data.prompts"],
    ),
    (
        check_prompts,
        "a relative file of another format",
        {"data__prompts": "prompts.csv", "data__rewardFunction": "m:f"},
        ["spec.data.prompts"],
    ),
    (
        check_sizes,
        "a model that is not built in is sized by the backend",
        {"model__path": "/models/x", "data__rolloutBatchSize": 4096},
        [],
    ),
    (
        check_sizes,
        "an unknown built-in model is another check's business",
        {"model__path": "builtin:nope", "data__rolloutBatchSize": 4096},
        [],
    ),
    (
        check_sizes,
        "a rollout on GPUs still leaves the actor's CPU pod checked",
        {
            "roles__rollout": {"backend": "sglang", "resources": {"gpus": 1}},
            "roles__actor": {"resources": {"memory": "1Mi"}},
        },
        ["spec.roles.actor.resources.memory"],
    ),
]


# (check, settings, problem path, what its message and fix must state)
FACTS: list[tuple[Any, dict[str, Any], str, list[str]]] = [
    (
        check_batches,
        {
            "roles__actor": {"replicas": 2},
            "data__rolloutBatchSize": 4,
            "data__samplesPerPrompt": 1,
            "training__miniBatchSize": 4,
            "training__microBatchSize": 3,
        },
        "spec.training.microBatchSize",
        ["the actor worker's share of a mini-batch (4 / 2 = 2)", "use a divisor of 2)"],
    ),
    (
        check_batches,
        {
            "roles__critic": {"replicas": 2, "overrides": {"microBatchSize": 3}},
            "data__rolloutBatchSize": 4,
            "data__samplesPerPrompt": 1,
            "training__miniBatchSize": 4,
        },
        "spec.roles.critic.overrides.microBatchSize",
        ["the critic worker's share of a mini-batch (4 / 2 = 2)", "use a divisor of 2)"],
    ),
    (
        check_batches,
        {
            "roles__actor": {"replicas": 3},
            "training__miniBatchSize": 4,
            "data__rolloutBatchSize": 4,
        },
        "spec.training.miniBatchSize",
        ["the actor's mini-batch of 4 samples does not split over its 3 data-parallel workers"],
    ),
    (
        check_batches,
        {
            "roles__critic": {"replicas": 3},
            "training__miniBatchSize": 4,
            "data__rolloutBatchSize": 4,
        },
        "spec.training.miniBatchSize",
        [
            "the critic's mini-batch of 4 samples does not split over its 3 data-parallel workers "
            "(the critic inherits spec.training's value)",
            "use a multiple of 3, or give the critic its own in "
            "spec.roles.critic.overrides.miniBatchSize",
        ],
    ),
    (
        check_checkpoint_volume,
        {
            "checkpointVolume": {
                "persistentVolumeClaim": {"claimName": "c"},
                "nfs": {"server": "10.0.0.1", "path": "/x"},
            },
        },
        "spec.checkpointVolume",
        ["needs exactly one source, got 2"],
    ),
    (
        check_checkpoint_volume,
        {"checkpointVolume": {}},
        "spec.checkpointVolume",
        ["needs exactly one source, got 0"],
    ),
    (
        check_backends,
        {"roles__rollout": {"replicas": 2, "parallelism": {"tensor": 2}}},
        "spec.roles.rollout.parallelism",
        ["the torch backend is data parallel only", "or use backend sglang)"],
    ),
    (
        check_backends,
        {"roles__actor": {"replicas": 2, "parallelism": {"tensor": 2}}},
        "spec.roles.actor.parallelism",
        ["the torch backend is data parallel only", "or use backend megatron)"],
    ),
    (
        check_backends,
        {
            "roles__rollout": {
                "backend": "sglang",
                "resources": {"gpus": 3},
                "parallelism": {"tensor": 2},
            }
        },
        "spec.roles.rollout.parallelism.tensor",
        ["its pod's 3 GPU(s) (3 is not a multiple of 2)"],
    ),
    (
        check_backends,
        {
            "roles__actor": {"resources": {"gpus": 3}},
            "roles__rollout": {
                "backend": "sglang",
                "colocateWithActor": True,
                "parallelism": {"tensor": 2},
            },
        },
        "spec.roles.rollout.parallelism.tensor",
        ["the actor's pod's 3 GPU(s) (3 is not a multiple of 2)"],
    ),
]


FACTS += [
    (
        check_reward_function,
        {"data__rewardFunction": "rewards.score"},
        "spec.data.rewardFunction",
        ["'rewards.score' is not `module:function`"],
    ),
]


FACTS += [
    (
        check_kl_off,
        {"algorithm__kl": {"estimator": "k3", "mode": "loss"}},
        "spec.algorithm.kl.coefficient",
        ["KL settings are given (estimator: k3, mode: loss)"],
    ),
    (
        check_precision,
        {"model__dtype": "float16"},
        "spec.model.dtype",
        ["which the torch backend (actor) does not do"],
    ),
    (
        check_precision,
        {"model__dtype": "float16", "roles__actor": MEGATRON_CPU, "roles__critic": {"replicas": 1}},
        "spec.model.dtype",
        ["which the torch backend (critic) does not do"],
    ),
    (
        check_megatron_splits,
        {"roles__actor": {**GPU_ACTOR, "parallelism": {"tensor": 3}}},
        "spec.roles.actor.parallelism.tensor",
        ["tensor 3 does not divide the 4 attention heads of builtin:tiny-llama", "divides 4)"],
    ),
    (
        check_megatron_splits,
        {"roles__actor": {**GPU_ACTOR, "parallelism": {"tensor": 4}}},
        "spec.roles.actor.parallelism.tensor",
        ["tensor 4 does not divide the 14 vocabulary size of builtin:tiny-llama"],
    ),
]
TABLE += [
    (
        check_tensor_within_pod,
        "a megatron tensor group wider than the pod's GPUs",
        {"roles__actor": {"replicas": 4, "resources": {"gpus": 2}, **MEGATRON_TP4}},
        ["spec.roles.actor.parallelism.tensor"],
    ),
    (
        check_tensor_within_pod,
        "a torch actor and a megatron critic on pods of its own: a group of 2 on 3 GPUs",
        {
            "roles__critic": {
                "replicas": 1,
                "backend": "megatron",
                "resources": {"gpus": 3},
                "parallelism": {"tensor": 2},
            }
        },
        ["spec.roles.critic.parallelism.tensor"],
    ),
    (
        check_tensor_within_pod,
        "a colocated megatron critic's group must fit the actor's pod",
        {
            "roles__actor": {
                "replicas": 1,
                "resources": {"gpus": 6},
                **MEGATRON_TP4,
                "parallelism": {"tensor": 2},
            },
            "roles__critic": {
                "colocateWithActor": True,
                "backend": "megatron",
                "parallelism": {"tensor": 4},
            },
        },
        ["spec.roles.critic.parallelism.tensor"],
    ),
    (
        check_tensor_within_pod,
        "a tensor group inside one pod; on CPU the pods are the workers",
        {
            "roles__actor": {"replicas": 2, "resources": {"gpus": 8}, **MEGATRON_TP4},
            "roles__critic": {"replicas": 4, "backend": "megatron", "parallelism": {"tensor": 2}},
        },
        [],
    ),
    (
        check_env,
        "variables the operator, KubeRay or Ray set; one variable twice",
        {
            "roles__actor": {
                "env": [
                    {"name": "CUDA_VISIBLE_DEVICES", "value": "0"},
                    {"name": "A", "value": "1"},
                    {"name": "A", "value": "2"},
                ]
            },
            "roles__rollout": {"env": [{"name": "RAY_ADDRESS", "value": "ray://x:10001"}]},
        },
        [
            "spec.roles.actor.env[0].name",
            "spec.roles.actor.env[2].name",
            "spec.roles.rollout.env[0].name",
        ],
    ),
    (
        check_env,
        "every variable the operator, KubeRay, Ray or the device plugin set, on the critic",
        {
            "roles__critic": {
                "replicas": 1,
                "env": [{"name": n, "value": "1"} for n in RESERVED_ENV],
            }
        },
        [f"spec.roles.critic.env[{i}].name" for i in range(len(RESERVED_ENV))],
    ),
    (
        check_env,
        "the user's own variables",
        {"roles__actor": {"env": [{"name": "NCCL_DEBUG", "value": "WARN"}]}},
        [],
    ),
]

REQ = "requiredDuringSchedulingIgnoredDuringExecution"
PREF = "preferredDuringSchedulingIgnoredDuringExecution"

TABLE += [
    (
        check_pod_fields,
        "image with upper case in its path, and with a space",
        {"image": "ghcr.io/Org/trainer:1"},
        ["spec.image"],
    ),
    (check_pod_fields, "image with a space", {"image": "trainer :1"}, ["spec.image"]),
    (
        check_pod_fields,
        "valid images: a registry with a port, a digest",
        {"image": "localhost:5000/org/trainer:v1.0@sha256:" + "a" * 64},
        [],
    ),
    (
        check_pod_fields,
        "node selector key and value Kubernetes refuses",
        {"roles__actor": {"nodeSelector": {"bad key": "ok", "gpu": "H100 SXM"}}},
        ["spec.roles.actor.nodeSelector.bad key", "spec.roles.actor.nodeSelector.gpu"],
    ),
    (
        check_pod_fields,
        "a valid node selector on the head",
        {"head": {"nodeSelector": {"nvidia.com/gpu.product": "NVIDIA-H100-80GB-HBM3"}}},
        [],
    ),
    (
        check_pod_fields,
        "Exists with a value, tolerationSeconds without NoExecute, empty key with Equal",
        {
            "roles__rollout": {
                "tolerations": [
                    {"key": "gpu", "operator": "Exists", "value": "x"},
                    {"key": "gpu", "tolerationSeconds": 30, "effect": "NoSchedule"},
                    {"operator": "Equal"},
                ]
            }
        },
        [
            "spec.roles.rollout.tolerations[0].value",
            "spec.roles.rollout.tolerations[1].tolerationSeconds",
            "spec.roles.rollout.tolerations[2].operator",
        ],
    ),
    (
        check_pod_fields,
        "affinity keys misspelt at both levels",
        {
            "head": {
                "affinity": {
                    "nodeAfinity": {},
                    "podAntiAffinity": {"requiredDuringScheduling": []},
                }
            }
        },
        [
            "spec.head.affinity.nodeAfinity",
            "spec.head.affinity.podAntiAffinity.requiredDuringScheduling",
        ],
    ),
    (
        check_pod_fields,
        "a valid affinity",
        {
            "head": {
                "affinity": {
                    "nodeAffinity": {"preferredDuringSchedulingIgnoredDuringExecution": []},
                }
            }
        },
        [],
    ),
    (
        check_pod_fields,
        "affinity mistakes deep down: a misspelt key, operators and their values, a weight, "
        "a topology key, a label value, a matchFields key, a list written as a mapping",
        {
            "head": {
                "affinity": {
                    "nodeAffinity": {
                        "requiredDuringSchedulingIgnoredDuringExecution": {
                            "nodeSelectorTerms": [
                                {
                                    "matchExpressions": [
                                        {"key": "gpu", "operater": "In", "values": ["a"]},
                                        {"key": "k", "operator": "Exists", "values": ["x"]},
                                        {"key": "n", "operator": "Gt", "values": ["1", "2"]},
                                        {"key": "z", "operator": "In"},
                                    ],
                                    "matchFields": [
                                        {"key": "spec.nodeName", "operator": "In", "values": ["n"]}
                                    ],
                                }
                            ]
                        },
                        "preferredDuringSchedulingIgnoredDuringExecution": [
                            {"weight": 0, "preference": {"matchExpressions": []}}
                        ],
                    },
                    "podAntiAffinity": {
                        "requiredDuringSchedulingIgnoredDuringExecution": [
                            {"labelSelector": {"matchLabels": {"app": "a b"}}}
                        ],
                        "preferredDuringSchedulingIgnoredDuringExecution": [
                            {
                                "weight": 50,
                                "podAffinityTerm": {
                                    "topologyKey": "kubernetes.io/hostname",
                                    "labelSelector": {
                                        "matchExpressions": [
                                            {"key": "x", "operator": "Gt", "values": ["1"]}
                                        ]
                                    },
                                },
                            }
                        ],
                    },
                    "podAffinity": {"requiredDuringSchedulingIgnoredDuringExecution": {}},
                }
            }
        },
        [
            f"spec.head.affinity.nodeAffinity.{REQ}.nodeSelectorTerms[0].{m}"
            for m in (
                "matchExpressions[0].operater",
                "matchExpressions[0].operator",
                "matchExpressions[1].values",
                "matchExpressions[2].values",
                "matchExpressions[3].values",
                "matchFields[0].key",
            )
        ]
        + [
            f"spec.head.affinity.nodeAffinity.{PREF}[0].weight",
            f"spec.head.affinity.podAntiAffinity.{REQ}[0].labelSelector.matchLabels.app",
            f"spec.head.affinity.podAntiAffinity.{REQ}[0].topologyKey",
            f"spec.head.affinity.podAntiAffinity.{PREF}[0].podAffinityTerm.labelSelector"
            ".matchExpressions[0].operator",
            f"spec.head.affinity.podAffinity.{REQ}",
        ],
    ),
    (
        check_pod_fields,
        "a valid affinity at every level",
        {
            "head": {
                "affinity": {
                    "nodeAffinity": {
                        REQ: {
                            "nodeSelectorTerms": [
                                {
                                    "matchExpressions": [
                                        {"key": "gpu", "operator": "In", "values": ["h100"]},
                                        {"key": "spot", "operator": "DoesNotExist"},
                                        {"key": "mem", "operator": "Gt", "values": ["64"]},
                                    ],
                                    "matchFields": [
                                        {
                                            "key": "metadata.name",
                                            "operator": "NotIn",
                                            "values": ["x"],
                                        }
                                    ],
                                }
                            ]
                        },
                        PREF: [{"weight": 100, "preference": {"matchExpressions": []}}],
                    },
                    "podAntiAffinity": {
                        PREF: [
                            {
                                "weight": 1,
                                "podAffinityTerm": {
                                    "topologyKey": "kubernetes.io/hostname",
                                    "labelSelector": {
                                        "matchLabels": {"app.kubernetes.io/name": "ppojob"},
                                        "matchExpressions": [{"key": "x", "operator": "Exists"}],
                                    },
                                    "namespaces": ["a"],
                                    "matchLabelKeys": ["pod-template-hash"],
                                },
                            }
                        ]
                    },
                }
            }
        },
        [],
    ),
    (
        check_pod_fields,
        "a huge page amount that is no whole number of pages; a page size that is none",
        {"roles__actor": {"resources": {"hugepages": {"2Mi": "3Mi", "3Mi": "6Mi"}}}},
        [
            "spec.roles.actor.resources.hugepages.2Mi",
            "spec.roles.actor.resources.hugepages.3Mi",
        ],
    ),
    (
        check_pod_fields,
        "huge pages of two sizes",
        {"roles__rollout": {"resources": {"hugepages": {"2Mi": "512Mi", "1Gi": "2Gi"}}}},
        [],
    ),
    (
        check_pod_fields,
        "a worker role's affinity misspelt",
        {"roles__rollout": {"affinity": {"podAntiAffinity": {"preferred": []}}}},
        ["spec.roles.rollout.affinity.podAntiAffinity.preferred"],
    ),
    (
        check_extended_resources,
        "huge pages written as an extended resource",
        {"roles__actor": {"resources": {"extra": {"hugepages-2Mi": 512}}}},
        ["spec.roles.actor.resources.extra.hugepages-2Mi"],
    ),
    (
        check_colocation,
        "a colocated rollout with an affinity of its own",
        {"roles__rollout": {"colocateWithActor": True, "affinity": {"nodeAffinity": {}}}},
        ["spec.roles.rollout.affinity"],
    ),
    (
        check_pod_fields,
        "a YuniKorn queue path with an empty part",
        {"scheduling": {"gangScheduler": "yunikorn", "queue": "root..team-a"}},
        ["spec.scheduling.queue"],
    ),
    (
        check_pod_fields,
        "a YuniKorn queue path",
        {"scheduling": {"gangScheduler": "yunikorn", "queue": "root.team_a.sub-1"}},
        [],
    ),
    (
        check_pod_fields,
        "valid tolerations",
        {
            "roles__actor": {
                "tolerations": [
                    {"operator": "Exists"},
                    {"key": "n", "effect": "NoExecute", "tolerationSeconds": 30},
                ]
            }
        },
        [],
    ),
    (
        check_pod_fields,
        "priority class and Volcano queue that are no object names; a relative NFS path",
        {
            "scheduling": {
                "gangScheduler": "volcano",
                "queue": "Team_A",
                "priorityClassName": "High",
            },
            "checkpointVolume": {"nfs": {"server": "nfs", "path": "exports/ckpt"}},
            "training__checkpointDir": "/ckpt",
        },
        [
            "spec.scheduling.priorityClassName",
            "spec.scheduling.queue",
            "spec.checkpointVolume.nfs.path",
        ],
    ),
]

# Every message of the pod checks that the rows above do not reach, so that
# check_messages.txt holds its full text (volumes, affinity value rules, shapes, huge pages).
AA = "spec.head.affinity"
NODE_TERM = f"{AA}.nodeAffinity.{REQ}.nodeSelectorTerms[0]"
ANTI = f"{AA}.podAntiAffinity.{REQ}"
TABLE += [
    (
        check_pod_template,
        "extra volumes wrong at every level: misspelt and unknown keys, shapes, two sources",
        {
            "podTemplate": {
                "volumes": [
                    {"name": "a", "emptydir": {}, "zzzz": {}},
                    {
                        "name": "b",
                        "secret": {
                            "secretName": "s",
                            "defaultMode": "0644",
                            "items": [
                                {"key": "a", "pth": "a", "qqqq": 1},
                                {"key": "b", "path": "b", "mode": "x"},
                            ],
                        },
                    },
                    {
                        "name": "c",
                        "csi": {"driver": "d", "readOnly": "yes", "volumeAttributes": {"size": 10}},
                    },
                    {"name": "d", "emptyDir": {"sizeLimit": [1]}, "hostPath": {"path": "/x"}},
                    {"name": "f", "secret": "s", "csi": {"driver": "d", "volumeAttributes": "x"}},
                    {"name": "g", "rbd": {"image": "i", "monitors": ["m"], "imag": "x"}},
                    {
                        "name": "h",
                        "ephemeral": {
                            "volumeClaimTemplate": {"spec": {"resources": {"requests": "1Gi"}}}
                        },
                    },
                    {
                        "name": "e",
                        "ephemeral": {
                            "volumeClaimTemplate": {
                                "metadata": {"creationTimestamp": 5},
                                "spec": {
                                    "resources": {"requests": {"storage": True}},
                                    "storageClass": "fast",
                                },
                            }
                        },
                    },
                ]
            }
        },
        [
            "spec.podTemplate.volumes[0].emptydir",
            "spec.podTemplate.volumes[0].zzzz",
            "spec.podTemplate.volumes[1].secret.defaultMode",
            "spec.podTemplate.volumes[1].secret.items[0].pth",
            "spec.podTemplate.volumes[1].secret.items[0].qqqq",
            "spec.podTemplate.volumes[1].secret.items[1].mode",
            "spec.podTemplate.volumes[2].csi.readOnly",
            "spec.podTemplate.volumes[2].csi.volumeAttributes.size",
            "spec.podTemplate.volumes[3].emptyDir.sizeLimit",
            "spec.podTemplate.volumes[3]",
            "spec.podTemplate.volumes[4].secret",
            "spec.podTemplate.volumes[4].csi.volumeAttributes",
            "spec.podTemplate.volumes[4]",
            "spec.podTemplate.volumes[5].rbd.imag",
            "spec.podTemplate.volumes[6].ephemeral.volumeClaimTemplate.spec.resources.requests",
            "spec.podTemplate.volumes[7].ephemeral.volumeClaimTemplate.metadata.creationTimestamp",
            "spec.podTemplate.volumes[7].ephemeral.volumeClaimTemplate.spec.resources.requests"
            ".storage",
            "spec.podTemplate.volumes[7].ephemeral.volumeClaimTemplate.spec.storageClass",
        ],
    ),
    (
        check_pod_fields,
        "affinity value rules: requirements' keys, operators and values, weights, terms, "
        "namespaces, label keys, topology keys",
        {
            "head": {
                "affinity": {
                    "nodeAffinity": {
                        REQ: {
                            "nodeSelectorTerms": [
                                {
                                    "matchExpressions": [
                                        {"operator": "Exists"},
                                        {"key": "bad key!", "operator": "Lt"},
                                        {"key": "z", "operator": "NotIn"},
                                        {"key": "z", "operator": "Gte", "values": ["1"]},
                                        {"key": "", "operator": "DoesNotExist", "values": ["x"]},
                                    ],
                                    "matchFields": [
                                        {
                                            "key": "metadata.name",
                                            "operator": "In",
                                            "values": ["a", "b"],
                                        },
                                        {"key": "metadata.name", "operator": "Exists"},
                                    ],
                                }
                            ]
                        },
                        PREF: [
                            {"preference": {}},
                            {"weight": 101, "preference": {}},
                        ],
                    },
                    "podAntiAffinity": {
                        REQ: [
                            {
                                "namespaces": ["Team_A", "Team_B"],
                                "matchLabelKeys": ["a b"],
                                "mismatchLabelKeys": ["c"],
                                "topologyKey": "bad key!",
                            },
                            {
                                "labelSelector": {
                                    "matchLabels": {"bad key!": "a b", "bad key?": "v"},
                                    "matchExpressions": [
                                        {"key": "app", "operator": "In", "values": ["a b"]}
                                    ],
                                },
                                "matchLabelKeys": ["team"],
                                "mismatchLabelKeys": ["team"],
                                "topologyKey": "kubernetes.io/hostname",
                            },
                        ]
                    },
                    "podAffinity": {
                        REQ: [{"topologyKey": ""}],
                        PREF: [{"weight": 0, "podAffinityTerm": {"topologyKey": "zone"}}],
                    },
                }
            }
        },
        [
            f"{NODE_TERM}.matchExpressions[0].key",
            f"{NODE_TERM}.matchExpressions[1].values",
            f"{NODE_TERM}.matchExpressions[1].key",
            f"{NODE_TERM}.matchExpressions[2].values",
            f"{NODE_TERM}.matchExpressions[3].operator",
            f"{NODE_TERM}.matchExpressions[4].values",
            f"{NODE_TERM}.matchExpressions[4].key",
            f"{NODE_TERM}.matchFields[0].values",
            f"{NODE_TERM}.matchFields[1].operator",
            f"{AA}.nodeAffinity.{PREF}[0].weight",
            f"{AA}.nodeAffinity.{PREF}[1].weight",
            f"{ANTI}[0].namespaces[0]",
            f"{ANTI}[0].namespaces[1]",
            f"{ANTI}[0].matchLabelKeys",
            f"{ANTI}[0].matchLabelKeys[0]",
            f"{ANTI}[0].mismatchLabelKeys",
            f"{ANTI}[0].topologyKey",
            f"{ANTI}[1].labelSelector.matchExpressions[0].values[0]",
            f"{ANTI}[1].labelSelector.matchLabels.bad key!",
            f"{ANTI}[1].labelSelector.matchLabels.bad key!",
            f"{ANTI}[1].labelSelector.matchLabels.bad key?",
            f"{ANTI}[1].matchLabelKeys[0]",
            f"{AA}.podAffinity.{REQ}[0].topologyKey",
            f"{AA}.podAffinity.{PREF}[0].weight",
        ],
    ),
    (
        check_pod_fields,
        "a required node affinity without terms",
        {"head": {"affinity": {"nodeAffinity": {REQ: {"nodeSelectorTerms": []}}}}},
        [f"{AA}.nodeAffinity.{REQ}.nodeSelectorTerms"],
    ),
    (
        check_pod_fields,
        "a taint value Kubernetes refuses, huge pages off by a page at each unit, sizes that "
        "are no page size, a long YuniKorn queue name with a dot and a space",
        {
            "roles__actor": {
                "tolerations": [
                    {"key": "bad key!"},
                    {"key": "k", "operator": "Equal", "value": "a b"},
                ],
                "resources": {
                    "hugepages": {
                        "2Mi": "5Mi",
                        "4Ki": "1030Ki",
                        "1Gi": "1536Mi",
                        "6Ki": "1Mi",
                        "abc": "1Mi",
                        "1k": "1Mi",
                        "2.5Mi": "5Mi",
                    }
                },
            },
            "roles__rollout": {
                "nodeSelector": {"a" * 64 + "!": "x"},
                "resources": {"hugepages": {"1Gi": "100Mi"}},
            },
            "scheduling": {"gangScheduler": "yunikorn", "queue": "ml.team " + "a" * 80},
        },
        [
            "spec.roles.actor.tolerations[0].key",
            "spec.roles.actor.tolerations[1].value",
            *(
                f"spec.roles.actor.resources.hugepages.{s}"
                for s in ("2Mi", "4Ki", "1Gi", "6Ki", "abc", "1k", "2.5Mi")
            ),
            "spec.roles.rollout.nodeSelector." + "a" * 64 + "!",
            "spec.roles.rollout.resources.hugepages.1Gi",
            "spec.scheduling.queue",
        ],
    ),
    (
        check_pod_fields,
        "YuniKorn without a queue",
        {"scheduling": {"gangScheduler": "yunikorn"}},
        [],
    ),
    (
        check_pod_fields,
        "an image and a priority class name Kubernetes refuse",
        {"image": "trainer :1", "scheduling": {"priorityClassName": "High"}},
        ["spec.image", "spec.scheduling.priorityClassName"],
    ),
]

TABLE += [
    (
        check_unused_critic,
        "grpo with critic updates per step",
        {"algorithm__advantageEstimator": "grpo", "algorithm__criticUpdatesPerStep": 3},
        ["spec.algorithm.criticUpdatesPerStep"],
    ),
    (
        check_colocation,
        "a colocated critic placed elsewhere",
        {
            "roles__critic": {
                "colocateWithActor": True,
                "nodeSelector": {"pool": "x"},
                "tolerations": [{"key": "k", "operator": "Exists"}],
            }
        },
        ["spec.roles.critic.nodeSelector", "spec.roles.critic.tolerations"],
    ),
]


@pytest.mark.parametrize(("check", "settings", "path", "facts"), FACTS)
def test_problem_states_the_numbers(
    check: Any, settings: dict[str, Any], path: str, facts: list[str]
) -> None:
    """The message and fix give the numbers the user must change (not only the field)."""
    [problem] = [p for p in check(spec(**settings), "spec") if p.path == path]
    for fact in facts:
        assert fact in str(problem), str(problem)


# small-llama: hidden 128, intermediate 512, 5 layers; bfloat16 is 2 bytes a value
KV_PER_TOKEN = 2 * 5 * 128 * 2  # K and V of every layer
ACTIVATIONS_PER_TOKEN = 5 * (4 * 128 + 2 * 512) * 4  # float32 activations of every layer
BIG = "1Ti"


@pytest.mark.parametrize(
    ("role", "settings", "share", "need"),
    [
        # 4096 samples over 2 rollout workers: 2048 samples of 512 + 512 tokens each
        (
            "rollout",
            {"roles__rollout": {"replicas": 2}, "roles__actor": {"resources": {"memory": BIG}}},
            2048,
            2048 * 1024 * KV_PER_TOKEN,
        ),
        # all 4096 samples on one rollout worker
        (
            "rollout",
            {"roles__actor": {"resources": {"memory": BIG}}},
            4096,
            4096 * 1024 * KV_PER_TOKEN,
        ),
        # a mini-batch of all 4096 samples over 2 actor workers
        (
            "actor",
            {"roles__actor": {"replicas": 2}, "roles__rollout": {"resources": {"memory": BIG}}},
            2048,
            2048 * 1024 * ACTIVATIONS_PER_TOKEN,
        ),
        # a mini-batch of 2 samples over 2 actor workers: one sample each
        (
            "actor",
            {
                "roles__actor": {"replicas": 2},
                "roles__rollout": {"resources": {"memory": BIG}},
                "training__miniBatchSize": 2,
            },
            1,
            1 * 1024 * ACTIVATIONS_PER_TOKEN,
        ),
    ],
)
def test_size_bound_is_exact(role: str, settings: dict[str, Any], share: int, need: int) -> None:
    """A pod with exactly the memory the estimate needs passes; one byte less fails, and the
    message states the share of samples and the bytes (in GiB, or MiB below one GiB)."""
    base = {
        **SMALL,
        "data__rolloutBatchSize": 512,
        "data__samplesPerPrompt": 8,
        "data__maxPromptLength": 512,
        "data__maxResponseLength": 512,
    }
    key = f"roles__{role}"

    def with_memory(memory: int) -> PPOJobSpec:
        role_settings = {**settings.get(key, {}), "resources": {"memory": str(memory)}}
        return spec(**{**base, **settings, key: role_settings})

    assert check_sizes(with_memory(need), "spec") == []
    [problem] = check_sizes(with_memory(need - 1), "spec")
    assert problem.path == f"spec.roles.{role}.resources.memory"
    what = (
        "KV cache of its share of the rollout batch"
        if role == "rollout"
        else ("activations of one micro-batch")
    )
    assert f"the {role}'s {what} ({share} samples x 1024 tokens)" in problem.message
    shown = f"{need / 2**30:.1f} GiB" if need >= 2**30 else f"{need / 2**20:.1f} MiB"
    assert f"at least {shown}" in problem.message, problem.message


TABLE += [
    (
        check_reward_function,
        "a file name, not module:function",
        {"data__rewardFunction": "rewards.py"},
        ["spec.data.rewardFunction"],
    ),
    (
        check_megatron_splits,
        "a hub id named like a built-in is not split as the built-in",
        {"model__path": "tiny-llama", "roles__actor": {**GPU_ACTOR, "parallelism": {"tensor": 8}}},
        [],
    ),
]


# --- disruption settings (issue 22): the grace period with a checkpoint volume
TABLE += [
    (
        check_grace_period,
        "a 29 s grace period with a checkpoint volume",
        {
            "checkpointVolume": {"persistentVolumeClaim": {"claimName": "c"}},
            "training__checkpointDir": "/checkpoints",
            "failurePolicy__terminationGracePeriodSeconds": 29,
        },
        ["spec.failurePolicy.terminationGracePeriodSeconds"],
    ),
    (
        check_grace_period,
        "a 30 s grace period with a checkpoint volume",
        {
            "checkpointVolume": {"persistentVolumeClaim": {"claimName": "c"}},
            "training__checkpointDir": "/checkpoints",
            "failurePolicy__terminationGracePeriodSeconds": 30,
        },
        [],
    ),
]


PREFIX_253 = ".".join(c * 63 for c in "abc") + "." + "d" * 61  # a DNS subdomain of 253
GOOD_TEMPLATE = {
    "labels": {"team": "rl"},
    "annotations": {"karpenter.sh/do-not-disrupt": "true"},
    "env": [{"name": "HF_TOKEN", "valueFrom": {"secretKeyRef": {"name": "hf", "key": "token"}}}],
    "envFrom": [{"configMapRef": {"name": "settings"}}],
    "volumes": [{"name": "data", "persistentVolumeClaim": {"claimName": "data"}}],
    "volumeMounts": [{"name": "data", "mountPath": "/data", "readOnly": True}],
}
TABLE += [
    (
        check_pod_template,
        "labels, secrets, a volume and its mount",
        {"podTemplate": GOOD_TEMPLATE},
        [],
    ),
    (
        check_pod_template,
        "a label key prefix of 253 characters, a ConfigMap key and a Secret for the env, "
        "a mount below a trainer path",
        {
            "podTemplate": {
                "labels": {PREFIX_253 + "/x": "v"},
                "env": [
                    {"name": "STEP", "valueFrom": {"configMapKeyRef": {"name": "c", "key": "k"}}}
                ],
                "envFrom": [{"secretRef": {"name": "s"}}],
                "volumes": [{"name": "data", "emptyDir": {}}],
                "volumeMounts": [{"name": "data", "mountPath": "/ckpt/data"}],
            },
            "training__checkpointDir": "/ckpt",
        },
        [],
    ),
    (
        check_pod_template,
        "every reserved prefix, a key prefix of 254 characters, a label value, PPOJOB_, an env "
        "with no source, a volume name twice, mounts on the trainer's paths",
        {
            "podTemplate": {
                "labels": {
                    "app.kubernetes.io/managed-by": "me",
                    "scheduling.x-k8s.io/pod-group": "g",
                    PREFIX_253 + "d/x": "v",
                    "team": "Bad Value",
                },
                "annotations": {
                    "volcano.sh/queue-name": "q",
                    "yunikorn.apache.org/app-id": "a",
                    "kueue.x-k8s.io/queue-name": "q",
                },
                "env": [
                    {
                        "name": "PPOJOB_STEP",
                        "valueFrom": {"configMapKeyRef": {"name": "c", "key": "k"}},
                    },
                    {"name": "EMPTY", "valueFrom": {}},
                ],
                "envFrom": [{"secretRef": {"name": "s"}, "configMapRef": {"name": "c"}}],
                "volumes": [
                    {"name": "Bad", "emptyDir": {}},
                    {"name": "data", "emptyDir": {}},
                    {"name": "data", "emptyDir": {}},
                ],
                "volumeMounts": [
                    {"name": "data", "mountPath": "/ckpt/"},
                    {"name": "data", "mountPath": "/dev/shm"},
                ],
            },
            "training__checkpointDir": "/ckpt",
        },
        [
            "spec.podTemplate.labels.app.kubernetes.io/managed-by",
            "spec.podTemplate.labels.scheduling.x-k8s.io/pod-group",
            f"spec.podTemplate.labels.{PREFIX_253}d/x",
            "spec.podTemplate.annotations.volcano.sh/queue-name",
            "spec.podTemplate.annotations.yunikorn.apache.org/app-id",
            "spec.podTemplate.annotations.kueue.x-k8s.io/queue-name",
            "spec.podTemplate.labels.team",
            "spec.podTemplate.env[0].name",
            "spec.podTemplate.env[1].valueFrom",
            "spec.podTemplate.envFrom[0]",
            "spec.podTemplate.volumes[0].name",
            "spec.podTemplate.volumes[2].name",
            "spec.podTemplate.volumeMounts[0].mountPath",
            "spec.podTemplate.volumeMounts[1].mountPath",
        ],
    ),
    (
        check_pod_template,
        "a mount at a checkpoint dir written with a trailing slash",
        {
            "podTemplate": {
                "volumes": [{"name": "data", "emptyDir": {}}],
                "volumeMounts": [{"name": "data", "mountPath": "/ckpt"}],
            },
            "training__checkpointDir": "/ckpt/",
        },
        ["spec.podTemplate.volumeMounts[0].mountPath"],
    ),
    (
        check_pod_template,
        "mounts beside the checkpoint dir: its parent, a subdirectory X",
        {
            "podTemplate": {
                "volumes": [{"name": "data", "emptyDir": {}}],
                "volumeMounts": [{"name": "data", "mountPath": "/ckpt"}],
            },
            "training__checkpointDir": "/ckpt/X",
        },
        [],
    ),
    (
        check_pod_template,
        "a mount in a subdirectory X of the checkpoint dir",
        {
            "podTemplate": {
                "volumes": [{"name": "data", "emptyDir": {}}],
                "volumeMounts": [{"name": "data", "mountPath": "/ckpt/X"}],
            },
            "training__checkpointDir": "/ckpt",
        },
        [],
    ),
    (
        check_pod_template,
        "a mount without any volume",
        {"podTemplate": {"volumeMounts": [{"name": "x", "mountPath": "/x"}]}},
        ["spec.podTemplate.volumeMounts[0].name"],
    ),
    (
        check_pod_template,
        "reserved keys, two sources, a clash of volumes and mounts",
        {
            "podTemplate": {
                "labels": {"ppojob.io/job": "x", "bad key!": "v"},
                "annotations": {"ray.io/overwrite-container-cmd": "true"},
                "env": [
                    {
                        "name": "RAY_ADDRESS",
                        "valueFrom": {
                            "secretKeyRef": {"name": "a", "key": "b"},
                            "configMapKeyRef": {"name": "a", "key": "b"},
                        },
                    }
                ],
                "envFrom": [{}],
                "volumes": [{"name": "dshm", "emptyDir": {}}, {"name": "x"}],
                "volumeMounts": [
                    {"name": "y", "mountPath": "relative"},
                    {"name": "x", "mountPath": "/etc/ppojob/"},
                ],
            }
        },
        [
            "spec.podTemplate.labels.ppojob.io/job",
            "spec.podTemplate.labels.bad key!",
            "spec.podTemplate.annotations.ray.io/overwrite-container-cmd",
            "spec.podTemplate.env[0].name",
            "spec.podTemplate.env[0].valueFrom",
            "spec.podTemplate.envFrom[0]",
            "spec.podTemplate.volumes[0].name",
            "spec.podTemplate.volumes[1]",
            "spec.podTemplate.volumeMounts[0].name",
            "spec.podTemplate.volumeMounts[0].mountPath",
            "spec.podTemplate.volumeMounts[1].mountPath",
        ],
    ),
]


def test_every_check_has_a_table() -> None:
    """Each check has a row it passes and a row it fails."""
    for check in (*checks.TRAINING_CHECKS, *checks.CLUSTER_CHECKS):
        rows = [expected for c, _, _, expected in TABLE if c is check]
        assert any(rows) and [] in rows, f"{check.__name__} needs a failing and a passing row"


def test_prefix_is_the_path_of_every_problem() -> None:
    """The trainer checks its config file under `config`, not `spec`."""
    bad = spec(data__prompts="builtin:chess", training__minLearningRate=1.0)
    paths = [p.path for p in checks.check_training_half(bad, "config")]
    assert paths == ["config.training.minLearningRate", "config.data.prompts"]


def test_a_problem_two_checks_find_is_reported_once() -> None:
    """A training dataset and an eval dataset without a reward function: one problem."""
    doubled = spec(data__prompts="/data/p.jsonl", data__evalPrompts="/data/e.jsonl")
    found = checks.check_training_half(doubled)
    assert found == [
        Problem(
            "spec.data.rewardFunction",
            "a dataset needs a reward function",
            "set rewardFunction: package.module:function",
        )
    ]


def test_check_spec_runs_the_cluster_checks_after_the_training_ones() -> None:
    both = spec(data__prompts="builtin:chess", scheduling__gangScheduler="kueue")
    assert [p.path for p in checks.check_spec(both)] == [
        "spec.data.prompts",
        "spec.scheduling.queue",
    ]
    assert [p.path for p in checks.check_training_half(both)] == ["spec.data.prompts"]


@pytest.mark.parametrize(
    ("quantity", "expected"),
    [
        ("4Gi", 4 * 2**30),
        ("512M", 512e6),
        ("1000", 1000.0),
        ("1.5Ki", 1536.0),
        ("500m", 0.5),
        ("2e9", 2e9),
        ("1.5E3", 1500.0),
        (".5", 0.5),
        ("2.", 2.0),
        ("+1k", 1000.0),
        ("100n", 1e-7),
    ],
)
def test_quantity_bytes(quantity: str, expected: float) -> None:
    assert quantity_bytes(quantity) == expected


def test_a_model_path_holding_a_semicolon_keeps_its_message_and_fix_apart() -> None:
    """The message and the fix come from one "why; fix" string: a path that holds "; " itself
    stays whole in the message."""
    (problem,) = check_model_paths(spec(model__path="s3://a; b/model"), "spec")
    assert problem.message.startswith("'s3://a; b/model': URIs are not loaded by the trainer")
    assert problem.fix.startswith("copy the model into the image or a volume")


CALC = {"function": "builtin:calculator"}
ADD_TOOL = {
    "name": "add",
    "description": "a + b",
    "parameters": {
        "type": "object",
        "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}},
        "required": ["a", "b"],
    },
    "function": "my_tools:add",
}
CALC_TOOL = {"name": "calc", "function": "builtin:calculate"}
TABLE += [
    # --- multi-turn agents (data.agent)
    (check_agent, "no agent", {}, []),
    (
        check_agent,
        "the calculator on its own task",
        {"data__prompts": "builtin:calculator", "data__agent": CALC},
        [],
    ),
    (
        check_agent,
        "a user hook on a dataset",
        {"data__prompts": "/d.jsonl", "data__agent": {"function": "env.tools:step"}},
        [],
    ),
    (
        check_agent,
        "an unknown built-in agent",
        {"data__prompts": "builtin:calculator", "data__agent": {"function": "builtin:chess"}},
        ["spec.data.agent.function"],
    ),
    (
        check_agent,
        "a hook that is not module:function",
        {"data__agent": {"function": "tools.py"}},
        ["spec.data.agent.function"],
    ),
    (
        check_agent,
        "the calculator on another task",
        {"data__prompts": "builtin:count-up", "data__agent": CALC},
        ["spec.data.agent.function"],
    ),
    (
        check_agent,
        "an agent on sglang (training on megatron is accepted)",
        {
            "data__prompts": "builtin:calculator",
            "data__agent": CALC,
            "roles__rollout": {"backend": "sglang", "resources": {"gpus": 1}},
            "roles__actor": MEGATRON_CPU,
        },
        ["spec.roles.rollout.backend"],
    ),
    # --- declared tools (data.agent.tools)
    (
        check_agent,
        "declared tools",
        {"data__prompts": "/d.jsonl", "data__agent": {"tools": [ADD_TOOL, CALC_TOOL]}},
        [],
    ),
    (
        check_agent,
        "neither function nor tools",
        {"data__prompts": "/d.jsonl", "data__agent": {"maxTurns": 2}},
        ["spec.data.agent.function"],
    ),
    (
        check_agent,
        "function and tools",
        {"data__prompts": "/d.jsonl", "data__agent": {"function": "e.t:s", "tools": [ADD_TOOL]}},
        ["spec.data.agent"],
    ),
    (
        check_agent,
        "tools without the chat template",
        {
            "data__prompts": "/d.jsonl",
            "data__applyChatTemplate": False,
            "data__agent": {"tools": [ADD_TOOL]},
        },
        ["spec.data.agent.tools"],
    ),
    (
        check_agent,
        "bad tools",
        {
            "data__prompts": "/d.jsonl",
            "data__agent": {
                "tools": [
                    ADD_TOOL,
                    ADD_TOOL,
                    {**ADD_TOOL, "name": "b", "function": "builtin:shell"},
                    {**ADD_TOOL, "name": "c", "function": "tools.py"},
                    {**ADD_TOOL, "name": "d", "parameters": {"type": "string"}},
                    {**ADD_TOOL, "name": "e", "parameters": {"type": "object", "required": ["x"]}},
                    {**ADD_TOOL, "name": "f", "parameters": {"type": "object", "properties": 1}},
                    {**ADD_TOOL, "name": "g", "parameters": {"type": "object", "required": "x"}},
                    {**ADD_TOOL, "name": "h", "parameters": {"type": "object", "required": [1]}},
                ]
            },
        },
        [
            "spec.data.agent.tools[1].name",
            "spec.data.agent.tools[2].function",
            "spec.data.agent.tools[3].function",
            "spec.data.agent.tools[4].parameters.type",
            "spec.data.agent.tools[5].parameters.required",
            "spec.data.agent.tools[6].parameters.properties",
            "spec.data.agent.tools[7].parameters.required",
            "spec.data.agent.tools[8].parameters.required",
        ],
    ),
]


# --- experiment trackers: values their libraries and Kubernetes accept, no credentials
MLFLOW = {"type": "mlflow", "trackingUri": "http://mlflow.mlflow.svc:5000"}
WANDB = {"type": "wandb", "project": "ppo-demo", "secretRef": {"name": "wandb-key"}}
TABLE += [
    (
        check_trackers,
        "every tracker, well formed",
        {
            "trackers": [
                {"type": "tensorboard"},
                MLFLOW,
                {**MLFLOW, "trackingUri": "databricks"},
                WANDB,
            ]
        },
        [],
    ),
    (
        check_trackers,
        "a file store",
        {"trackers": [{**MLFLOW, "trackingUri": "file:/data/mlruns"}]},
        [],
    ),
    (
        check_trackers,
        "tracking URIs without a scheme, with a user or a password, without a host",
        {
            "trackers": [
                {**MLFLOW, "trackingUri": "mlflow.svc:5000/x y"},
                {**MLFLOW, "trackingUri": "mlruns"},
                {**MLFLOW, "trackingUri": "https://me:hunter2@mlflow.example.com"},
                {**MLFLOW, "trackingUri": "http:///api"},
                {**MLFLOW, "trackingUri": "https:///api"},
                {**MLFLOW, "trackingUri": "http://me@mlflow.example.com"},
                {**MLFLOW, "trackingUri": "https://me@mlflow.example.com"},
                {**MLFLOW, "trackingUri": "file://me:hunter2@host/data/mlruns"},
            ]
        },
        [f"spec.trackers[{i}].trackingUri" for i in range(8)],
    ),
    (
        check_trackers,
        "a W&B project with two characters W&B refuses, one with a leading space, a Secret name "
        "of 254 characters",
        {
            "trackers": [
                {**WANDB, "project": "a/b:c"},
                {**WANDB, "project": " ppo"},
                {**WANDB, "secretRef": {"name": PREFIX_253 + "d"}},
            ]
        },
        ["spec.trackers[0].project", "spec.trackers[1].project", "spec.trackers[2].secretRef.name"],
    ),
    (
        check_trackers,
        "a W&B Secret name of 253 characters",
        {"trackers": [{**WANDB, "secretRef": {"name": PREFIX_253}}]},
        [],
    ),
    (
        check_trackers,
        "a W&B project with a slash, an entity with a colon, a Secret name in capitals",
        {
            "trackers": [
                {**WANDB, "project": "team/ppo", "entity": "a:b", "secretRef": {"name": "Key"}}
            ]
        },
        ["spec.trackers[0].project", "spec.trackers[0].entity", "spec.trackers[0].secretRef.name"],
    ),
]


ELASTIC = {"replicas": 2, "elastic": {"minReplicas": 1, "maxReplicas": 3}}
TABLE += [
    # --- elastic rollout engines (roles.rollout.elastic)
    (check_elastic, "no elastic", {}, []),
    (check_elastic, "elastic torch engines of their own", {"roles__rollout": ELASTIC}, []),
    (
        check_elastic,
        "elastic bounds of one value, replicas at them",
        {"roles__rollout": {"replicas": 3, "elastic": {"minReplicas": 3, "maxReplicas": 3}}},
        [],
    ),
    (
        check_elastic,
        "elastic and colocated",
        {"roles__rollout": {"colocateWithActor": True, "elastic": {"maxReplicas": 2}}},
        ["spec.roles.rollout.elastic"],
    ),
    (
        check_elastic,
        "elastic sglang engines",
        {"roles__rollout": {**ELASTIC, "backend": "sglang", "resources": {"gpus": 1}}},
        ["spec.roles.rollout.elastic"],
    ),
    (
        check_elastic,
        "elastic with two GPUs a pod",
        {"roles__rollout": {**ELASTIC, "resources": {"gpus": 2}}},
        ["spec.roles.rollout.resources.gpus"],
    ),
    (
        check_elastic,
        "min above max",
        {"roles__rollout": {"replicas": 2, "elastic": {"minReplicas": 3, "maxReplicas": 2}}},
        ["spec.roles.rollout.elastic.minReplicas"],
    ),
    (
        check_elastic,
        "replicas outside the bounds",
        {"roles__rollout": {"replicas": 4, "elastic": {"minReplicas": 1, "maxReplicas": 3}}},
        ["spec.roles.rollout.replicas"],
    ),
    (
        check_elastic,
        "elastic with dynamic sampling",
        {
            "roles__rollout": ELASTIC,
            "algorithm__advantageEstimator": "grpo",
            "data__samplesPerPrompt": 4,
            "algorithm__dynamicSampling": {},
        },
        ["spec.roles.rollout.elastic"],
    ),
]


# --- roles.reward: reward-model workers of their own
RM = {"model": {"path": "/models/rm"}}
TABLE += [
    (
        check_reward_role,
        "two GPU reward workers holding a reward model",
        {
            "roles__reward": {"replicas": 2, "resources": {"gpus": 1}},
            "data__prompts": "/data/p.jsonl",
            "data__rewards": [{"function": "m:f"}, RM],
        },
        [],
    ),
    (
        check_reward_role,
        "no reward role, a reward model in the engines",
        {"data__rewards": [RM]},
        [],
    ),
    (
        check_reward_role,
        "reward workers without a reward model, with tensor parallelism",
        {
            "roles__reward": {"parallelism": {"tensor": 2}, "resources": {"gpus": 2}},
            "data__rewards": [{"function": "builtin:count-up"}],
        },
        ["spec.roles.reward", "spec.roles.reward.parallelism"],
    ),
    (
        check_reward_role,
        "a CPU reward worker whose reward model runs on the CPU",
        {
            "roles__reward": {"resources": {"gpus": 0}},
            "data__rewards": [{"model": {"path": "/models/rm", "device": "cpu"}}],
        },
        [],
    ),
    (
        check_reward_role,
        "a GPU reward worker whose only reward model runs on the CPU",
        {
            "roles__reward": {"resources": {"gpus": 1}},
            "data__rewards": [{"model": {"path": "/models/rm", "device": "cpu"}}],
        },
        ["spec.roles.reward.resources.gpus"],
    ),
    (
        check_reward_role,
        "reward workers and no data.rewards",
        {"roles__reward": {"replicas": 1}},
        ["spec.roles.reward"],
    ),
    (
        check_env,
        "a reward worker sets CUDA_VISIBLE_DEVICES",
        {
            "roles__reward": {"env": [{"name": "CUDA_VISIBLE_DEVICES", "value": "0"}]},
            "data__rewards": [RM],
        },
        ["spec.roles.reward.env[0].name"],
    ),
    (
        check_extended_resources,
        "a reward worker asks for cpu as an extended resource",
        {"roles__reward": {"resources": {"extra": {"cpu": 1}}}, "data__rewards": [RM]},
        ["spec.roles.reward.resources.extra.cpu"],
    ),
    (
        check_ray_memory,
        "a reward worker pod of 100Mi",
        {"roles__reward": {"resources": {"memory": "100Mi"}}, "data__rewards": [RM]},
        ["spec.roles.reward.resources.memory"],
    ),
    (
        check_pod_fields,
        "a reward worker's bad node selector",
        {"roles__reward": {"nodeSelector": {"bad key!": "x"}}, "data__rewards": [RM]},
        ["spec.roles.reward.nodeSelector.bad key!"],
    ),
]


# --- roles.sandbox: the agent's tool calls on workers of their own
SANDBOX_AGENT = {
    "data__prompts": "builtin:calculator",
    "data__agent": {"function": "builtin:calculator"},
}
TABLE += [
    (
        check_sandbox_role,
        "three sandbox workers under gVisor (a dotted RuntimeClass name) running the calculator",
        {
            "roles__sandbox": {
                "replicas": 3,
                "resources": {"cpus": 2},
                "runtimeClassName": "runsc.gvisor.dev",
            },
            **SANDBOX_AGENT,
        },
        [],
    ),
    (
        check_sandbox_role,
        "no sandbox role, the tools in the engines",
        SANDBOX_AGENT,
        [],
    ),
    (
        check_sandbox_role,
        "sandbox workers with declared tools",
        {
            "roles__sandbox": {"replicas": 1},
            "data__agent": {
                "tools": [
                    {
                        "name": "calc",
                        "function": "builtin:calculator",
                        "parameters": {"type": "object"},
                    }
                ]
            },
        },
        [],
    ),
    (
        check_sandbox_role,
        "sandbox workers and no data.agent",
        {"roles__sandbox": {"replicas": 1}},
        ["spec.roles.sandbox"],
    ),
    (
        check_sandbox_role,
        "a sandbox worker with one GPU",
        {"roles__sandbox": {"resources": {"gpus": 1}}, **SANDBOX_AGENT},
        ["spec.roles.sandbox.resources.gpus"],
    ),
    (
        check_sandbox_role,
        "a sandbox worker with a GPU and tensor parallelism",
        {
            "roles__sandbox": {"resources": {"gpus": 2}, "parallelism": {"tensor": 2}},
            **SANDBOX_AGENT,
        },
        ["spec.roles.sandbox.resources.gpus", "spec.roles.sandbox.parallelism"],
    ),
    (
        check_sandbox_role,
        "a runtime class name in capitals",
        {"roles__sandbox": {"runtimeClassName": "gVisor"}, **SANDBOX_AGENT},
        ["spec.roles.sandbox.runtimeClassName"],
    ),
    (
        check_sandbox_role,
        "a runtime class name ending in a dot",
        {"roles__sandbox": {"runtimeClassName": "kata."}, **SANDBOX_AGENT},
        ["spec.roles.sandbox.runtimeClassName"],
    ),
    (
        check_env,
        "a sandbox worker sets RAY_ADDRESS",
        {"roles__sandbox": {"env": [{"name": "RAY_ADDRESS", "value": "x"}]}, **SANDBOX_AGENT},
        ["spec.roles.sandbox.env[0].name"],
    ),
    (
        check_extended_resources,
        "a sandbox worker asks for memory as an extended resource",
        {"roles__sandbox": {"resources": {"extra": {"memory": 1}}}, **SANDBOX_AGENT},
        ["spec.roles.sandbox.resources.extra.memory"],
    ),
    (
        check_ray_memory,
        "a sandbox worker pod of 100Mi",
        {"roles__sandbox": {"resources": {"memory": "100Mi"}}, **SANDBOX_AGENT},
        ["spec.roles.sandbox.resources.memory"],
    ),
    (
        check_pod_fields,
        "a sandbox worker's bad toleration",
        {
            "roles__sandbox": {"tolerations": [{"key": "bad key!", "operator": "Exists"}]},
            **SANDBOX_AGENT,
        },
        ["spec.roles.sandbox.tolerations[0].key"],
    ),
]


# --- mixture-of-experts models and routing replay
REPLAY = {"algorithm__routingReplay": "rollout"}
AUX = {"algorithm__routerAuxLossCoefficient": 0.01}
MOE_MODEL = {"model__path": "builtin:tiny-qwen3-moe"}
MODELS = Path(__file__).with_name("models")
"""Model directories (a config.json each) of the rows below; check_messages.txt names them
relative to the repository (``_every_message``)."""
OTHER_MOE = {"model__path": str(MODELS / "tiny-deepseek-v3")}
TABLE += [
    (check_routing_replay, "replay on a built-in MoE model", {**REPLAY, **MOE_MODEL}, []),
    (check_routing_replay, "no replay on a dense model", {}, []),
    (
        check_routing_replay,
        "replay on a dense model",
        REPLAY,
        ["spec.algorithm.routingReplay"],
    ),
    (
        check_routing_replay,
        "replay on a megatron actor (megatron-core's RouterReplay)",
        {**REPLAY, "model__path": "builtin:tiny-mixtral", "roles__actor": MEGATRON_CPU},
        [],
    ),
    (
        check_routing_replay,
        "replay on a megatron actor, multi-turn",
        {
            **REPLAY,
            "model__path": "builtin:tiny-mixtral",
            "roles__actor": MEGATRON_CPU,
            **SANDBOX_AGENT,
        },
        ["spec.algorithm.routingReplay"],
    ),
    (
        check_routing_replay,
        "replay on a hub model (told at load)",
        {**REPLAY, "model__path": "org/m"},
        [],
    ),
    (
        check_router_aux_loss,
        "a load-balancing loss on a MoE model, megatron actor",
        {**AUX, "model__path": "builtin:tiny-mixtral", "roles__actor": MEGATRON_CPU},
        [],
    ),
    (check_router_aux_loss, "no load-balancing loss on a dense model", {}, []),
    (
        check_router_aux_loss,
        "a load-balancing loss on a dense model",
        AUX,
        ["spec.algorithm.routerAuxLossCoefficient"],
    ),
    (
        check_router_aux_loss,
        "a load-balancing loss on a MoE architecture the trainer does not drive",
        {**AUX, **OTHER_MOE},
        ["spec.algorithm.routerAuxLossCoefficient"],
    ),
    (check_moe_backends, "a MoE model on torch roles", MOE_MODEL, []),
    (
        check_moe_backends,
        "Qwen3-MoE and Mixtral models on a megatron actor and critic",
        {
            **MOE_MODEL,
            "model__criticPath": "builtin:tiny-mixtral",
            "roles__actor": MEGATRON_CPU,
            "roles__critic": {"backend": "megatron"},
        },
        [],
    ),
    (
        check_moe_backends,
        "another MoE architecture on a megatron actor and critic",
        {**OTHER_MOE, "roles__actor": MEGATRON_CPU, "roles__critic": {"backend": "megatron"}},
        ["spec.roles.actor.backend", "spec.roles.critic.backend"],
    ),
    (
        check_moe_backends,
        "another MoE architecture as the critic only, on megatron",
        {
            **MOE_MODEL,
            "model__criticPath": OTHER_MOE["model__path"],
            "roles__actor": MEGATRON_CPU,
            "roles__critic": {"backend": "megatron"},
        },
        ["spec.roles.critic.backend"],
    ),
    (check_moe_backends, "another MoE architecture on torch roles", OTHER_MOE, []),
]

# --- expert parallelism (parallelism.expert): megatron only, a MoE model, dividing dp and experts
EP = {"parallelism": {"expert": 2}}
TABLE += [
    (
        check_backends,
        "expert parallelism on torch actor and critic, and an sglang rollout",
        {
            **MOE_MODEL,
            "roles__actor": {"replicas": 2, **EP},
            "roles__critic": EP,
            "roles__rollout": {**SGLANG_GPU, **EP},
        },
        [
            "spec.roles.actor.parallelism.expert",
            "spec.roles.critic.parallelism.expert",
            "spec.roles.rollout.parallelism.expert",
        ],
    ),
    (
        check_backends,
        "expert parallelism on a torch rollout",
        {**MOE_MODEL, "roles__rollout": EP},
        ["spec.roles.rollout.parallelism.expert"],
    ),
    (
        check_backends,
        "expert parallelism on a megatron actor and critic",
        {**MOE_MODEL, "roles__actor": {**GPU_ACTOR, **EP}, "roles__critic": {**GPU_ACTOR, **EP}},
        [],
    ),
    (
        check_expert_parallel,
        "expert 2 and 8 on megatron roles of 8 data-parallel ranks, 8 experts",
        {
            **MOE_MODEL,
            "roles__actor": {**GPU_ACTOR, **EP},
            "roles__critic": {**GPU_ACTOR, "parallelism": {"expert": 8}},
        },
        [],
    ),
    (
        check_expert_parallel,
        "expert 2 on torch roles (check_backends refuses it)",
        {**MOE_MODEL, "roles__actor": {"replicas": 2, **EP}, "roles__critic": EP},
        [],
    ),
    (
        check_expert_parallel,
        "expert 2 with a dense model",
        {"roles__actor": {**GPU_ACTOR, **EP}},
        ["spec.roles.actor.parallelism.expert"],
    ),
    (
        check_expert_parallel,
        "expert 2 with a known dense hub model",
        {"model__path": "Qwen/Qwen2.5-7B-Instruct", "roles__actor": {**GPU_ACTOR, **EP}},
        ["spec.roles.actor.parallelism.expert"],
    ),
    (
        check_expert_parallel,
        "expert 4 of 2 data-parallel ranks (8 GPUs / tensor 4)",
        {**MOE_MODEL, "roles__actor": {**GPU_ACTOR, "parallelism": {"tensor": 4, "expert": 4}}},
        ["spec.roles.actor.parallelism.expert"],
    ),
    (
        check_expert_parallel,
        "expert 2 of 4 data-parallel ranks (8 GPUs / pipeline 2)",
        {**MOE_MODEL, "roles__actor": {**GPU_ACTOR, "parallelism": {"pipeline": 2, "expert": 2}}},
        [],
    ),
    (
        check_expert_parallel,
        "expert 2 on a colocated critic of the actor's 3 data-parallel ranks",
        {
            **MOE_MODEL,
            "roles__actor": {**GPU_ACTOR, "replicas": 3, "resources": {"gpus": 1}, **EP},
            "roles__critic": {"backend": "megatron", "colocateWithActor": True, **EP},
        },
        ["spec.roles.actor.parallelism.expert", "spec.roles.critic.parallelism.expert"],
    ),
    (
        check_expert_parallel,
        "expert 4 of a critic's own 2 data-parallel ranks (the actor has 8)",
        {
            **MOE_MODEL,
            "roles__actor": {**GPU_ACTOR, "parallelism": {"expert": 4}},
            "roles__critic": {**GPU_ACTOR, "resources": {"gpus": 2}, "parallelism": {"expert": 4}},
        },
        ["spec.roles.critic.parallelism.expert"],
    ),
    (
        check_expert_parallel,
        "expert 3 divides 12 data-parallel ranks but not 8 experts",
        {
            **MOE_MODEL,
            "roles__actor": {
                **GPU_ACTOR,
                "replicas": 3,
                "resources": {"gpus": 4},
                "parallelism": {"expert": 3},
            },
        },
        ["spec.roles.actor.parallelism.expert"],
    ),
    (
        check_expert_parallel,
        "expert 4 of a config.json's 6 experts",
        {
            "model__path": str(MODELS / "tiny-qwen3-moe-6-experts"),
            "roles__actor": {**GPU_ACTOR, "parallelism": {"expert": 4}},
        },
        ["spec.roles.actor.parallelism.expert"],
    ),
    (
        check_expert_parallel,
        "expert 2 of a config.json's 6 experts; the critic's own dense model",
        {
            "model__path": str(MODELS / "tiny-qwen3-moe-6-experts"),
            "model__criticPath": "builtin:tiny-llama",
            "roles__actor": {**GPU_ACTOR, **EP},
            "roles__critic": {**GPU_ACTOR, **EP},
        },
        ["spec.roles.critic.parallelism.expert"],
    ),
    (
        check_expert_parallel,
        "expert 16 of a hub model's 128 experts (Qwen3-30B-A3B), 16 data-parallel ranks",
        {
            "model__path": "Qwen/Qwen3-30B-A3B",
            "roles__actor": {**GPU_ACTOR, "replicas": 2, "parallelism": {"expert": 16}},
        },
        [],
    ),
    (
        check_expert_parallel,
        "expert 2 of a hub model the plan does not know (told at load)",
        {"model__path": "org/m", "roles__actor": {**GPU_ACTOR, **EP}},
        [],
    ),
    (
        check_megatron_colocated_critic,
        "colocated megatron critic with another expert size",
        {
            **MOE_MODEL,
            "roles__actor": {**GPU_ACTOR, **EP},
            "roles__critic": {"backend": "megatron", "colocateWithActor": True},
        },
        ["spec.roles.critic.parallelism"],
    ),
    (
        check_megatron_colocated_critic,
        "colocated megatron critic with the actor's expert size",
        {
            **MOE_MODEL,
            "roles__actor": {**GPU_ACTOR, **EP},
            "roles__critic": {"backend": "megatron", "colocateWithActor": True, **EP},
        },
        [],
    ),
]


# ---------------------------------------------------------------- what the user reads, verbatim
MESSAGES = Path(__file__).with_name("check_messages.txt")


def _every_message() -> str:
    lines = []
    for check, name, settings, _ in TABLE:
        for problem in check(spec(**settings), "spec"):
            lines.append(f"{check.__name__} | {name} | {problem}")
    repo = str(Path(__file__).resolve().parents[2]) + "/"
    return "\n".join(lines).replace(repo, "") + "\n"


def test_every_message_and_fix_reads_as_recorded() -> None:
    """The full text of every problem the tables produce (field, message, fix), as a user reads
    it in `ppojob validate` and the PPOJob's condition. A change of wording is a change a user
    sees: review it in the diff of check_messages.txt, then record it with
    `PPOJOB_RECORD_MESSAGES=1 pytest tests/api/test_checks.py -k reads_as_recorded`."""
    text = _every_message()
    if os.environ.get("PPOJOB_RECORD_MESSAGES") == "1":
        MESSAGES.write_text(text)
    recorded = MESSAGES.read_text().splitlines()
    assert text.splitlines() == recorded


def test_sglang_top_p_with_importance_sampling_is_refused_by_validation() -> None:
    """The check runs in validation (registered), not only when called by name."""
    doubled = spec(
        roles__rollout={"backend": "sglang", "resources": {"gpus": 1}},
        data__topP=0.9,
        algorithm__tisCap=2.0,
    )
    assert "spec.algorithm.tisCap" in [p.path for p in checks.check_training_half(doubled)]


def test_reward_workers_without_a_reward_model_are_refused_by_validation() -> None:
    """check_reward_role runs in validation (registered), not only when called by name."""
    lonely = spec(roles__reward={"replicas": 1})
    assert "spec.roles.reward" in [p.path for p in checks.check_training_half(lonely)]


def test_sandbox_workers_without_an_agent_are_refused_by_validation() -> None:
    """check_sandbox_role runs in validation (registered), not only when called by name."""
    lonely = spec(roles__sandbox={"replicas": 1})
    assert "spec.roles.sandbox" in [p.path for p in checks.check_training_half(lonely)]


def test_the_affinity_table_is_kubernetes_own() -> None:
    """checks/pods.py's table of core/v1 Affinity (every type it reaches, every field and its
    type) is exactly what the `kubernetes` client's models say."""
    reached: dict[str, dict[str, str]] = {}

    def walk(name: str) -> None:
        if name in reached:
            return
        cls = getattr(models, name)
        reached[name] = {cls.attribute_map[k]: t for k, t in cls.openapi_types.items()}
        for t in reached[name].values():
            inner = re.fullmatch(r"List\[(\w+)\]", t)
            t = inner.group(1) if inner else t
            if t.startswith("V1"):
                walk(t)

    walk("V1Affinity")
    assert reached == AFFINITY_TYPES


def test_a_token_budget_below_the_longest_sequence_is_refused_by_validation() -> None:
    """check_packing runs in validation (registered), not only when called by name."""
    small = spec(training__maxTokensPerMicroBatch=16)
    paths = [p.path for p in checks.check_training_half(small)]
    assert "spec.training.maxTokensPerMicroBatch" in paths


# --- the memory a Ray pod starts with (issue 23): the head and each role with pods of its own
TABLE += [
    (check_ray_memory, "250Mi head, 1Gi roles", {"head__memory": "250Mi"}, []),
    (
        check_ray_memory,
        "a 64Mi head and a 249Mi actor",
        {"head__memory": "64Mi", "roles__actor__resources": {"memory": "249Mi"}},
        ["spec.head.memory", "spec.roles.actor.resources.memory"],
    ),
    (
        check_ray_memory,
        "a small critic and rollout with pods of their own",
        {
            "roles__critic": {"replicas": 1, "resources": {"memory": "100Mi"}},
            "roles__rollout": {"replicas": 1, "resources": {"memory": "0.2Gi"}},
        },
        ["spec.roles.critic.resources.memory", "spec.roles.rollout.resources.memory"],
    ),
    (
        check_ray_memory,
        "colocated roles have no pods of their own (their resources are the actor's)",
        {
            "roles__critic": {"colocateWithActor": True, "resources": {"memory": "100Mi"}},
            "roles__rollout": {"colocateWithActor": True, "resources": {"memory": "100Mi"}},
        },
        [],
    ),
]


# --- a MoE model under megatron tensor parallelism needs sequence parallelism
TABLE += [
    (
        check_moe_tensor_parallel,
        "tensor 2 without sequence parallelism on a MoE megatron actor and its critic",
        {
            **MOE_MODEL,
            "roles__actor": {**GPU_ACTOR, "parallelism": {"tensor": 2}},
            "roles__critic": {**GPU_ACTOR, "parallelism": {"tensor": 2}},
        },
        [
            "spec.roles.actor.parallelism.sequenceParallel",
            "spec.roles.critic.parallelism.sequenceParallel",
        ],
    ),
    (
        check_moe_tensor_parallel,
        "tensor 2 with sequence parallelism on a MoE megatron actor",
        {
            **MOE_MODEL,
            "roles__actor": {
                **GPU_ACTOR,
                "parallelism": {"tensor": 2, "sequenceParallel": True},
            },
        },
        [],
    ),
    (
        check_moe_tensor_parallel,
        "tensor 2 without sequence parallelism on a dense megatron actor",
        {"roles__actor": {**GPU_ACTOR, "parallelism": {"tensor": 2}}},
        [],
    ),
    (
        check_moe_tensor_parallel,
        "tensor 2 on a MoE torch actor (FSDP2: no tensor parallelism to mind)",
        {**MOE_MODEL, "roles__actor": {"parallelism": {"tensor": 2}}},
        [],
    ),
]


# ---------------------------------------------------------------- every row above, each on its own
# (last in the file: the parametrisation reads TABLE when the decorator runs, so a row added
# after it would be left out)
@pytest.mark.parametrize(
    ("check", "settings", "expected"),
    [pytest.param(c, s, e, id=f"{c.__name__}: {name}") for c, name, s, e in TABLE],
)
def test_check(check: Any, settings: dict[str, Any], expected: list[str]) -> None:
    found = check(spec(**settings), "spec")
    assert [p.path for p in found] == expected, [str(p) for p in found]
    assert check(spec(**settings)) == found  # `spec` is the default prefix
    for problem in found:
        assert problem.message and problem.fix, f"{problem} needs a message and a fix"
