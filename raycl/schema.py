"""The base class of every config section, importable without the rest of raycl.

A method declares its knobs as a :class:`Section` subclass in its own file and registers it with
the method (``@register("hscl", section=HSCLConfig)``); :mod:`raycl.config` adds one top-level
section per registered method to the schema, so ``--show-schema``, ``--set hscl.filter_exponent``
and search spaces know the method's keys without ``raycl/config.py`` naming them.
"""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict


class Section(BaseModel):
    """A block of config keys: unknown keys are errors, assignments are validated."""

    model_config = ConfigDict(extra="forbid", validate_assignment=True)


__all__ = ["Section"]
