"""Problems: what is wrong with a spec, where, and how to fix it; and pydantic's errors as
Problems with camelCase field paths."""

from __future__ import annotations

import difflib
import re
from dataclasses import dataclass
from typing import Any, Literal, get_args, get_origin

from pydantic import BaseModel

from ppojob_api.base import HOOK_PATTERN, NAME_PATTERN, URL_PATTERN


@dataclass(frozen=True)
class Problem:
    """One thing wrong with a spec: where, what, and how to fix it."""

    path: str
    message: str
    fix: str = ""

    def __str__(self) -> str:
        return f"{self.path}: {self.message}" + (f" (fix: {self.fix})" if self.fix else "")


_MODEL_PATH = Problem(
    "spec.model.path",
    "required field is missing: a PPOJob names the model it trains (there is no default model)",
    "set spec.model.path to a model directory or a Hugging Face id such as "
    "Qwen/Qwen2.5-0.5B-Instruct, or to builtin:tiny-llama for the CPU demo",
)
REQUIRED: dict[str, Problem] = {"spec.model": _MODEL_PATH, "spec.model.path": _MODEL_PATH}
"""Required fields whose absence gets its own words and fix (by the path pydantic reports)."""


class SpecError(ValueError):
    """Every problem found in a spec, raised together."""

    def __init__(self, problems: list[Problem], source: str = "") -> None:
        self.problems = list(problems)
        self.source = source
        head = f"{source}: " if source else ""
        lines = "\n".join(f"  - {p}" for p in self.problems)
        super().__init__(f"{head}{len(self.problems)} problem(s):\n{lines}")


def pydantic_problems(exc: Exception, prefix: str = "") -> list[Problem]:
    """Turn a pydantic ValidationError into Problems with camelCase field paths."""
    problems = []
    for err in exc.errors():  # type: ignore[attr-defined]
        loc, _ = _resolve(exc, tuple(err["loc"]))
        parts = [prefix] if prefix else []
        for part in loc:
            if isinstance(part, int):
                parts[-1:] = [f"{parts[-1]}[{part}]"] if parts else [f"[{part}]"]
            elif not (isinstance(part, str) and "[" in part and part.endswith("]")):
                parts.append(str(part))
        kind = err["type"]
        ctx = err.get("ctx") or {}
        if kind in ("union_tag_invalid", "union_tag_not_found"):
            parts.append(str(ctx.get("discriminator", "type")).strip("'"))
        path = ".".join(parts) or prefix or "<root>"
        if kind == "extra_forbidden":
            key = str(err["loc"][-1]) if err["loc"] else ""
            if _norm(key) in _CREDENTIAL_KEYS and "secretRef" in _siblings(exc, err["loc"]):
                problems.append(
                    Problem(
                        path,
                        "credentials never go in a PPOJob (whoever can read the job could read "
                        "them)",
                        "put the value in a Secret (e.g. under the key WANDB_API_KEY or "
                        "MLFLOW_TRACKING_TOKEN) and name the Secret in secretRef",
                    )
                )
            else:
                problems.append(Problem(path, "unknown field", _unknown_field_fix(exc, err["loc"])))
        elif kind == "missing":
            problems.append(
                REQUIRED.get(path) or Problem(path, "required field is missing", "add it")
            )
        elif kind == "union_tag_invalid":
            problems.append(
                Problem(
                    path,
                    f"unknown type {ctx.get('tag')!r}",
                    f"use one of {ctx.get('expected_tags')}",
                )
            )
        elif kind == "union_tag_not_found":
            problems.append(
                Problem(
                    path,
                    "required field is missing",
                    f"add it: one of {_tags(exc, tuple(err['loc']), parts[-1])}",
                )
            )
        else:
            got = err.get("input")
            shown = repr(got) if not isinstance(got, dict | list) else type(got).__name__
            got_part = "" if kind == "k8s_quantity" else f" (got {shown[:80]})"  # it says
            problems.append(Problem(path, f"{err['msg']}{got_part}", _fix_for(err)))
    return problems


_CREDENTIAL_KEYS = {
    "token",
    "apikey",
    "apitoken",
    "accesstoken",
    "password",
    "secret",
    "key",
    "wandbapikey",
    "mlflowtrackingtoken",
    "mlflowtrackingpassword",
}
"""Keys (normalised) refused with a pointer to secretRef where an object has one."""


def _models_in(annotation: Any) -> list[type[BaseModel]]:
    """Every API model a field's annotation holds (a union's members, list items, ...)."""
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return [annotation]
    return [m for arg in get_args(annotation) for m in _models_in(arg)]


def _tag_of(model: type[BaseModel], part: Any) -> bool:
    """Whether `part` is the tag of `model` in a discriminated union (the value of one of its
    Literal fields), which pydantic puts in an error's location."""
    if not isinstance(part, str) or any(
        part in (n, f.alias) for n, f in model.model_fields.items()
    ):
        return False
    return any(
        get_origin(f.annotation) is Literal and part in get_args(f.annotation)
        for f in model.model_fields.values()
    )


def _resolve(exc: Exception, loc: tuple[Any, ...]) -> tuple[tuple[Any, ...], list[type[BaseModel]]]:
    """`loc` without the tags of discriminated unions, and the model(s) it ends at."""
    root = _model_named(getattr(exc, "title", ""))
    models: list[type[BaseModel]] = [root] if root is not None else []
    out: list[Any] = []
    for part in loc:
        if isinstance(part, int):
            out.append(part)
            continue
        tagged = [m for m in models if len(models) > 1 and _tag_of(m, part)]
        if tagged:
            models = tagged[:1]
            continue
        out.append(part)
        field = next(
            (f for m in models for n, f in m.model_fields.items() if part in (n, f.alias)), None
        )
        models = _models_in(field.annotation) if field is not None else []
    return tuple(out), models


def _tags(exc: Exception, loc: tuple[Any, ...], field: str) -> str:
    """The tags (values of `field`) of the discriminated union at `loc` (resolved)."""
    _, models = _resolve(exc, loc)
    tags = [
        str(get_args(f.annotation)[0])
        for m in models
        for n, f in m.model_fields.items()
        if field in (n, f.alias) and get_origin(f.annotation) is Literal
    ]
    return ", ".join(tags) or "the documented types"


def _norm(key: str) -> str:
    return re.sub(r"[^a-z0-9]", "", key.lower())


def _model_named(name: str) -> type[BaseModel] | None:
    todo: list[type[BaseModel]] = [BaseModel]
    while todo:
        cls = todo.pop()
        if cls.__name__ == name and cls.__module__.startswith("ppojob_api"):
            return cls
        todo += cls.__subclasses__()
    return None


def _model_in(annotation: Any) -> type[BaseModel] | None:
    """The API model a field's annotation holds (directly, optionally, or as list items)."""
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return annotation
    for arg in get_args(annotation):
        found = _model_in(arg)
        if found is not None:
            return found
    return None


def _siblings(exc: Exception, loc: tuple[Any, ...]) -> list[str]:
    """The field names (as written on the wire) of the object holding the unknown key `loc`."""
    model = _model_at(exc, loc[:-1])
    return [] if model is None else [f.alias or n for n, f in model.model_fields.items()]


def _model_at(exc: Exception, loc: tuple[Any, ...]) -> type[BaseModel] | None:
    _, models = _resolve(exc, loc)
    return models[0] if models else None


def _deeper(model: type[BaseModel] | None, key: str, depth: int = 2) -> str | None:
    """The dotted path below `model` of a field named `key` (a key indented too little)."""
    if model is None or depth == 0:
        return None
    for name, field in model.model_fields.items():
        child = _model_in(field.annotation)
        if child is None:
            continue
        alias = field.alias or name
        if any(key == (f.alias or n) for n, f in child.model_fields.items()):
            return alias
        below = _deeper(child, key, depth - 1)
        if below:
            return f"{alias}.{below}"
    return None


def _unknown_field_fix(exc: Exception, loc: tuple[Any, ...]) -> str:
    """How to fix an unknown key: the field's camelCase name when it is another spelling of one
    (the API server knows only that spelling: `kubectl apply` refuses the key or drops it, and
    the job runs with the default), or the nearest field name."""
    key = str(loc[-1]) if loc else ""
    names = _siblings(exc, loc)
    same = [n for n in names if _norm(n) == _norm(key)]
    if same:
        return f"write it as `{same[0]}` (the API server knows only this spelling)"
    if names:
        home = _deeper(_model_at(exc, loc[:-1]), key)
        if home:
            return f"`{key}` is a field of `{home}`: indent it under {home.split('.')[-1]}:"
    near = difflib.get_close_matches(key, names, n=1, cutoff=0.75)
    if near:
        return f"check its spelling: did you mean `{near[0]}`?"
    if names:
        return f"remove it; the fields here are {', '.join(names)}"
    return "remove it or check its spelling"


_TYPE_FIXES = {
    "int_type": "write a whole number, without quotes",
    "int_from_float": "write a whole number",
    "bool_type": "write true or false, without quotes",
    "float_type": "write a number, without quotes",
    "finite_number": "write a finite number (.nan and .inf are not numbers)",
    "string_type": "write a string (quote it)",
    "dict_type": "write a mapping (key: value)",
    "list_type": "write a list",
    "model_type": "write a mapping of this object's fields",
}


def _fix_for(err: dict[str, Any]) -> str:
    if err.get("type") in _TYPE_FIXES:
        return _TYPE_FIXES[err["type"]]
    ctx = err.get("ctx") or {}
    if "fix" in ctx:
        return str(ctx["fix"])
    if "expected" in ctx:
        return f"use one of {ctx['expected']}"
    if "pattern" in ctx:
        if ctx["pattern"] == HOOK_PATTERN:
            return "write it as `package.module:function`"
        if ctx["pattern"] == URL_PATTERN:
            return "write an http:// or https:// URL"
        if ctx["pattern"] == NAME_PATTERN:
            return (
                "use lowercase letters, digits, '-', '_' and '.', starting and ending with a "
                "letter or digit, at most 63 characters"
            )
        return f"match the pattern {ctx['pattern']}"
    for key, word in (("ge", ">="), ("gt", ">"), ("le", "<="), ("lt", "<")):
        if key in ctx:
            return f"use a value {word} {ctx[key]}"
    if err.get("type") == "too_short" and "min_length" in ctx:
        n = ctx["min_length"]
        return f"give at least {n} item{'s' if n != 1 else ''}, or remove the field"
    if err.get("type") == "too_long" and "max_length" in ctx:
        return f"give at most {ctx['max_length']} items"
    return ""
