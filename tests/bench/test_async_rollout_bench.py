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


def test_the_split_critic_row_gives_actor_critic_and_engine_a_process_each_on_2_cpus() -> None:
    """``async-1-is-critic``: ``async-1-is`` with the critic in a process of its own; the three
    processes' logical CPUs fit the 2-CPU local Ray, one torch thread each."""
    from bench.async_rollout import _config

    base, split = _config("async-1-is", 1, 5), _config("async-1-is-critic", 1, 5)
    roles = split.roles
    critic = roles.effective_critic(split.algorithm.needs_critic)
    assert critic is not None and not critic.colocate_with_actor
    assert not roles.rollout.colocate_with_actor
    cpus = [roles.actor.resources.cpus, critic.resources.cpus, roles.rollout.resources.cpus]
    assert sum(cpus) <= 2
    assert [max(1, round(c)) for c in cpus] == [1, 1, 1]  # the loop's threads per process
    assert split.algorithm == base.algorithm  # the same objective and staleness
