"""What the torch policy and value trainers share: their checkpoint state (model and optimizer),
the causal LM's log-probs module, the (packed) model inputs on the device, and the Hugging Face
export of gathered weights."""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch
from torch import nn

from ...distributed import ShardIdentity
from ...models import load_tokenizer, save_pretrained_here
from .common import full_inputs
from .memory import chunked_logprobs
from .optimiser import _Optimised
from .packing import pack_rows


class _OptimisedState:
    """Checkpoint state of a trainer is its model and optimizer (``self.opt``)."""

    opt: _Optimised

    def state_dict(self) -> dict[str, object]:
        return self.opt.state_dict()

    def load_state_dict(self, state: Mapping[str, object]) -> None:
        self.opt.load_state_dict(state)

    def save_checkpoint(self, directory: Path | str, shard: ShardIdentity) -> None:
        """Every worker of the role writes its own shard (torch.distributed.checkpoint)."""
        self.opt.save_checkpoint(directory)

    def load_checkpoint(self, directory: Path | str, shard: ShardIdentity) -> None:
        self.opt.load_checkpoint(directory)


class CausalLMLogprobs(nn.Module):
    """A causal LM that returns the log-probs (and entropy) of given response tokens.

    The decoder runs once; the vocabulary projection runs over :data:`LOGITS_CHUNK_TOKENS`
    positions at a time (:func:`chunked_logprobs`), so no [B, T, V] logits tensor exists.
    """

    def __init__(self, lm: nn.Module) -> None:
        super().__init__()
        self.lm = lm
        self.softcap = getattr(lm.config, "final_logit_softcapping", None)

    def forward(
        self,
        inputs: Mapping[str, torch.Tensor | None],
        tokens: torch.Tensor,
        prompt_len: int,
        temperature: float,
        want_entropy: bool = False,
        entropy_grad: bool = False,
        chunk_tokens: int = 1024,
        top_p: float = 1.0,
        select: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """``select`` (packed inputs, :func:`pack_rows`): the positions of the one packed row
        whose hidden states predict ``tokens`` [1, n]; else ``tokens`` [b, T] follow the
        ``prompt_len`` prompt columns."""
        hidden = self.lm.get_decoder()(**inputs, use_cache=False).last_hidden_state
        if select is not None:
            hidden = hidden[0, select][None]
        else:
            tlen = tokens.shape[1]
            hidden = hidden[:, prompt_len - 1 : prompt_len - 1 + tlen]
        return chunked_logprobs(
            hidden,
            self.lm.get_output_embeddings(),
            tokens,
            temperature,
            want_entropy=want_entropy,
            entropy_grad=entropy_grad,
            chunk_tokens=chunk_tokens,
            softcap=self.softcap,
            top_p=top_p,
        )


def _device_inputs(
    batch: Mapping[str, torch.Tensor], device: torch.device
) -> tuple[dict[str, torch.Tensor | None], int]:
    """Model inputs of a CPU batch (decided on the CPU: padding is data-dependent), moved."""
    ids, attn, pos, plen = full_inputs(batch)
    inputs = {"input_ids": ids, "attention_mask": attn, "position_ids": pos}
    nb = device.type == "cuda"
    return {
        k: None if v is None else v.to(device, non_blocking=nb) for k, v in inputs.items()
    }, plen


def _packed_device_inputs(
    batch: Mapping[str, torch.Tensor], device: torch.device
) -> tuple[dict[str, torch.Tensor | None], torch.Tensor, torch.Tensor, torch.Tensor]:
    """Packed model inputs of a CPU batch (:func:`pack_rows`: no attention mask, position ids
    restarting per sequence) on ``device``; the selected positions there; rows and columns on
    the CPU."""
    ids, pos, select, rows, cols = pack_rows(batch)
    nb = device.type == "cuda"
    starts = torch.nonzero(pos[0] == 0).flatten()
    cu = torch.cat([starts, torch.tensor([pos.shape[1]])]).to(torch.int32)
    longest = int((cu[1:] - cu[:-1]).max())
    inputs: dict[str, Any] = {
        "input_ids": ids.to(device, non_blocking=nb),
        "attention_mask": None,
        "position_ids": pos.to(device, non_blocking=nb),
        # the sequences' boundaries, as flash-attention's varlen kernels and the CPU's
        # per-sequence attention (packed_attention) take them
        "cu_seq_lens_q": cu.to(device, non_blocking=nb),
        "cu_seq_lens_k": cu.to(device, non_blocking=nb),
        "max_length_q": longest,
        "max_length_k": longest,
    }
    return inputs, select.to(device, non_blocking=nb), rows, cols


def save_pretrained(
    model: nn.Module,
    weights: Mapping[str, torch.Tensor],
    directory: Path | str,
    tokenizer_dir: Path | str | None,
) -> None:
    """``model.save_pretrained`` with the given (gathered) weights, and the tokenizer saved
    with ``tokenizer_dir``'s model if it has one."""
    out = Path(directory)
    out.mkdir(parents=True, exist_ok=True)
    dtypes = {v.dtype for v in weights.values() if v.is_floating_point()}
    if len(dtypes) == 1:
        model.config.dtype = next(iter(dtypes))
    save_pretrained_here(model, out, state_dict=dict(weights))
    if tokenizer_dir is not None:
        try:
            tok = load_tokenizer(tokenizer_dir)
        except (OSError, ValueError):  # a model directory without a tokenizer
            return
        tok.save_pretrained(str(out))
