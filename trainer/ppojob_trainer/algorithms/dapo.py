"""DAPO's sample-level pieces (Yu et al. 2025, "DAPO: An Open-Source LLM Reinforcement Learning
System at Scale", arXiv 2503.14476): the soft overlong punishment, truncated samples, and the
group filter and refill of dynamic sampling.

Soft overlong punishment (eq. 13), with L_max the maximum response length and L_cache the
buffer::

    R_length(y) = 0                              if |y| <= L_max - L_cache
                  ((L_max - L_cache) - |y|) / L_cache   if L_max - L_cache < |y| <= L_max
                  -1                             if L_max < |y|

Dynamic sampling (eq. 11's constraint 0 < |{o_i : is_equivalent(a, o_i)}| < G): a group whose
samples all got the same reward has zero advantage under a group estimator; it is filtered and
more groups are generated until the batch is full (:func:`fill_step`).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

__all__ = ["StepFill", "fill_step", "informative_groups", "overlong_penalty", "truncated_rows"]


def overlong_penalty(
    lengths: torch.Tensor, max_length: int, buffer: int, factor: float = 1.0
) -> torch.Tensor:
    """R_length of each response length [b] (float32), times ``factor``."""
    if not 0 < buffer <= max_length:
        raise ValueError(f"overlong_penalty: buffer must be in (0, {max_length}], got {buffer}")
    expected = max_length - buffer
    over = lengths.to(torch.float32) - float(expected)
    penalty = torch.where(over > 0, -over / float(buffer), torch.zeros_like(over))
    return torch.clamp(penalty, min=-1.0) * float(factor)


def truncated_rows(
    response_ids: torch.Tensor, lengths: torch.Tensor, max_length: int, stop_ids: Sequence[int]
) -> torch.Tensor:
    """[b] bool: responses cut at ``max_length`` tokens without a stop token as their last."""
    if response_ids.shape[0] == 0:
        return torch.zeros(0, dtype=torch.bool)
    last = (lengths.long() - 1).clamp(min=0).unsqueeze(1)
    last_token = response_ids.gather(1, last.to(response_ids.device)).squeeze(1).cpu()
    stops = torch.tensor(sorted(set(stop_ids)), dtype=last_token.dtype)
    ended = torch.isin(last_token, stops)
    return (lengths.cpu() >= max_length) & ~ended


def informative_groups(scores: torch.Tensor, group_ids: torch.Tensor) -> list[int]:
    """The groups (ids, in order of first appearance) whose samples' scores are not all equal."""
    out: list[int] = []
    seen: dict[int, tuple[float, float]] = {}
    for s, g in zip(scores.tolist(), group_ids.tolist(), strict=True):
        lo, hi = seen.get(g, (s, s))
        seen[g] = (min(lo, s), max(hi, s))
    for g, (lo, hi) in seen.items():
        if hi > lo:
            out.append(g)
    return out


@dataclass(frozen=True)
class StepFill:
    """Which generated groups a step trains on."""

    picked: list[tuple[int, int, bool]]
    """(round, group id, in the loss) in training order: the kept groups first (by round, then
    as generated); when short, filtered groups fill the rest, out of the loss."""
    filtered: int
    """Groups generated with all-equal rewards (left out, or used only as filler)."""
    short: int
    """Groups missing when the rounds ran out (as many fillers)."""


def fill_step(rounds: Sequence[tuple[Sequence[int], Sequence[int]]], need: int) -> StepFill:
    """The step's ``need`` groups from generation rounds, each ``(all group ids, informative
    group ids)``. Surplus informative groups (of the last round) are left unused."""
    kept = [(r, g) for r, (_, good) in enumerate(rounds) for g in good]
    flat = [(r, g) for r, (groups, good) in enumerate(rounds) for g in groups if g not in good]
    picked = [(r, g, True) for r, g in kept[:need]]
    short = max(need - len(kept), 0)
    if short > len(flat):
        raise ValueError(f"fill_step: {need} groups needed, only {len(kept) + len(flat)} generated")
    picked += [(r, g, False) for r, g in flat[:short]]
    return StepFill(picked, len(flat), short)
