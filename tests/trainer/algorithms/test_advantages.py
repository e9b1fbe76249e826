"""GAE, reward shaping and the advantage-estimator registry, against float64 loop references."""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from ppojob_trainer.algorithms import advantages as adv_mod
from ppojob_trainer.algorithms import (
    compute_advantages,
    compute_gae,
    discounted_reverse_cumsum,
    get_advantage_estimator,
    list_advantage_estimators,
    register_advantage_estimator,
    shape_token_rewards,
)

SETTINGS = settings(max_examples=40, deadline=None)


# ------------------------------------------------------------------ references (plain loops)
def ref_gae(rewards, values, mask, gamma, lam):
    B, T = len(rewards), len(rewards[0])
    adv = [[0.0] * T for _ in range(B)]
    ret = [[0.0] * T for _ in range(B)]
    for b in range(B):
        positions = [t for t in range(T) if mask[b][t]]
        next_v, next_a = 0.0, 0.0
        for t in reversed(positions):
            delta = rewards[b][t] + gamma * next_v - values[b][t]
            a = delta + gamma * lam * next_a
            adv[b][t] = a
            ret[b][t] = a + values[b][t]
            next_v, next_a = values[b][t], a
    return adv, ret


def ref_reward_to_go(rewards, mask, gamma):
    out = [[0.0] * len(row) for row in rewards]
    for b, row in enumerate(rewards):
        acc = 0.0
        for t in reversed(range(len(row))):
            if mask[b][t]:
                acc = row[t] + gamma * acc
                out[b][t] = acc
    return out


def ref_whiten(x, mask):
    vals = [x[b][t] for b in range(len(x)) for t in range(len(x[0])) if mask[b][t]]
    mean = sum(vals) / len(vals)
    var = sum((v - mean) ** 2 for v in vals) / len(vals)
    return [
        [(x[b][t] - mean) / math.sqrt(var + 1e-8) if mask[b][t] else 0.0 for t in range(len(x[0]))]
        for b in range(len(x))
    ]


def make_batch(seed, B, T, layout):
    g = torch.Generator().manual_seed(seed)
    rewards = torch.randn(B, T, generator=g, dtype=torch.float64)
    values = torch.randn(B, T, generator=g, dtype=torch.float64)
    if layout == "random":  # interior gaps anywhere
        mask = torch.rand(B, T, generator=g) < 0.6
    else:  # prompt | response | padding
        mask = torch.zeros(B, T, dtype=torch.bool)
        for b in range(B):
            start = int(torch.randint(0, T, (1,), generator=g))
            length = int(torch.randint(0, T - start + 1, (1,), generator=g))
            mask[b, start : start + length] = True
    # garbage off the mask must never matter
    rewards[~mask] = float("nan")
    values[~mask] = float("inf")
    return rewards, values, mask


def nan_to_zero(x):
    return torch.where(torch.isfinite(x), x, torch.zeros_like(x))


# ------------------------------------------------------------------ GAE
@SETTINGS
@given(
    seed=st.integers(0, 2**31 - 1),
    B=st.integers(1, 6),
    T=st.integers(1, 90),
    gamma=st.one_of(st.just(1.0), st.just(0.0), st.floats(0.0, 1.0)),
    lam=st.one_of(st.just(1.0), st.just(0.0), st.floats(0.0, 1.0)),
    layout=st.sampled_from(["random", "contiguous"]),
)
def test_gae_matches_loop_reference(seed, B, T, gamma, lam, layout):
    rewards, values, mask = make_batch(seed, B, T, layout)
    adv, ret = compute_gae(rewards, values, mask.float(), gamma, lam)
    ref_a, ref_r = ref_gae(rewards.tolist(), values.tolist(), mask.tolist(), gamma, lam)
    torch.testing.assert_close(adv, torch.tensor(ref_a, dtype=torch.float64), atol=1e-9, rtol=1e-9)
    torch.testing.assert_close(ret, torch.tensor(ref_r, dtype=torch.float64), atol=1e-9, rtol=1e-9)
    # float32 path agrees within float32 accuracy
    adv32, ret32 = compute_gae(rewards.float(), values.float(), mask, gamma, lam)
    assert adv32.dtype == torch.float32
    torch.testing.assert_close(adv32.double(), adv, atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(ret32.double(), ret, atol=1e-4, rtol=1e-4)
    assert bool((adv[~mask] == 0).all()) and bool((ret[~mask] == 0).all())


@SETTINGS
@given(seed=st.integers(0, 2**31 - 1), B=st.integers(1, 5), T=st.integers(1, 60))
def test_gae_gamma_lambda_one_is_reward_to_go_minus_values(seed, B, T):
    """Documented property: gamma = lam = 1 gives A = sum of future rewards - V on the mask."""
    rewards, values, mask = make_batch(seed, B, T, "random")
    adv, ret = compute_gae(rewards, values, mask, 1.0, 1.0)
    rtg = torch.tensor(
        ref_reward_to_go(nan_to_zero(rewards).tolist(), mask.tolist(), 1.0), dtype=torch.float64
    )
    expected = torch.where(mask, rtg.double() - nan_to_zero(values), torch.zeros(()).double())
    torch.testing.assert_close(adv, expected, atol=1e-9, rtol=1e-9)
    torch.testing.assert_close(ret, torch.where(mask, rtg, torch.zeros(()).double()))


def test_gae_hand_computed():
    # prompt, 3 response tokens, padding; gamma = 0.5, lam = 0.5
    r = torch.tensor([[9.0, 0.0, 0.0, 1.0, 9.0]])
    v = torch.tensor([[9.0, 1.0, 2.0, 3.0, 9.0]])
    m = torch.tensor([[0, 1, 1, 1, 0]])
    adv, ret = compute_gae(r, v, m, 0.5, 0.5)
    # deltas: t3: 1 - 3 = -2; t2: 0 + 0.5*3 - 2 = -0.5; t1: 0 + 0.5*2 - 1 = 0
    # A3 = -2; A2 = -0.5 + 0.25*-2 = -1; A1 = 0 + 0.25*-1 = -0.25
    torch.testing.assert_close(adv, torch.tensor([[0.0, -0.25, -1.0, -2.0, 0.0]]))
    torch.testing.assert_close(ret, torch.tensor([[0.0, 0.75, 1.0, 1.0, 0.0]]))


def test_gae_skips_interior_masked_positions():
    # the gap at index 1 is skipped: token 0 links to token 2
    r = torch.tensor([[0.0, 100.0, 1.0]])
    v = torch.tensor([[0.5, 100.0, 0.25]])
    m = torch.tensor([[1.0, 0.0, 1.0]])
    adv, _ = compute_gae(r, v, m, 1.0, 1.0)
    torch.testing.assert_close(adv, torch.tensor([[0.5, 0.0, 0.75]]))


def test_gae_all_masked_row_is_zero_and_long_sequences():
    B, T = 3, 5000
    g = torch.Generator().manual_seed(0)
    r = torch.randn(B, T, generator=g, dtype=torch.float64)
    v = torch.randn(B, T, generator=g, dtype=torch.float64)
    m = torch.ones(B, T, dtype=torch.bool)
    m[1] = False
    m[2, :100] = False
    adv, ret = compute_gae(r, v, m, 0.999, 0.97)
    ref_a, ref_r = ref_gae(r.tolist(), v.tolist(), m.tolist(), 0.999, 0.97)
    torch.testing.assert_close(adv, torch.tensor(ref_a, dtype=torch.float64))
    torch.testing.assert_close(ret, torch.tensor(ref_r, dtype=torch.float64))
    assert bool((adv[1] == 0).all())


@SETTINGS
@given(
    seed=st.integers(0, 2**31 - 1),
    T=st.integers(0, 300),
    c=st.floats(0.0, 1.0),
    chunk=st.integers(2, 9),
)
def test_discounted_reverse_cumsum_recursion(seed, T, c, chunk):
    x = torch.randn(2, T, generator=torch.Generator().manual_seed(seed), dtype=torch.float64)
    out = discounted_reverse_cumsum(x, c, chunk)
    expected = torch.zeros_like(x)
    for b in range(2):
        acc = 0.0
        for t in reversed(range(T)):
            acc = float(x[b, t]) + c * acc
            expected[b, t] = acc
    torch.testing.assert_close(out, expected, atol=1e-9, rtol=1e-9)


@pytest.mark.parametrize(
    "kwargs, match",
    [
        ({"rewards": torch.zeros(2, 3), "values": torch.zeros(2, 4)}, "values shape"),
        ({"mask": torch.ones(2, 4)}, "rewards shape"),
        (
            {"rewards": torch.zeros(0, 3), "values": torch.zeros(0, 3), "mask": torch.ones(0, 3)},
            "empty",
        ),
        ({"mask": torch.ones(3)}, r"\[B, T\]"),
        ({"gamma": 1.5}, "gamma"),
        ({"lam": -0.1}, "lam"),
        ({"gamma": float("nan")}, "gamma"),
        ({"rewards": torch.tensor([[0.0, float("nan"), 0.0]] * 2)}, "rewards has a non-finite"),
        ({"values": torch.tensor([[0.0, 0.0, float("inf")]] * 2)}, "sample 0, position 2"),
        ({"rewards": torch.zeros(2, 3, dtype=torch.long)}, "floating-point"),
    ],
)
def test_gae_bad_inputs(kwargs, match):
    args = {
        "rewards": torch.zeros(2, 3),
        "values": torch.zeros(2, 3),
        "mask": torch.ones(2, 3),
        "gamma": 1.0,
        "lam": 0.95,
    }
    args.update(kwargs)
    with pytest.raises(ValueError, match=match):
        compute_gae(**args)


# ------------------------------------------------------------------ shaping
@SETTINGS
@given(seed=st.integers(0, 2**31 - 1), B=st.integers(1, 5), T=st.integers(1, 30))
def test_shape_token_rewards_matches_loop(seed, B, T):
    g = torch.Generator().manual_seed(seed)
    mask = torch.rand(B, T, generator=g) < 0.5
    mask[:, int(torch.randint(0, T, (1,), generator=g))] = True  # every row has a token
    scores = torch.randn(B, generator=g, dtype=torch.float64)
    kl = torch.randn(B, T, generator=g, dtype=torch.float64)
    out = shape_token_rewards(scores, mask, kl, kl_coef=0.3)
    expected = torch.zeros(B, T, dtype=torch.float64)
    for b in range(B):
        last = max(t for t in range(T) if mask[b, t])
        for t in range(T):
            if mask[b, t]:
                expected[b, t] = -0.3 * float(kl[b, t]) + (float(scores[b]) if t == last else 0)
    torch.testing.assert_close(out, expected)
    no_kl = shape_token_rewards(scores.float(), mask)
    assert no_kl.dtype == torch.float32
    assert torch.allclose(no_kl.sum(dim=1).double(), scores, atol=1e-6)


def test_shape_token_rewards_errors():
    mask = torch.tensor([[1, 1, 0], [0, 0, 0]])
    with pytest.raises(ValueError, match="sample 1 has no response token"):
        shape_token_rewards(torch.tensor([1.0, 2.0]), mask)
    with pytest.raises(ValueError, match="non-finite value at sample 0"):
        shape_token_rewards(torch.tensor([float("nan")]), torch.ones(1, 2))
    with pytest.raises(ValueError, match=r"shape \(2,\)"):
        shape_token_rewards(torch.tensor([1.0]), torch.ones(2, 2))
    with pytest.raises(ValueError, match="kl_coef"):
        shape_token_rewards(torch.ones(1), torch.ones(1, 2), torch.zeros(1, 2), kl_coef=-1)
    # integer scores are fine: float32 result
    out = shape_token_rewards(torch.tensor([3]), torch.tensor([[0, 1, 1, 0]]))
    assert out.tolist() == [[0.0, 0.0, 3.0, 0.0]]


# ------------------------------------------------------------------ outcome estimators
def ref_groups(scores, group_ids):
    groups = {}
    for i, g in enumerate(group_ids):
        groups.setdefault(g, []).append(scores[i])
    return groups


def ref_grpo(scores, group_ids, norm_by_std, eps):
    groups = ref_groups(scores, group_ids)
    out = []
    for s, g in zip(scores, group_ids, strict=True):
        members = groups[g]
        n = len(members)
        if n == 1:
            out.append(0.0)
            continue
        mean = sum(members) / n
        std = math.sqrt(sum((x - mean) ** 2 for x in members) / (n - 1))
        out.append((s - mean) / (std + eps) if norm_by_std else s - mean)
    return out


def ref_rloo(scores, group_ids):
    groups = ref_groups(scores, group_ids)
    out = []
    for s, g in zip(scores, group_ids, strict=True):
        others = list(groups[g])
        others.remove(s)
        out.append(s - sum(others) / len(others))
    return out


def broadcast(per_sample, mask):
    return [
        [per_sample[b] if mask[b][t] else 0.0 for t in range(len(mask[0]))]
        for b in range(len(mask))
    ]


def outcome_batch(seed, B, T, n_groups, min_group=1):
    g = torch.Generator().manual_seed(seed)
    mask = torch.rand(B, T, generator=g) < 0.7
    mask[:, 0] = True
    scores = torch.randint(0, 3, (B,), generator=g).double() + torch.rand(B, generator=g).double()
    group_ids = torch.randint(0, n_groups, (B,), generator=g)
    if min_group > 1:
        group_ids = torch.arange(B) // min_group
        if B % min_group:
            group_ids[-(B % min_group) :] = group_ids[-(B % min_group) - 1]
    token_rewards = torch.randn(B, T, generator=g, dtype=torch.float64)
    return dict(
        token_rewards=token_rewards, scores=scores, values=None, mask=mask, group_ids=group_ids
    )


@SETTINGS
@given(
    seed=st.integers(0, 2**31 - 1),
    B=st.integers(1, 12),
    T=st.integers(1, 12),
    n_groups=st.integers(1, 4),
    norm_by_std=st.booleans(),
)
def test_grpo_matches_reference(seed, B, T, n_groups, norm_by_std):
    batch = outcome_batch(seed, B, T, n_groups)
    adv, ret = compute_advantages(
        "grpo", **batch, gamma=1.0, lam=1.0, norm_by_std=norm_by_std, eps=1e-6
    )
    ref = ref_grpo(batch["scores"].tolist(), batch["group_ids"].tolist(), norm_by_std, 1e-6)
    expected = torch.tensor(broadcast(ref, batch["mask"].tolist()), dtype=torch.float64)
    torch.testing.assert_close(adv, expected)
    torch.testing.assert_close(ret, expected)


@SETTINGS
@given(
    seed=st.integers(0, 2**31 - 1),
    B=st.integers(2, 12),
    T=st.integers(1, 12),
    size=st.integers(2, 4),
)
def test_rloo_matches_reference(seed, B, T, size):
    batch = outcome_batch(seed, B, T, 1, min_group=min(size, B))
    adv, _ = compute_advantages("rloo", **batch, gamma=1.0, lam=1.0)
    ref = ref_rloo(batch["scores"].tolist(), batch["group_ids"].tolist())
    expected = torch.tensor(broadcast(ref, batch["mask"].tolist()), dtype=torch.float64)
    torch.testing.assert_close(adv, expected)


@SETTINGS
@given(
    seed=st.integers(0, 2**31 - 1), B=st.integers(1, 8), T=st.integers(2, 15), gamma=st.floats(0, 1)
)
def test_reinforce_plus_plus_matches_reference(seed, B, T, gamma):
    batch = outcome_batch(seed, B, T, 2)
    adv, ret = compute_advantages("reinforce_plus_plus", **batch, gamma=gamma, lam=0.3)
    m = batch["mask"].tolist()
    rtg = ref_reward_to_go(batch["token_rewards"].tolist(), m, gamma)
    torch.testing.assert_close(ret, torch.tensor(rtg, dtype=torch.float64))
    torch.testing.assert_close(adv, torch.tensor(ref_whiten(rtg, m), dtype=torch.float64))


@SETTINGS
@given(
    seed=st.integers(0, 2**31 - 1),
    B=st.integers(1, 10),
    T=st.integers(1, 10),
    n_groups=st.integers(1, 3),
)
def test_reinforce_plus_plus_baseline_matches_reference(seed, B, T, n_groups):
    batch = outcome_batch(seed, B, T, n_groups)
    s, gids = batch["scores"].tolist(), batch["group_ids"].tolist()
    groups = ref_groups(s, gids)
    centred = [x - sum(groups[g]) / len(groups[g]) for x, g in zip(s, gids, strict=True)]
    m = batch["mask"].tolist()
    expected = ref_whiten(broadcast(centred, m), m)
    adv, ret = compute_advantages("reinforce_plus_plus_baseline", **batch, gamma=1.0, lam=1.0)
    torch.testing.assert_close(adv, torch.tensor(expected, dtype=torch.float64))
    torch.testing.assert_close(ret, adv)


def test_grpo_hand_computed_and_singletons():
    mask = torch.ones(4, 2)
    scores = torch.tensor([1.0, 0.0, 1.0, 5.0])
    gids = torch.tensor([7, 7, 7, 9])  # group 9 is a singleton
    kwargs = dict(token_rewards=torch.zeros(4, 2), scores=scores, values=None, mask=mask)
    adv, _ = compute_advantages("grpo", **kwargs, group_ids=gids, gamma=1.0, lam=1.0)
    # group 7: mean 2/3, sample std sqrt(1/3)
    std = math.sqrt(1 / 3)
    expected = [(1 / 3) / (std + 1e-6), (-2 / 3) / (std + 1e-6), (1 / 3) / (std + 1e-6), 0.0]
    torch.testing.assert_close(adv[:, 0], torch.tensor(expected))
    # identical scores in a group: advantage 0, not NaN
    adv, _ = compute_advantages(
        "grpo", **{**kwargs, "scores": torch.ones(4)}, group_ids=gids, gamma=1.0, lam=1.0
    )
    assert bool((adv == 0).all())


def test_rloo_hand_computed_and_singleton_error():
    kwargs = dict(token_rewards=torch.zeros(3, 1), values=None, mask=torch.ones(3, 1))
    adv, _ = compute_advantages(
        "rloo",
        **kwargs,
        scores=torch.tensor([3.0, 1.0, 2.0]),
        group_ids=torch.zeros(3, dtype=torch.long),
        gamma=1.0,
        lam=1.0,
    )
    torch.testing.assert_close(adv[:, 0], torch.tensor([1.5, -1.5, 0.0]))
    with pytest.raises(ValueError, match=r"sample 2 \(group id 5\) is alone"):
        compute_advantages(
            "rloo",
            **kwargs,
            scores=torch.ones(3),
            group_ids=torch.tensor([1, 1, 5]),
            gamma=1.0,
            lam=1.0,
        )


def test_gae_estimator_whitens_and_needs_values():
    g = torch.Generator().manual_seed(3)
    r, v = torch.randn(3, 6, generator=g), torch.randn(3, 6, generator=g)
    mask = torch.ones(3, 6)
    mask[0, :2] = 0
    common = dict(token_rewards=r, scores=torch.zeros(3), mask=mask, group_ids=torch.arange(3))
    a_raw, ret_raw = compute_gae(r, v, mask, 0.9, 0.8)
    a, _ = compute_advantages("gae", **common, values=v, gamma=0.9, lam=0.8, whiten=False)
    torch.testing.assert_close(a, a_raw)
    a_w, ret_w = compute_advantages("gae", **common, values=v, gamma=0.9, lam=0.8)
    torch.testing.assert_close(ret_w, ret_raw)
    m = mask.bool()
    assert abs(float(a_w[m].mean())) < 1e-5 and abs(float(a_w[m].std(unbiased=False)) - 1) < 1e-4
    with pytest.raises(ValueError, match="needs critic values"):
        compute_advantages("gae", **common, values=None, gamma=0.9, lam=0.8)


def test_registry_extension_unknown_names_and_options():
    assert {"gae", "grpo", "reinforce_plus_plus", "reinforce_plus_plus_baseline", "rloo"} <= set(
        list_advantage_estimators()
    )
    with pytest.raises(ValueError, match=r"registered: .*grpo"):
        get_advantage_estimator("nope")
    with pytest.raises(ValueError, match="unknown option"):
        compute_advantages(
            "grpo",
            token_rewards=torch.zeros(2, 2),
            scores=torch.zeros(2),
            values=None,
            mask=torch.ones(2, 2),
            group_ids=torch.zeros(2, dtype=torch.long),
            gamma=1.0,
            lam=1.0,
            norm_by_sdt=False,
        )

    @register_advantage_estimator("test_constant")
    def constant(*, token_rewards, mask, scale=1.0, **_):
        out = torch.full_like(token_rewards, scale)
        return out, out

    try:
        adv, _ = compute_advantages(
            "test_constant",
            token_rewards=torch.zeros(1, 3),
            scores=torch.zeros(1),
            values=None,
            mask=torch.tensor([[0, 1, 1]]),
            group_ids=torch.zeros(1, dtype=torch.long),
            gamma=1.0,
            lam=1.0,
            scale=2.0,
        )
        assert adv.tolist() == [[0.0, 2.0, 2.0]]  # zeroed off the mask by the dispatcher
        with pytest.raises(ValueError, match="already registered"):
            register_advantage_estimator("test_constant")(constant)

        @register_advantage_estimator("test_constant", override=True)
        def broken(**_):
            return torch.zeros(2), torch.zeros(1, 3)

        with pytest.raises(ValueError, match=r"advantages must be \[B, T\]"):
            compute_advantages(
                "test_constant",
                token_rewards=torch.zeros(1, 3),
                scores=torch.zeros(1),
                values=None,
                mask=torch.ones(1, 3),
                group_ids=torch.zeros(1, dtype=torch.long),
                gamma=1.0,
                lam=1.0,
            )
    finally:
        adv_mod._REGISTRY.pop("test_constant", None)


def test_dispatcher_rejects_bad_common_inputs():
    base = dict(
        token_rewards=torch.zeros(2, 2),
        scores=torch.zeros(2),
        values=None,
        mask=torch.ones(2, 2),
        group_ids=torch.zeros(2, dtype=torch.long),
        gamma=1.0,
        lam=1.0,
    )
    with pytest.raises(ValueError, match="scores has a non-finite value at sample 1"):
        compute_advantages("grpo", **{**base, "scores": torch.tensor([0.0, float("nan")])})
    with pytest.raises(ValueError, match="integer"):
        compute_advantages("grpo", **{**base, "group_ids": torch.zeros(2)})
    with pytest.raises(ValueError, match="empty batch"):
        compute_advantages(
            "grpo",
            **{
                **base,
                "mask": torch.ones(0, 2),
                "token_rewards": torch.zeros(0, 2),
                "scores": torch.zeros(0),
                "group_ids": torch.zeros(0, dtype=torch.long),
            },
        )
    with pytest.raises(ValueError, match="values shape"):
        compute_advantages("gae", **{**base, "values": torch.zeros(2, 3)})


# ------------------------------------------------------------------ edges mutmut found open
def test_shape_token_rewards_defaults_and_dtype():
    """Without a coefficient the KL is not charged; integer scores give float32 rewards; a
    float64 KL does not change the rewards' dtype."""
    mask = torch.tensor([[1, 1, 0], [0, 1, 1]])
    kl = torch.tensor([[0.5, 0.25, 9.0], [1.0, 2.0, 4.0]], dtype=torch.float64)
    scores = torch.tensor([1, 0])
    r = shape_token_rewards(scores, mask, kl)
    assert r.dtype == torch.float32
    assert r.tolist() == [[0.0, 1.0, 0.0], [0.0, 0.0, 0.0]]
    assert shape_token_rewards(scores, mask).dtype == torch.float32
    r = shape_token_rewards(scores.float(), mask, kl, 0.5)
    assert r.dtype == torch.float32
    assert r.tolist() == [[-0.25, 1.0 - 0.125, 0.0], [0.0, -1.0, -2.0]]


def test_shape_token_rewards_errors_name_the_function_and_argument():
    mask = torch.ones(2, 3, dtype=torch.long)
    cases = [
        (lambda: shape_token_rewards(torch.ones(2), [[1]]), "shape_token_rewards: "),
        (lambda: shape_token_rewards(torch.ones(3), mask), "shape_token_rewards: "),
        (
            lambda: shape_token_rewards(torch.ones(2), mask, torch.zeros(2, 2), 0.1),
            "shape_token_rewards: kl shape",
        ),
    ]
    for make, message in cases:
        with pytest.raises(ValueError) as info:
            make()
        assert str(info.value).startswith(message), str(info.value)


def _common(**over):
    base = dict(
        token_rewards=torch.zeros(2, 3),
        scores=torch.zeros(2),
        values=None,
        mask=torch.ones(2, 3),
        group_ids=torch.zeros(2, dtype=torch.long),
        gamma=1.0,
        lam=1.0,
    )
    return {**base, **over}


def test_advantage_errors_name_the_function_and_argument(monkeypatch):
    monkeypatch.setattr(adv_mod, "_REGISTRY", dict(adv_mod._REGISTRY))
    r = torch.zeros(2, 3)
    mask = torch.ones(2, 3)
    where = "compute_advantages('grpo')"

    @register_advantage_estimator("plain")
    def plain(*, token_rewards, scores, values, mask, group_ids, gamma, lam):
        return token_rewards, token_rewards

    @register_advantage_estimator("three")
    def three(**_):
        return r, r, r

    @register_advantage_estimator("listed")
    def listed(**_):
        return r, [0.0]

    @register_advantage_estimator("flat")
    def flat(**_):
        return torch.zeros(2), r

    @register_advantage_estimator("nan")
    def nan(**_):
        return r, torch.full((2, 3), float("nan"))

    cases = [
        (lambda: compute_gae(r[:, :2], r, mask, 1.0, 1.0), "compute_gae: rewards shape (2, 2)"),
        (lambda: compute_gae(r, r[:, :2], mask, 1.0, 1.0), "compute_gae: values shape (2, 2)"),
        (
            lambda: compute_gae(r, r, [[1.0]], 1.0, 1.0),
            "compute_gae: mask must be a tensor, got list",
        ),
        (
            lambda: compute_gae(r, r, mask, gamma=2, lam=1.0),
            "compute_gae: gamma must be in [0, 1], got 2",
        ),
        (
            lambda: compute_gae(r, r, mask, gamma=1.0, lam=-1),
            "compute_gae: lam must be in [0, 1], got -1",
        ),
        (
            lambda: compute_advantages("grpo", **_common(mask=[1])),
            f"{where}: mask must be a tensor",
        ),
        (
            lambda: compute_advantages("grpo", **_common(token_rewards=r[:, :1])),
            f"{where}: token_rewards shape (2, 1)",
        ),
        (
            lambda: compute_advantages("gae", **_common(values=r[:, :1])),
            "compute_advantages('gae'): values shape (2, 1)",
        ),
        (
            lambda: compute_advantages("grpo", **_common(scores=[0, 0])),
            f"{where}: scores must be a tensor, got list",
        ),
        (
            lambda: compute_advantages("grpo", **_common(group_ids=[0, 0])),
            f"{where}: group_ids must be a tensor, got list",
        ),
        (
            lambda: compute_advantages(
                "grpo", **_common(group_ids=torch.zeros(3, dtype=torch.long))
            ),
            f"{where}: group_ids must have shape (2,), got (3,)",
        ),
        (
            lambda: compute_advantages(
                "grpo", **_common(group_ids=torch.zeros(2, dtype=torch.bool))
            ),
            f"{where}: group_ids must be an integer tensor, got torch.bool",
        ),
        (
            lambda: compute_advantages("grpo", **_common(gamma=1.5)),
            f"{where}: gamma must be in [0, 1], got 1.5",
        ),
        (
            lambda: compute_advantages("grpo", **_common(lam="x")),
            f"{where}: lam must be a number in [0, 1], got 'x'",
        ),
        (
            lambda: compute_advantages("plain", **_common(), extra=1),
            "compute_advantages('plain'): unknown option(s) ['extra']; accepted: none",
        ),
        (
            lambda: compute_advantages("three", **_common()),
            "compute_advantages('three'): estimator must return (advantages, returns), got (",
        ),
        (
            lambda: compute_advantages("listed", **_common()),
            "compute_advantages('listed'): returns must be [B, T] = (2, 3), got list",
        ),
        (
            lambda: compute_advantages("flat", **_common()),
            "compute_advantages('flat'): advantages must be [B, T] = (2, 3), got (2,)",
        ),
        (
            lambda: compute_advantages("nan", **_common()),
            "compute_advantages('nan'): returns has a non-finite value on a response token",
        ),
        (
            lambda: get_advantage_estimator("nope"),
            "unknown advantage estimator 'nope'; registered: flat, gae, grpo, ",
        ),
        (
            lambda: register_advantage_estimator(5),
            "advantage estimator name must be a non-empty string, got 5",
        ),
        (
            lambda: register_advantage_estimator("  "),
            "advantage estimator name must be a non-empty string",
        ),
        (
            lambda: register_advantage_estimator("x")(3),
            "advantage estimator 'x' must be callable, got 3",
        ),
        (
            lambda: discounted_reverse_cumsum(r, 0.5, chunk=1),
            "discounted_reverse_cumsum: chunk must be >= 2, got 1",
        ),
    ]
    for make, message in cases:
        with pytest.raises(ValueError) as info:
            make()
        assert str(info.value).startswith(message), str(info.value)


def test_gae_in_the_rewards_dtype_and_group_estimators_take_integer_scores():
    mask = torch.tensor([[1, 1, 0], [1, 0, 1]])
    rewards = torch.tensor([[0.0, 1.0, 0.0], [0.5, 0.0, 1.0]])
    values = torch.tensor([[0.1, 0.2, 0.3], [0.4, 0.5, 0.6]], dtype=torch.float64)
    adv, ret = compute_gae(rewards, values, mask, gamma=1.0, lam=1.0)
    assert adv.dtype == ret.dtype == torch.float32
    scores = torch.tensor([1, 0, 1, 1])
    batch = _common(
        token_rewards=torch.zeros(4, 2),
        scores=scores,
        mask=torch.ones(4, 2),
        group_ids=torch.tensor([0, 0, 1, 1]),
    )
    adv, _ = compute_advantages("grpo", **batch, norm_by_std=False)
    assert adv.dtype == torch.float32
    assert adv[:, 0].tolist() == [0.5, -0.5, 0.0, 0.0]
    # integer scores take the token rewards' dtype
    for name in ("grpo", "rloo", "reinforce_plus_plus_baseline"):
        wide = {**batch, "token_rewards": torch.zeros(4, 2, dtype=torch.float64)}
        adv, _ = compute_advantages(name, **wide)
        assert adv.dtype == torch.float64, name


def test_inputs_of_the_wrong_kind_are_named() -> None:
    """A list where a tensor belongs, and a tensor of the wrong rank, name the function, the
    argument and what came."""
    from ppojob_trainer.algorithms.advantages import discounted_reverse_cumsum

    mask = torch.ones(2, 3)
    with pytest.raises(ValueError, match=r"^compute_gae: rewards must be a tensor, got list$"):
        compute_gae([[0.0] * 3] * 2, torch.zeros(2, 3), mask, 1.0, 1.0)
    with pytest.raises(
        ValueError, match=r"^discounted_reverse_cumsum: x must be \[B, T\], got \(3,\)$"
    ):
        discounted_reverse_cumsum(torch.zeros(3), 0.9)
