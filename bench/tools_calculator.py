"""The calculator task with an environment that evaluates the model's own call: what is learned.

Runs `ppojob run examples/ppojob-tiny-calculator.yaml` (a fresh process and local Ray each time)
for each seed, ``--steps`` steps (default 200; the example's 16 prompts x 8 samples per step),
and reads `metrics.jsonl`. The environment is `builtin:calculator`: a turn of four digits WXYZ
is a call of WX + YZ answered with its value, any other turn is the final answer (see
`ppojob_trainer.agent`), so a call helps only when the model copies the right operands and then
copies the result's last digit.

Method: every figure is the mean over a window of steps of a per-step mean over the step's 128
samples, for the first ``--window`` steps (default 25) and the last ``--window`` steps:
``reward`` (`reward_mean`: 1 when the last turn is the answer digit; a guess scores 0.1),
``calls`` (`agent/env/calls_mean`: calls per sample), ``exact`` (`agent/env/exact_calls_mean`
over `agent/env/calls_mean`: the share of calls whose value is AB + CD, e.g. the prompt copied)
and ``digit`` (`agent/env/digit_calls_mean` over calls: the share whose last digit is the
answer, i.e. the operands' last digits right), and ``turns`` (`agent/turns_mean`). A share is
computed from the window's summed means (calls-weighted), blank when the window has no call.
``train s`` is `elapsed_seconds` of the last step (from the start of training). The closing
line gives, over seeds, the lowest and highest last-window reward.

Usage: python bench/tools_calculator.py [--seeds 1 2] [--steps 200] [--window 25]
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
EXAMPLE = ROOT / "examples" / "ppojob-tiny-calculator.yaml"


def run(seed: int, steps: int, sets: list[str], out: Path) -> list[dict]:
    """One `ppojob run` of the example; its metrics records."""
    args = [sys.executable, "-m", "ppojob_cli.main", "run", str(EXAMPLE), "--out", str(out)]
    args += ["--steps", str(steps), "--no-progress", "--set", f"training.seed={seed}"]
    for s in sets:
        args += ["--set", s]
    done = subprocess.run(args, capture_output=True, text=True, cwd=ROOT)
    if done.returncode != 0:
        raise SystemExit(f"ppojob run failed (seed {seed}):\n{done.stderr[-2000:]}")
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]


def window(records: list[dict]) -> dict[str, float | None]:
    """The figures of a window of steps (see the method)."""
    n = len(records)

    def total(key: str) -> float:
        return sum(r.get(key, 0.0) for r in records)

    calls = total("agent/env/calls_mean")
    return {
        "reward": total("reward_mean") / n,
        "calls": calls / n,
        "exact": total("agent/env/exact_calls_mean") / calls if calls else None,
        "digit": total("agent/env/digit_calls_mean") / calls if calls else None,
        "turns": total("agent/turns_mean") / n,
    }


def row_line(seed: int, label: str, figures: dict[str, float | None]) -> str:
    """One printed row: the seed, the window and its figures (``-``: no call in the window)."""
    cells = "  ".join(f"{k} {'-' if v is None else f'{v:.3f}'}" for k, v in figures.items())
    return f"seed {seed}  {label:<9} {cells}"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--seeds", type=int, nargs="+", default=[1, 2])
    ap.add_argument("--steps", type=int, default=200)
    ap.add_argument("--window", type=int, default=25)
    ap.add_argument("--set", dest="sets", action="append", default=[])
    a = ap.parse_args(argv)
    print(f"examples/ppojob-tiny-calculator.yaml, {a.steps} steps, window {a.window}")
    lasts = []
    for seed in a.seeds:
        with tempfile.TemporaryDirectory() as tmp:
            records = run(seed, a.steps, a.sets, Path(tmp) / "run")
        first, last = window(records[: a.window]), window(records[-a.window :])
        lasts.append(last["reward"])
        print(row_line(seed, f"first {a.window}", first))
        print(row_line(seed, f"last {a.window}", last))
        print(f"seed {seed}  train s   {records[-1].get('elapsed_seconds', float('nan')):.1f}")
    print(f"last-{a.window} reward over seeds: lowest {min(lasts):.3f}, highest {max(lasts):.3f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
