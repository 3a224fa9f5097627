"""``make bench``: what raycl costs over a hand-written PyTorch loop, measured side by side.

Every figure is a ratio or a time measured in this one run, interleaved and repeated (median and
spread over ``--repeats``), so a noisy shared machine affects both sides alike:

- training throughput, raycl / plain loop: the same model, data, augmentation, optimizer and
  number of steps; the first epoch of each side is warm-up and excluded. raycl runs as a real Tune
  trial, in-process (``num_workers: 0``) and with one Ray Train worker;
- trial start-up: trial start to the first optimizer step (``perf/startup_seconds``);
- MCL between stages: raycl's embedding pass against a bare ``torch.no_grad`` loop over the same
  images, and the k-means that follows;
- peak RSS of the training process for each method at its CPU config (one epoch);
- the two augmented views: raycl's batched on-device augmentation against torchvision's
  per-sample pipeline in a DataLoader;
- with ``--sweep``: ASHA + Optuna against running every trial to the end on the quickstart
  space (wall time and best validation score).

Everything runs on the device it finds (``--device auto``: CUDA when this process sees a GPU):
the trials with ``scaling.use_gpu``, the plain loops, the embedding pass and the batched
augmentation on it (torchvision's per-sample pipeline stays on the host, as users run it); the
JSON records the device that ran. ``benchmarks/gpu.py`` is the GPU-specific benchmark.

    .venv/bin/python benchmarks/bench.py [--repeats 3] [--sweep] [--device auto|cpu|cuda]
        [--json benchmarks/results.json] [--augmentation-only]

``--augmentation-only`` measures only the augmented views (no Ray, a minute on 2 cores), among
them BYOL's recipe with Gaussian blur and solarization at 32 and 224 px, and writes
``benchmarks/augment.json`` unless ``--json`` says otherwise.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch

REPO = Path(__file__).resolve().parents[1]


# ---------------------------------------------------------------------------------------------
# Configs


def bench_config(root: Path, name: str, *overrides: str, search: str = "quickstart.yaml"):
    from raycl.launch.load import load_search

    return load_search(REPO / "searches" / search, [
        "tune.search_space={}", "tune.num_samples=1", f"name={name}",
        f"tune.storage_path={root / 'ray'}", f"mlflow.tracking_uri=sqlite:///{root / 'm.db'}",
        *overrides])


def throughput_overrides(args: argparse.Namespace, workers: int) -> list[str]:
    return [f"data.samples_per_combination={args.samples_per_combination}",
            f"train.epochs={args.epochs}", "train.batch_size=256", "train.warmup_epochs=0",
            "eval.every_n_epochs=0", "eval.linear_max_iter=20", "eval.max_train_samples=500",
            f"scaling.num_workers={workers}", f"scaling.cpus_per_worker={args.threads}",
            f"scaling.use_gpu={str(args.device == 'cuda').lower()}"]


def synchronize(device: torch.device) -> None:
    """Wait for the device's queued work (CUDA), so a host clock times what ran."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)


# ---------------------------------------------------------------------------------------------
# The reference: a hand-written loop


def plain_loop(config: Any, device: torch.device) -> list[float]:
    """What a user would write by hand for the same training on ``device`` (the same AMP mode,
    TF32 and channels_last as raycl's loop there): images/s of every epoch."""
    from raycl.data import load_dataset
    from raycl.data.augment import BatchAugment, to_float
    from raycl.methods import build_method
    from raycl.methods.base import Batch
    from raycl.worker.cuda import configure_cuda_backends, prefer_channels_last
    from raycl.worker.optim import autocast_and_scaler

    torch.manual_seed(0)
    configure_cuda_backends(device)
    data = load_dataset(config.data, config.seed)
    images = torch.from_numpy(np.asarray(data.train.images))  # a split is a view: one copy here
    if device.type == "cuda":
        images = images.pin_memory()
    method = prefer_channels_last(build_method(config, data.channels).to(device), device)
    optimizer = torch.optim.AdamW(method.parameters(), lr=config.train.lr,
                                  weight_decay=config.train.weight_decay)
    autocast, scaler = autocast_and_scaler(config, device)
    augment = BatchAugment(config.augment)
    generator = torch.Generator(device=device)
    batch_size = config.train.batch_size
    rates = []
    for _ in range(config.train.epochs):
        order = torch.randperm(len(images))
        seen, started = 0, time.perf_counter()
        for start in range(0, len(images) - batch_size + 1, batch_size):
            index = order[start:start + batch_size]
            batch_images = images[index].to(device, non_blocking=True)
            batch = Batch(images=to_float(batch_images),
                          views=[augment(batch_images, generator),
                                 augment(batch_images, generator)],
                          index=index.to(device, non_blocking=True))
            with autocast():
                loss = method(batch)["loss"]
            optimizer.zero_grad(set_to_none=True)
            scaler.scale(loss).backward()
            scaler.step(optimizer)
            scaler.update()
            seen += len(index)
        synchronize(device)
        rates.append(seen / (time.perf_counter() - started))
    return rates


def plain_loop_in_ray_worker(config: Any, threads: int, device: torch.device) -> list[float]:
    """The same hand-written loop inside a one-worker ``TorchTrainer``: separates what a Ray
    Train worker process costs from what raycl's loop costs."""
    from ray.train import RunConfig, ScalingConfig
    from ray.train.torch import TorchTrainer

    # Ray Train V2 keeps metrics only with checkpoints: the worker writes its rates to a file
    # (same machine) instead.
    out = Path(tempfile.mkdtemp(prefix="raycl-plain-worker-")) / "rates.json"

    def loop(train_config: dict[str, Any]) -> None:
        import ray.train.torch

        from raycl.methods import SearchConfig

        torch.set_num_threads(threads)
        out.write_text(json.dumps(plain_loop(SearchConfig.model_validate(train_config),
                                             ray.train.torch.get_device())))

    gpu = device.type == "cuda"
    TorchTrainer(
        loop, train_loop_config=config.to_dict(),
        scaling_config=ScalingConfig(num_workers=1, use_gpu=gpu, resources_per_worker={
            "CPU": threads, **({"GPU": 1} if gpu else {})}),
        run_config=RunConfig(name=f"plain-worker-{time.time_ns()}",
                             storage_path=config.tune.storage_path)).fit()
    return json.loads(out.read_text())


def raycl_trial(config: Any) -> dict[str, Any]:
    """One real Tune trial; its per-epoch images/s, start-up and peak RSS."""
    from raycl.sweep.tuner import build_tuner

    started = time.perf_counter()
    results = build_tuner(config, None).fit()
    wall = time.perf_counter() - started
    result = results[0]
    if result.error is not None:
        raise RuntimeError(f"benchmark trial failed: {result.error}")
    frame = result.metrics_dataframe
    return {
        "rates": [float(v) for v in frame["train/images_per_second"].dropna()],
        "startup_seconds": float(frame["perf/startup_seconds"].dropna().iloc[0]),
        "peak_rss_mb": float(frame["perf/peak_rss_mb"].max()),
        "wall_seconds": wall,
    }


def steady(rates: list[float]) -> float:
    """Median images/s without the first (warm-up) epoch."""
    return statistics.median(rates[1:] if len(rates) > 1 else rates)


# ---------------------------------------------------------------------------------------------
# Between MCL stages


def between_stages(args: argparse.Namespace, root: Path, repeats: int) -> dict[str, Any]:
    """raycl's embedding pass vs a bare no_grad loop over the same training images (both on
    ``args.device``, in the precision raycl's evaluation uses there), and k-means."""
    from raycl.data import load_dataset
    from raycl.kmeans import kmeans
    from raycl.methods import build_method
    from raycl.worker.cuda import prefer_channels_last
    from raycl.worker.embed import embed_images
    from raycl.worker.optim import inference_autocast
    from raycl.worker.session import InProcessSession

    device = torch.device(args.device)
    config = bench_config(root, "between", search="mcl_k_n.yaml")
    data = load_dataset(config.data, config.seed)
    method = prefer_channels_last(build_method(config, data.channels).to(device).eval(), device)
    autocast = inference_autocast(config, device)
    images = data.train.images
    session = InProcessSession(device)
    embed_rates, bare_rates, kmeans_seconds = [], [], []
    for _ in range(repeats):
        started = time.perf_counter()
        features = embed_images(method, images, session, autocast=autocast)
        embed_rates.append(len(images) / (time.perf_counter() - started))
        started = time.perf_counter()
        with torch.no_grad(), autocast():
            for i in range(0, len(images), 512):
                batch = torch.from_numpy(images[i:i + 512]).to(device)
                method.backbone(batch.float().div_(255).sub_(0.5).div_(0.5)).float().cpu()
        bare_rates.append(len(images) / (time.perf_counter() - started))
        started = time.perf_counter()
        kmeans(features, config.mcl.clusters, seed=0, niter=config.mcl.kmeans_iterations)
        kmeans_seconds.append(time.perf_counter() - started)
    ratios = [e / b for e, b in zip(embed_rates, bare_rates, strict=True)]
    return {"images": len(images), "embed_img_per_s": embed_rates, "bare_img_per_s": bare_rates,
            "embed_ratio": ratios, "kmeans_seconds": kmeans_seconds,
            "kmeans_k": config.mcl.clusters, "feature_dim": int(features.shape[1])}


# ---------------------------------------------------------------------------------------------
# Augmentation


# BYOL's augmentations (solo-learn's asymmetric recipe: blur [1.0, 0.1], solarize [0.0, 0.2])
# with jitter strength 0.5 = (0.4, 0.4, 0.4, 0.1), grayscale 0.2 and crops from 8 % of the area.
BYOL_AUGMENT = ("augment.crop_scale=[0.08, 1.0]", "augment.color_jitter=0.5",
                "augment.color_jitter_prob=0.8", "augment.grayscale_prob=0.2",
                "augment.blur_prob=[1.0, 0.1]", "augment.solarize_prob=[0.0, 0.2]")
AUGMENT_224_IMAGES = 512  # the 224 px figure: this many training images, upsampled


def per_sample_pipeline(augment_cfg: Any, side: int, channels: int, view: int) -> Any:
    """torchvision's per-sample v2 pipeline for one view doing what ``BatchAugment`` does with
    ``augment_cfg``: crop, flip, jitter, grayscale, blur (the same kernel and sigma range,
    scaled to ``side``), solarize (threshold 128 on uint8); an op that is off is left out."""
    from torchvision.transforms import v2

    from raycl.config.training import per_view
    from raycl.data.augment import blur_radius

    jitter, jitter_prob = (per_view(augment_cfg.color_jitter)[view],
                           per_view(augment_cfg.color_jitter_prob)[view])
    gray, blur, solarize = (per_view(getattr(augment_cfg, key))[view]
                            for key in ("grayscale_prob", "blur_prob", "solarize_prob"))
    steps: list[Any] = [v2.RandomResizedCrop(side, scale=tuple(augment_cfg.crop_scale),
                                             antialias=True)]
    if augment_cfg.flip:
        steps.append(v2.RandomHorizontalFlip())
    if channels == 3 and jitter > 0:
        steps.append(v2.RandomApply([v2.ColorJitter(0.8 * jitter, 0.8 * jitter, 0.8 * jitter,
                                                    min(0.2 * jitter, 0.5))], p=jitter_prob))
    if channels == 3 and gray > 0:
        steps.append(v2.RandomGrayscale(p=gray))
    if blur > 0:
        kernel = 2 * blur_radius(side) + 1
        sigma = tuple(value * side / 224 for value in augment_cfg.blur_sigma)
        steps.append(v2.RandomApply([v2.GaussianBlur(kernel, sigma=sigma)], p=blur))
    if solarize > 0:
        steps.append(v2.RandomSolarize(threshold=128, p=solarize))
    steps += [v2.ToDtype(torch.float32, scale=True),
              v2.Normalize([0.5] * channels, [0.5] * channels)]
    return v2.Compose(steps)


def views_side_by_side(augment_cfg: Any, images: torch.Tensor, device: torch.device,
                       repeats: int) -> dict[str, Any]:
    """Two views of every image: ``BatchAugment`` on the device in batches of 256 against
    torchvision's per-sample pipelines in a DataLoader (host), interleaved ``repeats`` times.

    Args:
        augment_cfg: the augment section both sides follow.
        images: uint8 (N, C, H, W) on the host.
        device: where the batched views run.
        repeats: interleaved measurements.

    Returns:
        img/s of each side per repeat and their ratios (batched / per sample).
    """
    from torch.utils.data import DataLoader, Dataset

    from raycl.data.augment import BatchAugment

    side, channels = images.shape[-1], images.shape[1]
    pipelines = [per_sample_pipeline(augment_cfg, side, channels, view) for view in (0, 1)]

    class PerSample(Dataset):
        def __len__(self) -> int:
            return len(images)

        def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
            return pipelines[0](images[i]), pipelines[1](images[i])

    # The batched views on the device (the uint8 batches already there, as in raycl's loop).
    augment, data = BatchAugment(augment_cfg), images.to(device)
    generator = torch.Generator(device=device).manual_seed(0)
    batched, per_sample = [], []
    for _ in range(repeats):
        augment(data[:256], generator)  # warm-up (kernels, the colour constants)
        synchronize(device)
        started = time.perf_counter()
        for start in range(0, len(data), 256):
            batch = data[start:start + 256]
            augment(batch, generator, view=0), augment(batch, generator, view=1)
        synchronize(device)
        batched.append(len(data) / (time.perf_counter() - started))
        started = time.perf_counter()
        for _ in DataLoader(PerSample(), batch_size=256, num_workers=0):
            pass
        per_sample.append(len(data) / (time.perf_counter() - started))
    return {"batched_img_per_s": batched, "per_sample_img_per_s": per_sample,
            "ratio": [b / p for b, p in zip(batched, per_sample, strict=True)],
            "images": len(images), "side": side}


def augmentation(args: argparse.Namespace, root: Path, repeats: int) -> dict[str, Any]:
    """The quickstart's views (crop + flip), then BYOL's with blur and solarization at the
    data's 32 px and at 224 px (the first ``AUGMENT_224_IMAGES`` images upsampled), each
    batched against torchvision per sample."""
    from raycl.data import load_dataset

    config = bench_config(root, "augment", *throughput_overrides(args, 0))
    images = torch.from_numpy(np.asarray(load_dataset(config.data, config.seed).train.images))
    device = torch.device(args.device)
    report = views_side_by_side(config.augment, images, device, repeats)
    byol = bench_config(root, "augment-byol", *throughput_overrides(args, 0), *BYOL_AUGMENT)
    upsampled = torch.nn.functional.interpolate(
        images[:AUGMENT_224_IMAGES].float(), size=(224, 224), mode="bilinear",
        align_corners=False).round().clamp(0, 255).to(torch.uint8)
    report["blur_solarize"] = [views_side_by_side(byol.augment, images, device, repeats),
                               views_side_by_side(byol.augment, upsampled, device, repeats)]
    return report


def augmentation_rows(a: dict[str, Any]) -> list[str]:
    rows = [f"| two augmented views img/s | {spread(a['batched_img_per_s'])} (batched) | "
            f"{spread(a['per_sample_img_per_s'])} (torchvision per sample) | "
            f"{spread(a['ratio'])} | |"]
    for b in a.get("blur_solarize", []):
        rows.append(f"| two views, BYOL's (blur, solarize), {b['side']} px, {b['images']} images "
                    f"img/s | {spread(b['batched_img_per_s'])} (batched) | "
                    f"{spread(b['per_sample_img_per_s'])} (torchvision per sample) | "
                    f"{spread(b['ratio'])} | |")
    return rows


# ---------------------------------------------------------------------------------------------
# Memory per method, and the dataset


def memory(args: argparse.Namespace, root: Path) -> dict[str, Any]:
    """Peak RSS of the training process, each method at its own YAML's config (on
    ``args.device``), one epoch."""
    from raycl.data import load_dataset

    out: dict[str, Any] = {}
    gpu = f"scaling.use_gpu={str(args.device == 'cuda').lower()}"
    for method, search in (("simclr", "quickstart.yaml"), ("mcl", "mcl_k_n.yaml")):
        config = bench_config(root, f"rss-{method}", "train.epochs=1", gpu, search=search)
        trial = raycl_trial(config)
        out[method] = {"peak_rss_mb": trial["peak_rss_mb"], "search": search}
        data = load_dataset(config.data, config.seed)
        out[method]["dataset_mb"] = sum(
            split.images.nbytes for split in (data.train, data.val, data.test)) / 2**20
    return out


# ---------------------------------------------------------------------------------------------
# Sweep efficiency


def sweep_efficiency(root: Path) -> dict[str, Any]:
    """The quickstart space with its ASHA scheduler against every trial run to the end."""
    from raycl.launch.load import load_search
    from raycl.sweep.tuner import build_tuner

    out = {}
    for label, scheduler in (("asha", "asha"), ("run_to_end", "none")):
        config = load_search(REPO / "searches" / "quickstart.yaml", [
            f"name=sweep-{label}", f"tune.storage_path={root / 'ray'}",
            f"mlflow.tracking_uri=sqlite:///{root / 'm.db'}",
            f"tune.scheduler.type={scheduler}"])
        started = time.perf_counter()
        results = build_tuner(config, None).fit()
        wall = time.perf_counter() - started
        best = results.get_best_result(config.tune.metric, config.tune.mode, scope="last")
        out[label] = {
            "trials": len(results), "wall_seconds": wall,
            "best_val": float(best.metrics[config.tune.metric]),
            "best_test": float(best.metrics.get("test/linear/mean", float("nan"))),
            "epochs_trained": int(sum(len(r.metrics_dataframe) for r in results)),
        }
    return out


# ---------------------------------------------------------------------------------------------
# Report


def spread(values: list[float]) -> str:
    return f"{statistics.median(values):.3g} [{min(values):.3g}–{max(values):.3g}]"


def table(report: dict[str, Any]) -> str:
    t = report["throughput"]
    rows = [
        "| figure | raycl | plain PyTorch | ratio (median [min–max]) | target |",
        "|---|---|---|---|---|",
        f"| training img/s, in-process | {spread(t['in_process'])} | {spread(t['plain'])} | "
        f"{spread(t['ratio_in_process'])} | ≥ 0.95 |",
        f"| training img/s, one Ray worker | {spread(t['one_worker'])} | {spread(t['plain'])} | "
        f"{spread(t['ratio_one_worker'])} | ≥ 0.95 |",
        f"| training img/s, one Ray worker vs the plain loop in a Ray Train worker | "
        f"{spread(t['one_worker'])} | {spread(t['plain_in_worker'])} | "
        f"{spread(t['ratio_one_worker_to_plain_in_worker'])} | |",
        f"| trial start → first step, in-process (s) | {spread(t['startup_in_process'])} | | | "
        f"≤ 3 s |",
        f"| trial start → first step, one Ray worker (s) | {spread(t['startup_one_worker'])} "
        f"| | | |",
    ]
    b = report["between_stages"]
    rows.append(f"| MCL embedding pass img/s ({b['images']} images) | "
                f"{spread(b['embed_img_per_s'])} | {spread(b['bare_img_per_s'])} (bare no_grad) | "
                f"{spread(b['embed_ratio'])} | ≥ 0.9 |")
    rows.append(f"| k-means, K={b['kmeans_k']}, {b['images']}×{b['feature_dim']} (s) | "
                f"{spread(b['kmeans_seconds'])} | | | |")
    rows += augmentation_rows(report["augmentation"])
    for method, m in report["memory"].items():
        rows.append(f"| peak RSS, {method} trial process ({m['search']}, 1 epoch) | "
                    f"{m['peak_rss_mb']:.0f} MB | | | dataset {m['dataset_mb']:.0f} MB, "
                    f"loaded per process |")
    if "sweep" in report:
        for label, s in report["sweep"].items():
            rows.append(f"| quickstart sweep, {label} | {s['wall_seconds']:.0f} s, "
                        f"{s['epochs_trained']} epochs | best val {s['best_val']:.3f} "
                        f"(its test {s['best_test']:.3f}) | | |")
    return "\n".join(rows)


def machine_record(args: argparse.Namespace) -> dict[str, Any]:
    """The machine and the device every figure of the report was measured on."""
    device = torch.device(args.device)
    return {"platform": platform.platform(), "cpus": os.cpu_count(),
            "threads": args.threads, "torch": torch.__version__,
            "cuda_available": torch.cuda.is_available(),
            # What ran: every figure below was measured on this device.
            "device": args.device,
            "gpu": torch.cuda.get_device_name(device) if device.type == "cuda" else None}


def augmentation_only(args: argparse.Namespace, root: Path) -> None:
    """``--augmentation-only``: the augmentation rows of the table, and their JSON."""
    report = {"machine": machine_record(args), "settings": vars(args),
              "augmentation": augmentation(args, root, args.repeats)}
    machine = report["machine"]
    print(f"device: {machine['device']}" + (f" ({machine['gpu']})" if machine["gpu"] else ""))
    print("\n| figure | raycl | torchvision | ratio (median [min–max]) | target |\n"
          "|---|---|---|---|---|")
    print("\n".join(augmentation_rows(report["augmentation"])))
    Path(args.json).write_text(json.dumps(report, indent=2, default=float))
    print(f"\nraw numbers: {args.json}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--epochs", type=int, default=4,
                        help="per throughput run; the first is warm-up")
    parser.add_argument("--samples-per-combination", type=int, default=3)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--sweep", action="store_true",
                        help="also compare ASHA with run-to-end on the quickstart space (slow)")
    parser.add_argument("--json", default=None,
                        help="default benchmarks/results.json (benchmarks/augment.json with "
                        "--augmentation-only)")
    parser.add_argument("--augmentation-only", action="store_true",
                        help="only the augmented views (no Ray trials)")
    parser.add_argument("--device", choices=("auto", "cpu", "cuda"), default="auto",
                        help="auto: CUDA when this process sees a GPU, else the CPU")
    args = parser.parse_args()
    if args.device == "auto":
        args.device = "cuda" if torch.cuda.is_available() else "cpu"
    args.json = args.json or str(REPO / "benchmarks" / (
        "augment.json" if args.augmentation_only else "results.json"))
    device = torch.device(args.device)
    torch.set_num_threads(args.threads)
    root = Path(tempfile.mkdtemp(prefix="raycl-bench-"))
    os.environ.setdefault("RAYCL_CACHE", str(root / "cache"))
    if args.augmentation_only:
        augmentation_only(args, root)
        return
    from raycl.sweep.local_ray import init_ray

    # One more logical CPU than threads: a worker trial also holds its own small reservation.
    init_ray(num_cpus=args.threads + 1, log_to_driver=False)

    throughput: dict[str, list[float]] = {key: [] for key in (
        "plain", "in_process", "one_worker", "ratio_in_process", "ratio_one_worker",
        "startup_in_process", "startup_one_worker", "plain_in_worker",
        "ratio_one_worker_to_plain_in_worker")}
    for repeat in range(args.repeats):
        # Interleaved: plain, in-process, worker, plain, ... so drift hits every side.
        plain = steady(plain_loop(bench_config(root, "plain", *throughput_overrides(args, 0)),
                                  device))
        throughput["plain"].append(plain)
        for workers, label in ((0, "in_process"), (1, "one_worker")):
            config = bench_config(root, f"tp{workers}-{repeat}",
                                  *throughput_overrides(args, workers))
            trial = raycl_trial(config)
            rate = steady(trial["rates"])
            throughput[label].append(rate)
            throughput[f"ratio_{label}"].append(rate / plain)
            throughput[f"startup_{label}"].append(trial["startup_seconds"])
        plain_worker = steady(plain_loop_in_ray_worker(
            bench_config(root, "plainw", *throughput_overrides(args, 0)), args.threads, device))
        throughput["plain_in_worker"].append(plain_worker)
        throughput["ratio_one_worker_to_plain_in_worker"].append(
            throughput["one_worker"][-1] / plain_worker)
        print(f"repeat {repeat + 1}/{args.repeats}: plain {plain:.0f} img/s, in-process "
              f"{throughput['in_process'][-1]:.0f}, one worker {throughput['one_worker'][-1]:.0f}"
              f", plain loop in a worker {plain_worker:.0f}", flush=True)
    report: dict[str, Any] = {
        "machine": machine_record(args),
        "settings": vars(args),
        "throughput": throughput,
        "between_stages": between_stages(args, root, args.repeats),
        "augmentation": augmentation(args, root, args.repeats),
        "memory": memory(args, root),
    }
    if args.sweep:
        report["sweep"] = sweep_efficiency(root)
    machine = report["machine"]
    text = (f"device: {machine['device']}" + (f" ({machine['gpu']})" if machine["gpu"] else "")
            + "\n\n" + table(report))
    print()
    print(text)
    Path(args.json).write_text(json.dumps(report, indent=2, default=float))
    print(f"\nraw numbers: {args.json}")


if __name__ == "__main__":
    main()
