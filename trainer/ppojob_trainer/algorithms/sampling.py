"""The sampling distribution and the rollout/training log-prob mismatch.

The rollout samples token ``a`` from ``softmax(logits / temperature)`` restricted to the nucleus
of ``top_p`` (the smallest set of most likely tokens whose mass reaches ``top_p``) and
renormalised. That truncated distribution is the behaviour policy, so it is also pi_old: the
actor's recomputed old log-probs and its training log-probs use the same truncation
(:func:`sampling_logprobs`), and the PPO ratio is 1 at the first update as it must be.

The nucleus is chosen from the logits without a gradient; the sampled token always counts as
kept (at pi_old it is in the nucleus anyway, having been sampled from it; after an update it may
leave it, and a finite log-prob keeps the ratio defined). With ``top_p = 1`` this is the plain
temperature-scaled log-softmax.
"""

from __future__ import annotations

import torch

__all__ = ["nucleus_mask", "rollout_is_weights", "sampling_logprobs"]


def nucleus_mask(logp: torch.Tensor, top_p: float) -> torch.Tensor:
    """Boolean mask of the nucleus over the last dimension of log-probs ``logp``: a token is kept
    when the probability mass of the tokens ranked strictly before it is below ``top_p`` (so the
    most likely token is always kept). Ties are ranked by the sort's order."""
    sorted_logp, idx = logp.sort(dim=-1, descending=True)
    sorted_p = sorted_logp.exp()
    before = sorted_p.cumsum(-1) - sorted_p
    keep_sorted = before < top_p
    return torch.zeros_like(keep_sorted).scatter_(-1, idx, keep_sorted)


def sampling_logprobs(
    logits: torch.Tensor, tokens: torch.Tensor, temperature: float, top_p: float = 1.0
) -> torch.Tensor:
    """Log-probs of ``tokens`` [...] under the sampling distribution of ``logits`` [..., V]:
    ``softmax(logits / temperature)`` truncated to the ``top_p`` nucleus (plus the token itself)
    and renormalised. Float32; differentiable in ``logits`` (the nucleus is not)."""
    logp = torch.log_softmax(logits.float() / temperature, dim=-1)
    picked = logp.gather(-1, tokens.unsqueeze(-1)).squeeze(-1)
    if top_p >= 1.0:
        return picked
    with torch.no_grad():
        keep = nucleus_mask(logp.detach(), top_p)
        keep.scatter_(-1, tokens.unsqueeze(-1), True)
    kept_mass = torch.logsumexp(logp.masked_fill(~keep, float("-inf")), dim=-1)
    return picked - kept_mass


def rollout_is_weights(
    old_logprobs: torch.Tensor, rollout_logprobs: torch.Tensor, cap: float
) -> torch.Tensor:
    """Truncated importance-sampling weights ``min(pi_old / pi_rollout, cap)`` per token (no
    gradient): they correct the policy loss for tokens the rollout engine sampled with
    probabilities that differ from the trainer's (Yao et al. 2025, "Your efficient RL framework
    secretly brings you off-policy RL training"; verl and slime offer the same correction)."""
    if not cap > 0:
        raise ValueError(f"rollout_is_weights: cap must be > 0, got {cap!r}")
    log_ratio = (old_logprobs.float() - rollout_logprobs.float()).detach()
    return torch.exp(log_ratio).clamp(max=float(cap))
