"""The house rules of ``raycl/``, checked by ``tools/structure.py`` (run it for a readable list)."""

from __future__ import annotations

import textwrap
from pathlib import Path

import pytest
from script_modules import load_script

structure = load_script("tools/structure.py", "structure")


def test_raycl_has_no_import_circle_no_long_function_and_no_large_file() -> None:
    graph = structure.import_graph()
    assert structure.import_cycles(graph) == []
    assert structure.floor_imports(graph) == []  # raycl/config/ imports nothing above it
    assert structure.long_functions() == []
    assert structure.large_files() == []
    assert structure.top_level_problems(graph=graph) == []  # a row of doors and helpers


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
    assert structure.long_functions(toy_package) == ["raycl/c.py:2 f (82 lines of code)"]
    assert structure.large_files(toy_package, limit=50) == ["raycl/c.py (83 lines)"]


def test_the_ground_floor_imports_nothing_above_it(tmp_path: Path) -> None:
    """raycl/config/ may import itself only: a lazy import, one under TYPE_CHECKING and the
    package root count as much as a top-level one."""
    config = tmp_path / "raycl" / "config"
    config.mkdir(parents=True)
    (tmp_path / "raycl" / "__init__.py").write_text("")
    (tmp_path / "raycl" / "methods.py").write_text("from raycl.config.schema import S\n")
    (tmp_path / "raycl" / "configs.py").write_text("")  # a name that only starts the same
    (config / "__init__.py").write_text("")
    (config / "schema.py").write_text("from raycl.config import section\nS = 1\n")
    (config / "section.py").write_text("import raycl.configs\n")
    (config / "lazy.py").write_text(textwrap.dedent("""
        from typing import TYPE_CHECKING
        if TYPE_CHECKING:
            from raycl import methods
        def build():
            import raycl
            from raycl.methods import register
            return register
    """))
    graph = structure.import_graph(tmp_path)
    assert structure.floor_imports(graph) == [
        "raycl.config.lazy -> raycl", "raycl.config.lazy -> raycl.methods",
        "raycl.config.section -> raycl.configs"]
    (config / "lazy.py").write_text("from raycl.config.schema import S\n")
    (config / "section.py").write_text("")
    assert structure.floor_imports(structure.import_graph(tmp_path)) == []
    assert structure.import_cycles(structure.import_graph(tmp_path)) == []


def test_a_functions_docstring_comments_and_blank_lines_are_not_code(tmp_path: Path) -> None:
    package = tmp_path / "raycl"
    package.mkdir()
    (package / "__init__.py").write_text("")
    body = '    """A docstring\n' + "    of many lines.\n" * 30 + '    """\n'
    body += "    # a comment\n\n" * 30 + "    x = 1\n" * 49
    (package / "m.py").write_text("def f():\n" + body)
    assert structure.long_functions(tmp_path) == []  # def + 49 lines: 50 of code
    (package / "m.py").write_text("def f():\n" + body + "    return x\n")
    assert structure.long_functions(tmp_path) == ["raycl/m.py:1 f (51 lines of code)"]


def test_the_top_level_is_a_row_of_doors_and_ground_floor_helpers(tmp_path: Path) -> None:
    """raycl/*.py: at most 8 modules; an entry point (``__main__``) of at most 150 lines; any
    other module imports nothing above the ground floor."""
    package = tmp_path / "raycl"
    (package / "config").mkdir(parents=True)
    (package / "sweep").mkdir()
    for name in ("__init__.py", "config/__init__.py", "sweep/__init__.py", "sweep/run.py"):
        (package / name).write_text("")
    door = 'from raycl.sweep.run import run\n\nif __name__ == "__main__":\n    run()\n'
    (package / "tune.py").write_text(door)
    (package / "helper.py").write_text("from raycl.config import x\n")
    assert structure.top_level_problems(tmp_path) == []
    (package / "tune.py").write_text(door + "# work\n" * 147)
    (package / "helper.py").write_text("from raycl.sweep import run\n")
    assert structure.top_level_problems(tmp_path) == [
        "raycl/helper.py: neither an entry point nor a ground-floor helper (it imports "
        "raycl.sweep.run): move it into the package it serves",
        "raycl/tune.py: a door of 151 lines (at most 150): its work belongs in a package"]
    for index in range(7):
        (package / f"extra{index}.py").write_text("")
    assert structure.top_level_problems(tmp_path)[0].startswith(
        "raycl/ has 10 modules beside its packages (at most 8): __init__.py, extra0.py")


@pytest.mark.xdist_group("canary")
def test_xdist_groups_reach_the_scheduler(request: pytest.FixtureRequest) -> None:
    """`make test` keeps the Ray session's tests on one worker with --dist loadgroup; a pytest
    or xdist upgrade that drops the groups (pytest-dev/pytest-xdist#1386) would start one Ray per
    worker and run the cluster tests twice, silently."""
    if not request.config.getoption("loadgroup", False):  # set in xdist's workers only
        pytest.skip("not run with --dist loadgroup")
    assert request.node.nodeid.endswith("@canary")


def test_the_ray_session_tests_reach_the_scheduler_as_one_group(
    request: pytest.FixtureRequest, ray_session: object
) -> None:
    """The group conftest.py gives every test on the shared Ray session reaches xdist's
    scheduler (its hook must run before xdist's): otherwise each worker starts a Ray."""
    if not request.config.getoption("loadgroup", False):  # set in xdist's workers only
        pytest.skip("not run with --dist loadgroup")
    assert request.node.nodeid.endswith("@ray-session")
