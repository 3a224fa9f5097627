"""Methods: one module per method (the class and its config section) and the registry.

A method is one file: the class, registered with ``@register("name", section=NameConfig)``
(:mod:`raycl.methods.registry`), and the :class:`~raycl.config.schema.Section` declaring its
knobs. Adding a method is that file plus one import line below, which fills :data:`METHODS` and
the config's :data:`~raycl.config.section.METHOD_SECTIONS`; :mod:`raycl.config.search_config`
turns each section into the top-level config key ``name``.
"""

from __future__ import annotations

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

__all__ = ["METHODS", "RESERVED_NAMES", "Batch", "Method", "Phase", "build_method",
           "method_class", "register", "stage_epochs", "stage_phases"]

# Imported for their @register side effect (the registry lines).
from raycl.methods import all4one, hscl, mocov2, nnclr, simclr, simsiam, spectral  # noqa: F401, I001
from raycl.methods import fgvr  # noqa: F401  (after its bases)
from raycl.methods import clip  # noqa: F401
