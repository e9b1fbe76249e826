"""Off-policy pieces of bounded-staleness training: importance weights of the decoupled PPO
objective, per-token staleness, and the admission window of generation.

Decoupled PPO (Hilton et al. 2022, "Batch size-invariance for policy optimization"; AReaL's
asynchronous loop): three policies meet in a step. pi_behaviour sampled the tokens (the engine's
weights when it generated them: its sampling log-probs, ``rollout_logprobs``); pi_old, the
*proximal* policy, is the actor at the start of the step (``old_logprobs``, recomputed by the
actor) and anchors the clipped ratio pi_theta / pi_old; the weight w = pi_old / pi_behaviour
corrects for sampling from pi_behaviour. Per token t of sample i::

    token level:     w_it = exp(old_it - behaviour_it)
    sequence level:  w_it = W_i = exp(sum_t' (old_it' - behaviour_it'))     (every token of i)
    truncate (TIS):  w -> min(w, cap)
    mask (MIS):      w -> w * [w <= cap]

    loss_it = w_it * max(-A_it r_it, -A_it clip(r_it, 1 - eps_low, 1 + eps_high)),
    r_it = pi_theta / pi_old

Log-ratios are clamped to [-20, 20] before ``exp`` (a sequence's sum may be large).
"""

from __future__ import annotations

import torch

__all__ = [
    "LOG_W_CLAMP",
    "StalenessError",
    "generation_window",
    "importance_weights",
    "interval_overlap",
    "staleness_stats",
]

LOG_W_CLAMP = 20.0


class StalenessError(RuntimeError):
    """A sample older than ``maxStaleness`` reached training (the admission rule was broken)."""


def importance_weights(
    old_logprobs: torch.Tensor,
    behaviour_logprobs: torch.Tensor,
    mask: torch.Tensor,
    *,
    level: str,
    mode: str,
    cap: float,
) -> tuple[torch.Tensor, dict[str, float]]:
    """The weights [B, T] (float32, no gradient, 0 off the mask) and their statistics over the
    response tokens, as sums for aggregation over workers: ``is_raw_sum`` (the weights before
    truncation or masking), ``is_raw_max``, ``is_capped`` (tokens whose weight exceeded ``cap``:
    truncated, or masked out) and ``is_tokens``."""
    if level not in ("token", "sequence"):
        raise ValueError(f"importance_weights: level must be token or sequence, got {level!r}")
    if mode not in ("truncate", "mask"):
        raise ValueError(f"importance_weights: mode must be truncate or mask, got {mode!r}")
    if not cap > 1:
        raise ValueError(f"importance_weights: cap must be > 1, got {cap!r}")
    m = mask.bool()
    log_w = torch.where(m, old_logprobs.float() - behaviour_logprobs.float(), 0.0).detach()
    if level == "sequence":
        log_w = log_w.sum(dim=1, keepdim=True).expand_as(log_w)
    raw = torch.exp(log_w.clamp(-LOG_W_CLAMP, LOG_W_CLAMP))
    over = raw > cap
    w = raw.clamp(max=float(cap)) if mode == "truncate" else torch.where(over, 0.0, raw)
    w = torch.where(m, w, 0.0)
    stats = {
        "is_raw_sum": float(torch.where(m, raw, 0.0).sum()),
        "is_raw_max": float(torch.where(m, raw, 0.0).max()) if m.any() else 0.0,
        "is_capped": float((over & m).sum()),
        "is_tokens": float(m.sum()),
    }
    return w, stats


def staleness_stats(
    versions: torch.Tensor, mask: torch.Tensor, current: int, bound: int
) -> dict[str, float]:
    """Per-token staleness ``current - version`` over the response tokens: its sum, max and a
    histogram (``staleness_hist_<s>``: tokens of staleness s, for s = 0..bound). Raises
    :class:`StalenessError` when a token is older than ``bound`` versions: such a sample must
    never be trained on."""
    m = mask.bool()
    stale = (int(current) - versions.long())[m]
    worst = int(stale.max()) if stale.numel() else 0
    if worst > bound:
        raise StalenessError(
            f"a sample is {worst} policy versions old, more than maxStaleness {bound}: "
            "generation was launched outside its admission window"
        )
    out = {"staleness_sum": float(stale.sum()), "staleness_max": float(worst)}
    for s in range(bound + 1):
        out[f"staleness_hist_{s}"] = float((stale == s).sum())
    return out


def generation_window(step: int, launched: int, bound: int, total: int | None) -> range:
    """The steps whose generation may be launched at the start of step ``step``, when every
    step before ``launched`` has been launched already.

    Admission rule: at a step's start the engines hold the actor's current version v (the
    previous step's weight sync has completed) and each step syncs at most once, so samples of
    step j generated now are at most j - step versions old when step j trains on them. Steps up
    to ``step + bound`` are admitted; later ones wait (their generation is not launched, never
    launched and thrown away). ``total``: the run's step count (no generation past its end).
    """
    hi = step + bound + 1
    if total is not None:
        hi = min(hi, total)
    return range(max(launched, step), hi)


def interval_overlap(span: tuple[float, float], intervals: list[tuple[float, float]]) -> float:
    """Seconds of ``span`` covered by the union of ``intervals`` (overlaps counted once)."""
    lo, hi = span
    clipped = sorted((max(a, lo), min(b, hi)) for a, b in intervals if min(b, hi) > max(a, lo))
    total, end = 0.0, lo
    for a, b in clipped:
        a = max(a, end)
        if b > a:
            total += b - a
            end = b
    return total
