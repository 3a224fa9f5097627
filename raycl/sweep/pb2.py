"""PB2 (``tune.scheduler.type: pb2``): Ray's population-based bandits with raycl's additions.

A module of its own because Ray's PB2 imports scikit-learn and SciPy (~1 s of CPU): only the
driver of a PB2 sweep imports it (:func:`raycl.sweep.pbt.population_scheduler`), never a trial
process; Tune pickles the scheduler with its state under this module's name.
"""

from __future__ import annotations

from ray.tune.schedulers.pb2 import PB2

from raycl.sweep.population import RayclPopulation


class RayclPB2(RayclPopulation, PB2):
    """Ray's ``PB2`` with raycl's additions (:class:`RayclPopulation`)."""
