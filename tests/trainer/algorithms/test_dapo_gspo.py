"""The algorithm pack of issue 25 against the papers' formulas, on fixed tensors with the
expected numbers worked out by hand (never by the code under test).

GSPO: Zheng et al. 2025, "Group Sequence Policy Optimization", arXiv 2507.18071, eqs. 5-7 and
the GSPO-token form (eqs. 13-17). DAPO: Yu et al. 2025, arXiv 2503.14476: the soft overlong
punishment (eq. 13), overlong filtering (section 3.4), dynamic sampling (eq. 11).
"""

from __future__ import annotations

import math

import pytest
import torch

from ppojob_trainer.algorithms import (
    fill_step,
    gspo_policy_loss,
    informative_groups,
    overlong_penalty,
    policy_loss,
    truncated_rows,
)

# Two samples: sample 0 has 2 response tokens (then padding), sample 1 has 3.
MASK = torch.tensor([[1, 1, 0], [1, 1, 1]], dtype=torch.bool)
OLD = torch.tensor([[-1.2, -1.9, 0.0], [-0.5, -0.6, -0.7]])
NEW = [[-1.0, -2.0, float("nan")], [-0.5, -0.7, -0.9]]  # NaN where masked: must not leak
# By hand: sample 0's token log-ratios 0.2, -0.1 -> mean 0.05 -> s_0 = e^0.05 = 1.0512711;
# sample 1's 0, -0.1, -0.2 -> mean -0.1 -> s_1 = e^-0.1 = 0.9048374.
S0, S1 = math.exp(0.05), math.exp(-0.1)
CLIP_LOW, CLIP_HIGH = 0.05, 0.04  # sample 0 is clipped above (1.051 > 1.04); sample 1 is not


def _new() -> torch.Tensor:
    return torch.tensor(NEW, requires_grad=True)


def test_gspo_value_and_gradient_follow_the_sequence_level_formula() -> None:
    adv = torch.tensor([[1.0, 1.0, 0.0], [2.0, 2.0, 2.0]])
    logp = _new()
    loss, m = gspo_policy_loss(logp, OLD, adv, MASK, CLIP_LOW, CLIP_HIGH, agg="seq-mean-token-mean")
    # sample 0: A = 1 > 0 and s_0 > 1 + 0.04: each token's loss is -A * 1.04 (clipped)
    # sample 1: A = 2, s_1 = 0.905 < 1 - 0.05: max(-2 s_1, -2 * 0.95) = -2 s_1 (unclipped)
    # seq-mean-token-mean: 1/2 * (mean(-1.04, -1.04) + mean(-2 s_1 x 3))
    expected = 0.5 * (-1.04 + -2 * S1)
    assert float(loss.detach()) == pytest.approx(expected, rel=1e-6)
    loss.backward()
    grad = logp.grad
    # clipped sample: no gradient. Unclipped: d/d logp_t of (1/2)(1/3) sum_t -A s_1,t, with
    # d s_1,t / d logp_t = s_1 (GSPO-token): -A s_1 / 6 per token, the same for every token
    assert grad[0, :2].tolist() == [0.0, 0.0]
    assert grad[1].tolist() == pytest.approx([-2 * S1 / 6] * 3, rel=1e-6)
    assert not torch.isnan(grad).any()
    assert float(m["clip_frac"]) == pytest.approx(2 / 5)  # sample 0's two tokens of five
    assert float(m["seq_ratio_mean"]) == pytest.approx((S0 + S1) / 2, rel=1e-6)
    # approx_kl: the token-level k1 estimate, mean of old - new over the 5 tokens
    assert float(m["approx_kl"]) == pytest.approx((-0.2 + 0.1 + 0.0 + 0.1 + 0.2) / 5, abs=1e-6)


def test_gspo_token_gives_each_token_its_own_advantage_times_the_sequence_ratio() -> None:
    """GSPO-token (eq. 16-17): per-token advantages, one sequence ratio s_i for all of them."""
    adv = torch.tensor([[0.0, 0.0, 0.0], [1.0, 2.0, 3.0]])
    logp = _new()
    loss, _ = gspo_policy_loss(logp, OLD, adv, MASK, CLIP_LOW, CLIP_HIGH, agg="token-mean")
    # token-mean over 5 tokens: sample 0 contributes 0; sample 1: -(1 + 2 + 3) * s_1
    assert float(loss.detach()) == pytest.approx(-6 * S1 / 5, rel=1e-6)
    loss.backward()
    assert logp.grad[1].tolist() == pytest.approx([-1 * S1 / 5, -2 * S1 / 5, -3 * S1 / 5])


def test_gspo_differs_from_token_level_ppo_on_the_same_tensors() -> None:
    adv = torch.tensor([[1.0, 1.0, 0.0], [2.0, 2.0, 2.0]])
    ppo, _ = policy_loss(_new(), OLD, adv, MASK, CLIP_LOW, CLIP_HIGH, agg="seq-mean-token-mean")
    # token-level, by hand: sample 0 ratios e^0.2 (clipped to 1.04) and e^-0.1 -> -1.04,
    # -e^-0.1; sample 1 ratios 1, e^-0.1, e^-0.2: A = 2 > 0, each min'd at max(r, 0.95)...
    # -A * r unless r < 0.95, where -A * 0.95 is smaller: max picks -A * r
    s0 = 0.5 * (-1.04 - math.exp(-0.1))
    s1 = (-2 * 1.0 - 2 * math.exp(-0.1) - 2 * math.exp(-0.2)) / 3
    assert float(ppo.detach()) == pytest.approx(0.5 * (s0 + s1), rel=1e-6)
    gspo, _ = gspo_policy_loss(
        _new(), OLD, adv, MASK, CLIP_LOW, CLIP_HIGH, agg="seq-mean-token-mean"
    )
    assert abs(float(gspo.detach()) - float(ppo.detach())) > 1e-3


def test_gspo_accepts_the_papers_small_clip_ranges() -> None:
    adv = torch.tensor([[1.0, 1.0, 0.0], [-1.0, -1.0, -1.0]])
    loss, m = gspo_policy_loss(_new(), OLD, adv, MASK, 3e-4, 4e-4)
    # s_0 > 1 + 4e-4 with A > 0 and s_1 < 1 - 3e-4 with A < 0: both clipped, every token
    assert float(m["clip_frac"]) == 1.0
    assert float(loss.detach()) == pytest.approx(0.5 * (-(1 + 4e-4) + (1 - 3e-4)), abs=1e-7)


def test_overlong_penalty_is_the_soft_punishment_of_eq_13() -> None:
    # L_max 10, L_cache 4: no penalty up to 6 tokens, then (6 - |y|) / 4, -1 from 10 on
    lengths = torch.tensor([3, 6, 7, 9, 10, 12])
    got = overlong_penalty(lengths, max_length=10, buffer=4)
    assert got.tolist() == pytest.approx([0.0, 0.0, -0.25, -0.75, -1.0, -1.0])
    half = overlong_penalty(lengths, max_length=10, buffer=4, factor=0.5)
    assert half.tolist() == pytest.approx([0.0, 0.0, -0.125, -0.375, -0.5, -0.5])


def test_truncated_rows_are_those_cut_at_the_limit_without_a_stop_token() -> None:
    stop = 2
    ids = torch.tensor([[5, 6, 2, 0], [5, 6, 7, 8], [5, 6, 7, 2], [5, 0, 0, 0]])
    lengths = torch.tensor([3, 4, 4, 1])
    assert truncated_rows(ids, lengths, 4, [stop]).tolist() == [False, True, False, False]


def test_informative_groups_are_those_with_differing_rewards() -> None:
    scores = torch.tensor([1.0, 1.0, 0.0, 1.0, 0.5, 0.5, 0.0, 0.25])
    groups = torch.tensor([7, 7, 8, 8, 9, 9, 3, 3])
    assert informative_groups(scores, groups) == [8, 3]


def test_fill_step_takes_kept_groups_in_round_order_and_fills_when_short() -> None:
    # round 0: groups 0-3, informative 1 and 3; round 1: groups 4-7, informative 4
    rounds = [([0, 1, 2, 3], [1, 3]), ([4, 5, 6, 7], [4])]
    full = fill_step(rounds, 2)
    assert full.picked == [(0, 1, True), (0, 3, True)]
    assert (full.filtered, full.short) == (5, 0)
    short = fill_step(rounds, 4)
    # three kept, one missing: the first filtered group fills it, out of the loss
    assert short.picked == [(0, 1, True), (0, 3, True), (1, 4, True), (0, 0, False)]
    assert short.short == 1


def test_gspo_defaults_are_the_papers_clip_ranges_and_no_entropy_bonus() -> None:
    """Called with its defaults: clip 3e-4 / 4e-4, seq-mean-token-mean, entropy_coef 0 (an
    entropy given without a coefficient is reported, not added to the loss)."""
    adv = torch.tensor([[1.0, 1.0, 0.0], [-1.0, -1.0, -1.0]])
    entropy = torch.tensor([[0.5, 0.5, 0.0], [1.0, 1.0, 1.0]])
    loss, m = gspo_policy_loss(_new(), OLD, adv, MASK, entropy=entropy)
    assert float(loss.detach()) == pytest.approx(0.5 * (-(1 + 4e-4) + (1 - 3e-4)), abs=1e-7)
    assert float(m["entropy"]) == pytest.approx(0.5 * (0.5 + 1.0))


def test_gspo_weights_and_the_entropy_bonus_reach_the_loss() -> None:
    """Importance weights multiply each token's loss (metric is_weight_mean); the entropy bonus
    is entropy_coef times the aggregated entropy, subtracted."""
    adv = torch.tensor([[0.0, 0.0, 0.0], [1.0, 2.0, 3.0]])
    plain, _ = gspo_policy_loss(_new(), OLD, adv, MASK, CLIP_LOW, CLIP_HIGH, agg="token-mean")
    weights = torch.full((2, 3), 2.0)
    weighted, m = gspo_policy_loss(
        _new(), OLD, adv, MASK, CLIP_LOW, CLIP_HIGH, agg="token-mean", weights=weights
    )
    assert float(weighted.detach()) == pytest.approx(2 * float(plain.detach()), rel=1e-6)
    assert float(m["is_weight_mean"]) == pytest.approx(2.0)
    entropy = torch.full((2, 3), 0.4)
    bonus, m = gspo_policy_loss(
        _new(), OLD, adv, MASK, CLIP_LOW, CLIP_HIGH, "token-mean", entropy=entropy, entropy_coef=0.5
    )
    assert float(bonus.detach()) == pytest.approx(float(plain.detach()) - 0.5 * 0.4, rel=1e-6)


def test_gspo_sequence_ratio_of_one_token_and_of_none() -> None:
    """A one-token response's s_i is its token's ratio; a row with no response token has no
    s_i and stays out of seq_ratio_mean. Metrics are float32 whatever the inputs' dtype."""
    mask = torch.tensor([[1, 0, 0], [0, 0, 0], [1, 1, 0]], dtype=torch.bool)
    old = torch.zeros(3, 3, dtype=torch.float64)
    new = torch.tensor([[0.3, 0.0, 0.0], [0.0, 0.0, 0.0], [0.1, -0.3, 0.0]], dtype=torch.float64)
    adv = torch.ones(3, 3, dtype=torch.float64)
    _, m = gspo_policy_loss(new, old, adv, mask, CLIP_LOW, CLIP_HIGH)
    assert float(m["seq_ratio_mean"]) == pytest.approx((math.exp(0.3) + math.exp(-0.1)) / 2)
    assert float(m["approx_kl"]) == pytest.approx(-(0.3 + 0.1 - 0.3) / 3)
    assert m["seq_ratio_mean"].dtype == m["approx_kl"].dtype == torch.float32


@pytest.mark.parametrize("log_ratio", [50.0, -50.0])
def test_gspo_clamps_a_huge_sequence_log_ratio(log_ratio: float) -> None:
    mask = torch.ones(1, 2, dtype=torch.bool)
    new = torch.full((1, 2), log_ratio)
    loss, m = gspo_policy_loss(new, torch.zeros(1, 2), torch.ones(1, 2), mask, 0.2, 0.2)
    assert float(m["seq_ratio_mean"]) == pytest.approx(math.exp(math.copysign(20.0, log_ratio)))
    assert math.isfinite(float(loss))
    # approx_kl stays the token-level k1 estimate, not the clamped sequence log-ratio
    assert float(m["approx_kl"]) == pytest.approx(-log_ratio)


def test_gspo_errors_name_the_function_and_the_argument() -> None:
    adv = torch.ones(2, 3)
    with pytest.raises(ValueError, match=r"^gspo_policy_loss: unknown agg 'mean'"):
        gspo_policy_loss(_new(), OLD, adv, MASK, agg="mean")
    with pytest.raises(ValueError, match=r"^gspo_policy_loss: clip_low must be in \[0, 1\)"):
        gspo_policy_loss(_new(), OLD, adv, MASK, 1.0, 0.2)
    with pytest.raises(ValueError, match=r"^gspo_policy_loss: entropy shape \(2,\) must equal"):
        gspo_policy_loss(_new(), OLD, adv, MASK, entropy=torch.ones(2))
    with pytest.raises(ValueError, match=r"^gspo_policy_loss: weights shape \(2,\) must equal"):
        gspo_policy_loss(_new(), OLD, adv, MASK, weights=torch.ones(2))
    with pytest.raises(ValueError, match=r"^gspo_policy_loss: advantages shape"):
        gspo_policy_loss(_new(), OLD, torch.ones(2), MASK)
