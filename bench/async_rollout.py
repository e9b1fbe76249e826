"""Synchronous vs bounded-staleness (asynchronous) training on the CPU count-up task: wall time
to reward 0.9 and final reward, same seeds.

Trains examples/ppojob-tiny.yaml as `ppojob run` does (``train_locally``; one local Ray for all
runs, started once) for each seed and configuration, reads the run's `metrics.jsonl` and prints
one row per run:

``sync``        the example as written: actor, critic and engine in one worker process with
                both cores, maxStaleness 0 (today's loop; what `ppojob run` does by default)
``sync-split``  maxStaleness 0 with the engine in a process of its own (actor 1 core, engine
                1 core): the same placement as the asynchronous runs, without the overlap,
                and ``async-1-is``'s importanceSampling setting (accepted at staleness 0,
                where it weighs each token by pi_old / pi_engine: the engine's and the actor's
                log-prob mismatch alone, weights near 1; ``is w``, ``is max`` and ``capped``
                show how near), so that it differs from ``async-1-is`` in maxStaleness alone
``sync-critic``  ``async-1-is-critic``'s placement (critic and engine apart) and
                importanceSampling setting with maxStaleness 0: differs from
                ``async-1-is-critic`` in maxStaleness alone
``async-1``     that placement with algorithm.maxStaleness 1: the engine generates step k+1
                while the actor trains on step k
``async-2``     the same with maxStaleness 2
``async-1-partial``  maxStaleness 1 with algorithm.partialRollout: a weight sync reaches the
                generation in flight, which samples its remaining tokens with the new weights
``async-1-is``  maxStaleness 1 with the decoupled PPO objective's token-level truncated
                importance weights (cap 2)
``async-1-is-critic``  ``async-1-is`` with the critic in a process of its own as well
                (``roles.critic.colocateWithActor: false``; actor 1 logical CPU, critic and
                engine 0.5 each, one thread per process): the critic's values run beside the
                actor's log-probs (the actor fetches them only after its log-probs) and its
                update beside the actor's; three processes share the 2 cores. Measured
                2026-12-02, ``--seeds 1 --configs async-1-is-critic sync`` (load 3.3 -> 2.7):
                0.9 at step 257 in 21.3 s of training, median step 0.081 s, final 1.000;
                sync step 271, 51.1 s (other load; 28.7 s in its quietest run that day),
                0.112 s, 0.999: 1.38x the step speed. Seeds 2 and 3 (load 1.8-2.8):
                22.8 vs 32.5 s and 26.1 vs 36.8 s of training to 0.9 (1.43x, 1.41x; 1.23x,
                1.22x with start-up), same final rewards. At load 5-8 it is slower than
                ``async-1-is`` (0.150 against 0.136 s): it needs idle cores (README)

Rows that differ by one thing (the summary prints the median of their per-seed ratios):
``sync-split`` -> ``async-1-is`` and ``sync-critic`` -> ``async-1-is-critic``: asynchrony
(maxStaleness 0 -> 1) with the critic in the actor's process, and apart; ``sync-split`` ->
``async-1``: asynchrony without the correction (maxStaleness and importanceSampling);
``sync-split`` -> ``sync-critic`` and ``async-1-is`` -> ``async-1-is-critic``: the critic apart
(sync, async). ``sync`` -> ``sync-split`` (the engine apart) and ``sync`` -> ``sync-critic``
(the three-process layout) change the placement and, with it, the importanceSampling setting
at staleness 0 (the mismatch correction only). ``sync`` -> ``async-1-is-critic`` changes all of
it at once (the README's earlier 1.48x), and its ratio is the product of ``sync`` ->
``sync-critic`` and ``sync-critic`` -> ``async-1-is-critic``.

Method: every run trains the example's full ``--steps`` (500) steps with the same seed per row
pair. Time to 0.9: the step whose 10-step trailing mean reward first reaches 0.9 and stays there
for 10 steps (``bench/time_to_reward.py``'s criterion); ``to 0.9 s`` is its ``elapsed_seconds``
(from the start of the run: Ray, placement and model start-up included), ``train s`` the same
minus the start-up (elapsed at step 1 minus step 1's own time). Final reward: the mean reward of
the last 10 steps. ``step s``: the median step time (steps 4 on; robust to other load);
``overlap`` and ``stale``: the mean over steps of ``time/overlap_share`` and ``staleness/mean``;
``switch`` (partial rollout): the mean over steps of ``rollout/switched_share``, the share of a
step's samples whose tokens came from more than one policy version; ``is w``, ``is max``,
``capped`` (importance sampling): the mean over steps of ``is/weight_mean`` (the raw token
weight's mean), the largest ``is/weight_max`` of the run and the mean of ``is/capped_share`` (a
dash: the row does not have them). Speed-ups are the sync row's seconds over the row's, per
seed, then averaged; ``mean step time`` compares the median step times. The summary then gives,
per configuration over the seeds, the median and [min-max] of the step to 0.9, ``train s``,
``to 0.9 s``, the median step time and the final reward, and for each one-thing pair the median
and [min-max] of the per-seed ratios base / changed of steps, ``train s``, ``to 0.9 s`` and
``step s`` (above 1: the change helps).
A run whose local Ray fails to start (an overloaded machine) is retried.
The machine's 2 cores are shared with whatever else runs (the figures say so when it did):
compare rows of one invocation, not figures across machines.

Usage: python bench/async_rollout.py [--seeds 1 2 3 4 5] [--configs sync sync-split
       sync-critic async-1 async-2 async-1-is async-1-is-critic ...]
       [--steps 500]

On a machine too loaded to train 500 steps per configuration, ``--steps 40`` still compares step
times and the reward curves' start (time to 0.9 then reads "never").
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import yaml

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from bench.records import Figure, add_record_arguments, write_record
from bench.time_to_reward import EXAMPLE, crossing

SPLIT = (
    "roles.rollout.colocateWithActor=false",
    "roles.rollout.resources.cpus=1",
    "roles.actor.resources.cpus=1",
)
SPLIT_CRITIC = (
    "roles.rollout.colocateWithActor=false",
    "roles.rollout.resources.cpus=0.5",
    "roles.actor.resources.cpus=1",
    "roles.critic.colocateWithActor=false",
    "roles.critic.resources.cpus=0.5",
)
CONFIGS: dict[str, tuple[str, ...]] = {
    "sync": (),
    "sync-split": (
        *SPLIT,
        "algorithm.maxStaleness=0",
        "algorithm.importanceSampling={level: token, mode: truncate, cap: 2.0}",
    ),
    "sync-critic": (
        *SPLIT_CRITIC,
        "algorithm.maxStaleness=0",
        "algorithm.importanceSampling={level: token, mode: truncate, cap: 2.0}",
    ),
    "async-1": (*SPLIT, "algorithm.maxStaleness=1"),
    "async-2": (*SPLIT, "algorithm.maxStaleness=2"),
    "async-1-partial": (*SPLIT, "algorithm.maxStaleness=1", "algorithm.partialRollout=true"),
    "async-1-is": (
        *SPLIT,
        "algorithm.maxStaleness=1",
        "algorithm.importanceSampling={level: token, mode: truncate, cap: 2.0}",
    ),
    "async-1-is-critic": (
        *SPLIT_CRITIC,
        "algorithm.maxStaleness=1",
        "algorithm.importanceSampling={level: token, mode: truncate, cap: 2.0}",
    ),
}
THRESHOLD, WINDOW, HOLD, LAST = 0.9, 10, 10, 10


def _config(config: str, seed: int, steps: int) -> Any:
    """The example with the row's settings (what `ppojob run --set ...` would train)."""
    from ppojob_trainer.manifest import config_from_doc

    doc = yaml.safe_load(EXAMPLE.read_text())
    doc["spec"]["training"].update(seed=seed, steps=steps)
    for setting in CONFIGS[config]:
        path, value = setting.split("=", 1)
        node = doc["spec"]
        *parents, leaf = path.split(".")
        for key in parents:
            node = node.setdefault(key, {})
        node[leaf] = yaml.safe_load(value)
    return config_from_doc(doc)


def run_one(config: str, seed: int, steps: int, out: Path) -> dict[str, float | None]:
    from ppojob_trainer.run_cmd import train_locally

    start = time.perf_counter()
    code = train_locally(_config(config, seed, steps), out, show_bar=False)
    wall = time.perf_counter() - start
    if code != 0:
        raise SystemExit(f"{config} seed {seed} failed (exit code {code})")
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    return summarize(rows, wall)


def summarize(rows: list[dict[str, Any]], wall: float) -> dict[str, float | None]:
    """One row's figures from its run's metrics.jsonl records (the run directory is deleted
    afterwards: every figure a row shows is taken here)."""
    rewards = [r["reward_mean"] for r in rows]
    at = crossing(rewards, THRESHOLD, WINDOW, HOLD)
    setup = rows[0]["elapsed_seconds"] - rows[0]["time/step"]
    to = rows[at]["elapsed_seconds"] if at is not None else None
    return {
        "step": rows[at]["step"] if at is not None else None,
        "to": to,
        "train": to - setup if to is not None else None,
        "final": sum(rewards[-LAST:]) / len(rewards[-LAST:]),
        "step_s": statistics.median([r["time/step"] for r in (rows[3:] or rows)]),
        "overlap": sum(r.get("time/overlap_share", 0.0) for r in rows) / len(rows),
        "stale": sum(r.get("staleness/mean", 0.0) for r in rows) / len(rows),
        "wall": wall,
        # partial rollout: the share of samples whose tokens span versions (mean over steps)
        "switched": _mean(rows, "rollout/switched_share"),
        # importance sampling: the mean raw weight, the largest one, the share capped
        "is_mean": _mean(rows, "is/weight_mean"),
        "is_max": max((r["is/weight_max"] for r in rows if "is/weight_max" in r), default=None),
        "capped": _mean(rows, "is/capped_share"),
    }


def _mean(rows: list[dict[str, Any]], key: str) -> float | None:
    """The mean of ``key`` over the steps that report it (None when none does)."""
    values = [r[key] for r in rows if key in r]
    return sum(values) / len(values) if values else None


def _fmt(x: float | None, spec: str = "7.1f", none: str = "never") -> str:
    return none if x is None else format(x, spec)


def row_line(config: str, seed: int, r: dict[str, float | None]) -> str:
    """The printed row of one run (a dash: a figure the row does not have)."""
    return (
        f"{config:17} {seed:>4} {_fmt(r['step'], '5d') if r['step'] else 'never':>5} "
        f"{_fmt(r['to'], '8.1f'):>8} {_fmt(r['train'], '8.1f'):>8} "
        f"{r['final']:6.3f} {r['step_s']:7.3f} {r['overlap']:7.2f} "
        f"{r['stale']:5.2f} {r['wall']:7.1f} {_fmt(r['switched'], '6.3f', '-'):>6} "
        f"{_fmt(r['is_mean'], '5.3f', '-'):>5} {_fmt(r['is_max'], '7.2f', '-'):>7} "
        f"{_fmt(r['capped'], '6.4f', '-'):>6}"
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seeds", type=int, nargs="+", default=[1, 2, 3, 4, 5])
    parser.add_argument("--configs", nargs="+", default=list(CONFIGS), choices=list(CONFIGS))
    parser.add_argument("--steps", type=int, default=500)
    add_record_arguments(parser, "async_rollout")
    args = parser.parse_args()
    load = os.getloadavg()[0]
    print(
        f"count-up, tiny-llama, {args.steps} steps, reward {THRESHOLD} held by the {WINDOW}-step "
        f"trailing mean for {HOLD} steps; {os.cpu_count()} CPUs, load average {load:.1f} at start"
    )
    print(
        f"{'config':17} {'seed':>4} {'step':>5} {'to 0.9 s':>8} {'train s':>8} {'final':>6} "
        f"{'step s':>7} {'overlap':>7} {'stale':>5} {'wall s':>7} {'switch':>6} {'is w':>5} "
        f"{'is max':>7} {'capped':>6}"
    )
    from ppojob_trainer.runtime import shutdown_ray, start_local_ray

    for _attempt in range(5):  # one local Ray for every run; a loaded machine may time it out
        try:
            start_local_ray()
            break
        except Exception as exc:  # Ray's start-up timeout on an overloaded machine
            print(f"local Ray did not start ({exc}); again", flush=True)
            shutdown_ray()
    results: dict[tuple[str, int], dict[str, float | None]] = {}
    with tempfile.TemporaryDirectory() as tmp:
        for seed in args.seeds:
            for config in args.configs:
                r = run_one(config, seed, args.steps, Path(tmp) / f"{config}-{seed}")
                results[config, seed] = r
                print(row_line(config, seed, r), flush=True)
    end = os.getloadavg()[0]
    print(f"load average at the end {end:.1f}")
    for line in summary_lines(results, args.configs, args.seeds):
        print(line)
    if args.record:
        note = args.load or f"load average {load:.1f} at the start, {end:.1f} at the end"
        write_record(args.record, record_figures(results, args.configs, args.seeds), load=note)


# The pairs of rows that differ by one thing (base, changed, what changes). ``sync-split`` and
# ``sync-critic`` carry async-1-is's importanceSampling setting at staleness 0 (there it weighs
# each token by pi_old / pi_engine, the engine's and the actor's log-prob mismatch alone: the
# rows' ``is w``, ``is max`` and ``capped`` show how far from 1), so that each is one key
# (maxStaleness) from its asynchronous partner; against ``sync`` they change the layout and
# that setting.
PAIRS: tuple[tuple[str, str, str], ...] = (
    ("sync", "sync-split", "engine apart (+IS at staleness 0)"),
    ("sync-split", "async-1-is", "asynchrony, critic with the actor"),
    ("sync-split", "async-1", "asynchrony without IS"),
    ("sync-critic", "async-1-is-critic", "asynchrony, critic apart"),
    ("sync", "sync-critic", "the layout (+IS at staleness 0)"),
    ("sync-split", "sync-critic", "critic apart, sync"),
    ("async-1-is", "async-1-is-critic", "critic apart, async"),
    ("sync", "async-1-is-critic", "all of it (the earlier 1.48x)"),
)
SUMMARY_KEYS = (
    ("step", "step to 0.9", ".0f"),
    ("train", "train s", ".1f"),
    ("to", "to 0.9 s", ".1f"),
    ("step_s", "step s", ".3f"),
    ("final", "final", ".3f"),
)


def _spread(values: list[float], spec: str) -> str:
    """``median [min-max]`` of the values (``never`` when there are none)."""
    if not values:
        return "never"
    lo, hi = min(values), max(values)
    return f"{format(statistics.median(values), spec)} [{format(lo, spec)}-{format(hi, spec)}]"


def summary_lines(
    results: dict[tuple[str, int], dict[str, float | None]],
    configs: list[str],
    seeds: list[int],
) -> list[str]:
    """Per configuration over the seeds, the median and [min-max] of the step and the seconds to
    0.9 (training alone, and with start-up), the median step time and the final reward (a seed
    that never reached 0.9 is left out of those and counted); then, for each pair of rows that
    differ by one thing (``PAIRS``), the median and [min-max] of the per-seed ratios base /
    changed (above 1: the change is faster, or, for steps, needs fewer); then the mean
    speed-ups over ``sync`` as before."""
    lines = [f"medians [min-max] over seeds {' '.join(map(str, seeds))}:"]
    lines.append(
        f"{'config':17} {'n':>3} " + " ".join(f"{name:>20}" for _, name, _ in SUMMARY_KEYS)
    )
    for config in configs:
        runs = [results[config, s] for s in seeds if (config, s) in results]
        reached = sum(r["step"] is not None for r in runs)
        cells = []
        for key, _, spec in SUMMARY_KEYS:
            values = [float(r[key]) for r in runs if r[key] is not None]  # type: ignore[arg-type]
            cells.append(f"{_spread(values, spec):>20}")
        lines.append(f"{config:17} {reached}/{len(runs)} " + " ".join(cells))
    lines.append("one-thing pairs, median [min-max] of the per-seed ratios base / changed:")
    lines.append(
        f"{'base -> changed':38} {'what':34} {'n':>2} {'steps':>17} {'train s':>17} "
        f"{'to 0.9 s':>17} {'step s':>17}"
    )
    for base, changed, what in PAIRS:
        if base not in configs or changed not in configs:
            continue
        cells = []
        counts = []
        for key in ("step", "train", "to", "step_s"):
            ratios = [
                results[base, s][key] / results[changed, s][key]  # type: ignore[operator]
                for s in seeds
                if results[base, s][key] and results[changed, s][key]
            ]
            counts.append(len(ratios))
            cells.append(f"{_spread(ratios, '.2f'):>17}")
        lines.append(f"{base + ' -> ' + changed:38} {what:34} {min(counts):>2} " + " ".join(cells))
    if "sync" not in configs:
        return lines
    for config in configs:
        if config == "sync":
            continue
        for key, name in (("to", "to 0.9 (start-up included)"), ("train", "training to 0.9")):
            ratios = [
                results["sync", s][key] / results[config, s][key]  # type: ignore[operator]
                for s in seeds
                if results["sync", s][key] and results[config, s][key]
            ]
            if ratios:
                mean = sum(ratios) / len(ratios)
                lines.append(f"{config}: {name} {mean:.2f}x the sync speed ({len(ratios)} seed(s))")
        steps = [results["sync", s]["step_s"] / results[config, s]["step_s"] for s in seeds]  # type: ignore[operator]
        lines.append(
            f"{config}: median step time {sum(steps) / len(steps):.2f}x the sync speed "
            f"({len(steps)} seed(s))"
        )
        finals = [results[config, s]["final"] - results["sync", s]["final"] for s in seeds]  # type: ignore[operator]
        lines.append(
            f"{config}: final reward {sum(finals) / len(finals):+.3f} vs sync (mean over seeds)"
        )
    return lines


# the summary's columns as record figures: (key, unit, decimals, unit printed in the docs' tables)
RECORD_KEYS = {
    "step": ("steps_to_0.9", "steps", 0, False),
    "train": ("train_to_0.9", "s", 1, True),
    "to": ("to_0.9_with_startup", "s", 1, True),
    "step_s": ("median_step", "s", 3, True),
    "final": ("final_last10", "", 3, True),
}
RATIO_KEYS = {
    "step": "steps_to_0.9",
    "train": "train_to_0.9",
    "to": "with_startup",
    "step_s": "median_step",
}


def record_figures(
    results: dict[tuple[str, int], dict[str, float | None]],
    configs: list[str],
    seeds: list[int],
) -> dict[str, Figure]:
    """The medians :func:`summary_lines` prints, as record figures: ``<config>.<key>`` and
    ``ratio.<base>_to_<changed>.<key>`` (the one-thing pairs' per-seed ratios)."""
    figures: dict[str, Figure] = {}
    for config in configs:
        runs = [results[config, s] for s in seeds if (config, s) in results]
        for key, (name, unit, digits, shown) in RECORD_KEYS.items():
            values = [float(r[key]) for r in runs if r[key] is not None]  # type: ignore[arg-type]
            if values:
                median = statistics.median(values)
                figures[f"{config}.{name}"] = Figure(median, unit, digits, unit_shown=shown)
    for base, changed, _ in PAIRS:
        if base not in configs or changed not in configs:
            continue
        for key, name in RATIO_KEYS.items():
            ratios = [
                results[base, s][key] / results[changed, s][key]  # type: ignore[operator]
                for s in seeds
                if results[base, s][key] and results[changed, s][key]
            ]
            if ratios:
                figures[f"ratio.{base}_to_{changed}.{name}"] = Figure(
                    statistics.median(ratios), "", 2
                )
    return figures


if __name__ == "__main__":
    main()
