"""Strict YAML: a duplicate key is an error instead of the last one silently winning, and `1e-5`
is a number (as kubectl and YAML 1.2 read it)."""

from __future__ import annotations

import re
from typing import Any

import yaml

from ppojob_api.problems import Problem, SpecError


class _Loader(getattr(yaml, "CSafeLoader", yaml.SafeLoader)):  # type: ignore[misc]
    """PyYAML's safe loader, reading `1e-5` as a number (as kubectl and YAML 1.2 do)."""


_Loader.add_implicit_resolver(
    "tag:yaml.org,2002:float",
    re.compile(r"^[-+]?(?:[0-9][0-9_]*)(?:\.[0-9_]*)?[eE][-+]?[0-9]+$"),
    list("-+0123456789"),
)
_MERGE = "tag:yaml.org,2002:merge"
_NON_STRING_KEYS = {
    "tag:yaml.org,2002:bool": "a boolean (on, off, yes, no, y, n are booleans in YAML 1.1)",
    "tag:yaml.org,2002:null": "null",
    "tag:yaml.org,2002:int": "a number",
    "tag:yaml.org,2002:float": "a number",
}


MAX_NODES = 100_000
"""The most values a document may hold once its aliases are expanded. A PPOJob manifest has a
few hundred; a small file of nested aliases (an "alias bomb") expands to billions, which every
reader of the document (this check, defaulting, validation) would walk for ever."""
MAX_DEPTH = 64
"""The deepest nesting a document may have (a PPOJob manifest nests about ten levels)."""


class _ShapeError(Exception):
    def __init__(self, problem: Problem) -> None:
        self.problem = problem


def _duplicate_keys(
    node: yaml.Node, path: str, out: list[Problem], stack: set[int], seen_nodes: list[int]
) -> None:
    """Duplicate keys under `node`, following aliases: an alias into its own anchor (a recursive
    document) and a document of more than MAX_NODES values or MAX_DEPTH levels are refused
    (raise _ShapeError) instead of recursing or expanding for ever."""
    where = path or "<document>"
    if id(node) in stack:
        raise _ShapeError(
            Problem(
                where,
                "refers to itself through a YAML alias (an anchor `&name` whose own value "
                "contains `*name`)",
                "write the value out instead of the recursive alias",
            )
        )
    seen_nodes[0] += 1
    if seen_nodes[0] > MAX_NODES:
        raise _ShapeError(
            Problem(
                "<file>",
                f"expands to more than {MAX_NODES:,} values through YAML aliases (`*name`)",
                "write the values out, without aliases of aliases",
            )
        )
    if len(stack) >= MAX_DEPTH:
        raise _ShapeError(
            Problem(where, f"nests more than {MAX_DEPTH} levels deep", "flatten the document")
        )
    if not isinstance(node, yaml.MappingNode | yaml.SequenceNode):
        return
    stack.add(id(node))
    try:
        if isinstance(node, yaml.SequenceNode):
            for i, item in enumerate(node.value):
                _duplicate_keys(item, f"{path}[{i}]", out, stack, seen_nodes)
            return
        seen: dict[Any, int] = {}
        for key_node, value_node in node.value:
            if key_node.tag == _MERGE or not isinstance(key_node, yaml.ScalarNode):
                _duplicate_keys(value_node, path, out, stack, seen_nodes)
                continue
            key = key_node.value
            here = f"{path}.{key}" if path else str(key)
            line = key_node.start_mark.line + 1
            kind = _NON_STRING_KEYS.get(key_node.tag)
            if kind:  # a plain key YAML resolves to another type (quoted keys are strings)
                out.append(
                    Problem(
                        here,
                        f"the key `{key}` (line {line}) is read as {kind}, not as the name "
                        f"`{key}` (YAML 1.1, as kubectl reads it)",
                        f'quote the key: "{key}":',
                    )
                )
            if key in seen:
                out.append(
                    Problem(
                        here,
                        f"duplicate key (line {line}; first at line {seen[key]}): YAML keeps only "
                        "one of them",
                        "write each key once; merge the two blocks",
                    )
                )
            else:
                seen[key] = line
            _duplicate_keys(value_node, here, out, stack, seen_nodes)
    finally:
        stack.discard(id(node))


def yaml_problem(exc: yaml.YAMLError, text: str) -> Problem:
    """A YAML syntax error as one line naming the line and column and what to do there: a tab
    is named as a tab, a line indented against its siblings as an indentation problem."""
    mark = getattr(exc, "problem_mark", None)
    what = str(getattr(exc, "problem", None) or exc).split("\n")[0]
    if mark is None:
        return Problem("<file>", f"not valid YAML: {what}", "fix the YAML syntax")
    line, col = mark.line + 1, mark.column + 1
    lines = text.splitlines()
    row = lines[mark.line] if mark.line < len(lines) else ""
    where = f"line {line}, column {col}"
    if "\t" in row[: max(mark.column, 0) + 1] or "tab" in what:
        return Problem(
            "<file>",
            f"{where}: not valid YAML: a tab character (YAML indents with spaces only)",
            f"replace the tab on line {line} with spaces",
        )
    if what.startswith(("did not find expected key", "mapping values are not allowed")):
        shown = row.strip()[:60]
        return Problem(
            "<file>",
            f"{where}: not valid YAML: {what} (`{shown}` or the line above it is indented "
            "differently from its sibling keys, or holds `: ` in an unquoted value)",
            f"check the indentation of lines {max(line - 1, 1)}-{line}, or quote the value",
        )
    if what.startswith("found unexpected end of stream") or "expected ',' or" in what:
        return Problem(
            "<file>",
            f"{where}: not valid YAML: {what} (an unclosed quote or bracket before it)",
            "close the quote or bracket",
        )
    return Problem("<file>", f"{where}: not valid YAML: {what}", f"fix the YAML on line {line}")


def load_yaml_documents(text: str, source: str = "") -> list[Any]:
    """Every document of a YAML stream, read strictly: a duplicate key is an error (naming its
    path and lines) instead of the last one silently winning; `1e-5` is a number. Raises
    SpecError."""
    loader = _Loader(text)
    docs: list[Any] = []
    problems: list[Problem] = []
    try:
        while loader.check_node():
            node = loader.get_node()
            dup: list[Problem] = []
            _duplicate_keys(node, "", dup, set(), [0])
            problems += [Problem(f"{len(docs) + 1}\0{d.path}", d.message, d.fix) for d in dup]
            docs.append(loader.construct_document(node))
    except _ShapeError as exc:
        raise SpecError([exc.problem], source) from None
    except yaml.YAMLError as exc:
        raise SpecError([yaml_problem(exc, text)], source) from None
    finally:
        loader.dispose()
    if problems:
        many = len([d for d in docs if d is not None]) > 1
        shown = []
        for pr in problems:
            index, _, where = pr.path.partition("\0")
            shown.append(
                Problem(f"document {index}: {where}" if many else where, pr.message, pr.fix)
            )
        raise SpecError(shown, source)
    return docs


def load_yaml(text: str, source: str = "") -> Any:
    """The single document of a YAML text, read as strictly as `load_yaml_documents`."""
    docs = load_yaml_documents(text, source)
    return docs[0] if docs else None
