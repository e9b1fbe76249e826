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
