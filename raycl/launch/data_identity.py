"""The data a sweep was launched on, as part of its identity (:mod:`raycl.launch.identity`).

Each dataset a sweep reads (``data``, and every ``eval.transfer`` entry) is named by the content
key its reader already computes for the on-disk cache (:meth:`Reader.content_key
<raycl.data.types.Reader.content_key>`): a folder's or a pairs file's (path, size, mtime) of every
image, CIFAR's and STL-10's files, ImageNet's digest of its files, a shard source's shards and
their sample counts, a generated set's settings. Computed inside the launch's
:func:`~raycl.data.listed_once.listed_once` scope on the config the pre-launch checks listed, so
no root is listed twice.

A file list longer than :data:`LISTED_FILES` is stored as its count and digest (a million-file
folder would make the stored identity tens of MB): a change is then found, but not itemised.
"""

from __future__ import annotations

import hashlib
import json
from typing import Any

from raycl.config.schema import CoreConfig

LISTED_FILES = 20_000  # files a stored key lists one by one; more are a count and a digest
# What one entry of a source's file list is, in the message.
_UNIT = {"folder": "image", "imagenet": "image", "imagenet100": "image"}


def _datasets(config: CoreConfig) -> list[tuple[str, Any]]:
    """(section, DataConfig-like) of every dataset the trials read, as they read it."""
    from raycl.eval.transfer import transfer_data_config

    return [("data", config.data)] + [
        (f"eval.transfer.{i}", transfer_data_config(config, entry))
        for i, entry in enumerate(config.eval.transfer)]


def _digest(value: Any) -> str:
    return hashlib.sha256(json.dumps(value, sort_keys=True).encode()).hexdigest()


def _image_count(source: Any, cfg: Any) -> int | None:
    """Images of the dataset as its listing counts them (no image is read); None if unknown."""
    try:
        return sum(sum(counts) for counts in source.class_counts(cfg).values())
    except (OSError, ValueError):
        return None


def dataset_key(cfg: Any, seed: int) -> dict[str, Any]:
    """The stored key of one dataset: its name and its reader's content key, a long file list
    as ``{"count", "digest"}``.

    Raises:
        OSError, ValueError: the reader cannot compute it (a file missing).
    """
    from raycl.data.registry import reader

    source = reader(cfg.dataset)
    content = source.content_key(cfg, seed)
    files = content.get("files")
    if isinstance(files, list) and len(files) > LISTED_FILES:
        content["files"] = {"count": len(files), "digest": _digest(files)}
    elif isinstance(files, str):  # already a digest (ImageNet): its size from the listing
        content["files"] = {"count": _image_count(source, cfg), "digest": files}
    return {"dataset": cfg.dataset, **content}


def data_keys(config: CoreConfig) -> dict[str, dict[str, Any] | None]:
    """Section (``data``, ``eval.transfer.<i>``) -> :func:`dataset_key`, None where it cannot be
    computed (files a trial downloads first): such a dataset is not compared on a re-run.

    ``config``: the config the pre-launch checks listed (so its listings are reused).
    """
    keys: dict[str, dict[str, Any] | None] = {}
    for section, cfg in _datasets(config):
        try:
            keys[section] = dataset_key(cfg, config.data_seed)
        except (OSError, ValueError):
            keys[section] = None
    return keys


def _plural(count: int, unit: str) -> str:
    return f"{count} {unit}{'' if count == 1 else 's'}"


def _listed_changes(old: list[list[Any]], new: list[list[Any]], unit: str) -> str:
    """``1 image added, 0 removed, 2 changed (600 → 601 images)`` of two (name, ...) lists."""
    before = {str(entry[0]): entry[1:] for entry in old}
    after = {str(entry[0]): entry[1:] for entry in new}
    added = len(after.keys() - before.keys())
    removed = len(before.keys() - after.keys())
    changed = sum(before[name] != after[name] for name in before.keys() & after.keys())
    return (f"{_plural(added, unit)} added, {removed} removed, {changed} changed "
            f"({len(old)} → {_plural(len(new), unit)})")


def _counted(value: Any) -> int | None:
    if isinstance(value, list):
        return len(value)
    return value.get("count") if isinstance(value, dict) else None


def _field_change(field: str, old: Any, new: Any, unit: str) -> str:
    """How one field of a stored key differs, in words."""
    if field in ("files", "shards"):
        unit = "shard" if field == "shards" else unit
        if isinstance(old, list) and isinstance(new, list):
            return _listed_changes(old, new, unit)
        counts = (_counted(old), _counted(new))
        told = f" ({counts[0]} → {_plural(counts[1], unit)})" if None not in counts else ""
        return f"its {unit}s changed{told}"
    return f"{field}: {json.dumps(old)} → {json.dumps(new)}"


def _compact(value: Any) -> Any:
    """A file list as the count and digest a long one is stored as (to compare with one)."""
    if isinstance(value, list):
        return {"count": len(value), "digest": _digest(value)}
    return value


def key_change(old: dict[str, Any], new: dict[str, Any]) -> str | None:
    """What differs between two :func:`dataset_key` values, in words; None when nothing does.

    E.g. ``folder /data/x: 1 image added, 0 removed, 0 changed (600 → 601 images)``.
    """
    dataset = str(new.get("dataset"))
    unit = _UNIT.get(dataset, "file")
    parts = []
    for field in sorted(old.keys() | new.keys()):
        before, after = old.get(field), new.get(field)
        if field in ("files", "shards") and isinstance(before, list) != isinstance(after, list):
            before, after = _compact(before), _compact(after)  # stored under another limit
        if before != after:
            parts.append(_field_change(field, before, after, unit))
    if not parts:
        return None
    root = new.get("root")
    return f"{dataset}{f' {root}' if root else ''}: {'; '.join(parts)}"


def data_changes(stored: dict[str, Any], new: dict[str, Any]) -> list[tuple[str, str]]:
    """``(section, what changed)`` of every dataset whose key differs; a dataset either side
    could not key (None) is not compared."""
    changes = []
    for section in sorted(stored.keys() & new.keys()):
        old, key = stored[section], new[section]
        if old is not None and key is not None:
            change = key_change(old, key)
            if change:
                changes.append((section, change))
    return changes


__all__ = ["LISTED_FILES", "data_changes", "data_keys", "dataset_key", "key_change"]
