"""The tiny example with actor and critic on the megatron backend (tensor parallel 2, on CPU).

Runs `ppojob run examples/ppojob-tiny.yaml` with the actor on 2 workers (`backend: megatron`,
`parallelism.tensor: 2`) and a colocated megatron critic of the same layout (the rollout stays
on the torch backend, colocated), in a fresh process and local Ray per seed, and prints the step
at which the reward curve reached the threshold, the training time until then (`elapsed_seconds`:
Ray start-up, placement, megatron-core start-up and model conversion included), the set-up
time and the whole process's wall time.

The step is found as in bench/time_to_reward.py: the first step whose 10-step trailing mean
reward (``--window``) is >= the threshold and stays so for 10 consecutive steps (``--hold``),
not the first single (noisy) step over it.

``--backend torch`` runs the same 2-worker layout on the torch backend (data parallel 2);
``megatron-moe`` and ``torch-moe`` run ``builtin:tiny-mixtral`` (8 experts, top 2) with routing
replay, its experts over the 2 megatron workers (expert 2) or data parallel 2 on the torch backend.

Usage: python bench/megatron_tiny.py [--seeds 1] [--threshold 0.9] [--steps 500]
       [--backend megatron|torch|megatron-moe|torch-moe] [--window 10] [--hold 10]
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "bench"))

from time_to_reward import EXAMPLE, crossing, run_command  # noqa: E402

LAYOUTS = {
    # 2 workers, tensor parallel 2 (data parallel 1), megatron actor and critic.
    "megatron": [
        "roles.actor={replicas: 2, backend: megatron, parallelism: {tensor: 2},"
        " resources: {cpus: 1, memory: 2Gi}}",
        "roles.critic={colocateWithActor: true, backend: megatron, parallelism: {tensor: 2}}",
    ],
    # The same 2 workers on the torch backend (data parallel 2), for comparison.
    "torch": ["roles.actor={replicas: 2, resources: {cpus: 1, memory: 2Gi}}"],
    # builtin:tiny-mixtral (8 experts, top 2): its experts over the 2 megatron workers (expert
    # 2, data 2), a colocated megatron critic of that layout, routing replay on.
    "megatron-moe": [
        "model.path=builtin:tiny-mixtral",
        "roles.actor={replicas: 2, backend: megatron, parallelism: {expert: 2},"
        " resources: {cpus: 1, memory: 2Gi}}",
        "roles.critic={colocateWithActor: true, backend: megatron, parallelism: {expert: 2}}",
        "algorithm.routingReplay=rollout",
    ],
    # The same MoE model and replay on the torch backend (data parallel 2), for comparison.
    "torch-moe": [
        "model.path=builtin:tiny-mixtral",
        "roles.actor={replicas: 2, resources: {cpus: 1, memory: 2Gi}}",
        "algorithm.routingReplay=rollout",
    ],
}


def run_one(
    seed: int,
    steps: int,
    threshold: float,
    out: Path,
    backend: str = "megatron",
    window: int = 10,
    hold: int = 10,
) -> dict[str, float | None]:
    cmd = run_command(out, seed, *LAYOUTS[backend], steps=steps)
    start = time.perf_counter()
    proc = subprocess.run(cmd, capture_output=True, text=True, check=False)
    wall = time.perf_counter() - start
    if proc.returncode != 0:
        raise SystemExit(f"seed {seed} failed:\n{proc.stdout}\n{proc.stderr[-4000:]}")
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    at = crossing([r["reward_mean"] for r in rows], threshold, window, hold)
    hit = rows[at] if at is not None else None
    first = rows[0]
    return {
        "step": hit["step"] if hit else None,
        "seconds": hit["elapsed_seconds"] if hit else None,
        "setup": first["elapsed_seconds"] - first.get("time/step", 0.0),
        "step_s": (rows[-1]["elapsed_seconds"] - first["elapsed_seconds"]) / max(1, len(rows) - 1),
        "final": rows[-1]["reward_mean"],
        "first": first["reward_mean"],
        "wall": wall,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seeds", type=int, nargs="+", default=[1])
    parser.add_argument("--threshold", type=float, default=0.9)
    parser.add_argument("--steps", type=int, default=500)
    parser.add_argument(
        "--backend",
        choices=sorted(LAYOUTS),
        default="megatron",
        help="torch: the same 2 workers, data parallel",
    )
    parser.add_argument("--window", type=int, default=10, help="moving-average steps")
    parser.add_argument("--hold", type=int, default=10, help="steps the average must stay up")
    if str(ROOT) not in sys.path:
        sys.path.insert(0, str(ROOT))
    from bench.records import Figure, add_record_arguments, write_record

    add_record_arguments(parser, "megatron_tiny")
    args = parser.parse_args()
    what = {
        "megatron": "megatron TP2",
        "torch": "torch DP2",
        "megatron-moe": "tiny-mixtral, megatron expert 2 (data 2), routing replay",
        "torch-moe": "tiny-mixtral, torch DP2, routing replay",
    }[args.backend]
    print(
        f"{what} actor + critic, time to mean reward >= {args.threshold} "
        f"({args.window}-step trailing average, held {args.hold} steps) "
        f"({EXAMPLE.name}, {args.steps} steps max)"
    )
    print(
        f"{'seed':>4} {'first':>6} {'step':>5} {'seconds':>8} {'setup s':>8} {'s/step':>7} "
        f"{'final':>6} {'wall s':>7}"
    )
    figures: dict[str, Figure] = {}
    with tempfile.TemporaryDirectory() as tmp:
        for seed in args.seeds:
            r = run_one(
                seed,
                args.steps,
                args.threshold,
                Path(tmp) / f"seed-{seed}",
                args.backend,
                args.window,
                args.hold,
            )
            secs = r["seconds"]
            shown = f"{secs:8.1f}" if secs is not None else "   never"
            step = "-" if r["step"] is None else r["step"]
            print(
                f"{seed:>4} {r['first']:6.3f} {step:>5} {shown} {r['setup']:8.1f} "
                f"{r['step_s']:7.3f} {r['final']:6.3f} {r['wall']:7.1f}",
                flush=True,
            )
            if r["step"] is not None:
                figures[f"seed{seed}.steps_to_0.9"] = Figure(
                    r["step"], "steps", 0, unit_shown=False
                )
            figures[f"seed{seed}.s_per_step"] = Figure(r["step_s"], "s", 3, unit_shown=False)
            figures[f"seed{seed}.final"] = Figure(r["final"], "", 3)
    if args.record:
        write_record(args.record, figures, load=args.load)


if __name__ == "__main__":
    main()
