"""The operator's reconcile code stays in KubeRay's shape: short functions, and a
``reconcile_children`` that reads as a pipeline (admit -> plan -> build -> ensure -> record).
Parsed with ``ast``; a function's length is its ``def`` span (end_lineno - lineno + 1)."""

from __future__ import annotations

from pathlib import Path

import pytest

import ppojob_operator
from tests.helpers.structure import function_lengths

PACKAGE = Path(ppojob_operator.__file__).parent
MODULES = ("handlers", "reconcile", "sync", "suspend", "timers", "state", "watch")
"""kopf wiring, and the modules the reconcile was split into."""
MAX_LINES = 60
PIPELINE_MAX_LINES = 35


def functions(module: str) -> list[tuple[str, int]]:
    """Every function (nested ones too) of an operator module: (qualified name, lines)."""
    return function_lengths(PACKAGE / f"{module}.py")


@pytest.mark.parametrize("module", MODULES)
def test_no_function_is_longer_than_60_lines(module):
    found = functions(module)
    assert found, f"{module}.py defines no function"
    too_long = [(name, n) for name, n in found if n > MAX_LINES]
    assert not too_long, f"{module}.py: functions over {MAX_LINES} lines: {too_long}"


def test_reconcile_children_is_a_short_pipeline():
    lengths = dict(functions("reconcile"))
    assert lengths["reconcile_children"] <= PIPELINE_MAX_LINES, lengths["reconcile_children"]


def test_handlers_hold_no_reconcile_step():
    """handlers.py is kopf wiring: the reconcile steps live in their own modules."""
    names = {name.split(".")[-1] for name, _ in functions("handlers")}
    for step in ("reconcile_children", "sync_status", "apply_suspend", "heal", "on_pod_event"):
        assert step not in names, step
