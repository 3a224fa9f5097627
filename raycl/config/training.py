"""The training side of the schema: data, augmentations, model, training, MCL.

Every key is a field with a description, so ``python -m raycl.tune --show-schema`` prints the
documentation of all keys. MCL's section lives here: MCL is a training procedure around a base
method that the spine (the stages, the feasibility checks, ASHA's budget) reads, not a
registered method.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import Field, ValidationInfo, field_validator, model_validator

from raycl.config.section import Section

# data.num_samples' ceilings: all of Fashion-MNIST; mnist_fashion's pairs need an MNIST image each.
FASHION_MNIST_IMAGES = 70_000
MNIST_PAIRS = 5000


def checked_num_samples(dataset: str | None, value: int | None) -> int | None:
    """``num_samples`` (data's or a transfer set's) when ``dataset`` can draw that many.

    Raises:
        ValueError: mnist_fashion asked for more pairs than the offline MNIST subset holds.
    """
    if dataset == "mnist_fashion" and value is not None and value > MNIST_PAIRS:
        raise ValueError(f"mnist_fashion draws at most {MNIST_PAIRS} pairs (the offline MNIST "
                         f"subset), got {value}")
    return value


class DataConfig(Section):
    dataset: Literal["trifeature", "mnist_fashion", "fashion_mnist", "digits", "folder",
                     "pairs", "cifar10", "cifar100", "stl10", "imagenet", "imagenet100",
                     "webdataset", "parquet"] = Field(
        "trifeature", description="Dataset: generated Trifeature, MNIST⊕Fashion-MNIST "
        "(mnist_fashion: a digit and a garment as two channels, at most 5000 pairs), "
        "Fashion-MNIST (fashion_mnist: the 70 000 grey 28x28 images of the Debian package "
        "dataset-fashion-mnist, its t10k files the test split), sklearn "
        "digits, an ImageFolder-style directory given by data.root, image-caption pairs "
        "listed in the CSV/TSV file data.root (no labels; split at random), or a dataset read "
        "by name from data.root in the format it is distributed in: cifar10 / cifar100 (the "
        "python pickle batches), stl10 (the binary files), imagenet / imagenet100 (train/<wnid>/ "
        "and val/<wnid>/; imagenet100 is CMC's 100-class subset). Streamed only "
        "(data.loader: stream): webdataset (image-caption tar shards as img2dataset writes "
        "them, e.g. CC12M) and parquet (files with an image-bytes column)."
    )
    resolution: int = Field(32, ge=8, le=1024, description="Square image side in pixels.")
    samples_per_combination: int = Field(
        5, ge=1, description="Trifeature: images per (shape, texture, colour) combination "
        "(1000 combinations; the paper uses 100)."
    )
    num_samples: int | None = Field(
        None, ge=10, le=FASHION_MNIST_IMAGES, description="mnist_fashion: number of pairs to "
        "draw, at most 5000 (None: all 5000 of the offline MNIST subset). fashion_mnist: "
        "number of images, class-balanced, drawn from its train and test files 6:1 (None: "
        "all 70 000)."
    )
    val_fraction: float = Field(
        0.1, gt=0.0, lt=1.0, description="Share of each class held out for validation: probes "
        "are fit on train and scored here at every evaluation; sweeps select on it."
    )
    test_fraction: float = Field(
        0.2, gt=0.0, lt=1.0, description="Share of each class held out for the test split, "
        "scored once at the end of each trial and never optimised. Ignored where the dataset "
        "ships its test split: a folder in the train_test layout (its test/ folder), cifar10, "
        "cifar100, stl10, imagenet and fashion_mnist (their test files)."
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
    download: bool = Field(
        False, description="cifar10, cifar100, stl10: let torchvision download the dataset into "
        "data.root when it is not there (needs internet access on every node that reads it)."
    )
    pretrain_unlabeled: bool = Field(
        True, description="stl10: pretrain on the unlabeled split (100 000 images) besides train, "
        "as the papers do; probes are fit on train only and scored on test."
    )
    on_device: bool | Literal["auto"] = Field(
        "auto", description="Keep the decoded training images on the GPU for the whole trial, so "
        "an epoch never touches host memory. auto: on when the set takes at most a quarter of "
        "the trial's share of the device's memory (scaled by scaling.gpus_per_worker below 1, "
        "where trials share a GPU); ignored on CPU."
    )
    skip_unreadable: bool = Field(
        False, description="Image files (folder, pairs, imagenet): leave out the images that "
        "cannot be decoded (empty, corrupt or truncated files) from every split, before the "
        "split is made, instead of refusing the launch; they are counted (data/skipped in "
        "MLflow, the list as the artifact diagnostics/skipped_images.txt) and their count is "
        "printed at launch. false: the launch is refused, naming the first few and the count."
    )
    max_skipped_share: float = Field(
        0.01, ge=0.0, le=1.0, description="Stream mode: the share of an epoch's samples (per "
        "worker) that may be unreadable (a failed bucket read, a corrupt image or shard) before "
        "the trial fails with an error naming the files. Below it a training batch never holds "
        "a copy standing in for a failed read: image files are replaced by other samples of the "
        "training split, shard samples are skipped; an evaluation leaves such rows out. 0: any "
        "unreadable sample fails the trial."
    )
    decode_workers: int = Field(
        0, ge=0, description="Threads that decode image files when the cache is first built "
        "(0: the CPUs the Ray worker reserved, scaling.cpus_per_worker, so a node's other "
        "trials keep theirs; every core outside Ray)."
    )
    loader: Literal["memory", "stream", "auto"] = Field(
        "auto", description="How training reads the images. memory: decoded once per node "
        "into a memory-mapped cache that every process shares (fastest; the set must fit the "
        "node's memory). stream: decoded batch by batch from the files or shards by Ray Data "
        "tasks on the cluster's CPUs (data.stream_cpus per worker), for sets larger than "
        "memory (ImageNet-1k, CC12M); image folders, pairs, imagenet, webdataset and parquet. "
        "auto: memory when the decoded set takes at most data.memory_share of the memory of "
        "the smallest node that can run a worker, else stream; the choice is printed once at "
        "launch."
    )
    memory_share: float = Field(
        0.5, gt=0.0, le=1.0, description="data.loader: auto picks memory when the decoded "
        "set (images x 3 x resolution^2 bytes) takes at most this share of the memory of the "
        "smallest node that can run a worker (of the node types an autoscaler may add, while "
        "none is up)."
    )
    stream_cpus: float = Field(
        1.0, ge=0.0, description="Stream mode: CPUs each Ray Train worker reserves beside "
        "scaling.cpus_per_worker for the Ray Data tasks that decode its batches (they run in "
        "the worker's own bundle, on its node: no batch crosses nodes, and concurrent trials "
        "never starve each other's readers). "
        "0: no reservation; decoding then takes whatever CPUs the cluster has free. One CPU "
        "decodes about 200 full-size JPEGs a second at 224 px: GPU workers want at least 4 per "
        "GPU, and fewer is warned of at launch (raycl.launch.stream_rate)."
    )
    shuffle_buffer: int = Field(
        2048, ge=0, description="Stream mode, webdataset / parquet: samples in the seeded "
        "shuffle buffer behind the per-epoch shard order (image folders need none: their "
        "epochs are shuffled globally, as in memory mode)."
    )
    samples_per_shard: int | None = Field(
        None, ge=1, description="webdataset: samples per shard when neither sizes.json nor "
        "img2dataset's <shard>_stats.json gives the counts (img2dataset writes 10000)."
    )
    cache_dir: str | None = Field(
        None, description="Where decoded datasets are cached, one memory-mapped copy that every "
        "process of a node shares (None: $RAYCL_CACHE or ~/.cache/raycl). A local disk per node "
        "is best for a memory map (each node builds its copy once); shared storage works too "
        "(built once for the cluster, read over the network)."
    )
    seed: int | None = Field(
        None, description="Seed of the data: a generated set's images (Trifeature, digits' "
        "subsets), MNIST-Fashion's pairing, the train/val/test split and the evaluation subsets. "
        "None: the trial's seed. Seed confirmation sets it to the search's, so every confirmed "
        "configuration and seed trains and is scored on the same data (paired seeds; "
        "tune.confirm.redraw_data: true redraws it with each seed)."
    )

    @field_validator("num_samples")
    @classmethod
    def _num_samples_fit(cls, value: int | None, info: ValidationInfo) -> int | None:
        # A field validator (dataset is declared above): the line then names data.num_samples.
        return checked_num_samples(info.data.get("dataset"), value)

    @field_validator("captions")
    @classmethod
    def _known_caption_rates(cls, rates: dict[str, float] | None) -> dict[str, float] | None:
        # The names of raycl.data.sources.captions.CAPTION_ORDER, written out: importing that module
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


# A probability (or strength) for both views, or a pair [view 1, view 2] (BYOL's asymmetric
# augmentations: blur 1.0 on the first view and 0.1 on the second).
PerView = float | tuple[float, float]


def per_view(value: PerView) -> tuple[float, float]:
    """A :data:`PerView` key's value for (view 1, view 2)."""
    if isinstance(value, tuple):
        return float(value[0]), float(value[1])
    return float(value), float(value)


def _check_per_view(value: Any, low: float, high: float) -> PerView:
    """A number or a pair of numbers, each in [low, high] (a pair of another length is an
    error that says so, not pydantic's union message)."""
    if isinstance(value, (list, tuple)):
        if len(value) != 2:
            raise ValueError(f"expected one number (both views) or a pair [view 1, view 2], got "
                             f"{len(value)} values {list(value)}")
        values = tuple(float(item) for item in value)
    elif isinstance(value, (int, float)) and not isinstance(value, bool):
        values = (float(value),)
    else:
        raise ValueError(f"expected a number or a pair [view 1, view 2], got {value!r}")
    outside = [item for item in values if not low <= item <= high]
    if outside:
        raise ValueError(f"must be in [{low:g}, {high:g}], got {outside[0]:g}")
    return (values[0], values[1]) if len(values) == 2 else values[0]


class AugmentConfig(Section):
    """The two views' augmentations. Each probability and the jitter strength is one number for
    both views or a pair ``[view 1, view 2]``."""

    crop_scale: tuple[float, float] = Field(
        (0.2, 1.0), description="Random resized crop area range (fraction of the image)."
    )
    flip: bool = Field(True, description="Random horizontal flip.")
    color_jitter: PerView = Field(
        0.0, description="Colour jitter strength s in [0, 2] (0 = off), or a pair per view. On "
        "Trifeature it destroys the colour feature, which is why it is off by default."
    )
    color_jitter_prob: PerView = Field(
        0.8, description="Probability of jitter, or a pair per view.")
    grayscale_prob: PerView = Field(
        0.0, description="Probability of grayscale, or a pair per view.")
    blur_prob: PerView = Field(
        0.0, description="Probability of Gaussian blur, or a pair per view: BYOL's and "
        "solo-learn's [1.0, 0.1]; SimCLR's and MoCo v2's 0.5. 0: off."
    )
    blur_sigma: tuple[float, float] = Field(
        (0.1, 2.0), description="Range the blur's standard deviation is drawn from (uniform, "
        "per image), in pixels at 224 px, scaled with data.resolution (SimCLR/BYOL: [0.1, 2.0] "
        "at 224 px), as is the kernel (23 px at 224 px, ~10 % of the side; reflect padding)."
    )
    solarize_prob: PerView = Field(
        0.0, description="Probability of solarization (values >= 0.5 of [0, 1] inverted, "
        "BYOL's definition), or a pair per view: BYOL's and solo-learn's [0.0, 0.2]. 0: off."
    )

    @field_validator("crop_scale")
    @classmethod
    def _ordered(cls, value: tuple[float, float]) -> tuple[float, float]:
        low, high = value
        if not 0.0 < low <= high <= 1.0:
            raise ValueError("must satisfy 0 < low <= high <= 1")
        return value

    @field_validator("blur_sigma")
    @classmethod
    def _sigma_ordered(cls, value: tuple[float, float]) -> tuple[float, float]:
        low, high = value
        if not 0.0 < low <= high:
            raise ValueError("must satisfy 0 < low <= high")
        return value

    @field_validator("color_jitter", mode="before")
    @classmethod
    def _strength(cls, value: Any) -> PerView:
        return _check_per_view(value, 0.0, 2.0)

    @field_validator("color_jitter_prob", "grayscale_prob", "blur_prob", "solarize_prob",
                     mode="before")
    @classmethod
    def _probability(cls, value: Any) -> PerView:
        return _check_per_view(value, 0.0, 1.0)


class ModelConfig(Section):
    backbone: str = Field(
        "small_cnn", description="Encoder: small_cnn (a 4-block CNN for CPU runs), resnet18 or "
        "resnet50 (torchvision's, stem: model.stem), or timm/<name> for any timm model "
        "(timm/vit_small_patch16_224, timm/convnext_tiny, ...; raycl.models.timm_backbones): "
        "timm.create_model(name, pretrained=False, num_classes=0, in_chans=<the data's "
        "channels>, **model.timm_kwargs), whose pooled features (num_features wide) the "
        "projector reads. Never downloads weights: model.pretrained names a local file."
    )
    timm_kwargs: dict[str, Any] = Field(
        default_factory=dict, description="timm/ backbones: keyword arguments of "
        "timm.create_model, e.g. {img_size: 32, patch_size: 4, drop_path_rate: 0.1} for a ViT "
        "on 32 px images (its img_size must be data.resolution; checked before launch). "
        "pretrained, num_classes and in_chans are raycl's."
    )
    stem: Literal["auto", "cifar", "imagenet"] = Field(
        "auto", description="ResNet stem: cifar = 3x3 stride-1 conv, no max-pool (small "
        "images); imagenet = torchvision's 7x7 stride-2 conv + max-pool (what ImageNet weights "
        "need). auto: imagenet when data.resolution >= 128 (layer1 then sees >= 32 px, as with "
        "the cifar stem at 32 px), else cifar. small_cnn ignores it."
    )
    pretrained: str | None = Field(
        None, description="Local weights file the backbone starts from (never downloaded): a "
        "torchvision ResNet state dict (torch.save(resnet50().state_dict()); fc.* ignored), "
        "for a timm/ backbone a timm state dict (.safetensors or .pth, e.g. DINOv2/DINOv3 ViT "
        "weights: the model's checkpoint_filter_fn converts names and resamples the position "
        "embedding to img_size), or a raycl checkpoint's state.pt (its backbone.* weights). "
        "Every backbone weight must be "
        "in it with the shape model.backbone, model.stem and the data's channels give; checked "
        "before launch. Relative paths resolve against the launch directory."
    )
    width: int = Field(32, ge=4, description="small_cnn: channels of the first block.")
    projector_hidden_dim: int = Field(256, ge=1, description="Projector MLP hidden width.")
    projector_dim: int = Field(64, ge=1, description="Projector output (embedding) dimension.")
    sync_batchnorm: bool = Field(
        True, description="Several workers: every BatchNorm layer (projector and backbone) "
        "normalises with the statistics of the trial's global batch, as SimCLR's global BN and "
        "BYOL across accelerators and the papers' multi-GPU recipes (SyncBN), on GPU and CPU "
        "(gloo) workers alike; false keeps each worker's own (cheaper, but a rank's statistics "
        "leak batch information to the contrastive loss). One worker: nothing to share."
    )

    @field_validator("backbone")
    @classmethod
    def _known_backbone(cls, name: str) -> str:
        # Whether timm knows the name is checked before launch (raycl.launch.timm_check):
        # importing timm here would slow every config load.
        if name in ("small_cnn", "resnet18", "resnet50") or (
                name.startswith("timm/") and len(name) > len("timm/")):
            return name
        raise ValueError(f"unknown backbone {name!r}: small_cnn, resnet18, resnet50 or "
                         f"timm/<a timm model name> (e.g. timm/vit_small_patch16_224)")

    @field_validator("timm_kwargs")
    @classmethod
    def _timm_kwargs_for_timm(cls, kwargs: dict[str, Any],
                              info: ValidationInfo) -> dict[str, Any]:
        # A field validator (not the model's): the line then names model.timm_kwargs.
        backbone = info.data.get("backbone")
        if kwargs and isinstance(backbone, str) and not backbone.startswith("timm/"):
            raise ValueError(f"for a timm/ backbone, not {backbone}")
        reserved = sorted(set(kwargs) & {"pretrained", "num_classes", "in_chans"})
        if reserved:
            raise ValueError(f"{', '.join(reserved)} set by raycl (weights come from "
                             f"model.pretrained, channels from the data, no classifier)")
        return kwargs


class TrainConfig(Section):
    epochs: int = Field(10, ge=1, description="Epochs (per stage for MCL).")
    batch_size: int = Field(256, ge=2, description="Global batch size, split across workers.",
                            json_schema_extra={"symbol": "b"})
    lr: float = Field(1e-3, gt=0.0, description="Peak learning rate (after warmup).",
                      json_schema_extra={"symbol": "lr"})
    weight_decay: float = Field(1e-6, ge=0.0, description="Weight decay.",
                                json_schema_extra={"symbol": "wd"})
    optimizer: Literal["adamw", "sgd", "lars"] = Field(
        "adamw", description="Optimizer. lars: SGD with momentum whose step is rescaled per "
        "tensor by the trust ratio train.lars_eta x |w| / (|grad| + wd |w|) (You et al., 2017, "
        "eq. 6; 1 where a norm is 0), as solo-learn's recipes for NNCLR and All4One; biases and "
        "normalisation parameters (1-D tensors) are neither decayed nor adapted. Every matrix "
        "a method trains is adapted, All4One's transformer included (as solo-learn: its own "
        "rate, same optimizer). Only for convolutional encoders ('LARS (only for CNNs)', "
        "All4One §4.1; ViTs use AdamW): refused for clip, whose towers are transformers."
    )
    momentum: float = Field(0.9, ge=0.0, lt=1.0, description="SGD and LARS momentum.")
    lars_eta: float = Field(
        0.02, gt=0.0, description="LARS trust coefficient (solo-learn's eta_lars: 0.02)."
    )
    lars_clip_lr: bool = Field(
        False, description="LARS: cap each tensor's rate at the scheduled rate, i.e. step at "
        "min(trust ratio, lr) instead of lr x trust ratio (LARC's clip mode; solo-learn's "
        "clip_lr, on in its NNCLR and All4One CIFAR recipes)."
    )
    lr_scaling: Literal["none", "linear"] = Field(
        "none", description="linear: the base learning rate is train.lr x train.batch_size "
        "(the global batch) / 256 (Goyal et al.; the papers' 'lr x batch/256'); a group's "
        "absolute rate (all4one.transformer_lr) and a phase's own rate (fgvr.decoder_lr) stay "
        "as written. none: train.lr as written. The rate used is logged per epoch as "
        "train/effective_lr (the peak, before warmup and decay; train/lr is the current one)."
    )
    warmup_epochs: float = Field(1.0, ge=0.0, description="Linear warmup, then lr_schedule.")
    lr_schedule: Literal["cosine", "constant"] = Field(
        "cosine", description="After the warmup: cosine decay to 0, or constant (the MCL "
        "authors' CLIP tuning)."
    )
    amp: Literal["auto", "off", "bf16", "fp16"] = Field(
        "auto", description="Mixed precision: auto = bf16 autocast on a GPU with native bf16 "
        "(compute capability >= 8.0, Ampere or later; no loss scaler, so no host sync per step), "
        "fp16 with a loss scaler on older GPUs, off on CPU. Evaluation passes embed in the same "
        "precision on CUDA (features cast to float32), in float32 on CPU."
    )
    grad_clip_norm: float | None = Field(
        None, gt=0.0, description="Clip the global gradient norm to this before each step "
        "(after un-scaling fp16's loss scale; the ranks' averaged gradients, so every rank "
        "clips alike), as ViT recipes do (MoCo v3, DINO: 3.0). None: no clipping."
    )
    layer_decay: float | None = Field(
        None, gt=0.0, le=1.0, description="timm/ backbones: layer-wise learning-rate decay "
        "(BEiT, MAE fine-tuning): the backbone's last block trains at the full rate, each "
        "block below at layer_decay times the one above, the embeddings lowest (timm's "
        "param_groups_layer_decay, which also leaves biases and norms undecayed); the "
        "projector and predictor at the full rate. "
        "Useful when continuing from pretrained weights (model.pretrained). None: off."
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


__all__ = ["AugmentConfig", "DataConfig", "MCLConfig", "ModelConfig", "PerView", "TrainConfig",
           "per_view"]
