"""`kubectl-ppojob` on PATH, as pip would install it, for tests that run the real kubectl."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import tomllib

from tests.helpers.controlplane import ROOT


def launcher(bindir: Path) -> Path:
    """`kubectl-ppojob` as pip would install it, from pyproject's entry point."""
    scripts = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["scripts"]
    module, func = scripts["kubectl-ppojob"].split(":")
    path = bindir / "kubectl-ppojob"
    path.write_text(
        f"#!{sys.executable}\nimport sys\nfrom {module} import {func}\nsys.exit({func}())\n"
    )
    path.chmod(0o755)
    return path


def plugin_env(bindir: Path) -> dict[str, str]:
    """The environment kubectl runs the plugin in: the launcher first on PATH, this checkout's
    packages importable, no in-cluster or KUBECONFIG settings of the test process."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("KUBERNETES_SERVICE")}
    env.pop("KUBECONFIG", None)
    env["PATH"] = os.pathsep.join([str(bindir), env.get("PATH", "")])
    env["PYTHONPATH"] = os.pathsep.join(
        [*(str(ROOT / d) for d in ("api", "operator", "trainer", "cli")), env.get("PYTHONPATH", "")]
    )
    return env
