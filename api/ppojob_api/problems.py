"""Problems: what is wrong with a spec, where, and how to fix it; and pydantic's errors as
Problems with camelCase field paths."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from ppojob_api.base import HOOK_PATTERN, QUANTITY_PATTERN


@dataclass(frozen=True)
class Problem:
    """One thing wrong with a spec: where, what, and how to fix it."""

    path: str
    message: str
    fix: str = ""

    def __str__(self) -> str:
        return f"{self.path}: {self.message}" + (f" (fix: {self.fix})" if self.fix else "")


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
        parts = [prefix] if prefix else []
        for loc in err["loc"]:
            if isinstance(loc, int):
                parts[-1:] = [f"{parts[-1]}[{loc}]"] if parts else [f"[{loc}]"]
            elif not (isinstance(loc, str) and "[" in loc and loc.endswith("]")):
                parts.append(str(loc))
        path = ".".join(parts) or prefix or "<root>"
        kind = err["type"]
        if kind == "extra_forbidden":
            problems.append(Problem(path, "unknown field", "remove it or check its spelling"))
        elif kind == "missing":
            problems.append(Problem(path, "required field is missing", "add it"))
        else:
            got = err.get("input")
            shown = repr(got) if not isinstance(got, dict | list) else type(got).__name__
            problems.append(Problem(path, f"{err['msg']} (got {shown[:80]})", _fix_for(err)))
    return problems


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
    if "expected" in ctx:
        return f"use one of {ctx['expected']}"
    if "pattern" in ctx:
        if ctx["pattern"] == HOOK_PATTERN:
            return "write it as `package.module:function`"
        if ctx["pattern"] == QUANTITY_PATTERN:
            return "use a Kubernetes quantity such as `16Gi`"
        return f"match the pattern {ctx['pattern']}"
    for key, word in (("ge", ">="), ("gt", ">"), ("le", "<="), ("lt", "<")):
        if key in ctx:
            return f"use a value {word} {ctx[key]}"
    return ""
