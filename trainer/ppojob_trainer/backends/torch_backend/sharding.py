"""Sharding of the torch backend: FSDP2 (``fully_shard``, one unit per transformer block),
activation checkpointing, and the full or streamed state dict of a (sharded) module."""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from ..weight_sync import WeightStream, plan_buckets


def shard_module(
    module: nn.Module,
    group: Any,
    device: torch.device,
    *,
    offload: bool = False,
    compute_dtype: torch.dtype | None = None,
) -> nn.Module:
    """FSDP2 (``fully_shard``) over the data-parallel ``group``: each transformer block is one
    unit (gathered for its forward and backward, resharded after), the root holds the rest.
    Parameters, gradients and optimizer state then exist as 1/dp shards (``DTensor``).
    ``compute_dtype`` (other than the parameters'): units are gathered in it and gradients
    reduced in float32 (FSDP's mixed precision; no autocast, whose weight-cast cache would hold
    a whole unsharded copy). ``offload``: shards live in CPU memory, copied to the device per
    unit."""
    from torch.distributed.device_mesh import DeviceMesh
    from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, fully_shard

    mesh = DeviceMesh.from_group(group, device.type)
    kw: dict[str, Any] = {"mesh": mesh}
    if compute_dtype is not None:
        kw["mp_policy"] = MixedPrecisionPolicy(
            param_dtype=compute_dtype, reduce_dtype=torch.float32
        )
    if offload:
        kw["offload_policy"] = CPUOffloadPolicy(pin_memory=device.type == "cuda")
    for block in transformer_blocks(module):
        fully_shard(block, **kw)
    fully_shard(module, **kw)
    return module


def activation_checkpointing(model: nn.Module) -> None:
    """Recompute each block's activations in backward (non-reentrant checkpointing; the HF
    method's name in transformers >= 5, else its older one)."""
    kwargs = {"use_reentrant": False}
    if hasattr(model, "activation_checkpointing_enable"):
        model.activation_checkpointing_enable(activation_checkpointing_kwargs=kwargs)
    else:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs=kwargs)


def transformer_blocks(module: nn.Module) -> list[nn.Module]:
    """The repeated blocks of a HF model: the first ``ModuleList`` named ``layers``/``h``/
    ``blocks`` (Llama, Qwen, Mistral, GPT-2, ...), else none."""
    for name, sub in module.named_modules():
        if isinstance(sub, nn.ModuleList) and name.rsplit(".", 1)[-1] in ("layers", "h", "blocks"):
            return list(sub)
    return []


def full_state_dict(module: nn.Module) -> dict[str, torch.Tensor]:
    """``module.state_dict()`` as whole CPU tensors (FSDP shards gathered: every worker of the
    group must call this, in the same order)."""
    out = {}
    for k, v in module.state_dict().items():
        if hasattr(v, "full_tensor"):
            v = v.full_tensor()
        out[k] = v.detach().to("cpu")
    return out


def stream_state_dict(module: nn.Module, dtype: torch.dtype, max_bytes: int) -> WeightStream:
    """:func:`full_state_dict` cast to ``dtype`` (floating tensors), made one bucket of at
    most ``max_bytes`` at a time on the weights' own device: a shard is gathered
    (``full_tensor``) only when its bucket is asked for, and nothing is copied to the CPU.
    Each shard is cast before its gather (a cast is elementwise: the same tensor), so the
    gather moves ``dtype``'s bytes (bf16 from float32 masters: half) and no whole float32 copy
    of the tensor is made.
    Every worker of an FSDP group must ask for every bucket, in order. The buckets are planned
    from the global shapes, so every worker plans the same ones."""
    state = module.state_dict()  # references to the parameters (or their shards): no copy

    def out_dtype(v: torch.Tensor) -> torch.dtype:
        return dtype if v.is_floating_point() else v.dtype

    plan = plan_buckets(
        ((k, v.numel() * out_dtype(v).itemsize) for k, v in state.items()), max_bytes
    )

    def produce(names: list[str]) -> dict[str, torch.Tensor]:
        out = {}
        for k in names:
            v = state[k].detach()
            v = v.to(dtype=out_dtype(v))  # a DTensor casts its local shard
            if hasattr(v, "full_tensor"):
                v = v.full_tensor()
            out[k] = v
        return out

    return WeightStream(plan, produce)
