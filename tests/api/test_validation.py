"""The PPOJob API: schema and semantic validation, through the `ppojob validate` CLI."""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

import pytest
import yaml
from ppojob_api.problems import SpecError
from ppojob_api.validation import load_manifests, validate_manifest
from ppojob_cli.main import main

ROOT = Path(__file__).resolve().parents[2]

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


def _set(doc: dict[str, Any], dotted: str, value: Any) -> dict[str, Any]:
    doc = copy.deepcopy(doc)
    node = doc
    keys = dotted.split(".")
    for key in keys[:-1]:
        node = node.setdefault(key, {})
    if value is _DELETE:
        node.pop(keys[-1], None)
    else:
        node[keys[-1]] = value
    return doc


_DELETE = object()

# (description, mutation path, value, field path the error must name)
INVALID: list[tuple[str, str, Any, str]] = [
    ("unknown top-level spec field", "spec.imagee", "x", "spec.imagee"),
    ("missing image", "spec.image", _DELETE, "spec.image"),
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
    ("missing name", "metadata.name", _DELETE, "metadata.name"),
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
        "cpus as a quoted number",
        "spec.roles.actor.resources.cpus",
        "64",
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


TINY: dict[str, Any] = yaml.safe_load((ROOT / "examples" / "ppojob-tiny.yaml").read_text())

# Sizes that cannot work, on the CPU example (built-in model: its context and shape are known).
TINY_INVALID: list[tuple[str, str, Any, str]] = [
    (
        "response longer than the model's context",
        "spec.data.maxResponseLength",
        1048576,
        "spec.data.maxResponseLength",
    ),
    (
        "rollout batch whose KV cache exceeds the pod",
        "spec.data",
        {"rolloutBatchSize": 4096, "samplesPerPrompt": 8, "maxResponseLength": 2000},
        "spec.roles.actor.resources.memory",
    ),
]


def _grpo_base() -> dict[str, Any]:
    doc = _set(GPU_JOB, "spec.algorithm", {"advantageEstimator": "grpo"})
    doc["spec"]["roles"].pop("critic")
    return doc


def _write(tmp_path: Path, doc: Any, name: str = "job.yaml") -> Path:
    path = tmp_path / name
    path.write_text(doc if isinstance(doc, str) else yaml.safe_dump(doc))
    return path


def test_realistic_gpu_job_is_valid() -> None:
    job = validate_manifest(GPU_JOB)
    assert job.spec.roles.actor.parallelism.tensor == 4
    assert job.spec.algorithm.lam == 0.95
    assert validate_manifest(_grpo_base()).spec.algorithm.advantage_estimator == "grpo"


@pytest.mark.parametrize(
    ("why", "path", "value", "field"), INVALID, ids=[case[0] for case in INVALID]
)
def test_invalid_manifest_names_the_field(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], why: str, path: str, value: Any, field: str
) -> None:
    file = _write(tmp_path, _set(GPU_JOB, path, value))
    assert main(["validate", str(file)]) == 1
    err = capsys.readouterr().err
    assert f"{field}:" in err, err
    assert "Traceback" not in err


@pytest.mark.parametrize(
    ("why", "path", "value", "field"), GRPO_INVALID, ids=[case[0] for case in GRPO_INVALID]
)
def test_invalid_grpo_manifest_names_the_field(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], why: str, path: str, value: Any, field: str
) -> None:
    file = _write(tmp_path, _set(_grpo_base(), path, value))
    assert main(["validate", str(file)]) == 1
    assert f"{field}:" in capsys.readouterr().err


@pytest.mark.parametrize(
    ("why", "path", "value", "field"), TINY_INVALID, ids=[case[0] for case in TINY_INVALID]
)
def test_impossible_sizes_fail_before_start_naming_the_field(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], why: str, path: str, value: Any, field: str
) -> None:
    doc = _set(TINY, path, value) if path != "spec.data" else _set_all(TINY, path, value)
    file = _write(tmp_path, doc)
    assert main(["validate", str(file)]) == 1
    err = capsys.readouterr().err
    assert f"{field}:" in err, err


def _set_all(doc: dict[str, Any], dotted: str, values: dict[str, Any]) -> dict[str, Any]:
    for key, value in values.items():
        doc = _set(doc, f"{dotted}.{key}", value)
    return doc


DUPLICATE_KEYS = """\
apiVersion: ppojob.io/v1alpha1
kind: PPOJob
metadata: {name: dup}
spec:
  image: x
  training:
    steps: 5
  roles:
    actor: {replicas: 1, replicas: 2}
  training:
    steps: 500
"""


def test_duplicate_keys_are_an_error_naming_the_path(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    file = _write(tmp_path, DUPLICATE_KEYS)
    assert main(["validate", str(file)]) == 1
    err = capsys.readouterr().err
    assert "spec.training: duplicate key (line 10; first at line 6)" in err, err
    assert "spec.roles.actor.replicas: duplicate key" in err, err


@pytest.mark.parametrize(
    ("path", "value", "fix"),
    [
        ("spec.training.steps", True, "write a whole number, without quotes"),
        ("spec.suspend", "yes", "write true or false, without quotes"),
        ("spec.training.weightDecay", float("inf"), "write a finite number"),
        ("spec.roles.actor.resources.cpus", "64", "write a number, without quotes"),
    ],
)
def test_type_errors_say_how_to_write_the_value(path: str, value: Any, fix: str) -> None:
    with pytest.raises(SpecError) as info:
        validate_manifest(_set(GPU_JOB, path, value))
    (problem,) = info.value.problems
    assert problem.path == path and problem.fix.startswith(fix), problem


def test_a_whole_float_is_an_integer_as_kubectl_sends_it() -> None:
    """kubectl sends `steps: 500.0` as 500 and the API server accepts it: so does validation;
    `steps: 500.5` stays an error."""
    assert validate_manifest(_set(GPU_JOB, "spec.training.steps", 500.0)).spec.training.steps == 500
    with pytest.raises(SpecError) as info:
        validate_manifest(_set(GPU_JOB, "spec.training.steps", 500.5))
    assert [p.path for p in info.value.problems] == ["spec.training.steps"]


def test_exponent_without_a_dot_is_a_number(tmp_path: Path) -> None:
    """`learningRate: 1e-5` is a number to kubectl; strict types must not turn it away."""
    text = yaml.safe_dump(GPU_JOB).replace("learningRate: 1.0e-06", "learningRate: 1e-6")
    assert "learningRate: 1e-6" in text
    assert load_manifests(text)[0].spec.training.learning_rate == 1e-6


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("", "<document>: is empty"),
        ("spec: [unclosed", "not valid YAML"),
        ("- just\n- a list\n", "expected a mapping"),
        ("apiVersion: v1\nkind: Pod\nspec: {}\n", "apiVersion: expected 'ppojob.io/v1alpha1'"),
        ("apiVersion: ppojob.io/v1alpha1\nkind: RayJob\nspec: {}\n", "kind: expected 'PPOJob'"),
        ("apiVersion: ppojob.io/v1alpha1\nkind: PPOJob\n", "spec: required field is missing"),
        (
            "apiVersion: ppojob.io/v1alpha1\nkind: PPOJob\nspec: {image: x, roles: 3}\n",
            "spec.roles: ",
        ),
    ],
)
def test_bad_documents_are_reported_without_traceback(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], text: str, expected: str
) -> None:
    file = _write(tmp_path, text)
    assert main(["validate", str(file)]) == 1
    err = capsys.readouterr().err
    assert expected in err, err
    assert "Traceback" not in err


def test_every_problem_of_every_file_is_listed(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    bad = _set(_set(GPU_JOB, "spec.algorithm.gamma", 2), "spec.training.miniBatchSize", 100)
    one = _write(tmp_path, bad, "one.yaml")
    two = _write(tmp_path, _set(GPU_JOB, "spec.roles.actor.replicas", 0), "two.yaml")
    good = _write(tmp_path, GPU_JOB, "good.yaml")
    missing = tmp_path / "missing.yaml"
    assert main(["validate", str(one), str(two), str(good), str(missing)]) == 1
    captured = capsys.readouterr()
    # a type error stops the semantic pass for that file, so gamma is what one.yaml reports
    assert "one.yaml" in captured.err and "spec.algorithm.gamma" in captured.err
    assert "two.yaml" in captured.err and "spec.roles.actor.replicas" in captured.err
    assert "missing.yaml: cannot read" in captured.err
    assert "good.yaml: valid (qwen-7b)" in captured.out


def test_semantic_problems_are_all_reported_together() -> None:
    doc = _set(GPU_JOB, "spec.training.miniBatchSize", 100)
    doc = _set(doc, "spec.roles.critic.overrides", {"replicas": 2, "gpus": 1})
    doc = _set(doc, "spec.data.rewardFunction", "nocolon")
    with pytest.raises(SpecError) as info:
        validate_manifest(doc)
    paths = {p.path for p in info.value.problems}
    assert {
        "spec.training.miniBatchSize",
        "spec.roles.critic.overrides.replicas",
        "spec.roles.critic.overrides.gpus",
        "spec.data.rewardFunction",
    } <= paths
    assert all(p.fix for p in info.value.problems)


def test_multi_document_file_names_the_document() -> None:
    text = yaml.safe_dump_all([GPU_JOB, _set(GPU_JOB, "spec.image", "")])
    with pytest.raises(SpecError) as info:
        load_manifests(text)
    assert [p.path for p in info.value.problems] == ["document 2: spec.image"]


def test_examples_validate(capsys: pytest.CaptureFixture[str]) -> None:
    examples = sorted(str(p) for p in (ROOT / "examples").glob("*.yaml"))
    assert any(e.endswith("ppojob-tiny.yaml") for e in examples)
    assert len(examples) >= 2
    assert main(["validate", *examples]) == 0, capsys.readouterr().err


def test_validation_does_not_rely_on_assert(tmp_path: Path) -> None:
    """Run the CLI under `python -O`: errors must still be raised."""
    import subprocess
    import sys

    file = _write(tmp_path, _set(GPU_JOB, "spec.training.miniBatchSize", 100))
    proc = subprocess.run(
        [sys.executable, "-O", "-m", "ppojob_cli", "validate", str(file)],
        capture_output=True,
        text=True,
        check=False,
    )
    assert proc.returncode == 1
    assert "spec.training.miniBatchSize" in proc.stderr


def test_names_with_a_trailing_newline_are_refused():
    """`$` in a Python regex matches before a final newline; Kubernetes' validation does not."""
    from ppojob_api.metadata import check_kueue_queue, check_label_value

    assert check_kueue_queue("team-a\n") and not check_kueue_queue("team-a")
    assert check_label_value("abc\n", "x") and not check_label_value("abc", "x")
