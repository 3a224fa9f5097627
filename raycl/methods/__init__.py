"""Method registry: name -> :class:`~raycl.methods.base.Method` subclass and its config section.

A method is one file: the class, registered with ``@register("name", section=NameConfig)``, and
the :class:`~raycl.schema.Section` declaring its knobs. Adding a method is that file plus one
import line at the bottom of this module, which fills :data:`METHODS` and :data:`SECTIONS`;
:mod:`raycl.config` turns each section into the top-level config key ``name``.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, TypeVar

from raycl.methods.base import Batch, Method
from raycl.schema import Section

if TYPE_CHECKING:
    from raycl.config import CoreConfig

MethodType = TypeVar("MethodType", bound=type[Method])

METHODS: dict[str, type[Method]] = {}
# Method name -> the section of its knobs (the config key of the same name).
SECTIONS: dict[str, type[Section]] = {}
# Top-level config keys a method may not take as its name.
RESERVED_NAMES = frozenset({"name", "method", "seed", "data", "augment", "model", "train", "mcl",
                            "eval", "scaling", "tune", "mlflow"})


def register(
    name: str, section: type[Section] | None = None
) -> Callable[[MethodType], MethodType]:
    """Class decorator that registers a method under ``name``.

    Args:
        name: the value of ``cfg.method`` that selects the class; also the config key of its
            section.
        section: the method's knobs (defaults and descriptions), or None for a method without.

    Returns:
        The decorator; it returns the class unchanged.

    Raises:
        ValueError: if ``name`` is already registered or reserved, or the class is not a Method.
    """
    if name in RESERVED_NAMES or not name.isidentifier():
        raise ValueError(f"{name!r} cannot name a method: it is a core config key or not an "
                         f"identifier")
    if section is not None and not (isinstance(section, type) and issubclass(section, Section)):
        raise ValueError(f"@register({name!r}): section must be a raycl.schema.Section subclass")

    def decorator(cls: MethodType) -> MethodType:
        if name in METHODS:
            raise ValueError(
                f"method {name!r} is already registered (by {METHODS[name].__qualname__})"
            )
        if not (isinstance(cls, type) and issubclass(cls, Method)):
            raise ValueError(f"@register({name!r}) needs a Method subclass, got {cls!r}")
        METHODS[name] = cls
        if section is not None:
            SECTIONS[name] = section
        return cls

    return decorator


def build_method(cfg: CoreConfig, in_channels: int) -> Method:
    """Builds the method selected by ``cfg.method``.

    MCL is a training procedure around a base method, not a method of its own: for
    ``cfg.method == "mcl"`` this builds ``cfg.mcl.base`` (the pipeline runs the stages and
    feeds pseudo labels).

    Args:
        cfg: the run configuration.
        in_channels: number of image channels of the dataset.

    Returns:
        A new, randomly initialised method.

    Raises:
        ValueError: if the (base) method name is not registered.
    """
    name = cfg.mcl.base if cfg.method == "mcl" else cfg.method
    if name not in METHODS:
        known = ", ".join(sorted(METHODS))
        context = " (MCL base method)" if cfg.method == "mcl" else ""
        raise ValueError(f"unknown method {name!r}{context}; known methods: {known}")
    return METHODS[name].from_config(cfg, in_channels)


# Imported for their @register side effect; must come after register() is defined.
from raycl.methods import all4one, hscl, mocov2, nnclr, simclr, simsiam, spectral  # noqa: E402, F401

__all__ = ["METHODS", "SECTIONS", "Batch", "Method", "build_method", "register"]
