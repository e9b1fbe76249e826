"""The locks (locks/*.txt, hack/lock.py): every install takes exactly what they list.

Offline: the locks are read, never re-resolved. ``make lock`` rewrites them; ``make newest``
tries the newest versions allowed (PPOJOB_LOCK then names the lock of that scratch venv).
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from hack import lock

ROOT = Path(__file__).resolve().parents[1]


def test_this_virtualenv_is_exactly_its_lock() -> None:
    """Every distribution installed here is in the lock at the locked version, and every locked
    one is installed: a venv that drifted (a hand-made `pip install`, an older lock) fails."""
    locked = lock.lock_pins(os.environ.get("PPOJOB_LOCK", "dev"))
    installed = lock.installed_distributions()
    assert {"torch", "transformers", "ray", "kopf", "pytest"} <= installed.keys()  # it looked
    assert lock.drift(installed, locked) == []


def test_drift_names_what_is_extra_other_or_missing() -> None:
    installed = {"torch": "2.13.0", "kernels": "0.19.1", "numpy": "2.4.6"}
    locked = {"torch": "2.13.0", "numpy": "2.4.5", "pyyaml": "6.0.3"}
    assert lock.drift(installed, locked) == [
        "kernels==0.19.1 is installed but not in the lock",
        "numpy==2.4.6 is installed; the lock has 2.4.5",
        "pyyaml==6.0.3 is in the lock but not installed",
    ]
    assert lock.drift(locked, locked) == []


def test_installed_distributions_reads_an_environments_metadata(tmp_path: Path) -> None:
    for name, version in (("Foo_Bar", "1.0"), ("ppojob", "0.1.0"), ("baz", "2")):
        meta = tmp_path / f"{name}-{version}.dist-info"
        meta.mkdir()
        (meta / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {name}\nVersion: {version}\n")
    # names in PEP 503's form, the project itself left out (it installs from the source tree)
    assert lock.installed_distributions([str(tmp_path)]) == {"foo-bar": "1.0", "baz": "2"}


@pytest.mark.parametrize("name", sorted(lock.SPECS))
def test_each_lock_satisfies_pyproject_and_its_constraints(name: str) -> None:
    spec = lock.SPECS[name]
    pins = lock.read_lock(name)
    assert lock.disagreements(spec, pins) == []
    text = (lock.LOCKS / f"{name}.txt").read_text()
    # every entry is pinned with its hashes (pip then installs in --require-hashes mode)
    entries = re.split(r"\n(?=[a-z0-9])", text.split("\n", 2)[2].strip())
    assert len(entries) == len(pins) > 10
    assert all("--hash=sha256:" in entry for entry in entries), name


def test_the_lock_check_bites() -> None:
    """A requirement the lock lacks, one whose range excludes the locked version and a
    constraint pinned elsewhere are each reported; marker-excluded requirements are not."""
    spec = lock.SPECS["dev"]
    pins = {"torch": "2.13.0", "transformers": "5.25.0", "pyyaml": "6.0.3"}
    reqs = [
        "torch>=2.4",
        "transformers>=4.56,<5",
        "pyyaml>=6",
        "kopf>=1.45",
        "pywin32>=300; sys_platform == 'win32'",
    ]
    got = lock.disagreements(spec, pins, reqs, {"torch": "2.14.1"})
    assert got == [
        "transformers<5,>=4.56 is required but locks/dev.txt has transformers==5.25.0",
        "kopf>=1.45 is required but locks/dev.txt has no kopf",
        "constraints.txt pins torch==2.14.1 but locks/dev.txt has torch==2.13.0",
    ]
    assert lock.disagreements(spec, pins, reqs[:1] + reqs[2:3], {"torch": "2.13.0"}) == []


def test_the_locks_follow_pyproject_and_the_constraints_files() -> None:
    """What each lock must satisfy is read from pyproject.toml's extras and the constraints
    file, so an edit there counts before any re-lock."""
    dev = lock.requirements(lock.SPECS["dev"])
    assert any(r.startswith("kmock==") for r in dev) and any(r.startswith("ray[") for r in dev)
    assert lock.constraint_pins(lock.SPECS["dev"])["torch"] == "2.13.0"
    gpu = lock.SPECS["trainer-gpu"]
    assert lock.constraint_pins(gpu)["torch"] == lock.read_lock("trainer-gpu")["torch"]
    assert gpu.python == "3.12" and "sglang" in lock.read_lock("trainer-gpu")
    operator = lock.read_lock("operator")
    assert not operator.keys() & {"torch", "ray", "transformers"}
    runtime = lock.read_lock("sglang-runtime")
    assert runtime["sglang"] == lock.sglang_pin().split("==")[1]


LOCK_TEXT = """\
# header
alpha==1.0 \\
    --hash=sha256:aa
    # via beta
nvidia-cublas==13.1 \\
    --hash=sha256:bb \\
    --hash=sha256:cc
    # via
    #   torch
torch==2.13.0 \\
    --hash=sha256:dd
"""


def test_select_keeps_or_drops_whole_entries() -> None:
    without = lock.select(LOCK_TEXT, ["nvidia-*", "Torch"], keep=False)
    assert without == "# header\nalpha==1.0 \\\n    --hash=sha256:aa\n    # via beta\n"
    only = lock.select(LOCK_TEXT, ["torch"], keep=True)
    assert only == "# header\ntorch==2.13.0 \\\n    --hash=sha256:dd\n"
    assert lock.parse_lock(LOCK_TEXT) == {
        "alpha": "1.0",
        "nvidia-cublas": "13.1",
        "torch": "2.13.0",
    }


def test_the_lock_script_runs_with_the_bare_interpreter(tmp_path: Path) -> None:
    """The Dockerfiles run ``without``/``only`` before anything is installed: the standard
    library alone, no site-packages."""
    path = tmp_path / "lock.txt"
    path.write_text(LOCK_TEXT)
    out = subprocess.run(
        [sys.executable, "-S", "-I", str(ROOT / "hack" / "lock.py"), "only", str(path), "alpha"],
        capture_output=True,
        text=True,
        check=True,
    )
    assert lock.parse_lock(out.stdout) == {"alpha": "1.0"}


def test_every_install_reads_its_lock() -> None:
    """make install, the images and CI install from the locks with hashes, never from ranges."""
    makefile = (ROOT / "Makefile").read_text()
    assert "--require-hashes --no-deps -r locks/dev.txt" in makefile
    assert "-r locks/sglang-runtime.txt" in makefile
    operator = (ROOT / "images" / "operator.Dockerfile").read_text()
    assert "--require-hashes --no-deps -r locks/operator.txt" in operator
    trainer = (ROOT / "images" / "trainer.Dockerfile").read_text()
    assert "locks/trainer-gpu.txt" in trainer and "locks/trainer-cpu.txt" in trainer
    assert trainer.count("--require-hashes") >= 2
    for text in (makefile, operator, trainer):
        # no install of the project that resolves its dependencies
        for line in re.findall(r"pip install[^\n]*(?:\\\n[^\n]*)*", text):
            assert "-r " in line or "--no-deps" in line, line
