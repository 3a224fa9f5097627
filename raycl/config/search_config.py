"""The whole schema of a search YAML: :class:`CoreConfig` with the method sections plugged in, and
its dotted keys.

:data:`SearchConfig` is :class:`~raycl.config.schema.CoreConfig` plus one section per method
registered so far (:data:`~raycl.config.section.METHOD_SECTIONS`), built on first use. The
registry is filled by importing :mod:`raycl.methods` (and torch; ``--help`` does not need it),
which the entry points do (``raycl.tune``, ``raycl.launch.load``, the trial's worker): this
package imports nothing else of raycl. Dotted keys (``train.lr``,
``tune.search_space.simclr.temperature``) are read, set and documented here;
:func:`apply_overrides` makes trial configs.
"""

from __future__ import annotations

import sys
from collections.abc import Iterator, Mapping
from difflib import get_close_matches
from functools import cache
from itertools import product
from types import UnionType
from typing import Any, Literal, Union, get_args, get_origin

from pydantic import BaseModel, Field, ValidationError, create_model

from raycl.config.schema import CoreConfig, Domain
from raycl.config.section import METHOD_SECTIONS, Section, schema_home


def search_config_class() -> type[CoreConfig]:
    """:class:`CoreConfig` plus one section per method registered so far (one class per set of
    sections, built on first use: the same registry gives the same class, which pickles by it).

    Raises:
        RuntimeError: no method has registered its section yet: the caller's entry point must
            import :mod:`raycl.methods` first (the config package never imports it).
    """
    if not METHOD_SECTIONS:
        raise RuntimeError("no method sections are registered: take the whole schema from "
                           "raycl.methods (from raycl.methods import SearchConfig), or import "
                           "raycl.methods first (its @register calls fill "
                           "raycl.config.section.METHOD_SECTIONS)")
    return _schema_class(tuple(sorted(METHOD_SECTIONS.items())))


@cache
def _schema_class(sections: tuple[tuple[str, type[Section]], ...]) -> type[CoreConfig]:
    fields: dict[str, Any] = {
        name: (section, Field(default_factory=section, description=f"Knobs of method {name!r} "
                              f"(declared in {section.__module__})."))
        for name, section in sections
    }
    # Pickled by name where the registry's package resolves it (raycl.config.section
    # .set_schema_home): unpickling imports that package, which registers every method first.
    model = create_model("SearchConfig", __base__=CoreConfig,
                         __module__=schema_home() or __name__, **fields)
    model.__doc__ = ("A whole experiment: method, data, model, training, scaling, search, "
                     "tracking, and the knobs of every registered method.")
    return model


def method_sections() -> tuple[str, ...]:
    """Top-level keys that are method sections."""
    return tuple(name for name in search_config_class().model_fields
                 if name not in CoreConfig.model_fields)


def __getattr__(name: str) -> Any:
    # SearchConfig and CONFIG_KEYS depend on the method registry: resolved on first use.
    if name == "SearchConfig":
        return search_config_class()
    if name == "CONFIG_KEYS":
        return config_keys()
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


# ---------------------------------------------------------------------------------------------
# Dotted keys


def flatten(tree: Mapping[str, Any], prefix: str = "") -> dict[str, Any]:
    """``{"a": {"b": 1}}`` -> ``{"a.b": 1}``; the search space stays one (JSON) value."""
    flat: dict[str, Any] = {}
    for key, value in tree.items():
        dotted = f"{prefix}{key}"
        if isinstance(value, Mapping) and value and dotted != "tune.search_space":
            flat.update(flatten(value, f"{dotted}."))
        else:
            flat[dotted] = value
    return flat


def optional_section(annotation: Any) -> type[BaseModel] | None:
    """The section class of a field typed ``Section | None`` (``eval.linear_sgd``, ``paper``),
    else None: its keys are config keys too (``--set paper.value=...``), and so is the field
    itself (``--set eval.linear_sgd={epochs: 2}``, ``null`` to switch it off)."""
    if get_origin(annotation) not in (Union, UnionType):
        return None
    args = [arg for arg in get_args(annotation) if arg is not type(None)]
    if len(args) == 1 and len(get_args(annotation)) == 2 and isinstance(args[0], type) \
            and issubclass(args[0], BaseModel) and args[0] is not Domain:
        return args[0]
    return None


def _field_paths(model: type[BaseModel], prefix: str = "") -> Iterator[str]:
    for name, info in model.model_fields.items():
        annotation = info.annotation
        if isinstance(annotation, type) and issubclass(annotation, BaseModel) \
                and annotation is not Domain:
            yield from _field_paths(annotation, f"{prefix}{name}.")
            continue
        yield f"{prefix}{name}"
        if (section := optional_section(annotation)) is not None:
            yield from _field_paths(section, f"{prefix}{name}.")


def config_keys() -> tuple[str, ...]:
    """Every dotted config key, method sections included."""
    return _config_keys_of(search_config_class())


@cache
def _config_keys_of(model: type[CoreConfig]) -> tuple[str, ...]:
    return tuple(_field_paths(model))


def key_symbol(key: str) -> str:
    """The short name of a dotted config key in run names: the ``symbol`` its field declares
    (``Field(..., json_schema_extra={"symbol": "K"})``, the papers' names: ``mcl.clusters`` ->
    ``K``, ``simclr.temperature`` -> ``τ``), else the key's last component (``queue_size``)."""
    model: type[BaseModel] | None = search_config_class()
    info = None
    for part in key.split("."):
        fields = model.model_fields if model is not None else {}
        if part not in fields:
            info = None
            break
        info = fields[part]
        annotation = info.annotation
        model = annotation if isinstance(annotation, type) and issubclass(
            annotation, BaseModel) else None
    extra = info.json_schema_extra if info is not None else None
    symbol = extra.get("symbol") if isinstance(extra, dict) else None
    return str(symbol) if symbol else key.rsplit(".", 1)[-1]


def did_you_mean(key: str) -> str:
    """`` (did you mean train.epochs?)`` for a mistyped dotted key, or ``""``: the closest known
    key or section name (difflib; within the key's own section first; a renamed key's new name),
    so a typo is fixed without reading the schema."""
    keys = config_keys()
    sections = {known.rsplit(".", i)[0] for known in keys for i in range(1, known.count(".") + 1)}
    section = key.rsplit(".", 1)[0] if "." in key else None
    own = [known for known in keys if section in sections and known.startswith(f"{section}.")]
    close = get_close_matches(key, own, n=1, cutoff=0.75) or get_close_matches(
        key, [*keys, *sorted(sections), *RENAMED_KEYS], n=1, cutoff=0.75)
    leaf = key.rsplit(".", 1)[-1]
    same_leaf = [known for known in keys if known.rsplit(".", 1)[-1] == leaf]
    # A section's own keys before an optional sub-section's (train.epochs, not also
    # eval.linear_sgd.epochs).
    same_leaf = [known for known in same_leaf
                 if known.count(".") == min(other.count(".") for other in same_leaf)]
    if "." not in key and same_leaf:  # the section left out: `epochs` -> train.epochs
        close = same_leaf[:3]
    close = [RENAMED_KEYS.get(match, match) for match in close]
    return f" (did you mean {' or '.join(close)}?)" if close else ""


# Keys that moved; a YAML or --set using the old name gets told the new one.
RENAMED_KEYS = {"loss.temperature": "simclr.temperature"}


SEARCH_SPACE_PREFIX = "tune.search_space."


# Keys a `--set KEY=null` unsets (their default applies) rather than sets: they take no null,
# and a YAML's tune.metric must be removable where the command line gives tune.objectives.
UNSET_BY_NULL = ("tune.metric", "tune.mode")


def set_dotted(tree: dict[str, Any], dotted: str, value: Any) -> None:
    """Write one ``--set dotted=value`` into the raw YAML ``tree`` (:func:`write_dotted`).

    Two keys mean more than their own value on the command line: ``tune.objectives`` replaces
    the single objective and the ASHA scheduler that ``tree`` holds so far (the YAML's, or an
    earlier ``--set``'s; one line on stderr names them), as several objectives supersede both;
    and ``null`` for a key of :data:`UNSET_BY_NULL` removes it from ``tree``. A YAML that
    gives both objectives and a different metric is still refused (``TuneSection``).
    """
    if dotted == "tune.objectives" and value is not None:
        _replace_single_objective(tree)
    if dotted in UNSET_BY_NULL and value is None:
        *parents, leaf = dotted.split(".")
        node: Any = tree
        for part in parents:
            node = node.get(part) if isinstance(node, dict) else None
        if isinstance(node, dict):
            node.pop(leaf, None)
        return
    write_dotted(tree, dotted, value)


def _replace_single_objective(tree: dict[str, Any]) -> None:
    """Remove ``tune.metric``, ``tune.mode`` and an ASHA ``tune.scheduler.type`` from the raw
    ``tree``, saying so on stderr: the first objective takes the metric's place, and ASHA
    compares one number per trial (pbt/pb2 stay: with objectives they are refused)."""
    tune = tree.get("tune")
    if not isinstance(tune, dict):
        return
    replaced = [f"tune.{key}={tune.pop(key)}" for key in ("metric", "mode") if key in tune]
    scheduler = tune.get("scheduler")
    if isinstance(scheduler, dict) and scheduler.get("type") == "asha":
        replaced.append(f"tune.scheduler.type={scheduler.pop('type')}")
    if replaced:
        # Printed here: the loader's notice list is not handed to the config layer.
        print(f"raycl: --set tune.objectives replaces {', '.join(replaced)} (the first "
              f"objective ranks trials where one number must; every trial runs to the end)",
              file=sys.stderr, flush=True)


def write_dotted(tree: dict[str, Any], dotted: str, value: Any) -> None:
    """Set ``tree["a"]["b"] = value`` for ``"a.b"``, creating sections as needed.

    A search-space entry is keyed by a dotted config key itself: ``tune.search_space.loss.tau``
    sets ``tree["tune"]["search_space"]["loss.tau"]``.
    """
    if dotted.startswith(SEARCH_SPACE_PREFIX):
        parents, leaf = ["tune", "search_space"], dotted[len(SEARCH_SPACE_PREFIX):]
    else:
        *parents, leaf = dotted.split(".")
    node = tree
    for part in parents:
        child = node.get(part)
        if not isinstance(child, dict):
            child = {}
            node[part] = child
        node = child
    node[leaf] = value


def apply_overrides(config: CoreConfig, values: Mapping[str, Any]) -> CoreConfig:
    """A copy of ``config`` with dotted keys replaced, validated again (trial configs)."""
    raw = config.to_dict()
    for key, value in values.items():
        write_dotted(raw, key, value)  # plain values: no --set meaning (set_dotted)
    return search_config_class().model_validate(raw)


def searched_variants(
    config: CoreConfig, keys: tuple[str, ...]
) -> Iterator[tuple[dict[str, Any], CoreConfig]]:
    """``(searched values, config)`` for every combination of the candidate values
    (:meth:`Domain.candidates`: every choice, a range's ends) of those ``keys`` the search space
    varies; ``({}, config)`` alone when it varies none. A combination that does not validate is
    left out: an invalid searched value is ``check_search_space``'s message."""
    space = config.tune.search_space
    searched = [key for key in keys if key in space]
    for values in product(*(space[key].candidates() for key in searched)):
        chosen = dict(zip(searched, values, strict=True))
        try:
            yield chosen, apply_overrides(config, chosen) if chosen else config
        except ValidationError:
            continue


def searched_note(chosen: Mapping[str, Any], leave_out: tuple[str, ...] = ()) -> str:
    """``with searched k=v, k2=v2: `` naming a combination in a problem's message (empty when
    nothing was searched); ``leave_out`` keys the message names anyway."""
    shown = ", ".join(f"{key}={value}" for key, value in chosen.items() if key not in leave_out)
    return f"with searched {shown}: " if shown else ""


def type_label(annotation: Any) -> str:
    """A field's type as the schema shows it: a choice (``Literal``) as its allowed values
    (``'asha' | 'none'``), so a reader sees what to write."""
    origin = get_origin(annotation)
    if origin is Literal:
        return " | ".join(repr(value) for value in get_args(annotation))
    if origin in (Union, UnionType) and any(get_origin(arg) is Literal
                                            for arg in get_args(annotation)):
        return " | ".join(type_label(arg) for arg in get_args(annotation))
    if annotation is type(None):
        return "None"
    if (section := optional_section(annotation)) is not None:
        return f"{section.__name__} | None"  # its keys follow, one row each
    name = getattr(annotation, "__name__", None)
    return (name or str(annotation)).replace("typing.", "")


def schema_markdown() -> str:
    """Every key with its type, default and description: the reference for search YAMLs."""
    lines = ["| key | type | default | description |", "|---|---|---|---|"]

    def walk(model: type[BaseModel], prefix: str) -> None:
        for name, info in model.model_fields.items():
            annotation = info.annotation
            if isinstance(annotation, type) and issubclass(annotation, BaseModel) \
                    and annotation is not Domain:
                walk(annotation, f"{prefix}{name}.")
                continue
            type_name = type_label(annotation).replace("|", "\\|")
            default = "required" if info.is_required() else repr(info.get_default(
                call_default_factory=True))
            description = (info.description or "").replace("|", "\\|")
            lines.append(f"| `{prefix}{name}` | {type_name} | {default} | {description} |")
            if (section := optional_section(annotation)) is not None:
                walk(section, f"{prefix}{name}.")

    walk(search_config_class(), "")
    return "\n".join(lines)


__all__ = ["RENAMED_KEYS", "SEARCH_SPACE_PREFIX", "apply_overrides", "config_keys",
           "did_you_mean", "flatten", "key_symbol", "method_sections", "optional_section",
           "schema_markdown", "search_config_class", "set_dotted", "type_label",
           "write_dotted"]
