"""On-policy distillation: how far a tiny student moves toward its teacher, against a control.

Runs `ppojob run examples/ppojob-tiny-distill.yaml` (a fresh process and local Ray each time) for
each seed, twice: as written (the teacher builtin:count-up-teacher, the per-token reverse KL as
the reward of REINFORCE++ with gamma 0, coefficient 1, no task reward) and with
`algorithm.distillation.coefficient=0` (the teacher scores the samples, its signal is unused:
the control). `--mode loss` runs both with the reverse KL as a loss term instead.

Method: `distill/reverse_kl` of a step is the mean over its 64 samples of the summed per-token
log pi_student(y_t) - log pi_teacher(y_t) on the student's own samples (an unbiased estimate of
the sequence's KL(student || teacher) at that step's policy). One step's figure is noisy, so the
table gives the mean of the first ``--window`` steps (default 5) and of the last ``--window``
steps, for each run, and their ratio (last / first); the closing line gives, over seeds, the
largest ratio with the signal and the smallest and largest ratio of the control. It also prints
`reward_mean` (the count-up reward, which the signal leaves out but which the teacher mostly
solves) over the same windows.

Usage: python bench/distill.py [--seeds 1 2 3] [--steps 30] [--window 5] [--mode reward|loss]
       [--set KEY=VALUE ...]
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
EXAMPLE = ROOT / "examples" / "ppojob-tiny-distill.yaml"


def window_means(values: list[float], window: int) -> tuple[float, float]:
    """(mean of the first ``window`` values, mean of the last ``window``)."""
    first, last = values[:window], values[-window:]
    return sum(first) / len(first), sum(last) / len(last)


def run(seed: int, steps: int, coefficient: float, mode: str, sets: list[str], out: Path) -> list:
    """One `ppojob run` of the example; its metrics records."""
    args = [sys.executable, "-m", "ppojob_cli.main", "run", str(EXAMPLE), "--out", str(out)]
    args += ["--steps", str(steps), "--no-progress"]
    overrides = [
        f"training.seed={seed}",
        f"algorithm.distillation.coefficient={coefficient}",
        f"algorithm.distillation.mode={mode}",
        *sets,
    ]
    for s in overrides:
        args += ["--set", s]
    done = subprocess.run(args, capture_output=True, text=True, cwd=ROOT)
    if done.returncode != 0:
        raise SystemExit(f"ppojob run failed (seed {seed}):\n{done.stderr[-2000:]}")
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--seeds", type=int, nargs="+", default=[1, 2, 3])
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--window", type=int, default=5)
    ap.add_argument("--mode", choices=["reward", "loss"], default="reward")
    ap.add_argument("--set", action="append", default=[], dest="sets")
    a = ap.parse_args(argv)
    print(f"examples/ppojob-tiny-distill.yaml, mode {a.mode}, {a.steps} steps, window {a.window}")
    print("seed  coef  reverse_kl first -> last (ratio)   reward_mean first -> last")
    ratios: dict[float, list[float]] = {1.0: [], 0.0: []}
    with tempfile.TemporaryDirectory() as tmp:
        for seed in a.seeds:
            for coef in (1.0, 0.0):
                out = Path(tmp) / f"s{seed}-c{coef}"
                records = run(seed, a.steps, coef, a.mode, a.sets, out)
                kl0, kl1 = window_means([r["distill/reverse_kl"] for r in records], a.window)
                rw0, rw1 = window_means([r["reward_mean"] for r in records], a.window)
                ratios[coef].append(kl1 / kl0)
                print(
                    f"{seed:>4}  {coef:>4}  {kl0:>8.2f} -> {kl1:>6.2f} ({kl1 / kl0:.2f})"
                    f"      {rw0:.3f} -> {rw1:.3f}"
                )
    print(
        f"signal: largest last/first {max(ratios[1.0]):.2f}; control: "
        f"{min(ratios[0.0]):.2f} .. {max(ratios[0.0]):.2f}"
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
