"""PPOJob manifests shared by the API, operator and docs tests: a realistic GPU job, the invalid
variants every entry point must refuse (each with the field path its error names), and the
layouts and gang schedulers the operator's builders are checked over."""

from __future__ import annotations

import copy
from typing import Any

GPU_JOB: dict[str, Any] = {
    "apiVersion": "ppojob.io/v1alpha1",
    "kind": "PPOJob",
    "metadata": {"name": "qwen-7b", "namespace": "ml"},
    "spec": {
        "image": "registry.example.com/ppojob-trainer:0.1.0",
        "model": {"path": "/models/qwen2.5-7b", "dtype": "bfloat16"},
        "roles": {
            "actor": {
                "replicas": 2,
                "resources": {"gpus": 8, "cpus": 64, "memory": "512Gi"},
                "parallelism": {"tensor": 4},
                "backend": "megatron",
            },
            "critic": {
                "replicas": 1,
                "resources": {"gpus": 8, "cpus": 64, "memory": "512Gi"},
                "parallelism": {"tensor": 4},
                "backend": "megatron",
                "overrides": {"learningRate": 5e-6},
            },
            "rollout": {
                "replicas": 1,
                "resources": {"gpus": 8},
                "backend": "sglang",
                "parallelism": {"tensor": 2},
            },
        },
        "algorithm": {"advantageEstimator": "gae", "kl": {"coefficient": 0.01}},
        "data": {
            "prompts": "/data/math.jsonl",
            "rewardFunction": "rewards.math:score",
            "rolloutBatchSize": 64,
            "samplesPerPrompt": 4,
        },
        "training": {"steps": 500, "miniBatchSize": 64, "microBatchSize": 2, "learningRate": 1e-6},
        "scheduling": {"gangScheduler": "volcano", "queue": "research"},
    },
}


def set_path(doc: dict[str, Any], dotted: str, value: Any) -> dict[str, Any]:
    """A deep copy of `doc` with the field at the dotted path set to `value` (DELETE: removed)."""
    doc = copy.deepcopy(doc)
    node = doc
    keys = dotted.split(".")
    for key in keys[:-1]:
        node = node.setdefault(key, {})
    if value is DELETE:
        node.pop(keys[-1], None)
    else:
        node[keys[-1]] = value
    return doc


DELETE = object()  # set_path(doc, path, DELETE) removes the field

# (description, mutation path, value, field path the error must name)
INVALID: list[tuple[str, str, Any, str]] = [
    ("unknown top-level spec field", "spec.imagee", "x", "spec.imagee"),
    ("missing image", "spec.image", DELETE, "spec.image"),
    ("replicas as a string", "spec.roles.actor.replicas", "two", "spec.roles.actor.replicas"),
    ("zero replicas", "spec.roles.actor.replicas", 0, "spec.roles.actor.replicas"),
    ("negative gpus", "spec.roles.rollout.resources.gpus", -1, "spec.roles.rollout.resources.gpus"),
    (
        "bad memory quantity",
        "spec.roles.actor.resources.memory",
        "lots",
        "spec.roles.actor.resources.memory",
    ),
    ("unknown backend", "spec.roles.actor.backend", "deepspeed", "spec.roles.actor.backend"),
    (
        "sglang is not a training backend",
        "spec.roles.critic.backend",
        "sglang",
        "spec.roles.critic.backend",
    ),
    (
        "gpus not divisible by tp",
        "spec.roles.actor.parallelism.tensor",
        3,
        "spec.roles.actor.parallelism",
    ),
    (
        "gpus not divisible by tp*pp*cp",
        "spec.roles.critic.parallelism",
        {"tensor": 4, "pipeline": 2, "context": 2},
        "spec.roles.critic.parallelism",
    ),
    (
        "override changes GPU count",
        "spec.roles.critic.overrides",
        {"numGpusPerNode": 4},
        "spec.roles.critic.overrides.numGpusPerNode",
    ),
    (
        "override changes node count",
        "spec.roles.critic.overrides",
        {"critic_num_nodes": 2},
        "spec.roles.critic.overrides.critic_num_nodes",
    ),
    (
        "override of an unknown setting",
        "spec.roles.critic.overrides",
        {"learningRat": 1e-5},
        "spec.roles.critic.overrides.learningRat",
    ),
    (
        "override with a bad value",
        "spec.roles.critic.overrides",
        {"learningRate": -1},
        "spec.roles.critic.overrides.learningRate",
    ),
    (
        "malformed reward hook",
        "spec.data.rewardFunction",
        "rewards.math.score",
        "spec.data.rewardFunction",
    ),
    (
        "malformed advantage hook",
        "spec.algorithm.customAdvantageFunction",
        "mod:fn:x",
        "spec.algorithm.customAdvantageFunction",
    ),
    (
        "mini-batch does not divide the step",
        "spec.training.miniBatchSize",
        100,
        "spec.training.miniBatchSize",
    ),
    (
        "micro-batch does not divide a worker's share",
        "spec.training.microBatchSize",
        3,
        "spec.training.microBatchSize",
    ),
    (
        "critic mini-batch override does not divide",
        "spec.roles.critic.overrides",
        {"miniBatchSize": 96},
        "spec.roles.critic.overrides.miniBatchSize",
    ),
    (
        "KL loss with k1",
        "spec.algorithm.kl",
        {"coefficient": 0.1, "mode": "loss"},
        "spec.algorithm.kl.estimator",
    ),
    (
        "adaptive KL without coefficient",
        "spec.algorithm.kl",
        {"target": 6.0},
        "spec.algorithm.kl.target",
    ),
    (
        "adaptive KL as a loss",
        "spec.algorithm.kl",
        {"coefficient": 0.1, "target": 6, "mode": "loss", "estimator": "k3"},
        "spec.algorithm.kl.target",
    ),
    ("unknown KL estimator", "spec.algorithm.kl.estimator", "k4", "spec.algorithm.kl.estimator"),
    (
        "unknown estimator",
        "spec.algorithm.advantageEstimator",
        "ppo2",
        "spec.algorithm.advantageEstimator",
    ),
    ("gamma above 1", "spec.algorithm.gamma", 1.5, "spec.algorithm.gamma"),
    ("dual clip not above 1", "spec.algorithm.dualClip", 0.5, "spec.algorithm.dualClip"),
    ("temperature zero", "spec.data.temperature", 0, "spec.data.temperature"),
    (
        "unknown gang scheduler",
        "spec.scheduling.gangScheduler",
        "slurm",
        "spec.scheduling.gangScheduler",
    ),
    ("megatron on CPU in bfloat16", "spec.roles.actor.resources.gpus", 0, "spec.model.dtype"),
    (
        "colocated rollout with its own replicas",
        "spec.roles.rollout",
        {"colocateWithActor": True, "replicas": 3, "backend": "sglang"},
        "spec.roles.rollout.replicas",
    ),
    (
        "colocated critic with its own GPUs",
        "spec.roles.critic",
        {
            "colocateWithActor": True,
            "resources": {"gpus": 4},
            "backend": "megatron",
            "parallelism": {"tensor": 4},
        },
        "spec.roles.critic.resources",
    ),
    ("unknown built-in task", "spec.data.prompts", "builtin:chess", "spec.data.prompts"),
    (
        "toleration with a bad operator",
        "spec.roles.actor.tolerations",
        [{"key": "gpu", "operator": "Maybe"}],
        "spec.roles.actor.tolerations[0].operator",
    ),
    (
        "checkpoint volume with a relative dir",
        "spec.checkpointVolume",
        {"persistentVolumeClaim": {"claimName": "ckpt"}},
        "spec.training.checkpointDir",
    ),
    (
        "kueue without a queue",
        "spec.scheduling",
        {"gangScheduler": "kueue"},
        "spec.scheduling.queue",
    ),
]

# Realistic mistakes that passed before (issue 15): names Kubernetes or KubeRay refuse, types the
# API server refuses, numbers that are not numbers, label values too long, impossible sizes.
INVALID += [
    ("name with upper case and '_'", "metadata.name", "Bad_Name", "metadata.name"),
    ("name with dots", "metadata.name", "tiny.count.up", "metadata.name"),
    ("name of 70 characters", "metadata.name", "a" * 70, "metadata.name"),
    ("name of 48 characters", "metadata.name", "qwen-" + "x" * 43, "metadata.name"),
    ("missing name", "metadata.name", DELETE, "metadata.name"),
    ("name starting with a digit", "metadata.name", "7b-ppo", "metadata.name"),
    ("name ending with '-'", "metadata.name", "qwen-7b-", "metadata.name"),
    ("non-ASCII name", "metadata.name", "qwen-7b-\u00e9t\u00e9", "metadata.name"),
    (
        "generateName too long",
        "metadata",
        {"generateName": "g" * 43 + "-"},
        "metadata.generateName",
    ),
    ("namespace with upper case", "metadata.namespace", "ML-Team", "metadata.namespace"),
    ("namespace with '_'", "metadata.namespace", "ml_team", "metadata.namespace"),
    ("steps: true", "spec.training.steps", True, "spec.training.steps"),
    ("steps as a quoted number", "spec.training.steps", "500", "spec.training.steps"),
    ("replicas: true", "spec.roles.actor.replicas", True, "spec.roles.actor.replicas"),
    (
        "gpus as a quoted number",
        "spec.roles.actor.resources.gpus",
        "8",
        "spec.roles.actor.resources.gpus",
    ),
    (
        "cpus not a Kubernetes quantity",
        "spec.roles.actor.resources.cpus",
        "64 cores",
        "spec.roles.actor.resources.cpus",
    ),
    (
        "timeoutSeconds as a string",
        "spec.scheduling.timeoutSeconds",
        "600",
        "spec.scheduling.timeoutSeconds",
    ),
    ("resume: 'yes' as a string", "spec.training.resume", "yes", "spec.training.resume"),
    ("suspend: 1", "spec.suspend", 1, "spec.suspend"),
    ("shuffle: 'false' as a string", "spec.data.shuffle", "false", "spec.data.shuffle"),
    (
        "infinite entropy coefficient",
        "spec.algorithm.entropyCoefficient",
        float("inf"),
        "spec.algorithm.entropyCoefficient",
    ),
    (
        "infinite KL coefficient",
        "spec.algorithm.kl.coefficient",
        float("inf"),
        "spec.algorithm.kl.coefficient",
    ),
    ("NaN weight decay", "spec.training.weightDecay", float("nan"), "spec.training.weightDecay"),
    ("infinite adamEps", "spec.training.adamEps", float("inf"), "spec.training.adamEps"),
    ("NaN value clip", "spec.algorithm.valueClip", float("nan"), "spec.algorithm.valueClip"),
    (
        "queue name longer than a label",
        "spec.scheduling.queue",
        "research-" + "q" * 60,
        "spec.scheduling.queue",
    ),
    ("queue name with a space", "spec.scheduling.queue", "research team", "spec.scheduling.queue"),
    (
        # a label value, but Kueue's webhook refuses it: not a LocalQueue name
        "kueue queue with upper case and '_'",
        "spec.scheduling",
        {"gangScheduler": "kueue", "queue": "Team_A"},
        "spec.scheduling.queue",
    ),
    (
        "priority class with a space",
        "spec.scheduling.priorityClassName",
        "high priority",
        "spec.scheduling.priorityClassName",
    ),
]

# Expert parallelism (parallelism.expert): megatron roles only, dividing the data-parallel size
# (GPU_JOB's actor: 16 GPUs / tensor 4 = 4 ranks) and a MoE model's number of experts.
INVALID += [
    (
        "expert parallelism on the sglang rollout",
        "spec.roles.rollout.parallelism.expert",
        2,
        "spec.roles.rollout.parallelism.expert",
    ),
    (
        "expert 8 of the actor's 4 data-parallel ranks",
        "spec.roles.actor.parallelism.expert",
        8,
        "spec.roles.actor.parallelism.expert",
    ),
    (
        "expert above the schema's 1024",
        "spec.roles.critic.parallelism.expert",
        2048,
        "spec.roles.critic.parallelism.expert",
    ),
]

GRPO_INVALID: list[tuple[str, str, Any, str]] = [
    ("critic role with grpo", "spec.roles.critic", {"replicas": 1}, "spec.roles.critic"),
    (
        "critic warmup with grpo",
        "spec.algorithm.criticWarmupSteps",
        5,
        "spec.algorithm.criticWarmupSteps",
    ),
    ("critic model with grpo", "spec.model.criticPath", "/models/rm", "spec.model.criticPath"),
    (
        "grpo with one sample per prompt",
        "spec.data.samplesPerPrompt",
        1,
        "spec.data.samplesPerPrompt",
    ),
    (
        "grpo with KL in the reward",
        "spec.algorithm.kl",
        {"coefficient": 0.01},
        "spec.algorithm.kl.mode",
    ),
    (
        "reinforce++ baseline with KL in the reward",
        "spec.algorithm",
        {"advantageEstimator": "reinforce_plus_plus_baseline", "kl": {"coefficient": 0.01}},
        "spec.algorithm.kl.mode",
    ),
]


def grpo_base() -> dict[str, Any]:
    """GPU_JOB as GRPO: no critic."""
    doc = set_path(GPU_JOB, "spec.algorithm", {"advantageEstimator": "grpo"})
    doc["spec"]["roles"].pop("critic")
    return doc


# ---------------------------------------------------------------------------------------------
# The operator's layouts (tests/operator/test_builders.py and tests/operator/ophelpers.py keep
# their own copies until they import these)
# ---------------------------------------------------------------------------------------------
def base_manifest(name: str = "demo", namespace: str = "ns1", **spec: Any) -> dict[str, Any]:
    """The smallest PPOJob, with `spec` fields added."""
    body: dict[str, Any] = {
        "image": "ghcr.io/example/ppojob-trainer:1",
        "model": {"path": "builtin:tiny-llama"},
    }
    body.update(spec)
    return {
        "apiVersion": "ppojob.io/v1alpha1",
        "kind": "PPOJob",
        "metadata": {"name": name, "namespace": namespace},
        "spec": body,
    }


GPU = {"gpus": 2, "cpus": 8, "memory": "64Gi"}
LAYOUTS = {
    "grpo-colocated-rollout": {
        "algorithm": {"advantageEstimator": "grpo"},
        "roles": {"rollout": {"colocateWithActor": True}},
    },
    "grpo-separate-rollout": {"algorithm": {"advantageEstimator": "grpo"}},
    "gae-default-critic": {},
    "gae-colocated-critic": {"roles": {"critic": {"colocateWithActor": True}}},
    "gae-separate-all": {
        "roles": {
            "actor": {"replicas": 2, "resources": GPU},
            "critic": {"replicas": 1, "resources": GPU},
            "rollout": {"replicas": 3, "resources": GPU},
        }
    },
    "gae-all-colocated": {
        "roles": {
            "actor": {"resources": GPU},
            "critic": {"colocateWithActor": True},
            "rollout": {"colocateWithActor": True},
        }
    },
}
SCHEDULING = {
    "none": {},
    "volcano": {"gangScheduler": "volcano", "queue": "q1", "priorityClassName": "high"},
    "yunikorn": {"gangScheduler": "yunikorn", "queue": "root.ml"},
    "kueue": {"gangScheduler": "kueue", "queue": "lq"},
    "kai": {"gangScheduler": "kai", "queue": "research"},
    "scheduler-plugins": {
        "gangScheduler": "scheduler-plugins",
        "timeoutSeconds": 600,
        "permitTimeoutSeconds": 120,
    },
}


# ---------------------------------------------------------------------------------------------
# The memory plan (ppojob_api.memory_plan): a colocated sglang GRPO job on one 8 x 80 GB node
# whose model's shape every side knows (a hub id of memory_plan.KNOWN_SHAPES)
# ---------------------------------------------------------------------------------------------
def memory_base(model: str = "Qwen/Qwen2.5-1.5B-Instruct", **rollout: Any) -> dict[str, Any]:
    """A colocated sglang engine beside a torch actor (gpuMemoryFraction unset: sized by the
    plan), with `rollout` fields added."""
    return base_manifest(
        model={"path": model, "dtype": "bfloat16"},
        algorithm={
            "advantageEstimator": "grpo",
            "kl": {"coefficient": 0.001, "estimator": "low_var_kl", "mode": "loss"},
        },
        roles={
            "actor": {"replicas": 1, "resources": {"gpus": 8, "cpus": 48, "memory": "400Gi"}},
            "rollout": {"colocateWithActor": True, "backend": "sglang", **rollout},
        },
        data={
            "prompts": "/data/gsm8k.parquet",
            "rewardFunction": "rewards:score",
            "rolloutBatchSize": 64,
            "samplesPerPrompt": 8,
            "maxPromptLength": 512,
            "maxResponseLength": 1024,
        },
        training={"miniBatchSize": 128, "microBatchSize": 4},
    )


# (description, mutation path, value, field path the error must name): refused by the plan
MEMORY_INVALID: list[tuple[str, str, Any, str]] = [
    (
        "a colocated engine's fraction that cannot wake after step 1",
        "spec.roles.rollout.gpuMemoryFraction",
        0.95,
        "spec.roles.rollout.gpuMemoryFraction",
    ),
    (
        "a 7B actor replicated on every GPU beside a colocated engine",
        "spec.model.path",
        "Qwen/Qwen2.5-7B-Instruct",
        "spec.roles.actor",
    ),
]
