"""The time plan's arithmetic, worked by hand for a small layout: FLOPs per phase over the
GPUs, MFU and bandwidth assumed, the step time their sum, the job's time steps x that."""

from __future__ import annotations

import pytest
import yaml

from ppojob_api.memory_plan import Shape
from ppojob_api.validation import validate_manifest
from ppojob_trainer.time_plan import Hardware, format_time_plan, plan_time
from tests.helpers.controlplane import ROOT
from tests.helpers.manifests import DELETE, GPU_JOB, set_path

SHAPE = Shape(hidden=64, layers=2, heads=4, kv_heads=4, intermediate=128, vocab=1000)
HW = Hardware(name="test GPU", peak_tflops=100.0, memory_tbps=1.0, link_gbps=10.0)


def _half(**changes):
    doc = GPU_JOB
    for path, value in changes.items():
        doc = set_path(doc, path, value)
    return validate_manifest(doc).spec


def test_phases_by_hand() -> None:
    # actor 2 x 8 GPUs (megatron, MFU 0.40), critic 1 x 8 (megatron), rollout 8 GPUs at
    # tensor 2: 4 engines of 2 GPUs (sglang: MFU 0.40, 70% bandwidth), 64 samples each;
    # 64 x 4 samples of 32 + 64 tokens
    half = _half(**{"spec.data.maxPromptLength": 32, "spec.data.maxResponseLength": 64})
    plan = plan_time(half, SHAPE, HW)
    n = SHAPE.params
    tokens = 256 * 96
    peak = 100e12
    actor, critic = 16 * peak * 0.40, 8 * peak * 0.40
    gen = 2 * peak * 0.40
    read = 2 * n / (2 * 1e12 * 0.70)  # bf16 weights read once per decode step
    decode = max(read, 2 * n * 64 / gen)
    expected = {
        "generate": 2 * n * 64 * 32 / gen + 64 * decode,
        "logprobs": 2 * n * tokens / actor,
        "reference": 2 * n * tokens / actor,  # kl.coefficient 0.01
        "values": 2 * n * tokens / critic,
        "trainCritic": 6 * n * tokens / critic,  # 1 update x 1 epoch
        "trainActor": 6 * n * tokens / actor,
        "weightSync": 2 * n / 10e9,
    }
    assert plan.tokens_per_step == tokens
    assert plan.phases == pytest.approx(expected, rel=1e-12)
    assert plan.step_seconds == pytest.approx(sum(expected.values()))
    assert plan.total_seconds == pytest.approx(500 * sum(expected.values()))
    text = format_time_plan(plan)
    assert "for 500 steps" in text and "assumes: test GPU: 100 TFLOP/s" in text
    assert "256 samples x (32 + 64) = 24576 tokens per step" in text


def test_a_moe_models_flops_follow_its_active_parameters_and_its_bytes_all_of_them() -> None:
    """8 experts, 2 per token: compute phases count the parameters a token runs through, the
    weight sync (and the engine's reads) every parameter."""
    moe = Shape(
        hidden=64,
        layers=2,
        heads=4,
        kv_heads=4,
        intermediate=128,
        vocab=1000,
        experts=8,
        experts_per_token=2,
        expert_intermediate=32,
        moe_layers=2,
    )
    assert moe.active_params < moe.params
    half = _half(**{"spec.data.maxPromptLength": 32, "spec.data.maxResponseLength": 64})
    plan = plan_time(half, moe, HW)
    actor = 16 * 100e12 * 0.40
    tokens = 256 * 96
    assert plan.phases["trainActor"] == pytest.approx(6 * moe.active_params * tokens / actor)
    assert plan.phases["logprobs"] == pytest.approx(2 * moe.active_params * tokens / actor)
    assert plan.phases["weightSync"] == pytest.approx(2 * moe.params / 10e9)
    assert "active per token" in format_time_plan(plan)


def test_epochs_checkpointing_kl_and_colocation_change_what_they_should() -> None:
    base = plan_time(_half(), SHAPE, HW)
    more = plan_time(
        _half(
            **{
                "spec.training.ppoEpochs": 2,
                "spec.training.gradientCheckpointing": True,
                "spec.algorithm.kl.coefficient": 0,
            }
        ),
        SHAPE,
        HW,
    )
    assert more.phases["trainActor"] == pytest.approx(base.phases["trainActor"] * 2 * 4 / 3)
    assert "reference" not in more.phases
    assert more.phases["trainCritic"] == pytest.approx(base.phases["trainCritic"] * 2 * 4 / 3)
    grpo = plan_time(
        _half(
            **{
                "spec.algorithm.advantageEstimator": "grpo",
                "spec.algorithm.kl": {"coefficient": 0.01, "mode": "loss", "estimator": "k3"},
                "spec.roles.critic": DELETE,
            }
        ),
        SHAPE,
        HW,
    )
    assert "values" not in grpo.phases and "trainCritic" not in grpo.phases
    # a torch rollout colocated with a torch actor syncs in-process: no weight-sync time
    tiny = yaml.safe_load((ROOT / "examples" / "ppojob-tiny.yaml").read_text())
    tiny = set_path(tiny, "spec.roles.actor.resources.gpus", 1)
    colocated = plan_time(validate_manifest(tiny).spec, SHAPE, HW)
    assert colocated.phases["weightSync"] == 0 and base.phases["weightSync"] > 0


def test_no_plan_without_gpus_or_shape() -> None:
    cpu = yaml.safe_load((ROOT / "examples" / "ppojob-tiny.yaml").read_text())  # no GPUs
    assert plan_time(validate_manifest(cpu).spec, SHAPE, HW) is None
    assert plan_time(_half(), None, HW) is None  # /models/qwen2.5-7b is not readable here
