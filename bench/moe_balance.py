"""The router load-balancing loss (`algorithm.routerAuxLossCoefficient`) in a PPO run of a tiny
mixture-of-experts model on the CPU.

Runs `ppojob run examples/ppojob-tiny.yaml` with `model.path=builtin:tiny-qwen3-moe` (8 experts,
2 per token, 2 layers) for each seed and each coefficient (a fresh process and local Ray each
time). The smallest coefficient, 1e-6, is the control: the loss is computed and reported, its
gradient is a millionth of the loss (the metric exists only when the coefficient is above 0).

Method: `actor/router_balance` of a step is the row-weighted mean over the step's micro-batches
of the Switch loss E * sum_e f_e * P_e averaged over the layers (1 for uniform routing, E/k = 4
when every token goes to the same 2 experts), on the actor's update forward. The table gives,
per run, its mean over the first and the last ``--window`` steps, and the same windows of
`reward_mean` (the built-in count-up task), so the cost of balancing to the task shows beside it.

Usage: python bench/moe_balance.py [--seeds 1 2] [--steps 30] [--window 5]
       [--coefficients 1e-6 0.01 0.1] [--set KEY=VALUE ...]
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
EXAMPLE = ROOT / "examples" / "ppojob-tiny.yaml"


def run(seed: int, steps: int, coefficient: float, sets: list[str], out: Path) -> list:
    """One `ppojob run`; its metrics records."""
    args = [sys.executable, "-m", "ppojob_cli.main", "run", str(EXAMPLE), "--out", str(out)]
    args += ["--steps", str(steps), "--no-progress"]
    overrides = [
        "model.path=builtin:tiny-qwen3-moe",
        f"training.seed={seed}",
        f"algorithm.routerAuxLossCoefficient={coefficient}",
        *sets,
    ]
    for s in overrides:
        args += ["--set", s]
    done = subprocess.run(args, capture_output=True, text=True, cwd=ROOT)
    if done.returncode != 0:
        raise SystemExit(f"ppojob run failed (seed {seed}):\n{done.stderr[-2000:]}")
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]


def window_means(values: list[float], window: int) -> tuple[float, float]:
    """(mean of the first ``window`` values, mean of the last ``window``)."""
    first, last = values[:window], values[-window:]
    return sum(first) / len(first), sum(last) / len(last)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--seeds", type=int, nargs="+", default=[1, 2])
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--window", type=int, default=5)
    ap.add_argument("--coefficients", type=float, nargs="+", default=[1e-6, 0.01, 0.1])
    ap.add_argument("--set", action="append", default=[], dest="sets")
    if str(ROOT) not in sys.path:
        sys.path.insert(0, str(ROOT))
    from bench.records import Figure, add_record_arguments, command_line, write_record

    add_record_arguments(ap, "moe_balance")
    a = ap.parse_args(argv)
    figures: dict[str, Figure] = {}
    print(f"examples/ppojob-tiny.yaml, builtin:tiny-qwen3-moe, {a.steps} steps, window {a.window}")
    print("seed  coefficient  router_balance first -> last   reward_mean first -> last")
    with tempfile.TemporaryDirectory() as tmp:
        for seed in a.seeds:
            for coef in a.coefficients:
                records = run(seed, a.steps, coef, a.sets, Path(tmp) / f"s{seed}-c{coef}")
                b0, b1 = window_means([r["actor/router_balance"] for r in records], a.window)
                r0, r1 = window_means([r["reward_mean"] for r in records], a.window)
                print(
                    f"{seed:>4}  {coef:>11g}  {b0:>10.3f} -> {b1:.3f}        {r0:.3f} -> {r1:.3f}"
                )
                key = f"seed{seed}.coef{coef:g}".replace("e-0", "e-")
                figures[f"{key}.router_balance_first"] = Figure(b0, "", 3)
                figures[f"{key}.router_balance_last"] = Figure(b1, "", 3)
    if a.record:
        write_record(
            a.record,
            figures,
            command=None if argv is None else command_line([__file__, *argv]),
            load=a.load,
        )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
