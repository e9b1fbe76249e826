"""spec.algorithm.maxStaleness and importanceSampling (issue 24): typed, bounded, and refused in
one line naming the field when wrong."""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

import pytest
import yaml

from ppojob_api.problems import SpecError
from ppojob_api.training import Algorithm
from ppojob_api.validation import validate_manifest

TINY = yaml.safe_load((Path(__file__).parents[2] / "examples" / "ppojob-tiny.yaml").read_text())


def _problems(algorithm: dict[str, Any], rollout: dict[str, Any] | None = None) -> list[str]:
    doc = copy.deepcopy(TINY)
    doc["spec"]["algorithm"].update(algorithm)
    if rollout is not None:
        doc["spec"]["roles"]["rollout"] = rollout
    try:
        validate_manifest(doc)
    except SpecError as exc:
        return [str(p) for p in exc.problems]
    return []


def test_the_default_is_the_synchronous_loop_without_correction() -> None:
    algo = Algorithm()
    assert algo.max_staleness == 0
    assert algo.importance_sampling is None


@pytest.mark.parametrize(
    ("value", "says"),
    [
        (-1, "greater than or equal to 0"),
        ("1", "valid integer"),
        (1.5, "valid integer"),
        (True, "valid integer"),
        (17, "less than or equal to 16"),
    ],
)
def test_bad_staleness_is_one_line_naming_the_field(value: Any, says: str) -> None:
    (problem,) = _problems({"maxStaleness": value}, rollout={})
    assert problem.startswith("spec.algorithm.maxStaleness: ")
    assert says in problem and "\n" not in problem


@pytest.mark.parametrize(
    ("setting", "field"),
    [
        ({"cap": 1.0}, "cap"),
        ({"mode": "clip"}, "mode"),
        ({"level": "batch"}, "level"),
    ],
)
def test_bad_importance_sampling_names_its_field(setting: dict[str, Any], field: str) -> None:
    (problem,) = _problems({"importanceSampling": setting})
    assert problem.startswith(f"spec.algorithm.importanceSampling.{field}: ")


def test_staleness_with_a_colocated_engine_is_refused_with_the_reason() -> None:
    (problem,) = _problems({"maxStaleness": 1})  # the tiny example's engine is colocated
    assert problem.startswith("spec.algorithm.maxStaleness: ")
    assert "colocated engine" in problem and "colocateWithActor: false" in problem


def test_staleness_and_correction_on_engines_of_their_own_validate() -> None:
    setting = {"maxStaleness": 2, "importanceSampling": {"level": "sequence", "mode": "mask"}}
    assert _problems(setting, rollout={}) == []
