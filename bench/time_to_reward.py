"""Wall time until the tiny example's mean reward first reaches a threshold, PPO and GRPO.

Runs `ppojob run examples/ppojob-tiny.yaml` for each seed and mode (a fresh process and local Ray
each time), reads `metrics.jsonl` and prints, per run, the first step whose mean reward reached
the threshold, the training time until then (`elapsed_seconds`, from the start of training:
Ray start-up, placement and model start-up included) and the whole process's wall time.

Usage: python bench/time_to_reward.py [--seeds 1 2 3] [--modes gae grpo] [--threshold 0.9] [--stop]

`--stop` interrupts each run (SIGINT, a clean stop) once the threshold is reached instead of
training all 500 steps: the figures are the same, the bench takes a fraction of the time.
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


def _reached(out: Path, threshold: float) -> bool:
    path = out / "metrics.jsonl"
    if not path.exists():
        return False
    for line in path.read_text().splitlines():
        try:
            if json.loads(line)["reward_mean"] >= threshold:
                return True
        except (ValueError, KeyError):  # a line being written
            continue
    return False


def run_one(
    seed: int, mode: str, threshold: float, out: Path, stop: bool = False
) -> dict[str, float | None]:
    cmd = [
        sys.executable,
        "-m",
        "ppojob_cli",
        "run",
        str(EXAMPLE),
        "--out",
        str(out),
        "--seed",
        str(seed),
        "--no-progress",
        "--set",
        f"algorithm.advantageEstimator={mode}",
    ]
    start = time.perf_counter()
    with tempfile.TemporaryFile("w+") as log:
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, text=True)
        stopped = False
        while proc.poll() is None:
            if stop and not stopped and _reached(out, threshold):
                proc.send_signal(signal.SIGINT)
                stopped = True
            time.sleep(0.5)
        wall = time.perf_counter() - start
        if proc.returncode != 0 and not stopped:
            log.seek(0)
            raise SystemExit(f"seed {seed} {mode} failed:\n{log.read()}")
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    hit = next((r for r in rows if r["reward_mean"] >= threshold), None)
    return {
        "step": hit["step"] if hit else None,
        "seconds": hit["elapsed_seconds"] if hit else None,
        "final": rows[-1]["reward_mean"],
        "first": rows[0]["reward_mean"],
        "steps": len(rows),
        "wall": wall,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seeds", type=int, nargs="+", default=[1, 2, 3])
    parser.add_argument("--modes", nargs="+", default=["gae", "grpo"], choices=["gae", "grpo"])
    parser.add_argument("--threshold", type=float, default=0.9)
    parser.add_argument("--stop", action="store_true", help="stop each run at the threshold")
    args = parser.parse_args()
    print(f"time to mean reward >= {args.threshold} ({EXAMPLE.name}, 500 steps max)")
    print(
        f"{'mode':6} {'seed':>4} {'first':>6} {'step':>5} {'seconds':>8} {'goal':>6} "
        f"{'final':>6} {'run wall s':>10}"
    )
    worst: dict[str, float] = {}
    with tempfile.TemporaryDirectory() as tmp:
        for mode in args.modes:
            for seed in args.seeds:
                r = run_one(seed, mode, args.threshold, Path(tmp) / f"{mode}-{seed}", args.stop)
                secs = r["seconds"]
                shown = f"{secs:8.1f}" if secs is not None else "   never"
                print(
                    f"{mode:6} {seed:>4} {r['first']:6.3f} {r['step'] or '-':>5} {shown} "
                    f"{GOALS[mode]:6.0f} {r['final']:6.3f} {r['wall']:10.1f}",
                    flush=True,
                )
                worst[mode] = max(worst.get(mode, 0.0), secs if secs is not None else 1e9)
    for mode, secs in worst.items():
        verdict = "within" if secs <= GOALS[mode] else "OVER"
        print(f"{mode}: slowest seed {secs:.1f} s, {verdict} the {GOALS[mode]:.0f} s goal")


if __name__ == "__main__":
    main()
