"""Loads a script of the repository that is no package module (``tools/``, ``benchmarks/``) as a
module, so that its tests can call its functions."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from types import ModuleType

REPO = Path(__file__).resolve().parents[1]


def load_script(path: str, name: str) -> ModuleType:
    """The script at ``path`` (relative to the repository) as module ``name``, registered in
    ``sys.modules`` first: dataclasses resolve their module by name."""
    spec = importlib.util.spec_from_file_location(name, REPO / path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module
