"""Wall time until the tiny example's smoothed mean reward reaches a threshold, PPO and GRPO.

Runs `ppojob run examples/ppojob-tiny.yaml` for each seed and mode (a fresh process and local Ray
each time), reads `metrics.jsonl` and prints, per run, the step at which the reward curve reached
the threshold, the training time until then (`elapsed_seconds` of that step, from the start of
training: Ray start-up, placement and model start-up included) and the whole process's wall time.

Method: one step's mean reward is noisy (128 samples), so a single lucky step does not count.
The curve is smoothed with a trailing moving average over ``--window`` steps (default 10: step s
averages steps s-9..s; no value before a full window), and the step reported is the first s
whose smoothed reward is >= the threshold and stays >= it for ``--hold`` consecutive steps
(default 10: s..s+9). For comparison the table also shows the first single step whose raw mean
reward reached the threshold (the old figure).

Where the run ends matters as much as how fast it gets there: ``last50`` is the mean of the raw
per-step mean reward over the last ``--last`` steps (default 50) of the run, i.e. steps 451-500
of the 500-step example (each step 128 samples, so 6,400 samples). A run that peaks and then
collapses shows a high crossing and a low last50. The closing lines give, per mode, the slowest
seed's time to the threshold and the lowest seed's last50 against ``--min-last`` (default 0.95).
``--stop`` cuts runs short, so it leaves last50 out.

Usage: python bench/time_to_reward.py [--seeds 1 2 3 4 5] [--modes gae grpo] [--threshold 0.9]
       [--window 10] [--hold 10] [--last 50] [--min-last 0.95] [--stop] [--set KEY=VALUE ...]

`--set` passes spec overrides to every run (as `ppojob run --set`), to compare a setting
against the example as written (e.g. `--set training.lrScheduler=constant`).

`--stop` interrupts each run (SIGINT, a clean stop) once the criterion is met (``--hold`` steps
after the crossing) instead of training all 500 steps: the figures are the same, the bench
takes a fraction of the time.
"""

from __future__ import annotations

import argparse
import json
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
EXAMPLE = ROOT / "examples" / "ppojob-tiny.yaml"
GOALS = {"gae": 180.0, "grpo": 90.0}


def smoothed(rewards: list[float], window: int) -> list[float | None]:
    """Trailing moving average: entry s is the mean of ``rewards[s - window + 1 : s + 1]``,
    None before the first full window."""
    out: list[float | None] = []
    for s in range(len(rewards)):
        out.append(None if s + 1 < window else sum(rewards[s + 1 - window : s + 1]) / window)
    return out


def crossing(rewards: list[float], threshold: float, window: int, hold: int) -> int | None:
    """Index of the first step whose smoothed reward is >= ``threshold`` for ``hold``
    consecutive steps starting there; None if the curve does not (yet) do so."""
    above = [v is not None and v >= threshold for v in smoothed(rewards, window)]
    return next(
        (s for s in range(len(above) - hold + 1) if all(above[s : s + hold])),
        None,
    )


def last_mean(rewards: list[float], last: int) -> float | None:
    """Mean of the last ``last`` entries of ``rewards``; None when there are fewer."""
    if last < 1 or len(rewards) < last:
        return None
    return sum(rewards[-last:]) / last


def _rows(out: Path) -> list[dict]:
    path = out / "metrics.jsonl"
    if not path.exists():
        return []
    rows = []
    for line in path.read_text().splitlines():
        try:
            rows.append(json.loads(line))
        except ValueError:  # a line being written
            break
    return rows


def run_command(out: Path, seed: int, *sets: str, steps: int | None = None) -> list[str]:
    """`ppojob run` of the tiny example into `out` with `seed`, `--set` overrides and an optional
    step count (the command every time-to-reward bench times)."""
    cmd = [sys.executable, "-m", "ppojob_cli", "run", str(EXAMPLE), "--out", str(out)]
    cmd += ["--seed", str(seed), "--no-progress"]
    if steps is not None:
        cmd += ["--steps", str(steps)]
    for s in sets:
        cmd += ["--set", s]
    return cmd


def run_one(
    seed: int,
    mode: str,
    threshold: float,
    out: Path,
    stop: bool = False,
    window: int = 10,
    hold: int = 10,
    last: int = 50,
    sets: tuple[str, ...] = (),
) -> dict[str, float | None]:
    cmd = run_command(out, seed, f"algorithm.advantageEstimator={mode}", *sets)
    start = time.perf_counter()
    with tempfile.TemporaryFile("w+") as log:
        # SIGINT at its default in the run, even when this bench was started with it ignored
        # (a background job of a non-interactive shell): Python then turns it into a clean stop
        proc = subprocess.Popen(
            cmd,
            stdout=log,
            stderr=subprocess.STDOUT,
            text=True,
            preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL),
        )
        stopped = False
        while proc.poll() is None:
            rewards = [r["reward_mean"] for r in _rows(out)] if stop and not stopped else []
            if rewards and crossing(rewards, threshold, window, hold) is not None:
                proc.send_signal(signal.SIGINT)
                stopped = True
            time.sleep(0.5)
        wall = time.perf_counter() - start
        if proc.returncode != 0 and not stopped:
            log.seek(0)
            raise SystemExit(f"seed {seed} {mode} failed:\n{log.read()}")
    rows = _rows(out)
    at = crossing([r["reward_mean"] for r in rows], threshold, window, hold)
    hit = rows[at] if at is not None else None
    raw = next((r for r in rows if r["reward_mean"] >= threshold), None)
    return {
        "step": hit["step"] if hit else None,
        "seconds": hit["elapsed_seconds"] if hit else None,
        "raw_step": raw["step"] if raw else None,
        "raw_seconds": raw["elapsed_seconds"] if raw else None,
        "final": rows[-1]["reward_mean"],
        "last": None if stop else last_mean([r["reward_mean"] for r in rows], last),
        "first": rows[0]["reward_mean"],
        "steps": len(rows),
        "wall": wall,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seeds", type=int, nargs="+", default=[1, 2, 3])
    parser.add_argument("--modes", nargs="+", default=["gae", "grpo"], choices=["gae", "grpo"])
    parser.add_argument("--threshold", type=float, default=0.9)
    parser.add_argument("--window", type=int, default=10, help="moving-average steps")
    parser.add_argument("--hold", type=int, default=10, help="steps the average must stay up")
    parser.add_argument("--last", type=int, default=50, help="steps of the closing mean")
    parser.add_argument("--min-last", type=float, default=0.95, help="goal of the closing mean")
    parser.add_argument("--stop", action="store_true", help="stop each run at the criterion")
    parser.add_argument("--set", dest="sets", action="append", default=[], metavar="KEY=VALUE")
    sys.path.insert(0, str(ROOT))
    from bench.records import Figure, add_record_arguments, write_record

    add_record_arguments(parser, "time_to_reward")
    args = parser.parse_args()
    if args.window < 1 or args.hold < 1 or args.last < 1:
        parser.error("--window, --hold and --last must be >= 1")
    print(
        f"time to mean reward >= {args.threshold}, {args.window}-step trailing average, held "
        f"{args.hold} steps ({EXAMPLE.name}, 500 steps max); raw: first single step; "
        f"last{args.last}: mean reward of the last {args.last} steps"
        + (f"; overrides: {' '.join(args.sets)}" if args.sets else "")
    )
    print(
        f"{'mode':6} {'seed':>4} {'first':>6} {'step':>5} {'seconds':>8} {'raw step':>8} "
        f"{'raw s':>7} {'goal':>6} {'final':>6} {'last' + str(args.last):>7} {'run wall s':>10}"
    )
    worst: dict[str, float] = {}
    lowest: dict[str, float] = {}
    with tempfile.TemporaryDirectory() as tmp:
        for mode in args.modes:
            for seed in args.seeds:
                r = run_one(
                    seed,
                    mode,
                    args.threshold,
                    Path(tmp) / f"{mode}-{seed}",
                    args.stop,
                    args.window,
                    args.hold,
                    args.last,
                    tuple(args.sets),
                )
                secs, raw = r["seconds"], r["raw_seconds"]
                shown = f"{secs:8.1f}" if secs is not None else "   never"
                raw_shown = f"{raw:7.1f}" if raw is not None else "  never"
                step = "-" if r["step"] is None else r["step"]
                raw_step = "-" if r["raw_step"] is None else r["raw_step"]
                closing = "      -" if r["last"] is None else f"{r['last']:7.3f}"
                print(
                    f"{mode:6} {seed:>4} {r['first']:6.3f} {step:>5} {shown} {raw_step:>8} "
                    f"{raw_shown} {GOALS[mode]:6.0f} {r['final']:6.3f} {closing} "
                    f"{r['wall']:10.1f}",
                    flush=True,
                )
                worst[mode] = max(worst.get(mode, 0.0), secs if secs is not None else 1e9)
                if r["last"] is not None:
                    lowest[mode] = min(lowest.get(mode, 1.0), r["last"])
    for mode, secs in worst.items():
        verdict = "within" if secs <= GOALS[mode] else "OVER"
        print(f"{mode}: slowest seed {secs:.1f} s, {verdict} the {GOALS[mode]:.0f} s goal")
    for mode, low in lowest.items():
        verdict = "meets" if low >= args.min_last else "BELOW"
        print(
            f"{mode}: lowest last{args.last} {low:.3f}, {verdict} the {args.min_last} goal "
            f"(seeds {' '.join(map(str, args.seeds))})"
        )
    if args.record:  # the two verdicts' figures, per mode
        figures = {f"{m}.slowest_to_0.9": Figure(secs, "s", 1) for m, secs in worst.items()}
        figures.update(
            {f"{m}.last{args.last}_min": Figure(low, "", 3) for m, low in lowest.items()}
        )
        write_record(args.record, figures, load=args.load)


if __name__ == "__main__":
    main()
