"""The config of a sweep: its schema and sections, and their validation. The ground floor of
the house: it imports nothing else of raycl (``tools/structure.py`` checks it).

- :mod:`raycl.config.section`: the ``Section`` base, ``ConfigError``, ``Problem`` and the table
  of method sections the method registry fills;
- :mod:`raycl.config.schema`: :class:`CoreConfig` and the core sections
  (:mod:`~raycl.config.training`, :mod:`~raycl.config.evaluation`,
  :mod:`~raycl.config.sweep`);
- :mod:`raycl.config.search_config`: the whole schema with the method sections registered so
  far plugged in (an entry point imports :mod:`raycl.methods` first), and its dotted keys
  (``apply_overrides``, ``flatten``, ``schema_markdown``, ...);
- :mod:`raycl.config.metric_names`: the names of the reported metrics, built and parsed in one
  place (``tune.metric`` is validated with it);
- :mod:`raycl.config.problems`: collecting every problem of a config at once.

What must ask the methods, the data, the models, Ray or a server before a launch lives a floor
up, in :mod:`raycl.launch`: loading with ``--set`` (:mod:`raycl.launch.load`), the checks
(:mod:`raycl.launch.checks`), feasibility, placement and a sweep's identity.

Import the submodule that owns a name; this package face imports nothing, so that importing
one submodule (the schema, from a method file) never drags in the others.
"""

from typing import Any


def __getattr__(name: str) -> Any:
    # Sweeps saved before the config package existed pickled their config class as
    # ``raycl.config.SearchConfig``; resolving it here lets them resume (in a process that
    # imported raycl.methods, as every entry point does).
    if name == "SearchConfig":
        from raycl.config.search_config import search_config_class

        return search_config_class()
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
