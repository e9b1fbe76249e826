"""The torch backend's policy trainer (the actor)."""

from __future__ import annotations

from collections.abc import Mapping
from contextlib import nullcontext, suppress
from pathlib import Path
from typing import Any

import torch
from torch import nn

from ppojob_api.training import LoraSpec, TrainingSettings

from ...distributed import ShardIdentity
from ...models import load_causal_lm, load_tokenizer, torch_dtype
from ..base import PolicyLossFn, PolicyTrainer
from ..packed_attention import use_packed_attention
from ..weight_sync import WeightStream
from .common import _eval_mode
from .lora import apply_lora, lora_adapter_tensors, merged_lora_weights
from .memory import LOGITS_CHUNK_TOKENS, to_device
from .moe import BalanceTap, RouterTap, agreement
from .optimiser import _Optimised
from .packing import check_packing_support, unpack
from .sharding import activation_checkpointing, full_state_dict, shard_module, stream_state_dict
from .trainer_common import (
    CausalLMLogprobs,
    _device_inputs,
    _OptimisedState,
    _packed_device_inputs,
    save_pretrained,
)


class TorchPolicyTrainer(_OptimisedState, PolicyTrainer):
    """The actor: HF causal LM (float32 master weights, ``dtype`` compute), frozen reference
    copy in ``dtype`` when KL is on, AdamW; optionally FSDP2-sharded over the data-parallel
    group (``settings.sharding``)."""

    def __init__(
        self,
        model_dir: Path | str,
        dtype: str,
        settings: TrainingSettings,
        *,
        total_updates: int,
        temperature: float,
        top_p: float = 1.0,
        need_reference: bool,
        need_entropy: bool = True,
        entropy_grad: bool = False,
        group: Any | None = None,
        dp_size: int = 1,
        device: str = "cpu",
        offload_reference: bool = False,
        logits_chunk_tokens: int = LOGITS_CHUNK_TOKENS,
        lora: LoraSpec | None = None,
        sync_adapters: bool = True,
        routing_replay: bool = False,
        router_aux_loss: float = 0.0,
    ) -> None:
        """``need_entropy``: hand ``loss_fn`` the per-token entropy; ``entropy_grad``: with its
        graph (only when the loss uses it: an entropy coefficient > 0), else as a detached
        metric computed under ``no_grad`` (no [B, T, V] activations kept for backward).
        ``lora``: train adapters only (the reference is the base model with them disabled);
        ``sync_adapters``: :meth:`export_weights` gives only the adapters (engines that apply
        them), else the merged weights. ``router_aux_loss``: a MoE model's load-balancing loss
        coefficient (:class:`~.moe.BalanceTap`; 0: none)."""
        self.device = torch.device(device)
        self.model_dir = Path(model_dir)
        self.dtype = torch_dtype(dtype)
        self.settings = settings
        lm = load_causal_lm(model_dir, "float32")  # master weights in float32
        if settings.packing:
            check_packing_support(lm)
            use_packed_attention(lm)
        if settings.gradient_checkpointing:
            activation_checkpointing(lm)
        self.lora = lora
        self.sync_adapters = sync_adapters
        # hooks on the routers, before any wrapping (LoRA, FSDP) so they see the HF modules
        self.taps: dict[int, RouterTap] = {}
        if routing_replay:
            self.taps[id(lm)] = RouterTap(lm)
        self.routing_counts = [0.0, 0.0]  # (choices the routers made as the engine did, all)
        self.router_aux_loss = float(router_aux_loss)
        self.balance = BalanceTap(lm) if self.router_aux_loss > 0 else None
        if lora is not None:
            lm = apply_lora(lm, lora)
        self.model = CausalLMLogprobs(lm)
        self.opt = _Optimised(
            self.model,
            settings,
            total_updates,
            group,
            dp_size,
            device=self.device,
            compute_dtype=self.dtype,
        )
        self.model.train()
        self.reference: nn.Module | None = None
        self.reference_device = self.device
        if need_reference and lora is None:  # with LoRA: the base model, adapters disabled
            ref_lm = load_causal_lm(model_dir, dtype)
            if settings.packing:
                use_packed_attention(ref_lm)
            if routing_replay:
                self.taps[id(ref_lm)] = RouterTap(ref_lm)
            ref = CausalLMLogprobs(ref_lm).eval()
            ref.requires_grad_(False)
            offload = offload_reference and self.device.type != "cpu"
            if self.opt.sharded:
                ref = shard_module(ref, group, self.device, offload=offload)
            elif offload:  # kept on the CPU, brought to the device for its forwards
                self.reference_device = torch.device("cpu")
            else:
                ref = ref.to(self.device)
            self.reference = ref
        self.temperature = temperature
        self.top_p = top_p  # pi_old and pi_theta are the top-p truncated sampling distribution
        self.need_entropy = need_entropy
        self.entropy_grad = entropy_grad
        self.chunk_tokens = int(logits_chunk_tokens)

    @property
    def lm(self) -> nn.Module:
        """The Hugging Face model being trained."""
        return self.model.lm

    @torch.no_grad()
    def logprobs(
        self, batch: Mapping[str, torch.Tensor], *, reference: bool = False
    ) -> torch.Tensor:
        base = reference and self.lora is not None
        model = self.model if base or not reference else self.reference
        if model is None:
            raise ValueError("logprobs(reference=True) needs a reference model (KL is off)")
        moved = reference and not base and self.reference_device != self.device
        if moved:
            model.to(self.device)
        adapters_off = self.lm.disable_adapter() if base else nullcontext()
        measure = not reference
        if measure:
            self.routing_counts = [0.0, 0.0]
        try:
            # old/ref log-probs without dropout; training: train mode
            with _eval_mode(model), adapters_off:
                return self.opt.forward_chunks(
                    batch, lambda mb: self._logp(model, mb, measure=measure)[0]
                )
        finally:
            if moved:
                model.to(self.reference_device)

    def routing_stats(self) -> dict[str, float]:
        """The last old log-probs' routing agreement with the engine's (sums: choices made
        alike, choices compared); empty without routing replay."""
        if not self.taps:
            return {}
        same, total = self.routing_counts
        return {"router_agree_sum": same, "router_choices": total}

    def _tap(self, model: nn.Module) -> RouterTap | None:
        lm = model.lm if isinstance(model, CausalLMLogprobs) else model
        if self.lora is not None:  # the PEFT wrapper: its base model holds the routers
            return next(iter(self.taps.values()), None)
        return self.taps.get(id(lm))

    def _logp(
        self,
        model: nn.Module,
        micro: Mapping[str, torch.Tensor],
        *,
        entropy: bool = False,
        measure: bool = False,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        tap = self._tap(model) if "routed_experts" in micro else None
        if tap is None:
            return self._logp_forward(model, micro, entropy)
        recorded, valid = replay_layout(micro, self.settings.packing)
        # left set after the forward: activation checkpointing's recomputation replays it too
        tap.forced = recorded.reshape(-1, *recorded.shape[-2:]).to(self.device)
        if not measure:
            return self._logp_forward(model, micro, entropy)
        with tap.record():
            out = self._logp_forward(model, micro, entropy)
        same, total = agreement(recorded, tap.stacked(tap.chosen, tuple(valid.shape)), valid)
        self.routing_counts[0] += same
        self.routing_counts[1] += total
        return out

    def _logp_forward(
        self, model: nn.Module, micro: Mapping[str, torch.Tensor], entropy: bool
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        kw = dict(
            want_entropy=entropy,
            entropy_grad=self.entropy_grad,
            chunk_tokens=self.chunk_tokens,
            top_p=self.top_p,
        )
        if self.settings.packing:
            inputs, select, rows, cols = _packed_device_inputs(micro, self.device)
            tokens = micro["response_ids"][rows, cols][None].to(self.device)
            with self.opt.autocast():
                logp, ent = model(inputs, tokens, 0, self.temperature, select=select, **kw)
            shape = micro["response_ids"].shape
            rows, cols = rows.to(self.device), cols.to(self.device)
            return unpack(logp[0], rows, cols, shape), (
                None if ent is None else unpack(ent[0], rows, cols, shape)
            )
        inputs, plen = _device_inputs(micro, self.device)
        tokens = micro["response_ids"].to(self.device)
        with self.opt.autocast():
            return model(inputs, tokens, plen, self.temperature, **kw)

    def update(
        self,
        minibatch: Mapping[str, torch.Tensor],
        loss_fn: PolicyLossFn,
        micro_batch_size: int,
        agg: str = "token-mean",
    ) -> dict[str, float]:
        def micro_loss(micro: dict[str, torch.Tensor]) -> tuple[torch.Tensor, dict[str, Any]]:
            balance = self.balance
            collect = (
                balance.collect(real_tokens(micro, self.settings.packing))
                if balance is not None
                else nullcontext()
            )
            with collect:
                logp, ent = self._logp(self.model, micro, entropy=self.need_entropy)
            routes = ("routed_experts", "prompt_routed_experts")
            loss, metrics = loss_fn(
                logp,
                ent,
                to_device({k: v for k, v in micro.items() if k not in routes}, self.device),
            )
            if balance is not None:
                aux = balance.loss()
                loss = loss + self.router_aux_loss * aux
                metrics = {**metrics, "router_balance": aux.detach()}
            return loss, metrics

        return self.opt.accumulate(minibatch, micro_batch_size, agg, micro_loss)

    export_is_collective = property(lambda self: self.opt.sharded)

    def export_weights(self) -> dict[str, torch.Tensor]:
        """HF-named CPU tensors in the compute dtype (float32 masters cast once here). Under
        FSDP every worker of the group must call it (the shards are gathered). With LoRA: the
        adapters only (:func:`lora_adapter_tensors`), or the merged weights for engines that
        take full weights."""
        if self.lora is not None:
            if self.sync_adapters:
                return lora_adapter_tensors(self.lm, self.dtype)
            return merged_lora_weights(self.lm, self.dtype)
        return {
            k: v.to(dtype=self.dtype) if v.is_floating_point() else v
            for k, v in full_state_dict(self.lm).items()
        }

    def export_weight_stream(self, max_bytes: int) -> WeightStream:
        """:meth:`export_weights` in buckets of at most ``max_bytes``, each gathered when asked
        for, on the weights' device (:func:`stream_state_dict`); with LoRA, the same tensors
        as :meth:`export_weights` (adapters, or merged weights) planned into buckets."""
        if self.lora is not None:
            return WeightStream.of(self.export_weights(), max_bytes)
        return stream_state_dict(self.lm, self.dtype, max_bytes)

    def export_pretrained(self, directory: Path | str, shard: ShardIdentity) -> None:
        """``save_pretrained`` of the policy (in ``model.dtype``) and its tokenizer. With LoRA:
        the PEFT adapter (and, with ``exportMerged``, the merged model under ``merged/``)."""
        if self.lora is not None:
            if shard.is_dp_leader:
                self._export_lora(Path(directory))
            return
        weights = self.export_weights()  # collective under FSDP
        if shard.is_dp_leader:
            save_pretrained(self.lm, weights, directory, self.model_dir)

    def _export_lora(self, out: Path) -> None:
        out.mkdir(parents=True, exist_ok=True)
        self.lm.save_pretrained(str(out))  # adapter_config.json + adapter_model.safetensors
        with suppress(OSError, ValueError):  # a model directory without a tokenizer
            load_tokenizer(self.model_dir).save_pretrained(str(out))
        if self.lora is not None and self.lora.export_merged:
            plain = load_causal_lm(self.model_dir, "float32")
            save_pretrained(
                plain, merged_lora_weights(self.lm, self.dtype), out / "merged", self.model_dir
            )


def real_tokens(micro: Mapping[str, torch.Tensor], packed: bool) -> torch.Tensor | None:
    """The tokens of a micro-batch's forward that are real (each row's prompt and response
    tokens, not its padding) in the order the decoder flattens them: ``[b * (P + T)]`` bool
    (prompt then response columns), or None when packed (:func:`~.packing.pack_rows` keeps
    only real tokens)."""
    if packed:
        return None
    mask = torch.cat([micro["prompt_mask"], micro["response_mask"]], 1)
    return mask.bool().reshape(-1)


def replay_layout(
    micro: Mapping[str, torch.Tensor], packed: bool
) -> tuple[torch.Tensor, torch.Tensor]:
    """A micro-batch's recorded routing in the order the decoder flattens its tokens, and
    the positions whose routing reaches a response token's log-prob (the real prompt tokens
    and every response token but the last: a row's last token predicts nothing trained):
    ``[b, P + T, layers, k]`` and ``[b, P + T]`` (prompt then response columns), or packed
    (:func:`~.packing.pack_rows`: each row's real prompt tokens, then its response tokens up
    to its length) ``[1, N, layers, k]`` and ``[1, N]``."""
    prompt, response = micro["prompt_routed_experts"], micro["routed_experts"]
    pmask = micro["prompt_mask"].bool()
    rmask = micro["response_mask"].bool()
    if not packed:
        recorded = torch.cat([prompt, response], 1)
        followed = torch.cat([rmask[:, 1:], torch.zeros_like(rmask[:, :1])], 1)
        return recorded, torch.cat([pmask, followed], 1)
    rows, valid = [], []
    for i in range(response.shape[0]):
        length = int(rmask[i].sum())
        rows += [prompt[i][pmask[i]], response[i, :length]]
        valid += [torch.ones(int(pmask[i].sum()), dtype=torch.bool)]
        valid += [torch.arange(length) < length - 1]
    return torch.cat(rows)[None], torch.cat(valid)[None]
