"""User hooks: load ``module:function`` paths, run a custom advantage function, check rewards.

A custom advantage function is called once per step with *every* sample of the step, in sample
order, so each prompt's group is whole (as for the built-in group estimators), whatever the
number of data-parallel workers; each worker keeps its own rows of the result. It receives one
tensor per sample, covering that sample's *response span*: from its first to its last response
position (mask nonzero), both included, so
``L_i = last - first + 1``. Masked-out positions inside the span (rare) are included and marked
0 in ``response_masks[i]``; a sample with no response token gets empty tensors (``L_i = 0``).
The function is called with keyword arguments::

    fn(token_rewards=list[Tensor[L_i]],   # token-level rewards over the span
       scores=Tensor[B],                  # outcome reward per sample
       values=list[Tensor[L_i]] | None,   # critic values over the span, None without a critic
       response_masks=list[Tensor[L_i]],  # 1.0 on response tokens, 0.0 elsewhere (rewards dtype)
       group_ids=list[int],               # equal ids = same prompt
       gamma=float, lam=float)

and must return a mapping with keys ``"advantages"`` and ``"returns"``, each a list or tuple of
B tensors with ``shape == response_masks[i].shape`` and finite values where the mask is 1.
Values where the mask is 0 are ignored. The result is re-padded into [B, T] tensors (dtype and
device of ``token_rewards``), exactly 0 where ``mask`` is 0.
"""

from __future__ import annotations

import math
import numbers
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch

from ppojob_trainer.hookload import load_function

_FLOAT32_MAX = torch.finfo(torch.float32).max

__all__ = ["function_name", "load_function", "run_custom_advantage", "validate_rewards"]


def function_name(fn: Callable[..., Any]) -> str:
    """``module:qualname`` of a function, for error messages."""
    module = getattr(fn, "__module__", None) or "?"
    qual = getattr(fn, "__qualname__", None) or getattr(fn, "__name__", None) or repr(fn)
    return f"{module}:{qual}"


def _spans(m: torch.Tensor) -> list[tuple[int, int]]:
    """Per row, (first, last + 1) of its response positions; (0, 0) for a row with none."""
    length = m.shape[1]
    pos = torch.arange(length, device=m.device)
    first = torch.where(m, pos, length).min(dim=1).values.tolist()
    last = torch.where(m, pos, -1).max(dim=1).values.tolist()
    return [(f, e + 1) if e >= 0 else (0, 0) for f, e in zip(first, last, strict=True)]


def _check_padded(x: torch.Tensor, m: torch.Tensor, name: str) -> None:
    if not isinstance(x, torch.Tensor) or x.shape != m.shape:
        got = tuple(x.shape) if isinstance(x, torch.Tensor) else type(x).__name__
        raise ValueError(
            f"run_custom_advantage: {name} must be [B, T] = {tuple(m.shape)}, got {got}"
        )


def run_custom_advantage(
    fn: Callable[..., Any],
    *,
    token_rewards: torch.Tensor,
    scores: torch.Tensor,
    values: torch.Tensor | None,
    mask: torch.Tensor,
    group_ids: torch.Tensor,
    gamma: float,
    lam: float,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Call a user advantage function on per-sample spans and re-pad its outputs to [B, T].

    See the module docstring for the calling convention. Every problem with what ``fn``
    returns is a ``ValueError`` naming the function (``module:qualname``), the sample index
    where relevant, and what was expected versus received. Exceptions raised inside ``fn``
    propagate unchanged, with a note naming the function.
    """
    name = function_name(fn)
    if not isinstance(mask, torch.Tensor) or mask.dim() != 2 or mask.shape[0] == 0:
        got = tuple(mask.shape) if isinstance(mask, torch.Tensor) else type(mask).__name__
        raise ValueError(f"run_custom_advantage: mask must be a non-empty [B, T] tensor, got {got}")
    m = mask.bool()
    bsz = m.shape[0]
    _check_padded(token_rewards, m, "token_rewards")
    if values is not None:
        _check_padded(values, m, "values")
    if not isinstance(scores, torch.Tensor) or scores.shape != (bsz,):
        got = tuple(scores.shape) if isinstance(scores, torch.Tensor) else type(scores).__name__
        raise ValueError(f"run_custom_advantage: scores must have shape ({bsz},), got {got}")
    if not isinstance(group_ids, torch.Tensor) or group_ids.shape != (bsz,):
        got = tuple(group_ids.shape) if isinstance(group_ids, torch.Tensor) else type(group_ids)
        raise ValueError(f"run_custom_advantage: group_ids must have shape ({bsz},), got {got}")

    spans = _spans(m)
    dtype = token_rewards.dtype
    fmask = m.to(dtype)
    rewards_list = [token_rewards[i, a:b] for i, (a, b) in enumerate(spans)]
    values_list = None if values is None else [values[i, a:b] for i, (a, b) in enumerate(spans)]
    masks_list = [fmask[i, a:b] for i, (a, b) in enumerate(spans)]
    try:
        result = fn(
            token_rewards=rewards_list,
            scores=scores,
            values=values_list,
            response_masks=masks_list,
            group_ids=[int(g) for g in group_ids.tolist()],
            gamma=float(gamma),
            lam=float(lam),
        )
    except Exception as exc:
        if hasattr(exc, "add_note"):  # Python >= 3.11
            exc.add_note(
                f"raised inside the custom advantage function {name} "
                "(algorithm.customAdvantageFunction)"
            )
        raise

    if not isinstance(result, Mapping):
        raise ValueError(
            f"custom advantage function {name} must return a mapping with keys 'advantages' "
            f"and 'returns', got {type(result).__name__}"
        )
    outs = []
    for key in ("advantages", "returns"):
        if key not in result:
            raise ValueError(
                f"custom advantage function {name}: missing key {key!r} in its result "
                f"(expected keys 'advantages' and 'returns', got {sorted(map(str, result))})"
            )
        items = result[key]
        if not isinstance(items, list | tuple):
            raise ValueError(
                f"custom advantage function {name}: {key!r} must be a list or tuple of {bsz} "
                f"tensors, got {type(items).__name__}"
            )
        if len(items) != bsz:
            raise ValueError(
                f"custom advantage function {name}: {key!r} must hold one tensor per sample: "
                f"expected {bsz}, got {len(items)}"
            )
        padded = torch.zeros_like(token_rewards)
        for i, item in enumerate(items):
            expected = tuple(masks_list[i].shape)
            if not isinstance(item, torch.Tensor):
                raise ValueError(
                    f"custom advantage function {name}: {key}[{i}] (sample {i}) must be a "
                    f"tensor of shape {expected}, got {type(item).__name__}"
                )
            if tuple(item.shape) != expected:
                raise ValueError(
                    f"custom advantage function {name}: {key}[{i}] (sample {i}) has shape "
                    f"{tuple(item.shape)}, expected {expected} (the sample's response mask)"
                )
            if item.is_complex() or item.dtype == torch.bool:
                raise ValueError(
                    f"custom advantage function {name}: {key}[{i}] (sample {i}) must be a real "
                    f"tensor, got dtype {item.dtype}"
                )
            a, b = spans[i]
            sm = m[i, a:b]
            vals = item.detach().to(device=token_rewards.device, dtype=dtype)
            bad = sm & ~torch.isfinite(vals)
            if bool(bad.any()):
                j = int(bad.nonzero()[0, 0])
                raise ValueError(
                    f"custom advantage function {name}: {key}[{i}] (sample {i}) has a "
                    f"non-finite value {vals[j].item()} at response position {j}; expected "
                    f"finite values"
                )
            padded[i, a:b] = torch.where(sm, vals, torch.zeros((), dtype=dtype))
        outs.append(padded)
    return outs[0], outs[1]


def validate_rewards(values: Any, n: int, fn_name: str) -> torch.Tensor:
    """Check a user reward function's output: exactly ``n`` finite real numbers.

    Accepts a sequence of numbers (Python, NumPy or 0-d/1-element tensors, bools as 0/1) or a
    1-D tensor/array of length ``n``. Returns a float32 tensor [n]. ``ValueError`` naming
    ``fn_name`` (and the sample index where one is at fault) otherwise.
    """
    where = f"reward function {fn_name}"
    if isinstance(values, torch.Tensor):
        if values.dim() != 1:
            raise ValueError(
                f"{where} must return {n} rewards (a 1-D tensor), got shape {tuple(values.shape)}"
            )
        seq: Sequence[Any] = list(values.detach().cpu())
    elif hasattr(values, "__array__") and hasattr(values, "ndim") and hasattr(values, "tolist"):
        if values.ndim != 1:
            raise ValueError(f"{where} must return {n} rewards (1-D), got ndim {values.ndim}")
        seq = values.tolist()
    elif isinstance(values, Sequence) and not isinstance(values, str | bytes):
        seq = values
    else:
        raise ValueError(
            f"{where} must return a list of {n} floats (one per sample), "
            f"got {type(values).__name__}"
        )
    if len(seq) != n:
        raise ValueError(f"{where} must return one reward per sample: expected {n}, got {len(seq)}")
    out: list[float] = []
    for i, v in enumerate(seq):
        if isinstance(v, torch.Tensor):
            if v.numel() != 1 or v.is_complex():
                raise ValueError(
                    f"{where}: reward for sample {i} must be a single real number, "
                    f"got a tensor of shape {tuple(v.shape)}"
                )
            v = v.item()
        elif hasattr(v, "item") and hasattr(v, "dtype") and not isinstance(v, numbers.Number):
            v = v.item()  # NumPy scalar
        if not isinstance(v, numbers.Real):
            raise ValueError(
                f"{where}: reward for sample {i} must be a real number, got "
                f"{type(v).__name__} ({v!r})"
            )
        f = float(v)
        if not math.isfinite(f) or abs(f) > _FLOAT32_MAX:
            raise ValueError(
                f"{where}: reward for sample {i} is {f}; expected a finite float32 number"
            )
        out.append(f)
    return torch.tensor(out, dtype=torch.float32)
