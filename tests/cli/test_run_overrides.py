"""`ppojob run --set/--unset` (issue 23 item 5): `metadata.name` is the job's name, not
`spec.metadata`; an --unset of a field the manifest lacks is an error, not a silent no-op."""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

import pytest
import yaml

from ppojob_api.problems import SpecError
from ppojob_trainer.manifest import apply_spec_overrides

TINY = yaml.safe_load((Path(__file__).parents[2] / "examples" / "ppojob-tiny.yaml").read_text())


def test_set_metadata_name_sets_the_jobs_name() -> None:
    out = apply_spec_overrides(TINY, [("metadata.name", "renamed")])
    assert out["metadata"]["name"] == "renamed" and "metadata" not in out["spec"]


@pytest.mark.parametrize(
    ("unset", "message"),
    [
        ("training.stpes", "the manifest has no spec.training.stpes"),
        ("roles.critic", "the manifest has no spec.roles.critic"),
        ("metadata.labels", "the manifest has no metadata.labels"),
    ],
)
def test_unset_of_a_missing_field_is_an_error(unset: str, message: str) -> None:
    with pytest.raises(SpecError) as info:
        apply_spec_overrides(TINY, unsets=[unset])
    (problem,) = info.value.problems
    assert problem.path == f"--unset {unset}" and message in problem.message


@pytest.mark.parametrize(
    ("unset", "gone"),
    [("training.seed", ("spec", "training", "seed")), ("spec.head", ("spec", "head"))],
)
def test_unset_of_a_written_field_removes_it(unset: str, gone: tuple[str, ...]) -> None:
    out: Any = apply_spec_overrides(copy.deepcopy(TINY), unsets=[unset])
    for key in gone[:-1]:
        out = out[key]
    assert gone[-1] not in out


def test_set_of_apiversion_under_spec_is_refused() -> None:
    with pytest.raises(SpecError, match="kind is not a spec field"):
        apply_spec_overrides(TINY, [("kind", "RayJob")])
