"""PPO losses: clipped policy loss, clipped value loss, entropy, KL loss, and their aggregation.

All per-token inputs are [B, T] with the package's mask convention (nonzero = response token).
Values at masked-out positions never reach a loss or a metric, even when NaN or inf.

Aggregation modes (:func:`aggregate_loss`):

``token-mean``           sum over all response tokens / number of response tokens
``seq-mean-token-sum``   mean over samples of the per-sample sum over its response tokens
``seq-mean-token-mean``  mean over samples of the per-sample mean over its response tokens

The ``seq-*`` modes average over samples that have at least one response token (a sample with
none is left out, not counted as 0). A mask with no response token at all raises ``ValueError``.
Metrics are detached scalar tensors.
"""

from __future__ import annotations

import math

import torch

from .kl import kl_estimate

__all__ = [
    "AGG_MODES",
    "aggregate_loss",
    "aggregation_count",
    "entropy_from_logits",
    "gspo_policy_loss",
    "kl_loss",
    "policy_loss",
    "value_loss",
]

AGG_MODES = ("token-mean", "seq-mean-token-sum", "seq-mean-token-mean")
LOG_RATIO_CLAMP = 20.0


def _check_same(fn: str, mask: torch.Tensor, **tensors: torch.Tensor) -> torch.Tensor:
    if not isinstance(mask, torch.Tensor):
        raise ValueError(f"{fn}: mask must be a tensor, got {type(mask).__name__}")
    if mask.dim() != 2:
        raise ValueError(f"{fn}: mask must be [B, T], got shape {tuple(mask.shape)}")
    for name, t in tensors.items():
        if not isinstance(t, torch.Tensor):
            raise ValueError(f"{fn}: {name} must be a tensor, got {type(t).__name__}")
        if t.shape != mask.shape:
            raise ValueError(
                f"{fn}: {name} shape {tuple(t.shape)} must equal mask shape {tuple(mask.shape)}"
            )
    m = mask.bool()
    # (a `meta` tensor has a shape and no values: nothing to check)
    if not m.is_meta and not bool(m.any()):
        raise ValueError(f"{fn}: mask has no response token (empty batch or all rows masked)")
    return m


def _zero(x: torch.Tensor, m: torch.Tensor) -> torch.Tensor:
    return torch.where(m, x, torch.zeros((), dtype=x.dtype, device=x.device))


def _agg(loss_mat: torch.Tensor, m: torch.Tensor, mode: str) -> torch.Tensor:
    lz = _zero(loss_mat, m)
    if mode == "token-mean":
        return lz.sum() / m.sum()
    if mode not in AGG_MODES:
        raise ValueError(f"unknown loss aggregation {mode!r}; expected one of {AGG_MODES}")
    counts = m.sum(dim=1)
    seq = lz.sum(dim=1)
    if mode == "seq-mean-token-mean":
        seq = seq / counts.clamp_min(1)
    has = counts > 0
    return _zero(seq, has).sum() / has.sum()


def aggregation_count(mask: torch.Tensor, mode: str) -> int:
    """How many units ``mode`` averages over in ``mask``: response tokens for ``token-mean``,
    samples with at least one response token for the ``seq-*`` modes. A mini-batch split into
    micro-batches (and over data-parallel workers) weighs each part's loss by its count over the
    whole mini-batch's count, so that the sum is the loss of the whole mini-batch."""
    if mode not in AGG_MODES:
        raise ValueError(f"unknown loss aggregation {mode!r}; expected one of {AGG_MODES}")
    m = mask.bool()
    if mode == "token-mean":
        return int(m.sum())
    return int((m.sum(dim=-1) > 0).sum())


def aggregate_loss(loss_mat: torch.Tensor, mask: torch.Tensor, mode: str) -> torch.Tensor:
    """Reduce a [B, T] per-token loss to a scalar with one of :data:`AGG_MODES`."""
    if mode not in AGG_MODES:
        raise ValueError(f"unknown loss aggregation {mode!r}; expected one of {AGG_MODES}")
    m = _check_same("aggregate_loss", mask, loss_mat=loss_mat)
    return _agg(loss_mat, m, mode)


def _masked_frac(flag: torch.Tensor, m: torch.Tensor) -> torch.Tensor:
    return ((flag & m).sum() / m.sum()).to(torch.float32).detach()


def policy_loss(
    logprobs: torch.Tensor,
    old_logprobs: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    clip_low: float = 0.2,
    clip_high: float = 0.2,
    dual_clip: float | None = None,
    agg: str = "token-mean",
    *,
    entropy: torch.Tensor | None = None,
    entropy_coef: float = 0.0,
    weights: torch.Tensor | None = None,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """PPO clipped surrogate loss (to minimise), with asymmetric and dual clipping.

    Per token, with ``ratio = exp(logprobs - old_logprobs)`` (log-ratio clamped to [-20, 20]
    before ``exp`` so it never overflows) and advantage ``A``::

        l = max(-A * ratio, -A * clamp(ratio, 1 - clip_low, 1 + clip_high))
        if dual_clip is c and A < 0:  l = min(l, -A * c)        (Ye et al. 2020)

    then aggregated with ``agg``. With ``entropy`` [B, T] given (see
    :func:`entropy_from_logits`), ``entropy_coef * aggregate(entropy)`` is subtracted (a bonus
    for exploration). Metrics, over response tokens: ``clip_frac`` (share where the clipped term
    was selected, i.e. strictly larger), ``dual_clip_frac`` (share where the dual clip bound
    was applied), ``approx_kl`` (mean of ``old_logprobs - logprobs``, the k1 estimate of
    KL(old || new)) and, with an entropy, ``entropy``.
    ``weights`` [B, T] (no gradient), when given, multiply each token's loss ``l`` before
    aggregation (truncated importance sampling, see :func:`~.sampling.rollout_is_weights`);
    metric ``is_weight_mean``: their mean over response tokens.
    Raises ``ValueError`` on mismatched shapes, an empty mask, negative clips or ``clip_low >=
    1``, ``dual_clip <= 1`` or an unknown ``agg``.
    """
    fn = "policy_loss"
    if agg not in AGG_MODES:
        raise ValueError(f"{fn}: unknown agg {agg!r}; expected one of {AGG_MODES}")
    _check_clips(fn, clip_low, clip_high, dual_clip)
    m = _check_inputs(fn, logprobs, old_logprobs, advantages, mask, entropy, weights)
    log_ratio = _zero(logprobs - old_logprobs, m).clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP)
    return _surrogate(
        log_ratio,
        advantages,
        m,
        clip_low,
        clip_high,
        dual_clip,
        agg,
        entropy=entropy,
        entropy_coef=entropy_coef,
        weights=weights,
    )


def gspo_policy_loss(
    logprobs: torch.Tensor,
    old_logprobs: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    clip_low: float = 3e-4,
    clip_high: float = 4e-4,
    agg: str = "seq-mean-token-mean",
    *,
    entropy: torch.Tensor | None = None,
    entropy_coef: float = 0.0,
    weights: torch.Tensor | None = None,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """GSPO's clipped surrogate (Zheng et al. 2025, arXiv 2507.18071), in its GSPO-token form.

    Per sample i, the length-normalised sequence ratio over its response tokens::

        s_i = exp( (1 / |y_i|) * sum_t (logprobs_it - old_logprobs_it) )

    and per token ``s_it = sg[s_i] * pi(y_it) / sg[pi(y_it)]``: its value is s_i (so clipping
    happens per sequence), its gradient with respect to token t's log-prob is s_i (eq. 17)::

        l_it = max(-A_it * s_it, -A_it * clamp(s_it, 1 - clip_low, 1 + clip_high))

    then aggregated with ``agg`` (the paper: ``seq-mean-token-mean``). With every token of a
    sample given the same advantage, the gradient equals GSPO's sequence-level one (eq. 10).
    ``entropy``, ``entropy_coef`` and ``weights`` as in :func:`policy_loss`; metrics as there
    (``clip_frac`` counts the tokens of clipped sequences; ``dual_clip_frac`` is 0) plus
    ``seq_ratio_mean``: the mean of s_i over samples with a response token.
    """
    fn = "gspo_policy_loss"
    if agg not in AGG_MODES:
        raise ValueError(f"{fn}: unknown agg {agg!r}; expected one of {AGG_MODES}")
    _check_clips(fn, clip_low, clip_high, None)
    m = _check_inputs(fn, logprobs, old_logprobs, advantages, mask, entropy, weights)
    token_log_ratio = _zero(logprobs - old_logprobs, m)
    counts = m.sum(dim=1, keepdim=True)
    seq_log_ratio = token_log_ratio.sum(dim=1, keepdim=True) / counts.clamp_min(1)
    seq_log_ratio = seq_log_ratio.clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP)
    # value sg[log s_i]; gradient that of log pi(y_it) (GSPO-token)
    lp = _zero(logprobs, m)
    log_ratio = _zero(seq_log_ratio.detach() + lp - lp.detach(), m)
    loss, metrics = _surrogate(
        log_ratio,
        advantages,
        m,
        clip_low,
        clip_high,
        None,
        agg,
        entropy=entropy,
        entropy_coef=entropy_coef,
        weights=weights,
    )
    # approx_kl stays the token-level k1 estimate of KL(old || new)
    metrics["approx_kl"] = (_zero(-token_log_ratio, m).sum() / m.sum()).detach().to(torch.float32)
    has = counts.squeeze(1) > 0
    ratio = torch.exp(seq_log_ratio.squeeze(1).detach())
    metrics["seq_ratio_mean"] = (_zero(ratio, has).sum() / has.sum()).to(torch.float32)
    return loss, metrics


def _check_clips(fn: str, clip_low: float, clip_high: float, dual_clip: float | None) -> None:
    if not (0.0 <= float(clip_low) < 1.0):
        raise ValueError(f"{fn}: clip_low must be in [0, 1), got {clip_low!r}")
    if not (float(clip_high) >= 0.0 and math.isfinite(float(clip_high))):
        raise ValueError(f"{fn}: clip_high must be a finite number >= 0, got {clip_high!r}")
    if dual_clip is not None and not (float(dual_clip) > 1.0 and math.isfinite(dual_clip)):
        raise ValueError(f"{fn}: dual_clip must be a finite number > 1, got {dual_clip!r}")


def _check_inputs(
    fn: str,
    logprobs: torch.Tensor,
    old_logprobs: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    entropy: torch.Tensor | None,
    weights: torch.Tensor | None,
) -> torch.Tensor:
    tensors = {"logprobs": logprobs, "old_logprobs": old_logprobs, "advantages": advantages}
    if entropy is not None:
        tensors["entropy"] = entropy
    if weights is not None:
        tensors["weights"] = weights
    return _check_same(fn, mask, **tensors)


def _surrogate(
    log_ratio: torch.Tensor,
    advantages: torch.Tensor,
    m: torch.Tensor,
    clip_low: float,
    clip_high: float,
    dual_clip: float | None,
    agg: str,
    *,
    entropy: torch.Tensor | None,
    entropy_coef: float,
    weights: torch.Tensor | None,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """The clipped surrogate of a per-token log-ratio (0 off the mask), aggregated."""
    ratio = torch.exp(log_ratio)
    adv = _zero(advantages, m)
    pg1 = -adv * ratio
    pg2 = -adv * ratio.clamp(1.0 - clip_low, 1.0 + clip_high)
    loss_mat = torch.maximum(pg1, pg2)
    metrics = {"clip_frac": _masked_frac(pg2 > pg1, m)}
    if dual_clip is not None:
        pg3 = -adv * dual_clip
        dual = (adv < 0) & (loss_mat > pg3)
        loss_mat = torch.where(dual, pg3, loss_mat)
        metrics["dual_clip_frac"] = _masked_frac(dual, m)
    else:
        metrics["dual_clip_frac"] = torch.zeros((), dtype=torch.float32)
    metrics["approx_kl"] = (_zero(-log_ratio, m).sum() / m.sum()).detach().to(torch.float32)
    if weights is not None:
        w = _zero(weights.detach(), m)
        loss_mat = loss_mat * w
        metrics["is_weight_mean"] = (w.sum() / m.sum()).to(torch.float32)
    loss = _agg(loss_mat, m, agg)
    if entropy is not None:
        ent = _agg(entropy, m, agg)
        metrics["entropy"] = ent.detach().to(torch.float32)
        loss = loss - float(entropy_coef) * ent
    return loss, metrics


def value_loss(
    values: torch.Tensor,
    old_values: torch.Tensor,
    returns: torch.Tensor,
    mask: torch.Tensor,
    clip_range: float | None = None,
    agg: str = "token-mean",
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Critic loss ``0.5 * max((clip(v) - R)^2, (v - R)^2)``, aggregated with ``agg``.

    ``clip(v) = old_values + clamp(values - old_values, -clip_range, clip_range)``. The factor
    0.5 is included. With ``clip_range=None`` the loss is ``0.5 * (v - R)^2`` and ``clip_frac``
    is 0. Metric ``clip_frac``: share of response tokens where the clipped term was strictly
    larger (and so selected). ``ValueError`` on mismatched shapes, an empty mask, ``clip_range
    <= 0`` or an unknown ``agg``.
    """
    fn = "value_loss"
    if agg not in AGG_MODES:
        raise ValueError(f"{fn}: unknown agg {agg!r}; expected one of {AGG_MODES}")
    if clip_range is not None and not (math.isfinite(float(clip_range)) and float(clip_range) > 0):
        raise ValueError(
            f"{fn}: clip_range must be a finite number > 0 or None, got {clip_range!r}"
        )
    m = _check_same(fn, mask, values=values, old_values=old_values, returns=returns)
    v = _zero(values, m)
    ret = _zero(returns, m)
    vf1 = (v - ret) ** 2
    if clip_range is None:
        loss_mat = vf1
        frac = torch.zeros((), dtype=torch.float32)
    else:
        old = _zero(old_values, m)
        v_clip = old + (v - old).clamp(-clip_range, clip_range)
        vf2 = (v_clip - ret) ** 2
        loss_mat = torch.maximum(vf1, vf2)
        frac = _masked_frac(vf2 > vf1, m)
    return 0.5 * _agg(loss_mat, m, agg), {"clip_frac": frac}


def entropy_from_logits(logits: torch.Tensor) -> torch.Tensor:
    """Entropy of the softmax over the last dim: [B, T, V] -> [B, T].

    ``H = logsumexp(z) - sum softmax(z) * z``, stable for large logits; ``-inf`` logits
    (banned tokens) contribute 0.
    """
    if not isinstance(logits, torch.Tensor) or logits.dim() < 1:
        raise ValueError("entropy_from_logits: logits must be a tensor with a vocabulary dim")
    logp = torch.log_softmax(logits, dim=-1)
    p = logp.exp()
    # Zero log p where p == 0 *before* the product, so neither value nor gradient is NaN.
    safe_logp = torch.where(p > 0, logp, torch.zeros((), dtype=p.dtype, device=p.device))
    return -(p * safe_logp).sum(dim=-1)


def kl_loss(
    logprobs: torch.Tensor,
    ref_logprobs: torch.Tensor,
    mask: torch.Tensor,
    estimator: str = "low_var_kl",
    agg: str = "token-mean",
) -> torch.Tensor:
    """KL(policy || reference) as a loss term: :func:`kl_estimate` aggregated over the mask."""
    fn = "kl_loss"
    if agg not in AGG_MODES:
        raise ValueError(f"{fn}: unknown agg {agg!r}; expected one of {AGG_MODES}")
    m = _check_same(fn, mask, logprobs=logprobs, ref_logprobs=ref_logprobs)
    zero = torch.zeros((), dtype=logprobs.dtype, device=logprobs.device)
    lp = torch.where(m, logprobs, zero)
    ref = torch.where(m, ref_logprobs, zero)
    return _agg(kl_estimate(lp, ref, estimator), m, agg)
