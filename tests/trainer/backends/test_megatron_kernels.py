"""Which kernels the megatron backend runs (issue 40, finding 8): Transformer Engine missing on a
GPU is an error naming the extra that installs it, unless the role opts into megatron-core's
local layers; megatron-core's fusions are on where CUDA and Transformer Engine are, off on the
CPU. No GPU here: the availability of CUDA kernels and Transformer Engine is monkeypatched and
the choice driven through ``kernel_choice``, ``transformer_config`` and ``layer_spec``."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from ppojob_trainer.backends import megatron_parallel as mp
from ppojob_trainer.backends.megatron_convert import ModelShape

SHAPE = ModelShape(
    family="llama",
    hidden=32,
    intermediate=64,
    layers=2,
    heads=4,
    kv_heads=2,
    head_dim=8,
    vocab=16,
    rms_eps=1e-6,
    rope_theta=10000.0,
    qkv_bias=False,
    tied=False,
    max_positions=64,
)
FUSIONS = (
    "bias_activation_fusion",
    "bias_dropout_fusion",
    "masked_softmax_fusion",
    "apply_rope_fusion",
    "gradient_accumulation_fusion",
)


@pytest.fixture
def machine(monkeypatch):  # type: ignore[no-untyped-def]
    """``machine(te=..., wgrad=...)``: what this process finds installed."""
    monkeypatch.delenv("PPOJOB_MEGATRON_LOCAL_SPEC", raising=False)

    def set_(te: bool, wgrad: bool = False) -> None:
        monkeypatch.setattr(mp, "transformer_engine_available", lambda: te, raising=False)
        monkeypatch.setattr(mp, "wgrad_fusion_available", lambda: wgrad, raising=False)

    return set_


def test_the_fusions_are_megatron_core_config_fields() -> None:
    from megatron.core.transformer import TransformerConfig

    names = {f.name for f in dataclasses.fields(TransformerConfig)}
    assert set(FUSIONS) <= names
    assert set(mp.FUSIONS) == set(FUSIONS)


@pytest.mark.parametrize("te", [True, False])
def test_the_cpu_runs_the_local_layers_unfused(machine, te: bool) -> None:  # type: ignore[no-untyped-def]
    machine(te=te, wgrad=te)
    choice = mp.kernel_choice("cpu")
    assert choice.transformer_engine is False
    assert choice.fusions == dict.fromkeys(FUSIONS, False)
    config = mp.transformer_config(SHAPE, torch.float32, device="cpu", tp=1, pp=1)
    assert {f: getattr(config, f) for f in FUSIONS} == dict.fromkeys(FUSIONS, False)


def test_a_gpu_with_transformer_engine_runs_its_layers_fused(machine) -> None:  # type: ignore[no-untyped-def]
    machine(te=True, wgrad=False)
    choice = mp.kernel_choice("cuda:0")
    assert choice.transformer_engine is True
    # megatron-core's own output layer refuses gradient-accumulation fusion without APEX's
    # fused_weight_gradient_mlp_cuda, which the GPU image does not carry
    assert choice.fusions == {**dict.fromkeys(FUSIONS, True), "gradient_accumulation_fusion": False}
    machine(te=True, wgrad=True)
    assert mp.kernel_choice("cuda").fusions == dict.fromkeys(FUSIONS, True)


def test_the_config_carries_the_choices_fusions(machine, monkeypatch) -> None:  # type: ignore[no-untyped-def]
    """(RoPE fusion itself needs Transformer Engine when the config is built: left out here.)"""
    on = {**dict.fromkeys(FUSIONS, True), "apply_rope_fusion": False}
    monkeypatch.setattr(mp, "kernel_choice", lambda device, role="actor": mp.KernelChoice(True, on))
    config = mp.transformer_config(SHAPE, torch.float32, device="cpu", tp=1, pp=1)
    assert {f: getattr(config, f) for f in FUSIONS} == on


def test_a_gpu_without_transformer_engine_is_an_error_naming_the_extra(machine) -> None:  # type: ignore[no-untyped-def]
    machine(te=False)
    with pytest.raises(ValueError) as err:
        mp.transformer_config(SHAPE, torch.bfloat16, device="cuda", tp=1, pp=1, role="critic")
    msg = str(err.value)
    assert msg.startswith("spec.roles.critic.backend: megatron on a GPU needs Transformer Engine")
    assert "'gpu' extra" in msg and "transformer-engine[pytorch,core_cu13]" in msg
    assert "PPOJOB_MEGATRON_LOCAL_SPEC=1" in msg
    # the layer spec (built for every model) says the same, never the local spec silently
    config = mp.transformer_config(SHAPE, torch.float32, device="cpu", tp=1, pp=1)
    config.use_cpu_initialization = False  # what a CUDA config holds
    with pytest.raises(ValueError, match="needs Transformer Engine"):
        mp.layer_spec(config)


def test_the_local_layers_on_a_gpu_are_an_explicit_opt_in(machine, monkeypatch) -> None:  # type: ignore[no-untyped-def]
    machine(te=False)
    monkeypatch.setenv("PPOJOB_MEGATRON_LOCAL_SPEC", "1")
    choice = mp.kernel_choice("cuda")
    assert choice.transformer_engine is False
    assert choice.fusions == dict.fromkeys(FUSIONS, False)
    config = mp.transformer_config(SHAPE, torch.float32, device="cuda", tp=1, pp=1)
    assert config.use_cpu_initialization is False
    assert {f: getattr(config, f) for f in FUSIONS} == dict.fromkeys(FUSIONS, False)
    spec = mp.layer_spec(config)
    from megatron.core.transformer.dot_product_attention import DotProductAttention

    assert spec.submodules.self_attention.submodules.core_attention is DotProductAttention
