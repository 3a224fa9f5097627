"""Method registry: name -> :class:`~raycl.methods.base.Method` subclass.

Methods register themselves with ``@register("name")``; their modules are imported at the
bottom of this file so that importing ``raycl.methods`` fills :data:`METHODS`.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, TypeVar

from raycl.methods.base import Batch, Method

if TYPE_CHECKING:
    from raycl.config import SearchConfig

MethodType = TypeVar("MethodType", bound=type[Method])

METHODS: dict[str, type[Method]] = {}


def register(name: str) -> Callable[[MethodType], MethodType]:
    """Class decorator that registers a method under ``name``.

    Args:
        name: the value of ``cfg.method`` that selects the class.

    Returns:
        The decorator; it returns the class unchanged.

    Raises:
        ValueError: if ``name`` is already registered or the class is not a Method.
    """

    def decorator(cls: MethodType) -> MethodType:
        if name in METHODS:
            raise ValueError(
                f"method {name!r} is already registered (by {METHODS[name].__qualname__})"
            )
        if not (isinstance(cls, type) and issubclass(cls, Method)):
            raise ValueError(f"@register({name!r}) needs a Method subclass, got {cls!r}")
        METHODS[name] = cls
        return cls

    return decorator


def build_method(cfg: SearchConfig, in_channels: int) -> Method:
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
from raycl.methods import simclr  # noqa: E402, F401

__all__ = ["METHODS", "Batch", "Method", "build_method", "register"]
