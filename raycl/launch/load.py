"""Reading a search YAML: the file, ``--set`` overrides, pins, renamed keys, then the checks.

Bad input never launches anything: :func:`load_search` raises
:class:`~raycl.config.schema.ConfigErrors` with one line per problem, each naming the file (or
``--set``) and the dotted key, all of them at once, and ``python -m raycl.tune`` turns it into
exit code 2. Decisions the loader takes for the user (a pinned search key, a clamped grace
period) come back as notices, one line each. :func:`with_absolute_paths` readies a loaded
config for trials that run in directories of their own.
"""

from __future__ import annotations

import copy
import re
from pathlib import Path
from typing import Any

import yaml
from pydantic import ValidationError
from pydantic_core import ErrorDetails

from raycl.config.problems import all_problems
from raycl.config.schema import ConfigError, ConfigErrors, CoreConfig, resolve_tracking_uri
from raycl.config.search_config import (
    RENAMED_KEYS,
    SEARCH_SPACE_PREFIX,
    apply_overrides,
    config_keys,
    did_you_mean,
    flatten,
    method_sections,
    search_config_class,
    set_dotted,
)
from raycl.launch.checks import CONFIG_CHECKS
from raycl.launch.feasibility import grid_size, max_reports
from raycl.launch.unread_keys import unread_key_notices


def with_absolute_paths(config: CoreConfig) -> CoreConfig:
    """The config with relative paths made absolute against this (the driver's) directory.

    Ray Tune runs every trial in a working directory of its own, where a relative
    ``sqlite:///mlflow.db``, ``data.root``, ``data.cache_dir`` or ``model.pretrained`` would name
    another file (a trial would log its diagnostics into an empty database of its own).
    """
    from raycl.methods import METHODS

    values: dict[str, Any] = {"mlflow.tracking_uri": resolve_tracking_uri(
        config.mlflow.tracking_uri)}
    method_files = {key for cls in METHODS.values() for key in cls.weight_file_keys}
    for key in ("data.root", "data.cache_dir", "model.pretrained", *sorted(method_files)):
        section, field = key.split(".")
        path = getattr(getattr(config, section), field)
        if path is not None and "://" not in path:
            values[key] = str(Path(path).expanduser().resolve())
    transfer = [entry.model_dump(mode="json") for entry in config.eval.transfer]
    for entry in transfer:
        if entry["root"] is not None and "://" not in entry["root"]:
            entry["root"] = str(Path(entry["root"]).expanduser().resolve())
    if transfer:
        values["eval.transfer"] = transfer
    if config.eval.mmvp not in (None, "synthetic") and "://" not in config.eval.mmvp:
        values["eval.mmvp"] = str(Path(config.eval.mmvp).expanduser().resolve())
    return apply_overrides(config, values)



def _format_error(source: str, error: ErrorDetails, key: str) -> str:
    """One pydantic error as ``SOURCE: key: why`` (an unknown key with its likely meaning)."""
    message = error["msg"].removeprefix("Value error, ")
    if error["type"] == "extra_forbidden":
        message = "unknown key" + did_you_mean(key)
    elif "input" in error and error["type"] not in ("missing", "value_error"):
        shown = repr(error["input"])
        message = f"{message} (got {shown[:60]})"
    required = re.match(r"([\w.]+) is required", message)
    if required and "." in required.group(1):
        # A file the YAML leaves to the command line (searches/folder.yaml's data.root).
        message += f" (give it in the YAML or with --set {required.group(1)}=...)"
    return f"{source}: {key}: {message}"


def _error_source(source: str, key: str, overrides: list[str]) -> str:
    """Whom a validation error of ``key`` blames: ``--set key=value`` when its key is (or lies
    under) one a ``--set`` gave, the last such one winning as it does when applied; else the
    YAML file."""
    blamed = source
    for text in overrides:
        set_key = text.split("=", 1)[0].strip()
        if key == set_key or key.startswith(f"{set_key}."):
            blamed = f"--set {text}"
    return blamed


def _droppable(loc: tuple[int | str, ...], kind: str) -> tuple[int | str, ...] | None:
    """What to leave out of the YAML so that the rest can be checked despite an error at
    ``loc``: an unknown key (it means nothing) or a whole search-space entry (then not
    searched). None for a bad value elsewhere: a default in its place would be a guess, and
    problems found on a guess would mislead."""
    if loc[:2] == ("tune", "search_space") and len(loc) >= 3:
        return loc[:3]
    return loc if kind == "extra_forbidden" and loc else None


def _drop(raw: Any, loc: tuple[int | str, ...]) -> None:
    """Delete ``loc`` (dict keys and list indices) from ``raw`` if it is there."""
    node = raw
    for part in loc[:-1]:
        if isinstance(node, dict):
            node = node.get(part)
        elif isinstance(node, list) and isinstance(part, int) and part < len(node):
            node = node[part]
        else:
            return
    if isinstance(node, dict):
        node.pop(loc[-1], None)


def _validate(raw: dict[str, Any], source: str, overrides: list[str],
              lines: list[str], keys: list[str]) -> CoreConfig | None:
    """The validated config, or every validation error appended to ``lines`` (their keys to
    ``keys``) and the config validated without the unknown keys and bad search-space entries,
    so the checks still run on the rest; None when other errors leave nothing to check."""
    try:
        return search_config_class().model_validate(raw)
    except ValidationError as exc:
        errors = exc.errors()
    drops = []
    for error in errors:
        key = ".".join(str(part) for part in error["loc"]) or "(top level)"
        lines.append(_format_error(_error_source(source, key, overrides), error, key))
        keys.append(key)
        drops.append(_droppable(error["loc"], error["type"]))
    if any(drop is None for drop in drops):
        return None
    for drop in drops:
        if drop is not None:  # all are (checked above); says so to the type checker
            _drop(raw, drop)
    try:
        return search_config_class().model_validate(raw)
    except ValidationError:
        return None


def parse_override(text: str) -> tuple[str, Any]:
    """``"train.epochs=3"`` -> ``("train.epochs", 3)``; the value is parsed as YAML."""
    if "=" not in text:
        raise ConfigError(f"--set {text}: expected key=value")
    key, raw = text.split("=", 1)
    key = key.strip()
    try:
        value = yaml.safe_load(raw) if raw.strip() else ""
    except yaml.YAMLError as exc:
        raise ConfigError(f"--set {key}: value is not valid YAML ({exc.problem})") from None
    return key, value


def _drop_renamed(raw: dict[str, Any], source: str, lines: list[str],
                  keys: list[str]) -> None:
    """A renamed key in the YAML (or its search space) names the new key, and leaves the YAML
    (so validation does not call it unknown too)."""
    flat = flatten(raw)
    space = flat.get("tune.search_space")
    for old, new in RENAMED_KEYS.items():
        if old in flat or (isinstance(space, dict) and old in space):
            where = old if old in flat else f"tune.search_space.{old}"
            lines.append(f"{source}: {where}: renamed to {new} (a method's knobs live in its "
                         f"own section)")
            keys.append(where)
            _drop(raw, ("tune", "search_space", old) if old not in flat else
                  tuple(old.split(".")))


def _pin_searched_keys(raw: dict[str, Any], pinned: dict[str, Any], notices: list[str]) -> None:
    """A ``--set`` of a searched key pins it: the key leaves the raw YAML's search space."""
    tune = raw.get("tune") if isinstance(raw.get("tune"), dict) else None
    space = tune.get("search_space") if tune else None
    if isinstance(space, dict):
        for key, value in pinned.items():
            if key in space:
                del space[key]
                notices.append(f"--set {key}={value} pins a searched key: removed from "
                               f"tune.search_space")


def _clamp_scheduler(config: CoreConfig, notices: list[str]) -> CoreConfig:
    """ASHA's grace period longer than the longest trial is clamped (Ray would assert after
    start-up)."""
    scheduler = config.tune.scheduler
    if scheduler.type != "asha" or scheduler.grace_period <= max_reports(config):
        return config
    max_t = max_reports(config)
    notices.append(f"tune.scheduler.grace_period={scheduler.grace_period} exceeds the "
                   f"{max_t} report(s) of the longest trial: clamped to {max_t}")
    return apply_overrides(config, {"tune.scheduler.grace_period": max_t})


def _read_yaml(path: str | Path) -> dict[str, Any]:
    """The YAML file as a (copied) mapping of sections."""
    source = str(path)
    try:
        text = Path(path).read_text()
    except OSError as exc:
        raise ConfigError(f"{source}: cannot read: {exc.strerror}") from None
    try:
        raw = yaml.safe_load(text)
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        where = f"line {mark.line + 1}" if mark else "?"
        raise ConfigError(f"{source}: {where}: invalid YAML: "
                          f"{getattr(exc, 'problem', exc)}") from None
    if not isinstance(raw, dict):
        raise ConfigError(f"{source}: (top level): expected a mapping of sections")
    return copy.deepcopy(raw)


def _apply_set(raw: dict[str, Any], overrides: list[str], lines: list[str],
               keys: list[str]) -> dict[str, Any]:
    """Write the ``--set key=value`` overrides into ``raw``; the keys outside ``tune.`` they
    set (which pin a searched key) and their values. A bad one is a line of ``lines`` (its key
    in ``keys``) and is not applied."""
    pinned: dict[str, Any] = {}
    for text_override in overrides:
        try:
            key, value = parse_override(text_override)
        except ConfigError as exc:
            lines.append(str(exc))
            keys.append(text_override.split("=", 1)[0].strip())
            continue
        if key in RENAMED_KEYS:
            lines.append(f"--set {key}: renamed to {RENAMED_KEYS[key]} (a method's knobs live "
                         f"in its own section)")
        elif key not in config_keys() and not key.startswith(SEARCH_SPACE_PREFIX):
            lines.append(f"--set {key}: unknown key{did_you_mean(key)}")
        else:
            set_dotted(raw, key, value)
            if not key.startswith("tune."):
                pinned[key] = value
            continue
        keys.append(key)
    return pinned


def _grid_notice(config: CoreConfig) -> str | None:
    """How ``tune.searcher: grid`` covers its grid with ``tune.num_samples`` trials, unless
    exactly."""
    if config.tune.searcher != "grid" or not config.tune.search_space:
        return None
    size, samples = grid_size(config), config.tune.num_samples
    if size == samples:
        return None
    what = "the rest are repeats of random grid points" if samples > size else \
        f"{size - samples} are not run"
    return (f"tune.searcher=grid: {size} combinations, tune.num_samples={samples}: "
            f"{what}")


def _unlabelled_objective(config: CoreConfig, raw: dict[str, Any],
                          notices: list[str]) -> CoreConfig:
    """``config`` selecting on RankMe (``val/label_free/rankme``, max) when its data has no
    labels (a folder without class folders, a caption corpus), its method is an image-only one
    and neither the YAML nor a ``--set`` names ``tune.metric`` or ``tune.objectives``: the
    default, the class probe, would have nothing to score. Said in a notice. (An image-text
    method has caption retrieval to select on: which, the user says.)"""
    from raycl.config.collapse import RANKME
    from raycl.data import attributes_of
    from raycl.launch.objectives_check import trains_image_text, unlabelled_data_name

    named = raw.get("tune") if isinstance(raw.get("tune"), dict) else {}
    if ("metric" in named or config.tune.objectives or not config.eval.label_free
            or trains_image_text(config) or attributes_of(config.data) != ()):
        return config
    notices.append(f"tune.metric: {RANKME} (max), the label-free default: "
                   f"{unlabelled_data_name(config)} has no labels to probe")
    return apply_overrides(config, {"tune.metric": RANKME, "tune.mode": "max"})


def _usage_notices(config: CoreConfig, raw: dict[str, Any]) -> list[str]:
    """Sections the YAML sets that no trial reads; trials that are only seed repeats."""
    notices = []
    unused = sorted(name for name in method_sections()
                    if name in raw and name not in config.used_sections())
    if unused:
        notices.append(f"section{'s' if len(unused) > 1 else ''} {', '.join(unused)} not used: "
                       f"method is {config.method}"
                       + (f" (base {config.mcl.base})" if config.method == "mcl" else ""))
    if not config.tune.search_space and config.tune.num_samples > 1:
        first, count = config.seed, config.tune.num_samples
        notices.append(f"tune.search_space is empty: the {count} trials are repeats that differ "
                       f"only by seed ({first}..{first + count - 1}), each run to the end")
    return notices


def load_search(
    path: str | Path,
    overrides: list[str] | None = None,
    *,
    check_references: bool = True,
    notices: list[str] | None = None,
) -> CoreConfig:
    """Read a search YAML, apply ``--set key=value`` overrides, validate everything.

    A ``--set`` of a key in ``tune.search_space`` pins it (the key leaves the space); an ASHA
    grace period longer than the longest trial is clamped. Each such decision is appended to
    ``notices`` as one line, for the command line to print. ``check_references`` runs
    :data:`~raycl.launch.checks.CONFIG_CHECKS` (the environment checks are the caller's).

    Every problem is reported at once (:class:`~raycl.config.schema.ConfigErrors`, one line
    each, the first first): bad ``--set``s and unknown keys are left out, and the rest is still
    validated and checked. Only a file that cannot be read or parsed stops at its one line.

    Raises:
        ConfigError: one line per problem, naming the file (or ``--set``) and the dotted key.
    """
    import raycl.methods  # noqa: F401  (late, for `--help`: fills the schema's method sections)

    source = str(path)
    notices = [] if notices is None else notices
    raw = _read_yaml(path)  # a file that does not parse: one line, nothing else to check
    lines: list[str] = []  # every problem, one line each: a config is fixed in one pass
    keys: list[str] = []  # the keys they name (the checks skip them)
    pinned = _apply_set(raw, overrides or [], lines, keys)
    _pin_searched_keys(raw, pinned, notices)
    _drop_renamed(raw, source, lines, keys)
    config = _validate(raw, source, overrides or [], lines, keys)
    if config is None:
        raise ConfigErrors(lines)
    if check_references:
        config = _unlabelled_objective(config, raw, [] if lines else notices)
    config = _clamp_scheduler(config, [] if lines else notices)
    if check_references:
        problems = all_problems(config, CONFIG_CHECKS, skip=tuple(keys))
        lines += [problem.line(source) for problem in problems]
        keys += [problem.key for problem in problems]
    if lines:
        raise ConfigErrors(lines, config, keys)
    if check_references:
        grid = _grid_notice(config)
        if grid:
            notices.append(grid)
    notices.extend(_usage_notices(config, raw))
    notices.extend(unread_key_notices(config, source))  # searched, read by no trial
    return config


__all__ = ["load_search", "parse_override", "with_absolute_paths"]
