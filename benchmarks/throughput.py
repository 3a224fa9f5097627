"""Training throughput of raycl against a plain PyTorch loop doing the same work.

Measured side by side in one process, reported as ratios (this machine is shared and noisy):

1. augmentation: raycl's batched on-device ``BatchAugment`` vs torchvision's per-sample
   ``RandomResizedCrop + RandomHorizontalFlip`` in a DataLoader (the conventional pipeline);
2. loop overhead: raycl's worker loop through Ray Train (in-process mode, and one Ray worker)
   vs a plain loop with the same model, data, augmentation, optimizer and epochs.

    .venv/bin/python benchmarks/throughput.py [--epochs 2] [--samples-per-combination 2]
"""

from __future__ import annotations

import argparse
import os
import tempfile
import time

import numpy as np
import torch
from torch.utils.data import DataLoader, Dataset

from raycl.config import SearchConfig
from raycl.data import load_dataset
from raycl.data.augment import BatchAugment, to_float
from raycl.methods import build_method
from raycl.methods.base import Batch


def config_for(args: argparse.Namespace, storage: str) -> SearchConfig:
    return SearchConfig.model_validate({
        "name": "bench", "data": {"samples_per_combination": args.samples_per_combination},
        "train": {"epochs": args.epochs, "batch_size": 256},
        "eval": {"every_n_epochs": 0, "linear_max_iter": 10},
        "scaling": {"num_workers": 0, "cpus_per_worker": args.threads},
        "tune": {"storage_path": storage},
    })


def plain_loop(config: SearchConfig, images: np.ndarray, augment) -> float:
    """The reference: a hand-written loop, same model/augmentation/optimizer. Returns img/s."""
    torch.manual_seed(0)
    method = build_method(config, images.shape[1])
    optimizer = torch.optim.AdamW(method.parameters(), lr=config.train.lr)
    data = torch.from_numpy(images)
    batch_size = config.train.batch_size
    seen, started = 0, time.perf_counter()
    for _ in range(config.train.epochs):
        order = torch.randperm(len(data))
        for start in range(0, len(data) - batch_size + 1, batch_size):
            index = order[start:start + batch_size]
            batch_images = data[index]
            batch = Batch(images=to_float(batch_images),
                          views=[augment(batch_images), augment(batch_images)], index=index)
            loss = method(batch)["loss"]
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
            seen += len(index)
    return seen / (time.perf_counter() - started)


class _PerSample(Dataset):
    def __init__(self, images: np.ndarray) -> None:
        from torchvision.transforms import v2

        self.images = torch.from_numpy(images)
        side = images.shape[-1]
        self.transform = v2.Compose([
            v2.RandomResizedCrop(side, scale=(0.2, 1.0), antialias=True),
            v2.RandomHorizontalFlip(), v2.ToDtype(torch.float32, scale=True),
            v2.Normalize([0.5] * images.shape[1], [0.5] * images.shape[1])])

    def __len__(self) -> int:
        return len(self.images)

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        image = self.images[i]
        return self.transform(image), self.transform(image)


def augmentation_only(images: np.ndarray, config: SearchConfig) -> tuple[float, float]:
    """Two views of every image: batched raycl vs per-sample torchvision. Returns img/s each."""
    augment = BatchAugment(config.augment)
    data = torch.from_numpy(images)
    started = time.perf_counter()
    for start in range(0, len(data), 256):
        batch = data[start:start + 256]
        augment(batch), augment(batch)
    batched = len(data) / (time.perf_counter() - started)
    loader = DataLoader(_PerSample(images), batch_size=256, num_workers=0)
    started = time.perf_counter()
    for _ in loader:
        pass
    per_sample = len(data) / (time.perf_counter() - started)
    return batched, per_sample


def raycl_loop(config: SearchConfig, num_workers: int) -> float:
    """raycl's worker loop through Ray Train; images/s over the training epochs."""
    from raycl.pipeline import fit_stage
    from raycl.stages import StageInputs

    config = config.model_copy(update={"scaling": config.scaling.model_copy(
        update={"num_workers": num_workers})})
    started = time.perf_counter()
    _, _, metrics = fit_stage(config, StageInputs(), config.tune.storage_path)
    total = time.perf_counter() - started
    print(f"    raycl num_workers={num_workers}: {total:.1f} s wall for the stage (incl. start-up "
          f"and final evaluation), last epoch {metrics['train/images_per_second']:.0f} img/s")
    return float(metrics["train/images_per_second"])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--epochs", type=int, default=2)
    parser.add_argument("--samples-per-combination", type=int, default=2)
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    storage = tempfile.mkdtemp(prefix="raycl-bench-")
    config = config_for(args, storage)
    data = load_dataset(config.data, config.seed)
    images = data.train.images
    print(f"Trifeature {images.shape}, small_cnn, batch 256, {args.epochs} epochs, "
          f"{args.threads} threads")

    batched, per_sample = augmentation_only(images, config)
    print(f"augmentation  raycl batched {batched:8.0f} img/s   torchvision per-sample "
          f"{per_sample:8.0f} img/s   ratio {batched / per_sample:5.2f}x")

    plain = plain_loop(config, images, BatchAugment(config.augment))
    print(f"plain PyTorch loop            {plain:8.0f} img/s")
    import ray

    from raycl.tune import init_ray

    init_ray(num_cpus=args.threads, log_to_driver=False)
    for workers in (0, 1):
        rate = raycl_loop(config, workers)
        print(f"raycl loop, num_workers={workers}   {rate:8.0f} img/s   ratio to plain "
              f"{rate / plain:5.2f}")
    ray.shutdown()


if __name__ == "__main__":
    os.environ.setdefault("RAY_TRAIN_V2_ENABLED", "1")
    main()
