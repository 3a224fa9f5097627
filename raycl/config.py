"""The schema of a search YAML, its loader and its validation.

One YAML file in ``searches/`` describes a whole experiment. Every key is a field below with a
description, so ``python -m raycl.tune --show-schema`` prints the documentation of all keys.

Bad input never launches anything: :func:`load_search` raises :class:`ConfigError` whose message is
one line naming the file and the dotted key, and ``python -m raycl.tune`` turns it into exit code 2.
"""

from __future__ import annotations

import copy
import math
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any, Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator


class ConfigError(ValueError):
    """A search YAML (or an override of it) is invalid. The message is one line: file: key: why."""


class _Section(BaseModel):
    model_config = ConfigDict(extra="forbid", validate_assignment=True)


class DataConfig(_Section):
    dataset: Literal["trifeature", "mnist_fashion", "digits", "folder"] = Field(
        "trifeature", description="Dataset: generated Trifeature, MNIST⊕Fashion-MNIST, sklearn "
        "digits, or an ImageFolder-style directory given by data.root."
    )
    resolution: int = Field(32, ge=8, le=1024, description="Square image side in pixels.")
    samples_per_combination: int = Field(
        5, ge=1, description="Trifeature: images per (shape, texture, colour) combination "
        "(1000 combinations; the paper uses 100)."
    )
    num_samples: int | None = Field(
        None, ge=10, description="mnist_fashion: number of pairs to draw (None: 5000)."
    )
    test_fraction: float = Field(
        0.2, gt=0.0, lt=1.0, description="Held-out fraction used for linear/kNN evaluation."
    )
    root: str | None = Field(None, description="folder: root directory with one folder per class.")
    cache_dir: str | None = Field(
        None, description="Where generated datasets are cached (None: $RAYCL_CACHE or "
        "~/.cache/raycl). Must be shared storage on multi-node clusters, or each node generates."
    )

    @model_validator(mode="after")
    def _folder_needs_root(self) -> DataConfig:
        if self.dataset == "folder" and not self.root:
            raise ValueError("data.root is required when data.dataset is 'folder'")
        return self


class AugmentConfig(_Section):
    crop_scale: tuple[float, float] = Field(
        (0.2, 1.0), description="Random resized crop area range (fraction of the image)."
    )
    flip: bool = Field(True, description="Random horizontal flip.")
    color_jitter: float = Field(
        0.0, ge=0.0, le=2.0, description="Colour jitter strength s (0 = off). On Trifeature it "
        "destroys the colour feature, which is why it is off by default."
    )
    color_jitter_prob: float = Field(0.8, ge=0.0, le=1.0, description="Probability of jitter.")
    grayscale_prob: float = Field(0.0, ge=0.0, le=1.0, description="Probability of grayscale.")

    @field_validator("crop_scale")
    @classmethod
    def _ordered(cls, value: tuple[float, float]) -> tuple[float, float]:
        low, high = value
        if not 0.0 < low <= high <= 1.0:
            raise ValueError("must satisfy 0 < low <= high <= 1")
        return value


class ModelConfig(_Section):
    backbone: Literal["small_cnn", "resnet18", "resnet50"] = Field(
        "small_cnn", description="Encoder: a 4-block CNN for CPU runs, or torchvision "
        "ResNet-18/50 in the CIFAR variant (3x3 stem, no max-pool) for GPU runs."
    )
    width: int = Field(32, ge=4, description="small_cnn: channels of the first block.")
    projector_hidden_dim: int = Field(256, ge=1, description="Projector MLP hidden width.")
    projector_dim: int = Field(64, ge=1, description="Projector output (embedding) dimension.")


class TrainConfig(_Section):
    epochs: int = Field(10, ge=1, description="Epochs (per stage for MCL).")
    batch_size: int = Field(256, ge=2, description="Global batch size, split across workers.")
    lr: float = Field(1e-3, gt=0.0, description="Peak learning rate (after warmup).")
    weight_decay: float = Field(1e-6, ge=0.0, description="Weight decay.")
    optimizer: Literal["adamw", "sgd"] = Field("adamw", description="Optimizer.")
    momentum: float = Field(0.9, ge=0.0, lt=1.0, description="SGD momentum.")
    warmup_epochs: float = Field(1.0, ge=0.0, description="Linear warmup, then cosine decay.")
    amp: Literal["auto", "off", "bf16", "fp16"] = Field(
        "auto", description="Mixed precision: auto = fp16 autocast on CUDA, off on CPU."
    )
    loader_workers: int = Field(0, ge=0, description="DataLoader worker processes per worker.")
    checkpoint_every: int = Field(1, ge=1, description="Checkpoint every N epochs (and the last).")


class LossConfig(_Section):
    temperature: float = Field(0.5, gt=0.0, le=10.0, description="InfoNCE temperature τ.")


class MCLConfig(_Section):
    base: str = Field("simclr", description="Inner contrastive method trained at every stage.")
    stages: int = Field(3, ge=1, le=16, description="Number of stages N.")
    clusters: int = Field(5, ge=2, description="K-means clusters K between stages.")
    negatives: Literal["sampler", "mask", "none"] = Field(
        "sampler", description="Feature-aware negatives by the paper's batch sampler (batches "
        "drawn from one pseudo-label group) or by masking the loss's denominator; 'none' is the "
        "ablation: fresh encoders with ordinary negatives (the integration is then an ensemble)."
    )


class EvalConfig(_Section):
    every_n_epochs: int = Field(
        1, ge=0, description="Evaluate every N epochs (0: only at the end of each stage). "
        "ASHA compares trials on these intermediate evaluations."
    )
    knn_k: int = Field(20, ge=1, description="Neighbours for kNN accuracy.")
    linear_max_iter: int = Field(
        200, ge=10, description="Logistic-regression iterations (epochs of the torch probe)."
    )
    linear_backend: Literal["auto", "sklearn", "torch"] = Field(
        "auto", description="Linear probe: scikit-learn lbfgs, or a torch linear head on the "
        "worker's device for large sets (auto: torch above 20 000 training samples or on CUDA)."
    )
    max_train_samples: int | None = Field(
        None, ge=10, description="Cap on probe training samples (None: the whole train split)."
    )


class ScalingSection(_Section):
    num_workers: int = Field(
        1, ge=0, description="Ray Train workers per trial. 0 runs training inside the trial "
        "process (fastest for one CPU worker; no worker group)."
    )
    use_gpu: bool = Field(False, description="One GPU per worker (needs GPUs in the cluster).")
    cpus_per_worker: float = Field(1.0, gt=0.0, description="CPUs reserved per worker.")
    gpus_per_worker: float = Field(1.0, gt=0.0, description="GPUs per worker when use_gpu.")
    max_failures: int = Field(2, ge=0, description="Worker-group restarts before a trial fails.")


class Domain(_Section):
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


class SchedulerConfig(_Section):
    type: Literal["asha", "none"] = Field("asha", description="Early stopping scheduler.")
    grace_period: int = Field(2, ge=1, description="ASHA: reports before a trial can be stopped.")
    reduction_factor: float = Field(2.0, gt=1.0, description="ASHA: halving rate.")
    max_t: int | None = Field(
        None, ge=1, description="ASHA: max reports per trial (None: epochs x stages)."
    )


class TuneSection(_Section):
    num_samples: int = Field(4, ge=1, description="Trials to run.")
    metric: str = Field("eval/linear/mean", description="Objective reported by every trial.")
    mode: Literal["max", "min"] = Field("max", description="Maximise or minimise the metric.")
    search_space: dict[str, Domain] = Field(
        default_factory=dict, description="Dotted config key -> domain, e.g. "
        "{'loss.temperature': {'loguniform': [0.1, 0.5]}}."
    )
    searcher: Literal["optuna", "random"] = Field("optuna", description="Search algorithm.")
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


class MLflowSection(_Section):
    tracking_uri: str = Field(
        "sqlite:///mlflow.db", description="MLflow tracking URI; sqlite locally, http on clusters."
    )
    experiment: str | None = Field(None, description="Experiment name (None: the sweep name).")


class SearchConfig(_Section):
    """A whole experiment: method, data, model, training, scaling, search and tracking."""

    name: str = Field(..., min_length=1, description="Sweep name (MLflow experiment, Ray run).")
    method: str = Field("simclr", description="Method from the registry, or 'mcl' (multistage).")
    seed: int = Field(0, description="Seed of data, initialisation, augmentations and search.")
    data: DataConfig = Field(default_factory=DataConfig)
    augment: AugmentConfig = Field(default_factory=AugmentConfig)
    model: ModelConfig = Field(default_factory=ModelConfig)
    train: TrainConfig = Field(default_factory=TrainConfig)
    loss: LossConfig = Field(default_factory=LossConfig)
    mcl: MCLConfig = Field(default_factory=MCLConfig)
    eval: EvalConfig = Field(default_factory=EvalConfig)
    scaling: ScalingSection = Field(default_factory=ScalingSection)
    tune: TuneSection = Field(default_factory=TuneSection)
    mlflow: MLflowSection = Field(default_factory=MLflowSection)

    @property
    def num_stages(self) -> int:
        return self.mcl.stages if self.method == "mcl" else 1

    def to_dict(self) -> dict[str, Any]:
        return self.model_dump(mode="json")


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


def _field_paths(model: type[BaseModel], prefix: str = "") -> Iterator[str]:
    for name, info in model.model_fields.items():
        annotation = info.annotation
        if isinstance(annotation, type) and issubclass(annotation, BaseModel) \
                and annotation is not Domain:
            yield from _field_paths(annotation, f"{prefix}{name}.")
        else:
            yield f"{prefix}{name}"


CONFIG_KEYS: tuple[str, ...] = tuple(_field_paths(SearchConfig))


def set_dotted(tree: dict[str, Any], dotted: str, value: Any) -> None:
    """Set ``tree["a"]["b"] = value`` for ``"a.b"``, creating sections as needed."""
    *parents, leaf = dotted.split(".")
    node = tree
    for part in parents:
        child = node.get(part)
        if not isinstance(child, dict):
            child = {}
            node[part] = child
        node = child
    node[leaf] = value


def apply_overrides(config: SearchConfig, values: Mapping[str, Any]) -> SearchConfig:
    """A copy of ``config`` with dotted keys replaced, validated again (trial configs)."""
    raw = config.to_dict()
    for key, value in values.items():
        set_dotted(raw, key, value)
    return SearchConfig.model_validate(raw)


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
            type_name = getattr(annotation, "__name__", None) or str(annotation)
            type_name = type_name.replace("typing.", "").replace("|", "\\|")
            default = "required" if info.is_required() else repr(info.get_default(
                call_default_factory=True))
            description = (info.description or "").replace("|", "\\|")
            lines.append(f"| `{prefix}{name}` | {type_name} | {default} | {description} |")

    walk(SearchConfig, "")
    return "\n".join(lines)


# ---------------------------------------------------------------------------------------------
# Loading


def _format_error(source: str, error: ValidationError) -> str:
    first = error.errors()[0]
    key = ".".join(str(part) for part in first["loc"]) or "(top level)"
    message = first["msg"]
    if first["type"] == "extra_forbidden":
        message = "unknown key"
    elif "input" in first and first["type"] not in ("missing",):
        shown = repr(first["input"])
        message = f"{message} (got {shown[:60]})"
    more = len(error.errors()) - 1
    suffix = f" (+{more} more problem{'s' if more > 1 else ''})" if more else ""
    return f"{source}: {key}: {message}{suffix}"


def parse_override(text: str) -> tuple[str, Any]:
    """``"train.epochs=3"`` -> ``("train.epochs", 3)``; the value is parsed as YAML."""
    if "=" not in text:
        raise ConfigError(f"--set {text}: expected key=value")
    key, raw = text.split("=", 1)
    key = key.strip()
    try:
        value = yaml.safe_load(raw) if raw.strip() else ""
    except yaml.YAMLError as exc:
        raise ConfigError(f"--set {key}: value is not valid YAML ({exc.problem})") from None
    return key, value


def estimated_train_size(data: DataConfig) -> int | None:
    """Training-split size known without loading data (None when it depends on files)."""
    total = {
        "trifeature": 1000 * data.samples_per_combination,
        "mnist_fashion": data.num_samples or 5000,
        "digits": 1797,
    }.get(data.dataset)
    if total is None:
        return None
    return total - math.ceil(total * data.test_fraction)


def stage_budget_problem(
    clusters: int, stages: int, train_size: int, batch_size: int
) -> str | None:
    """MCL's constraint K^N <= M/b in the paper's literal form (Eq. 4), as the issue asks.

    :func:`raycl.cluster.check_stage_budget` explains why K^(N-1) would suffice; the literal
    form is K times stricter and guarantees every last-stage group averages K batches.
    """
    from raycl.cluster import check_stage_budget  # late: faiss is slow to import

    problem = check_stage_budget(clusters, stages, train_size, batch_size,
                                 count_final_clustering=True)
    return f"MCL needs K^N <= M/b with K={clusters}, N={stages}: {problem}" if problem else None


def _check_search_space(config: SearchConfig, source: str) -> None:
    for key, domain in config.tune.search_space.items():
        where = f"{source}: tune.search_space.{key}"
        if key not in CONFIG_KEYS or key.startswith(("tune.", "mlflow.", "name")):
            raise ConfigError(f"{where}: not a searchable config key")
        for value in domain.candidates():
            try:
                apply_overrides(config, {key: value})
            except ValidationError as exc:
                raise ConfigError(f"{where}: value {value!r} is invalid: "
                                  f"{exc.errors()[0]['msg']}") from None


def _check_mcl(config: SearchConfig, source: str) -> None:
    if config.method != "mcl":
        return
    train_size = estimated_train_size(config.data)
    if train_size is None:
        return  # checked by the trial once the folder is read
    space = config.tune.search_space
    searched = any(k in space for k in ("mcl.clusters", "mcl.stages", "train.batch_size"))
    problem = stage_budget_problem(config.mcl.clusters, config.mcl.stages, train_size,
                                   config.train.batch_size)
    if problem and not searched:
        raise ConfigError(f"{source}: mcl.clusters/mcl.stages: {problem}")


def validate_references(config: SearchConfig, source: str) -> None:
    """Checks that need more than field types: registry names, search space, MCL budget."""
    from raycl.methods import METHODS  # late: keeps `--help` and config errors fast

    if config.method != "mcl" and config.method not in METHODS:
        raise ConfigError(f"{source}: method: unknown method {config.method!r} "
                          f"(known: {', '.join(sorted([*METHODS, 'mcl']))})")
    if config.method == "mcl" and config.mcl.base not in METHODS:
        raise ConfigError(f"{source}: mcl.base: unknown method {config.mcl.base!r} "
                          f"(known: {', '.join(sorted(METHODS))})")
    if config.scaling.num_workers > 0 and config.train.batch_size % config.scaling.num_workers:
        raise ConfigError(f"{source}: train.batch_size: {config.train.batch_size} is not "
                          f"divisible by scaling.num_workers={config.scaling.num_workers}")
    if config.data.dataset == "folder" and not Path(str(config.data.root)).expanduser().is_dir():
        raise ConfigError(f"{source}: data.root: not a directory: {config.data.root}")
    _check_search_space(config, source)
    _check_mcl(config, source)


def load_search(
    path: str | Path,
    overrides: list[str] | None = None,
    *,
    check_references: bool = True,
) -> SearchConfig:
    """Read a search YAML, apply ``--set key=value`` overrides, validate everything.

    Raises:
        ConfigError: one line naming the file (or ``--set``) and the dotted key.
    """
    source = str(path)
    try:
        text = Path(path).read_text()
    except OSError as exc:
        raise ConfigError(f"{source}: cannot read: {exc.strerror}") from None
    try:
        raw = yaml.safe_load(text)
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        where = f"line {mark.line + 1}" if mark else "?"
        raise ConfigError(f"{source}: {where}: invalid YAML: "
                          f"{getattr(exc, 'problem', exc)}") from None
    if not isinstance(raw, dict):
        raise ConfigError(f"{source}: (top level): expected a mapping of sections")
    raw = copy.deepcopy(raw)
    for text_override in overrides or []:
        key, value = parse_override(text_override)
        if key not in CONFIG_KEYS and not key.startswith("tune.search_space."):
            raise ConfigError(f"--set {key}: unknown key")
        set_dotted(raw, key, value)
    try:
        config = SearchConfig.model_validate(raw)
    except ValidationError as exc:
        raise ConfigError(_format_error(source, exc)) from None
    if check_references:
        validate_references(config, source)
    return config
