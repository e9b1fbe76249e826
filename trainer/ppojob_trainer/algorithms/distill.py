"""On-policy distillation's signal: the per-token reverse KL to a teacher on the student's own
samples, as token rewards or as a loss term.

With ``y`` sampled from the student ``pi``, ``log pi(y_t) - log pi_teacher(y_t)`` is an unbiased
per-token estimate of KL(pi || pi_teacher) at that position (the k1 estimator). In the reward,
``-coef x`` that estimate on every response token makes the return the negated reverse KL of the
rest of the sequence (the objective of on-policy distillation). As a loss, ``0.5 (log pi -
log pi_teacher)^2`` (the k2 estimator) has the gradient ``(log pi - log pi_teacher) grad log pi``,
whose expectation under ``pi`` is the gradient of KL(pi || pi_teacher) (the score function's own
expectation being 0): the reverse KL's gradient, where k3 as a loss would give the forward KL's.
"""

from __future__ import annotations

import torch

from .losses import kl_loss

__all__ = ["distill_loss", "distill_token_rewards", "reverse_kl"]


def reverse_kl(
    student_logprobs: torch.Tensor, teacher_logprobs: torch.Tensor, mask: torch.Tensor
) -> torch.Tensor:
    """[B, T] float32: ``log pi_student - log pi_teacher`` on the ``mask`` tokens, 0 elsewhere."""
    if student_logprobs.shape != teacher_logprobs.shape or student_logprobs.shape != mask.shape:
        raise ValueError(
            f"reverse_kl: shapes differ (student {tuple(student_logprobs.shape)}, teacher "
            f"{tuple(teacher_logprobs.shape)}, mask {tuple(mask.shape)})"
        )
    diff = student_logprobs.float() - teacher_logprobs.float()
    return torch.where(mask.bool(), diff, 0.0)


def distill_token_rewards(
    token_rewards: torch.Tensor, rkl: torch.Tensor, coefficient: float
) -> torch.Tensor:
    """``token_rewards - coefficient x rkl`` (``rkl`` from :func:`reverse_kl`: 0 off the mask)."""
    if coefficient < 0:
        raise ValueError(f"distill_token_rewards: coefficient {coefficient} < 0")
    return token_rewards - coefficient * rkl.to(token_rewards.dtype)


def distill_loss(
    logprobs: torch.Tensor,
    teacher_logprobs: torch.Tensor,
    mask: torch.Tensor,
    agg: str = "token-mean",
) -> torch.Tensor:
    """The reverse-KL loss term: ``0.5 (log pi - log pi_teacher)^2`` aggregated over ``mask``
    (its gradient on the student's samples is the reverse KL's; see the module docstring)."""
    return kl_loss(logprobs, teacher_logprobs.to(logprobs.device), mask, "k2", agg)
