"""Bounded staleness and the decoupled PPO objective (issue 24), on fixed tensors: importance
weights (token/sequence level, truncated/masked) against their formulas computed here in plain
Python, the policy loss they weigh, per-token staleness, and the admission window of generation
driven through a deterministic simulation of the loop's schedule."""

from __future__ import annotations

import math

import pytest
import torch

from ppojob_trainer.algorithms import (
    StalenessError,
    generation_window,
    importance_weights,
    interval_overlap,
    policy_loss,
    staleness_stats,
)

# two samples, four positions; sample 1 has three response tokens
OLD = [[-0.5, -1.0, -2.0, -0.3], [-1.5, -0.2, -0.9, 0.0]]
BEHAVIOUR = [[-1.4, -0.9, -2.5, -0.3], [-0.7, -0.6, -1.0, 0.0]]
MASK = [[1, 1, 1, 1], [1, 1, 1, 0]]


def _expected(level: str, mode: str, cap: float) -> list[list[float]]:
    out = []
    for old, beh, mask in zip(OLD, BEHAVIOUR, MASK, strict=True):
        seq = math.exp(sum(o - b for o, b, m in zip(old, beh, mask, strict=True) if m))
        row = []
        for o, b, m in zip(old, beh, mask, strict=True):
            w = seq if level == "sequence" else math.exp(o - b)
            if mode == "truncate":
                w = min(w, cap)
            elif w > cap:
                w = 0.0
            row.append(w if m else 0.0)
        out.append(row)
    return out


@pytest.mark.parametrize("level", ["token", "sequence"])
@pytest.mark.parametrize("mode", ["truncate", "mask"])
def test_importance_weights_follow_their_formula(level: str, mode: str) -> None:
    cap = 1.5
    w, stats = importance_weights(
        torch.tensor(OLD),
        torch.tensor(BEHAVIOUR),
        torch.tensor(MASK),
        level=level,
        mode=mode,
        cap=cap,
    )
    expected = _expected(level, mode, cap)
    assert torch.allclose(w, torch.tensor(expected), atol=1e-6)
    raw = _expected(level, "truncate", float("inf"))
    tokens = [
        r for row, mrow in zip(raw, MASK, strict=True) for r, m in zip(row, mrow, strict=True) if m
    ]
    assert stats["is_tokens"] == len(tokens) == 7
    assert stats["is_raw_sum"] == pytest.approx(sum(tokens), rel=1e-6)
    assert stats["is_raw_max"] == pytest.approx(max(tokens), rel=1e-6)
    assert stats["is_capped"] == sum(t > cap for t in tokens)
    assert 0 < stats["is_capped"] < len(tokens)  # the fixture exercises both sides of the cap


def test_a_huge_sequence_ratio_stays_finite() -> None:
    old = torch.zeros(1, 60)
    beh = torch.full((1, 60), -1.0)  # sum of log-ratios 60: e^60 would be clamped at e^20
    w, stats = importance_weights(
        old, beh, torch.ones(1, 60), level="sequence", mode="mask", cap=10
    )
    assert torch.all(w == 0) and math.isfinite(stats["is_raw_max"])
    assert stats["is_raw_max"] == pytest.approx(math.exp(20), rel=1e-5)


def test_the_decoupled_objective_weighs_the_clipped_surrogate() -> None:
    """loss = mean over tokens of w * max(-A r, -A clip(r, 1-eps, 1+eps)), r = pi_theta / pi_old
    (the proximal policy), w = pi_old / pi_behaviour truncated: computed here token by token."""
    new = [[-0.2, -1.3, -1.9, -0.1], [-1.0, -0.1, -1.2, 0.0]]
    adv = [[1.0, -0.5, 2.0, -1.0], [0.3, 1.2, -0.7, 0.0]]
    eps, cap = 0.2, 1.5
    weights = _expected("token", "truncate", cap)
    total, count = 0.0, 0
    for i in range(2):
        for t in range(4):
            if not MASK[i][t]:
                continue
            r = math.exp(new[i][t] - OLD[i][t])
            a = adv[i][t]
            total += weights[i][t] * max(-a * r, -a * min(max(r, 1 - eps), 1 + eps))
            count += 1
    mask = torch.tensor(MASK).bool()
    w, _ = importance_weights(
        torch.tensor(OLD), torch.tensor(BEHAVIOUR), mask, level="token", mode="truncate", cap=cap
    )
    loss, metrics = policy_loss(
        torch.tensor(new), torch.tensor(OLD), torch.tensor(adv), mask, eps, eps, weights=w
    )
    assert float(loss) == pytest.approx(total / count, rel=1e-6)
    assert float(metrics["is_weight_mean"]) == pytest.approx(
        sum(sum(r) for r in weights) / count, rel=1e-6
    )


def test_staleness_is_counted_per_token_and_a_stale_token_is_refused() -> None:
    versions = torch.tensor([[3, 3, 4, 4], [2, 2, 2, 9]], dtype=torch.int32)
    mask = torch.tensor([[1, 1, 1, 0], [1, 1, 1, 0]])
    stats = staleness_stats(versions, mask, current=4, bound=2)
    assert stats["staleness_hist_0"] == 1 and stats["staleness_hist_1"] == 2
    assert stats["staleness_hist_2"] == 3
    assert stats["staleness_sum"] == 8 and stats["staleness_max"] == 2
    with pytest.raises(StalenessError, match="3 policy versions old, more than maxStaleness 2"):
        staleness_stats(versions, mask, current=5, bound=2)


def test_interval_overlap_counts_the_union_once() -> None:
    assert interval_overlap((0.0, 10.0), [(-2.0, 1.0), (2.0, 5.0), (4.0, 6.0), (9.0, 12.0)]) == 6.0
    assert interval_overlap((0.0, 1.0), [(2.0, 3.0)]) == 0.0


def _simulate(bound: int, total: int, syncs_on: set[int]) -> dict[int, int]:
    """The loop's schedule without Ray, as the loop runs it: at each step's start the window's
    generation is queued behind the engine's last sync (so it samples with the version the
    actor holds then), the step trains on its own samples (the actor refuses any token older
    than the bound), and steps in ``syncs_on`` end with a weight sync. Returns the version
    each step's samples were generated with; launching a step twice, training one never
    launched, or launching one that is never trained fails."""
    version, launched, gen_version, trained = 0, 0, {}, []
    for step in range(total):
        window = generation_window(step, launched, bound, total)
        for j in window:
            assert j not in gen_version, f"step {j} launched twice"
            gen_version[j] = version
        launched = max(launched, window.stop)
        assert launched <= step + bound + 1, "generation launched beyond the admission window"
        stats = staleness_stats(
            torch.full((1, 2), gen_version[step], dtype=torch.int32),
            torch.ones(1, 2),
            version,
            bound,
        )
        trained.append(int(stats["staleness_max"]))
        if step in syncs_on:
            version += 1
    assert sorted(gen_version) == list(range(total)), "finished generation was discarded"
    return gen_version


@pytest.mark.parametrize("bound", [0, 1, 2, 3])
def test_admission_window_keeps_every_sample_within_the_bound(bound: int) -> None:
    total = 9
    every = _simulate(bound, total, set(range(total)))
    # staleness is exactly the bound once the pipeline is full, never more
    assert [every[j] for j in range(total)] == [max(0, j - bound) for j in range(total)]
    # steps that do not sync (the actor not training: critic warm-up) keep samples fresher
    warm = _simulate(bound, total, {4, 5, 6, 7, 8})
    assert all(warm[j] <= every[j] for j in range(total))


def test_generation_waits_outside_the_window_and_never_runs_past_the_end() -> None:
    assert list(generation_window(0, 0, 2, None)) == [0, 1, 2]
    assert list(generation_window(1, 3, 2, None)) == [3]  # one more: the rest is in flight
    assert list(generation_window(5, 8, 2, 7)) == []  # the run ends at step 7
    assert list(generation_window(4, 0, 0, None)) == [4]  # resumed at step 4, synchronous
