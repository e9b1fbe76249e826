"""Inputs of the megatron backend: rows shifted left so that each prompt starts at position 0,
and packed rows with their attention (``PackedSeqParams`` under Transformer Engine, a
block-diagonal causal mask otherwise) and rotary positions restarting per sequence."""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager
from typing import Any

import torch


def left_aligned(
    batch: Mapping[str, torch.Tensor], pad_to: int = 1
) -> tuple[torch.Tensor, torch.Tensor]:
    """(ids [B, L], index [B, T]): each row's prompt + response moved to start at position 0,
    and the position of the logits (or value) that predicts response token t of row i.

    ``L`` is rounded up to a multiple of ``pad_to`` (sequence parallelism splits it)."""
    prompt_ids, prompt_mask = batch["prompt_ids"], batch["prompt_mask"].long()
    ids = torch.cat([prompt_ids, batch["response_ids"]], dim=1)
    b, p = prompt_ids.shape
    t = batch["response_ids"].shape[1]
    length = p + t
    shift = p - prompt_mask.sum(1)  # left padding of each row
    cols = torch.arange(length)[None, :] + shift[:, None]
    out = ids.gather(1, cols.clamp(max=length - 1))
    out = out.masked_fill(cols >= length, 0)
    total = -(-length // pad_to) * pad_to
    if total > length:
        out = torch.cat([out, out.new_zeros(b, total - length)], 1)
    index = (p - shift - 1)[:, None] + torch.arange(t)[None, :]
    return out, index


def _causal_mask(length: int, device: torch.device) -> torch.Tensor:
    return torch.ones(length, length, device=device).triu(1).bool()[None, None]


def packed_lengths(positions: torch.Tensor) -> list[int]:
    """The lengths of the sequences of one packed row, from its ``positions`` (restarting at 0
    for every sequence, :func:`~.torch_backend.packing.pack_rows`)."""
    pos = positions.reshape(-1)
    starts = (pos == 0).nonzero().flatten().tolist()
    return [b - a for a, b in zip(starts, [*starts[1:], pos.numel()], strict=True)]


def block_causal_mask(lengths: list[int], device: torch.device) -> torch.Tensor:
    """[1, 1, N, N] bool, megatron's convention (True: masked out): each of the packed
    sequences of ``lengths`` attends causally to itself and to no other."""
    seg = torch.repeat_interleave(torch.arange(len(lengths)), torch.tensor(lengths))
    same = seg[:, None] == seg[None, :]
    causal = torch.ones(len(seg), len(seg), dtype=torch.bool).tril()
    return (~(same & causal)).to(device)[None, None]


def packed_seq_params(lengths: list[int], device: torch.device) -> Any:
    """megatron-core's ``PackedSeqParams`` of one packed row (``thd``: Transformer Engine's
    varlen attention, and RoPE restarted per sequence): the cumulative sequence boundaries
    ``cu_seqlens`` [0, l1, l1 + l2, ..., N] (int32) and the longest sequence, the same for
    queries and keys (self-attention; no context parallelism, so no per-sequence padding)."""
    from megatron.core.packed_seq_params import PackedSeqParams

    cu = torch.zeros(len(lengths) + 1, dtype=torch.int32)
    cu[1:] = torch.tensor(lengths, dtype=torch.int32).cumsum(0)
    cu = cu.to(device)
    longest = max(lengths)
    return PackedSeqParams(
        qkv_format="thd",
        cu_seqlens_q=cu,
        cu_seqlens_kv=cu,
        max_seqlen_q=longest,
        max_seqlen_kv=longest,
    )


@contextmanager
def rope_positions(module: Any, positions: torch.Tensor) -> Iterator[None]:
    """Inside the block, the rotary embeddings of ``module`` (megatron-core's ``GPTModel``
    computes them for positions 0..N-1 of the row, whatever its ``position_ids``) rotate token
    k by ``positions[k]`` instead: the packed row's positions, restarting per sequence, as the
    Hugging Face model and the padded row give them (megatron's local attention takes no
    ``PackedSeqParams``)."""
    from megatron.core.models.common.embeddings.rotary_pos_embedding import RotaryEmbedding

    pos = positions.reshape(-1)
    ropes = [m for m in module.modules() if type(m) is RotaryEmbedding]

    def restarted(rope: Any) -> Callable[..., torch.Tensor]:
        def forward(max_seq_len: int, *args: Any, **kwargs: Any) -> torch.Tensor:
            emb = RotaryEmbedding.forward(rope, int(pos.max()) + 1, *args, **kwargs)
            return emb[pos.to(emb.device)]

        return forward

    for rope in ropes:
        rope.forward = restarted(rope)
    try:
        yield
    finally:
        for rope in ropes:
            del rope.forward


def _split(n: int, size: int) -> list[slice]:
    return [slice(i, min(i + size, n)) for i in range(0, n, size)]
