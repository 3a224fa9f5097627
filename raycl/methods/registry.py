"""The method registry: name -> :class:`~raycl.methods.base.Method` subclass and its config
section, and the lookups of the method a config trains.

:func:`register` fills :data:`METHODS` and the config's
:data:`~raycl.config.section.METHOD_SECTIONS`; the method modules register themselves when
:mod:`raycl.methods` imports them, so importing anything under ``raycl.methods`` fills both.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, TypeVar

from raycl.config.schema import Section
from raycl.config.section import METHOD_SECTIONS
from raycl.methods.base import Method, Phase

if TYPE_CHECKING:
    from raycl.config.schema import CoreConfig

MethodType = TypeVar("MethodType", bound=type[Method])

METHODS: dict[str, type[Method]] = {}
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
        section: the method's knobs (defaults and descriptions), or None for a method without;
            the class's ``section_type``, so its instances read them as ``self.section``.

    Returns:
        The decorator; it returns the class unchanged.

    Raises:
        ValueError: if ``name`` is already registered or reserved, or the class is not a Method.
    """
    if name in RESERVED_NAMES or not name.isidentifier():
        raise ValueError(f"{name!r} cannot name a method: it is a core config key or not an "
                         f"identifier")
    if section is not None and not (isinstance(section, type) and issubclass(section, Section)):
        raise ValueError(f"@register({name!r}): section must be a raycl.config.schema.Section "
                         f"subclass")

    def decorator(cls: MethodType) -> MethodType:
        if name in METHODS:
            raise ValueError(
                f"method {name!r} is already registered (by {METHODS[name].__qualname__})"
            )
        if not (isinstance(cls, type) and issubclass(cls, Method)):
            raise ValueError(f"@register({name!r}) needs a Method subclass, got {cls!r}")
        METHODS[name] = cls
        if section is not None:
            METHOD_SECTIONS[name] = section
            cls.section_type = section  # what the class's instances read as self.section
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
    return method_class(cfg).from_config(cfg, in_channels)


def method_class(cfg: CoreConfig) -> type[Method]:
    """The class of the (base) method ``cfg`` trains (MCL: ``mcl.base``)."""
    name = cfg.mcl.base if cfg.method == "mcl" else cfg.method
    if name not in METHODS:
        known = ", ".join(sorted(METHODS))
        context = " (MCL base method)" if cfg.method == "mcl" else ""
        raise ValueError(f"unknown method {name!r}{context}; known methods: {known}")
    return METHODS[name]


def stage_phases(cfg: CoreConfig) -> list[Phase]:
    """The (base) method's training phases for ``cfg`` (:meth:`Method.phases`), checked.

    Raises:
        ValueError: if the last phase is not ``"train"`` over ``train.epochs``, or names repeat.
    """
    phases = method_class(cfg).phases(cfg)
    names = [phase.name for phase in phases]
    if not phases or phases[-1].name != "train" or phases[-1].epochs is not None:
        raise ValueError(f"the last phase must be 'train' with train.epochs, got {phases}")
    if len(set(names)) != len(names):
        raise ValueError(f"phase names repeat: {names}")
    return phases


def stage_epochs(cfg: CoreConfig) -> int:
    """Epochs of one stage over all its phases: the reports one stage makes."""
    return sum(phase.epoch_count(cfg.train.epochs) for phase in stage_phases(cfg))


__all__ = ["METHODS", "RESERVED_NAMES", "build_method", "method_class", "register",
           "stage_epochs", "stage_phases"]
