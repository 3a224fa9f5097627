"""Methods: one module per method (the class and its config section) and the registry.

A method is one file: the class, registered with ``@register("name", section=NameConfig)``
(:mod:`raycl.methods.registry`), and the :class:`~raycl.config.schema.Section` declaring its
knobs. Adding a method is that file plus one import line below, which fills :data:`METHODS` and
the config's :data:`~raycl.config.section.METHOD_SECTIONS`; :mod:`raycl.config.search_config`
turns each section into the top-level config key ``name``.

:data:`SearchConfig`, the whole schema (:class:`~raycl.config.schema.CoreConfig` plus every
registered method's section), is taken from here: importing this package registers every method
first, and a pickled config resolves here in any process.
"""

from __future__ import annotations

from typing import Any

from raycl.config.search_config import search_config_class
from raycl.config.section import set_schema_home
from raycl.methods.base import Batch, Method, Phase
from raycl.methods.registry import (
    METHODS,
    RESERVED_NAMES,
    build_method,
    method_class,
    register,
    stage_epochs,
    stage_phases,
)

__all__ = ["METHODS", "RESERVED_NAMES", "Batch", "Method", "Phase", "SearchConfig",
           "build_method", "method_class", "register", "stage_epochs", "stage_phases"]

# Imported for their @register side effect (the registry lines).
from raycl.methods import all4one, hscl, mocov2, nnclr, simclr, simsiam, spectral  # noqa: F401, I001
from raycl.methods import fgvr  # noqa: F401  (after its bases)
from raycl.methods import clip  # noqa: F401

set_schema_home(__name__)  # the schema's classes (built on first use) resolve here


def __getattr__(name: str) -> Any:
    # The whole schema, built from the sections registered above on first use (one class per
    # set of sections: a method registered later, e.g. by a test, gets a class of its own).
    if name == "SearchConfig":
        return search_config_class()
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
