"""Collecting every problem of a config at once, so a user fixes it in one pass.

The checks (:mod:`raycl.launch.checks`, :mod:`raycl.launch.placement`) each yield what they
find; :func:`all_problems` runs them all and keeps one problem per key. A check that runs after
a problem was found may meet a config that is wrong in a way it does not expect: its failure is
then a consequence of a reported problem, not news. :func:`with_checks` adds a caller's own
checks (the environment's) to the lines of a config error that carries its config.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator

from raycl.config.schema import ConfigError, CoreConfig, Problem, error_lines

Check = Callable[[CoreConfig], Iterator[Problem]]


def overlaps(key: str, keys: tuple[str, ...]) -> bool:
    """Whether ``key`` is one of ``keys``, lies under one, or has one under it."""
    return any(key == other or key.startswith(f"{other}.") or other.startswith(f"{key}.")
               for other in keys)


def all_problems(config: CoreConfig, checks: tuple[Check, ...],
                 skip: tuple[str, ...] = ()) -> list[Problem]:
    """Every problem of every check, in order, so a config is fixed in one pass: one per key (a
    key's first; a search-space entry with five bad values is one line), none that
    :func:`overlaps` ``skip`` (keys whose problem is already reported)."""
    found: list[Problem] = []
    for check in checks:
        try:
            for problem in check(config):
                if not overlaps(problem.key, (*skip, *(seen.key for seen in found))):
                    found.append(problem)
        except Exception:
            if not found:
                raise
            # A check after a problem runs on a config known to be wrong: its failure is a
            # consequence of what is reported already, not news.
            continue
    return found


def with_checks(error: ConfigError, source: str, checks: tuple[Check, ...]) -> list[str]:
    """The lines of ``error`` and, when it carries the config it was found on, those of
    ``checks`` on that config (e.g. the environment's, after the YAML's problems): everything
    that is wrong, in one pass. The keys it names or left out (``dropped``) are not checked."""
    lines = error_lines(error)
    config = getattr(error, "config", None)
    if config is None:
        return lines
    skip = tuple(getattr(error, "dropped", ()))
    return lines + [problem.line(source) for problem in all_problems(config, checks, skip=skip)]


__all__ = ["Check", "all_problems", "overlaps", "with_checks"]
