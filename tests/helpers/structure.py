"""Function lengths of a module, parsed with ``ast`` (the structure tests of the operator's
reconcile modules and of the trainer's driver package). A function's length is its ``def`` span:
end_lineno - lineno + 1."""

from __future__ import annotations

import ast
from pathlib import Path


def function_lengths(path: Path) -> list[tuple[str, int]]:
    """Every function (nested ones and methods too) of the module at ``path``: (qualified name,
    lines), in the order they appear."""
    tree = ast.parse(path.read_text())
    out: list[tuple[str, int]] = []

    def walk(node: ast.AST, prefix: str) -> None:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef)):
                name = f"{prefix}{child.name}"
                assert child.end_lineno is not None
                out.append((name, child.end_lineno - child.lineno + 1))
                walk(child, f"{name}.")
            elif isinstance(child, ast.ClassDef):
                walk(child, f"{prefix}{child.name}.")
            else:
                walk(child, prefix)

    walk(tree, "")
    return out


OUR_PACKAGES = ("ppojob_trainer", "ppojob_api", "ppojob_cli")


class ConfigTrail:
    """The path one run's config takes through our modules, as a newcomer reading it follows it:
    from the first call of ``start`` (a function name, e.g. ``train_locally``) that receives the
    config, every call in our packages one of whose arguments is the config or a part of it (any
    pydantic model reachable from it), until the first call of ``until`` (e.g. the trainer's
    ``step``). A module is *visited* once per distinct function of it entered from another module
    (a call from inside the same module, or the same function entered again, is not a new visit).
    Used as ``sys.setprofile(trail)`` around the run, in the calling thread."""

    def __init__(self, start: str, until: tuple[str, str]) -> None:
        self.start, self.until = start, until
        self.ids: set[int] | None = None
        self.done = False
        self.calls: list[tuple[str, str, str]] = []
        """(module, function, calling module) of every call that carried the config."""

    def _collect(self, obj: object, seen: set[int]) -> None:
        from pydantic import BaseModel

        if isinstance(obj, BaseModel) and id(obj) not in seen:
            seen.add(id(obj))
            for name in type(obj).model_fields:
                self._collect(getattr(obj, name), seen)
        elif isinstance(obj, (list, tuple)):
            for item in obj:
                self._collect(item, seen)
        elif isinstance(obj, dict):
            for item in obj.values():
                self._collect(item, seen)

    def __call__(self, frame: object, event: str, arg: object) -> None:
        if self.done or event != "call":
            return
        module = frame.f_globals.get("__name__", "")  # type: ignore[attr-defined]
        if not module.startswith(OUR_PACKAGES):
            return
        code = frame.f_code  # type: ignore[attr-defined]
        names = code.co_varnames[: code.co_argcount + code.co_kwonlyargcount]
        args = [frame.f_locals.get(n) for n in names]  # type: ignore[attr-defined]
        if self.ids is None:
            if code.co_name != self.start:
                return
            self.ids = set()
            for value in args:
                self._collect(value, self.ids)
        if (module.rsplit(".", 1)[-1], code.co_name) == self.until:
            self.done = True
            return
        if not any(id(v) in self.ids for v in args):
            return
        caller = frame.f_back  # type: ignore[attr-defined]
        while caller is not None and not caller.f_globals.get("__name__", "").startswith(
            OUR_PACKAGES
        ):
            caller = caller.f_back
        calling = caller.f_globals.get("__name__", "") if caller is not None else ""
        self.calls.append((module, code.co_name, calling))

    def visits(self) -> dict[str, int]:
        """Module -> its visits (distinct functions entered from another module)."""
        entered: dict[str, set[str]] = {}
        for module, function, calling in self.calls:
            if calling != module:
                entered.setdefault(module, set()).add(function)
        return {m: len(f) for m, f in sorted(entered.items(), key=lambda kv: -len(kv[1]))}
