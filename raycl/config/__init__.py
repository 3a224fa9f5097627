"""The config of a sweep: its schema, how a search YAML is loaded, and the checks before launch.

- :mod:`raycl.config.section`: the ``Section`` base, ``ConfigError``, ``Problem`` and the table
  of method sections the method registry fills;
- :mod:`raycl.config.schema`: :class:`CoreConfig` and the core sections
  (:mod:`~raycl.config.training`, :mod:`~raycl.config.sweep`);
- :mod:`raycl.config.search_config`: the whole schema with the method sections plugged in, and
  its dotted keys (``apply_overrides``, ``flatten``, ``schema_markdown``, ...);
- :mod:`raycl.launch.feasibility`: which trials can train, and the feasible joint domain of the
  searched keys that decide it;
- :mod:`raycl.launch.checks`: everything knowable before launch, one convention;
- :mod:`raycl.launch.load`: ``load_search``: the YAML, ``--set``, pins, renames, then the checks.

Import the submodule that owns a name; this package face imports nothing, so that importing
one submodule (the schema, from a method file) never drags in the loader and its checks.
"""

from typing import Any


def __getattr__(name: str) -> Any:
    # Sweeps saved before the config package existed pickled their config class as
    # ``raycl.config.SearchConfig``; resolving it here lets them resume.
    if name == "SearchConfig":
        from raycl.config.search_config import search_config_class

        return search_config_class()
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
