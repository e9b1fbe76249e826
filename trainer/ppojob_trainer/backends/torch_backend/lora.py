"""LoRA (PEFT) on the torch backend: adapters applied to the policy, and the tensors the weight
sync sends (the adapters, or the merged weights)."""

from __future__ import annotations

from collections.abc import Iterator

import torch
from torch import nn

from ppojob_api.training import LoraSpec

LORA_A, LORA_B = ".lora_A", ".lora_B"
"""Suffixes of the adapter tensors the weight sync sends: ``<module>.lora_A`` [r, in] and
``<module>.lora_B`` [out, r] already multiplied by alpha / r, so an engine adds ``B @ A`` to
``<module>.weight`` (HF names of the base model)."""


def apply_lora(lm: nn.Module, lora: LoraSpec) -> nn.Module:
    """``lm`` with PEFT LoRA adapters on ``lora.target_modules`` (every other weight frozen).
    A name that is no linear layer of ``lm`` raises one line naming the field."""
    from peft import LoraConfig, get_peft_model

    targets = list(lora.target_modules)
    linear = sorted(
        {n.rsplit(".", 1)[-1] for n, m in lm.named_modules() if isinstance(m, nn.Linear)}
        - {"lm_head"}
    )
    unknown = [t for t in targets if t != "all-linear" and t not in linear]
    if unknown:
        raise ValueError(
            f"spec.model.lora.targetModules: {unknown} are not linear layers of "
            f"{type(lm).__name__}; use some of {linear}, or all-linear"
        )
    config = LoraConfig(
        r=lora.rank,
        lora_alpha=lora.alpha,
        lora_dropout=lora.dropout,
        target_modules="all-linear" if targets == ["all-linear"] else targets,
        modules_to_save=list(lora.modules_to_save) or None,
        bias="none",
        task_type="CAUSAL_LM",
    )
    return get_peft_model(lm, config)


def _saved_modules(peft_model: nn.Module) -> Iterator[tuple[str, nn.Module]]:
    """(HF name, trained copy) of each module trained in full (``modulesToSave``)."""
    for name, module in peft_model.named_modules():
        copies = getattr(module, "modules_to_save", None)
        if isinstance(copies, nn.ModuleDict) and "default" in copies:
            yield name.removeprefix("base_model.model."), copies["default"]


def _lora_layers(peft_model: nn.Module) -> Iterator[tuple[str, nn.Module]]:
    """(HF name of the base module, its LoRA layer) for each adapted layer."""
    for name, module in peft_model.named_modules():
        if hasattr(module, "lora_A") and "default" in getattr(module, "lora_A", {}):
            yield name.removeprefix("base_model.model."), module


def lora_adapter_tensors(peft_model: nn.Module, dtype: torch.dtype) -> dict[str, torch.Tensor]:
    """The adapters as the weight sync sends them (:data:`LORA_A`, :data:`LORA_B`), CPU
    tensors in ``dtype``."""
    out = {}
    for name, layer in _lora_layers(peft_model):
        a = layer.lora_A["default"].weight.detach()
        b = layer.lora_B["default"].weight.detach() * layer.scaling["default"]
        out[name + LORA_A] = a.to("cpu", dtype)
        out[name + LORA_B] = b.to("cpu", dtype)
    for name, module in _saved_modules(peft_model):  # modulesToSave: their full weights
        for key, value in module.state_dict().items():
            out[f"{name}.{key}"] = value.detach().to("cpu", dtype)
    return out


def merged_lora_weights(peft_model: nn.Module, dtype: torch.dtype) -> dict[str, torch.Tensor]:
    """The base model's HF state dict with every adapter merged in (``W + (alpha/r) B A``),
    CPU tensors in ``dtype`` (floating point ones): for engines that take full weights."""
    base = {}
    for k, v in peft_model.get_base_model().state_dict().items():
        if ".lora_" not in k and ".original_module." not in k:  # (modulesToSave: the copy)
            name = k.replace(".base_layer.", ".").replace(".modules_to_save.default.", ".")
            base[name] = v.detach().to("cpu")
    for name, layer in _lora_layers(peft_model):
        a = layer.lora_A["default"].weight.detach().float().cpu()
        b = layer.lora_B["default"].weight.detach().float().cpu() * layer.scaling["default"]
        key = f"{name}.weight"
        base[key] = base[key].float() + b @ a
    return {k: v.to(dtype) if v.is_floating_point() else v for k, v in base.items()}
