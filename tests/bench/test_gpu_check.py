"""bench/gpu_check.py's code path on the CPU (`--device cpu --tiny`): the GPU run uses the same
backend classes, checks and report (its torch, fsdp and megatron sections); only the model size, the
dtype of the megatron section and the device differ."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
pytestmark = pytest.mark.slow


def test_gpu_check_runs_its_steps_and_reports_on_the_cpu():
    out = subprocess.run(
        [
            sys.executable,
            str(ROOT / "bench" / "gpu_check.py"),
            "--device",
            "cpu",
            "--tiny",
            "--steps",
            "2",
            "--peak-tflops",
            "0.0001",
        ],
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert out.returncode == 0, out.stderr[-2000:]
    assert "step 1:" in out.stdout and "gpu_check: OK" in out.stdout
    # the megatron section: an update through the shared loss, and save -> load -> step
    assert "megatron on cpu (float32)" in out.stdout, out.stdout
    assert "save -> load -> step: max |w_resumed - w| 0" in out.stdout, out.stdout
    assert re.search(r"^megatron_resume_max_abs\s+0$", out.stdout, flags=re.M), out.stdout
    # the fsdp section: FSDP2 (world of one) update through the actor's losses, its sharded
    # checkpoint loaded by a fresh trainer, and both stepped alike
    assert "fsdp (FSDP2, world 1) on cpu" in out.stdout, out.stdout
    for row in ("fsdp_load_max_abs", "fsdp_resume_max_abs"):
        assert re.search(rf"^{row}\s+0$", out.stdout, flags=re.M), out.stdout
    moved = re.search(r"^fsdp_update_max_abs\s+(\S+)$", out.stdout, flags=re.M)
    assert moved and float(moved.group(1)) > 0, out.stdout
    assert "tokens/s" in out.stdout and "training MFU" in out.stdout and "peak memory" in out.stdout
    # MFU = the counted model FLOPs / the time of the forwards and updates / the peak
    found = re.search(
        r"training MFU ([\d.]+)% \(([\d.e+-]+) model TFLOP in ([\d.e+-]+) s", out.stdout
    )
    assert found, out.stdout
    mfu, tflop, seconds = (float(x) for x in found.groups())
    assert abs(mfu - 100 * tflop / seconds / 0.0001) <= 0.05 + 1e-3 * mfu
    # the count lies between the step's batch with empty responses and with full-width ones
    # (--tiny: 4 prompts of 8 tokens, responses up to 8, micro-batches of 2; bench/flops.py)
    from bench.flops import total_flops, uniform

    shape = dict(
        hidden_size=64,
        intermediate_size=256,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        vocab_size=128,
    )

    def step(response: int) -> int:  # 2 log-prob forwards, values, critic and actor updates
        micros = uniform(4, 8, response, 2)
        forwards = 2 * total_flops(shape, micros, train=False)
        forwards += total_flops(shape, micros, train=False, head="value")
        updates = total_flops(shape, micros, train=True, head="value")
        return forwards + updates + total_flops(shape, micros, train=True)

    assert step(1) <= tflop * 1e12 * (1 + 1e-5) and tflop * 1e12 <= step(8) * (1 + 1e-5)


def test_gpu_check_fails_on_a_device_it_cannot_use():
    out = subprocess.run(
        [sys.executable, str(ROOT / "bench" / "gpu_check.py"), "--device", "cuda:999", "--tiny"],
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert out.returncode == 1 and "gpu_check: FAILED" in out.stderr
