"""The driver package stays in short pieces, and ``PPOTrainer.step`` reads top to bottom as the
PPO step (rollouts -> values -> log-probs and advantages -> updates -> weight sync -> metrics).
Parsed with ``ast``; a function's length is its ``def`` span (end_lineno - lineno + 1)."""

from __future__ import annotations

from pathlib import Path

import pytest

import ppojob_trainer
from tests.helpers.structure import function_lengths

PACKAGE = Path(ppojob_trainer.__file__).parent / "driver"
MODULES = sorted(p.stem for p in PACKAGE.glob("*.py") if p.stem != "__init__")
MAX_LINES = 60
STEP_MAX_LINES = 45


def functions(module: str) -> list[tuple[str, int]]:
    """Every function (nested ones too) of a driver module: (qualified name, lines)."""
    return function_lengths(PACKAGE / f"{module}.py")


def test_the_driver_is_a_package_of_its_pieces() -> None:
    expected = {"topology", "groups", "cluster", "weights", "rollouts", "elastic", "metrics"}
    assert expected | {"trainer", "run"} <= set(MODULES), MODULES
    assert not (PACKAGE.parent / "loop.py").exists(), "the driver lives in driver/"


@pytest.mark.parametrize("module", MODULES)
def test_no_function_is_longer_than_60_lines(module: str) -> None:
    found = functions(module)
    assert found, f"{module}.py defines no function"
    too_long = [(name, n) for name, n in found if n > MAX_LINES]
    assert not too_long, f"driver/{module}.py: functions over {MAX_LINES} lines: {too_long}"


def test_the_step_is_short() -> None:
    lengths = dict(functions("trainer"))
    assert lengths["PPOTrainer.step"] <= STEP_MAX_LINES, lengths["PPOTrainer.step"]


def test_the_measure_sees_a_long_function(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The check itself: a 61-line function is found (so a pass above is not vacuous)."""
    body = "\n".join(f"    x{i} = {i}" for i in range(60))
    (tmp_path / "long.py").write_text(f"class C:\n  def f(self):\n{body}\n")
    monkeypatch.setattr(f"{__name__}.PACKAGE", tmp_path)
    assert functions("long") == [("C.f", 61)]
