"""Masked statistics over ``[B, T]`` tensors.

Mask convention (shared by the whole ``algorithms`` package): ``mask`` has the shape of ``x``;
a nonzero entry marks a response token (counted), a zero entry marks a prompt or padding token
(ignored). Values at ignored positions never reach the result, even when they are NaN or inf.

Empty selections never produce a silent NaN: a statistic over zero tokens raises ``ValueError``
(or, for ``masked_mean`` along a dimension, gives 0 for the empty rows, as documented there).
"""

from __future__ import annotations

import torch

from .collectives import all_reduce_sum, collective_device

__all__ = [
    "all_reduce_sum",
    "collective_device",
    "masked_mean",
    "masked_sum_count",
    "masked_var",
    "masked_whiten",
]


def _check(x: torch.Tensor, mask: torch.Tensor, fn: str) -> torch.Tensor:
    """Validate shapes and return the mask as a bool tensor."""
    if not isinstance(x, torch.Tensor) or not isinstance(mask, torch.Tensor):
        raise ValueError(f"{fn}: x and mask must be tensors, got {type(x)} and {type(mask)}")
    if x.shape != mask.shape:
        raise ValueError(
            f"{fn}: mask shape {tuple(mask.shape)} must equal x shape {tuple(x.shape)}"
        )
    return mask.bool()


def masked_sum_count(
    x: torch.Tensor, mask: torch.Tensor, dim: int | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """Sum of ``x`` over masked positions and the number of masked positions (in x's dtype)."""
    m = _check(x, mask, "masked_sum_count")
    xz = torch.where(m, x, torch.zeros((), dtype=x.dtype, device=x.device))
    if dim is None:
        return xz.sum(), m.sum().to(x.dtype)
    return xz.sum(dim=dim), m.sum(dim=dim).to(x.dtype)


def masked_mean(x: torch.Tensor, mask: torch.Tensor, dim: int | None = None) -> torch.Tensor:
    """Mean of ``x`` over the positions where ``mask`` is nonzero.

    With ``dim=None`` the mean is over all masked elements (a scalar); if there are none,
    ``ValueError`` is raised. With ``dim`` given, the mean is taken along that dimension and
    slices with no masked element yield 0 (not NaN).
    """
    total, count = masked_sum_count(x, mask, dim)
    if dim is None:
        if count.item() == 0:
            raise ValueError("masked_mean: mask selects no element (all positions are masked out)")
        return total / count
    return torch.where(count > 0, total / count.clamp_min(1), torch.zeros_like(total))


def masked_var(x: torch.Tensor, mask: torch.Tensor, unbiased: bool = True) -> torch.Tensor:
    """Variance of ``x`` over all masked elements (a scalar).

    ``unbiased=True`` divides by ``n - 1`` (Bessel's correction) and needs at least 2 masked
    elements; ``unbiased=False`` divides by ``n`` and needs at least 1. Otherwise ``ValueError``.
    Computed in two passes (mean, then squared deviations) for accuracy.
    """
    m = _check(x, mask, "masked_var")
    n = int(m.sum().item())
    need = 2 if unbiased else 1
    if n < need:
        raise ValueError(
            f"masked_var: needs at least {need} masked element(s) (unbiased={unbiased}), got {n}"
        )
    mean = masked_mean(x, m)
    dev = torch.where(m, x - mean, torch.zeros((), dtype=x.dtype, device=x.device))
    return (dev * dev).sum() / (n - 1 if unbiased else n)


def _whiten_with(
    x: torch.Tensor, m: torch.Tensor, mean: torch.Tensor, var: torch.Tensor, shift_mean: bool, eps
) -> torch.Tensor:
    out = (x - mean) * torch.rsqrt(var + eps)
    if not shift_mean:
        out = out + mean
    return torch.where(m, out, torch.zeros((), dtype=x.dtype, device=x.device))


def masked_whiten(
    x: torch.Tensor, mask: torch.Tensor, shift_mean: bool = True, eps: float = 1e-8
) -> torch.Tensor:
    """Whiten ``x`` using the mean and the population variance of its masked elements.

    Returns ``(x - mean) / sqrt(var + eps)`` on masked positions (``+ mean`` added back when
    ``shift_mean=False``, i.e. only the scale changes) and exactly 0 on unmasked positions.
    The variance is the biased (divide by ``n``) one, so a single masked element is allowed
    (its whitened value is 0). No masked element raises ``ValueError``.
    """
    m = _check(x, mask, "masked_whiten")
    if int(m.sum().item()) == 0:
        raise ValueError("masked_whiten: mask selects no element (all positions are masked out)")
    mean = masked_mean(x, m)
    var = masked_var(x, m, unbiased=False)
    return _whiten_with(x, m, mean, var, shift_mean, eps)
