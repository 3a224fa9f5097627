"""Searched keys that no trial reads: a notice before launch (issue 47).

A method's knob is read only by trials of that method (:func:`raycl.config.schema.key_is_active`).
When the sweep's method, or every value a search over ``method`` / ``<section>.base`` offers,
leaves a searched knob unread (``searches/mcl_k_n.yaml`` with ``--set mcl.base=hscl`` still
searches ``simclr.temperature``), the searcher never samples it (:mod:`raycl.sweep.searchers`
drops inactive keys): the search is smaller than the YAML says. Not an error (the sweep runs as
the user would expect of the other keys), one notice line per such key.
"""

from __future__ import annotations

from raycl.config.schema import CoreConfig, key_is_active, trial_sections
from raycl.config.search_config import searched_variants

# Keys that decide which method sections a trial reads (besides every ``<section>.base``).
METHOD_KEY = "method"


def deciding_keys(config: CoreConfig) -> tuple[str, ...]:
    """The searched keys that decide what a trial reads: ``method`` and any ``<section>.base``.

    Args:
        config: the sweep's configuration.

    Returns:
        Those keys in search-space order (empty when none is searched).
    """
    return tuple(key for key in config.tune.search_space
                 if key == METHOD_KEY or key.endswith(".base"))


def unread_keys(config: CoreConfig) -> list[str]:
    """The searched keys that no trial reads: inactive in every combination of the deciding
    keys' candidate values (their fixed values when none is searched).

    Args:
        config: the sweep's configuration.

    Returns:
        The keys, in search-space order.
    """
    space = config.tune.search_space
    read: set[str] = set()
    seen_any = False
    for chosen, _ in searched_variants(config, deciding_keys(config)):
        seen_any = True
        sections = trial_sections(config, chosen)
        read.update(key for key in space if key_is_active(key, sections))
    # No combination validates: check_search_space says why; nothing to add here.
    return [key for key in space if key not in read] if seen_any else []


def _deciding_note(config: CoreConfig) -> str:
    """What decides the reading: ``mcl.base=hscl``, ``method=simclr``, or the searched values
    (``method in simclr, byol``)."""
    searched = deciding_keys(config)
    if searched:
        space = config.tune.search_space
        return "; ".join(f"{key} in {', '.join(str(value) for value in space[key].candidates())}"
                         for key in searched)
    base = getattr(getattr(config, config.method, None), "base", None)
    return f"{config.method}.base={base}" if isinstance(base, str) else \
        f"{METHOD_KEY}={config.method}"


def unread_key_notices(config: CoreConfig, source: str) -> list[str]:
    """One notice per searched key no trial reads (:func:`unread_keys`).

    Args:
        config: the loaded sweep configuration.
        source: the search YAML's path, as the notice names it.

    Returns:
        ``<source>: tune.search_space.<key> is searched but no trial reads it (<why>); it is
        not sampled`` lines.
    """
    keys = unread_keys(config)
    if not keys:
        return []
    note = _deciding_note(config)
    return [f"{source}: tune.search_space.{key} is searched but no trial reads it ({note}); "
            f"it is not sampled" for key in keys]


__all__ = ["deciding_keys", "unread_key_notices", "unread_keys"]
