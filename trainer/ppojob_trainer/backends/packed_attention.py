"""Attention over packed rows, one sequence at a time, without a dense mask.

A packed row (``pack_rows``) holds many sequences one after the other, position ids restarting
at 0 for each. Hugging Face's ``sdpa`` attention reads that as a block-diagonal causal mask over
the whole row: on a GPU without flash-attention, and always on the CPU, every position then
computes scores against every other position of the row, a cost quadratic in the *packed*
length (a 2,304-token row of 32 sequences does ~30x the attention work of its sequences alone).

This module registers an attention implementation, ``ppojob_packed``, with transformers'
``AttentionInterface`` and ``AttentionMaskInterface``. With no padding mask it runs causal
attention per sequence, sequences of one length stacked into one call
(``torch.nn.functional.scaled_dot_product_attention`` through transformers' own
``sdpa_attention_forward``, so grouped-query heads, scaling and dropout are the model's), the
sequences' boundaries taken from ``cu_seq_lens_q`` (the cumulative lengths flash-attention's
varlen kernels take, which the trainer passes with its packed inputs) or else from the
restarting ``position_ids``. With a padding mask (an unpacked, padded batch) it is
exactly ``sdpa``. The trainer switches a model to it only where the model runs ``sdpa``
(a flash-attention model already has a varlen kernel; eager attention may be there for a reason,
e.g. soft-capping, that sdpa does not support).
"""

from __future__ import annotations

import itertools
from typing import Any

import torch

NAME = "ppojob_packed"
"""The attention implementation's name in transformers' registries."""


def segment_offsets(kwargs: dict[str, Any], length: int) -> list[int]:
    """The start of every sequence of a row of ``length`` positions, then ``length``: from
    ``cu_seq_lens_q`` if given, else from where ``position_ids`` [1, length] restart. Neither
    is an error: a model whose code drops the attention's keyword arguments would otherwise
    attend across the packed sequences without a word."""
    cu = kwargs.get("cu_seq_lens_q")
    if cu is not None:
        offsets = [int(x) for x in cu.tolist()]
        if offsets[0] != 0 or offsets[-1] != length:
            raise ValueError(
                f"packed attention: cu_seq_lens_q {offsets[:3]}...{offsets[-1]} does not "
                f"cover the row's {length} positions"
            )
        return offsets
    pos = kwargs.get("position_ids")
    if pos is not None and pos.shape[-1] == length:
        if pos.dim() > 1 and pos.shape[0] > 1 and not bool((pos == pos[:1]).all()):
            raise ValueError("packed attention: rows of one batch are packed differently")
        row = pos.reshape(-1, length)[0]
        starts = (torch.nonzero(row[1:] != row[:-1] + 1).flatten() + 1).tolist()
        return [0, *starts, length]
    raise ValueError(
        "packing: the model's attention got neither cu_seq_lens_q nor position_ids, so it "
        "cannot tell the packed sequences apart (its code does not pass the attention's "
        "keyword arguments through); set training.packing: false for this model"
    )


DENSE_ROW_TOKENS = 512
"""Rows up to this many positions attend in one call through a block-diagonal mask: below it,
on the CPU, a call per sequence length costs more than the scores across sequences it saves
(measured: a row of ~130 tokens of 7 sequences 2.7x slower per sequence, ~530 even, ~1,100
3.6x faster)."""


def block_causal_mask(offsets: list[int], window: int | None, device: torch.device) -> torch.Tensor:
    """[1, 1, T, T] boolean (True: attend): each sequence between ``offsets`` attends causally
    (within ``window`` positions, if any) to itself only."""
    length = offsets[-1]
    lengths = torch.tensor(offsets[1:]) - torch.tensor(offsets[:-1])
    seq = torch.repeat_interleave(torch.arange(len(lengths)), lengths).to(device)
    i = torch.arange(length, device=device)
    mask = (seq[:, None] == seq[None, :]) & (i[None, :] <= i[:, None])
    if window is not None:
        mask &= i[:, None] - i[None, :] < window
    return mask[None, None]


class RowPlan:
    """What the attention of every layer needs of one packed row, worked out once per row (per
    micro-batch) instead of once per layer: the sequences' ``offsets`` (reading them from
    ``cu_seq_lens_q`` copies the tensor to the host: a device synchronisation), the
    block-diagonal masks of a short row, and the index tensors that stack the sequences of each
    length, all on the row's device."""

    def __init__(self, offsets: list[int], device: torch.device) -> None:
        self.offsets = offsets
        self.length = offsets[-1]
        self.device = device
        self._masks: dict[tuple[int | None, int | None], torch.Tensor] = {}
        self._groups: tuple[list[tuple[int, torch.Tensor]], torch.Tensor] | None = None

    def mask(self, window: int | None, n: int | None = None) -> torch.Tensor:
        """:func:`block_causal_mask` of the row, or with ``n`` of one sequence of n positions
        (layers may differ in their window)."""
        key = (window, n)
        if key not in self._masks:
            offsets = self.offsets if n is None else [0, n]
            self._masks[key] = block_causal_mask(offsets, window, self.device)
        return self._masks[key]

    def groups(self) -> tuple[list[tuple[int, torch.Tensor]], torch.Tensor]:
        """``[(n, index)]``, one per sequence length n (``index``: the row positions of the
        sequences of that length, in order), and the inverse permutation that puts the
        stacked outputs back in row order."""
        if self._groups is None:
            by_length: dict[int, list[int]] = {}
            for start, end in itertools.pairwise(self.offsets):
                by_length.setdefault(end - start, []).append(start)
            indices = [
                (n, (torch.tensor(starts)[:, None] + torch.arange(n)[None, :]).reshape(-1))
                for n, starts in by_length.items()
            ]
            inverse = torch.empty(self.length, dtype=torch.long)
            inverse[torch.cat([index for _, index in indices])] = torch.arange(self.length)
            self._groups = (
                [(n, index.to(self.device)) for n, index in indices],
                inverse.to(self.device),
            )
        return self._groups


# One slot for the whole process, not per thread: on a GPU, autograd runs activation
# checkpointing's recomputation in its device thread, which must find the forward's plan. A
# tuple is replaced whole, so a reader in another thread sees an old entry or a new one, and an
# entry is used only for the very tensor it was made from.
_last: list[tuple[torch.Tensor, int | None, RowPlan] | None] = [None]


def _version(t: torch.Tensor) -> int | None:
    try:
        return t._version
    except RuntimeError:  # an inference-mode tensor keeps no version counter
        return None


def row_plan(kwargs: dict[str, Any], length: int, device: torch.device) -> RowPlan:
    """The :class:`RowPlan` of the row whose boundaries ``kwargs`` carry: the one the previous
    layer used when they are the same tensor, unchanged since (every layer of a forward, and
    activation checkpointing's recomputation, gets the tensor the model was called with; each
    micro-batch brings a new one), else a new plan."""
    source = kwargs.get("cu_seq_lens_q")
    if source is None:
        source = kwargs.get("position_ids")
    cached = _last[0]
    if (
        cached is not None
        and source is not None
        and cached[0] is source
        and cached[1] == _version(source)
        and cached[2].length == length
        and cached[2].device == device
    ):
        return cached[2]
    plan = RowPlan(segment_offsets(kwargs, length), device)
    _last[0] = None if source is None else (source, _version(source), plan)
    return plan


def packed_attention_forward(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    dropout: float = 0.0,
    scaling: float | None = None,
    sliding_window: int | None = None,
    **kwargs: Any,
) -> tuple[torch.Tensor, None]:
    """Per-sequence causal attention of ``query``/``key``/``value`` [B, heads, T, d] when there
    is no padding mask; ``sdpa`` with it. Returns [B, T, heads, d] as every transformers
    attention function does."""
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    length = query.shape[2]
    if attention_mask is not None or key.shape[2] != length:  # padded batch, or a cache
        return sdpa_attention_forward(
            module, query, key, value, attention_mask, dropout=dropout, scaling=scaling, **kwargs
        )
    plan = row_plan(kwargs, length, query.device)
    rest = {
        k: v
        for k, v in kwargs.items()
        if k not in ("cu_seq_lens_q", "cu_seq_lens_k", "max_length_q", "max_length_k")
        and k not in ("position_ids", "is_causal")
    }
    if len(plan.offsets) == 2 and (sliding_window is None or length <= sliding_window):
        return sdpa_attention_forward(  # one sequence: plain causal attention
            module,
            query,
            key,
            value,
            None,
            dropout=dropout,
            scaling=scaling,
            is_causal=True,
            **rest,
        )
    if length <= DENSE_ROW_TOKENS:  # a short row: one call with the block-diagonal mask
        return sdpa_attention_forward(
            module,
            query,
            key,
            value,
            plan.mask(sliding_window),
            dropout=dropout,
            scaling=scaling,
            **rest,
        )
    # sequences of equal length go through one call, stacked as a batch of their own
    groups, inverse = plan.groups()
    batch, heads = query.shape[:2]
    outs = []
    for n, index in groups:

        def stacked(x: torch.Tensor, n: int = n, index: torch.Tensor = index) -> torch.Tensor:
            # [B, h, G*n, d] -> [B*G, h, n, d]
            # (the head size of each: values may differ from queries, as in MLA models)
            x = x.index_select(2, index).reshape(batch, x.shape[1], -1, n, x.shape[-1])
            return x.transpose(1, 2).reshape(-1, x.shape[1], n, x.shape[-1])

        mask = None
        if sliding_window is not None and n > sliding_window:
            mask = plan.mask(sliding_window, n)
        out, _ = sdpa_attention_forward(
            module,
            stacked(query),
            stacked(key),
            stacked(value),
            mask,
            dropout=dropout,
            scaling=scaling,
            is_causal=mask is None,
            **rest,
        )
        # [B*G, n, h, d] -> [B, G*n, h, d]
        outs.append(out.reshape(batch, -1, heads, out.shape[-1]))
    out = outs[0] if len(outs) == 1 else torch.cat(outs, dim=1)
    return out.index_select(1, inverse), None


def packed_attention_mask(*args: Any, attention_mask: torch.Tensor | None = None, **kwargs: Any):
    """The mask transformers builds for ``ppojob_packed``: none for a whole row without padding
    or cache (the attention finds the sequences itself), ``sdpa``'s otherwise (padding, a
    cache's earlier tokens)."""
    from transformers.masking_utils import sdpa_mask

    whole = kwargs.get("q_length") is not None and kwargs.get("q_length") == kwargs.get("kv_length")
    unshifted = int(kwargs.get("q_offset") or 0) == 0 and int(kwargs.get("kv_offset") or 0) == 0
    if attention_mask is None and whole and unshifted:
        return None
    return sdpa_mask(*args, attention_mask=attention_mask, **kwargs)


def register() -> None:
    """Make ``ppojob_packed`` known to transformers (idempotent)."""
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface

    AttentionInterface.register(NAME, packed_attention_forward)
    AttentionMaskInterface.register(NAME, packed_attention_mask)


def use_packed_attention(model: torch.nn.Module) -> bool:
    """Switch ``model`` (a transformers model) from ``sdpa`` to ``ppojob_packed``; leave any
    other implementation (flash-attention's varlen kernels, eager) as it is, and any model
    whose mask carries more than causality and sequence boundaries (sliding-window or chunked
    layers, which some models apply through the mask alone; bidirectional attention): those
    keep sdpa's block-diagonal mask, correct if slower. Returns whether it switched
    (transformers may decline, e.g. for a model whose source it cannot read)."""
    config = getattr(model, "config", None)
    if config is None or getattr(config, "_attn_implementation", None) != "sdpa":
        return False
    if not getattr(config, "is_causal", True):
        return False
    if getattr(config, "sliding_window", None) and getattr(config, "use_sliding_window", True):
        return False
    if any(kind != "full_attention" for kind in getattr(config, "layer_types", None) or []):
        return False
    register()
    model.set_attn_implementation(NAME)
    return model.config._attn_implementation == NAME
