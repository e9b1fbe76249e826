"""Generate the PPOJob API reference (docs/reference.md) from the typed models.

Walks `PPOJob`'s fields recursively and writes one section per type, in the order the types first
appear, with every field's wire name (alias), type, default, bounds/enums/patterns and description
(the field's docstring, the same text `kubectl explain` shows). A test regenerates the page and
fails on any drift, so the reference can never disagree with the CRD.

    python -m ppojob_api.reference > docs/reference.md
"""

from __future__ import annotations

import json
import sys
import types
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal, get_args, get_origin

from pydantic import BaseModel
from pydantic.fields import FieldInfo

from ppojob_api import crd
from ppojob_api.crd import PRINTER_COLUMNS
from ppojob_api.spec import (
    API_VERSION,
    GROUP,
    KIND,
    PHASES,
    PLURAL,
    SHORT_NAMES,
    VERSION,
    ObjectMeta,
    PPOJob,
    PPOJobSpec,
)
from ppojob_api.training import TrainingHalf

DEFAULT_PATH = Path(__file__).resolve().parents[2] / "docs" / "reference.md"
_K8S_META = "https://kubernetes.io/docs/reference/kubernetes-api/common-definitions/object-meta/"


@dataclass
class _Type:
    model: type[BaseModel]
    paths: list[str] = field(default_factory=list)


def _one_line(text: str | None) -> str:
    return " ".join((text or "").split())


def _cell(text: str) -> str:
    """Make text safe inside a Markdown table cell."""
    return text.replace("|", "\\|")


def _unwrap_optional(annotation: Any) -> tuple[Any, bool]:
    origin = get_origin(annotation)
    if origin in (typing.Union, types.UnionType):
        args = [a for a in get_args(annotation) if a is not type(None)]
        if len(args) == 1:
            return args[0], True
    return annotation, False


def _is_model(annotation: Any) -> bool:
    return isinstance(annotation, type) and issubclass(annotation, BaseModel)


def _anchor(model: type[BaseModel]) -> str:
    return model.__name__.lower()


_SCALARS = {str: "string", int: "integer", float: "number", bool: "boolean"}


def _type_name(annotation: Any) -> str:
    """A Kubernetes-style type name, with a link for nested models."""
    annotation, _ = _unwrap_optional(annotation)
    origin = get_origin(annotation)
    if annotation is ObjectMeta:
        return f"[ObjectMeta]({_K8S_META})"
    if origin is typing.Annotated:
        return _type_name(get_args(annotation)[0])
    if origin in (typing.Union, types.UnionType):  # a discriminated union of models
        return "one of " + ", ".join(_type_name(a) for a in get_args(annotation))
    if _is_model(annotation):
        return f"[{annotation.__name__}](#{_anchor(annotation)})"
    if origin is Literal:
        kinds = {type(v) for v in get_args(annotation)}
        return "string (enum)" if kinds == {str} else "enum"
    if origin is list:
        (item,) = get_args(annotation)
        return f"[]{_type_name(item)}"
    if origin is dict:
        key, value = get_args(annotation)
        if value is Any:
            return "object (free-form)"
        return f"map[{_type_name(key)}]{_type_name(value)}"
    if annotation is Any:
        return "any"
    return _SCALARS.get(annotation, getattr(annotation, "__name__", str(annotation)))


def _nested_models(annotation: Any) -> list[type[BaseModel]]:
    annotation, _ = _unwrap_optional(annotation)
    if annotation is ObjectMeta:
        return []
    if _is_model(annotation):
        return [annotation]
    return [m for arg in get_args(annotation) for m in _nested_models(arg)]


def _suffix(annotation: Any) -> str:
    """Path suffix for list items and map values."""
    annotation, _ = _unwrap_optional(annotation)
    origin = get_origin(annotation)
    if origin is list:
        return "[]"
    if origin is dict:
        return ".<key>"
    return ""


def _format_value(value: Any) -> str:
    if isinstance(value, BaseModel):
        return "(see type)"
    return f"`{json.dumps(value)}`"


def _default(info: FieldInfo) -> str:
    if info.is_required():
        return "**required**"
    if info.default_factory is not None:
        return _format_value(info.default_factory())  # type: ignore[call-arg]
    if info.default is None:
        return "unset"
    return _format_value(info.default)


def _constraints(info: FieldInfo, annotation: Any) -> str:
    parts: list[str] = []
    inner, _ = _unwrap_optional(annotation)
    if get_origin(inner) is Literal:
        parts.append("one of " + ", ".join(f"`{v}`" for v in get_args(inner)))
    for meta in info.metadata:
        for attr, word in (("ge", ">="), ("gt", ">"), ("le", "<="), ("lt", "<")):
            value = getattr(meta, attr, None)
            if value is not None:
                parts.append(f"{word} {value}")
        if getattr(meta, "min_length", None) is not None:
            parts.append(f"min length {meta.min_length}")
        if getattr(meta, "max_length", None) is not None:
            parts.append(f"max length {meta.max_length}")
        if getattr(meta, "pattern", None) is not None:
            parts.append(f"pattern `{meta.pattern}`")
    extra = info.json_schema_extra
    if isinstance(extra, dict) and extra.get("x-kubernetes-preserve-unknown-fields"):
        parts.append("unknown keys preserved")
    return "; ".join(parts)


def _collect(root: type[BaseModel], path: str) -> dict[type[BaseModel], _Type]:
    """Every model reachable from root, in first-appearance (depth-first) order, with paths."""
    found: dict[type[BaseModel], _Type] = {}

    def visit(model: type[BaseModel], where: str) -> None:
        seen = model in found
        found.setdefault(model, _Type(model)).paths.append(where)
        if seen:
            return
        for name, info in model.model_fields.items():
            wire = info.alias or name
            sub = f"{where}.{wire}" if where else wire
            sub += _suffix(info.annotation)
            for nested in _nested_models(info.annotation):
                visit(nested, sub)

    visit(root, path)
    return found


def _description(model: type[BaseModel], wire: str, info: FieldInfo) -> str:
    if info.description:
        return _one_line(info.description)
    if model is PPOJob:  # the standard top-level fields carry the CRD's descriptions
        return getattr(crd, "_TOP_DESCRIPTIONS", {}).get(wire, "")
    return ""


def _field_table(model: type[BaseModel]) -> list[str]:
    lines = [
        "| Field | Type | Default | Validation | Description |",
        "|---|---|---|---|---|",
    ]
    for name, info in model.model_fields.items():
        wire = info.alias or name
        lines.append(
            "| "
            + " | ".join(
                _cell(c)
                for c in (
                    f"`{wire}`",
                    _type_name(info.annotation),
                    _default(info),
                    _constraints(info, info.annotation),
                    _description(model, wire, info),
                )
            )
            + " |"
        )
    return lines


def reference_markdown() -> str:
    """The whole reference page."""
    types_ = _collect(PPOJob, "")
    out: list[str] = [
        "<!-- Generated by `python -m ppojob_api.reference` from ppojob_api/spec.py",
        "     and ppojob_api/training.py (its parts in ppojob_api/trainspec/). Do not edit by",
        "     hand: tests/chart/test_docs.py fails on drift. -->",
        "",
        f"# {KIND} API reference ({API_VERSION})",
        "",
        _one_line(PPOJob.__doc__),
        "",
        f"- Group: `{GROUP}`, version: `{VERSION}`, kind: `{KIND}`, namespaced",
        f"- Plural: `{PLURAL}`; short names: {', '.join(f'`{s}`' for s in SHORT_NAMES)}"
        f" (`kubectl get {SHORT_NAMES[0]}`)",
        "- Field names below are the names in YAML (camelCase). `kubectl explain "
        f"{PLURAL}.spec.<field>` prints the same descriptions.",
        "- Validation: the API server enforces types, enums, bounds and patterns (from the CRD); "
        "`ppojob validate FILE` and the operator additionally check rules that span fields and "
        "report every problem with its field path.",
        "",
        "## Columns of `kubectl get ppojobs`",
        "",
        "| Column | JSON path | Shown | Description |",
        "|---|---|---|---|",
    ]
    for col in PRINTER_COLUMNS:
        shown = "with `-o wide`" if col.get("priority", 0) else "always"
        out.append(
            f"| {col['name']} | `{col['jsonPath']}` | {shown} | "
            f"{_cell(col.get('description', 'Time since the job was created'))} |"
        )
    out += [
        "",
        "## Phases",
        "",
        "`status.phase` is one of: " + ", ".join(f"`{p}`" for p in PHASES) + ". See the "
        "[troubleshooting guide](troubleshooting.md) for every condition reason.",
        "",
        "## Types",
        "",
    ]
    for t in types_.values():
        out.append(f"- [{t.model.__name__}](#{_anchor(t.model)})")
    training_fields = set(TrainingHalf.model_fields)
    for t in types_.values():
        model = t.model
        out += ["", f"### {model.__name__}", ""]
        if t.paths != [""]:
            shown = ", ".join(f"`{p}`" for p in dict.fromkeys(t.paths))
            out += [f"Used at: {shown}", ""]
        out += [_one_line(model.__doc__), ""]
        if model is PPOJobSpec:
            half = ", ".join(
                f"`{PPOJobSpec.model_fields[n].alias or n}`"
                for n in PPOJobSpec.model_fields
                if n in training_fields
            )
            out += [
                f"The training half ({half}) is read by the trainer (it is rendered into the "
                "trainer's ConfigMap and is also what `ppojob run` reads locally); the other "
                "fields are the cluster half, read only by the operator.",
                "",
            ]
        out += _field_table(model)
    return "\n".join(out) + "\n"


def write_reference(path: str | Path | None = None) -> Path:
    """Write the reference page (default: docs/reference.md of the source tree)."""
    target = Path(path) if path is not None else DEFAULT_PATH
    target.parent.mkdir(parents=True, exist_ok=True)
    target.write_text(reference_markdown())
    return target


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    if args and args[0] in ("-h", "--help"):
        print(
            "usage: python -m ppojob_api.reference [--write [PATH]]\n"
            "Print the PPOJob API reference (Markdown); --write writes docs/reference.md."
        )
        return 0
    if args and args[0] == "--write":
        print(write_reference(args[1] if len(args) > 1 else None))
        return 0
    sys.stdout.write(reference_markdown())
    return 0


if __name__ == "__main__":
    sys.exit(main())
