"""The module names a sweep started before House III pickled, resolved to where the classes live
now, so that such a sweep still resumes.

``Tuner.restore`` unpickles the sweep's ``tuner.pkl`` and searcher state: its callbacks (the
progress display, the baseline), its searcher (Optuna over ``ConstrainedSpace``), its scheduler
(ASHA, PBT, PB2) and its trainable, each by the module path it had when the sweep started
(``raycl.sweep_display.ProgressDisplay``, ``raycl.searchers.FinishingASHA``, ...). Those modules
moved into :mod:`raycl.sweep` and :mod:`raycl.trial`; :func:`alias_moved_modules` registers each
old name in ``sys.modules`` as a module whose attributes are looked up, on first use, in the
modules that hold them now. No file stands at the old paths: a new import of one fails as any
unknown module does.
"""

from __future__ import annotations

import importlib
import sys
import types
from typing import Any

# Old module -> the modules its public names live in now, searched in order.
MOVED: dict[str, tuple[str, ...]] = {
    "raycl.pipeline": ("raycl.trial.trainable",),
    "raycl.pbt_train": ("raycl.trial.population_workers",),
    "raycl.pbt": ("raycl.sweep.pbt", "raycl.sweep.population", "raycl.sweep.pb2"),
    "raycl.baseline_run": ("raycl.sweep.baseline",),
    "raycl.confirm_run": ("raycl.sweep.confirm_tuner",),
    "raycl.confirm": ("raycl.sweep.confirmation",),
    "raycl.warm_start": ("raycl.sweep.warm_start",),
    "raycl.searchers": ("raycl.sweep.searchers",),
    "raycl.sweep_display": ("raycl.sweep.display",),
    "raycl.quiet_lines": ("raycl.sweep.quiet_lines",),
    "raycl.dry_run": ("raycl.sweep.dry_run",),
    "raycl.ray_workarounds": ("raycl.sweep.worker_setup",),
    "raycl.closed_stdout": ("raycl.tracking.closed_stdout",),
    "raycl.cluster": ("raycl.kmeans",),
    "raycl.queues": ("raycl.methods.queues",),
}


def _moved_module(old: str, homes: tuple[str, ...]) -> types.ModuleType:
    module = types.ModuleType(old, f"{old}: moved to {', '.join(homes)} (a resume alias)")

    def find(name: str) -> Any:
        for home in homes:
            value = getattr(importlib.import_module(home), name, None)
            if value is not None:
                return value
        raise AttributeError(f"{old}.{name}: not in {', '.join(homes)}")

    module.__getattr__ = find  # type: ignore[method-assign]  (PEP 562, on the module object)
    return module


def alias_moved_modules() -> None:
    """Register every old module name (:data:`MOVED`) that is not a module already; idempotent.
    Called in the driver before a sweep is restored (:func:`raycl.sweep.tuner.build_tuner`, seed
    confirmation's tuner): the trials get the trainable the driver passes, by its new name."""
    for old, homes in MOVED.items():
        sys.modules.setdefault(old, _moved_module(old, homes))
