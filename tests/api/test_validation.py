"""The PPOJob API: schema and semantic validation, through the `ppojob validate` CLI."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import yaml

from ppojob_api.problems import SpecError
from ppojob_api.validation import load_manifests, validate_manifest
from ppojob_cli.main import main
from tests.helpers.manifests import GPU_JOB, GRPO_INVALID, INVALID, grpo_base, set_path

ROOT = Path(__file__).resolve().parents[2]

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


def _write(tmp_path: Path, doc: Any, name: str = "job.yaml") -> Path:
    path = tmp_path / name
    path.write_text(doc if isinstance(doc, str) else yaml.safe_dump(doc))
    return path


def test_realistic_gpu_job_is_valid() -> None:
    job = validate_manifest(GPU_JOB)
    assert job.spec.roles.actor.parallelism.tensor == 4
    assert job.spec.algorithm.lam == 0.95
    assert validate_manifest(grpo_base()).spec.algorithm.advantage_estimator == "grpo"


@pytest.mark.parametrize(
    ("why", "path", "value", "field"), INVALID, ids=[case[0] for case in INVALID]
)
def test_invalid_manifest_names_the_field(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], why: str, path: str, value: Any, field: str
) -> None:
    file = _write(tmp_path, set_path(GPU_JOB, path, value))
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
    file = _write(tmp_path, set_path(grpo_base(), path, value))
    assert main(["validate", str(file)]) == 1
    assert f"{field}:" in capsys.readouterr().err


@pytest.mark.parametrize(
    ("why", "path", "value", "field"), TINY_INVALID, ids=[case[0] for case in TINY_INVALID]
)
def test_impossible_sizes_fail_before_start_naming_the_field(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], why: str, path: str, value: Any, field: str
) -> None:
    doc = set_path(TINY, path, value) if path != "spec.data" else _set_all(TINY, path, value)
    file = _write(tmp_path, doc)
    assert main(["validate", str(file)]) == 1
    err = capsys.readouterr().err
    assert f"{field}:" in err, err


def _set_all(doc: dict[str, Any], dotted: str, values: dict[str, Any]) -> dict[str, Any]:
    for key, value in values.items():
        doc = set_path(doc, f"{dotted}.{key}", value)
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
        ("spec.roles.actor.resources.cpus", "64 cores", "write cores as a number (2, 0.5) or"),
        ("spec.roles.actor.resources.memory", 2048, 'write the unit, e.g. "2048Mi"'),
    ],
)
def test_type_errors_say_how_to_write_the_value(path: str, value: Any, fix: str) -> None:
    with pytest.raises(SpecError) as info:
        validate_manifest(set_path(GPU_JOB, path, value))
    (problem,) = info.value.problems
    assert problem.path == path and problem.fix.startswith(fix), problem


def test_a_whole_float_is_an_integer_as_kubectl_sends_it() -> None:
    """kubectl sends `steps: 500.0` as 500 and the API server accepts it: so does validation;
    `steps: 500.5` stays an error."""
    assert (
        validate_manifest(set_path(GPU_JOB, "spec.training.steps", 500.0)).spec.training.steps
        == 500
    )
    with pytest.raises(SpecError) as info:
        validate_manifest(set_path(GPU_JOB, "spec.training.steps", 500.5))
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
        ("apiVersion: v1\nkind: Pod\nspec: {}\n", "kind: this document is a Pod (v1), not a"),
        ("apiVersion: v1\nkind: PPOJob\nspec: {}\n", "apiVersion: expected 'ppojob.io/v1alpha1'"),
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
    bad = set_path(set_path(GPU_JOB, "spec.algorithm.gamma", 2), "spec.training.miniBatchSize", 100)
    one = _write(tmp_path, bad, "one.yaml")
    two = _write(tmp_path, set_path(GPU_JOB, "spec.roles.actor.replicas", 0), "two.yaml")
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
    doc = set_path(GPU_JOB, "spec.training.miniBatchSize", 100)
    doc = set_path(doc, "spec.roles.critic.overrides", {"replicas": 2, "gpus": 1})
    doc = set_path(doc, "spec.data.rewardFunction", "nocolon")
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
    text = yaml.safe_dump_all([GPU_JOB, set_path(GPU_JOB, "spec.image", "")])
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

    file = _write(tmp_path, set_path(GPU_JOB, "spec.training.miniBatchSize", 100))
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
