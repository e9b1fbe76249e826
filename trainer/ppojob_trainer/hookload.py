"""Loading user hooks (`package.module:function`) and checking how they can be called; imports
neither torch nor Ray, so `ppojob run` checks hooks before it starts Ray (`preflight`) with the
same rule the trainer's workers load them with."""

from __future__ import annotations

import importlib
import inspect
from collections.abc import Callable
from typing import Any

__all__ = ["call_problem", "load_function"]


def load_function(path: str, field: str) -> Callable[..., Any]:
    """Import ``"pkg.module:function"`` (the attribute may be dotted: ``"mod:Class.method"``).

    Every failure is a ``ValueError`` naming ``field`` (the config field the path came from),
    the path and what is wrong: malformed path, module not importable (with the import error),
    attribute missing, or not callable.
    """
    where = f"{field}: {path!r}"
    if not isinstance(path, str):
        raise ValueError(f"{field}: expected a 'module:function' string, got {path!r}")
    module_name, sep, attr = path.partition(":")
    parts = attr.split(".")
    if (
        not sep
        or ":" in attr
        or not module_name
        or any(not p.isidentifier() for p in module_name.split("."))
        or any(not p.isidentifier() for p in parts)
    ):
        raise ValueError(
            f"{where} is malformed; expected 'package.module:function' "
            f"(dotted module path, a colon, then a function name)"
        )
    try:
        obj: Any = importlib.import_module(module_name)
    except Exception as exc:
        raise ValueError(
            f"{where}: cannot import module {module_name!r}: {type(exc).__name__}: {exc}"
        ) from exc
    for i, part in enumerate(parts):
        if not hasattr(obj, part):
            owner = ".".join([module_name, *parts[:i]])
            raise ValueError(f"{where}: {owner!r} has no attribute {part!r}")
        obj = getattr(obj, part)
    if not callable(obj):
        raise ValueError(f"{where}: {attr!r} is not callable (it is a {type(obj).__name__})")
    return obj


def call_problem(
    fn: Callable[..., Any], args: tuple[Any, ...], kwargs: dict[str, Any], call: str
) -> str | None:
    """Why `fn` cannot be called as the trainer calls it (`call`, e.g.
    "fn(prompts, completions, labels)"), or None; a function whose signature Python cannot read
    (a builtin) passes."""
    try:
        sig = inspect.signature(fn)
    except (TypeError, ValueError):
        return None
    try:
        sig.bind(*args, **kwargs)
    except TypeError as exc:
        return f"its signature {sig} does not take the call {call} ({exc})"
    return None
