"""raycl side by side with its peers: lightly's recipe and a plain torchvision loop (issue 37).

One generated folder of PNGs (Trifeature at 32 px, or ``--resolution``, labelled by its 10
shapes; ``train/`` and ``test/``), one backbone (torchvision ResNet-18 with the CIFAR stem, or
``--backbone small_cnn``: raycl's 4-block CNN, the same module on every side), one projector
(backbone features -> 512 -> 128), batch 256, SGD (lr 0.06, momentum 0.9, no weight decay,
constant lr), τ 0.5 and one set of augmentation parameters, trained by

- **raycl**: its real entry (``build_tuner(config).fit()``), in-process (``scaling.num_workers:
  0``) and, without ``--quick``, with one Ray Train worker (``raycl-ray``);
- **lightly** (``pip install -e '.[peers]'``): its documented recipe, ``SimCLRTransform`` (or
  the method's transform), ``ImageFolder``, ``DataLoader(num_workers=1)``, ``NTXentLoss``,
  ``SimCLRProjectionHead`` (NNCLR and MoCo v2: its heads, memory bank and momentum helpers);
- **plain**: what a user writes with torchvision alone (``v2`` transforms, ``ImageFolder``,
  ``DataLoader(num_workers=1)``, a hand-written NT-Xent; SimCLR only).

Every run is its own process (peak RSS is per process), the sides interleaved per repeat; the
first epoch of every run is warm-up and excluded; the figure is the median images/s of the
other epochs (the optimizer steps and the data waits between them: raycl's
``train/images_per_second``, the same clock in the peers' loops); the table gives the median and
[min-max] over the repeats. Each encoder's backbone is then scored with raycl's kNN code
(:func:`raycl.eval.knn.knn_accuracy`, k 20, T 0.07) on the same split: raycl's training split
as the bank, the ``test/`` folder as queries, each side's images normalised as it trained.

    .venv/bin/python benchmarks/peers.py [--quick] [--device cpu|cuda|auto]
        [--method simclr|nnclr|mocov2] [--backbone resnet18|small_cnn] [--resolution 32]
        [--train-images 4000] [--epochs 3] [--repeats 3] [--json benchmarks/peers.json]

It prints a markdown table and, last, one JSON line ``{"raycl": {"images_per_s", "knn",
"peak_rss_mb"}, "lightly": {...}, "plain": {...}}``.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:  # run as a script: raycl from this checkout
    sys.path.insert(0, str(REPO))

METHODS: tuple[str, ...] = ("simclr", "nnclr", "mocov2")
SIDES: tuple[str, ...] = ("raycl", "raycl-ray", "lightly", "plain")
# resnet18: the issue's backbone (compute-bound on a CPU at 32 px); small_cnn: a cheap model,
# where the data pipeline decides the speed.
BACKBONES: tuple[str, ...] = ("resnet18", "small_cnn")
SMALL_CNN_WIDTH = 32  # raycl's default model.width (test_peers_bench checks it stays so)
# The line printed (and the row shown) when lightly is not installed.
LIGHTLY_MISSING = ("lightly is not installed: its rows are skipped "
                   "(pip install -e '.[peers]' installs lightly 1.6.0)")
# ImageNet statistics: lightly's transforms normalise with them, and a torchvision user does.
IMAGENET_MEAN = (0.485, 0.456, 0.406)
IMAGENET_STD = (0.229, 0.224, 0.225)
# raycl requires a validation share > 0; 2% of train/ (the peers train on all of train/, the
# same number of full batches: drop_last everywhere).
RAYCL_VAL_FRACTION = 0.02


@dataclass(frozen=True)
class Settings:
    """What every side trains with (listed in the output).

    Attributes:
        method: simclr, nnclr or mocov2.
        backbone: resnet18 (CIFAR stem) or small_cnn (raycl's, width 32).
        resolution: image side in pixels.
        train_images: images in ``train/`` (raycl trains on 98% of them, see RAYCL_VAL_FRACTION).
        test_images: images in ``test/`` (the kNN queries).
        epochs: epochs per run; the first is warm-up.
        batch_size: images per optimizer step.
        lr: SGD learning rate (constant).
        momentum: SGD momentum.
        temperature: NT-Xent τ.
        crop_scale: RandomResizedCrop's area range.
        flip_prob: horizontal flip probability.
        jitter: colour-jitter strength s (brightness, contrast, saturation 0.8 s, hue 0.2 s).
        jitter_prob: probability of the jitter.
        grayscale_prob: probability of grayscale.
        projector: (input, hidden, output) widths of the projection head.
        threads: torch threads of every training process.
        loader_processes: DataLoader worker processes of the peers (lightly's recipe: 1).
        seed: torch seed of every run (raycl: its config's seed).
    """

    method: str = "simclr"
    backbone: str = "resnet18"
    resolution: int = 32
    train_images: int = 4000
    test_images: int = 1000
    epochs: int = 3
    batch_size: int = 256
    lr: float = 0.06
    momentum: float = 0.9
    temperature: float = 0.5
    crop_scale: tuple[float, float] = (0.2, 1.0)
    flip_prob: float = 0.5
    jitter: float = 0.5
    jitter_prob: float = 0.8
    grayscale_prob: float = 0.2
    projector: tuple[int, int, int] = (512, 512, 128)
    threads: int = 2
    loader_processes: int = 1
    seed: int = 0


def quick_settings(settings: Settings) -> Settings:
    """``--quick``: 2 full batches per epoch, 2 epochs (the first warm-up), 128 kNN queries."""
    values = asdict(settings)
    values.update(train_images=2 * settings.batch_size + 24, test_images=128, epochs=2)
    return Settings(**values)


def matched_settings(method: str, backbone: str, resolution: int, threads: int, *,
                     quick: bool = False, epochs: int | None = None,
                     train_images: int | None = None, seed: int = 0) -> Settings:
    """The settings of one benchmark run, from its command line.

    Args:
        method: simclr, nnclr or mocov2.
        backbone: one of :data:`BACKBONES`; the projector's input is its feature width.
        resolution: image side in pixels.
        threads: torch threads of every training process.
        quick: ``--quick``'s sizes (:func:`quick_settings`).
        epochs: epochs per run (the first is warm-up), or None for the default.
        train_images: images in ``train/``, or None for the default.
        seed: torch seed of every run.

    Returns:
        The settings every side trains with.

    Raises:
        ValueError: an unknown backbone, fewer than 2 epochs, or too few images for two full
            batches after raycl's validation share.
    """
    if backbone not in BACKBONES:
        raise ValueError(f"backbone must be one of {', '.join(BACKBONES)}, got {backbone!r}")
    from raycl.models.backbones import build_backbone

    features = build_backbone(backbone, 3, SMALL_CNN_WIDTH)[1]
    widths = Settings().projector
    settings = Settings(method=method, threads=threads, backbone=backbone, seed=seed,
                        resolution=resolution, projector=(features, *widths[1:]))
    if quick:
        settings = quick_settings(settings)
    if epochs is not None:
        if epochs < 2:
            raise ValueError("--epochs must be >= 2 (the first epoch is warm-up, not measured)")
        settings = replace(settings, epochs=epochs)
    if train_images is not None:
        least = 2 * settings.batch_size + 24
        if train_images < least:
            raise ValueError(f"--train-images must be >= {least} "
                             "(two full batches after raycl's validation share)")
        settings = replace(settings, train_images=train_images)
    return settings


def settings_rows(settings: Settings) -> list[tuple[str, str]]:
    """The matched settings as (name, value) rows, the way the output lists them."""
    return [
        ("method", settings.method),
        ("data", f"Trifeature PNGs, {settings.resolution} px, 10 shape classes, "
                 f"{settings.train_images} in train/, {settings.test_images} in test/"),
        ("backbone", "torchvision resnet18, CIFAR stem (3x3 stride-1 conv1, no max pool)"
                     if settings.backbone == "resnet18" else
                     f"raycl's small_cnn (4 conv-BN-ReLU blocks, width {SMALL_CNN_WIDTH}; "
                     "the same module on every side)"),
        ("projector", " -> ".join(str(width) for width in settings.projector)),
        ("batch", str(settings.batch_size)),
        ("optimizer", f"SGD lr {settings.lr} (constant) momentum {settings.momentum}, "
                      "weight decay 0"),
        ("temperature", str(settings.temperature)),
        ("augmentation", f"crop scale {settings.crop_scale}, flip {settings.flip_prob}, "
                         f"jitter {settings.jitter} p {settings.jitter_prob}, "
                         f"grayscale {settings.grayscale_prob}, no blur, no solarize"),
        ("epochs", f"{settings.epochs} (the first is warm-up, excluded)"),
        ("threads", f"{settings.threads} torch threads per training process"),
        ("data loading", f"lightly and plain: DataLoader(num_workers={settings.loader_processes})"
                         "; raycl: its loader (batched views in the training process)"),
        ("seed", str(settings.seed)),
    ]


def lightly_available() -> bool:
    """Whether lightly can be imported (the ``peers`` extra)."""
    try:
        import lightly  # noqa: F401
    except ImportError:
        return False
    return True


# ---------------------------------------------------------------------------------------------
# The image folder


def write_image_folder(root: Path, settings: Settings) -> Path:
    """Write Trifeature PNGs as ``root/train/<shape>/*.png`` and ``root/test/<shape>/*.png``
    (once: an existing complete folder is reused).

    Args:
        root: where the folder goes.
        settings: how many images of which side.

    Returns:
        ``root``.
    """
    from PIL import Image

    from raycl.data.sources.trifeature import SHAPE_NAMES, generate_trifeature

    total = settings.train_images + settings.test_images
    marker = root / f".complete-{total}-{settings.resolution}"
    if marker.exists():
        return root
    per_combination = -(-total // 1000)
    generated = generate_trifeature(per_combination, settings.resolution, seed=0)
    for index in range(total):
        half = "train" if index < settings.train_images else "test"
        folder = root / half / SHAPE_NAMES[int(generated.labels["shape"][index])]
        folder.mkdir(parents=True, exist_ok=True)
        Image.fromarray(generated.images[index].transpose(1, 2, 0)).save(folder / f"{index}.png")
    marker.touch()
    return root


# ---------------------------------------------------------------------------------------------
# Scoring an encoder


@dataclass(frozen=True)
class Split:
    """The kNN split every encoder is scored on: uint8 (N, C, H, W) images and labels."""

    bank_images: Any
    bank_labels: Any
    query_images: Any
    query_labels: Any


def raycl_config(folder: Path, root: Path, settings: Settings, workers: int, device: str,
                 name: str) -> Any:
    """The raycl search config of one run: quickstart.yaml with every matched setting."""
    from raycl.launch.load import load_search

    # NNCLR and MoCo v2: what lightly's examples use (queue 4096, predictor 512 wide, key
    # momentum 0.99), so only the training code differs.
    tau = settings.temperature
    method_keys = {
        "simclr": [f"simclr.temperature={tau}"],
        "nnclr": [f"nnclr.temperature={tau}", "nnclr.queue_size=4096",
                  "nnclr.projector_layers=3", f"nnclr.predictor_hidden_dim={settings.projector[1]}",
                  "nnclr.symmetric=true"],
        "mocov2": [f"mocov2.temperature={tau}", "mocov2.queue_size=4096",
                   "mocov2.momentum_start=0.99", "mocov2.momentum_end=0.99",
                   "mocov2.projector_layers=2", "mocov2.symmetric=false"],
    }[settings.method]
    crop = settings.crop_scale
    return load_search(REPO / "searches" / "quickstart.yaml", [
        "tune.search_space={}", "tune.num_samples=1", f"name={name}", f"method={settings.method}",
        f"seed={settings.seed}",
        f"tune.storage_path={root / 'ray'}", f"mlflow.tracking_uri=sqlite:///{root / 'm.db'}",
        "data.dataset=folder", f"data.root={folder}", "data.layout=train_test",
        f"data.resolution={settings.resolution}", f"data.val_fraction={RAYCL_VAL_FRACTION}",
        f"model.backbone={settings.backbone}", "model.stem=cifar",
        f"model.width={SMALL_CNN_WIDTH}",
        f"model.projector_hidden_dim={settings.projector[1]}",
        f"model.projector_dim={settings.projector[2]}",
        f"train.epochs={settings.epochs}", f"train.batch_size={settings.batch_size}",
        "train.optimizer=sgd", f"train.lr={settings.lr}", f"train.momentum={settings.momentum}",
        "train.weight_decay=0", "train.warmup_epochs=0", "train.lr_schedule=constant",
        f"augment.crop_scale=[{crop[0]}, {crop[1]}]", f"augment.flip={settings.flip_prob > 0}",
        f"augment.color_jitter={settings.jitter}",
        f"augment.color_jitter_prob={settings.jitter_prob}",
        f"augment.grayscale_prob={settings.grayscale_prob}",
        "eval.every_n_epochs=0", "eval.linear_max_iter=20", "eval.max_train_samples=500",
        f"scaling.num_workers={workers}", f"scaling.cpus_per_worker={settings.threads}",
        f"scaling.use_gpu={str(device == 'cuda').lower()}", *method_keys])


def knn_split(folder: Path, root: Path, settings: Settings) -> Split:
    """raycl's training split of the folder (the bank) and its ``test/`` folder (the queries),
    as raycl's data loader reads them."""
    from raycl.data import load_dataset

    config = raycl_config(folder, root, settings, 0, "cpu", "split")
    data = load_dataset(config.data, config.seed)
    return Split(bank_images=data.train.images, bank_labels=data.train.labels["class"],
                 query_images=data.test.images, query_labels=data.test.labels["class"])


def knn_score(encoder: Any, normalise: Callable[[Any], Any], split: Split, device: Any) -> float:
    """kNN accuracy (raycl's code: k 20, T 0.07) of ``encoder``'s features on ``split``.

    Args:
        encoder: float images -> (B, D) features (a backbone; set to eval mode here).
        normalise: uint8 (B, C, H, W) tensor -> the float images the encoder trained on.
        split: bank and queries.
        device: where the forward passes run.

    Returns:
        Accuracy in [0, 1].
    """
    import numpy as np
    import torch

    from raycl.eval.features import batch_features
    from raycl.eval.knn import knn_accuracy

    encoder = encoder.to(device).eval()

    def features(images: Any) -> Any:
        rows = [batch_features(encoder, normalise(torch.from_numpy(
                    np.ascontiguousarray(images[start:start + 256])).to(device))).cpu()
                for start in range(0, len(images), 256)]
        return torch.cat(rows).numpy()

    return knn_accuracy(features(split.bank_images), np.asarray(split.bank_labels),
                        features(split.query_images), np.asarray(split.query_labels),
                        k=20, temperature=0.07)


def imagenet_normalise(images: Any) -> Any:
    """uint8 images -> float in [0, 1] normalised with ImageNet's statistics (the peers')."""
    import torch

    mean = torch.tensor(IMAGENET_MEAN, device=images.device).view(1, 3, 1, 1)
    std = torch.tensor(IMAGENET_STD, device=images.device).view(1, 3, 1, 1)
    return (images.float() / 255.0 - mean) / std


# ---------------------------------------------------------------------------------------------
# The sides (each runs in its own process: ``--one SIDE``)


def newest_checkpoint(storage: Path, run_name: str) -> Path:
    """The newest checkpoint directory (one holding ``state.pt``) of run ``run_name`` under
    ``storage``.

    Raises:
        FileNotFoundError: the run wrote none.
    """
    states = [path for path in storage.rglob("state.pt") if run_name in str(path)]
    if not states:
        raise FileNotFoundError(f"no checkpoint of {run_name} under {storage}")
    return max(states, key=lambda path: path.stat().st_mtime).parent


def run_raycl(settings: Settings, folder: Path, root: Path, device: str, workers: int,
              split: Split) -> dict[str, Any]:
    """One raycl trial through its real entry; its per-epoch images/s, peak RSS and kNN."""
    from raycl.data.augment import to_float
    from raycl.export.encoder import trained_encoder
    from raycl.sweep.local_ray import init_ray
    from raycl.sweep.tuner import build_tuner

    # One more logical CPU than threads: a worker trial also holds its own small reservation.
    init_ray(num_cpus=settings.threads + 1, log_to_driver=False)
    config = raycl_config(folder, root, settings, workers, device, f"peers-{time.time_ns()}")
    result = build_tuner(config, None).fit()[0]
    if result.error is not None:
        raise RuntimeError(f"raycl trial failed: {result.error}")
    frame = result.metrics_dataframe
    if result.checkpoint is not None:
        with result.checkpoint.as_directory() as directory:
            encoder = trained_encoder(Path(directory), config)
    else:  # one Ray Train worker: the checkpoints live in the Train run's own storage
        encoder = trained_encoder(newest_checkpoint(root / "ray", config.name), config)
    return {"rates": [float(v) for v in frame["train/images_per_second"].dropna()],
            "peak_rss_mb": float(frame["perf/peak_rss_mb"].max()),
            "knn": knn_score(encoder, to_float, split, device)}


def peer_backbone(name: str) -> Any:
    """The peers' backbone: torchvision's ResNet-18 with the CIFAR stem as a user writes it, or
    raycl's ``small_cnn`` module itself (no library has it; the same module keeps the model
    identical, so only the training differs)."""
    if name == "small_cnn":
        from raycl.models.backbones import small_cnn

        return small_cnn(3, SMALL_CNN_WIDTH)[0]
    return cifar_resnet18()


def cifar_resnet18() -> Any:
    """torchvision's ResNet-18 with the CIFAR stem, its classifier removed (512-d features)."""
    import torchvision
    from torch import nn

    model = torchvision.models.resnet18()
    model.conv1 = nn.Conv2d(3, 64, kernel_size=3, stride=1, padding=1, bias=False)
    model.maxpool = nn.Identity()
    model.fc = nn.Identity()
    return model


def torchvision_views(settings: Settings) -> Any:
    """The plain loop's two-view transform (torchvision v2, the matched parameters)."""
    import torch
    from torchvision.transforms import v2

    strength = settings.jitter
    one_view = v2.Compose([
        v2.RandomResizedCrop(settings.resolution, scale=settings.crop_scale, antialias=True),
        v2.RandomHorizontalFlip(settings.flip_prob),
        v2.RandomApply([v2.ColorJitter(0.8 * strength, 0.8 * strength, 0.8 * strength,
                                       0.2 * strength)], p=settings.jitter_prob),
        v2.RandomGrayscale(settings.grayscale_prob),
        v2.ToImage(), v2.ToDtype(torch.float32, scale=True),
        v2.Normalize(IMAGENET_MEAN, IMAGENET_STD)])
    return lambda image: [one_view(image), one_view(image)]


def lightly_views(settings: Settings) -> Any:
    """lightly's transform for the method, with the matched parameters."""
    from lightly.transforms import MoCoV2Transform, SimCLRTransform

    transform = MoCoV2Transform if settings.method == "mocov2" else SimCLRTransform
    return transform(input_size=settings.resolution, min_scale=settings.crop_scale[0],
                     cj_prob=settings.jitter_prob, cj_strength=settings.jitter,
                     random_gray_scale=settings.grayscale_prob, gaussian_blur=0.0,
                     hf_prob=settings.flip_prob)


def nt_xent_plain(z0: Any, z1: Any, temperature: float) -> Any:
    """NT-Xent as a torchvision user writes it: 2N anchors, the other view positive."""
    import torch
    import torch.nn.functional as F

    z = F.normalize(torch.cat([z0, z1]), dim=1)
    logits = z @ z.T / temperature
    logits.fill_diagonal_(float("-inf"))
    count = len(z0)
    targets = torch.cat([torch.arange(count, 2 * count), torch.arange(count)]).to(z.device)
    return F.cross_entropy(logits, targets)


class PeerModel:
    """A peer's trainable model: ``loss(view0, view1)`` and ``after_step()``, its backbone."""

    def __init__(self, settings: Settings, side: str) -> None:
        import copy

        from torch import nn

        self.settings, self.side = settings, side
        self.backbone = peer_backbone(settings.backbone)
        widths = settings.projector
        if side == "plain":
            self.head: nn.Module = nn.Sequential(
                nn.Linear(widths[0], widths[1]), nn.BatchNorm1d(widths[1]), nn.ReLU(),
                nn.Linear(widths[1], widths[2]))
            self.modules = nn.ModuleList([self.backbone, self.head])
            return
        from lightly import loss, models

        heads = models.modules
        if settings.method == "simclr":
            self.head = heads.SimCLRProjectionHead(*widths)
            self.criterion = loss.NTXentLoss(temperature=settings.temperature)
        elif settings.method == "nnclr":
            self.head = heads.NNCLRProjectionHead(widths[0], widths[1], widths[2])
            self.predictor = heads.NNCLRPredictionHead(widths[2], widths[1], widths[2])
            self.bank = heads.NNMemoryBankModule(size=(4096, widths[2]))
            self.criterion = loss.NTXentLoss(temperature=settings.temperature)
        else:  # mocov2, as lightly's example: momentum encoder, memory bank of keys
            self.head = heads.MoCoProjectionHead(widths[0], widths[1], widths[2])
            self.key_backbone = copy.deepcopy(self.backbone)
            self.key_head = copy.deepcopy(self.head)
            models.utils.deactivate_requires_grad(self.key_backbone)
            models.utils.deactivate_requires_grad(self.key_head)
            self.criterion = loss.NTXentLoss(temperature=settings.temperature,
                                             memory_bank_size=(4096, widths[2]))
        self.modules = nn.ModuleList([m for m in (
            self.backbone, self.head, getattr(self, "predictor", None),
            getattr(self, "key_backbone", None), getattr(self, "key_head", None))
            if m is not None])

    def to(self, device: Any) -> PeerModel:
        self.modules.to(device)
        if hasattr(self, "bank"):
            self.bank.to(device)
        if hasattr(self, "criterion"):
            self.criterion.to(device)
        return self

    def loss(self, view0: Any, view1: Any) -> Any:
        """The step's loss, as the recipe computes it (one forward per view)."""
        import torch

        if self.side == "plain":
            return nt_xent_plain(self.head(self.backbone(view0)),
                                 self.head(self.backbone(view1)), self.settings.temperature)
        if self.settings.method == "simclr":
            return self.criterion(self.head(self.backbone(view0)),
                                  self.head(self.backbone(view1)))
        if self.settings.method == "nnclr":
            z0, z1 = self.head(self.backbone(view0)), self.head(self.backbone(view1))
            p0, p1 = self.predictor(z0), self.predictor(z1)
            z0 = self.bank(z0.detach(), update=False)
            z1 = self.bank(z1.detach(), update=True)
            return 0.5 * (self.criterion(z0, p1) + self.criterion(z1, p0))
        from lightly.models.utils import update_momentum

        update_momentum(self.backbone, self.key_backbone, m=0.99)
        update_momentum(self.head, self.key_head, m=0.99)
        query = self.head(self.backbone(view0))
        with torch.no_grad():
            key = self.key_head(self.key_backbone(view1))
        return self.criterion(query, key)


def run_peer(side: str, settings: Settings, folder: Path, device: str,
             split: Split) -> dict[str, Any]:
    """One peer run: lightly's recipe or the plain loop; its per-epoch images/s, peak RSS
    (after training) and kNN."""
    import torch
    import torchvision

    torch.manual_seed(settings.seed)
    transform = torchvision_views(settings) if side == "plain" else lightly_views(settings)
    dataset = torchvision.datasets.ImageFolder(str(folder / "train"), transform=transform)
    loader = torch.utils.data.DataLoader(
        dataset, batch_size=settings.batch_size, shuffle=True, drop_last=True,
        num_workers=settings.loader_processes, pin_memory=device == "cuda")
    model = PeerModel(settings, side).to(device)
    optimizer = torch.optim.SGD([p for p in model.modules.parameters() if p.requires_grad],
                                lr=settings.lr, momentum=settings.momentum)
    rates = []
    for _ in range(settings.epochs):
        model.modules.train()
        seen, started = 0, time.perf_counter()
        for (view0, view1), _labels in loader:
            loss = model.loss(view0.to(device, non_blocking=True),
                              view1.to(device, non_blocking=True))
            loss.backward()
            optimizer.step()
            optimizer.zero_grad()
            seen += len(view0)
        if device == "cuda":
            torch.cuda.synchronize()
        rates.append(seen / (time.perf_counter() - started))
    from raycl.worker.perf import peak_rss_mb  # what raycl's own runs report

    rss = peak_rss_mb()
    return {"rates": rates, "peak_rss_mb": rss,
            "knn": knn_score(model.backbone, imagenet_normalise, split, device)}


def run_one(side: str, settings: Settings, folder: Path, root: Path, device: str) -> None:
    """``--one SIDE``: run one side in this process and print its result as a JSON line."""
    import torch

    torch.set_num_threads(settings.threads)
    split = knn_split(folder, root, settings)
    if side in ("raycl", "raycl-ray"):
        result = run_raycl(settings, folder, root, device, 0 if side == "raycl" else 1, split)
    else:
        result = run_peer(side, settings, folder, device, split)
    print("RESULT " + json.dumps(result), flush=True)


# ---------------------------------------------------------------------------------------------
# The driver


def steady(rates: list[float]) -> float:
    """Median images/s without the first (warm-up) epoch."""
    return statistics.median(rates[1:] if len(rates) > 1 else rates)


def spawn(side: str, settings: Settings, folder: Path, root: Path, device: str) -> dict[str, Any]:
    """Run ``side`` in a fresh process (``--one``) and read its result line."""
    command = [sys.executable, str(Path(__file__).resolve()), "--one", side,
               "--settings", json.dumps(asdict(settings)), "--folder", str(folder),
               "--root", str(root), "--device", device]
    done = subprocess.run(command, capture_output=True, text=True, check=False,
                          env={**os.environ, "RAYCL_CACHE": str(root / "cache")})
    lines = [line for line in done.stdout.splitlines() if line.startswith("RESULT ")]
    if done.returncode != 0 or not lines:
        raise RuntimeError(f"{side} run failed (exit {done.returncode}):\n{done.stderr[-3000:]}")
    return json.loads(lines[-1][len("RESULT "):])


def summary(runs: list[dict[str, Any]]) -> dict[str, Any]:
    """Median and [min, max] over repeats of images/s, peak RSS and kNN."""
    def spread(values: list[float]) -> dict[str, float]:
        return {"median": statistics.median(values), "min": min(values), "max": max(values)}

    return {"images_per_s": spread([steady(run["rates"]) for run in runs]),
            "peak_rss_mb": spread([run["peak_rss_mb"] for run in runs]),
            "knn": spread([run["knn"] for run in runs]), "repeats": len(runs)}


def json_line(results: dict[str, dict[str, Any]]) -> str:
    """The one-line JSON of the issue: each side's median images/s, kNN and peak RSS (null for
    a side that did not run)."""
    line: dict[str, Any] = {}
    for side in ("raycl", "raycl-ray", "lightly", "plain"):
        if side not in results:
            if side == "raycl-ray":
                continue
            line[side] = None
            continue
        figures = results[side]
        line[side] = {key: round(figures[key]["median"], 4)
                      for key in ("images_per_s", "knn", "peak_rss_mb")}
    return json.dumps(line)


def markdown_table(results: dict[str, dict[str, Any]], reference: str = "lightly") -> str:
    """The table: one row per side, median [min-max]; images/s also as a ratio to lightly's."""
    def cell(figure: dict[str, float], digits: str) -> str:
        return (f"{figure['median']:{digits}} [{figure['min']:{digits}}–"
                f"{figure['max']:{digits}}]")

    rows = ["| side | images/s | × lightly | kNN accuracy | peak RSS (MB) | repeats |",
            "|---|---|---|---|---|---|"]
    base = results.get(reference, {}).get("images_per_s", {}).get("median")
    for side, figures in results.items():
        ratio = f"{figures['images_per_s']['median'] / base:.2f}" if base else "–"
        rows.append(f"| {side} | {cell(figures['images_per_s'], '.1f')} | {ratio} | "
                    f"{cell(figures['knn'], '.3f')} | {cell(figures['peak_rss_mb'], '.0f')} | "
                    f"{figures['repeats']} |")
    return "\n".join(rows)


def runnable_sides(sides: list[str], method: str,
                   lightly_installed: bool) -> tuple[list[str], list[str]]:
    """The sides that can run, and one line for each left out.

    Args:
        sides: the sides asked for.
        method: the method trained (the plain loop is SimCLR only).
        lightly_installed: whether lightly imports.

    Returns:
        (sides to run, in order; a line per side skipped, saying why).
    """
    kept, notes = [], []
    for side in sides:
        if side == "plain" and method != "simclr":
            notes.append(f"plain: SimCLR only, skipped for --method {method}")
        elif side == "lightly" and not lightly_installed:
            notes.append(LIGHTLY_MISSING)
        else:
            kept.append(side)
    return kept, notes


def iterate_sides(sides: list[str], repeats: int) -> Iterator[tuple[int, str]]:
    """(repeat, side) in the interleaved order: every side once per repeat."""
    for repeat in range(repeats):
        for side in sides:
            yield repeat, side


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true",
                        help="2 batches per epoch, 2 epochs, no Ray Train worker (< 10 min)")
    parser.add_argument("--device", choices=("auto", "cpu", "cuda"), default="auto")
    parser.add_argument("--method", choices=METHODS, default="simclr")
    parser.add_argument("--backbone", choices=BACKBONES, default="resnet18")
    parser.add_argument("--resolution", type=int, default=32, help="image side in pixels")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--seed", type=int, default=0, help="torch seed of every run")
    parser.add_argument("--train-images", type=int, default=None,
                        help="images in train/ (default 4000; --quick 536)")
    parser.add_argument("--epochs", type=int, default=None,
                        help="epochs per run, the first warm-up (default 3; --quick 2)")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--sides", default=None,
                        help=f"comma-separated subset of {','.join(SIDES)}")
    parser.add_argument("--json", default=None, help="write every raw number here")
    parser.add_argument("--root", default=None, help="scratch directory (default: a new one)")
    # Internal: one side in this process.
    parser.add_argument("--one", choices=SIDES, help=argparse.SUPPRESS)
    parser.add_argument("--settings", help=argparse.SUPPRESS)
    parser.add_argument("--folder", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.repeats < 1:
        raise SystemExit("--repeats must be >= 1")
    import torch

    if args.device == "auto":
        args.device = "cuda" if torch.cuda.is_available() else "cpu"
    if args.one:
        values = json.loads(args.settings)
        values.update(crop_scale=tuple(values["crop_scale"]),
                      projector=tuple(values["projector"]))
        run_one(args.one, Settings(**values), Path(args.folder), Path(args.root), args.device)
        return

    if args.resolution < 16:
        raise SystemExit("--resolution must be >= 16 (small_cnn halves the image three times)")
    try:
        settings = matched_settings(args.method, args.backbone, args.resolution, args.threads,
                                    quick=args.quick, epochs=args.epochs,
                                    train_images=args.train_images, seed=args.seed)
    except ValueError as error:
        raise SystemExit(str(error)) from None
    sides = (args.sides.split(",") if args.sides
             else ["raycl", "lightly", "plain"] if args.quick else list(SIDES))
    unknown = sorted(set(sides) - set(SIDES))
    if unknown:
        raise SystemExit(f"--sides: unknown {unknown}; choose from {', '.join(SIDES)}")
    sides, notes = runnable_sides(sides, settings.method, lightly_available())
    for note in notes:
        print(note)
    root = Path(args.root or tempfile.mkdtemp(prefix="raycl-peers-"))
    folder = write_image_folder(root / "folder", settings)
    print("matched settings:")
    for name, value in settings_rows(settings):
        print(f"- {name}: {value}")
    runs: dict[str, list[dict[str, Any]]] = {side: [] for side in sides}
    for repeat, side in iterate_sides(sides, args.repeats):
        run = spawn(side, settings, folder, root, args.device)
        runs[side].append(run)
        print(f"repeat {repeat + 1}/{args.repeats} {side}: {steady(run['rates']):.1f} images/s "
              f"(epochs {', '.join(f'{rate:.1f}' for rate in run['rates'])}), "
              f"kNN {run['knn']:.3f}, peak RSS {run['peak_rss_mb']:.0f} MB", flush=True)
    results = {side: summary(side_runs) for side, side_runs in runs.items()}
    device_name = (torch.cuda.get_device_name() if args.device == "cuda"
                   else f"{platform.processor() or platform.machine()}, {os.cpu_count()} cores")
    print(f"\ndevice: {args.device} ({device_name}), torch {torch.__version__}\n")
    print(markdown_table(results))
    if args.json:
        Path(args.json).write_text(json.dumps(
            {"device": args.device, "device_name": device_name, "settings": asdict(settings),
             "runs": runs, "results": results}, indent=2))
    print(json_line(results))


if __name__ == "__main__":
    main()
