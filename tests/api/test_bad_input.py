"""Issue 23: every manifest a user can get wrong is answered with one line per problem naming the
field and the fix, never a traceback, a hang, or blame on a field the user never wrote. Each
table holds bad inputs and their valid neighbours."""

from __future__ import annotations

import time

import pytest

from ppojob_api.problems import SpecError
from ppojob_api.validation import load_manifests
from ppojob_api.yamlio import load_yaml_documents

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
