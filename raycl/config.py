"""The schema of a search YAML, its loader and its validation.

One YAML file in ``searches/`` describes a whole experiment. Every key is a field below with a
description, so ``python -m raycl.tune --show-schema`` prints the documentation of all keys.

The core sections (data, model, train, mcl, eval, ...) are declared here; every method's knobs are
declared in the method's own file and registered with it (:mod:`raycl.methods`), and become the
top-level section of the same name (``hscl.filter_exponent``). :data:`SearchConfig` is therefore
built on first use, from the registry (which imports torch; ``--help`` does not need it).
MCL's section stays here: MCL is a training procedure around a base method that the spine (the
stages, the feasibility checks, ASHA's budget) reads, not a registered method.

Bad input never launches anything: :func:`load_search` raises :class:`ConfigError` whose message is
one line naming the file and the dotted key, and ``python -m raycl.tune`` turns it into exit code 2.
"""

from __future__ import annotations

import copy
import re
from collections.abc import Iterator, Mapping
from functools import cache
from pathlib import Path
from typing import Any, Literal, TypeVar, get_args

import yaml
from pydantic import (
    BaseModel,
    Field,
    ValidationError,
    create_model,
    field_validator,
    model_validator,
)

from raycl.schema import Section


class ConfigError(ValueError):
    """A search YAML (or an override of it) is invalid. The message is one line: file: key: why."""


class DataConfig(Section):
    dataset: Literal["trifeature", "mnist_fashion", "digits", "folder", "pairs"] = Field(
        "trifeature", description="Dataset: generated Trifeature, MNIST⊕Fashion-MNIST, sklearn "
        "digits, an ImageFolder-style directory given by data.root, or image-caption pairs "
        "listed in the CSV/TSV file data.root (no labels; split at random)."
    )
    resolution: int = Field(32, ge=8, le=1024, description="Square image side in pixels.")
    samples_per_combination: int = Field(
        5, ge=1, description="Trifeature: images per (shape, texture, colour) combination "
        "(1000 combinations; the paper uses 100)."
    )
    num_samples: int | None = Field(
        None, ge=10, le=5000, description="mnist_fashion: number of pairs to draw (None: all "
        "5000 of the offline MNIST subset)."
    )
    val_fraction: float = Field(
        0.1, gt=0.0, lt=1.0, description="Share of each class held out for validation: probes "
        "are fit on train and scored here at every evaluation; sweeps select on it."
    )
    test_fraction: float = Field(
        0.2, gt=0.0, lt=1.0, description="Share of each class held out for the test split, "
        "scored once at the end of each trial and never optimised. Ignored by a folder in the "
        "train_test layout, whose test split is its test/ folder."
    )
    root: str | None = Field(
        None, description="folder: the dataset directory, root/<class>/* or root/train/<class>/* "
        "+ root/test/<class>/* (see data.layout). pairs: a CSV (comma) or TSV (tab, by the .tsv "
        "suffix) file with a header, an image column (image, filepath or path; relative to the "
        "file's directory) and a caption column (caption, title or text), one pair per row. "
        "Relative paths resolve against the launch directory."
    )
    captions: dict[str, float] | None = Field(
        None, description="trifeature: give every image a synthetic caption; per attribute "
        "(color, texture, shape) the probability that a caption names it, e.g. {color: 1.0, "
        "shape: 0.5, texture: 0.1} ('a red triangle', 'a red object'); unnamed attributes are "
        "never named. Drawn from the data seed. None: no captions."
    )
    layout: Literal["auto", "flat", "train_test"] = Field(
        "auto", description="folder: flat = root/<class>/*, split by data.val_fraction and "
        "data.test_fraction; train_test = root/train/<class>/* and root/test/<class>/* as CUB-200, "
        "Stanford Cars and FGVC-Aircraft ship them: test is exactly test/, validation a "
        "stratified data.val_fraction share of train/, class indices the sorted class names of "
        "both (a class only in test/ is an error). auto: train_test when root/train/ and "
        "root/test/ both hold class folders, else flat."
    )
    cache_dir: str | None = Field(
        None, description="Where generated datasets are cached (None: $RAYCL_CACHE or "
        "~/.cache/raycl). Must be shared storage on multi-node clusters, or each node generates."
    )

    @field_validator("captions")
    @classmethod
    def _known_caption_rates(cls, rates: dict[str, float] | None) -> dict[str, float] | None:
        # The names of raycl.data.captions.CAPTION_ORDER, written out: importing that module
        # here would load the Trifeature renderer whenever a config is read.
        known = ("color", "texture", "shape")
        for name, rate in (rates or {}).items():
            if name not in known:
                raise ValueError(f"unknown caption attribute {name!r} (attributes: "
                                 f"{', '.join(known)})")
            if not 0.0 <= rate <= 1.0:
                raise ValueError(f"the rate of {name!r} must be in [0, 1], got {rate}")
        return rates

    @model_validator(mode="after")
    def _folder_needs_root(self) -> DataConfig:
        if self.dataset == "folder" and not self.root:
            raise ValueError("data.root is required when data.dataset is 'folder'")
        if self.dataset == "pairs" and not self.root:
            raise ValueError("data.root is required when data.dataset is 'pairs' (the CSV or "
                             "TSV file of image, caption rows)")
        if self.captions is not None and self.dataset != "trifeature":
            raise ValueError(f"data.captions is only for data.dataset trifeature (its captions "
                             f"are made from its labels), not {self.dataset!r}")
        if self.val_fraction + self.test_fraction >= 1.0:
            raise ValueError("data.val_fraction + data.test_fraction must be < 1 (a training "
                             "split must remain)")
        return self


class AugmentConfig(Section):
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


class ModelConfig(Section):
    backbone: Literal["small_cnn", "resnet18", "resnet50"] = Field(
        "small_cnn", description="Encoder: a 4-block CNN for CPU runs, or torchvision "
        "ResNet-18/50 (stem: model.stem) for GPU runs."
    )
    stem: Literal["auto", "cifar", "imagenet"] = Field(
        "auto", description="ResNet stem: cifar = 3x3 stride-1 conv, no max-pool (small "
        "images); imagenet = torchvision's 7x7 stride-2 conv + max-pool (what ImageNet weights "
        "need). auto: imagenet when data.resolution >= 128 (layer1 then sees >= 32 px, as with "
        "the cifar stem at 32 px), else cifar. small_cnn ignores it."
    )
    pretrained: str | None = Field(
        None, description="Local weights file the backbone starts from (never downloaded): a "
        "torchvision ResNet state dict (torch.save(resnet50().state_dict()); fc.* ignored) or "
        "a raycl checkpoint's state.pt (its backbone.* weights). Every backbone weight must be "
        "in it with the shape model.backbone, model.stem and the data's channels give; checked "
        "before launch. Relative paths resolve against the launch directory."
    )
    width: int = Field(32, ge=4, description="small_cnn: channels of the first block.")
    projector_hidden_dim: int = Field(256, ge=1, description="Projector MLP hidden width.")
    projector_dim: int = Field(64, ge=1, description="Projector output (embedding) dimension.")


class TrainConfig(Section):
    epochs: int = Field(10, ge=1, description="Epochs (per stage for MCL).")
    batch_size: int = Field(256, ge=2, description="Global batch size, split across workers.",
                            json_schema_extra={"symbol": "b"})
    lr: float = Field(1e-3, gt=0.0, description="Peak learning rate (after warmup).",
                      json_schema_extra={"symbol": "lr"})
    weight_decay: float = Field(1e-6, ge=0.0, description="Weight decay.",
                                json_schema_extra={"symbol": "wd"})
    optimizer: Literal["adamw", "sgd"] = Field("adamw", description="Optimizer.")
    momentum: float = Field(0.9, ge=0.0, lt=1.0, description="SGD momentum.")
    warmup_epochs: float = Field(1.0, ge=0.0, description="Linear warmup, then lr_schedule.")
    lr_schedule: Literal["cosine", "constant"] = Field(
        "cosine", description="After the warmup: cosine decay to 0, or constant (the MCL "
        "authors' CLIP tuning)."
    )
    amp: Literal["auto", "off", "bf16", "fp16"] = Field(
        "auto", description="Mixed precision: auto = fp16 autocast on CUDA, off on CPU."
    )
    loader_workers: int = Field(0, ge=0, description="DataLoader worker processes per worker.")
    checkpoint_every: int = Field(1, ge=1, description="Checkpoint every N epochs (and the last).")


class MCLConfig(Section):
    base: str = Field("simclr", description="Inner contrastive method trained at every stage.")
    stages: int = Field(3, ge=1, le=16, description="Number of stages N.",
                        json_schema_extra={"symbol": "N"})
    clusters: int = Field(5, ge=2, description="K-means clusters K between stages.",
                          json_schema_extra={"symbol": "K"})
    negatives: Literal["sampler", "mask", "none"] = Field(
        "sampler", description="Feature-aware negatives by the paper's batch sampler (batches "
        "drawn from one pseudo-label group) or by masking the loss's denominator; 'none' is the "
        "ablation: fresh encoders with ordinary negatives (the integration is then an ensemble)."
    )
    kmeans_max_points: int | None = Field(
        None, ge=2, description="Cap on the training points k-means fits its centroids on "
        "(a seeded random subset; every point is still assigned). None: all points."
    )
    kmeans_iterations: int = Field(50, ge=1, description="Lloyd iterations of k-means.")
    integration: Literal["concat", "soup"] = Field(
        "concat", description="How the stages make the trial's representation: concat = the "
        "paper's concatenation of L2-normalised stage features (N times the width); soup = the "
        "average of the stages' weights, one model's size (model soup, MCL appendix A.4). soup "
        "starts every stage from the same initial weights (the same seed, or the pretrained "
        "file), as averaging needs."
    )


class TransferConfig(Section):
    """A labelled dataset the frozen encoder is probed on after training (transfer)."""

    dataset: Literal["trifeature", "mnist_fashion", "digits", "folder"] = Field(
        ..., description="Dataset, as in data.dataset; converted to the pretraining set's "
        "channels and resolution."
    )
    name: str | None = Field(
        None, pattern=r"^[A-Za-z0-9_.-]+$", description="Name in the metric keys "
        "transfer/<name>/linear/<attribute> (None: the dataset name)."
    )
    samples_per_combination: int = Field(2, ge=1, description="trifeature: images per "
                                         "combination.")
    num_samples: int | None = Field(None, ge=10, le=5000, description="mnist_fashion: pairs.")
    root: str | None = Field(None, description="folder: root directory with one folder per "
                             "class.")
    test_fraction: float = Field(
        0.3, gt=0.0, lt=1.0, description="Share of each class the transfer probe is scored on; "
        "it is fit on the rest."
    )

    @property
    def label(self) -> str:
        return self.name or self.dataset

    @model_validator(mode="after")
    def _folder_needs_root(self) -> TransferConfig:
        if self.dataset == "folder" and not self.root:
            raise ValueError("root is required when dataset is 'folder'")
        return self


class EvalConfig(Section):
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
        None, ge=10, description="Cap on probe training samples, a seeded subset stratified on "
        "the first attribute (None: the whole train split)."
    )
    label_fractions: list[float] = Field(
        default_factory=list, description="Also fit the linear probe on these shares of the "
        "(max_train_samples-capped) training labels, e.g. [0.5, 0.2] as FGVR's Table 1: a seeded "
        "subset stratified on the first attribute (at least one image per class when the share "
        "allows), the same at every evaluation of a trial, scored as "
        "val/linear_50pct/<attribute> (and test/...). Each in (0, 1); []: only the full-label "
        "probe (val/linear/...)."
    )
    transfer: list[TransferConfig] = Field(
        default_factory=list, description="Datasets the frozen encoder is linearly probed on "
        "after training, e.g. [{dataset: digits}]: transfer/<name>/linear/<attribute> on their "
        "held-out share. Reported, never optimised."
    )
    diagnostics: bool = Field(
        True, description="End of trial: singular value spectrum and effective rank of the "
        "test-split features (diag/effective_rank), principal angles between each class and the "
        "rest (diag/shared_directions, diag/subclass_directions), plots as artifacts."
    )
    mmvp: str | None = Field(
        None, description="MMVP-style pair benchmark for image-text methods (clip): "
        "'synthetic' = Trifeature pairs differing in one attribute (colour, texture, shape), "
        "each image with its own full caption, eval.mmvp_pairs per attribute, one set for "
        "val/mmvp/* and another for test/mmvp/*; or the directory of the real MMVP-VLM "
        "benchmark (test/mmvp/* only: it is a test set). A pair scores only if both of its "
        "images and statements are matched (eval.mmvp_direction). None: off."
    )
    mmvp_direction: Literal["text_to_image", "image_to_text"] = Field(
        "text_to_image", description="MMVP pair rule: text_to_image = each statement picks its "
        "own image of the pair (the official MMVP-VLM script, scripts/evaluate_vlm.py); "
        "image_to_text = each image picks its own statement."
    )
    mmvp_pairs: int = Field(30, ge=1, description="Synthetic MMVP: pairs per attribute in each "
                            "of the val and test sets.")

    @field_validator("transfer")
    @classmethod
    def _distinct_names(cls, value: list[TransferConfig]) -> list[TransferConfig]:
        labels = [entry.label for entry in value]
        if len(set(labels)) != len(labels):
            raise ValueError(f"transfer names must be distinct, got {labels} (set name: to "
                             f"tell two entries of one dataset apart)")
        return value

    @field_validator("label_fractions")
    @classmethod
    def _fractions_below_one(cls, value: list[float]) -> list[float]:
        outside = [fraction for fraction in value if not 0.0 < fraction < 1.0]
        if outside:
            raise ValueError(f"each fraction must be in (0, 1), got {outside} (the full-label "
                             f"probe always runs, as val/linear/...)")
        percents = [cls.fraction_percent(fraction) for fraction in value]
        if len(set(percents)) != len(percents):
            raise ValueError(f"fractions must be distinct (as percentages in metric keys), got "
                             f"{value}")
        return value

    @staticmethod
    def fraction_percent(fraction: float) -> str:
        """A label fraction as its metric keys write it: 0.5 -> "50" (``linear_50pct``).

        Args:
            fraction: share of the training labels, in (0, 1).

        Returns:
            ``100 × fraction`` to 6 significant digits, without trailing zeros ("12.5", "20").
        """
        return f"{100 * fraction:g}"


class ScalingSection(Section):
    num_workers: int = Field(
        1, ge=0, description="Ray Train workers per trial. 0 runs training inside the trial "
        "process (fastest for one CPU worker; no worker group)."
    )
    use_gpu: bool = Field(False, description="One GPU per worker (needs GPUs in the cluster).")
    cpus_per_worker: float = Field(1.0, gt=0.0, description="CPUs reserved per worker.")
    gpus_per_worker: float = Field(1.0, gt=0.0, description="GPUs per worker when use_gpu.")
    max_failures: int = Field(2, ge=0, description="Worker-group restarts before a trial fails.")


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
    type: Literal["asha", "none"] = Field("asha", description="Early stopping scheduler.")
    grace_period: int = Field(
        2, ge=1, description="ASHA: reports before a trial can be stopped (clamped to max_t)."
    )
    reduction_factor: float = Field(2.0, gt=1.0, description="ASHA: halving rate.")
    max_t: int | None = Field(
        None, ge=1, description="ASHA: max reports per trial (None: epochs x stages)."
    )


class TuneSection(Section):
    num_samples: int = Field(
        4, ge=1, description="Trials to run. With an empty search space the trials differ only "
        "by seed (seed, seed+1, ...): repeats of one configuration."
    )
    metric: str = Field(
        "val/linear/mean", description="Objective the searcher and scheduler select on: a "
        "validation metric (val/linear/<attribute>, val/knn/<attribute>, val/linear/mean, "
        "stage<j>/val/...) or a train/ metric; test/ metrics are never optimised."
    )
    mode: Literal["max", "min"] = Field("max", description="Maximise or minimise the metric.")
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

    @field_validator("metric")
    @classmethod
    def _selects_on_validation(cls, metric: str) -> str:
        parts = metric.split("/")
        if parts and re.fullmatch(r"stage\d+", parts[0]):
            parts = parts[1:]
        if parts and parts[0] == "eval":
            renamed = metric.replace("eval/", "val/", 1)
            raise ValueError(f"{metric!r} was renamed to {renamed!r} (probes are scored on the "
                             f"validation split during a sweep, on test once per trial)")
        if parts and parts[0] == "test":
            raise ValueError(f"{metric!r} is a test metric: it is reported once at the end of a "
                             f"trial and never optimised; select on its val/ counterpart")
        if parts and parts[0] == "transfer":
            raise ValueError(f"{metric!r} is a transfer metric: scored on the transfer set's "
                             f"held-out share once per trial, reported and never optimised; "
                             f"select on val/ of the pretraining set")
        return metric


def reported_test_metric(metric: str) -> str | None:
    """The test-split metric reported beside a validation objective (None for train/ etc.)."""
    renamed = re.sub(r"(^|/)val/", r"\1test/", metric, count=1)
    return renamed if renamed != metric else None


class MLflowSection(Section):
    tracking_uri: str = Field(
        "sqlite:///mlflow.db", description="MLflow tracking URI; sqlite locally, http on clusters."
    )
    experiment: str | None = Field(None, description="Experiment name (None: the sweep name).")


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

    @property
    def num_stages(self) -> int:
        return self.mcl.stages if self.method == "mcl" else 1

    def max_reports(self) -> int:
        """ASHA's max_t: ``scheduler.max_t``, or the reports of the longest trial the search
        space allows (every phase's epochs, e.g. FGVR's decoder pre-training, times stages)."""
        from raycl.methods import stage_epochs

        if self.tune.scheduler.max_t:
            return self.tune.scheduler.max_t
        space = self.tune.search_space
        # The largest value of every searched epoch count and of the stage count.
        longest = {key: max(int(v) for v in domain.candidates()) for key, domain in space.items()
                   if key.endswith("epochs") or key == "mcl.stages"}
        config = apply_overrides(self, longest) if longest else self
        try:
            epochs = stage_epochs(config)
        except ValueError:  # an unknown method: reported by validate_references, not here
            epochs = config.train.epochs
        return max(1, epochs * config.num_stages)

    def to_dict(self, used_sections_only: bool = False) -> dict[str, Any]:
        """The config as plain JSON values; ``used_sections_only`` drops the sections of methods
        its trials do not run (for MLflow params)."""
        raw = self.model_dump(mode="json")
        if used_sections_only:
            used = self.used_sections()
            for name in method_sections():
                if name not in used:
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
        """Method sections this config's trials read: the method's (and MCL's base's), and any
        a search space varies the method over."""
        names = {self.method, self.mcl.base} if self.method == "mcl" else {self.method}
        for key in ("method", "mcl.base"):
            domain = self.tune.search_space.get(key)
            if domain is not None:
                names.update(str(value) for value in domain.candidates())
        names.update(key.split(".")[0] for key in self.tune.search_space)
        return names


@cache
def search_config_class() -> type[CoreConfig]:
    """:class:`CoreConfig` plus one section per registered method (built once, on first use)."""
    from raycl.methods import SECTIONS

    fields: dict[str, Any] = {
        name: (section, Field(default_factory=section, description=f"Knobs of method {name!r} "
                              f"(declared in {section.__module__})."))
        for name, section in sorted(SECTIONS.items())
    }
    model = create_model("SearchConfig", __base__=CoreConfig, __module__=__name__, **fields)
    model.__doc__ = ("A whole experiment: method, data, model, training, scaling, search, "
                     "tracking, and the knobs of every registered method.")
    return model


def method_sections() -> tuple[str, ...]:
    """Top-level keys that are method sections."""
    return tuple(name for name in search_config_class().model_fields
                 if name not in CoreConfig.model_fields)


def __getattr__(name: str) -> Any:
    # SearchConfig and CONFIG_KEYS depend on the method registry: resolved on first use.
    if name == "SearchConfig":
        return search_config_class()
    if name == "CONFIG_KEYS":
        return config_keys()
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


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


@cache
def config_keys() -> tuple[str, ...]:
    """Every dotted config key, method sections included."""
    return tuple(_field_paths(search_config_class()))


def key_symbol(key: str) -> str:
    """The short name of a dotted config key in run names: the ``symbol`` its field declares
    (``Field(..., json_schema_extra={"symbol": "K"})``, the papers' names: ``mcl.clusters`` ->
    ``K``, ``simclr.temperature`` -> ``τ``), else the key's last component (``queue_size``)."""
    model: type[BaseModel] | None = search_config_class()
    info = None
    for part in key.split("."):
        fields = model.model_fields if model is not None else {}
        if part not in fields:
            info = None
            break
        info = fields[part]
        annotation = info.annotation
        model = annotation if isinstance(annotation, type) and issubclass(
            annotation, BaseModel) else None
    extra = info.json_schema_extra if info is not None else None
    symbol = extra.get("symbol") if isinstance(extra, dict) else None
    return str(symbol) if symbol else key.rsplit(".", 1)[-1]


# Keys that moved; a YAML or --set using the old name gets told the new one.
RENAMED_KEYS = {"loss.temperature": "simclr.temperature"}


SEARCH_SPACE_PREFIX = "tune.search_space."


def set_dotted(tree: dict[str, Any], dotted: str, value: Any) -> None:
    """Set ``tree["a"]["b"] = value`` for ``"a.b"``, creating sections as needed.

    A search-space entry is keyed by a dotted config key itself: ``tune.search_space.loss.tau``
    sets ``tree["tune"]["search_space"]["loss.tau"]``.
    """
    if dotted.startswith(SEARCH_SPACE_PREFIX):
        parents, leaf = ["tune", "search_space"], dotted[len(SEARCH_SPACE_PREFIX):]
    else:
        *parents, leaf = dotted.split(".")
    node = tree
    for part in parents:
        child = node.get(part)
        if not isinstance(child, dict):
            child = {}
            node[part] = child
        node = child
    node[leaf] = value


def apply_overrides(config: CoreConfig, values: Mapping[str, Any]) -> CoreConfig:
    """A copy of ``config`` with dotted keys replaced, validated again (trial configs)."""
    raw = config.to_dict()
    for key, value in values.items():
        set_dotted(raw, key, value)
    return search_config_class().model_validate(raw)


def resolve_tracking_uri(uri: str) -> str:
    """Make a relative ``sqlite:///x.db`` absolute (against the current directory)."""
    prefix = "sqlite:///"
    if uri.startswith(prefix) and not uri.startswith(prefix + "/"):
        return prefix + str(Path(uri[len(prefix):]).resolve())
    return uri


def with_absolute_paths(config: CoreConfig) -> CoreConfig:
    """The config with relative paths made absolute against this (the driver's) directory.

    Ray Tune runs every trial in a working directory of its own, where a relative
    ``sqlite:///mlflow.db``, ``data.root``, ``data.cache_dir`` or ``model.pretrained`` would name
    another file (a trial would log its diagnostics into an empty database of its own).
    """
    from raycl.methods import METHODS

    values: dict[str, Any] = {"mlflow.tracking_uri": resolve_tracking_uri(
        config.mlflow.tracking_uri)}
    method_files = {key for cls in METHODS.values() for key in cls.weight_file_keys}
    for key in ("data.root", "data.cache_dir", "model.pretrained", *sorted(method_files)):
        section, field = key.split(".")
        path = getattr(getattr(config, section), field)
        if path is not None and "://" not in path:
            values[key] = str(Path(path).expanduser().resolve())
    transfer = [entry.model_dump(mode="json") for entry in config.eval.transfer]
    for entry in transfer:
        if entry["root"] is not None and "://" not in entry["root"]:
            entry["root"] = str(Path(entry["root"]).expanduser().resolve())
    if transfer:
        values["eval.transfer"] = transfer
    if config.eval.mmvp not in (None, "synthetic") and "://" not in config.eval.mmvp:
        values["eval.mmvp"] = str(Path(config.eval.mmvp).expanduser().resolve())
    return apply_overrides(config, values)


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

    walk(search_config_class(), "")
    return "\n".join(lines)


# ---------------------------------------------------------------------------------------------
# Loading


def _format_error(source: str, error: ValidationError) -> str:
    first = error.errors()[0]
    key = ".".join(str(part) for part in first["loc"]) or "(top level)"
    message = first["msg"].removeprefix("Value error, ")
    if first["type"] == "extra_forbidden":
        message = "unknown key"
    elif "input" in first and first["type"] not in ("missing", "value_error"):
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


# Keys a search may not vary: they name the sweep, or they change what is measured (the
# validation and test splits), which would make trials incomparable.
UNSEARCHABLE_KEYS = ("name", "data.val_fraction", "data.test_fraction", "data.cache_dir")
UNSEARCHABLE_SECTIONS = ("tune.", "mlflow.")


def _is_integer_key(key: str) -> bool:
    model: type[BaseModel] = search_config_class()
    *parents, leaf = key.split(".")
    for part in parents:
        model = model.model_fields[part].annotation  # type: ignore[assignment]
    annotation = model.model_fields[leaf].annotation
    return annotation is int or (int in get_args(annotation) and float not in get_args(annotation))


def _check_search_space(config: CoreConfig, source: str) -> None:
    for key, domain in config.tune.search_space.items():
        where = f"{source}: tune.search_space.{key}"
        if key in RENAMED_KEYS:
            raise ConfigError(f"{where}: renamed to {RENAMED_KEYS[key]} (a method's knobs live "
                              f"in its own section)")
        if key not in config_keys() or key.startswith(UNSEARCHABLE_SECTIONS):
            raise ConfigError(f"{where}: not a searchable config key")
        if key in UNSEARCHABLE_KEYS:
            raise ConfigError(f"{where}: not searchable: it changes the sweep's name or the "
                              f"splits trials are compared on")
        if domain.kind in ("uniform", "loguniform") and _is_integer_key(key):
            raise ConfigError(f"{where}: {key} is an integer: search it with randint or choice")
        for value in domain.candidates():
            try:
                candidate = apply_overrides(config, {key: value})
            except ValidationError as exc:
                raise ConfigError(f"{where}: value {value!r} is invalid: "
                                  f"{exc.errors()[0]['msg']}") from None
            # Checks across sections too (All4One's heads must divide model.projector_dim).
            for _, problem in _method_problems(candidate)[:1]:
                raise ConfigError(f"{where}: value {value!r}: {problem}")


def _method_problems(config: CoreConfig) -> list[tuple[str, str]]:
    """The (base) method's :meth:`~raycl.methods.base.Method.config_problems` for ``config``."""
    from raycl.methods import METHODS

    method = METHODS.get(config.mcl.base if config.method == "mcl" else config.method)
    return method.config_problems(config) if method is not None else []


def _check_metric(config: CoreConfig, source: str) -> None:
    """A probe metric must name an attribute the dataset has."""
    from raycl.data import ATTRIBUTES

    match = re.fullmatch(r"(?:stage\d+/)?val/(?:linear(?:_[\d.]+pct)?|knn)/(\w+)",
                         config.tune.metric)
    known = ATTRIBUTES.get(config.data.dataset)
    if match and known and match.group(1) not in (*known, "mean"):
        raise ConfigError(f"{source}: tune.metric: {config.data.dataset} has no attribute "
                          f"{match.group(1)!r} (attributes: {', '.join(known)}, or mean)")
    metric = re.sub(r"^stage\d+/", "", config.tune.metric)
    unlabelled = config.data.dataset in ATTRIBUTES and not ATTRIBUTES[config.data.dataset]
    if unlabelled and re.match(r"val/(linear|knn|retrieval|nn_retrieval|zeroshot)", metric):
        raise ConfigError(f"{source}: tune.metric: {config.data.dataset} has no labels to probe "
                          f"or classify; select on caption retrieval (val/i2t/r1, val/t2i/r1) "
                          f"or val/mmvp/mean with eval.mmvp: synthetic")
    if metric.startswith("val/mmvp/") and config.eval.mmvp != "synthetic":
        raise ConfigError(f"{source}: tune.metric: {config.tune.metric} needs validation pairs: "
                          f"eval.mmvp: synthetic (a real MMVP-VLM directory is a test set)")


def _check_dataset(dataset: str, root: str | None, where: str, layout: str = "auto") -> None:
    """The dataset's files exist: a folder's images (both halves of a train/test layout, with
    their classes aligned), Fashion-MNIST's package."""
    if dataset == "folder":
        path = Path(str(root)).expanduser()
        if not path.is_dir():
            raise ConfigError(f"{where}.root: not a directory: {root}")
        from raycl.data.folders import list_folder

        try:
            list_folder(path, layout)
        except (OSError, ValueError) as exc:
            raise ConfigError(f"{where}.root: {exc}") from None
    if dataset == "pairs":
        from raycl.data.image_text import read_pairs

        try:
            read_pairs(Path(str(root)).expanduser())
        except (OSError, ValueError) as exc:
            raise ConfigError(f"{where}.root: {exc}") from None
    if dataset == "mnist_fashion":
        from raycl.data.pairs import FASHION_MNIST_DIR, FASHION_MNIST_PACKAGE

        if not FASHION_MNIST_DIR.is_dir():
            raise ConfigError(f"{where}.dataset: mnist_fashion needs Fashion-MNIST in "
                              f"{FASHION_MNIST_DIR} (Debian package {FASHION_MNIST_PACKAGE})")


def _check_data(config: CoreConfig, source: str) -> None:
    _check_dataset(config.data.dataset, config.data.root, f"{source}: data", config.data.layout)
    mmvp = config.eval.mmvp
    if mmvp not in (None, "synthetic"):
        from raycl.eval.mmvp import load_mmvp_vlm

        try:
            load_mmvp_vlm(mmvp, 8, check_only=True)
        except (OSError, ValueError) as exc:
            raise ConfigError(f"{source}: eval.mmvp: {exc}") from None
    for i, entry in enumerate(config.eval.transfer):
        _check_dataset(entry.dataset, entry.root, f"{source}: eval.transfer.{i}")


# Keys that decide whether model.pretrained fits the backbone a trial builds.
_PRETRAINED_KEYS = ("model.pretrained", "model.backbone", "model.stem", "model.width",
                    "data.resolution", "data.dataset")


def _check_pretrained(config: CoreConfig, source: str) -> None:
    """``model.pretrained`` exists, is readable and fits the backbone every trial builds (its
    architecture, its stem and the data's channels), for each searched value of those keys.

    Args:
        config: the validated config.
        source: the YAML file, for the message.

    Raises:
        ConfigError: ``FILE: model.pretrained: why``.
    """
    from itertools import product

    from raycl.data import CHANNELS
    from raycl.models import resolve_stem
    from raycl.models.pretrained import pretrained_problem

    space = config.tune.search_space
    if config.model.pretrained is None and "model.pretrained" not in space:
        return
    searched = [key for key in _PRETRAINED_KEYS if key in space]
    for values in product(*(space[key].candidates() for key in searched)):
        chosen = dict(zip(searched, values, strict=True))
        try:
            candidate = apply_overrides(config, chosen) if chosen else config
        except ValidationError:
            continue  # an invalid searched value is _check_search_space's message
        model = candidate.model
        if model.pretrained is None:
            continue
        problem = pretrained_problem(
            model.pretrained, model.backbone, CHANNELS[candidate.data.dataset], model.width,
            resolve_stem(model.stem, candidate.data.resolution))
        if problem:
            shown = ", ".join(f"{key}={value}" for key, value in chosen.items()
                              if key != "model.pretrained")
            searched_note = f"with searched {shown}: " if shown else ""
            raise ConfigError(f"{source}: model.pretrained: {searched_note}{problem}")


def grid_size(config: CoreConfig) -> int:
    """Combinations ``tune.searcher: grid`` runs: the product of the choice domains' sizes, with
    constrained keys counted by their feasible combinations only."""
    from raycl.constraints import joint_domain

    joint = joint_domain(config)
    tied = set(joint.keys) if joint else set()
    size = len(joint.labels()) if joint else 1
    for key, domain in config.tune.search_space.items():
        if key not in tied:
            size *= len(domain.candidates())
    return size


def _check_grid(config: CoreConfig, source: str, notices: list[str]) -> None:
    if config.tune.searcher != "grid" or not config.tune.search_space:
        return
    for key, domain in config.tune.search_space.items():
        if domain.kind != "choice":
            raise ConfigError(f"{source}: tune.search_space.{key}: tune.searcher 'grid' needs "
                              f"choice domains, got {domain.kind}")
    size, samples = grid_size(config), config.tune.num_samples
    if size != samples:
        what = "the rest are repeats of random grid points" if samples > size else \
            f"{size - samples} are not run"
        notices.append(f"tune.searcher=grid: {size} combinations, tune.num_samples={samples}: "
                       f"{what}")


def _check_feasible(config: CoreConfig, source: str) -> None:
    """Batch size and MCL budget: fixed values must fit; searched ones must leave a choice."""
    from raycl.constraints import CONSTRAINED_KEYS, joint_domain, trial_problem

    if not any(key in config.tune.search_space for key in CONSTRAINED_KEYS):
        problem = trial_problem(config)
        if problem:
            raise ConfigError(f"{source}: {problem[0]}: {problem[1]}")
        return
    try:
        joint_domain(config)
    except ValueError as exc:
        raise ConfigError(f"{source}: tune.search_space: {exc}") from None


def validate_references(config: CoreConfig, source: str) -> None:
    """Checks that need more than field types: registry names, data on disk, the metric, the
    search space, pretrained weights, and whether the trials can train at all (batch size, MCL
    budget)."""
    from raycl.methods import METHODS  # late: keeps `--help` and config errors fast

    if config.method != "mcl" and config.method not in METHODS:
        raise ConfigError(f"{source}: method: unknown method {config.method!r} "
                          f"(known: {', '.join(sorted([*METHODS, 'mcl']))})")
    if config.method == "mcl" and config.mcl.base not in METHODS:
        raise ConfigError(f"{source}: mcl.base: unknown method {config.mcl.base!r} "
                          f"(known: {', '.join(sorted(METHODS))})")
    method = METHODS[config.mcl.base if config.method == "mcl" else config.method]
    if (config.method == "mcl" and config.mcl.negatives == "mask"
            and not method.accepts_negative_mask):
        takes_mask = sorted(name for name, cls in METHODS.items() if cls.accepts_negative_mask)
        raise ConfigError(f"{source}: mcl.negatives: 'mask' needs a base method that restricts "
                          f"its negatives ({', '.join(takes_mask)}); {config.mcl.base} does not: "
                          f"use 'sampler'")
    for key, problem in _method_problems(config)[:1]:
        raise ConfigError(f"{source}: {key}: {problem}")
    from raycl.data import ATTRIBUTES

    if not ATTRIBUTES.get(config.data.dataset, ("?",)) and not method.multimodal:
        trained = config.mcl.base if config.method == "mcl" else config.method
        raise ConfigError(f"{source}: data.dataset: {config.data.dataset} has captions but no "
                          f"labels, which only an image-text method uses (method: clip, or "
                          f"mcl.base: clip); {trained} would have nothing to be evaluated on")
    _check_data(config, source)
    _check_metric(config, source)
    _check_search_space(config, source)
    _check_pretrained(config, source)
    _check_feasible(config, source)


def _check_renamed(raw: dict[str, Any], source: str) -> None:
    flat = flatten(raw)
    space = flat.get("tune.search_space")
    for old, new in RENAMED_KEYS.items():
        if old in flat or (isinstance(space, dict) and old in space):
            where = old if old in flat else f"tune.search_space.{old}"
            raise ConfigError(f"{source}: {where}: renamed to {new} (a method's knobs live in "
                              f"its own section)")


def _pin_searched_keys(raw: dict[str, Any], pinned: dict[str, Any], notices: list[str]) -> None:
    """A ``--set`` of a searched key pins it: the key leaves the raw YAML's search space."""
    tune = raw.get("tune") if isinstance(raw.get("tune"), dict) else None
    space = tune.get("search_space") if tune else None
    if isinstance(space, dict):
        for key, value in pinned.items():
            if key in space:
                del space[key]
                notices.append(f"--set {key}={value} pins a searched key: removed from "
                               f"tune.search_space")


def _clamp_scheduler(config: CoreConfig, notices: list[str]) -> CoreConfig:
    """ASHA's grace period longer than the longest trial is clamped (Ray would assert after
    start-up)."""
    scheduler = config.tune.scheduler
    if scheduler.type != "asha" or scheduler.grace_period <= config.max_reports():
        return config
    max_t = config.max_reports()
    notices.append(f"tune.scheduler.grace_period={scheduler.grace_period} exceeds the "
                   f"{max_t} report(s) of the longest trial: clamped to {max_t}")
    return apply_overrides(config, {"tune.scheduler.grace_period": max_t})


def load_search(
    path: str | Path,
    overrides: list[str] | None = None,
    *,
    check_references: bool = True,
    notices: list[str] | None = None,
) -> CoreConfig:
    """Read a search YAML, apply ``--set key=value`` overrides, validate everything.

    A ``--set`` of a key in ``tune.search_space`` pins it (the key leaves the space); an ASHA
    grace period longer than the longest trial is clamped. Each such decision is appended to
    ``notices`` as one line, for the command line to print.

    Raises:
        ConfigError: one line naming the file (or ``--set``) and the dotted key.
    """
    source = str(path)
    notices = [] if notices is None else notices
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
    pinned: dict[str, Any] = {}
    for text_override in overrides or []:
        key, value = parse_override(text_override)
        if key in RENAMED_KEYS:
            raise ConfigError(f"--set {key}: renamed to {RENAMED_KEYS[key]} (a method's knobs "
                              f"live in its own section)")
        if key not in config_keys() and not key.startswith(SEARCH_SPACE_PREFIX):
            raise ConfigError(f"--set {key}: unknown key")
        set_dotted(raw, key, value)
        if not key.startswith("tune."):
            pinned[key] = value
    _pin_searched_keys(raw, pinned, notices)
    _check_renamed(raw, source)
    try:
        config = search_config_class().model_validate(raw)
    except ValidationError as exc:
        raise ConfigError(_format_error(source, exc)) from None
    config = _clamp_scheduler(config, notices)
    if check_references:
        validate_references(config, source)
        _check_grid(config, source, notices)
    unused = sorted(name for name in method_sections()
                    if name in raw and name not in config.used_sections())
    if unused:
        notices.append(f"section{'s' if len(unused) > 1 else ''} {', '.join(unused)} not used: "
                       f"method is {config.method}"
                       + (f" (base {config.mcl.base})" if config.method == "mcl" else ""))
    if not config.tune.search_space and config.tune.num_samples > 1:
        first, count = config.seed, config.tune.num_samples
        notices.append(f"tune.search_space is empty: the {count} trials are repeats that differ "
                       f"only by seed ({first}..{first + count - 1}), each run to the end")
    return config
