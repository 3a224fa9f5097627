"""A sweep started before House III resumes: the module names its pickles hold (raycl.searchers,
raycl.sweep_display, raycl.pbt, ...) resolve to where the classes live now."""

from __future__ import annotations

import importlib
import pickle
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from raycl.sweep import old_names
from raycl.sweep.display import ProgressDisplay
from raycl.sweep.pb2 import RayclPB2
from raycl.sweep.searchers import ConstrainedSpace, FinishingASHA

REPO = Path(__file__).resolve().parents[1]


@pytest.fixture
def aliased() -> Iterator[None]:
    before = set(sys.modules)
    old_names.alias_moved_modules()
    yield
    for name in set(sys.modules) - before:
        if name in old_names.MOVED:
            del sys.modules[name]


def _as_pickled_by(old_module: str, value: object) -> bytes:
    """``value``'s pickle (a reference to its class) as a sweep of the old layout wrote it."""
    text = pickle.dumps(value, protocol=0)
    return text.replace(value.__module__.encode(), old_module.encode())


def test_every_old_name_is_gone_and_every_new_home_imports() -> None:
    for old, homes in old_names.MOVED.items():
        assert not (REPO / (old.replace(".", "/") + ".py")).exists(), old
        for home in homes:
            importlib.import_module(home)


def test_old_pickles_load_the_classes_where_they_live_now(aliased: None) -> None:
    assert pickle.loads(_as_pickled_by("raycl.searchers", FinishingASHA)) is FinishingASHA
    assert pickle.loads(_as_pickled_by("raycl.searchers", ConstrainedSpace)) is ConstrainedSpace
    assert pickle.loads(_as_pickled_by("raycl.sweep_display", ProgressDisplay)) is ProgressDisplay
    # raycl.pbt held PBT, the population's helpers and PB2: now three modules.
    assert pickle.loads(_as_pickled_by("raycl.pbt", RayclPB2)) is RayclPB2
    assert sys.modules["raycl.pbt"].copy_missing_files.__module__ == "raycl.sweep.population"
    with pytest.raises(AttributeError, match=r"raycl\.searchers\.Nothing: not in"):
        sys.modules["raycl.searchers"].Nothing  # noqa: B018
