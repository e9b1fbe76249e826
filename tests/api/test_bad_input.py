"""Issue 23: every manifest a user can get wrong is answered with one line per problem naming the
field and the fix, never a traceback, a hang, or blame on a field the user never wrote. Each
table holds bad inputs and their valid neighbours."""

from __future__ import annotations

import copy
import time
from pathlib import Path
from typing import Any

import pytest
import yaml

from ppojob_api.problems import SpecError
from ppojob_api.validation import load_manifests, validate_manifest
from ppojob_api.yamlio import load_yaml_documents

EXAMPLES = Path(__file__).parents[2] / "examples"
TINY = yaml.safe_load((EXAMPLES / "ppojob-tiny.yaml").read_text())
HEAD = "apiVersion: ppojob.io/v1alpha1\nkind: PPOJob\nmetadata: {name: job}\n"


def _problems(text: str) -> list[str]:
    try:
        load_manifests(text)
    except SpecError as exc:
        return [str(p) for p in exc.problems]
    return []


def _bomb(levels: int) -> str:
    lines = ['l0: &l0 ["x", "x", "x", "x", "x", "x", "x", "x", "x"]']
    for i in range(1, levels):
        lines.append(f"l{i}: &l{i} [" + ", ".join([f"*l{i - 1}"] * 9) + "]")
    return "\n".join(lines) + "\n"


# --- item 6: aliases are followed with a guard -------------------------------------------------
@pytest.mark.parametrize(
    ("text", "expected"),
    [
        (HEAD + "spec: &a\n  image: x\n  nested: *a\n", "spec.nested: refers to itself"),
        ("a: &a [1, *a]\n", "a[1]: refers to itself"),
        (_bomb(9), "<file>: expands to more than 100,000 values"),
        ("a: " + "[" * 80 + "]" * 80 + "\n", "nests more than 64 levels"),
    ],
)
def test_recursive_aliases_and_alias_bombs_are_one_line_errors(text: str, expected: str) -> None:
    t0 = time.monotonic()
    with pytest.raises(SpecError) as info:
        load_yaml_documents(text)
    assert time.monotonic() - t0 < 1.0
    assert len(info.value.problems) == 1
    assert expected in str(info.value.problems[0]), info.value


@pytest.mark.parametrize(
    "text",
    [
        "a: &a [1, 2]\nb: *a\nc: *a\n",  # an alias used twice, not into itself
        "base: &b {x: 1}\nd: {<<: *b, y: 2}\n",  # a merge key
        _bomb(4),  # 6,561 values: many, but a document may hold them
        "a: " + "[" * 60 + "]" * 60 + "\n",
    ],
)
def test_ordinary_aliases_still_load(text: str) -> None:
    assert load_yaml_documents(text)


def test_duplicate_keys_inside_a_merged_block_are_still_found() -> None:
    with pytest.raises(SpecError, match=r"d\.x: duplicate key"):
        load_yaml_documents("base: &b {x: 1}\nd:\n  <<: {x: 1, x: 2}\n")


# --- item 1: batch-size problems are blamed where the value was written ------------------------
def _tiny(**training: object) -> dict[str, Any]:
    doc = copy.deepcopy(TINY)
    doc["spec"]["training"].update(training)
    return doc


def _paths(doc: dict[str, Any]) -> list[str]:
    try:
        validate_manifest(doc)
    except SpecError as exc:
        return [p.path for p in exc.problems]
    return []


@pytest.mark.parametrize(
    ("training", "critic", "expected"),
    [
        ({"miniBatchSize": 7}, None, ["spec.training.miniBatchSize"]),
        ({"microBatchSize": 3}, None, ["spec.training.microBatchSize"]),
        ({"microBatchSize": 3}, {"colocateWithActor": True}, ["spec.training.microBatchSize"]),
        # the critic's own override is blamed as its user spelled it
        (
            {},
            {"colocateWithActor": True, "overrides": {"micro_batch_size": 3}},
            ["spec.roles.critic.overrides.micro_batch_size"],
        ),
        # an override that repairs the critic's batches leaves only the actor's problem
        (
            {"microBatchSize": 3},
            {"colocateWithActor": True, "overrides": {"microBatchSize": 4}},
            ["spec.training.microBatchSize"],
        ),
        ({"miniBatchSize": 64}, None, []),
        ({"miniBatchSize": 64, "microBatchSize": 8}, {"colocateWithActor": True}, []),
    ],
)
def test_batch_problems_are_reported_once_where_written(
    training: dict[str, Any], critic: dict[str, Any] | None, expected: list[str]
) -> None:
    doc = _tiny(**training)
    if critic is not None:
        doc["spec"]["roles"]["critic"] = critic
    assert _paths(doc) == expected
