"""A memory plan the runtime obeys (issue 40, finding 6): a colocated sglang engine's memory
fraction, unset, is computed from the plan and never exceeds what fits after step 1; a job the
plan says cannot fit is refused by `ppojob validate` and by the operator before any pod starts,
in one line naming the field, with the numbers and the fix; the plan is shown by `ppojob render`
and in the job's status. Where the operator cannot read the model's shape (a directory on a
volume), the trainer judges it at start with the same message."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from ppojob_api import memory_plan as M
from ppojob_api.problems import SpecError
from ppojob_api.spec import PPOJob
from ppojob_api.trainspec.roles import RolloutRole
from ppojob_api.validation import load_trainer_config, validate_manifest
from ppojob_cli.main import main as ppojob
from ppojob_operator import builders, state
from tests.helpers.manifests import MEMORY_INVALID, memory_base, set_path

ROOT = Path(__file__).resolve().parents[2]
GRPO = ROOT / "examples" / "ppojob-grpo-kueue.yaml"
QWEN_7B = M.KNOWN_SHAPES["Qwen/Qwen2.5-7B"]


def _write(tmp_path: Path, doc: dict) -> Path:
    path = tmp_path / "job.yaml"
    path.write_text(yaml.safe_dump(doc, sort_keys=False))
    return path


def _actor(doc: dict) -> M.ProcessPlan:
    """The actor's plan of a manifest, judged or not (the schema only)."""
    job = PPOJob.model_validate(doc, by_alias=True, by_name=False)
    actor = job.spec.roles.actor
    return M.plan_job(job.spec, M.gpu_gib_of(actor.node_selector, actor.resources.gpu_memory))[0]


def test_the_fraction_is_unset_by_default_and_the_crd_defaults_nothing() -> None:
    """Unset means "sized by the plan" (colocated) or 0.85 (an engine on its own GPUs); the
    API server stores no default, so the manifest and its stored form are planned alike."""
    assert RolloutRole().gpu_memory_fraction is None
    crd = yaml.safe_load((ROOT / "crds" / "ppojob.io_ppojobs.yaml").read_text())
    schema = crd["spec"]["versions"][0]["schema"]["openAPIV3Schema"]
    rollout = schema["properties"]["spec"]["properties"]["roles"]["properties"]["rollout"]
    assert "default" not in rollout["properties"]["gpuMemoryFraction"]


def test_an_unset_fraction_is_sized_to_wake_after_step_1() -> None:
    """The colocated engine's fraction, unset, comes from the plan (the actor's weights,
    gradients, AdamW moments and kept update blocks after step 1, the engine's weights and KV
    cache): at most what the wake leaves, and the wake fits; the old default 0.85 did not."""
    plan = _actor(memory_base())
    assert plan.engine_fraction_source == "auto"
    assert 0 < plan.engine_fraction <= plan.wake_max_fraction
    assert plan.wake_over(M.DEFAULT_GPU_GIB * M.GiB) is None
    assert plan.wake["resume KV cache"]["sglang KV cache"] > 0
    old = _actor(memory_base(gpuMemoryFraction=0.85))
    assert old.wake_over(M.DEFAULT_GPU_GIB * M.GiB) is not None
    print(
        f"auto fraction {plan.engine_fraction:.2f} (fits up to {plan.wake_max_fraction:.3f}); "
        f"0.85 wakes {old.wake_over(M.DEFAULT_GPU_GIB * M.GiB)[2] / M.GiB:.1f} GiB over"
    )


def test_an_explicit_fraction_that_fits_is_honoured() -> None:
    plan = _actor(memory_base(gpuMemoryFraction=0.3))
    assert plan.engine_fraction == 0.3 and plan.engine_fraction_source == "spec"


def test_validate_refuses_a_fraction_that_cannot_wake_in_one_line_with_the_numbers(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    best = _actor(memory_base()).wake_max_fraction
    path = _write(tmp_path, memory_base(gpuMemoryFraction=0.95))
    assert ppojob(["validate", str(path)]) == 1
    err = capsys.readouterr().err
    (line,) = [ln for ln in err.splitlines() if "gpuMemoryFraction" in ln]
    assert "spec.roles.rollout.gpuMemoryFraction:" in line
    assert re.search(r"needs \d+\.\d GiB per GPU at 'resume KV cache'", line), line
    assert f"at most {int(best * 100) / 100:.2f}" in line and "leave it unset" in line
    assert "(fix: " in line


@pytest.mark.parametrize(
    ("why", "path", "value", "field"), MEMORY_INVALID, ids=[c[0] for c in MEMORY_INVALID]
)
def test_the_operator_refuses_what_the_plan_cannot_fit_before_any_pod(why, path, value, field):
    """The operator's parse (what every reconcile starts with: no children without a job)."""
    body = set_path(memory_base(), path, value)
    job, problems = state.parse(body)
    assert job is None
    assert field in [p.path for p in problems]
    (problem,) = [p for p in problems if p.path == field]
    assert "GiB" in problem.message and problem.fix
    assert "\n" not in str(problem)


def test_a_7b_colocated_job_is_refused_with_the_numbers_and_fits_sharded(capsys) -> None:
    """Qwen2.5-7B replicated on each of 8 x 80 GB GPUs beside a colocated engine: float32
    weights, gradients and two moments alone are 16 bytes x 7.6e9 = 114 GiB: refused, naming
    the actor's layout. Sharded (FSDP over 8, gradient checkpointing) it fits and the engine is
    sized by the plan."""
    doc = memory_base("Qwen/Qwen2.5-7B-Instruct")
    with pytest.raises(SpecError) as refused:
        validate_manifest(doc)
    (problem,) = [p for p in refused.value.problems if p.path == "spec.roles.actor"]
    assert "training.sharding: fsdp" in problem.fix
    sharded = set_path(doc, "spec.training.sharding", "fsdp")
    sharded = set_path(sharded, "spec.training.gradientCheckpointing", True)
    plan = _actor(sharded)
    assert plan.engine_fraction_source == "auto" and plan.engine_fraction > 0
    assert plan.peak <= M.DEFAULT_GPU_GIB * M.GiB
    with capsys.disabled():
        print(f"\n7B colocated, replicated: {problem}")
        print(
            f"7B colocated, fsdp: peak {plan.peak / M.GiB:.1f} GiB, fraction "
            f"{plan.engine_fraction:.2f}"
        )


def test_a_model_on_a_volume_is_planned_by_the_trainer_at_start(tmp_path: Path) -> None:
    """`ppojob validate` reads a local model directory's config.json and refuses; the operator
    (which cannot read the volume) admits the job and says in its status that the trainer
    judges it; the trainer, reading the rendered config where the directory exists, refuses
    with the same message before Ray starts."""
    model = tmp_path / "qwen7b"
    model.mkdir()
    (model / "config.json").write_text(
        json.dumps(
            {
                "model_type": "qwen2",
                "hidden_size": QWEN_7B.hidden,
                "num_hidden_layers": QWEN_7B.layers,
                "num_attention_heads": QWEN_7B.heads,
                "num_key_value_heads": QWEN_7B.kv_heads,
                "intermediate_size": QWEN_7B.intermediate,
                "vocab_size": QWEN_7B.vocab,
            }
        )
    )
    here = memory_base(str(model))
    with pytest.raises(SpecError) as cli_side:
        validate_manifest(here)
    (msg,) = [p.message for p in cli_side.value.problems if p.path == "spec.roles.actor"]

    on_volume = memory_base("/models/not-here")
    job, problems = state.parse(on_volume)
    assert job is not None and not problems
    status = M.memory_status(job.spec)
    assert status["peakGiB"] is None and "checked by the trainer at start" in status["message"]

    job = validate_manifest(on_volume)
    cm = builders.config_map(job, namespace="default")
    rendered = cm["data"][builders.CONFIG_KEY].replace("/models/not-here", str(model))
    cfg_path = tmp_path / "trainer.yaml"
    cfg_path.write_text(rendered)
    with pytest.raises(SpecError) as trainer_side:
        load_trainer_config(cfg_path)
    (again,) = [p.message for p in trainer_side.value.problems if p.path.endswith("roles.actor")]
    assert again == msg


def test_the_status_carries_the_plan() -> None:
    job = validate_manifest(memory_base())
    status = M.memory_status(job.spec)
    plan = _actor(memory_base())
    assert status["gpuGiB"] == pytest.approx(M.DEFAULT_GPU_GIB)
    assert status["peakGiB"] == pytest.approx(round(plan.peak / M.GiB, 2))
    assert status["engineFraction"] == plan.engine_fraction
    assert status["engineFractionSource"] == "auto"
    assert status["processes"][0]["name"] == "actor"
    assert "fits" in status["message"]


def test_render_shows_the_plan(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = _write(tmp_path, memory_base())
    assert ppojob(["render", str(path)]) == 0
    out = capsys.readouterr().out
    plan = _actor(memory_base())
    assert "# memory plan" in out
    assert f"gpuMemoryFraction {plan.engine_fraction:.2f} (sized by the plan; at most" in out
    assert list(yaml.safe_load_all(out))  # still a YAML stream kubectl applies


def test_the_plan_imports_without_torch_or_ray() -> None:
    code = (
        "import sys, ppojob_api.memory_plan, ppojob_api.checks, ppojob_operator.state;"
        "bad = [m for m in ('torch', 'ray', 'transformers') if m in sys.modules];"
        "sys.exit(1 if bad else 0)"
    )
    assert subprocess.run([sys.executable, "-c", code], check=False).returncode == 0


def test_a_declared_gpu_memory_replaces_the_assumed_80_gb_and_the_refusal_says_so() -> None:
    """With no GPU product label and no ``resources.gpuMemory`` the plan assumes 80 GB GPUs, and
    a refusal says so and names the field; declared (141 GiB, an H200), the same job fits, and
    the plan, the status and the trainer's fallback all use the declared size."""
    doc = memory_base(gpuMemoryFraction=0.85)
    with pytest.raises(SpecError) as refused:
        validate_manifest(doc)
    (problem,) = [p for p in refused.value.problems if "gpuMemoryFraction" in p.path]
    assert "assumed 80 GiB GPUs" in problem.fix and "resources.gpuMemory" in problem.fix
    declared = set_path(doc, "spec.roles.actor.resources.gpuMemory", "141Gi")
    validate_manifest(declared)  # fits
    job = PPOJob.model_validate(declared, by_alias=True, by_name=False)
    assert M.memory_status(job.spec)["gpuGiB"] == 141
    plan = _actor(declared)
    assert plan.wake_over(141 * M.GiB) is None and plan.wake_over(80 * M.GiB) is not None
    # a labelled node selector is a size the user stated: no "assumed" hint
    labelled = set_path(
        doc, "spec.roles.actor.nodeSelector", {"nvidia.com/gpu.product": "NVIDIA-A100-SXM4-80GB"}
    )
    with pytest.raises(SpecError) as refused:
        validate_manifest(labelled)
    assert all("assumed" not in p.fix for p in refused.value.problems)


def test_gpu_memory_on_another_role_is_refused_not_ignored() -> None:
    """The plan judges every GPU by the actor's declared size: the field on the critic would be
    silently ignored, so it is refused, naming it and where to set the size."""
    doc = set_path(memory_base(), "spec.roles.rollout.resources", {"gpus": 8, "gpuMemory": "141Gi"})
    doc = set_path(doc, "spec.roles.rollout.colocateWithActor", False)
    with pytest.raises(SpecError) as refused:
        validate_manifest(doc)
    (problem,) = [p for p in refused.value.problems if p.path.endswith("gpuMemory")]
    assert problem.path == "spec.roles.rollout.resources.gpuMemory"
    assert "roles.actor.resources.gpuMemory" in problem.fix
