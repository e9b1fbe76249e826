"""Shared helpers of the torch backend: model inputs of a batch, log-probs and entropy under the
sampling distribution, nucleus filtering and the learning-rate schedule."""

from __future__ import annotations

import math
from collections.abc import Iterator, Mapping
from contextlib import contextmanager

import torch
from torch import nn

from ppojob_api.training import TrainingSettings

from ...algorithms.sampling import sampling_logprobs


def full_inputs(
    batch: Mapping[str, torch.Tensor],
) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None, int]:
    """Prompt + response ids, attention mask (None without padding), position ids, prompt len."""
    prompt_ids, prompt_mask = batch["prompt_ids"], batch["prompt_mask"]
    ids = torch.cat([prompt_ids, batch["response_ids"]], dim=1)
    if bool(prompt_mask.all()):
        return ids, None, None, prompt_ids.shape[1]
    ones = torch.ones_like(batch["response_ids"], dtype=prompt_mask.dtype)
    attn = torch.cat([prompt_mask, ones], dim=1).long()
    pos = (attn.cumsum(-1) - 1).clamp_min(0)
    return ids, attn, pos, prompt_ids.shape[1]


def token_logprobs(
    logits: torch.Tensor, tokens: torch.Tensor, temperature: float, top_p: float = 1.0
) -> torch.Tensor:
    """Log-probs of ``tokens`` under the sampling distribution: ``softmax(logits / temperature)``
    truncated to the ``top_p`` nucleus (:func:`~ppojob_trainer.algorithms.sampling_logprobs`),
    in float32."""
    return sampling_logprobs(logits, tokens, temperature, top_p)


def entropy(logits: torch.Tensor, temperature: float) -> torch.Tensor:
    """Entropy of ``softmax(logits / temperature)`` per position, float32."""
    logp = torch.log_softmax(logits.float() / temperature, dim=-1)
    return -(logp.exp() * logp).sum(-1)


def top_p_filter(probs: torch.Tensor, top_p: float) -> torch.Tensor:
    """Zero the tail of each row beyond the smallest set with probability mass >= ``top_p``."""
    sorted_p, idx = probs.sort(dim=-1, descending=True)
    before = sorted_p.cumsum(-1) - sorted_p  # mass strictly before each token
    sorted_p = sorted_p.masked_fill(before >= top_p, 0.0)
    return torch.zeros_like(probs).scatter_(-1, idx, sorted_p)


def lr_factor(update: int, settings: TrainingSettings, total_updates: int) -> float:
    """Multiplier of the peak learning rate at optimizer update ``update`` (0-based): a linear
    warmup over ``lr_warmup_steps``, then the peak, then the decay to ``min_learning_rate``
    over the last ``lr_decay_steps`` updates (0: every update after the warmup)."""
    warm = settings.lr_warmup_steps
    if warm and update < warm:
        return (update + 1) / warm
    if settings.lr_scheduler == "constant" or total_updates <= warm:
        return 1.0
    span = total_updates - warm
    if settings.lr_decay_steps:
        span = min(span, settings.lr_decay_steps)
    start = total_updates - span  # the first update of the decay
    if update < start:
        return 1.0
    progress = min(1.0, (update - start) / max(1, span))
    floor = settings.min_learning_rate / settings.learning_rate
    if settings.lr_scheduler == "linear":
        return floor + (1 - floor) * (1 - progress)
    return floor + (1 - floor) * 0.5 * (1 + math.cos(math.pi * progress))


@contextmanager
def _eval_mode(module: nn.Module) -> Iterator[None]:
    """``module`` in eval mode (no dropout) inside the block, its previous mode after."""
    was_training = module.training
    module.eval()
    try:
        yield
    finally:
        module.train(was_training)


def _split(n: int, size: int) -> list[torch.Tensor]:
    return [torch.arange(i, min(i + size, n)) for i in range(0, n, size)]
