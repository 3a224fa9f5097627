"""The base of every config section, the errors of configs, and the table of method sections.

Importable without the rest of raycl. A method declares its knobs as a :class:`Section` subclass
in its own file and registers it with the method (``@register("hscl", section=HSCLConfig)``),
which puts it in :data:`METHOD_SECTIONS`; :func:`raycl.config.search_config.search_config_class`
adds one top-level section per entry, so ``--show-schema``, ``--set hscl.filter_exponent`` and
search spaces know the method's keys without the config package naming them.
"""

from __future__ import annotations

from typing import NamedTuple

from pydantic import BaseModel, ConfigDict


class Section(BaseModel):
    """A block of config keys: unknown keys are errors, assignments are validated."""

    model_config = ConfigDict(extra="forbid", validate_assignment=True)


class ConfigError(ValueError):
    """A search YAML (or an override of it) is invalid. The message is one line: file: key: why."""


class Problem(NamedTuple):
    """Why a config cannot run: the dotted key at fault and the reason (one line each)."""

    key: str
    why: str

    def line(self, source: str) -> str:
        """The one-line message ``FILE: key: why`` a :class:`ConfigError` carries."""
        return f"{source}: {self.key}: {self.why}"


# Method name -> the section of its knobs (the top-level config key of the same name); filled
# by :func:`raycl.methods.register`.
METHOD_SECTIONS: dict[str, type[Section]] = {}

_schema_home: str | None = None


def set_schema_home(module: str) -> None:
    """Name the module where the whole schema (``SearchConfig``) resolves by name: the method
    registry's package names itself, since importing it registers every method first. A config
    pickled in one process then unpickles in any other (a Ray worker that imported no method
    yet), while this package imports nothing above it."""
    global _schema_home
    _schema_home = module


def schema_home() -> str | None:
    """The module :func:`set_schema_home` named (None: no registry imported)."""
    return _schema_home


__all__ = ["METHOD_SECTIONS", "ConfigError", "Problem", "Section", "schema_home",
           "set_schema_home"]
