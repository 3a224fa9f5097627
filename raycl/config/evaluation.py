"""The evaluation side of the schema: probes, kNN, retrieval, transfer sets, diagnostics, MMVP
and the papers' linear evaluation (``eval.linear_sgd``).

Every key is a field with a description (``python -m raycl.tune --show-schema``).
"""

from __future__ import annotations

from typing import Literal

from pydantic import Field, ValidationInfo, field_validator, model_validator

from raycl.config.metric_names import fraction_percent
from raycl.config.section import Section
from raycl.config.training import FASHION_MNIST_IMAGES, checked_num_samples


class TransferConfig(Section):
    """A labelled dataset the frozen encoder is probed on after training (transfer)."""

    dataset: Literal["trifeature", "mnist_fashion", "fashion_mnist", "digits", "folder",
                     "cifar10", "cifar100", "stl10"] = Field(
        ..., description="Dataset, as in data.dataset; converted to the pretraining set's "
        "channels and resolution. cifar10, cifar100, stl10 and fashion_mnist are probed on "
        "their train files and scored on their test files (test_fraction unused)."
    )
    name: str | None = Field(
        None, pattern=r"^[A-Za-z0-9_.-]+$", description="Name in the metric keys "
        "transfer/<name>/linear/<attribute> (None: the dataset name)."
    )
    samples_per_combination: int = Field(2, ge=1, description="trifeature: images per "
                                         "combination.")
    num_samples: int | None = Field(
        None, ge=10, le=FASHION_MNIST_IMAGES, description="mnist_fashion: pairs (at most "
        "5000); fashion_mnist: images, as data.num_samples.")
    root: str | None = Field(None, description="folder: root directory with one folder per "
                             "class; cifar10, cifar100, stl10: their directory, as data.root.")
    test_fraction: float = Field(
        0.3, gt=0.0, lt=1.0, description="Share of each class the transfer probe is scored on; "
        "it is fit on the rest."
    )

    @field_validator("num_samples")
    @classmethod
    def _num_samples_fit(cls, value: int | None, info: ValidationInfo) -> int | None:
        return checked_num_samples(info.data.get("dataset"), value)

    @property
    def label(self) -> str:
        return self.name or self.dataset

    @model_validator(mode="after")
    def _folder_needs_root(self) -> TransferConfig:
        if self.dataset in ("folder", "cifar10", "cifar100", "stl10") and not self.root:
            raise ValueError(f"root is required when dataset is {self.dataset!r}")
        return self


class LinearSGDConfig(Section):
    """The papers' linear evaluation: a linear head on the frozen backbone, trained by SGD on
    augmented images (MoCo's, HSCL's and FGVR's protocol), one head per learning rate. It reads
    every row of the train, val and test splits: ``eval.max_train_samples`` and
    ``eval.max_eval_samples`` cap the cheap every-epoch probe only."""

    epochs: int = Field(100, ge=1, description="Passes over the (labelled) training split.")
    batch_size: int = Field(
        256, ge=1, description="Global batch, split across the trial's workers (FGVR: 128).")
    lrs: list[float] = Field(
        default_factory=lambda: [0.1], min_length=1, description="Learning rates, one head "
        "each, trained in the same pass over the data; per attribute, the one with the best "
        "validation score is kept and scores the test split (the first listed on a tie) "
        "(HSCL: [1.0, 0.1, 0.01]; FGVR and MoCo: [30.0])."
    )
    momentum: float = Field(0.9, ge=0.0, lt=1.0, description="SGD momentum.")
    weight_decay: float = Field(0.0, ge=0.0, description="SGD weight decay.")
    lr_milestones: list[float] = Field(
        default_factory=lambda: [0.6, 0.8], description="Fractions of the epochs at which the "
        "learning rate is multiplied by 0.1 (HSCL and MoCo: epochs 60 and 80 of 100); []: "
        "constant."
    )
    label_fractions: list[float] = Field(
        default_factory=list, description="Also train heads on these shares of the training "
        "labels (a seeded subset stratified on the first attribute, as eval.label_fractions), "
        "e.g. [0.5, 0.2] as FGVR's Table 1: val/linear_sgd_50pct/<attribute> and test/...; []: "
        "only every label (val/linear_sgd/...)."
    )
    augment: bool = Field(
        True, description="Training images: random resized crop (0.08, 1) + horizontal flip on "
        "the fly, as the papers; false: the whole image at the trial's resolution (the "
        "papers' centre crop of a larger image). Validation and test images are never "
        "augmented."
    )

    @field_validator("lrs")
    @classmethod
    def _positive_rates(cls, value: list[float]) -> list[float]:
        if any(rate <= 0 for rate in value):
            raise ValueError(f"every learning rate must be > 0, got {value}")
        if len(set(value)) != len(value):
            raise ValueError(f"learning rates must be distinct, got {value}")
        return value

    @field_validator("lr_milestones")
    @classmethod
    def _milestones_inside(cls, value: list[float]) -> list[float]:
        if any(not 0.0 < milestone < 1.0 for milestone in value) or value != sorted(value):
            raise ValueError(f"milestones must be increasing fractions in (0, 1), got {value}")
        return value

    @field_validator("label_fractions")
    @classmethod
    def _fractions_below_one(cls, value: list[float]) -> list[float]:
        return _check_label_fractions(value)


def _check_label_fractions(value: list[float]) -> list[float]:
    """Shares in (0, 1), distinct as the percentages of their metric keys."""
    outside = [fraction for fraction in value if not 0.0 < fraction < 1.0]
    if outside:
        raise ValueError(f"each fraction must be in (0, 1), got {outside} (the full-label "
                         f"probe always runs)")
    percents = [fraction_percent(fraction) for fraction in value]
    if len(set(percents)) != len(percents):
        raise ValueError(f"fractions must be distinct (as percentages in metric keys), got "
                         f"{value}")
    return value


class EvalConfig(Section):
    every_n_epochs: int = Field(
        1, ge=0, description="Evaluate every N epochs (0: only at the end of each stage). "
        "ASHA compares trials on these intermediate evaluations."
    )
    knn_k: int = Field(20, ge=1, description="Neighbours for kNN accuracy.")
    knn_queries: int | None = Field(
        None, ge=1, description="Cap on the val/test rows scored by kNN, each against the whole "
        "(max_train_samples-capped) train split: a seeded uniform draw, the same at every "
        "evaluation of a trial (None: every row)."
    )
    retrieval_queries: int | None = Field(
        10_000, ge=1, description="Cap on the queries of image retrieval per split, each ranked "
        "exactly against the whole rest of its split (rank-k and full-ranking mAP): a seeded "
        "uniform draw, the same at every evaluation of a trial; splits up to this size score "
        "every row (None: always every row; the cost grows as queries x rows)."
    )
    linear_max_iter: int = Field(
        200, ge=10, description="Logistic-regression iterations (epochs of the torch probe)."
    )
    linear_backend: Literal["auto", "sklearn", "torch"] = Field(
        "auto", description="Linear probe: scikit-learn lbfgs, or a torch linear head on the "
        "worker's device for large sets (auto: torch above 20 000 training samples or on CUDA)."
    )
    max_train_samples: int | None = Field(
        None, ge=10, description="Cap on probe training samples, a seeded subset stratified on "
        "the first attribute (None: the whole train split). Only those rows are embedded for "
        "the probe and kNN (MCL's clustering still embeds the whole split at a stage's end; "
        "eval.linear_sgd reads every row)."
    )
    max_eval_samples: int | None = Field(
        None, ge=10, description="Cap on the val and test rows each evaluation embeds and "
        "scores (probes, kNN, retrieval, image-text, diagnostics): a seeded subset stratified on "
        "the first attribute, the same rows at every evaluation of a trial (None: every row). "
        "MMVP pairs, transfer sets and eval.linear_sgd are not capped."
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
    baseline: bool = Field(
        True, description="Once per sweep, score the base configuration's freshly initialised "
        "backbone (trial 0's seed; the starting weights when model.pretrained is set) with the "
        "trials' val probes, logged on the sweep's parent run as baseline/val/... with chance "
        "(data/chance/...): the leaderboard's 'at init' row, which a trained trial must beat. "
        "Costs one Ray task per sweep (1 CPU, and when the trials use GPUs half a GPU, or "
        "scaling.gpus_per_worker when less) running one val evaluation (an embedding of the "
        "probe's training rows and of val, capped by max_train_samples and max_eval_samples "
        "as the trials' every-epoch probe is) beside the "
        "trials; a resumed sweep whose parent run has it does not repeat it. Searched model.* "
        "keys: the row is the base configuration's network (the leaderboard says so)."
    )
    diagnostics: bool = Field(
        True, description="End of trial: singular value spectrum and effective rank of the "
        "test-split features (diag/effective_rank), principal angles between each class and the "
        "rest (diag/shared_directions, diag/subclass_directions; at most 64 classes, a fixed "
        "draw), plots as artifacts."
    )
    label_free: bool = Field(
        True, description="Every evaluation: figures of the val features alone, no labels "
        "(raycl.eval.label_free), for any dataset: val/label_free/rankme (RankMe, Garrido et al. "
        "2023: how many directions the representation uses; higher is better), "
        "val/label_free/alpha (alpha-ReQ, Agrawal et al. 2022: the eigenspectrum's power-law "
        "decay, good near 1) and val/label_free/std (the L2-normalised features' per-dimension "
        "std times sqrt(D): ~1 spread out, 0 collapsed); test/label_free/... after a stage's last "
        "epoch. Any may be tune.metric or an objective, also on a dataset without labels."
    )
    online_probe: bool = Field(
        False, description="Train a linear head per attribute beside the method, on each "
        "training batch's backbone features (stop-gradient: the encoder gets nothing from it; "
        "its own AdamW optimizer; gradients averaged over the ranks), as solo-learn and "
        "stable-pretraining do: train/online_linear/<attribute> (the epoch's running accuracy "
        "on the augmented views) and, at each evaluation, val/online_linear/<attribute> (the "
        "heads on the val embeddings; test/ at the end), each with /mean. A family of its own, "
        "never the closed-form probe's numbers; may be tune.metric. Labelled data, one stage "
        "(not MCL), an image-only method."
    )
    online_probe_lr: float = Field(
        1e-3, gt=0.0, description="The online probe's learning rate (AdamW, no weight decay).")
    label_free_rows: int | None = Field(
        4096, ge=10, description="Rows (a seeded draw, the same at every evaluation) the "
        "label-free figures read per split; their cost is O(rows * D^2) on rank 0 "
        "(None: every scored row)."
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
    linear_sgd: LinearSGDConfig | None = Field(
        None, description="End of trial: the papers' linear evaluation (eval.linear_sgd.*), "
        "e.g. {epochs: 100, lrs: [30.0], batch_size: 128} as FGVR: a linear head per "
        "attribute on the frozen backbone (eval mode), trained by SGD on the trial's workers "
        "(each takes its share of every batch), each attribute's learning rate chosen on "
        "validation (diag/linear_sgd_lr/<attribute>), then test scored once: "
        "val/linear_sgd/<attribute>, test/linear_sgd/<attribute> (and /mean), in the trial's "
        "last report. Reads the rows the closed-form probe reads (eval.max_train_samples, "
        "max_eval_samples). Memory mode only; not for MCL. Slow (epochs over the images); the "
        "closed-form probe (val/linear/...) stays the sweep's fast objective. None: off."
    )

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
        return _check_label_fractions(value)


__all__ = ["EvalConfig", "LinearSGDConfig", "TransferConfig"]
