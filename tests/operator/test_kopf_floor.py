"""The kopf floor in pyproject.toml is a version the operator runs on.

The operator sets ``settings.watching.label_selectors`` (kopf 1.45): on kopf 1.44.0 its start-up
activity fails with "'WatchingSettings' object has no attribute 'label_selectors'" and it never
becomes ready (checked with the 1.44.0 and 1.45.0 wheels: tests/operator/test_integration.py
passes on 1.45.0, hangs at start-up on 1.44.0)."""

from __future__ import annotations

from importlib.metadata import version
from pathlib import Path

import kopf
import tomllib
from packaging.requirements import Requirement

ROOT = Path(__file__).resolve().parents[2]


def kopf_requirement() -> Requirement:
    doc = tomllib.loads((ROOT / "pyproject.toml").read_text())
    deps = doc["project"]["optional-dependencies"]["operator"]
    return next(Requirement(d) for d in deps if Requirement(d).name == "kopf")


def test_the_floor_excludes_kopf_without_label_selectors() -> None:
    spec = kopf_requirement().specifier
    assert "1.44.0" not in spec and "1.45.0" in spec
    assert version("kopf") in spec
    assert hasattr(kopf.OperatorSettings().watching, "label_selectors")
