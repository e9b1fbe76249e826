"""KL estimators and controllers, policy/value/entropy/KL losses, against float64 loops."""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from ppojob_trainer.algorithms import (
    AdaptiveKLController,
    FixedKLController,
    aggregate_loss,
    aggregation_count,
    entropy_from_logits,
    kl_estimate,
    kl_loss,
    policy_loss,
    value_loss,
)

SETTINGS = settings(max_examples=40, deadline=None)
MODES = ["token-mean", "seq-mean-token-sum", "seq-mean-token-mean"]


def ref_agg(mat, mask, mode):
    B, T = len(mat), len(mat[0])
    if mode == "token-mean":
        vals = [mat[b][t] for b in range(B) for t in range(T) if mask[b][t]]
        return sum(vals) / len(vals)
    seqs = []
    for b in range(B):
        vals = [mat[b][t] for t in range(T) if mask[b][t]]
        if vals:
            seqs.append(sum(vals) if mode == "seq-mean-token-sum" else sum(vals) / len(vals))
    return sum(seqs) / len(seqs)


def ref_kl(lp, ref, est):
    d = ref - lp
    if est == "k1":
        return -d
    if est == "k2":
        return 0.5 * d * d
    k3 = math.exp(d) - d - 1
    return k3 if est == "k3" else min(max(k3, -10.0), 10.0)


def rand_batch(seed, B, T, n=3):
    g = torch.Generator().manual_seed(seed)
    mask = torch.rand(B, T, generator=g) < 0.6
    mask[0, 0] = True
    tensors = [torch.randn(B, T, generator=g, dtype=torch.float64) for _ in range(n)]
    for t in tensors:
        t[~mask] = float("nan")  # garbage off the mask never reaches a loss or metric
    return mask, tensors


def close(a, b, tol=1e-9):
    assert math.isclose(float(a), b, rel_tol=tol, abs_tol=tol), (float(a), b)


# ------------------------------------------------------------------ KL
@SETTINGS
@given(seed=st.integers(0, 2**31 - 1), est=st.sampled_from(["k1", "k2", "k3", "low_var_kl"]))
def test_kl_estimators_match_reference(seed, est):
    g = torch.Generator().manual_seed(seed)
    lp = torch.randn(3, 5, generator=g, dtype=torch.float64) * 3
    ref = torch.randn(3, 5, generator=g, dtype=torch.float64) * 3
    out = kl_estimate(lp, ref, est)
    for b in range(3):
        for t in range(5):
            close(out[b, t], ref_kl(float(lp[b, t]), float(ref[b, t]), est), 1e-9)


def test_kl_properties_and_errors():
    lp = torch.tensor([0.0, -50.0, -1.0])
    ref = torch.tensor([0.0, 0.0, -1.0])
    assert kl_estimate(lp, ref, "k1").tolist() == [0.0, -50.0, 0.0]
    k3 = kl_estimate(lp, ref, "k3")
    assert bool((k3 >= 0).all())
    big = kl_estimate(torch.tensor([-200.0]), torch.tensor([0.0]), "low_var_kl")
    assert big.item() == 10.0  # clamped, never inf
    with pytest.raises(ValueError, match="k1, k2, k3, low_var_kl"):
        kl_estimate(lp, ref, "k4")
    with pytest.raises(ValueError, match="shape"):
        kl_estimate(lp, ref[:2], "k1")


def test_fixed_and_adaptive_kl_controllers():
    fixed = FixedKLController(0.1)
    fixed.update(5.0, 100)
    assert fixed.value == 0.1
    ctl = AdaptiveKLController(0.2, target=6.0, horizon=10000)
    ctl.update(current_kl=9.0, n_steps=256)  # error clipped to +0.2
    assert math.isclose(ctl.value, 0.2 * (1 + 0.2 * 256 / 10000))
    v = ctl.value
    ctl.update(current_kl=5.4, n_steps=100)  # error -0.1
    assert math.isclose(ctl.value, v * (1 - 0.1 * 100 / 10000))
    v = ctl.value
    ctl.update(current_kl=6.0, n_steps=100)  # on target: unchanged
    assert ctl.value == v
    # a simulated loop: the coefficient rises while KL is above target, falls while below
    ctl = AdaptiveKLController(1.0, target=1.0, horizon=10)
    for _ in range(5):
        ctl.update(2.0, 1)
    assert math.isclose(ctl.value, 1.02**5)
    ctl.update(0.0, 1000)  # huge n_steps: floored, never negative
    assert ctl.value == 0.0
    for bad in (
        dict(init_coef=-1, target=1, horizon=1),
        dict(init_coef=1, target=0, horizon=1),
        dict(init_coef=1, target=1, horizon=0),
    ):
        with pytest.raises(ValueError):
            AdaptiveKLController(**bad)
    with pytest.raises(ValueError, match="finite"):
        AdaptiveKLController(1, 1, 1).update(float("nan"), 1)


# ------------------------------------------------------------------ aggregation
@SETTINGS
@given(
    seed=st.integers(0, 2**31 - 1),
    B=st.integers(1, 5),
    T=st.integers(1, 12),
    mode=st.sampled_from(MODES),
)
def test_aggregate_loss_matches_reference(seed, B, T, mode):
    mask, (x,) = rand_batch(seed, B, T, 1)
    close(aggregate_loss(x, mask, mode), ref_agg(x.tolist(), mask.tolist(), mode))


def test_aggregate_hand_computed_and_errors():
    x = torch.tensor([[1.0, 2.0, 3.0], [4.0, 0.0, 0.0], [9.0, 9.0, 9.0]])
    m = torch.tensor([[1, 1, 1], [1, 0, 0], [0, 0, 0]])  # last row empty: left out of seq means
    assert aggregate_loss(x, m, "token-mean").item() == 2.5
    assert aggregate_loss(x, m, "seq-mean-token-sum").item() == 5.0
    assert aggregate_loss(x, m, "seq-mean-token-mean").item() == 3.0
    with pytest.raises(ValueError, match="unknown loss aggregation"):
        aggregate_loss(x, m, "sum")
    with pytest.raises(ValueError, match="no response token"):
        aggregate_loss(x, torch.zeros(3, 3), "token-mean")
    with pytest.raises(ValueError, match="shape"):
        aggregate_loss(x, torch.ones(3, 2), "token-mean")


# ------------------------------------------------------------------ policy loss
def ref_policy(lp, old, adv, mask, lo, hi, dual, mode):
    B, T = len(lp), len(lp[0])
    mat = [[0.0] * T for _ in range(B)]
    clipped = dualed = n = 0
    kl = 0.0
    for b in range(B):
        for t in range(T):
            if not mask[b][t]:
                continue
            n += 1
            ratio = math.exp(lp[b][t] - old[b][t])
            a = adv[b][t]
            unclipped = -a * ratio
            clip = -a * min(max(ratio, 1 - lo), 1 + hi)
            loss = max(unclipped, clip)
            clipped += clip > unclipped
            if dual is not None and a < 0 and loss > -a * dual:
                loss = -a * dual
                dualed += 1
            mat[b][t] = loss
            kl += old[b][t] - lp[b][t]
    return ref_agg(mat, mask, mode), clipped / n, dualed / n, kl / n


@SETTINGS
@given(
    seed=st.integers(0, 2**31 - 1),
    B=st.integers(1, 5),
    T=st.integers(1, 12),
    lo=st.floats(0.0, 0.5),
    hi=st.floats(0.0, 0.5),
    dual=st.one_of(st.none(), st.floats(1.01, 5.0)),
    mode=st.sampled_from(MODES),
)
def test_policy_loss_matches_reference(seed, B, T, lo, hi, dual, mode):
    mask, (lp, old, adv) = rand_batch(seed, B, T)
    lp = lp * 0.5  # ratios around 1 so that both clipped and unclipped tokens occur
    loss, metrics = policy_loss(lp, old * 0.5, adv, mask, lo, hi, dual, mode)
    r_loss, r_clip, r_dual, r_kl = ref_policy(
        lp.tolist(), (old * 0.5).tolist(), adv.tolist(), mask.tolist(), lo, hi, dual, mode
    )
    close(loss, r_loss)
    close(metrics["clip_frac"], r_clip, 1e-6)
    close(metrics["dual_clip_frac"], r_dual, 1e-6)
    close(metrics["approx_kl"], r_kl, 1e-5)


def test_policy_loss_hand_computed_gradients_and_entropy():
    lp = torch.log(torch.tensor([[1.5, 0.5, 1.0, 3.0]])).requires_grad_()
    old = torch.zeros(1, 4)
    adv = torch.tensor([[1.0, 1.0, -2.0, -1.0]])
    mask = torch.ones(1, 4)
    loss, m = policy_loss(lp, old, adv, mask, clip_low=0.2, clip_high=0.3, dual_clip=2.5)
    # t0: ratio 1.5, A=1: max(-1.5, -1.3) = -1.3 (clipped)
    # t1: ratio 0.5, A=1: max(-0.5, -0.8) = -0.5
    # t2: ratio 1, A=-2: 2
    # t3: ratio 3, A=-1: max(3, 1.3) = 3 -> dual clip min(3, 2.5) = 2.5
    assert math.isclose(loss.item(), (-1.3 - 0.5 + 2 + 2.5) / 4, rel_tol=1e-6)
    assert m["clip_frac"].item() == 0.25 and m["dual_clip_frac"].item() == 0.25
    loss.backward()
    # clipped and dual-clipped tokens carry no gradient; others d/dlp(-A*ratio) / 4
    torch.testing.assert_close(lp.grad, torch.tensor([[0.0, -0.5 / 4, 2.0 / 4, 0.0]]))
    ent = torch.tensor([[1.0, 2.0, 3.0, 4.0]])
    loss_e, m_e = policy_loss(
        lp.detach(), old, adv, mask, 0.2, 0.3, 2.5, entropy=ent, entropy_coef=0.1
    )
    assert math.isclose(loss_e.item(), loss.item() - 0.1 * 2.5, rel_tol=1e-6)
    assert m_e["entropy"].item() == 2.5


def test_policy_loss_errors_and_extremes():
    t = torch.zeros(2, 3)
    m = torch.ones(2, 3)
    with pytest.raises(ValueError, match="dual_clip must be"):
        policy_loss(t, t, t, m, dual_clip=1.0)
    with pytest.raises(ValueError, match="clip_low"):
        policy_loss(t, t, t, m, clip_low=1.0)
    with pytest.raises(ValueError, match="advantages shape"):
        policy_loss(t, t, torch.zeros(2, 2), m)
    with pytest.raises(ValueError, match="no response token"):
        policy_loss(t, t, t, torch.zeros(2, 3))
    with pytest.raises(ValueError, match="unknown agg"):
        policy_loss(t, t, t, m, agg="mean")
    # a huge log-ratio does not overflow to inf/NaN
    loss, metrics = policy_loss(torch.full((2, 3), 500.0), t, torch.ones(2, 3), m)
    assert torch.isfinite(loss) and all(torch.isfinite(v) for v in metrics.values())


# ------------------------------------------------------------------ value loss
@SETTINGS
@given(
    seed=st.integers(0, 2**31 - 1),
    B=st.integers(1, 5),
    T=st.integers(1, 12),
    clip=st.one_of(st.none(), st.floats(0.01, 2.0)),
    mode=st.sampled_from(MODES),
)
def test_value_loss_matches_reference(seed, B, T, clip, mode):
    mask, (v, old, ret) = rand_batch(seed, B, T)
    loss, metrics = value_loss(v, old, ret, mask, clip, mode)
    mat = [[0.0] * T for _ in range(B)]
    n = clipped = 0
    for b in range(B):
        for t in range(T):
            if not mask[b, t]:
                continue
            vv, oo, rr = float(v[b, t]), float(old[b, t]), float(ret[b, t])
            l1 = (vv - rr) ** 2
            l2 = l1 if clip is None else (oo + min(max(vv - oo, -clip), clip) - rr) ** 2
            mat[b][t] = 0.5 * max(l1, l2)
            n += 1
            clipped += l2 > l1
    close(loss, ref_agg(mat, mask.tolist(), mode))
    close(metrics["clip_frac"], clipped / n, 1e-6)


def test_value_loss_hand_computed_and_errors():
    v = torch.tensor([[2.0, 0.0]])
    old = torch.tensor([[0.0, 0.0]])
    ret = torch.tensor([[3.0, 1.0]])
    loss, m = value_loss(v, old, ret, torch.ones(1, 2), clip_range=0.5)
    # t0: unclipped (2-3)^2 = 1, clipped (0.5-3)^2 = 6.25 -> 6.25; t1: 1 vs 1 -> 1
    assert math.isclose(loss.item(), 0.5 * (6.25 + 1) / 2)
    assert m["clip_frac"].item() == 0.5
    loss, m = value_loss(v, old, ret, torch.ones(1, 2))
    assert math.isclose(loss.item(), 0.5 * (1 + 1) / 2) and m["clip_frac"].item() == 0.0
    with pytest.raises(ValueError, match="clip_range"):
        value_loss(v, old, ret, torch.ones(1, 2), clip_range=0.0)
    with pytest.raises(ValueError, match="returns shape"):
        value_loss(v, old, ret[:, :1], torch.ones(1, 2))


# ------------------------------------------------------------------ entropy and KL loss
@SETTINGS
@given(seed=st.integers(0, 2**31 - 1), V=st.integers(1, 8))
def test_entropy_matches_reference(seed, V):
    logits = (
        torch.randn(2, 3, V, generator=torch.Generator().manual_seed(seed), dtype=torch.float64) * 4
    )
    out = entropy_from_logits(logits)
    for b in range(2):
        for t in range(3):
            z = logits[b, t].tolist()
            mx = max(z)
            ps = [math.exp(x - mx) for x in z]
            total = sum(ps)
            close(out[b, t], -sum(p / total * math.log(p / total) for p in ps if p > 0), 1e-9)


def test_entropy_with_banned_tokens_has_finite_gradient():
    logits = torch.tensor([[[0.0, 0.0, float("-inf"), 1000.0]]], requires_grad=True)
    h = entropy_from_logits(logits)
    h.sum().backward()
    assert torch.isfinite(h).all() and torch.isfinite(logits.grad).all()
    assert math.isclose(entropy_from_logits(torch.zeros(1, 1, 4)).item(), math.log(4), rel_tol=1e-6)


@SETTINGS
@given(
    seed=st.integers(0, 2**31 - 1),
    est=st.sampled_from(["k1", "k2", "k3", "low_var_kl"]),
    mode=st.sampled_from(MODES),
)
def test_kl_loss_matches_reference(seed, est, mode):
    mask, (lp, ref) = rand_batch(seed, 3, 6, 2)
    mat = [
        [ref_kl(float(lp[b, t]), float(ref[b, t]), est) if mask[b, t] else 0.0 for t in range(6)]
        for b in range(3)
    ]
    close(kl_loss(lp, ref, mask, est, mode), ref_agg(mat, mask.tolist(), mode), 1e-9)


# ------------------------------------------------------------------ edges mutmut found open
def test_kl_controllers_name_the_bad_argument_and_value():
    cases = [
        (lambda: FixedKLController(-0.5), "KL coef must be >= 0, got -0.5"),
        (lambda: FixedKLController("x"), "KL coef must be a number, got 'x'"),
        (lambda: FixedKLController(1.0).update("y", 1), "current_kl must be a number, got 'y'"),
        (lambda: FixedKLController(1.0).update(0.1, -1), "n_steps must be >= 0, got -1"),
        (lambda: AdaptiveKLController(-1, 1, 1), "init_coef must be >= 0, got -1"),
        (lambda: AdaptiveKLController(1, 0, 1), "target must be > 0, got 0"),
        (lambda: AdaptiveKLController(1, 1, -2), "horizon must be > 0, got -2"),
        (
            lambda: AdaptiveKLController(1, 1, 1).update(float("inf"), 1),
            "current_kl must be finite",
        ),
        (lambda: AdaptiveKLController(1, 1, 1).update(0.5, -3), "n_steps must be >= 0, got -3"),
    ]
    for make, message in cases:
        with pytest.raises(ValueError) as info:
            make()
        assert str(info.value).startswith(message), str(info.value)


def test_kl_controllers_accept_zero():
    """A coefficient of 0 (KL off) and an update over zero steps are valid."""
    fixed = FixedKLController(0.0)
    fixed.update(0.3, 0)
    assert fixed.value == 0.0
    ctl = AdaptiveKLController(0.0, target=1.0, horizon=10)
    ctl.update(5.0, 0)
    assert ctl.value == 0.0
    ctl = AdaptiveKLController(0.5, target=1.0, horizon=10)
    ctl.update(3.0, 0)  # no steps measured: unchanged
    assert ctl.value == 0.5


def test_kl_controllers_accept_a_negative_measured_kl():
    """The k1 estimate's mean can be negative: a measurement, not an error."""
    fixed = FixedKLController(0.1)
    fixed.update(-0.05, 4)
    assert fixed.value == 0.1
    ctl = AdaptiveKLController(1.0, target=1.0, horizon=10)
    ctl.update(-0.05, 10)  # below target: lowered by the clipped error
    assert math.isclose(ctl.value, 0.8)


def test_adaptive_kl_lowers_by_at_most_a_fifth_per_horizon():
    """KL far below the target: the error is clipped at -0.2, so over one horizon of steps the
    coefficient falls to 0.8 of itself (not to 0)."""
    ctl = AdaptiveKLController(1.0, target=1.0, horizon=10)
    ctl.update(0.0, 10)
    assert math.isclose(ctl.value, 0.8)


def test_entropy_of_one_distribution_and_errors():
    """A single vocabulary dim is enough ([V] -> scalar); anything else is a clear error."""
    h = entropy_from_logits(torch.zeros(4))
    assert h.dim() == 0 and math.isclose(float(h), math.log(4), rel_tol=1e-6)
    for bad in ([0.0, 1.0], torch.tensor(1.0)):
        with pytest.raises(ValueError) as info:
            entropy_from_logits(bad)
        assert str(info.value) == (
            "entropy_from_logits: logits must be a tensor with a vocabulary dim"
        )


def test_kl_loss_defaults_are_low_var_kl_and_token_mean():
    """The defaults: the clamped k3 estimate, averaged over response tokens."""
    lp = torch.tensor([[0.0, 0.0, -1.0], [0.0, 0.0, 0.0]], dtype=torch.float64)
    ref = torch.tensor([[15.0, 0.5, 0.0], [-0.5, 0.0, 0.0]], dtype=torch.float64)
    mask = torch.tensor([[1, 1, 1], [1, 0, 0]])
    got = kl_loss(lp, ref, mask)
    per_token = kl_estimate(lp, ref, "low_var_kl")[mask.bool()]
    assert math.isclose(float(got), float(per_token.mean()), rel_tol=1e-12)
    assert float(per_token.max()) == 10.0  # the clamp is reached: k3 would be ~3.3e6
    assert not math.isclose(float(got), float(kl_loss(lp, ref, mask, "k3")))
    per_sample = kl_loss(lp, ref, mask, "low_var_kl", "seq-mean-token-mean")
    assert not math.isclose(float(got), float(per_sample))
    with pytest.raises(ValueError, match="aggregate_loss: mask has no response token"):
        aggregate_loss(lp, torch.zeros_like(mask), "token-mean")


@pytest.mark.parametrize("mode", ["token-mean", "seq-mean-token-sum", "seq-mean-token-mean"])
def test_aggregation_count_weighs_micro_batches_into_the_whole(mode):
    """The documented use: parts of a mini-batch, each loss weighted by its count over the
    whole's count, sum to the whole mini-batch's loss (a row without tokens counts for none)."""
    g = torch.Generator().manual_seed(3)
    loss = torch.randn(6, 5, generator=g, dtype=torch.float64)
    mask = torch.tensor(
        [
            [1, 1, 0, 0, 0],
            [1, 1, 1, 1, 1],
            [0, 0, 0, 0, 0],
            [1, 0, 0, 0, 0],
            [1, 1, 1, 0, 0],
            [1, 0, 1, 0, 1],
        ]
    )
    whole = aggregation_count(mask, mode)
    assert whole == (mask.sum().item() if mode == "token-mean" else 5)
    parts = [slice(0, 2), slice(2, 4), slice(4, 6)]
    total = sum(
        aggregate_loss(loss[sl], mask[sl], mode) * aggregation_count(mask[sl], mode) / whole
        for sl in parts
    )
    assert math.isclose(float(total), float(aggregate_loss(loss, mask, mode)), rel_tol=1e-12)
    with pytest.raises(ValueError, match="unknown loss aggregation 'mean'"):
        aggregation_count(mask, "mean")


def _one(*values, dtype=torch.float64):
    return [torch.tensor([[v]], dtype=dtype) for v in values]


def test_policy_loss_importance_weights_scale_each_token():
    """Truncated importance weights multiply each token's loss (no gradient through them); the
    metric is their mean over response tokens."""
    lp = torch.tensor([[0.1, -0.2, 0.3], [0.0, 0.2, 9.0]], dtype=torch.float64, requires_grad=True)
    old = torch.zeros(2, 3, dtype=torch.float64)
    adv = torch.tensor([[1.0, -2.0, 0.5], [1.5, -1.0, 7.0]], dtype=torch.float64)
    mask = torch.tensor([[1, 1, 1], [1, 1, 0]])
    w = torch.tensor([[0.5, 2.0, 1.0], [0.0, 1.5, 99.0]], dtype=torch.float64, requires_grad=True)
    plain, _ = policy_loss(lp, old, adv, mask, agg="seq-mean-token-sum")
    loss, metrics = policy_loss(lp, old, adv, mask, agg="seq-mean-token-sum", weights=w)
    per_token, _ = policy_loss(lp, old, adv, mask, agg="token-mean")
    # the same per-token losses, each times its weight
    one = torch.ones(1, 1, dtype=torch.long)
    l_tok = [
        float(
            policy_loss(
                lp.detach()[b : b + 1, t : t + 1], old[:1, :1], adv[b : b + 1, t : t + 1], one
            )[0]
        )
        for b, t in ((0, 0), (0, 1), (0, 2), (1, 0), (1, 1))
    ]
    expected = ((0.5 * l_tok[0] + 2.0 * l_tok[1] + 1.0 * l_tok[2]) + (0.0 + 1.5 * l_tok[4])) / 2
    assert math.isclose(loss.item(), expected, rel_tol=1e-12)
    assert not math.isclose(loss.item(), plain.item())
    assert math.isclose(float(metrics["is_weight_mean"]), (0.5 + 2 + 1 + 0 + 1.5) / 5)
    assert metrics["is_weight_mean"].dtype == torch.float32
    loss.backward()
    assert w.grad is None and lp.grad is not None
    assert per_token.item() == float(policy_loss(lp.detach(), old, adv, mask)[0])  # default agg


def test_policy_loss_defaults_clip_at_a_fifth_and_add_no_entropy():
    lp, old, adv = _one(math.log(2.0), 0.0, 1.0)
    mask = torch.ones(1, 1, dtype=torch.long)
    # ratio 2 with a positive advantage: the clipped term -A * 1.2 is the larger
    loss, metrics = policy_loss(
        lp, old, adv, mask, entropy=torch.full((1, 1), 3.0, dtype=torch.float64)
    )
    assert math.isclose(float(loss), -1.2, rel_tol=1e-12)
    assert float(metrics["clip_frac"]) == 1.0
    assert float(metrics["entropy"]) == 3.0 and metrics["entropy"].dtype == torch.float32
    # a negative advantage at ratio 2: the unclipped -A * 2 is the larger
    lp, old, adv = _one(math.log(2.0), 0.0, -1.0)
    assert float(policy_loss(lp, old, adv, mask)[0]) == 2.0


def test_policy_loss_log_ratio_is_clamped_at_twenty():
    mask = torch.ones(1, 1, dtype=torch.long)
    lp, old, adv = _one(50.0, 0.0, -1.0)
    loss, metrics = policy_loss(lp, old, adv, mask)
    assert math.isclose(float(loss), math.exp(20.0), rel_tol=1e-12)
    assert float(metrics["approx_kl"]) == -20.0
    lp, old, adv = _one(-50.0, 0.0, 1.0)
    _, metrics = policy_loss(lp, old, adv, mask)
    assert float(metrics["approx_kl"]) == 20.0
    assert metrics["approx_kl"].dtype == torch.float32


def test_dual_clip_bound_reached_exactly_is_not_counted():
    """The dual clip applies where the loss is strictly above -A * c."""
    mask = torch.ones(1, 1, dtype=torch.long)
    lp, old, adv = _one(math.log(2.0), 0.0, -1.0)  # loss 2 = -A * c for c = 2
    loss, metrics = policy_loss(lp, old, adv, mask, dual_clip=2.0)
    assert float(loss) == 2.0 and float(metrics["dual_clip_frac"]) == 0.0
    loss, metrics = policy_loss(lp, old, adv, mask, dual_clip=1.5)
    assert float(loss) == 1.5 and float(metrics["dual_clip_frac"]) == 1.0
    assert metrics["dual_clip_frac"].dtype == torch.float32


def test_loss_errors_name_the_function_and_the_argument():
    mask = torch.ones(2, 3, dtype=torch.long)
    x = torch.zeros(2, 3)
    short = torch.zeros(2, 2)
    cases = [
        (lambda: policy_loss(short, x, x, mask), "policy_loss: logprobs shape (2, 2)"),
        (lambda: policy_loss(x, short, x, mask), "policy_loss: old_logprobs shape (2, 2)"),
        (lambda: policy_loss(x, x, x, mask, entropy=short), "policy_loss: entropy shape"),
        (lambda: policy_loss(x, x, x, mask, weights=short), "policy_loss: weights shape"),
        (
            lambda: policy_loss(x, x, x, mask, clip_high=float("inf")),
            "policy_loss: clip_high must be a finite number >= 0, got inf",
        ),
        (lambda: value_loss(short, x, x, mask), "value_loss: values shape (2, 2)"),
        (lambda: value_loss(x, short, x, mask), "value_loss: old_values shape (2, 2)"),
        (lambda: value_loss(x, x, x, mask, agg="sum"), "value_loss: unknown agg 'sum'"),
        (lambda: kl_loss(short, x, mask), "kl_loss: logprobs shape (2, 2)"),
        (lambda: kl_loss(x, short, mask), "kl_loss: ref_logprobs shape (2, 2)"),
        (lambda: kl_loss(x, x, mask, agg="sum"), "kl_loss: unknown agg 'sum'"),
        (
            lambda: aggregate_loss(x, [[1, 1, 1]], "token-mean"),
            "aggregate_loss: mask must be a tensor, got list",
        ),
        (
            lambda: aggregate_loss(x, torch.ones(3), "token-mean"),
            "aggregate_loss: mask must be [B, T], got shape (3,)",
        ),
        (
            lambda: aggregate_loss([0.0], mask, "token-mean"),
            "aggregate_loss: loss_mat must be a tensor, got list",
        ),
        (
            lambda: kl_estimate(x, [0.0], "k1"),
            "kl_estimate: logprobs and ref_logprobs must be tensors",
        ),
        (
            lambda: kl_estimate([0.0], x, "k1"),
            "kl_estimate: logprobs and ref_logprobs must be tensors",
        ),
    ]
    for make, message in cases:
        with pytest.raises(ValueError) as info:
            make()
        assert str(info.value).startswith(message), str(info.value)


def test_metrics_are_float32_whatever_the_inputs():
    lp = torch.tensor([[0.3, -0.1]], dtype=torch.float64)
    mask = torch.ones(1, 2, dtype=torch.long)
    _, metrics = policy_loss(lp, torch.zeros_like(lp), torch.ones_like(lp), mask, dual_clip=3.0)
    assert {k: v.dtype for k, v in metrics.items()} == {
        "clip_frac": torch.float32,
        "dual_clip_frac": torch.float32,
        "approx_kl": torch.float32,
    }
