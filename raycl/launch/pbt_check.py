"""Population-based training's pre-launch check (``tune.scheduler.type: pbt | pb2``): which
searched keys may change mid-training, and the schedule's fit with evaluation and checkpoints.
Imports no Ray (it runs with every config check); the scheduler is :mod:`raycl.sweep.pbt`."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any, get_args

from raycl.config.schema import CoreConfig, Problem

POPULATION_SCHEDULERS = ("pbt", "pb2")
# Sections whose keys never change mid-training: the model's shape (widths, backbone, stem),
# the data (resolution, splits), the stage plan (MCL's K and N), placement, what is measured.
_FROZEN_SECTIONS = {
    "model.": "it changes the model's shape or weights (an exploit copies weights of one shape)",
    "data.": "it changes the data the trial trains and is measured on",
    "mcl.": "it changes MCL's stage plan (K, N, clustering)",
    "scaling.": "it changes where and how wide the trial runs",
    "eval.": "it changes what the objective measures",
}
# Float keys read once, at the start: the checkpoint's learned value wins over a mutation.
_INITIAL_ONLY = {"clip.init_logit_scale": "it only sets the learned logit scale's start"}


def mutability_problem(key: str, annotation: Any) -> str | None:
    """Why ``key`` (of field type ``annotation``) cannot be mutated by PBT, or None.

    Args:
        key: a dotted config key of the search space.
        annotation: its field's type in the schema.

    Returns:
        The reason, or None for a float knob the next step reads (rates, temperatures, loss
        weights, ε): only those change a trial without changing what it is.
    """
    for prefix, why in _FROZEN_SECTIONS.items():
        if key.startswith(prefix):
            return why
    if key in _INITIAL_ONLY:
        return _INITIAL_ONLY[key]
    kinds = set(get_args(annotation)) or {annotation}
    if float not in kinds:
        return ("only float knobs are mutable: an integer, choice or switch changes shapes "
                "(batch size, queue sizes, widths), the epoch plan or the code path")
    return None


def _field_annotation(key: str) -> Any:
    """The schema's field type of a dotted key (known to exist: checked before)."""
    from raycl.config.search_config import search_config_class

    model: Any = search_config_class()
    *parents, leaf = key.split(".")
    for part in parents:
        model = model.model_fields[part].annotation
    return model.model_fields[leaf].annotation


def check_pbt(config: CoreConfig) -> Iterator[Problem]:
    """``tune.scheduler.type: pbt | pb2``: a population of mutable keys, perturbed at epochs
    that report the objective and write a checkpoint (a :data:`raycl.launch.checks` check)."""
    tune = config.tune
    kind = tune.scheduler.type
    if kind not in POPULATION_SCHEDULERS:
        return
    where = "tune.scheduler.type"
    if getattr(tune, "objectives", None):
        yield Problem(where, f"{kind} compares trials on one number: with tune.objectives use "
                             f"scheduler type none")
    if not tune.search_space:
        yield Problem("tune.search_space", f"{kind} needs keys to mutate (the search space's)")
    if tune.num_samples < 2:
        yield Problem("tune.num_samples", f"{kind} needs a population of at least 2 trials")
    if kind == "pb2":
        try:
            import sklearn  # noqa: F401  (Ray 2.60's PB2 fits its GP with scikit-learn)
        except ImportError:
            yield Problem(where, "pb2 needs scikit-learn, which is not installed (use pbt)")
    from raycl.config.search_config import config_keys

    known = config_keys()
    for key, domain in tune.search_space.items():
        if key not in known:
            continue  # named by raycl.launch.checks.check_search_space
        why = mutability_problem(key, _field_annotation(key))
        if why:
            yield Problem(f"tune.search_space.{key}",
                          f"not mutable under {kind}: {why}; set it in the YAML, or search it "
                          f"with scheduler asha")
        elif kind == "pb2" and domain.kind not in ("loguniform", "uniform"):
            yield Problem(f"tune.search_space.{key}", f"pb2 models continuous bounds only: "
                                                      f"give loguniform or uniform, not "
                                                      f"{domain.kind}")
    interval = tune.scheduler.perturbation_interval
    for key, every in (("eval.every_n_epochs", config.eval.every_n_epochs),
                       ("train.checkpoint_every", config.train.checkpoint_every)):
        if interval % every:
            yield Problem("tune.scheduler.perturbation_interval",
                          f"{interval} is not a multiple of {key}={every}: a perturbation "
                          f"needs the objective and a checkpoint of the same epoch")


__all__ = ["POPULATION_SCHEDULERS", "check_pbt", "mutability_problem"]
