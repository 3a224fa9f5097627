"""Structure checks for ``raycl/``: import circles, imports out of the ground floor, long
functions, large files, and a thin top level.

The ground floor (:data:`FLOORS`: ``raycl/config/``, the schema every room imports) imports no
other raycl package. Every import between raycl's modules counts, lazy imports inside functions
and imports under ``TYPE_CHECKING`` included: ``import raycl.a.b`` and ``from raycl.a import b``
point at the module ``raycl.a.b`` when it is one, else at the package ``raycl.a`` (its
``__init__.py``), as import linters such as grimp count them.

    python tools/structure.py            # prints every problem; exit 1 when there is one

The top level (:func:`top_level_problems`) holds at most :data:`MAX_TOP_LEVEL_MODULES` modules
beside its packages, each a door or a ground-floor helper: an entry point (``python -m raycl.X``:
it has an ``if __name__ == "__main__":``) of at most :data:`MAX_ENTRY_LINES` lines that parses
its arguments and calls the package that does the work, or a module that imports nothing of
raycl above the ground floor. ``raycl/__init__.py``, the package's face, only has to be short.

``tests/test_structure.py`` runs the same checks in ``make test``.
"""

from __future__ import annotations

import ast
import sys
from collections.abc import Iterator
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = "raycl"
# Lines of code of one function: blank lines, comment lines and its docstring not counted (a
# nested function's lines count toward the function around it too).
MAX_FUNCTION_LINES = 50
MAX_FILE_LINES = 500
MAX_TOP_LEVEL_MODULES = 8  # raycl/*.py, __init__.py included
MAX_ENTRY_LINES = 150
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


def code_lines(node: ast.FunctionDef | ast.AsyncFunctionDef, source: list[str]) -> int:
    """Lines of code of a function: its lines (decorators excluded) less blank lines, comment
    lines and the lines of its docstring."""
    body = node.body
    docstring: range = range(0)
    if (body and isinstance(body[0], ast.Expr) and isinstance(body[0].value, ast.Constant)
            and isinstance(body[0].value.value, str)):
        docstring = range(body[0].lineno, body[0].end_lineno + 1)
    return sum(1 for number in range(node.lineno, node.end_lineno + 1)
               if number not in docstring
               and source[number - 1].strip() and not source[number - 1].lstrip().startswith("#"))


def long_functions(root: Path = ROOT, limit: int = MAX_FUNCTION_LINES) -> list[str]:
    """``path:line name (N lines of code)`` for every function or method with more than
    ``limit`` lines of code (:func:`code_lines`)."""
    found = []
    for path in module_files(root).values():
        text = path.read_text()
        source = text.splitlines()
        for node in ast.walk(ast.parse(text, str(path))):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                length = code_lines(node, source)
                if length > limit:
                    where = path.relative_to(root)
                    found.append(f"{where}:{node.lineno} {node.name} ({length} lines of code)")
    return found


def large_files(root: Path = ROOT, limit: int = MAX_FILE_LINES) -> list[str]:
    """``path (N lines)`` for every module longer than ``limit`` lines."""
    found = []
    for path in module_files(root).values():
        lines = len(path.read_text().splitlines())
        if lines > limit:
            found.append(f"{path.relative_to(root)} ({lines} lines)")
    return found


def _is_entry_point(tree: ast.Module) -> bool:
    """Whether a module runs as a command: a top-level ``if __name__ == "__main__":``."""
    for node in tree.body:
        if (isinstance(node, ast.If) and isinstance(node.test, ast.Compare)
                and isinstance(node.test.left, ast.Name) and node.test.left.id == "__name__"):
            return True
    return False


def top_level_problems(root: Path = ROOT, graph: dict[str, set[str]] | None = None,
                       floors: tuple[str, ...] = FLOORS) -> list[str]:
    """What keeps ``raycl/``'s top level from being a row of doors: more than
    :data:`MAX_TOP_LEVEL_MODULES` modules, an entry point over :data:`MAX_ENTRY_LINES` lines
    (its work belongs in a package), or a module that is neither an entry point nor a
    ground-floor helper (it imports raycl above the floors)."""
    graph = import_graph(root) if graph is None else graph
    paths = sorted((root / PACKAGE).glob("*.py"))
    problems = []
    if len(paths) > MAX_TOP_LEVEL_MODULES:
        names = ", ".join(path.name for path in paths)
        problems.append(f"{PACKAGE}/ has {len(paths)} modules beside its packages (at most "
                        f"{MAX_TOP_LEVEL_MODULES}): {names}")
    for path in paths:
        text = path.read_text()
        lines = len(text.splitlines())
        where = path.relative_to(root)
        if path.name == "__init__.py" or _is_entry_point(ast.parse(text, str(path))):
            if lines > MAX_ENTRY_LINES:
                problems.append(f"{where}: a door of {lines} lines (at most {MAX_ENTRY_LINES}):"
                                f" its work belongs in a package")
            continue
        above = sorted(target for target in graph.get(f"{PACKAGE}.{path.stem}", ())
                       if not any(target == floor or target.startswith(floor + ".")
                                  for floor in floors))
        if above:
            problems.append(f"{where}: neither an entry point nor a ground-floor helper (it "
                            f"imports {', '.join(above)}): move it into the package it serves")
    return problems


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
        print(f"function over {MAX_FUNCTION_LINES} lines of code: {entry}")
    larges = large_files()
    for entry in larges:
        print(f"file over {MAX_FILE_LINES} lines: {entry}")
    tops = top_level_problems(graph=graph)
    for entry in tops:
        print(f"top level: {entry}")
    problems = len(cycles) + len(upward) + len(longs) + len(larges) + len(tops)
    print(f"{len(cycles)} import circles, {len(upward)} imports out of the ground floor, "
          f"{len(longs)} long functions, {len(larges)} large files, "
          f"{len(tops)} top-level problems")
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
