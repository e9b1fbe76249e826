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


def test_each_sync_row_differs_from_its_asynchronous_partner_in_max_staleness_alone() -> None:
    """``sync-critic`` -> ``async-1-is-critic`` and ``sync-split`` -> ``async-1-is``: the same
    placement and objective settings, maxStaleness 0 against 1."""
    from bench.async_rollout import CONFIGS, _config

    for sync, asynchronous in (("sync-critic", "async-1-is-critic"), ("sync-split", "async-1-is")):
        a, b = set(CONFIGS[sync]), set(CONFIGS[asynchronous])
        assert a - b == {"algorithm.maxStaleness=0"}
        assert b - a == {"algorithm.maxStaleness=1"}
        s, x = _config(sync, 1, 5), _config(asynchronous, 1, 5)
        assert (s.algorithm.max_staleness, x.algorithm.max_staleness) == (0, 1)
        assert s.roles == x.roles
        assert s.algorithm.model_copy(update={"max_staleness": 1}) == x.algorithm


def test_the_summary_gives_medians_spreads_and_the_one_thing_pairs_ratios() -> None:
    from bench.async_rollout import summary_lines

    def run(step: int | None, train: float, step_s: float) -> dict[str, float | None]:
        reached = step is not None
        return {
            "step": step,
            "to": train + 8.0 if reached else None,
            "train": train if reached else None,
            "step_s": step_s,
            "final": 1.0,
        }

    results = {}
    for seed, (a, b) in enumerate(((30.0, 20.0), (40.0, 40.0), (50.0, 25.0)), start=1):
        results["sync-critic", seed] = run(260, a, 0.1)
        results["async-1-is-critic", seed] = run(260 if seed != 3 else None, b, 0.08)
    lines = summary_lines(results, ["sync-critic", "async-1-is-critic"], [1, 2, 3])
    row = next(line for line in lines if line.startswith("async-1-is-critic "))
    assert row.split()[1] == "2/3"  # reached 0.9 / seeds
    assert "30.0 [20.0-40.0]" in row  # train s: median [min-max] over the seeds that reached it
    pair = next(line for line in lines if line.startswith("sync-critic -> async-1-is-critic"))
    assert "1.25 [1.00-1.50]" in pair  # train s: 30/20, 40/40
    assert "1.25 [1.25-1.25]" in pair  # step s: 0.1/0.08 on every seed


def test_the_record_holds_the_summarys_medians_under_the_docs_keys() -> None:
    from bench.async_rollout import record_figures

    def run(step: int, train: float) -> dict[str, float | None]:
        return {"step": step, "to": train + 8.0, "train": train, "step_s": 0.1, "final": 0.999}

    results = {}
    for seed, (a, b) in enumerate(((30.0, 20.0), (40.0, 40.0), (50.0, 25.0)), start=1):
        results["sync-critic", seed] = run(260, a)
        results["async-1-is-critic", seed] = run(270, b)
    figures = record_figures(results, ["sync-critic", "async-1-is-critic"], [1, 2, 3])
    assert figures["async-1-is-critic.train_to_0.9"].text == "25.0 s"
    assert figures["async-1-is-critic.steps_to_0.9"].text == "270"
    assert figures["sync-critic.final_last10"].text == "0.999"
    assert figures["ratio.sync-critic_to_async-1-is-critic.train_to_0.9"].text == "1.50"
