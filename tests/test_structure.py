"""The house rules of ``raycl/``, checked by ``tools/structure.py`` (run it for a readable list)."""

from __future__ import annotations

import importlib.util
import sys
import textwrap
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]


def _structure():
    spec = importlib.util.spec_from_file_location("structure", REPO / "tools" / "structure.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules.setdefault("structure", module)
    spec.loader.exec_module(module)
    return module


structure = _structure()


def test_raycl_has_no_import_circle_no_long_function_and_no_large_file() -> None:
    assert structure.import_cycles(structure.import_graph()) == []
    assert structure.long_functions() == []
    assert structure.large_files() == []


@pytest.fixture
def toy_package(tmp_path: Path) -> Path:
    package = tmp_path / "raycl"
    (package / "sub").mkdir(parents=True)
    (package / "__init__.py").write_text("")
    (package / "sub" / "__init__.py").write_text("from raycl.sub.b import B\n")
    (package / "sub" / "b.py").write_text(textwrap.dedent("""
        from typing import TYPE_CHECKING
        if TYPE_CHECKING:
            from raycl.a import A
        B = 1
    """))
    (package / "a.py").write_text(textwrap.dedent("""
        def late():
            from raycl.sub import b  # lazy, and names a submodule through its package
            return b
        A = 1
    """))
    (package / "c.py").write_text("import raycl.sub\n" + "def f():\n" + "    x = 1\n" * 81)
    return tmp_path


def test_every_kind_of_import_counts_toward_a_circle(toy_package: Path) -> None:
    graph = structure.import_graph(toy_package)
    assert graph["raycl.a"] == {"raycl.sub.b"}
    assert graph["raycl.sub"] == {"raycl.sub.b"}
    assert graph["raycl.c"] == {"raycl.sub"}
    assert structure.import_cycles(graph) == [["raycl.a", "raycl.sub.b"]]


def test_long_functions_and_large_files_are_named(toy_package: Path) -> None:
    assert structure.long_functions(toy_package) == ["raycl/c.py:2 f (82 lines)"]
    assert structure.large_files(toy_package, limit=50) == ["raycl/c.py (83 lines)"]


@pytest.mark.xdist_group("canary")
def test_xdist_groups_reach_the_scheduler(request: pytest.FixtureRequest) -> None:
    """`make test` keeps the Ray session's tests on one worker with --dist loadgroup; a pytest
    or xdist upgrade that drops the groups (pytest-dev/pytest-xdist#1386) would start one Ray per
    worker and run the cluster tests twice, silently."""
    if not request.config.getvalue("loadgroup"):
        pytest.skip("not run with --dist loadgroup")
    assert request.node.nodeid.endswith("@canary")
