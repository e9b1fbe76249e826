"""`--set KEY=VALUE` / `--unset KEY` of `ppojob run` and `ppojob validate`: spec fields changed
before validation (`KEY` is a dotted path under `spec`, e.g. `algorithm.advantageEstimator`, or
`metadata.name`; `VALUE` is parsed as YAML, so `3e-4`, `true`, `null` and `[1, 2]` have their YAML
types)."""

from __future__ import annotations

import argparse
import copy
import re
from collections.abc import Sequence
from typing import Any

import yaml

from ppojob_api.problems import Problem, SpecError
from ppojob_api.yamlio import yaml_problem

_FLOAT = re.compile(r"^[-+]?(\d+\.?\d*|\.\d+)[eE][-+]?\d+$")


def parse_set(item: str) -> tuple[str, Any]:
    """`a.b.c=value` -> ("a.b.c", parsed value); raises SpecError on a malformed item."""
    key, sep, raw = item.partition("=")
    key = key.strip()
    if not sep or not key:
        raise SpecError(
            [
                Problem(
                    f"--set {item}",
                    "expected KEY=VALUE",
                    "write e.g. --set algorithm.advantageEstimator=grpo",
                )
            ]
        )
    try:
        value = yaml.safe_load(raw) if raw.strip() else ""
    except yaml.YAMLError as exc:
        found = yaml_problem(exc, raw)  # one line: "line 1, column 16: not valid YAML: ..."
        raise SpecError(
            [
                Problem(
                    f"--set {key}",
                    f"value {raw[:60]!r}, {found.message}",
                    f"{found.fix}, or quote a string, e.g. --set 'data.prompts=\"a b.jsonl\"'",
                )
            ]
        ) from None
    if isinstance(value, str) and _FLOAT.match(value.strip()):
        value = float(value)  # YAML 1.1 reads 3e-4 (no dot) as a string
    return key, value


def _path(key: str) -> tuple[str, list[str]]:
    """(`spec` or `metadata`, the dotted path under it): `metadata.name` is the job's name,
    anything else a field under spec (a leading `spec.` is optional)."""
    parts = key.split(".")
    root = "spec"
    if parts and parts[0] in ("spec", "metadata"):
        root, parts = parts[0], parts[1:]
    if not parts or any(not p for p in parts):
        raise SpecError(
            [
                Problem(
                    f"--set {key}",
                    "empty path segment",
                    "write a dotted path under spec, e.g. training.steps",
                )
            ]
        )
    if root == "spec" and parts[0] in ("apiVersion", "kind", "status"):
        raise SpecError(
            [
                Problem(
                    f"--set {key}",
                    f"{parts[0]} is not a spec field",
                    "set fields under spec (training.steps) or metadata (metadata.name)",
                )
            ]
        )
    return root, parts


def apply_spec_overrides(
    doc: dict[str, Any], sets: Sequence[tuple[str, Any]] = (), unsets: Sequence[str] = ()
) -> dict[str, Any]:
    """A copy of `doc` with `spec.<key>` (or `metadata.<key>`) set or removed for each override;
    an --unset of a field the manifest does not have is an error (nothing would change)."""
    out = copy.deepcopy(doc)
    for root in ("spec", "metadata"):
        if not isinstance(out.get(root), dict):
            out[root] = {} if out.get(root) is None else out[root]
    problems: list[Problem] = []
    for key in unsets:
        root, parts = _path(key)
        node: Any = out[root]
        for part in parts[:-1]:
            node = node.get(part) if isinstance(node, dict) else None
        if isinstance(node, dict) and parts[-1] in node:
            node.pop(parts[-1])
        else:
            problems.append(
                Problem(
                    f"--unset {key}",
                    f"the manifest has no {root}.{'.'.join(parts)} (nothing to unset)",
                    "check the path: a dotted path of a field written in the manifest, e.g. "
                    "training.steps",
                )
            )
    for key, value in sets:
        root, parts = _path(key)
        node = out[root]
        for i, part in enumerate(parts[:-1]):
            nxt = node.get(part) if isinstance(node, dict) else None
            if nxt is None and isinstance(node, dict):
                nxt = node[part] = {}
            if not isinstance(nxt, dict):
                where = f"{root}." + ".".join(parts[: i + 1])
                problems.append(
                    Problem(
                        f"--set {key}",
                        f"{where} is a {type(nxt).__name__}, not a mapping",
                        "set a field of a mapping",
                    )
                )
                break
            node = nxt
        else:
            if isinstance(node, dict):
                node[parts[-1]] = value
            else:
                problems.append(Problem(f"--set {key}", f"{root} is not a mapping", ""))
    if problems:
        raise SpecError(problems)
    return out


def add_set_arguments(parser: argparse.ArgumentParser, what: str = "set") -> None:
    """``--set KEY=VALUE`` and ``--unset KEY`` (into ``sets`` and ``unsets``) of a command;
    ``what`` starts their help ("set" for run, "check every job with" for validate)."""
    parser.add_argument(
        "--set",
        dest="sets",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help=f"{what} a spec field set before validation, e.g. --set "
        "algorithm.advantageEstimator=grpo (VALUE is YAML; repeatable)",
    )
    parser.add_argument(
        "--unset",
        dest="unsets",
        action="append",
        default=[],
        metavar="KEY",
        help=f"{what} a spec field removed (it takes its default), e.g. --unset roles.critic; "
        "repeatable",
    )
