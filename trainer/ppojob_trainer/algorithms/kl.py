"""KL estimators between the policy and the reference policy, and KL-coefficient controllers.

Per-token estimators of KL(pi || pi_ref) from sampled log-probabilities (Schulman, "Approximating
KL divergence", 2020), with ``d = ref_logprobs - logprobs`` (log of pi_ref / pi):

``k1``          ``-d``                      unbiased, high variance, can be negative
``k2``          ``0.5 * d**2``               biased, low variance, >= 0
``k3``          ``exp(d) - d - 1``           unbiased, low variance, >= 0; may be +inf when
                                             ``d`` is huge (exp overflows)
``low_var_kl``  ``clamp(k3, -10, 10)``       k3 bounded for stability (as in verl); never inf

The controllers hold the coefficient ``beta`` of the KL penalty: :class:`FixedKLController`
keeps it constant; :class:`AdaptiveKLController` follows Ziegler et al. 2019 ("Fine-tuning
language models from human preferences"), steering the measured KL towards a target.
"""

from __future__ import annotations

import math

import torch

__all__ = [
    "KL_ESTIMATORS",
    "AdaptiveKLController",
    "FixedKLController",
    "kl_estimate",
]

KL_ESTIMATORS = ("k1", "k2", "k3", "low_var_kl")
LOW_VAR_KL_CLAMP = 10.0


def kl_estimate(logprobs: torch.Tensor, ref_logprobs: torch.Tensor, estimator: str) -> torch.Tensor:
    """Per-token KL estimate, same shape as the inputs (see the module docstring).

    Masking is the caller's business (see ``losses.kl_loss``). ``ValueError`` on an unknown
    estimator or mismatched shapes.
    """
    if estimator not in KL_ESTIMATORS:
        raise ValueError(
            f"unknown KL estimator {estimator!r}; expected one of {', '.join(KL_ESTIMATORS)}"
        )
    if not isinstance(logprobs, torch.Tensor) or not isinstance(ref_logprobs, torch.Tensor):
        raise ValueError("kl_estimate: logprobs and ref_logprobs must be tensors")
    if logprobs.shape != ref_logprobs.shape:
        raise ValueError(
            f"kl_estimate: logprobs shape {tuple(logprobs.shape)} must equal "
            f"ref_logprobs shape {tuple(ref_logprobs.shape)}"
        )
    d = ref_logprobs - logprobs
    if estimator == "k1":
        return -d
    if estimator == "k2":
        return 0.5 * d * d
    k3 = torch.expm1(d) - d
    if estimator == "k3":
        return k3
    return k3.clamp(-LOW_VAR_KL_CLAMP, LOW_VAR_KL_CLAMP)


def _finite(value: float, name: str, *, positive: bool = False, nonneg: bool = False) -> float:
    try:
        v = float(value)
    except (TypeError, ValueError):
        raise ValueError(f"{name} must be a number, got {value!r}") from None
    if not math.isfinite(v):
        raise ValueError(f"{name} must be finite, got {value!r}")
    if positive and v <= 0:
        raise ValueError(f"{name} must be > 0, got {value!r}")
    if nonneg and v < 0:
        raise ValueError(f"{name} must be >= 0, got {value!r}")
    return v


class FixedKLController:
    """A constant KL coefficient; ``update`` only validates its arguments."""

    def __init__(self, coef: float) -> None:
        self.value = _finite(coef, "KL coef", nonneg=True)

    def update(self, current_kl: float, n_steps: int) -> None:
        _finite(current_kl, "current_kl")
        if int(n_steps) < 0:
            raise ValueError(f"n_steps must be >= 0, got {n_steps!r}")

    def __repr__(self) -> str:
        return f"FixedKLController(value={self.value})"


class AdaptiveKLController:
    """Adaptive KL coefficient (Ziegler et al. 2019).

    After each batch: ``e = clip(current_kl / target - 1, -0.2, 0.2)`` and
    ``value *= 1 + e * n_steps / horizon``, where ``n_steps`` is the number of samples (or
    steps) the KL was measured over. KL above target raises the coefficient, below lowers it;
    the clip bounds the change per update. The multiplier is floored at 0 (reachable only when
    ``n_steps > 5 * horizon``) so the coefficient never turns negative. ``target`` and
    ``horizon`` must be > 0.
    """

    def __init__(self, init_coef: float, target: float, horizon: float) -> None:
        self.value = _finite(init_coef, "init_coef", nonneg=True)
        self.target = _finite(target, "target", positive=True)
        self.horizon = _finite(horizon, "horizon", positive=True)

    def update(self, current_kl: float, n_steps: int) -> None:
        kl = _finite(current_kl, "current_kl")
        n = int(n_steps)
        if n < 0:
            raise ValueError(f"n_steps must be >= 0, got {n_steps!r}")
        error = min(max(kl / self.target - 1.0, -0.2), 0.2)
        self.value *= max(0.0, 1.0 + error * n / self.horizon)

    def __repr__(self) -> str:
        return (
            f"AdaptiveKLController(value={self.value}, target={self.target}, "
            f"horizon={self.horizon})"
        )
