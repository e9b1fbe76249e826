"""The generated CRD: no drift from the models, structural, documented, consistent columns."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path
from typing import Any

import jsonschema
import yaml

from ppojob_api.crd import build_crd, crd_yaml, structural_schema

ROOT = Path(__file__).resolve().parents[2]
COMMITTED = ROOT / "crds" / "ppojob.io_ppojobs.yaml"


def _schema() -> dict[str, Any]:
    return build_crd()["spec"]["versions"][0]["schema"]["openAPIV3Schema"]


def _walk(node: dict[str, Any], path: str = ""):
    yield path, node
    for name, child in node.get("properties", {}).items():
        yield from _walk(child, f"{path}.{name}")
    if "items" in node:
        yield from _walk(node["items"], f"{path}[]")
    if isinstance(node.get("additionalProperties"), dict):
        yield from _walk(node["additionalProperties"], f"{path}{{}}")


def test_committed_crd_has_no_drift() -> None:
    assert COMMITTED.read_text() == crd_yaml(), "run `make crd` to regenerate the CRD"


def test_cli_prints_the_committed_crd() -> None:
    out = subprocess.run(
        [sys.executable, "-m", "ppojob_cli", "crd"],
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    assert out == COMMITTED.read_text()


def test_schema_is_structural() -> None:
    forbidden = {
        "$ref",
        "anyOf",
        "oneOf",
        "allOf",
        "not",
        "$defs",
        "definitions",
        "const",
        "title",
        "additionalItems",
        "patternProperties",
        "dependencies",
    }
    for path, node in _walk(_schema()):
        assert not forbidden & set(node), f"{path or '<root>'} has {forbidden & set(node)}"
        # untyped only where Kubernetes allows it: int-or-string, or any value (a quantity field
        # takes `cpus: 1.5` and `cpus: "500m"`, as a pod does; its pattern judges strings)
        assert (
            "type" in node
            or node.get("x-kubernetes-int-or-string")
            or (node.get("x-kubernetes-preserve-unknown-fields") and "properties" not in node)
        ), f"{path} untyped"
        if "properties" in node:
            assert "additionalProperties" not in node, path
            assert node.get("type") == "object", path
        if node.get("type") == "object" and "properties" not in node and path != ".metadata":
            assert node.get("x-kubernetes-preserve-unknown-fields") or isinstance(
                node.get("additionalProperties"), dict
            ), f"{path}: a free-form map must be marked"
        if "exclusiveMinimum" in node:
            assert isinstance(node["exclusiveMinimum"], bool) and "minimum" in node, path
        if "default" in node:
            assert node["default"] is not None, path


def test_every_property_is_described() -> None:
    missing = [p for p, n in _walk(_schema()) if p and not n.get("description")]
    # the elements of lists and maps are described by their parent
    missing = [p for p in missing if not p.endswith(("[]", "{}"))]
    # the API server refuses a description on the root `metadata` (tests/cluster installs it)
    assert missing == [".metadata"]


def test_defaults_enums_and_bounds_are_present() -> None:
    spec = _schema()["properties"]["spec"]["properties"]
    algo = spec["algorithm"]["properties"]
    assert algo["advantageEstimator"]["enum"] == [
        "gae",
        "grpo",
        "reinforce_plus_plus",
        "reinforce_plus_plus_baseline",
        "rloo",
    ]
    assert algo["advantageEstimator"]["default"] == "gae"
    assert algo["gamma"] == {**algo["gamma"], "minimum": 0, "maximum": 1, "type": "number"}
    assert algo["dualClip"]["nullable"] is True
    assert algo["dualClip"]["exclusiveMinimum"] is True and algo["dualClip"]["minimum"] == 1
    assert spec["roles"]["properties"]["critic"]["nullable"] is True
    overrides = spec["roles"]["properties"]["critic"]["properties"]["overrides"]
    assert overrides["x-kubernetes-preserve-unknown-fields"] is True
    assert spec["scheduling"]["properties"]["gangScheduler"]["enum"][-1] == "none"
    assert _schema()["required"] == ["spec"]
    assert "image" in _schema()["properties"]["spec"]["required"]


def test_no_enum_is_nullable() -> None:
    """The API server checks a null it keeps (a nullable field) against the enum, which no null
    satisfies: a nullable ``gangScheduler`` refused ``gangScheduler: null``, which `ppojob
    validate` reads as unset. Not nullable, the null is pruned: unset in the stored object too
    (tests/cluster/test_api_agreement.py runs both through the real API server)."""
    enums: list[str] = []

    def walk(node: Any, path: str) -> None:
        if isinstance(node, dict):
            if "enum" in node:
                enums.append(path)
                assert not node.get("nullable"), f"{path}: a nullable enum"
            for key, value in node.items():
                walk(value, f"{path}.{key}")
        elif isinstance(node, list):
            for value in node:
                walk(value, path)

    walk(_schema(), "")
    assert any(p.endswith("gangScheduler") for p in enums), enums
    assert any(p.endswith("effect") for p in enums), enums


def test_defaults_are_valid_under_their_own_schema() -> None:
    for path, node in _walk(_schema()):
        if "default" in node:
            # OpenAPI v3.0 bounds are JSON Schema draft 4's (boolean exclusiveMinimum)
            sub = {k: v for k, v in node.items() if not k.startswith(("x-", "default", "null"))}
            errors = list(jsonschema.Draft4Validator(sub).iter_errors(node["default"]))
            assert errors == [], f"{path}: {errors}"


def test_printer_columns_point_into_the_schema() -> None:
    version = build_crd()["spec"]["versions"][0]
    names = [c["name"] for c in version["additionalPrinterColumns"]]
    assert {"Phase", "Step", "Reward", "GPUs", "Age"} <= set(names)
    schema = version["schema"]["openAPIV3Schema"]
    for column in version["additionalPrinterColumns"]:
        parts = column["jsonPath"].lstrip(".").split(".")
        if parts[0] == "metadata":
            continue
        node = schema
        for part in parts:
            assert part in node.get("properties", {}), column["jsonPath"]
            node = node["properties"][part]
        kind = {"integer": "integer", "number": "number", "string": "string"}[column["type"]]
        assert node["type"] == kind, column


def test_status_subresource_and_names() -> None:
    crd = build_crd()
    assert crd["spec"]["versions"][0]["subresources"] == {"status": {}}
    assert crd["spec"]["names"]["shortNames"] == ["ppo"]
    assert crd["metadata"]["name"] == "ppojobs.ppojob.io"
    assert yaml.safe_load(COMMITTED.read_text()) == crd


def test_structural_conversion_of_optional_refs() -> None:
    raw = {
        "$defs": {"X": {"type": "object", "title": "X", "properties": {"a": {"type": "integer"}}}},
        "type": "object",
        "properties": {
            "x": {
                "anyOf": [{"$ref": "#/$defs/X"}, {"type": "null"}],
                "default": None,
                "description": "an\n x",
            },
            "m": {"type": "object", "additionalProperties": True},
            "p": {"type": "number", "exclusiveMinimum": 0},
        },
    }
    out = structural_schema(raw)
    assert out["properties"]["x"] == {
        "type": "object",
        "properties": {"a": {"type": "integer"}},
        "description": "an x",
        "nullable": True,
    }
    assert out["properties"]["m"] == {
        "type": "object",
        "x-kubernetes-preserve-unknown-fields": True,
    }
    assert out["properties"]["p"] == {"type": "number", "minimum": 0, "exclusiveMinimum": True}
