"""Where a sweep's state lives, and what a launch does with a sweep of its name: decided before
Ray starts (:func:`plan_sweep`, called by ``python -m raycl.tune``).

A sweep of the name that exists resumes only with the settings and data it was launched with
(:mod:`raycl.launch.identity`); otherwise the launch stops with one line (exit 2) before Ray has
spent its ~10 s starting. ``--fresh`` sets the old state aside (renamed, never deleted) and
starts over. A new sweep's identity is stored when its ``Tuner`` is built
(:func:`raycl.sweep.tuner.build_tuner`), so a dry run or a refused launch writes nothing.
"""

from __future__ import annotations

import shutil
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from raycl.config.schema import ConfigError, CoreConfig
from raycl.launch.data_identity import data_keys
from raycl.launch.identity import check_same_sweep
from raycl.launch.load import with_absolute_paths


def resolved_storage(path: str) -> str:
    """``tune.storage_path`` as Ray gets it: a URI as given, a local path absolute."""
    return path if "://" in path else str(Path(path).expanduser().resolve())


def storage_child(storage: str, name: str) -> str:
    """``storage``/``name``, before a URI's query: ``s3://b/raycl?endpoint_override=h:9000`` gives
    ``s3://b/raycl/NAME?endpoint_override=h:9000`` (pyarrow reads the options from the query)."""
    path, mark, query = storage.partition("?")
    return f"{path.rstrip('/')}/{name}{mark}{query}"


def set_aside(experiment_path: str) -> None:
    """--fresh keeps the old sweep's state (nothing a user ran is lost): it is renamed."""
    if "://" in experiment_path:
        raise ConfigError(f"--fresh: {experiment_path} is remote; choose a new --name instead")
    stamp = time.strftime("%Y%m%d-%H%M%S")
    aside = f"{experiment_path}.{stamp}"
    shutil.move(experiment_path, aside)
    print(f"raycl: --fresh: previous sweep state moved to {aside}", flush=True)


@dataclass(frozen=True)
class SweepPlan:
    """What a launch does with the sweep of its name, decided by :func:`plan_sweep`.

    Attributes:
        experiment_path: the sweep's state (Ray Tune's experiment directory or URI).
        resume: a sweep of this name exists, with these settings and data: restore it.
            False: a new sweep (any old one was set aside by --fresh).
        data: the data's content keys (:func:`~raycl.launch.data_identity.data_keys`),
            stored with the settings of a new sweep.
    """

    experiment_path: str
    resume: bool
    data: dict[str, Any] = field(default_factory=dict)


def plan_sweep(config: CoreConfig, search_file: str | None, fresh: bool = False) -> SweepPlan:
    """Before Ray starts: whether the sweep of ``config``'s name resumes, is set aside
    (``fresh``) or starts. Nothing is written but --fresh's rename.

    ``config``: as the pre-launch checks saw it, so that inside their
    :func:`~raycl.data.listed_once.listed_once` scope the data's listings are theirs.

    Raises:
        ConfigError: a sweep of this name was launched with other settings or data (exit 2).
    """
    from ray import tune  # the import only: Ray is not started

    absolute = with_absolute_paths(config)  # the settings as stored: what trials get
    experiment_path = storage_child(resolved_storage(absolute.tune.storage_path), absolute.name)
    data = data_keys(config)
    if not tune.Tuner.can_restore(experiment_path):
        return SweepPlan(experiment_path, resume=False, data=data)
    if fresh:
        set_aside(experiment_path)
        return SweepPlan(experiment_path, resume=False, data=data)
    # Other settings or data stop here (ConfigError: exit 2); identical ones resume.
    notice = check_same_sweep(absolute, experiment_path, search_file, data)
    if notice:
        print(f"raycl: {notice}", flush=True)
    return SweepPlan(experiment_path, resume=True, data=data)


__all__ = ["SweepPlan", "plan_sweep", "resolved_storage", "set_aside", "storage_child"]
