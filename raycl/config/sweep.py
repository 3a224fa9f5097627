"""The sweep side of the schema: workers per trial, the search space, the scheduler, tracking."""

from __future__ import annotations

import argparse
import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any, Literal

from pydantic import Field, ValidationInfo, field_validator, model_validator

from raycl.config.collapse import CollapseConfig
from raycl.config.metric_names import (
    TEST,
    TRANSFER,
    VAL,
    MetricNameError,
    maybe_metric,
    parse_metric,
    split_stage,
)
from raycl.config.section import Section


class ScalingSection(Section):
    num_workers: int = Field(
        1, ge=0, description="Ray Train workers per trial. 0 runs training inside the trial "
        "process (fastest for one CPU worker; no worker group)."
    )
    use_gpu: bool = Field(False, description="One GPU per worker (needs GPUs in the cluster).")
    cpus_per_worker: float = Field(1.0, gt=0.0, description="CPUs reserved per worker.")
    gpus_per_worker: float = Field(
        1.0, gt=0.0, description="GPUs per worker when use_gpu. Below 1 only with num_workers 0 "
        "or 1 (trials share a GPU): two ranks on one GPU fail in NCCL."
    )
    resources_per_worker: dict[str, float] = Field(
        default_factory=dict, description="Custom Ray resources each worker also reserves, e.g. "
        "{'gpu_node': 1}: workers then run only on nodes declaring them (a node type of the "
        "cluster config). CPUs and GPUs are set by the keys above."
    )
    max_failures: int = Field(
        2, ge=0, description="Worker-group restarts before a trial fails (a preempted or lost "
        "node counts as one)."
    )
    collective_timeout_s: int = Field(
        1800, ge=60, description="How long a collective of the trial's default process group "
        "(NCCL on GPUs, gloo on CPUs) waits for the slowest rank before the group aborts and "
        "restarts: a hung rank costs this long. raycl's long single-rank phases (a node "
        "building its data cache, rank 0 scoring an evaluation) wait outside it, so it only "
        "needs to cover a training step's slowest rank (Ray Train's TorchConfig.timeout_s)."
    )

    @field_validator("resources_per_worker")
    @classmethod
    def _custom_resources_only(cls, resources: dict[str, float]) -> dict[str, float]:
        for name, amount in resources.items():
            if name.upper() in ("CPU", "GPU"):
                key = "cpus_per_worker" if name.upper() == "CPU" else "gpus_per_worker"
                raise ValueError(f"{name!r} is set by scaling.{key}, not here")
            if not amount > 0:
                raise ValueError(f"{name!r}: {amount:g} must be above 0")
        return resources


class Domain(Section):
    """One search-space entry: exactly one of the keys below."""

    loguniform: tuple[float, float] | None = None
    uniform: tuple[float, float] | None = None
    randint: tuple[int, int] | None = Field(None, description="Integers in [low, high].")
    choice: list[Any] | None = None

    @model_validator(mode="after")
    def _exactly_one(self) -> Domain:
        given = [name for name in ("loguniform", "uniform", "randint", "choice")
                 if getattr(self, name) is not None]
        if len(given) != 1:
            raise ValueError("give exactly one of loguniform, uniform, randint, choice")
        kind = given[0]
        if kind == "choice":
            if not self.choice:
                raise ValueError("choice needs at least one value")
            return self
        low, high = getattr(self, kind)
        if low > high or (kind == "loguniform" and low <= 0):
            raise ValueError(f"{kind} needs 0 < low <= high" if kind == "loguniform"
                             else f"{kind} needs low <= high")
        return self

    @property
    def kind(self) -> str:
        return next(n for n in ("loguniform", "uniform", "randint", "choice")
                    if getattr(self, n) is not None)

    def candidates(self) -> list[Any]:
        """Values that bound the domain (to type-check against the target field)."""
        if self.choice is not None:
            return list(self.choice)
        low, high = getattr(self, self.kind)
        return [low, high]


class SchedulerConfig(Section):
    type: Literal["asha", "none", "pbt", "pb2"] = Field(
        "asha", description="asha: stop weak trials early; none: run every trial to the end; "
        "pbt / pb2: population-based training (raycl.sweep.pbt, docs/searches.md): every "
        "perturbation_interval epochs the worse trials copy a better trial's whole checkpoint "
        "and train on with its values of the search space's keys perturbed (pbt) or chosen "
        "by a GP bandit (pb2: loguniform/uniform keys only). Every search_space key is mutable "
        "under pbt/pb2: keys that change the model's shape or MCL's stage plan are refused."
    )
    grace_period: int = Field(
        2, ge=1, description="ASHA: reports before a trial can be stopped (clamped to max_t)."
    )
    reduction_factor: float = Field(2.0, gt=1.0, description="ASHA: halving rate.")
    max_t: int | None = Field(
        None, ge=1, description="ASHA: max reports per trial (None: epochs x stages)."
    )
    perturbation_interval: int = Field(
        1, ge=1, description="PBT/PB2: epochs between perturbations (exploit and explore); a "
        "multiple of eval.every_n_epochs and train.checkpoint_every (a perturbation needs the "
        "objective and a checkpoint of the same epoch)."
    )
    burn_in_period: int = Field(
        0, ge=0, description="PBT/PB2: epochs before the first perturbation."
    )
    quantile_fraction: float = Field(
        0.25, gt=0.0, le=0.5, description="PBT/PB2: the bottom fraction of trials copies the "
        "top fraction at each perturbation (0.5 with 2 trials: one exploit every time)."
    )
    resample_probability: float = Field(
        0.25, ge=0.0, le=1.0, description="PBT: chance that an explored value is drawn afresh "
        "from its search_space domain instead of perturbed."
    )
    perturbation_factors: tuple[float, float] = Field(
        (1.2, 0.8), description="PBT: a loguniform/uniform/randint value is multiplied by one "
        "of these (a choice value moves to a neighbour in its list)."
    )

    @field_validator("perturbation_factors")
    @classmethod
    def _positive_factors(cls, factors: tuple[float, float]) -> tuple[float, float]:
        if min(factors) <= 0:
            raise ValueError("perturbation factors must be above 0 (a value times 0 or less "
                             "leaves its domain)")
        return factors


class ConfirmConfig(Section):
    """Seed confirmation after the search (raycl.sweep.confirmation)."""

    top_k: int = Field(
        1, ge=1, description="Best configurations of the search (by the validation objective) "
        "re-run to the end with fresh seeds."
    )
    seeds: int = Field(
        3, ge=2, le=1000, description="Fresh seeds per configuration (at least 2: a confidence "
        "interval needs a spread). Every configuration gets the same seeds (paired: "
        "confirm.csv gives each one's difference from the winner seed by seed, with its "
        "interval)."
    )
    per: str | None = Field(
        None, description="A searched choice key (method): confirm the best configuration of "
        "each of its values instead of the top_k overall, so the paired difference between "
        "them answers 'does HSCL beat SimCLR on this data?' (top_k is then per value)."
    )
    redraw_data: bool = Field(
        False, description="false: every confirmation trial trains and is scored on the "
        "search's data (its generated images, pairing and splits: data.seed pinned to the "
        "search's), each seed drawing only the initialisation and augmentations. true: each "
        "seed redraws the data too (the data's variance inside the interval)."
    )


# The reserved key of a confirmation trial's config naming its (configuration, seed) case
# (raycl.sweep.confirm_tuner): configurations share their seeds, so the seed cannot name it. No
# config key: dropped before a trial's values are applied (trial_values).
CONFIRM_CASE_KEY = "raycl.confirm_case"


def trial_values(trial_config: Mapping[str, Any]) -> dict[str, Any]:
    """A Tune trial's config as config overrides: without the reserved keys Tune's param space
    carries beside them (:data:`CONFIRM_CASE_KEY`)."""
    return {key: value for key, value in trial_config.items() if key != CONFIRM_CASE_KEY}


class Objective(Section):
    """One objective of a multi-objective sweep (``tune.objectives``)."""

    metric: str = Field(
        description="A metric every trial reports, as tune.metric: a validation metric "
        "(val/linear/shape), a train/ metric, or the trial's cost perf/device_hours (wall "
        "seconds x the trial's devices / 3600, cumulative)."
    )
    mode: Literal["max", "min"] = Field(description="Maximise or minimise it.")

    @field_validator("metric")
    @classmethod
    def _selects_on_validation(cls, metric: str) -> str:
        return selectable_metric(metric)


class TuneSection(Section):
    num_samples: int = Field(
        4, ge=1, description="Trials to run. With an empty search space the trials differ only "
        "by seed (seed, seed+1, ...): repeats of one configuration."
    )
    metric: str = Field(
        "val/linear/mean", description="Objective the searcher and scheduler select on: a "
        "validation metric (val/linear/<attribute>, val/knn/<attribute>, val/linear/mean, "
        "stage<j>/val/...; without labels a label-free figure, val/label_free/rankme, see "
        "eval.label_free) or a train/ metric; test/ metrics are never optimised."
    )
    mode: Literal["max", "min"] = Field("max", description="Maximise or minimise the metric.")
    objectives: list[Objective] | None = Field(
        None, description="Several objectives instead of metric/mode, e.g. "
        "[{metric: val/linear/shape, mode: max}, {metric: val/linear/texture, mode: max}] (at "
        "least 2, distinct; metric as tune.metric, or the cost perf/device_hours = wall seconds "
        "x the trial's devices / 3600, cumulative; mode max or min): Optuna's multi-objective "
        "sampler proposes the trials and the sweep ends with the Pareto-optimal trials (marked "
        "in the leaderboard, pareto.csv and pareto.png on the parent run, tag "
        "raycl.pareto=true on their runs). The first "
        "objective stands in for tune.metric/mode wherever one number ranks trials "
        "(the leaderboard within the front, confirm, importance, --trial best). No early "
        "stopping: ASHA compares one number, so scheduler.type is none (asha is refused)."
    )
    warm_start: str | None = Field(
        None, description="An earlier sweep's MLflow experiment (same tracking_uri) whose best "
        "configurations (the top half of num_samples, at least 1) are the searcher's first "
        "trials; only the searched keys whose values lie inside this search space's domains are "
        "kept (others dropped, with a line). The parent run's tag raycl.warm_start lists them. "
        "Also --warm-start NAME."
    )
    search_space: dict[str, Domain] = Field(
        default_factory=dict, description="Dotted config key -> domain, e.g. "
        "{'simclr.temperature': {'loguniform': [0.1, 0.5]}}."
    )
    searcher: Literal["optuna", "random", "grid"] = Field(
        "optuna", description="Optuna's TPE, Optuna's random sampler, or Optuna's grid sampler "
        "(every combination of the choice domains once, in a seeded order; needs choice domains "
        "only). All are offered only feasible combinations of constrained keys (batch size, "
        "MCL's K and N)."
    )
    scheduler: SchedulerConfig = Field(default_factory=SchedulerConfig)
    max_concurrent_trials: int = Field(1, ge=1, description="Trials running at once.")
    trial_cpus: float = Field(
        0.01, ge=0.0, description="CPUs reserved for a trial's driver process (workers reserve "
        "their own; with num_workers=0 raise this to what the trial really uses)."
    )
    max_failures: int = Field(1, ge=0, description="Trial restarts (from checkpoint) on error.")
    storage_path: str = Field(
        "./ray_results", description="Where Ray keeps trial state and checkpoints (S3/GCS/NFS "
        "on multi-node clusters). Re-running the same name resumes the sweep."
    )
    confirm: ConfirmConfig | None = Field(
        None, description="After the search: re-run the top_k best configurations to the end "
        "with `seeds` fresh seeds each, under the same parent run, which gets confirm.csv (mean "
        "and 95 % interval over seeds, validation and test; the seeds that did not finish, and how "
        "they ended), e.g. {top_k: 1, seeds: 3}. None: off. Refused with scheduler.type pbt / "
        "pb2 (a population trial's values change while it trains: its last ones re-run from "
        "scratch are no run it was)."
    )
    compare: str | None = Field(
        None, description="A searched choice key (method) whose values are compared fairly "
        "as one sweep: each value gets an equal share of num_samples (which must split "
        "evenly), a searcher of its own and ASHA brackets of its own (a trial is stopped "
        "against its own value's rungs: a slow-starting method is not starved), then each "
        "value's best configuration is confirmed over the same fresh seeds (tune.confirm, "
        "default {seeds: 3}, per this key) and the sweep ends with each value's mean and 95 % "
        "interval and their paired difference (raycl.config.compare). None: one search over "
        "every value."
    )
    collapse: CollapseConfig | None = Field(
        None, description="Stop a trial whose representation collapsed, judged at each "
        "evaluation from the label-free figures (eval.label_free), e.g. {std_below: 0.1, "
        "from_epoch: 2}: stopped at once, its run FINISHED with raycl.ended=collapsed and the "
        "reason in its description, recorded as pruned by Optuna, never ranked. None: off."
    )

    @field_validator("confirm")
    @classmethod
    def _confirm_not_on_a_population(cls, confirm: ConfirmConfig | None,
                                     info: ValidationInfo) -> ConfirmConfig | None:
        # A field validator (not the model's): the line then names tune.confirm. The scheduler
        # is declared above confirm, so it is already validated here.
        scheduler = info.data.get("scheduler")
        kind = scheduler.type if isinstance(scheduler, SchedulerConfig) else None
        if confirm is not None and kind in ("pbt", "pb2"):
            # A population trial ends with a schedule of values: its final (mutated) values
            # re-run from scratch are a configuration the population never trained.
            raise ValueError(f"not with tune.scheduler.type {kind}: a population's trials "
                             f"train on a schedule of values, and re-running their last values "
                             f"from scratch confirms a run none of them was (drop tune.confirm, "
                             f"or search with asha or none)")
        return confirm

    @model_validator(mode="after")
    def _confirm_needs_a_search(self) -> TuneSection:
        if self.confirm is None:
            return self
        if not self.search_space:
            raise ValueError("confirm needs a search space (with none, the trials are already "
                             "repeats over seeds)")
        if self.confirm.top_k > self.num_samples:
            raise ValueError(f"confirm.top_k={self.confirm.top_k} exceeds the search's "
                             f"num_samples={self.num_samples}")
        per = self.confirm.per
        if per is not None and (per not in self.search_space
                                or self.search_space[per].choice is None):
            raise ValueError(f"confirm.per={per}: not a choice of the search space (per "
                             f"compares the best configuration of each of its values)")
        return self

    @model_validator(mode="after")
    def _compare_is_fair(self) -> TuneSection:
        from raycl.config.compare import compare_problem

        problem = compare_problem(self)
        if problem:
            raise ValueError(f"compare={self.compare}: {problem}")
        if self.compare is not None:
            # A comparison ends with its confirmation: per the compared key, seeds as given.
            confirm = self.confirm or ConfirmConfig()
            # Plain assignment would validate the section again (validate_assignment).
            object.__setattr__(self, "confirm", confirm.model_copy(update={"per": self.compare}))
        return self

    @field_validator("metric")
    @classmethod
    def _selects_on_validation(cls, metric: str) -> str:
        return selectable_metric(metric)

    @field_validator("objectives")
    @classmethod
    def _distinct_objectives(cls, objectives: list[Objective] | None) -> list[Objective] | None:
        if objectives is None:
            return None
        if len(objectives) < 2:
            raise ValueError("one objective only: give it as tune.metric and tune.mode "
                             "(objectives are for at least 2)")
        metrics = [objective.metric for objective in objectives]
        twice = sorted({metric for metric in metrics if metrics.count(metric) > 1})
        if twice:
            raise ValueError(f"{', '.join(twice)} given twice: objectives must differ")
        return objectives

    @model_validator(mode="after")
    def _objectives_replace_metric(self) -> TuneSection:
        if self.objectives is None:
            return self
        first = self.objectives[0]
        given = self.model_fields_set & {"metric", "mode"}
        # Only what is given can disagree (a mode alone is not refused for the metric's default).
        if any(getattr(self, key) != getattr(first, key) for key in given):
            raise ValueError(f"give tune.objectives or tune.{'/'.join(sorted(given))}, not "
                             f"both (the first objective, {first.metric} {first.mode}, is what "
                             f"the leaderboard, confirm and importance rank on)")
        scheduler = self.scheduler
        if scheduler.type != "none" and "type" in scheduler.model_fields_set:
            raise ValueError(f"scheduler.type {scheduler.type!r} compares one number per trial; "
                             f"a sweep with tune.objectives runs every trial to the end "
                             f"(scheduler.type: none, the default with objectives)")
        # Plain assignment would validate the section again (validate_assignment): recursion.
        object.__setattr__(self, "metric", first.metric)
        object.__setattr__(self, "mode", first.mode)
        if scheduler.type != "none":
            object.__setattr__(self, "scheduler", scheduler.model_copy(update={"type": "none"}))
        return self


def selectable_metric(metric: str) -> str:
    """``metric`` when a sweep may select on it (``tune.metric``, an objective's ``metric``).

    Args:
        metric: a reported metric's name.

    Returns:
        ``metric`` unchanged.

    Raises:
        ValueError: a renamed, test or transfer metric, or a name the worker never reports.
    """
    # The first part after an MCL stage prefix says what kind of metric it is.
    head = split_stage(metric)[1].split("/")[0]
    if head == "eval":
        renamed = metric.replace("eval/", f"{VAL}/", 1)
        raise ValueError(f"{metric!r} was renamed to {renamed!r} (probes are scored on the "
                         f"validation split during a sweep, on test once per trial)")
    if head == TEST:
        raise ValueError(f"{metric!r} is a test metric: it is reported once at the end of a "
                         f"trial and never optimised; select on its val/ counterpart")
    if head == TRANSFER:
        raise ValueError(f"{metric!r} is a transfer metric: scored on the transfer set's "
                         f"held-out share once per trial, reported and never optimised; "
                         f"select on val/ of the pretraining set")
    # Only a name the worker reports can be selected on (Tune would fail at the first
    # report, after the launch).
    try:
        parse_metric(metric)
    except MetricNameError as exc:
        raise ValueError(f"{exc} (e.g. val/linear/mean, val/knn/<attribute>, "
                         f"stage<j>/val/..., train/loss, perf/device_hours)") from None
    return metric


def reported_test_metric(metric: str) -> str | None:
    """The test-split metric reported beside a validation objective (None for train/ etc.)."""
    name = maybe_metric(metric)
    return name.replace(split=TEST).format() if name and name.split == VAL else None


# The MLflow store of a sweep and of the commands that read one back, when none is given.
DEFAULT_TRACKING_URI = "sqlite:///mlflow.db"


class MLflowSection(Section):
    tracking_uri: str = Field(
        DEFAULT_TRACKING_URI, description="MLflow tracking URI; sqlite locally, http on clusters."
    )
    experiment: str | None = Field(None, description="Experiment name (None: the sweep name).")
    log_encoder: bool = Field(
        True, description="Log each trial's trained encoder (safetensors weights and model "
        "card) into its run as the artifact encoder/ when it ends with a checkpoint (finished "
        "or stopped early), so raycl.load_encoder('runs:/<run_id>/encoder'), raycl.export and "
        "raycl.evaluate work once ray_results/ is gone; false: the checkpoint tag only.")


def add_tracking_uri_option(parser: argparse.ArgumentParser) -> None:
    """``--tracking-uri``, as every command that reads a sweep back from MLflow takes it
    (leaderboard, export, evaluate): default ``$MLFLOW_TRACKING_URI``, else
    :data:`DEFAULT_TRACKING_URI`."""
    parser.add_argument("--tracking-uri",
                        default=os.environ.get("MLFLOW_TRACKING_URI", DEFAULT_TRACKING_URI),
                        help=f"MLflow URI (default $MLFLOW_TRACKING_URI, else "
                             f"{DEFAULT_TRACKING_URI})")


def resolve_tracking_uri(uri: str) -> str:
    """Make a relative ``sqlite:///x.db`` absolute (against the current directory)."""
    prefix = "sqlite:///"
    if uri.startswith(prefix) and not uri.startswith(prefix + "/"):
        return prefix + str(Path(uri[len(prefix):]).resolve())
    return uri


__all__ = ["CONFIRM_CASE_KEY", "DEFAULT_TRACKING_URI", "ConfirmConfig", "Domain", "MLflowSection",
           "Objective", "ScalingSection", "SchedulerConfig", "TuneSection",
           "add_tracking_uri_option", "reported_test_metric", "resolve_tracking_uri",
           "selectable_metric", "trial_values"]
