"""A sweep's settings and data are its identity: a re-run with other ones never resumes it.

At launch, ``python -m raycl.tune`` stores the resolved config every trial gets (after
:func:`~raycl.launch.load.with_absolute_paths`) and the content key of every dataset it reads
(:mod:`raycl.launch.data_identity`: a folder's files with their sizes and mtimes, ImageNet's
digest, shard lists, a generated set's settings) beside Ray Tune's experiment state, as
``<experiment>/raycl_sweep.json``. A re-run of the same name (and storage) compares both with its
own before anything launches, before Ray starts: identical ones resume the sweep; other settings
stop with one line naming every differing key, ``key: old → new``, other data with one line
naming what changed (``folder /x: 1 image added, 0 removed, 0 changed (600 → 601 images)``);
both name the two ways on (``--name NEW``, ``--fresh``). A sweep stored by an older raycl (no
file, or a file without the data) resumes with a notice.

What a re-run may change and still resume (:data:`RESUME_MAY_CHANGE`) is only where the sweep's
state lives (``tune.storage_path``: it is how the sweep was found, spelled relative or absolute).
Everything else is compared, also the keys a resume would seem to allow, because Ray Tune's
restore keeps the first launch's values of them and a new value would be ignored without a word:

- ``tune.num_samples`` (also upward), ``tune.max_concurrent_trials``, ``tune.scheduler.*``,
  ``tune.max_failures``: ``Tuner.restore`` restores its ``TuneConfig``/``RunConfig`` and the
  searcher's state (its trial count included) from the experiment; a resumed sweep runs exactly
  the trials it was launched with.
- ``mlflow.*``: the restored MLflow callback logs the parent and trial runs to the first
  launch's tracking URI and experiment, while trials would get the new ones.
- every other key changes what the trials train or measure; so does the data under an unchanged
  ``data.root``, which trials would read as it is now while the finished trials saw it as it was.

``data.loader: auto`` is stored as the user wrote it, not as the launch settled it for this
cluster's memory: the same data read another way is the same sweep.

A key the stored file lacks (added by a newer raycl) counts only when its value is not the
default; a key the stored file has and this raycl no longer knows is not compared.

The file is read and written through ``pyarrow.fs``, so ``s3://``/``gs://`` storage works where
pyarrow can reach it; where it cannot, the check is skipped with a notice, never the launch.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from functools import cache
from typing import Any

from raycl.config.schema import ConfigError, CoreConfig
from raycl.config.search_config import flatten, search_config_class

SWEEP_FILE = "raycl_sweep.json"
# 2: {"format", "settings", "data"}; before it the file was the settings alone.
_FORMAT = 2
# Key -> whether a re-run may resume with (stored, new) values of it.
RESUME_MAY_CHANGE: dict[str, Callable[[Any, Any], bool]] = {
    "tune.storage_path": lambda old, new: True,
}
_SHOWN_KEYS = 8  # differing keys listed in the message; the rest are counted
_SHOWN_CHARS = 40  # of each value


@cache
def _defaults() -> dict[str, Any]:
    return flatten(search_config_class()(name="default").to_dict())


def setting_changes(stored: dict[str, Any], new: dict[str, Any]) -> list[tuple[str, Any, Any]]:
    """``(dotted key, stored value, new value)`` for every key whose difference stops a resume,
    in key order; both arguments are ``config.to_dict()`` trees."""
    old_flat, new_flat, defaults = flatten(stored), flatten(new), _defaults()
    missing = object()
    changes = []
    for key in sorted(new_flat):
        old, value = old_flat.get(key, missing), new_flat[key]
        if old is missing:
            if value != defaults.get(key, missing):
                changes.append((key, None, value))
        elif old != value and not RESUME_MAY_CHANGE.get(key, lambda a, b: False)(old, value):
            changes.append((key, old, value))
    return changes


def _shown(value: Any) -> str:
    text = json.dumps(value, ensure_ascii=False, separators=(", ", ": "))
    return text if len(text) <= _SHOWN_CHARS else text[:_SHOWN_CHARS - 1] + "…"


def changes_line(source: str, name: str, experiment_path: str,
                 changes: list[tuple[str, Any, Any]]) -> str:
    """The one-line refusal: ``FILE: name: sweep 'x' … key: old → new, …; the ways on``."""
    listed = ", ".join(f"{key}: {_shown(old)} → {_shown(new)}"
                       for key, old, new in changes[:_SHOWN_KEYS])
    more = len(changes) - _SHOWN_KEYS
    if more > 0:
        listed += f" (+{more} more)"
    return (f"{source}: name: sweep {name!r} at {experiment_path} was launched with other "
            f"settings ({listed}); run these as a new sweep (--name NEW) or start this one over "
            f"(--fresh)")


def _filesystem(experiment_path: str) -> tuple[Any, str]:
    """``pyarrow.fs`` file system and path of the experiment directory (local or a URI)."""
    from pyarrow import fs

    return fs.FileSystem.from_uri(experiment_path)


def read_stored_json(directory: str, name: str) -> Any:
    """The JSON file ``name`` a sweep keeps beside its state in ``directory`` (a local path or a
    bucket URI), parsed; None where there is no such file.

    Raises:
        OSError, ValueError: the file system cannot be reached, or the file is not JSON.
    """
    from pyarrow import fs as pafs

    filesystem, path = _filesystem(directory)
    file_path = f"{path.rstrip('/')}/{name}"
    if filesystem.get_file_info(file_path).type != pafs.FileType.File:
        return None
    with filesystem.open_input_stream(file_path) as stream:
        return json.loads(stream.read().decode())


def write_stored_json(directory: str, name: str, value: Any) -> None:
    """``value`` as the JSON file ``name`` in ``directory`` (a local path or a bucket URI;
    created where missing).

    Raises:
        OSError, ValueError: the file system cannot be reached or written.
    """
    filesystem, path = _filesystem(directory)
    path = path.rstrip("/")
    filesystem.create_dir(path, recursive=True)
    with filesystem.open_output_stream(f"{path}/{name}") as stream:
        stream.write(json.dumps(value, indent=1).encode())


def read_identity(experiment_path: str) -> dict[str, Any] | None:
    """The stored identity of the sweep at ``experiment_path``: ``{"settings": ..., "data": ...}``
    (``data`` None where an older raycl stored only the settings); None where it has none.

    Raises:
        OSError, ValueError: the file system cannot be reached, or the file is not JSON.
    """
    stored = read_stored_json(experiment_path, SWEEP_FILE)
    if stored is None:
        return None
    if stored.get("format") == _FORMAT:
        return {"settings": stored["settings"], "data": stored.get("data")}
    return {"settings": stored, "data": None}  # raycl before the data key: the settings alone


def read_settings(experiment_path: str) -> dict[str, Any] | None:
    """The stored settings of the sweep at ``experiment_path``, None where it has none.

    Raises:
        OSError, ValueError: the file system cannot be reached, or the file is not JSON.
    """
    identity = read_identity(experiment_path)
    return None if identity is None else identity["settings"]


def data_line(source: str, name: str, experiment_path: str,
              changes: list[tuple[str, str]]) -> str:
    """The one-line refusal of other data: ``FILE: data.root: sweep 'x' … what changed``."""
    section = changes[0][0]
    listed = "; ".join(f"{key}: {change}" for key, change in changes)
    return (f"{source}: {section}.root: sweep {name!r} at {experiment_path} was launched on "
            f"other data ({listed}); run it as a new sweep (--name NEW) or start this one over "
            f"(--fresh)")


def _compare_data(stored: dict[str, Any] | None, data: dict[str, Any] | None, source: str,
                  name: str, experiment_path: str) -> str | None:
    """Raise ConfigError when the data changed; a notice where it cannot be compared."""
    from raycl.launch.data_identity import data_changes

    if data is None:
        return None
    if stored is None:
        return (f"sweep {name!r} was launched by a raycl that stored no key of its data; "
                f"resuming it without comparing the data (--fresh starts it over with this data)")
    changes = data_changes(stored, data)
    if changes:
        raise ConfigError(data_line(source, name, experiment_path, changes))
    return None


def check_same_sweep(config: CoreConfig, experiment_path: str, source: str | None = None,
                     data: dict[str, Any] | None = None) -> str | None:
    """Before resuming the sweep at ``experiment_path`` with ``config`` (absolute paths, as
    trials get it) and ``data`` (:func:`~raycl.launch.data_identity.data_keys`; None: the data
    is not compared): raise when its stored settings or data differ; a notice where they cannot
    be compared.

    Raises:
        ConfigError: the differing keys, old → new, or what changed in the data, and the ways on
            (one line). Settings are compared first: other settings usually mean other data.
    """
    try:
        stored = read_identity(experiment_path)
    except (OSError, ValueError, KeyError, AttributeError) as exc:
        return (f"the settings stored with sweep {config.name!r} cannot be read ({exc}); "
                f"resuming without comparing them")
    if stored is None:
        return (f"sweep {config.name!r} was launched by an older raycl that stored no settings; "
                f"resuming it as it was launched (--fresh starts it over with these)")
    changes = setting_changes(stored["settings"], config.to_dict())
    if changes:
        raise ConfigError(changes_line(source or config.name, config.name, experiment_path,
                                       changes))
    return _compare_data(stored["data"], data, source or config.name, config.name,
                         experiment_path)


def store_settings(config: CoreConfig, experiment_path: str,
                   data: dict[str, Any] | None = None) -> str | None:
    """Write ``config``'s settings and ``data``'s keys beside a new sweep's state; a notice
    where that failed (the sweep still launches; a re-run then resumes it without comparing)."""
    try:
        write_stored_json(experiment_path, SWEEP_FILE,
                          {"format": _FORMAT, "settings": config.to_dict(), "data": data})
    except (OSError, ValueError) as exc:
        return (f"the sweep's settings could not be stored at {experiment_path} ({exc}); a "
                f"re-run will resume it without comparing settings")
    return None


__all__ = ["RESUME_MAY_CHANGE", "SWEEP_FILE", "changes_line", "check_same_sweep", "data_line",
           "read_identity", "read_settings", "read_stored_json", "setting_changes",
           "store_settings", "write_stored_json"]
