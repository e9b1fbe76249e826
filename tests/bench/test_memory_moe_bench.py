"""bench/memory.py on the Qwen3-30B-A3B-shaped example (plan only, no GPU): it prints the MoE
figures (parameters, experts, the experts' weights per actor rank) and the per-GPU plan, which
fits its 80 GB GPUs only because expert parallelism splits the experts."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
EXAMPLE = ROOT / "examples" / "ppojob-qwen3-moe-megatron-ep.yaml"


def _bench(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, str(ROOT / "bench" / "memory.py"), str(EXAMPLE), *args],
        capture_output=True,
        text=True,
        timeout=300,
        cwd=ROOT,
    )


def test_the_moe_example_prints_its_experts_and_fits() -> None:
    out = _bench()
    assert out.returncode == 0, out.stdout + out.stderr
    # 28.99e9 expert parameters in bf16 = 54.00 GiB, over expert 8 x tensor 2 = 3.38 GiB
    assert (
        "experts: 128 per MoE block (top-8), 48 MoE blocks; 30.53B parameters (28.99B in "
        "experts, 3.35B active per token); expert weights per actor rank 3.38 GiB in bf16 "
        "(expert 8, tensor 2; 54.00 GiB whole)"
    ) in out.stdout
    assert "expert parallel 8: each rank holds 16 of them per block" in out.stdout
    assert "actor: peak 55.96 GiB of 75 GiB (fits" in out.stdout


def test_without_expert_parallelism_the_example_does_not_fit() -> None:
    out = _bench("--set", "roles.actor.parallelism.expert=1")
    assert out.returncode != 0
    said = out.stdout + out.stderr
    assert "spec.roles.actor: the memory plan needs 150.5 GiB per GPU" in said
    assert "or (megatron) a larger parallelism.expert to split the experts" in said
