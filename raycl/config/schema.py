"""The schema of a search YAML: :class:`CoreConfig` and its core sections.

One YAML file in ``searches/`` describes a whole experiment. The core sections are declared in
:mod:`raycl.config.training` (data, augment, model, train, mcl), :mod:`raycl.config.evaluation`
(eval) and :mod:`raycl.config.sweep` (scaling, tune, mlflow) and re-exported here; every
method's knobs are declared in the method's own file and registered with it
(:mod:`raycl.methods`), into :data:`~raycl.config.section.METHOD_SECTIONS`, and become the
top-level section of the same name (``hscl.filter_exponent``) in
:func:`raycl.config.search_config.search_config_class`. Nothing
here imports the method registry: methods import this module.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any, TypeVar

from pydantic import Field

from raycl.config.evaluation import EvalConfig, TransferConfig
from raycl.config.paper import PaperConfig
from raycl.config.section import METHOD_SECTIONS, ConfigError, Problem, Section
from raycl.config.sweep import (
    Domain,
    MLflowSection,
    ScalingSection,
    SchedulerConfig,
    TuneSection,
    reported_test_metric,
    resolve_tracking_uri,
)
from raycl.config.training import (
    AugmentConfig,
    DataConfig,
    MCLConfig,
    ModelConfig,
    TrainConfig,
)

SectionType = TypeVar("SectionType", bound=Section)


class CoreConfig(Section):
    """The method-agnostic part of :data:`SearchConfig` (which adds one section per method)."""

    name: str = Field(..., min_length=1, description="Sweep name (MLflow experiment, Ray run).")
    method: str = Field("simclr", description="Method from the registry, or 'mcl' (multistage).")
    seed: int = Field(0, description="Seed of data, initialisation, augmentations and search.")
    data: DataConfig = Field(default_factory=DataConfig)
    augment: AugmentConfig = Field(default_factory=AugmentConfig)
    model: ModelConfig = Field(default_factory=ModelConfig)
    train: TrainConfig = Field(default_factory=TrainConfig)
    mcl: MCLConfig = Field(default_factory=MCLConfig)
    eval: EvalConfig = Field(default_factory=EvalConfig)
    scaling: ScalingSection = Field(default_factory=ScalingSection)
    tune: TuneSection = Field(default_factory=TuneSection)
    mlflow: MLflowSection = Field(default_factory=MLflowSection)
    paper: PaperConfig | None = Field(
        None, description="The paper's number for this experiment, e.g. {metric: "
        "test/linear_sgd/fine, value: 72.17, table: 'Table 1'} (paper.*): the parent run and "
        "the leaderboard print the best trial's (chosen on tune.metric) test value beside it, "
        "with the difference. None: no comparison."
    )

    @property
    def data_seed(self) -> int:
        """The seed of the data (generation, pairing, splits, evaluation subsets):
        ``data.seed``, else ``seed``."""
        return self.seed if self.data.seed is None else self.data.seed

    @property
    def num_stages(self) -> int:
        return self.mcl.stages if self.method == "mcl" else 1

    def to_dict(self, used_sections_only: bool = False) -> dict[str, Any]:
        """The config as plain JSON values; ``used_sections_only`` drops the sections of methods
        its trials do not run (for MLflow params)."""
        raw = self.model_dump(mode="json")
        if used_sections_only:
            used = self.used_sections()
            for name in METHOD_SECTIONS:
                if name not in used:
                    raw.pop(name, None)
        return raw

    def trial_dict(self, values: Mapping[str, Any]) -> dict[str, Any]:
        """:meth:`to_dict` of this trial config (``values``: its searched values) for its
        MLflow params: only the method sections the trial itself reads
        (:func:`trial_sections`), not every section its sweep's search space reaches."""
        raw = self.to_dict(used_sections_only=True)
        own = trial_sections(self, values)
        for name in METHOD_SECTIONS:
            if name not in own:
                raw.pop(name, None)
        return raw

    def section(self, kind: type[SectionType]) -> SectionType:
        """The method section of type ``kind``: ``cfg.section(HSCLConfig).filter_exponent``."""
        for name in type(self).model_fields:
            value = getattr(self, name)
            if type(value) is kind:
                return value
        raise KeyError(f"no config section of type {kind.__name__} (is its method registered?)")

    def used_sections(self) -> set[str]:
        """Method sections this config's trials read: the method's, its base method's, followed
        down (MCL's ``mcl.base``, FGVR's ``fgvr.base``), and any a search space varies the
        method, a base or a section's keys over."""
        space = self.tune.search_space
        names = {self.method, *(str(value) for value in
                                (space["method"].candidates() if "method" in space else []))}
        names.update(key.split(".")[0] for key in space)
        pending = list(names)
        while pending:
            name = pending.pop()
            bases = {getattr(getattr(self, name, None), "base", None)}
            if f"{name}.base" in space:
                bases.update(space[f"{name}.base"].candidates())
            for base in bases:
                if isinstance(base, str) and base not in names:
                    names.add(base)
                    pending.append(base)
        return names


def trial_sections(config: CoreConfig, values: Mapping[str, Any]) -> set[str]:
    """The method sections one trial reads: its method (``values["method"]``, else the
    config's) followed down each ``<section>.base`` (the trial's value, else the config's).
    ``mcl`` is among them only for ``method: mcl`` (MCL's section is a core one).

    Args:
        config: the sweep's config (defaults for what ``values`` does not give).
        values: the trial's searched values, dotted keys (``{"method": "hscl", ...}``).

    Returns:
        Section names, e.g. ``{"mcl", "simclr"}`` for MCL over SimCLR.
    """
    names: set[str] = set()
    pending = [str(values.get("method", config.method))]
    while pending:
        name = pending.pop()
        if name in names:
            continue
        names.add(name)
        base = values.get(f"{name}.base", getattr(getattr(config, name, None), "base", None))
        if isinstance(base, str):
            pending.append(base)
    return names


def key_is_active(key: str, sections: set[str]) -> bool:
    """Whether a trial reading ``sections`` (:func:`trial_sections`) reads config key ``key``:
    a method's knob (``hscl.filter_exponent``, ``mcl.clusters``) only for that method's
    trials; every other key always."""
    head = key.split(".", 1)[0]
    if head in METHOD_SECTIONS or head == "mcl":
        return head in sections
    return True


def active_values(config: CoreConfig, values: Mapping[str, Any]) -> dict[str, Any]:
    """``values`` without the keys its own trial does not read (a SimCLR trial's
    ``hscl.filter_exponent`` in a search over ``method``)."""
    sections = trial_sections(config, values)
    return {key: value for key, value in values.items() if key_is_active(key, sections)}


def conditional_keys(config: CoreConfig) -> list[str]:
    """The searched keys some trials do not read: a method's knobs in a search over ``method``
    (or over a ``<section>.base``) that also offers other methods."""
    import itertools

    space = config.tune.search_space
    deciding = [key for key in space if key == "method" or key.endswith(".base")]
    if not deciding:
        return []
    choices = [space[key].candidates() for key in deciding]
    conditional: set[str] = set()
    for combination in itertools.product(*choices):
        sections = trial_sections(config, dict(zip(deciding, combination, strict=True)))
        conditional.update(key for key in space if not key_is_active(key, sections))
    return [key for key in space if key in conditional]


class ConfigErrors(ConfigError):
    """Every problem found in one pass over a config (a user fixes them all at once).

    ``lines`` holds one ``FILE: key: why`` line per problem, the first first; the message
    (``str()``) is the first line, so a caller that shows one line shows the one that decided.
    ``config``: the config the lines were found on, when it validated (unknown keys and bad
    search-space entries left out, ``dropped``), so the caller's own checks can run on it too.
    """

    def __init__(self, lines: Sequence[str], config: CoreConfig | None = None,
                 dropped: Sequence[str] = ()) -> None:
        super().__init__(lines[0])
        self.lines = list(lines)
        self.config = config
        self.dropped = tuple(dropped)

    def __reduce__(self) -> tuple[Any, ...]:
        # Pickled with its lines (Ray ships exceptions); the config stays behind.
        return ConfigErrors, (self.lines,)


def error_lines(error: ConfigError) -> list[str]:
    """The problems a :class:`ConfigError` reports, one line each (one for a plain one)."""
    return list(error.lines) if isinstance(error, ConfigErrors) else [str(error)]


__all__ = ["METHOD_SECTIONS", "AugmentConfig", "ConfigError", "ConfigErrors", "CoreConfig",
           "DataConfig",
           "Domain", "EvalConfig", "MCLConfig", "MLflowSection", "ModelConfig", "PaperConfig",
           "Problem",
           "ScalingSection", "SchedulerConfig", "Section", "SectionType", "TrainConfig",
           "TransferConfig", "TuneSection", "active_values", "conditional_keys", "error_lines",
           "key_is_active", "reported_test_metric", "resolve_tracking_uri", "trial_sections"]
