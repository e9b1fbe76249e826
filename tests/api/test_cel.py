"""The CRD's admission rules and bounds (issue 41, item 5), judged without a cluster: each CEL
rule names the Python check it restates, every spec string, list and map is bounded, a started
job's spec is frozen but for suspend, and a PPOJob names its model (tests/cluster/test_api_cel.py
sends the same cases through the real API server)."""

from __future__ import annotations

import importlib
import re
from typing import Any

import pytest

from ppojob_api.cel import (
    ADMISSION_RULES,
    LIST_MAX,
    MUTABLE_WHEN_STARTED,
    STRING_MAX,
    bound_problems,
    started_rules,
)
from ppojob_api.crd import openapi_schema
from ppojob_api.problems import SpecError
from ppojob_api.spec import PPOJobSpec
from ppojob_api.validation import validate_manifest
from tests.api.test_bad_input import TINY
from tests.helpers.manifests import DELETE, set_path


def _rules(node: dict[str, Any]) -> list[dict[str, Any]]:
    found = list(node.get("x-kubernetes-validations", []))
    for sub in (node.get("properties") or {}).values():
        found += _rules(sub)
    if isinstance(node.get("items"), dict):
        found += _rules(node["items"])
    return found


def test_every_rule_is_in_the_crd_and_names_its_python_check() -> None:
    in_crd = _rules(openapi_schema())
    for rule in (*ADMISSION_RULES, *started_rules()):
        assert rule.entry() in in_crd
        module, _, name = rule.check.partition(":")
        assert callable(getattr(importlib.import_module(module), name)), rule.check
        assert "fix:" in rule.message, rule.message
    assert len(in_crd) == len(ADMISSION_RULES) + len(started_rules())


def test_a_started_jobs_spec_is_frozen_field_by_field_but_for_suspend() -> None:
    spec = openapi_schema()["properties"]["spec"]["properties"]
    frozen = {r.field_path for r in started_rules()}
    assert frozen == {f".spec.{f}" for f in spec if f not in MUTABLE_WHEN_STARTED}
    assert MUTABLE_WHEN_STARTED == ("suspend",)
    for rule in started_rules():
        assert rule.rule.startswith("!(has(oldSelf.status) && has(oldSelf.status.rayJobName))")
        # no optional (`.?`) equality: the API server estimates its cost as unbounded
        assert ".?" not in rule.rule


def _unbounded(node: dict[str, Any], path: str) -> list[str]:
    out = []
    kind = node.get("type")
    if kind == "string" and "enum" not in node and "maxLength" not in node:
        out.append(path)
    if kind == "array" and "maxItems" not in node:
        out.append(path)
    extra = node.get("additionalProperties")
    if isinstance(extra, dict):
        if "maxProperties" not in node:
            out.append(path)
        out += _unbounded(extra, f"{path}{{}}")
    for key, sub in (node.get("properties") or {}).items():
        out += _unbounded(sub, f"{path}.{key}")
    if isinstance(node.get("items"), dict):
        out += _unbounded(node["items"], f"{path}[]")
    return out


def test_every_spec_string_list_and_map_is_bounded() -> None:
    assert _unbounded(openapi_schema()["properties"]["spec"], "spec") == []


@pytest.mark.parametrize(
    ("path", "value", "problem"),
    [
        ("spec.image", "i" * (STRING_MAX + 1), f"spec.image: is {STRING_MAX + 1} characters"),
        ("spec.imagePullSecrets", [{"name": "s"}] * (LIST_MAX + 1), "spec.imagePullSecrets: has"),
        ("spec.head.nodeSelector", {f"k{i}": "v" for i in range(257)}, "spec.head.nodeSelector"),
    ],
)
def test_validate_refuses_what_is_over_a_bound(path: str, value: Any, problem: str) -> None:
    with pytest.raises(SpecError) as err:
        validate_manifest(set_path(TINY, path, value))
    assert problem in str(err.value)


def test_bounds_count_characters_as_the_api_server_does() -> None:
    schema = openapi_schema()["properties"]["spec"]
    assert bound_problems({"image": "\u00e9" * STRING_MAX}, schema) == []
    assert bound_problems({"image": "\u00e9" * (STRING_MAX + 1)}, schema)


@pytest.mark.parametrize("model", [DELETE, {}, {"dtype": "bfloat16"}])
def test_a_manifest_without_a_model_is_refused_naming_spec_model_path(model: Any) -> None:
    """No silent default: a job that forgets `model` would have trained the built-in tiny model
    and reported Succeeded."""
    with pytest.raises(SpecError) as err:
        validate_manifest(set_path(TINY, "spec.model", model))
    (problem,) = err.value.problems
    assert problem.path == "spec.model.path"
    assert "builtin:tiny-llama" in problem.fix and "Hugging Face" in problem.fix


def test_the_crd_requires_the_model_and_its_path() -> None:
    spec = openapi_schema()["properties"]["spec"]
    assert "model" in spec["required"]
    assert spec["properties"]["model"]["required"] == ["path"]
    assert "default" not in spec["properties"]["model"]["properties"]["path"]
    assert PPOJobSpec.model_fields["model"].is_required()


def test_name_rules_use_the_python_limit() -> None:
    from ppojob_api.metadata import _DNS1035, MAX_NAME_LENGTH

    name = openapi_schema()["properties"]["metadata"]["properties"]["name"]
    rules = [r["rule"] for r in name["x-kubernetes-validations"]]
    assert f"self.size() <= {MAX_NAME_LENGTH}" in rules
    (pattern,) = re.findall(r"matches\('([^']*)'\)", " ".join(rules))
    assert pattern == _DNS1035.pattern
