"""Judging a manifest the way a user meets it (issue 23): `ppojob validate`'s verdict, timed,
and whether a refusal is clear. Shared by the generated corpus (tests/cli/test_bad_input_corpus.py)
and the hand-written batch (bench/bad_input_batch.py).

A refusal is *clear* when every problem is one line with a fix and names a field that exists:
a key written in the input, or a field of the PPOJob schema (a required or defaulted one the
checks judge), or the file/document itself (`<file>`, `<document>`). A verdict that is neither an
acceptance nor a SpecError (a traceback) is a crash."""

from __future__ import annotations

import re
import tempfile
import time
import traceback
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from ppojob_api.problems import SpecError
from ppojob_api.setflags import parse_set
from ppojob_api.validation import _schema, load_manifests, load_trainer_config

_PART = re.compile(r"([^.\[\]]+)|\[(\d+)\]")


@dataclass
class Verdict:
    kind: str  # "accepted", "clear", "unclear" or "crash"
    seconds: float
    lines: list[str] = field(default_factory=list)
    why: str = ""


def split_path(path: str) -> list[str | int]:
    """`spec.roles.actor.nodeSelector.nvidia.com/gpu` -> keys; list indices as ints. Keys of a
    free-form map may hold dots, so callers try both readings (see `names_a_field`)."""
    return [int(m.group(2)) if m.group(2) else m.group(1) for m in _PART.finditer(path)]


def _in_doc(doc: Any, parts: list[str | int]) -> bool:
    if not parts:
        return True
    head, rest = parts[0], parts[1:]
    if isinstance(doc, list) and isinstance(head, int):
        return head < len(doc) and _in_doc(doc[head], rest)
    if isinstance(doc, dict):
        # a key may contain dots (nodeSelector: {nvidia.com/gpu.product: x})
        for n in range(len(rest) + 1, 0, -1):
            key = ".".join(str(p) for p in parts[:n])
            if key in doc or (key.isdigit() and int(key) in doc):
                value = doc.get(key, doc.get(int(key)) if key.isdigit() else None)
                if _in_doc(value, parts[n:]):
                    return True
    return False


def _in_schema(schema: dict[str, Any] | None, parts: list[str | int]) -> bool:
    for part in parts:
        if schema is None:
            return False
        if isinstance(part, int):
            schema = schema.get("items")
            continue
        props = schema.get("properties") or {}
        if part in props:
            schema = props[part]
        else:  # a key of a free-form map, or no field at all
            free = schema.get("x-kubernetes-preserve-unknown-fields")
            return bool(free or isinstance(schema.get("additionalProperties"), dict))
    return schema is not None


def names_a_field(path: str, docs: list[Any], text: str = "") -> bool:
    """Whether a problem's path names a field of the input, of the schema, or the file."""
    index, where = 0, path
    m = re.match(r"document (\d+): (.*)", path)
    if m:
        index, where = int(m.group(1)) - 1, m.group(2)
    if where.startswith("<") or where.startswith("--"):
        return True
    doc = docs[index] if 0 <= index < len(docs) else None
    parts = split_path(where)
    if _in_doc(doc, parts):
        return True
    if not docs and parts and all(f"{p}:" in text for p in parts if isinstance(p, str)):
        return True  # a document no loader builds (a recursive alias): its keys as written
    if parts and parts[0] == "metadata":
        return len(parts) == 1 or parts[1] in ("name", "generateName", "namespace")
    return _in_schema(_schema(), parts)


def judge(text: str | bytes, sets: Sequence[str] = (), unsets: Sequence[str] = ()) -> Verdict:
    """`ppojob validate`'s verdict on `text` (with `--set` items `sets` and `--unset` keys
    `unsets`), timed, and what a user would make of it."""
    t0 = time.monotonic()
    try:
        if isinstance(text, bytes):
            text = text.decode()
        parsed = [parse_set(s) for s in sets]
        jobs = load_manifests(text, source="m.yaml", sets=parsed, unsets=unsets)
    except UnicodeDecodeError:
        return Verdict("clear", time.monotonic() - t0, ["not UTF-8 (the CLI says so)"])
    except SpecError as exc:
        seconds = time.monotonic() - t0
        lines = [str(p) for p in exc.problems]
        try:
            # keys as written (`on:` is the key "on" here, not True)
            docs = [d for d in yaml.load_all(text, Loader=yaml.BaseLoader) if d not in (None, "")]
            if sets or unsets:  # the fields a --set adds are fields of the input too
                docs = [_with_sets(d, sets) for d in docs]
        except Exception:  # the YAML itself is broken: the problem names <file>
            docs = []
        for p in exc.problems:
            if "\n" in str(p).strip() or not p.fix or not p.message:
                return Verdict("unclear", seconds, lines, f"not one line with a fix: {p}")
            if not names_a_field(p.path, docs, text):
                return Verdict("unclear", seconds, lines, f"names no field of the input: {p}")
        return Verdict("clear", seconds, lines)
    except BaseException:  # a traceback is the finding
        return Verdict("crash", time.monotonic() - t0, [], traceback.format_exc())
    seconds = time.monotonic() - t0
    why = trainer_refusal(jobs)
    return Verdict("accepted" if not why else "crash", seconds, [], why)


def _with_sets(doc: Any, sets: Sequence[str]) -> Any:
    if not isinstance(doc, dict):
        return doc
    for item in sets:
        key = item.partition("=")[0].strip()
        parts = key.split(".")
        node = doc.setdefault("metadata" if parts[0] == "metadata" else "spec", {})
        for part in parts[1:] if parts[0] in ("spec", "metadata") else parts:
            if not isinstance(node, dict):
                break
            node = node.setdefault(part, {})
    return doc


def trainer_refusal(jobs: list[Any]) -> str:
    """Why the trainer's loader refuses what validate accepted (the ConfigMap the operator
    renders, read by `ppojob-train --config`), or ""."""
    from ppojob_operator.builders import trainer_config_yaml

    for job in jobs:
        with tempfile.TemporaryDirectory() as tmp:
            path = Path(tmp) / "trainer.yaml"
            path.write_text(trainer_config_yaml(job))
            try:
                load_trainer_config(path)
            except SpecError as exc:
                return f"validate accepts, the trainer's loader refuses: {exc}"
    return ""
