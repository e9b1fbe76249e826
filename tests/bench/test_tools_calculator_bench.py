"""bench/tools_calculator.py: a window's figures are per-step means averaged over its steps,
and its shares of calls are weighted by the calls (none: no share), from the run's metrics."""

from __future__ import annotations

from bench.tools_calculator import row_line, window


def _step(reward: float, calls: float, exact: float, digit: float) -> dict[str, float]:
    return {
        "reward_mean": reward,
        "agent/env/calls_mean": calls,
        "agent/env/exact_calls_mean": exact,
        "agent/env/digit_calls_mean": digit,
        "agent/turns_mean": 1.0 + calls,
    }


def test_shares_are_weighted_by_the_calls_of_each_step() -> None:
    # step 1: a quarter of the samples call, all with the right sum; step 2: three quarters
    # call, a third of them right: 0.5 of the window's calls are right
    w = window([_step(0.2, 0.25, 0.25, 0.25), _step(0.4, 0.75, 0.25, 0.5)])
    assert abs(w["reward"] - 0.3) < 1e-12  # type: ignore[operator]
    assert w["calls"] == 0.5 and w["exact"] == 0.5 and w["digit"] == 0.75
    assert w["turns"] == 1.5


def test_a_window_without_calls_has_no_share() -> None:
    w = window([{"reward_mean": 0.1, "agent/turns_mean": 1.0}])  # (no calculator metrics)
    assert w["calls"] == 0.0 and w["exact"] is None and w["digit"] is None
    line = row_line(3, "last 25", w)
    assert line.startswith("seed 3  last 25") and "exact -  digit -" in line
