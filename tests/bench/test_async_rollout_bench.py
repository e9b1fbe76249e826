"""bench/async_rollout.py: a row's figures are taken from its run's metrics before the run
directory is deleted, the partial-rollout switched share and the importance-weight statistics
among them, and printed in the row."""

from __future__ import annotations

from typing import Any

from bench.async_rollout import row_line, summarize


def _rows(extra: list[dict[str, float]]) -> list[dict[str, Any]]:
    return [
        {"step": i + 1, "reward_mean": 0.5, "elapsed_seconds": 3.0 + i, "time/step": 1.0, **e}
        for i, e in enumerate(extra)
    ]


def test_a_partial_rollout_row_shows_the_switched_share() -> None:
    rows = _rows([{"rollout/switched_share": s} for s in (0.0, 0.25, 0.5, 0.25)])
    r = summarize(rows, wall=10.0)
    assert r["switched"] == 0.25
    assert r["is_mean"] is r["is_max"] is r["capped"] is None
    line = row_line("async-1-partial", 1, r)
    assert line.split()[-4:] == ["0.250", "-", "-", "-"]


def test_an_importance_sampling_row_shows_the_weight_statistics() -> None:
    rows = _rows(
        [
            {"is/weight_mean": 1.0, "is/weight_max": 1.5, "is/capped_share": 0.0},
            {"is/weight_mean": 1.2, "is/weight_max": 3.0, "is/capped_share": 0.02},
            {},  # (a step without them: not counted)
        ]
    )
    r = summarize(rows, wall=10.0)
    assert r["switched"] is None
    assert abs(r["is_mean"] - 1.1) < 1e-12  # type: ignore[operator]
    assert r["is_max"] == 3.0
    assert r["capped"] == 0.01
    assert row_line("async-1-is", 2, r).split()[-4:] == ["-", "1.100", "3.00", "0.0100"]
