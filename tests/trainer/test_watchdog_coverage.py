"""Every blocking wait of the driver is under the stall watchdog (issue 42, finding 4): no module
of ``ppojob_trainer/driver`` calls ``ray.get`` or ``ray.wait`` (nor imports them by name); each
wait goes through ``watchdog.WATCHDOG``, which bounds it and names the role, rank and phase that
did not report. Parsed with ``ast``."""

from __future__ import annotations

import ast
from pathlib import Path

import ppojob_trainer.driver

DRIVER = Path(ppojob_trainer.driver.__file__).parent
BLOCKING = {"get", "wait"}


def blocking_calls(path: Path) -> list[str]:
    tree = ast.parse(path.read_text())
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.module == "ray":
            found += [f"{path.name}:{node.lineno} from ray import {a.name}" for a in node.names]
        if not isinstance(node, ast.Call) or not isinstance(node.func, ast.Attribute):
            continue
        f = node.func
        if f.attr in BLOCKING and isinstance(f.value, ast.Name) and f.value.id == "ray":
            found.append(f"{path.name}:{node.lineno} ray.{f.attr}")
    return [c for c in found if c.split()[-1] in {"ray.get", "ray.wait", *BLOCKING}]


def test_no_driver_module_waits_outside_the_watchdog() -> None:
    modules = sorted(DRIVER.glob("*.py"))
    assert len(modules) >= 8
    outside = [c for m in modules for c in blocking_calls(m)]
    assert not outside, f"blocking waits outside watchdog.WATCHDOG: {outside}"


def test_the_check_sees_a_wait(tmp_path: Path) -> None:
    sample = tmp_path / "m.py"
    sample.write_text("import ray\nfrom ray import wait\nray.get(x)\nray.wait([x])\n")
    assert len(blocking_calls(sample)) == 3
