"""Structure checks for ``raycl/``: import circles, imports out of the ground floor, long
functions, large files.

The ground floor (:data:`FLOORS`: ``raycl/config/``, the schema every room imports) imports no
other raycl package. Every import between raycl's modules counts, lazy imports inside functions
and imports under ``TYPE_CHECKING`` included: ``import raycl.a.b`` and ``from raycl.a import b``
point at the module ``raycl.a.b`` when it is one, else at the package ``raycl.a`` (its
``__init__.py``), as import linters such as grimp count them.

    python tools/structure.py            # prints every problem; exit 1 when there is one

``tests/test_structure.py`` runs the same checks in ``make test``.
"""

from __future__ import annotations

import ast
import sys
from collections.abc import Iterator
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = "raycl"
MAX_FUNCTION_LINES = 80  # docstring included
MAX_FILE_LINES = 500
# Packages that import nothing of raycl outside themselves: what every room stands on.
FLOORS: tuple[str, ...] = ("raycl.config",)


def module_files(root: Path = ROOT) -> dict[str, Path]:
    """Dotted module name -> file, for every module of the package."""
    modules = {}
    for path in sorted((root / PACKAGE).rglob("*.py")):
        parts = list(path.relative_to(root).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts = parts[:-1]
        modules[".".join(parts)] = path
    return modules


def _resolve(name: str, modules: dict[str, Path]) -> str | None:
    """The module an import of ``name`` executes last: itself, or its nearest package."""
    while name and name not in modules:
        name = name.rpartition(".")[0]
    return name or None


def _imported_names(tree: ast.AST, module: str, is_package: bool) -> Iterator[str]:
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            yield from (alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            if node.level:  # relative: from .x import y
                base = module.split(".")
                base = base if is_package else base[:-1]
                base = base[: len(base) - (node.level - 1)]
                stem = ".".join([*base, node.module] if node.module else base)
            else:
                stem = node.module or ""
            # ``from a import b`` points at the module a.b when b is one, else at a
            # (:func:`_resolve` falls back to the nearest module or package).
            yield from (f"{stem}.{alias.name}" for alias in node.names)


def import_graph(root: Path = ROOT) -> dict[str, set[str]]:
    """Module -> the raycl modules it imports (anywhere in its file)."""
    modules = module_files(root)
    graph: dict[str, set[str]] = {}
    for module, path in modules.items():
        tree = ast.parse(path.read_text(), str(path))
        targets = set()
        for name in _imported_names(tree, module, path.name == "__init__.py"):
            if name == PACKAGE or name.startswith(PACKAGE + "."):
                target = _resolve(name, modules)
                if target and target != module:
                    targets.add(target)
        graph[module] = targets
    return graph


def import_cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan), each sorted."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    components: list[list[str]] = []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        on_stack.add(node)
        for target in sorted(graph.get(node, ())):
            if target not in index:
                visit(target)
                low[node] = min(low[node], low[target])
            elif target in on_stack:
                low[node] = min(low[node], index[target])
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

    sys.setrecursionlimit(max(10_000, sys.getrecursionlimit()))
    for node in sorted(graph):
        if node not in index:
            visit(node)
    return sorted(components)


def floor_imports(graph: dict[str, set[str]], floors: tuple[str, ...] = FLOORS) -> list[str]:
    """``module -> target`` for every import from a floor package (:data:`FLOORS`) to a raycl
    module outside it (the ``raycl`` package itself included), sorted."""
    def inside(module: str, floor: str) -> bool:
        return module == floor or module.startswith(floor + ".")

    return sorted(f"{module} -> {target}" for module, targets in graph.items()
                  for floor in floors if inside(module, floor)
                  for target in targets if not inside(target, floor))


def long_functions(root: Path = ROOT, limit: int = MAX_FUNCTION_LINES) -> list[str]:
    """``path:line name (N lines)`` for every function or method longer than ``limit`` lines
    (decorators excluded, docstring included)."""
    found = []
    for path in module_files(root).values():
        tree = ast.parse(path.read_text(), str(path))
        for node in ast.walk(tree):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                length = node.end_lineno - node.lineno + 1
                if length > limit:
                    where = path.relative_to(root)
                    found.append(f"{where}:{node.lineno} {node.name} ({length} lines)")
    return found


def large_files(root: Path = ROOT, limit: int = MAX_FILE_LINES) -> list[str]:
    """``path (N lines)`` for every module longer than ``limit`` lines."""
    found = []
    for path in module_files(root).values():
        lines = len(path.read_text().splitlines())
        if lines > limit:
            found.append(f"{path.relative_to(root)} ({lines} lines)")
    return found


def main() -> int:
    graph = import_graph()
    cycles = import_cycles(graph)
    for cycle in cycles:
        print("import circle: " + " <-> ".join(cycle))
    upward = floor_imports(graph)
    for entry in upward:
        print(f"import out of the ground floor: {entry}")
    longs = long_functions()
    for entry in longs:
        print(f"function over {MAX_FUNCTION_LINES} lines: {entry}")
    larges = large_files()
    for entry in larges:
        print(f"file over {MAX_FILE_LINES} lines: {entry}")
    problems = len(cycles) + len(upward) + len(longs) + len(larges)
    print(f"{len(cycles)} import circles, {len(upward)} imports out of the ground floor, "
          f"{len(longs)} long functions, {len(larges)} large files")
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
