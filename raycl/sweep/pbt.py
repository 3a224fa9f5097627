"""Population-based training's schedulers (``tune.scheduler.type: pbt | pb2``) and the Tuner
parts of a population: Ray's synchronous PBT with raycl's additions
(:class:`raycl.sweep.population.RayclPopulation`, where the design and the workarounds are
written), PB2 from :mod:`raycl.sweep.pb2` when asked for."""

from __future__ import annotations

from typing import Any

from ray.tune.schedulers import PopulationBasedTraining

from raycl.config.schema import CoreConfig
from raycl.sweep.population import (
    EPOCH_KEY,
    ClampToDomains,
    RayclPopulation,
    bounds,
    initial_space,
    mutations,
)


class RayclPBT(RayclPopulation, PopulationBasedTraining):
    """Ray's ``PopulationBasedTraining`` with raycl's additions (:class:`RayclPopulation`)."""


def population_scheduler(config: CoreConfig) -> Any:
    """The sweep's PBT or PB2 scheduler (``tune.scheduler.type``).

    Args:
        config: the sweep's config (a population type, checked by :func:`check_pbt`).

    Returns:
        A :class:`RayclPBT` or :class:`RayclPB2`.
    """
    from raycl.launch.feasibility import max_reports

    scheduler = config.tune.scheduler
    common: dict[str, Any] = {
        # metric and mode come from the TuneConfig (Tune refuses them given twice).
        "time_attr": EPOCH_KEY,
        "perturbation_interval": scheduler.perturbation_interval,
        "quantile_fraction": scheduler.quantile_fraction,
        "custom_explore_fn": ClampToDomains(config.tune.search_space),
        # Reports without the objective (no evaluation that epoch) or without an epoch (a
        # finished trial's last one) are no reason to fail the sweep.
        "require_attrs": False, "synch": True,
    }
    raycl = {"config": config, "last_epoch": max_reports(config)}
    if scheduler.type == "pb2":
        from raycl.sweep.pb2 import RayclPB2  # SciPy and scikit-learn: only here

        return RayclPB2(hyperparam_bounds=bounds(config), raycl=raycl, **common)
    return RayclPBT(hyperparam_mutations=mutations(config), raycl=raycl,
                    burn_in_period=scheduler.burn_in_period,
                    resample_probability=scheduler.resample_probability,
                    perturbation_factors=tuple(scheduler.perturbation_factors), **common)


def population_tuner_parts(config: CoreConfig) -> tuple[dict[str, Any], Any, int, Any]:
    """``(param_space, search_alg, num_samples, scheduler)`` of a population's Tuner
    (:func:`raycl.sweep.tuner.tuner_search`): the search space's domains drawn by Tune's random
    variants (seeded), and PBT or PB2 over them."""
    return (initial_space(config), population_search(config), config.tune.num_samples,
            population_scheduler(config))


def population_search(config: CoreConfig) -> Any:
    """The population's first values: Tune's random variants, seeded by ``seed`` (Tune's PBT
    refuses a searcher). Every trial of the population is created at once: a generator held
    to ``tune.max_concurrent_trials`` would create the next trial only when one ends, and
    synchronous PBT would never see two trials to compare; the cluster's resources decide how
    many run at a time (Tune warns that it ignores ``max_concurrent_trials`` here)."""
    from ray.tune.search import BasicVariantGenerator

    return BasicVariantGenerator(random_state=config.seed)
