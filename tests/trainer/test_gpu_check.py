"""bench/gpu_check.py's code path on the CPU (`--device cpu --tiny`): the GPU run uses the same
backend classes, checks and report; only the model size and the device differ."""

from __future__ import annotations

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
            "1",
        ],
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert out.returncode == 0, out.stderr[-2000:]
    assert "step 1:" in out.stdout and "gpu_check: OK" in out.stdout
    assert "tokens/s" in out.stdout and "training MFU" in out.stdout and "peak memory" in out.stdout


def test_gpu_check_fails_on_a_device_it_cannot_use():
    out = subprocess.run(
        [sys.executable, str(ROOT / "bench" / "gpu_check.py"), "--device", "cuda:999", "--tiny"],
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert out.returncode == 1 and "gpu_check: FAILED" in out.stderr
