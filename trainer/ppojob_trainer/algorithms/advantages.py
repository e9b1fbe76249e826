"""Advantage estimators: GAE, outcome-reward estimators and the registry that dispatches them.

Shapes: ``B`` samples, ``T`` token positions. ``mask`` [B, T] is nonzero on response tokens (the
tokens the policy generated, EOS included) and zero on prompt and padding tokens. Every
``[B, T]`` output of this module is exactly 0 where ``mask`` is 0.

Registry: estimators are plain functions registered by name with
:func:`register_advantage_estimator`. Each is called with the keyword arguments
``token_rewards, scores, values, mask, group_ids, gamma, lam`` plus its own options and returns
``(advantages, returns)``, both [B, T]. :func:`compute_advantages` is the single entry point: it
validates inputs, rejects options the estimator does not accept, calls it and validates and masks
its outputs.

Built-in estimators and their options:

``gae``
    Generalised advantage estimation (Schulman et al. 2016) on ``token_rewards`` with the critic's
    ``values`` (required). Option ``whiten=True``: whiten advantages over the batch's response
    tokens (returns are never whitened).
``grpo``
    ``(score - group mean) / (group std + eps)``, std with Bessel's correction (Shao et al. 2024).
    Options ``norm_by_std=True`` (False: drop the division, as in Dr. GRPO), ``eps=1e-6``.
    Singleton groups get advantage 0.
``reinforce_plus_plus``
    Discounted reward-to-go of ``token_rewards`` (``gamma``; ``lam`` unused), whitened over the
    batch's response tokens (Hu 2025). Returns are the unwhitened reward-to-go.
    Option ``whiten=True`` (False: keep the raw reward-to-go as the advantage).
``reinforce_plus_plus_baseline``
    ``score - group mean``, broadcast over the response, then whitened over the batch's response
    tokens. Singleton groups get 0 before whitening. Option ``whiten=True`` (False: skip the
    whitening).
``rloo``
    ``score - mean of the other samples' scores in the group`` (Ahmadian et al. 2024). Every
    group needs at least 2 samples; a singleton group raises ``ValueError``.

Outcome estimators (``grpo``, ``reinforce_plus_plus_baseline``, ``rloo``) use ``scores`` only
(put the KL term in the loss with them), broadcast the per-sample advantage over that sample's
response tokens, and return ``returns == advantages`` (there is no critic to fit).
``group_ids`` [B] integers: samples with equal id were generated from the same prompt.
"""

from __future__ import annotations

import inspect
import math
from collections.abc import Callable

import torch

from .stats import masked_whiten

__all__ = [
    "AdvantageEstimator",
    "compute_advantages",
    "compute_gae",
    "discounted_reverse_cumsum",
    "get_advantage_estimator",
    "list_advantage_estimators",
    "register_advantage_estimator",
    "shape_token_rewards",
]

AdvantageEstimator = Callable[..., tuple[torch.Tensor, torch.Tensor]]

_CHUNK = 16


# --------------------------------------------------------------------------------------------
# Validation helpers
# --------------------------------------------------------------------------------------------
def _check_mask(mask: torch.Tensor, fn: str) -> torch.Tensor:
    if not isinstance(mask, torch.Tensor):
        raise ValueError(f"{fn}: mask must be a tensor, got {type(mask).__name__}")
    if mask.dim() != 2:
        raise ValueError(f"{fn}: mask must be [B, T], got shape {tuple(mask.shape)}")
    if mask.shape[0] == 0:
        raise ValueError(f"{fn}: empty batch (B = 0)")
    return mask.bool()


def _check_bt(x: torch.Tensor, m: torch.Tensor, name: str, fn: str) -> torch.Tensor:
    """Check shape, dtype and finiteness on response tokens; return x zeroed off the mask."""
    if not isinstance(x, torch.Tensor):
        raise ValueError(f"{fn}: {name} must be a tensor, got {type(x).__name__}")
    if x.shape != m.shape:
        raise ValueError(
            f"{fn}: {name} shape {tuple(x.shape)} must equal mask shape {tuple(m.shape)}"
        )
    if not x.is_floating_point():
        raise ValueError(f"{fn}: {name} must be a floating-point tensor, got {x.dtype}")
    xz = torch.where(m, x, torch.zeros((), dtype=x.dtype, device=x.device))
    # Fast path: one reduction; a NaN or inf on the mask makes the sum non-finite.
    if bool(torch.isfinite(xz.sum())):
        return xz
    bad = m & ~torch.isfinite(x)
    if bool(bad.any()):
        b, t = (int(i) for i in bad.nonzero()[0])
        raise ValueError(
            f"{fn}: {name} has a non-finite value on a response token "
            f"(sample {b}, position {t}: {x[b, t].item()})"
        )
    return xz


def _check_coef(value: float, name: str, fn: str) -> float:
    try:
        v = float(value)
    except (TypeError, ValueError):
        raise ValueError(f"{fn}: {name} must be a number in [0, 1], got {value!r}") from None
    if not (0.0 <= v <= 1.0):
        raise ValueError(f"{fn}: {name} must be in [0, 1], got {value!r}")
    return v


def _check_scores(scores: torch.Tensor, batch: int, fn: str) -> None:
    if not isinstance(scores, torch.Tensor):
        raise ValueError(f"{fn}: scores must be a tensor, got {type(scores).__name__}")
    if scores.shape != (batch,):
        raise ValueError(f"{fn}: scores must have shape ({batch},), got {tuple(scores.shape)}")
    bad = ~torch.isfinite(scores.double())
    if bool(bad.any()):
        i = int(bad.nonzero()[0, 0])
        raise ValueError(f"{fn}: scores has a non-finite value at sample {i}: {scores[i].item()}")


def _check_group_ids(group_ids: torch.Tensor, batch: int, fn: str) -> None:
    if not isinstance(group_ids, torch.Tensor):
        raise ValueError(f"{fn}: group_ids must be a tensor, got {type(group_ids).__name__}")
    if group_ids.shape != (batch,):
        raise ValueError(
            f"{fn}: group_ids must have shape ({batch},), got {tuple(group_ids.shape)}"
        )
    if group_ids.is_floating_point() or group_ids.is_complex() or group_ids.dtype == torch.bool:
        raise ValueError(f"{fn}: group_ids must be an integer tensor, got {group_ids.dtype}")


# --------------------------------------------------------------------------------------------
# Scans
# --------------------------------------------------------------------------------------------
def discounted_reverse_cumsum(x: torch.Tensor, c: float, chunk: int = _CHUNK) -> torch.Tensor:
    """``y[:, t] = sum_{k >= t} c**(k - t) * x[:, k]`` along the last dim of a [B, T] tensor.

    A chunked parallel scan: within chunks of ``chunk`` positions the sum is one matmul with an
    upper-triangular matrix of powers of ``c``; the values carried between chunks form the same
    recurrence with coefficient ``c**chunk`` over T / chunk positions, solved recursively. Only
    non-negative powers of ``c`` appear, so nothing overflows for any ``c`` in [0, 1].
    """
    if chunk < 2:
        raise ValueError(f"discounted_reverse_cumsum: chunk must be >= 2, got {chunk}")
    if x.dim() != 2:
        raise ValueError(f"discounted_reverse_cumsum: x must be [B, T], got {tuple(x.shape)}")
    bsz, length = x.shape
    if length == 0:
        return x.clone()
    if length <= chunk:
        return x @ _power_matrix(c, length, x.dtype, x.device).T
    n = -(-length // chunk)
    pad = n * chunk - length
    xp = torch.nn.functional.pad(x, (0, pad)) if pad else x
    xr = xp.reshape(bsz, n, chunk)
    local = xr @ _power_matrix(c, chunk, x.dtype, x.device).T  # [B, n, C]
    # full value at each chunk start: F_j = local_j[0] + c**chunk * F_{j+1}
    starts = discounted_reverse_cumsum(local[:, :, 0].contiguous(), c**chunk, chunk)
    carry = torch.nn.functional.pad(starts[:, 1:], (0, 1))  # F_{j+1}, 0 after the last chunk
    tail = torch.tensor(
        [c ** (chunk - i) for i in range(chunk)], dtype=torch.float64, device=x.device
    ).to(x.dtype)
    out = local + carry.unsqueeze(-1) * tail
    return out.reshape(bsz, n * chunk)[:, :length]


def _power_matrix(c: float, size: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """M[i, k] = c**(k - i) for k >= i, else 0 (0**0 == 1)."""
    idx = torch.arange(size, device=device)
    exp = (idx[None, :] - idx[:, None]).to(torch.float64)
    base = torch.full((), float(c), dtype=torch.float64, device=device)
    mat = torch.where(exp >= 0, torch.pow(base, exp.clamp_min(0)), torch.zeros_like(base))
    return mat.to(dtype)


def compute_gae(
    rewards: torch.Tensor,
    values: torch.Tensor,
    mask: torch.Tensor,
    gamma: float,
    lam: float,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Generalised advantage estimation over the response tokens of each sample.

    For the response tokens ``t_1 < t_2 < ... < t_L`` of a sample (positions where ``mask`` is
    nonzero, taken in order; masked-out positions in between are skipped, so each response token
    is linked to the next *response* token)::

        delta_j = r[t_j] + gamma * V[t_{j+1}] - V[t_j]        (V[t_{L+1}] = 0: episode ends)
        A[t_j]  = delta_j + gamma * lam * A[t_{j+1}]           (A[t_{L+1}] = 0)
        R[t_j]  = A[t_j] + V[t_j]

    Returns ``(advantages, returns)``, [B, T] in the dtype of ``rewards``, exactly 0 where
    ``mask`` is 0 (rows with no response token are all 0). Values of ``rewards``/``values``
    at masked-out positions are ignored (they may be anything, even NaN). With ``gamma = lam
    = 1`` the advantage is the reward-to-go minus the value.

    Vectorised over the batch. When every row's response is one contiguous run (prompt,
    response, padding) the scan runs in place; otherwise response tokens are compacted to the
    front of each row (a scatter), the recursion runs as a chunked parallel scan
    (:func:`discounted_reverse_cumsum`) and the result is gathered back. Raises ``ValueError``
    on mismatched shapes, an empty batch, ``gamma``/``lam`` outside [0, 1] or a non-finite
    reward or value on a response token.
    """
    fn = "compute_gae"
    m = _check_mask(mask, fn)
    r = _check_bt(rewards, m, "rewards", fn)
    v = _check_bt(values, m, "values", fn).to(r.dtype)
    g = _check_coef(gamma, "gamma", fn)
    lm = _check_coef(lam, "lam", fn)
    dtype = r.dtype
    bsz, length = m.shape

    # Fast path: each row's response tokens form one contiguous run (the common layout: prompt,
    # response, padding). The next response token of t is then t + 1, and V there is already 0
    # after the run's end; positions off the run are zeroed at the end.
    runs = m[:, :1].sum(dim=1) + (m[:, 1:] & ~m[:, :-1]).sum(dim=1)
    if int(runs.max()) <= 1:
        zero = torch.zeros((), dtype=dtype, device=r.device)
        v_next = torch.nn.functional.pad(v[:, 1:], (0, 1))
        delta = torch.where(m, r + g * v_next - v, zero)
        adv = torch.where(m, discounted_reverse_cumsum(delta, g * lm), zero)
        return adv, adv + v

    # Compaction: response token j of a row goes to column j; other positions to a trash column.
    rank = torch.cumsum(m, dim=1) - 1
    dest = torch.where(m, rank, torch.full_like(rank, length))
    rc = torch.zeros(bsz, length + 1, dtype=dtype, device=r.device).scatter_(1, dest, r)
    vc = torch.zeros(bsz, length + 1, dtype=dtype, device=r.device).scatter_(1, dest, v)
    # Trash column receives only zeros; compacted positions past a row's length are 0 too.
    delta = rc[:, :length] + g * vc[:, 1:] - vc[:, :length]
    adv_c = torch.nn.functional.pad(discounted_reverse_cumsum(delta, g * lm), (0, 1))
    # Gathering through ``dest`` reads the zero trash column for every masked-out position.
    adv = torch.gather(adv_c, 1, dest)
    return adv, adv + v  # v is already 0 off the mask


def shape_token_rewards(
    scores: torch.Tensor,
    mask: torch.Tensor,
    kl: torch.Tensor | None = None,
    kl_coef: float = 0.0,
) -> torch.Tensor:
    """Token-level rewards: each sample's score on its last response token, minus ``kl_coef *
    kl`` on every response token (the KL-in-reward penalty).

    ``scores`` [B], ``mask`` [B, T], ``kl`` [B, T] or None. The result has the floating dtype of
    ``scores`` (float32 if scores are integers) and is 0 where ``mask`` is 0. A sample with no
    response token cannot receive its score, so it raises ``ValueError`` naming the sample, as
    do non-finite scores or KL values on response tokens and a negative or non-finite kl_coef.
    """
    fn = "shape_token_rewards"
    m = _check_mask(mask, fn)
    _check_scores(scores, m.shape[0], fn)
    dtype = scores.dtype if scores.is_floating_point() else torch.float32
    empty = ~m.any(dim=1)
    if bool(empty.any()):
        i = int(empty.nonzero()[0, 0])
        raise ValueError(f"{fn}: sample {i} has no response token to carry its score")
    coef = float(kl_coef)
    if not math.isfinite(coef) or coef < 0:
        raise ValueError(f"{fn}: kl_coef must be a finite number >= 0, got {kl_coef!r}")
    positions = torch.arange(m.shape[1], device=m.device)
    last = torch.where(m, positions, -1).max(dim=1).values
    out = torch.zeros(m.shape, dtype=dtype, device=scores.device)
    out.scatter_(1, last.unsqueeze(1), scores.to(dtype).unsqueeze(1))
    if kl is not None:
        _check_bt(kl, m, "kl", fn)
        zero = torch.zeros((), dtype=dtype, device=out.device)
        out = out - coef * torch.where(m, kl.to(dtype), zero)
    return out


# --------------------------------------------------------------------------------------------
# Registry
# --------------------------------------------------------------------------------------------
_REGISTRY: dict[str, AdvantageEstimator] = {}


def register_advantage_estimator(
    name: str, *, override: bool = False
) -> Callable[[AdvantageEstimator], AdvantageEstimator]:
    """Decorator registering an estimator under ``name``.

    The function is called with keyword arguments only (``token_rewards, scores, values, mask,
    group_ids, gamma, lam`` and its options) and must return ``(advantages, returns)``, both
    [B, T]. Registering an existing name raises ``ValueError`` unless ``override=True``.
    """
    if not isinstance(name, str) or not name.strip():
        raise ValueError(f"advantage estimator name must be a non-empty string, got {name!r}")

    def deco(fn: AdvantageEstimator) -> AdvantageEstimator:
        if not callable(fn):
            raise ValueError(f"advantage estimator {name!r} must be callable, got {fn!r}")
        if name in _REGISTRY and not override:
            raise ValueError(
                f"advantage estimator {name!r} is already registered "
                f"(pass override=True to replace it)"
            )
        _REGISTRY[name] = fn
        return fn

    return deco


def list_advantage_estimators() -> list[str]:
    """Registered estimator names, sorted."""
    return sorted(_REGISTRY)


def get_advantage_estimator(name: str) -> AdvantageEstimator:
    """The estimator registered under ``name``; ``ValueError`` listing the known names if none."""
    try:
        return _REGISTRY[name]
    except (KeyError, TypeError):
        raise ValueError(
            f"unknown advantage estimator {name!r}; registered: "
            f"{', '.join(list_advantage_estimators())}"
        ) from None


_COMMON = ("token_rewards", "scores", "values", "mask", "group_ids", "gamma", "lam")


def _accepted_options(fn: AdvantageEstimator) -> set[str] | None:
    """Option names the estimator accepts, or None when it takes ``**kwargs``."""
    try:
        params = inspect.signature(fn).parameters.values()
    except (TypeError, ValueError):
        return None
    if any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params):
        return None
    return {p.name for p in params if p.name not in _COMMON}


def compute_advantages(
    name: str,
    *,
    token_rewards: torch.Tensor,
    scores: torch.Tensor,
    values: torch.Tensor | None,
    mask: torch.Tensor,
    group_ids: torch.Tensor,
    gamma: float,
    lam: float,
    **options: object,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Run the estimator registered as ``name``; returns ``(advantages, returns)``, [B, T].

    Validates the common inputs (shapes, an empty batch, non-finite values on response tokens,
    integer ``group_ids``), rejects options the estimator does not declare, and checks that the
    estimator returned two [B, T] tensors with finite values on response tokens. Outputs are
    set to exactly 0 where ``mask`` is 0.
    """
    fn = get_advantage_estimator(name)
    where = f"compute_advantages({name!r})"
    m = _check_mask(mask, where)
    _check_bt(token_rewards, m, "token_rewards", where)
    if values is not None:
        _check_bt(values, m, "values", where)
    _check_scores(scores, m.shape[0], where)
    _check_group_ids(group_ids, m.shape[0], where)
    g = _check_coef(gamma, "gamma", where)
    lm = _check_coef(lam, "lam", where)
    accepted = _accepted_options(fn)
    if accepted is not None:
        unknown = sorted(set(options) - accepted)
        if unknown:
            raise ValueError(
                f"{where}: unknown option(s) {unknown}; accepted: {sorted(accepted) or 'none'}"
            )
    result = fn(
        token_rewards=token_rewards,
        scores=scores,
        values=values,
        mask=mask,
        group_ids=group_ids,
        gamma=g,
        lam=lm,
        **options,
    )
    if not isinstance(result, tuple | list) or len(result) != 2:
        raise ValueError(f"{where}: estimator must return (advantages, returns), got {result!r}")
    outs = []
    for label, t in zip(("advantages", "returns"), result, strict=True):
        if not isinstance(t, torch.Tensor) or t.shape != m.shape:
            got = tuple(t.shape) if isinstance(t, torch.Tensor) else type(t).__name__
            raise ValueError(f"{where}: {label} must be [B, T] = {tuple(m.shape)}, got {got}")
        _check_bt(t, m, label, where)
        outs.append(torch.where(m, t, torch.zeros((), dtype=t.dtype, device=t.device)))
    return outs[0], outs[1]


def _group_stats(
    scores: torch.Tensor, group_ids: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Per-sample (group index, group size, group mean), vectorised with index_add."""
    _, inv = torch.unique(group_ids, return_inverse=True)
    n_groups = int(inv.max()) + 1
    counts = torch.bincount(inv, minlength=n_groups).to(scores.dtype)
    sums = torch.zeros(n_groups, dtype=scores.dtype, device=scores.device).index_add_(
        0, inv, scores
    )
    return inv, counts, sums / counts


def _broadcast(adv: torch.Tensor, m: torch.Tensor) -> torch.Tensor:
    return torch.where(m, adv.unsqueeze(1), torch.zeros((), dtype=adv.dtype, device=adv.device))


def _float_scores(scores: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    dtype = like.dtype if like.is_floating_point() else torch.float32
    return scores.to(dtype)


@register_advantage_estimator("gae")
def _gae(
    *,
    token_rewards: torch.Tensor,
    scores: torch.Tensor,
    values: torch.Tensor | None,
    mask: torch.Tensor,
    group_ids: torch.Tensor,
    gamma: float,
    lam: float,
    whiten: bool = True,
) -> tuple[torch.Tensor, torch.Tensor]:
    if values is None:
        raise ValueError("advantage estimator 'gae' needs critic values, got values=None")
    adv, ret = compute_gae(token_rewards, values, mask, gamma, lam)
    if whiten:
        adv = masked_whiten(adv, mask.bool())
    return adv, ret


@register_advantage_estimator("grpo")
def _grpo(
    *,
    token_rewards: torch.Tensor,
    scores: torch.Tensor,
    values: torch.Tensor | None,
    mask: torch.Tensor,
    group_ids: torch.Tensor,
    gamma: float,
    lam: float,
    norm_by_std: bool = True,
    eps: float = 1e-6,
) -> tuple[torch.Tensor, torch.Tensor]:
    m = mask.bool()
    s = _float_scores(scores, token_rewards)
    inv, counts, mean = _group_stats(s, group_ids)
    adv = s - mean[inv]
    if norm_by_std:
        sq = torch.zeros_like(mean).index_add_(0, inv, adv * adv)
        std = torch.sqrt(sq / (counts - 1).clamp_min(1))
        adv = adv / (std[inv] + eps)
    adv = torch.where(counts[inv] > 1, adv, torch.zeros_like(adv))
    out = _broadcast(adv, m)
    return out, out.clone()


@register_advantage_estimator("rloo")
def _rloo(
    *,
    token_rewards: torch.Tensor,
    scores: torch.Tensor,
    values: torch.Tensor | None,
    mask: torch.Tensor,
    group_ids: torch.Tensor,
    gamma: float,
    lam: float,
) -> tuple[torch.Tensor, torch.Tensor]:
    m = mask.bool()
    s = _float_scores(scores, token_rewards)
    inv, counts, mean = _group_stats(s, group_ids)
    single = counts[inv] < 2
    if bool(single.any()):
        i = int(single.nonzero()[0, 0])
        raise ValueError(
            f"advantage estimator 'rloo' needs at least 2 samples per prompt; sample {i} "
            f"(group id {int(group_ids[i])}) is alone in its group"
        )
    n = counts[inv]
    adv = n / (n - 1) * (s - mean[inv])  # == s - mean of the other n - 1 scores
    out = _broadcast(adv, m)
    return out, out.clone()


@register_advantage_estimator("reinforce_plus_plus")
def _reinforce_pp(
    *,
    token_rewards: torch.Tensor,
    scores: torch.Tensor,
    values: torch.Tensor | None,
    mask: torch.Tensor,
    group_ids: torch.Tensor,
    gamma: float,
    lam: float,
    whiten: bool = True,
) -> tuple[torch.Tensor, torch.Tensor]:
    m = mask.bool()
    ret, _ = compute_gae(token_rewards, torch.zeros_like(token_rewards), m, gamma, 1.0)
    return (masked_whiten(ret, m) if whiten else ret.clone()), ret


@register_advantage_estimator("reinforce_plus_plus_baseline")
def _reinforce_pp_baseline(
    *,
    token_rewards: torch.Tensor,
    scores: torch.Tensor,
    values: torch.Tensor | None,
    mask: torch.Tensor,
    group_ids: torch.Tensor,
    gamma: float,
    lam: float,
    whiten: bool = True,
) -> tuple[torch.Tensor, torch.Tensor]:
    m = mask.bool()
    s = _float_scores(scores, token_rewards)
    inv, counts, mean = _group_stats(s, group_ids)
    adv = torch.where(counts[inv] > 1, s - mean[inv], torch.zeros_like(s))
    out = _broadcast(adv, m)
    if whiten:
        out = masked_whiten(out, m)
    return out, out.clone()
