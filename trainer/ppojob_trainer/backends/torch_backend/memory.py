"""Devices, precision and bounded memory: the one place a micro-batch moves to the device
(:func:`to_device`), padding trimmed per (micro-)batch (:func:`trim_padding`), and log-probs and
entropy from the hidden states ``LOGITS_CHUNK_TOKENS`` positions at a time
(:func:`chunked_logprobs`)."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch
from torch import nn

from ...algorithms.sampling import sampling_logprobs

LOGITS_CHUNK_TOKENS = 1024
"""Positions whose vocabulary logits exist at once in :func:`chunked_logprobs`."""


def to_device(batch: Mapping[str, torch.Tensor], device: torch.device) -> dict[str, torch.Tensor]:
    """Every tensor of ``batch`` on ``device``: the one place a micro-batch crosses from the CPU
    seam to the worker's device, so a loss never mixes devices."""
    nb = device.type == "cuda"
    return {k: v.to(device, non_blocking=nb) for k, v in batch.items()}


def trim_padding(batch: Mapping[str, torch.Tensor]) -> tuple[dict[str, torch.Tensor], int]:
    """``batch`` padded to its own longest prompt and response, not the step's maximum.

    Drops the response columns after the last response token of any row (every ``[b, T]``
    tensor) and the prompt columns before the first prompt token of any row (prompts are
    left-padded). Returns the trimmed batch and the original response width ``T``.
    """
    width = batch["response_ids"].shape[1]
    keep = width
    mask = batch.get("response_mask")
    if mask is not None and width:
        used = mask.bool().any(0).nonzero()
        keep = int(used[-1]) + 1 if used.numel() else 1
    first = 0
    pmask = batch.get("prompt_mask")
    if pmask is not None and pmask.shape[1] > 1:
        used = pmask.bool().any(0).nonzero()
        first = min(int(used[0]) if used.numel() else 0, pmask.shape[1] - 1)
    out = {}
    for k, v in batch.items():
        if k in ("prompt_ids", "prompt_mask", "prompt_routed_experts"):
            out[k] = v[:, first:]
        elif v.dim() >= 2 and v.shape[1] == width and keep < width:
            out[k] = v[:, :keep]
        else:
            out[k] = v
    return out, width


def _pad_columns(x: torch.Tensor, width: int) -> torch.Tensor:
    if x.shape[1] >= width:
        return x
    return torch.cat([x, x.new_zeros(x.shape[0], width - x.shape[1], *x.shape[2:])], 1)


def scalar(x: Any) -> float:
    """A metric as a Python float (a sharded DTensor is gathered; a tensor on the ``meta``
    device, where only shapes exist, is NaN)."""
    if not isinstance(x, torch.Tensor):
        return float(x)
    if hasattr(x, "full_tensor"):
        x = x.full_tensor()
    if x.is_meta:
        return float("nan")
    return float(x.detach())


def _chunk_stats(
    head: nn.Module,
    hidden: torch.Tensor,
    tokens: torch.Tensor,
    temperature: float,
    want_entropy: bool,
    entropy_grad: bool,
    softcap: float | None,
    top_p: float = 1.0,
) -> tuple[torch.Tensor, torch.Tensor]:
    logits = head(hidden).float()
    if softcap:
        logits = torch.tanh(logits / softcap) * softcap
    if top_p < 1.0:  # the sampling distribution: the top-p nucleus, renormalised
        logp = sampling_logprobs(logits, tokens, temperature, top_p)
        logits = logits / temperature
        lse = torch.logsumexp(logits, dim=-1)
    else:
        logits = logits / temperature
        lse = torch.logsumexp(logits, dim=-1)
        logp = logits.gather(-1, tokens.unsqueeze(-1)).squeeze(-1) - lse
    if not want_entropy:
        return logp, logp.new_zeros(0)
    if entropy_grad:
        return logp, lse - (torch.softmax(logits, -1) * logits).sum(-1)
    with torch.no_grad():
        d = logits.detach()
        return logp, lse.detach() - (torch.softmax(d, -1) * d).sum(-1)


def chunked_logprobs(
    hidden: torch.Tensor,
    head: nn.Module,
    tokens: torch.Tensor,
    temperature: float,
    *,
    want_entropy: bool = False,
    entropy_grad: bool = False,
    chunk_tokens: int = LOGITS_CHUNK_TOKENS,
    softcap: float | None = None,
    top_p: float = 1.0,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Log-probs of ``tokens`` [b, T] (and the entropy) from the last hidden states [b, T, H].

    The vocabulary projection ``head`` runs ``chunk_tokens`` positions at a time and each
    chunk's logits are reduced (float32 log-sum-exp, gather) before the next exists. With
    gradients and more than one chunk, each chunk is recomputed in backward
    (``torch.utils.checkpoint``) instead of keeping its logits: memory holds one chunk of
    ``[chunk_tokens, V]`` logits, never ``[b, T, V]``.
    """
    b, t, h = hidden.shape
    flat, toks = hidden.reshape(b * t, h), tokens.reshape(b * t)
    n = b * t
    recompute = torch.is_grad_enabled() and hidden.requires_grad and n > chunk_tokens
    lps, ents = [], []
    for s in range(0, max(n, 1), chunk_tokens):
        args = (
            head,
            flat[s : s + chunk_tokens],
            toks[s : s + chunk_tokens],
            temperature,
            want_entropy,
            entropy_grad,
            softcap,
            top_p,
        )
        if recompute:
            from torch.utils.checkpoint import checkpoint

            lp, ent = checkpoint(_chunk_stats, *args, use_reentrant=False)
        else:
            lp, ent = _chunk_stats(*args)
        lps.append(lp)
        ents.append(ent)
    # (fresh tensors, not views: an FSDP root's outputs carry its backward hooks)
    logp = torch.cat(lps).view(b, t).clone()
    return logp, (torch.cat(ents).view(b, t).clone() if want_entropy else None)
