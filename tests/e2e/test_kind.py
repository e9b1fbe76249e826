"""The whole path on a real cluster: kind + Volcano + KubeRay + this chart + the tiny CPU example,
until the PPOJob reaches phase Succeeded (hack/e2e-kind.sh). Collected only with PPOJOB_E2E=1."""

import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.e2e
def test_tiny_example_succeeds_on_kind() -> None:
    out = subprocess.run([str(ROOT / "hack" / "e2e-kind.sh")], timeout=3 * 3600)
    assert out.returncode == 0, "hack/e2e-kind.sh failed; see its output above"
