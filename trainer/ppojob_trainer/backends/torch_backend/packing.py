"""Packing and token-budget micro-batches: rows planned into micro-batches by a token budget
(first-fit decreasing when packed), and rows packed into one sequence without padding and back.
(The megatron backend plans and packs with these too.)"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import torch
from torch import nn

from .common import _split


def sequence_lengths(batch: Mapping[str, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
    """Real (unpadded) prompt and response tokens of each row: ``prompt_mask`` and
    ``response_mask`` counted (a batch without ``response_mask``: every column)."""
    plen = batch["prompt_mask"].bool().sum(1)
    mask = batch.get("response_mask")
    if mask is None:
        rlen = torch.full_like(plen, batch["response_ids"].shape[1])
    else:
        rlen = mask.bool().sum(1)
    return plen, rlen


def micro_batch_rows(
    batch: Mapping[str, torch.Tensor],
    max_tokens: int | None,
    *,
    packing: bool,
    max_rows: int | None,
    field: str = "maxTokensPerMicroBatch",
) -> list[torch.Tensor]:
    """The rows of each micro-batch of ``batch`` (index tensors; every row exactly once).

    Without ``max_tokens``: consecutive runs of ``max_rows`` rows (today's micro-batches).
    With it: micro-batches whose tokens as the forward sees them fit ``max_tokens``: the sum
    of the rows' prompt + response tokens when packed, rows x the longest prompt + the longest
    response when padded. Rows are taken longest first (first-fit decreasing when packed, runs
    of similar lengths when padded), so few micro-batches run, and one long row never drags
    short ones to its width. A row longer than ``max_tokens`` raises ``ValueError`` naming
    ``field``."""
    n = batch["response_ids"].shape[0]
    if max_tokens is None:
        return _split(n, max(1, max_rows or n))
    plen, rlen = sequence_lengths(batch)
    cost = (plen + rlen).tolist()
    order = sorted(range(n), key=lambda i: (-cost[i], i))
    if order and cost[order[0]] > max_tokens:
        raise ValueError(
            f"{field}: a sequence of {cost[order[0]]} tokens (prompt + response) does not fit "
            f"the budget of {max_tokens} tokens; raise {field} to at least "
            "maxPromptLength + maxResponseLength"
        )
    bins: list[list[int]] = []
    if packing:  # first-fit decreasing by tokens
        room: list[int] = []
        for i in order:
            for b, free in enumerate(room):
                if cost[i] <= free and (max_rows is None or len(bins[b]) < max_rows):
                    bins[b].append(i)
                    room[b] -= cost[i]
                    break
            else:
                bins.append([i])
                room.append(max_tokens - cost[i])
    else:  # padded: each micro-batch costs rows x (longest prompt + longest response)
        pmax = rmax = 0
        for i in order:
            p, r = max(pmax, int(plen[i])), max(rmax, int(rlen[i]))
            full = max_rows is not None and bins and len(bins[-1]) >= max_rows
            if bins and not full and (len(bins[-1]) + 1) * (p + r) <= max_tokens:
                bins[-1].append(i)
                pmax, rmax = p, r
            else:
                bins.append([i])
                pmax, rmax = int(plen[i]), int(rlen[i])
    return [torch.tensor(sorted(b), dtype=torch.long) for b in bins]


def split_to_count(bins: Sequence[torch.Tensor], count: int) -> list[torch.Tensor]:
    """``bins`` split (the one with most rows in halves, repeatedly) until there are ``count``
    of them: FSDP's collectives need every worker of the group to run as many micro-batches.
    A half of a micro-batch within the token budget is within it too."""
    out = [b for b in bins]
    while len(out) < count:
        big = max(range(len(out)), key=lambda j: len(out[j]))
        if len(out[big]) < 2:
            raise ValueError(
                f"maxTokensPerMicroBatch: another data-parallel worker runs {count} "
                f"micro-batches but this one has only {sum(len(b) for b in bins)} samples"
            )
        rows = out.pop(big)
        out[big:big] = [rows[0::2], rows[1::2]]
    return out


def pack_rows(
    batch: Mapping[str, torch.Tensor],
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """``batch``'s sequences (each row's real prompt tokens, then its response tokens up to its
    length) concatenated into one row without padding.

    Returns ``input_ids`` [1, N] and ``position_ids`` [1, N] (restarting at 0 for every
    sequence: the Hugging Face attention takes that, with no attention mask, as packed
    sequences: a block-diagonal causal mask for eager/sdpa attention, varlen kernels for flash
    attention), then for each of the batch's response tokens, flattened: the packed position
    whose hidden state predicts it (``select``), and its row and column in ``[B, T]``."""
    prompt_ids, pmask = batch["prompt_ids"], batch["prompt_mask"].bool()
    resp = batch["response_ids"]
    _, rlen = sequence_lengths(batch)
    ids, pos, select, rows, cols = [], [], [], [], []
    offset = 0
    for i in range(resp.shape[0]):
        prompt = prompt_ids[i][pmask[i]]
        if prompt.numel() == 0:
            raise ValueError(f"packing: sample {i} has no prompt token")
        length = int(rlen[i])
        seq = torch.cat([prompt, resp[i, :length]])
        ids.append(seq)
        pos.append(torch.arange(seq.numel()))
        steps = torch.arange(length)
        select.append(offset + prompt.numel() - 1 + steps)
        rows.append(torch.full((length,), i, dtype=torch.long))
        cols.append(steps)
        offset += seq.numel()
    return (
        torch.cat(ids)[None],
        torch.cat(pos)[None],
        torch.cat(select),
        torch.cat(rows),
        torch.cat(cols),
    )


def unpack(flat: torch.Tensor, rows: torch.Tensor, cols: torch.Tensor, shape: Any) -> torch.Tensor:
    """Per-token values ``flat`` [n] put back at their ``(rows, cols)`` of a zero ``[B, T]``
    (differentiable)."""
    out = flat.new_zeros(tuple(shape))
    return out.index_put((rows, cols), flat)


def check_packing_support(model: nn.Module) -> None:
    """Packed sequences need a Hugging Face decoder whose attention mask comes from
    ``transformers.masking_utils`` (which reads restarting position ids as sequence
    boundaries); a model with its own mask code would attend across them."""
    import sys

    decoder = model.get_decoder() if hasattr(model, "get_decoder") else model
    module = sys.modules.get(type(decoder).__module__)
    if module is None or not hasattr(module, "create_causal_mask"):
        raise ValueError(
            f"packing: {type(decoder).__name__} builds its attention mask itself (not with "
            "transformers' create_causal_mask), so packed sequences would attend to each "
            "other; set packing: false for this model"
        )
