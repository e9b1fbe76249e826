"""No import cycle among the four packages, counting imports inside functions too.

import-linter's contracts see module-level imports; a cycle closed by an import inside a function
still makes the modules depend on each other (and a later refactor that hoists the import turns it
into a circular ImportError). This builds the graph with ``ast`` from every ``import`` and
``from ... import`` statement, wherever it sits, and fails naming each cycle.
"""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PACKAGES = {
    "ppojob_api": ROOT / "api" / "ppojob_api",
    "ppojob_operator": ROOT / "operator" / "ppojob_operator",
    "ppojob_trainer": ROOT / "trainer" / "ppojob_trainer",
    "ppojob_cli": ROOT / "cli" / "ppojob_cli",
}


def _modules() -> dict[str, tuple[Path, bool]]:
    """Every module of the four packages: dotted name -> (file, is a package's __init__)."""
    found: dict[str, tuple[Path, bool]] = {}
    for top, directory in PACKAGES.items():
        for path in sorted(directory.rglob("*.py")):
            parts = list(path.relative_to(directory).with_suffix("").parts)
            is_package = parts[-1] == "__init__"
            if is_package:
                parts = parts[:-1]
            found[".".join([top, *parts])] = (path, is_package)
    return found


def _resolve(name: str, known: set[str]) -> str | None:
    """The longest known module that ``name`` is or lies in (``a.b.func`` -> ``a.b``)."""
    while name:
        if name in known:
            return name
        name = name.rpartition(".")[0]
    return None


def import_graph() -> dict[str, set[str]]:
    """Module -> the modules of the four packages it imports (anywhere in its body)."""
    modules = _modules()
    known = set(modules)
    graph: dict[str, set[str]] = {name: set() for name in modules}
    for name, (path, is_package) in modules.items():
        package = name if is_package else name.rpartition(".")[0]
        for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
            targets: list[str] = []
            if isinstance(node, ast.Import):
                targets = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom):
                if node.level:
                    base_parts = package.split(".")
                    base_parts = base_parts[: len(base_parts) - (node.level - 1)]
                    base = ".".join(base_parts)
                    source = f"{base}.{node.module}" if node.module else base
                else:
                    source = node.module or ""
                # `from pkg import mod` names the module pkg.mod; `from mod import func` names mod.
                for alias in node.names:
                    submodule = f"{source}.{alias.name}"
                    targets.append(submodule if submodule in known else source)
            for target in targets:
                resolved = _resolve(target, known)
                if resolved is not None and resolved != name:
                    graph[name].add(resolved)
    return graph


def find_cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components with more than one module (Tarjan), each sorted."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    components: list[list[str]] = []
    counter = 0

    def visit(start: str) -> None:
        nonlocal counter
        work = [(start, iter(sorted(graph[start])))]
        index[start] = low[start] = counter
        counter += 1
        stack.append(start)
        on_stack.add(start)
        while work:
            node, successors = work[-1]
            advanced = False
            for succ in successors:
                if succ not in index:
                    index[succ] = low[succ] = counter
                    counter += 1
                    stack.append(succ)
                    on_stack.add(succ)
                    work.append((succ, iter(sorted(graph[succ]))))
                    advanced = True
                    break
                if succ in on_stack:
                    low[node] = min(low[node], index[succ])
            if advanced:
                continue
            work.pop()
            if work:
                parent = work[-1][0]
                low[parent] = min(low[parent], low[node])
            if low[node] == index[node]:
                component = []
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    component.append(member)
                    if member == node:
                        break
                if len(component) > 1:
                    components.append(sorted(component))

    for node in sorted(graph):
        if node not in index:
            visit(node)
    return sorted(components)


def _shortest_cycle(graph: dict[str, set[str]], component: list[str]) -> list[str]:
    """One concrete cycle through the component's first module (breadth-first), for the message."""
    members = set(component)
    start = component[0]
    paths = {start: [start]}
    frontier = [start]
    while frontier:
        nxt = []
        for node in frontier:
            for succ in sorted(graph[node] & members):
                if succ == start:
                    return [*paths[node], start]
                if succ not in paths:
                    paths[succ] = [*paths[node], succ]
                    nxt.append(succ)
        frontier = nxt
    return component


def test_graph_sees_the_packages() -> None:
    graph = import_graph()
    assert "ppojob_trainer.driver.trainer" in graph
    assert "ppojob_api.spec" in graph
    # A known edge, so an empty graph cannot pass vacuously.
    assert any(target.startswith("ppojob_api") for target in graph["ppojob_operator.builders"])


def test_no_import_cycles() -> None:
    graph = import_graph()
    cycles = find_cycles(graph)
    message = "\n".join(
        f"cycle among {len(c)} modules: {' -> '.join(_shortest_cycle(graph, c))}" for c in cycles
    )
    assert not cycles, "import cycles:\n" + message
