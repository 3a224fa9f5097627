"""The GPU benchmark: raycl's training step against a plain PyTorch loop on one device, and what
each CUDA knob buys. Needs torch and torchvision only (no Ray, no MLflow), so it runs on a bare
GPU machine:

    python benchmarks/gpu.py                        # = make bench-gpu; CUDA when present
    python benchmarks/gpu.py --device cpu --quick   # a smoke test at a tiny size (seconds)
    python benchmarks/gpu.py --time-budget 200      # skip what has not started after 200 s

What it measures (every figure after untimed warm-up, timed with ``torch.cuda.synchronize()``
around the timed block, so queued GPU work is counted):

1. **raycl vs plain**: ResNet-18 at 32 px, two-view SimCLR, batch 256, AdamW: images/s of
   raycl's epoch (``raycl.worker.epoch.run_epoch``: its method, ``BatchAugment``, lr schedule,
   AMP, loss bookkeeping, NaN check) against a hand-written loop (the same model, augmentation,
   optimizer, precision and batches), interleaved epoch by epoch; the ratio's target is ≥ 0.95.
   Both read the same pre-made uint8 batches from pinned host memory (data loading excluded).
2. the same pair under AMP off / fp16 / bf16, channels_last off and on, ``torch.compile`` of
   the backbone off and on (CUDA; ``--compile`` also on CPU);
3. each method's step (forward, backward, optimizer step, ``on_train_step_end``; views made
   once, so augmentation excluded) at the same shape, in the precision ``amp: auto`` picks;
4. the batched augmentation (two views) on the device, and BYOL's (blur, solarization);
5. an embedding pass (``raycl.worker.embed.embed_images``, in evaluation's precision) against a
   bare ``no_grad`` loop;
6. faiss k-means on the CPU, and on the GPU when faiss has GPU support.

The raw numbers go to ``--out`` (JSON); a markdown table is printed.
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import numpy as np
import torch

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from raycl.data.augment import BatchAugment, to_float  # noqa: E402
from raycl.methods import SearchConfig, build_method  # noqa: E402
from raycl.methods.base import TRAIN_PHASE, Batch, Method  # noqa: E402
from raycl.methods.registry import METHODS  # noqa: E402
from raycl.worker.batches import TrainBatch  # noqa: E402
from raycl.worker.cuda import configure_cuda_backends, prefer_channels_last  # noqa: E402
from raycl.worker.embed import embed_images  # noqa: E402
from raycl.worker.epoch import PhaseRun, StepParts, run_epoch  # noqa: E402
from raycl.worker.optim import (  # noqa: E402
    LrSchedule,
    autocast_and_scaler,
    build_optimizer,
    inference_autocast,
    resolve_amp,
)
from raycl.worker.perf import Clock  # noqa: E402

Batches = list[tuple[torch.Tensor, torch.Tensor]]


def synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def timed(device: torch.device, work: Callable[..., Any], *args: Any) -> float:
    """Seconds ``work(*args)`` takes, the device's queued work included."""
    synchronize(device)
    started = time.perf_counter()
    work(*args)
    synchronize(device)
    return time.perf_counter() - started


def make_config(args: argparse.Namespace, method: str = "simclr", amp: str = "auto",
                sections: dict[str, Any] | None = None) -> SearchConfig:
    sections = dict(sections or {})
    for name in ("nnclr", "all4one"):  # the support set sized from the flags
        if method == name:
            sections[name] = {"queue_size": args.queue_size, **sections.get(name, {})}
    return SearchConfig.model_validate({
        "name": "gpu-bench", "method": method, "seed": 0,
        "data": {"resolution": args.resolution},
        "model": {"backbone": args.backbone, "width": args.width},
        "train": {"batch_size": args.batch_size, "amp": amp, "warmup_epochs": 0},
        **sections})


def make_batches(args: argparse.Namespace, device: torch.device) -> Batches:
    """Random uint8 images in batches (host memory, pinned for CUDA) with their indices."""
    generator = torch.Generator().manual_seed(0)
    side = args.resolution
    images = torch.randint(0, 256, (args.images, 3, side, side), dtype=torch.uint8,
                           generator=generator)
    order = torch.randperm(args.images, generator=generator)
    batches = []
    for start in range(0, args.images - args.batch_size + 1, args.batch_size):
        index = order[start:start + args.batch_size]
        pair = (images[index], index)
        batches.append(tuple(t.pin_memory() for t in pair) if device.type == "cuda" else pair)
    return batches  # type: ignore[return-value]


# ---------------------------------------------------------------------------------------------
# 1-2. raycl's epoch against a plain loop


def build_model(args: argparse.Namespace, config: SearchConfig, device: torch.device,
                channels_last: bool, compile_backbone: bool) -> Method:
    torch.manual_seed(0)
    method = build_method(config, 3).to(device)
    if channels_last:
        method = method.to(memory_format=torch.channels_last)
    if compile_backbone:
        method.backbone = torch.compile(method.backbone)
    return method


def plain_epoch(method: Method, optimizer: torch.optim.Optimizer, batches: Batches,
                augment: BatchAugment, amp: str, scaler: torch.amp.GradScaler,
                device: torch.device, seed: int) -> None:
    """One epoch as a user writes it by hand: the same views, precision and optimizer."""
    generator = torch.Generator(device=device).manual_seed(seed)
    dtype = {"fp16": torch.float16, "bf16": torch.bfloat16}.get(amp)
    method.train()
    for images, index in batches:
        images = images.to(device, non_blocking=True)
        batch = Batch(images=to_float(images),
                      views=[augment(images, generator, view=0),
                             augment(images, generator, view=1)],
                      index=index.to(device, non_blocking=True))
        with torch.autocast(device.type, dtype=dtype, enabled=dtype is not None):
            loss = method(batch)["loss"]
        optimizer.zero_grad(set_to_none=True)
        scaler.scale(loss).backward()
        scaler.step(optimizer)
        scaler.update()


def raycl_vs_plain(args: argparse.Namespace, device: torch.device, batches: Batches,
                   amp: str, channels_last: bool, compile_backbone: bool) -> dict[str, Any]:
    """Images/s of raycl's epoch and the plain loop, interleaved; the first epoch of each is
    warm-up (kernels, cuDNN autotuning, compilation) and not counted."""
    config = make_config(args, amp=amp)
    mode = resolve_amp(amp, device)
    raycl = build_model(args, config, device, channels_last, compile_backbone)
    plain = build_model(args, config, device, channels_last, compile_backbone)
    raycl_optimizer = build_optimizer(raycl, config)
    plain_optimizer = torch.optim.AdamW(plain.parameters(), lr=config.train.lr,
                                        weight_decay=config.train.weight_decay)
    autocast, scaler = autocast_and_scaler(config, device)
    plain_scaler = torch.amp.GradScaler(device.type,
                                        enabled=mode == "fp16" and device.type == "cuda")
    augment = BatchAugment(config.augment)
    # The session is only asked for its device here (no report, no fault installed).
    parts = StepParts(stage=0, session=SimpleNamespace(device=device),  # type: ignore[arg-type]
                      method=raycl, loader=[TrainBatch(images=images, index=index)  # type: ignore[arg-type]
                                            for images, index in batches],
                      augment=augment, pseudo_labels=None, tokens=None, autocast=autocast,
                      scaler=scaler, clock=Clock(None))
    epochs = 1 + args.epochs
    schedule = LrSchedule(epochs * len(batches), 0, "cosine", False)
    run = PhaseRun(index=0, phase=TRAIN_PHASE, offset=0, epochs=epochs, start_epoch=0,
                   model=raycl, optimizer=raycl_optimizer, schedule=schedule)
    seen = len(batches) * args.batch_size
    rates: dict[str, list[float]] = {"raycl": [], "plain": []}
    for epoch in range(epochs):
        generator = torch.Generator(device=device).manual_seed(epoch)
        raycl_s = timed(device, run_epoch, parts, run, epoch, generator)
        plain_s = timed(device, plain_epoch, plain, plain_optimizer, batches, augment, mode,
                        plain_scaler, device, epoch)
        if epoch > 0:
            rates["raycl"].append(seen / raycl_s)
            rates["plain"].append(seen / plain_s)
    ratios = [r / p for r, p in zip(rates["raycl"], rates["plain"], strict=True)]
    return {"amp": mode, "channels_last": channels_last, "compile": compile_backbone,
            "raycl_img_per_s": rates["raycl"], "plain_img_per_s": rates["plain"],
            "ratio": ratios}


def training_variants(args: argparse.Namespace, device: torch.device) -> list[dict[str, Any]]:
    """The default (``amp: auto``, channels_last on CUDA, no compile), then one knob at a time."""
    cuda = device.type == "cuda"
    default_amp = resolve_amp("auto", device)
    variants = [("default", default_amp, cuda, False)]
    amps = ["off", "fp16", "bf16"] if cuda else (["off", "bf16"] if not args.quick else [])
    variants += [(f"amp {amp}", amp, cuda, False) for amp in amps if amp != default_amp]
    if cuda or not args.quick:
        variants.append((f"channels_last {'off' if cuda else 'on'}", default_amp, not cuda,
                         False))
    return run_variants(args, device, variants)


def compile_variant(args: argparse.Namespace, device: torch.device) -> list[dict[str, Any]]:
    """The default with ``torch.compile`` of the backbone (CUDA; ``--compile`` on the CPU): run
    last, as its compilation takes the longest (tens of seconds) and the time budget may be
    spent by then."""
    if device.type != "cuda" and not args.compile:
        return []
    if out_of_time(args):
        return [{"label": "torch.compile", "amp": resolve_amp("auto", device),
                 "channels_last": device.type == "cuda", "compile": True,
                 "error": "skipped: --time-budget spent"}]
    return run_variants(args, device, [("torch.compile", resolve_amp("auto", device),
                                        device.type == "cuda", True)])


def run_variants(args: argparse.Namespace, device: torch.device,
                 variants: list[tuple[str, str, bool, bool]]) -> list[dict[str, Any]]:
    """raycl vs plain for each (label, amp, channels_last, compile); a failure is recorded."""
    batches = make_batches(args, device)
    out = []
    for label, amp, channels_last, compile_backbone in variants:
        try:
            result = raycl_vs_plain(args, device, batches, amp, channels_last, compile_backbone)
        except Exception as exc:  # a knob this machine lacks must not lose the other figures
            result = {"amp": amp, "channels_last": channels_last, "compile": compile_backbone,
                      "error": f"{type(exc).__name__}: {exc}"}
        out.append({"label": label, **result})
        print(f"  {label}: {summary(result)}", file=sys.stderr, flush=True)
    return out


STARTED = time.perf_counter()


def out_of_time(args: argparse.Namespace) -> bool:
    """True once ``--time-budget`` seconds have passed since the start (never without one)."""
    return bool(args.time_budget) and time.perf_counter() - STARTED > args.time_budget


# ---------------------------------------------------------------------------------------------
# 3. each method's step


def method_batch(args: argparse.Namespace, method: Method, device: torch.device,
                 pseudo_labels: bool) -> Batch:
    generator = torch.Generator(device=device).manual_seed(0)
    shape = (args.batch_size, 3, args.resolution, args.resolution)
    views = [torch.randn(shape, generator=generator, device=device) for _ in range(2)]
    texts = (method.tokenize(["a striped red square"] * args.batch_size).to(device)
             if type(method).multimodal else None)
    labels = (torch.arange(args.batch_size, device=device) % 4) if pseudo_labels else None
    return Batch(images=views[0], views=views, index=torch.arange(args.batch_size, device=device),
                 pseudo_labels=labels, texts=texts)


def method_step_seconds(args: argparse.Namespace, name: str, device: torch.device) -> float:
    """Median seconds of one training step of ``name`` ("mcl": SimCLR with pseudo labels)."""
    config = make_config(args, "simclr" if name == "mcl" else name)
    torch.manual_seed(0)
    method = prefer_channels_last(build_method(config, 3).to(device), device)  # as the loop
    method.set_phase(TRAIN_PHASE.name)
    method.train()
    batch = method_batch(args, method, device, pseudo_labels=name == "mcl")
    optimizer = build_optimizer(method, config)
    autocast, scaler = autocast_and_scaler(config, device)

    def step() -> None:
        with autocast():
            loss = method(batch)["loss"]
        optimizer.zero_grad(set_to_none=True)
        scaler.scale(loss).backward()
        scaler.step(optimizer)
        scaler.update()
        method.on_train_step_end(1, 1_000_000)

    for _ in range(args.warmup):
        step()
    return statistics.median(
        timed(device, lambda: [step() for _ in range(args.steps)]) / args.steps
        for _ in range(args.repeats))


def method_steps(args: argparse.Namespace, device: torch.device) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for name in args.methods or [*METHODS, "mcl"]:
        if out_of_time(args):
            out[name] = {"error": "skipped: --time-budget spent"}
            continue
        try:
            out[name] = {"step_seconds": method_step_seconds(args, name, device)}
        except Exception as exc:  # e.g. open_clip missing for clip: the others still count
            out[name] = {"error": f"{type(exc).__name__}: {exc}"}
        print(f"  step {name}: {out[name]}", file=sys.stderr, flush=True)
    return out


# ---------------------------------------------------------------------------------------------
# 4-6. augmentation, embedding, k-means


# BYOL's asymmetric views (solo-learn): jitter, grayscale, blur [1.0, 0.1], solarize [0.0, 0.2].
BYOL_AUGMENT = {"crop_scale": [0.08, 1.0], "color_jitter": 0.5, "grayscale_prob": 0.2,
                "blur_prob": [1.0, 0.1], "solarize_prob": [0.0, 0.2]}


def augmentation(args: argparse.Namespace, device: torch.device) -> dict[str, Any]:
    """Two views of a batch: the default augment section, and BYOL's with blur and
    solarization."""
    images = make_batches(args, device)[0][0].to(device)
    out: dict[str, Any] = {"batch": len(images)}
    for key, sections in (("img_per_s", None), ("byol_img_per_s", {"augment": BYOL_AUGMENT})):
        augment = BatchAugment(make_config(args, sections=sections).augment)
        generator = torch.Generator(device=device).manual_seed(0)
        for _ in range(args.warmup):
            augment(images, generator, view=0), augment(images, generator, view=1)

        def views(augment: BatchAugment = augment, generator: torch.Generator = generator) -> None:
            for _ in range(args.steps):
                augment(images, generator, view=0), augment(images, generator, view=1)

        seconds = [timed(device, views) for _ in range(args.repeats)]
        out[key] = [args.steps * len(images) / s for s in seconds]
    return out


def embedding(args: argparse.Namespace, device: torch.device) -> dict[str, Any]:
    """raycl's embedding pass (evaluation's precision) against bare loops in float32 and in the
    same precision; the features raycl hands the probes are float32 either way."""
    config = make_config(args)
    torch.manual_seed(0)
    method = prefer_channels_last(build_method(config, 3).to(device).eval(), device)
    images = np.random.default_rng(0).integers(
        0, 256, (args.embed_images, 3, args.resolution, args.resolution), dtype=np.uint8)
    session = SimpleNamespace(rank=0, world_size=1, device=device)
    autocast = inference_autocast(config, device)

    def bare(precision: Callable[[], Any]) -> None:
        with torch.no_grad(), precision():
            for i in range(0, len(images), 512):
                batch = to_float(torch.from_numpy(images[i:i + 512]).to(device))
                method.backbone(batch).float().cpu()

    out: dict[str, list[float]] = {"raycl_img_per_s": [], "bare_fp32_img_per_s": [],
                                   "bare_autocast_img_per_s": []}
    embed_images(method, images[:512], session, autocast=autocast)  # warm-up
    for _ in range(args.repeats):
        out["raycl_img_per_s"].append(len(images) / timed(device, lambda: embed_images(
            method, images, session, autocast=autocast)))
        out["bare_fp32_img_per_s"].append(len(images) / timed(device, lambda: bare(
            lambda: torch.autocast(device.type, enabled=False))))
        out["bare_autocast_img_per_s"].append(len(images) / timed(device, lambda: bare(autocast)))
    return {"images": len(images), "precision": resolve_amp("auto", device)
            if device.type == "cuda" else "off", **out}


def kmeans_timing(args: argparse.Namespace, device: torch.device) -> dict[str, Any]:
    """faiss k-means of random unit features on the CPU, and on the GPU when faiss has one."""
    try:
        import faiss
    except ImportError as exc:  # a bare GPU machine may lack it: the other figures still count
        return {"points": args.kmeans_points, "dim": args.kmeans_dim, "k": args.kmeans_k,
                "faiss_gpus": f"faiss not installed ({exc})"}

    from raycl.kmeans import kmeans

    features = np.random.default_rng(0).standard_normal(
        (args.kmeans_points, args.kmeans_dim)).astype(np.float32)
    gpus = faiss.get_num_gpus() if hasattr(faiss, "get_num_gpus") else 0
    out: dict[str, Any] = {"points": len(features), "dim": args.kmeans_dim, "k": args.kmeans_k,
                           "faiss_gpus": gpus}
    targets = [("cpu", None)] + ([("gpu", device.index or 0)] if device.type == "cuda"
                                 and gpus > 0 else [])
    for label, gpu in targets:
        kmeans(features[:1000], args.kmeans_k, seed=0, niter=2, gpu=gpu)  # warm-up
        seconds = []
        for _ in range(args.repeats):
            started = time.perf_counter()
            kmeans(features, args.kmeans_k, seed=0, niter=20, gpu=gpu)
            seconds.append(time.perf_counter() - started)
        out[f"{label}_seconds"] = seconds
    return out


# ---------------------------------------------------------------------------------------------
# Report


def spread(values: list[float], scale: float = 1.0, digits: str = ".3g") -> str:
    values = [v * scale for v in values]
    return (f"{statistics.median(values):{digits}} [{min(values):{digits}}–"
            f"{max(values):{digits}}]")


def summary(result: dict[str, Any]) -> str:
    if "error" in result:
        return f"failed: {result['error']}"
    return (f"raycl {spread(result['raycl_img_per_s'])} img/s, plain "
            f"{spread(result['plain_img_per_s'])}, ratio {spread(result['ratio'])}")


def table(report: dict[str, Any]) -> str:
    rows = [f"device: {report['machine']['device_name']} · torch {report['machine']['torch']} · "
            f"{report['settings']['backbone']} at {report['settings']['resolution']} px, batch "
            f"{report['settings']['batch_size']}" + (" · QUICK (smoke-test sizes)"
                                                     if report["settings"]["quick"] else ""),
            "", "| figure | raycl | plain PyTorch | ratio (median [min–max]) | target |",
            "|---|---|---|---|---|"]
    for result in report["training"]:
        label = (f"training img/s, {result['label']} (amp {result['amp']}, channels_last "
                 f"{'on' if result['channels_last'] else 'off'}, compile "
                 f"{'on' if result['compile'] else 'off'})")
        if "error" in result:
            rows.append(f"| {label} | failed: {result['error'][:80]} | | | |")
            continue
        rows.append(f"| {label} | {spread(result['raycl_img_per_s'])} | "
                    f"{spread(result['plain_img_per_s'])} | {spread(result['ratio'])} | "
                    f"{'≥ 0.95' if result['label'] == 'default' else ''} |")
    for name, step in report["methods"].items():
        value = (f"{1e3 * step['step_seconds']:.2f} ms" if "step_seconds" in step
                 else f"failed: {step['error'][:60]}")
        rows.append(f"| step, {name} | {value} | | | |")
    augment = report["augmentation"]
    rows.append(f"| two augmented views img/s (batch {augment['batch']}) | "
                f"{spread(augment['img_per_s'])} | | | |")
    rows.append(f"| two views, BYOL's (blur, solarize) img/s (batch {augment['batch']}) | "
                f"{spread(augment['byol_img_per_s'])} | | | |")
    embed = report["embedding"]
    ratios = [r / b for r, b in zip(embed["raycl_img_per_s"], embed["bare_autocast_img_per_s"],
                                    strict=True)]
    rows.append(f"| embedding img/s ({embed['images']} images, {embed['precision']}) | "
                f"{spread(embed['raycl_img_per_s'])} | {spread(embed['bare_autocast_img_per_s'])}"
                f" (bare, same precision); {spread(embed['bare_fp32_img_per_s'])} (bare fp32) | "
                f"{spread(ratios)} | ≥ 0.9 |")
    kmeans = report["kmeans"]
    for label in ("cpu", "gpu"):
        if f"{label}_seconds" in kmeans:
            rows.append(f"| faiss k-means {label.upper()}, {kmeans['points']}×{kmeans['dim']}, "
                        f"K={kmeans['k']}, 20 iterations (s) | {spread(kmeans[f'{label}_seconds'])}"
                        f" | | | |")
    if "gpu_seconds" not in kmeans:
        rows.append(f"| faiss k-means GPU | not run (faiss GPUs: {kmeans['faiss_gpus']}) | | | |")
    return "\n".join(rows)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", choices=("auto", "cpu", "cuda"), default="auto")
    parser.add_argument("--quick", action="store_true",
                        help="tiny sizes (small CNN, batch 32): a smoke test, not a measurement")
    parser.add_argument("--compile", action="store_true",
                        help="also time torch.compile on the CPU (always on CUDA)")
    parser.add_argument("--backbone", default="resnet18")
    parser.add_argument("--width", type=int, default=32, help="small_cnn width")
    parser.add_argument("--resolution", type=int, default=32)
    parser.add_argument("--batch-size", type=int, default=256)
    parser.add_argument("--images", type=int, default=10240, help="per epoch")
    parser.add_argument("--epochs", type=int, default=3, help="timed epochs (after 1 warm-up)")
    parser.add_argument("--queue-size", type=int, default=65536, help="NNCLR / All4One")
    parser.add_argument("--warmup", type=int, default=5, help="untimed steps first")
    parser.add_argument("--steps", type=int, default=20, help="timed steps per repeat")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--embed-images", type=int, default=20000)
    parser.add_argument("--kmeans-points", type=int, default=100000)
    parser.add_argument("--kmeans-dim", type=int, default=512)
    parser.add_argument("--kmeans-k", type=int, default=100)
    parser.add_argument("--methods", nargs="+", default=None,
                        help="methods whose step to time (default: every one, and mcl)")
    parser.add_argument("--threads", type=int, default=None, help="torch CPU threads")
    parser.add_argument("--time-budget", type=float, default=0.0,
                        help="seconds after which the sections not yet started (method steps, "
                             "torch.compile) are skipped; 0: no limit")
    parser.add_argument("--out", default=str(REPO / "benchmarks" / "gpu_results.json"))
    args = parser.parse_args(argv)
    if args.quick:
        args.backbone, args.width, args.batch_size, args.images = "small_cnn", 8, 32, 96
        args.epochs, args.queue_size, args.warmup, args.steps, args.repeats = 1, 256, 1, 2, 1
        args.embed_images, args.kmeans_points, args.kmeans_dim, args.kmeans_k = 256, 2000, 32, 8
    if args.device == "auto":
        args.device = "cuda" if torch.cuda.is_available() else "cpu"
    return args


def main(argv: list[str] | None = None) -> dict[str, Any]:
    args = parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    device = torch.device(args.device)
    configure_cuda_backends(device)  # TF32 and cuDNN autotuning, as every raycl worker
    report: dict[str, Any] = {
        "machine": {"platform": platform.platform(), "torch": torch.__version__,
                    "device": str(device), "device_name": torch.cuda.get_device_name(device)
                    if device.type == "cuda" else f"CPU ({torch.get_num_threads()} threads)",
                    "amp_auto": resolve_amp("auto", device)},
        "settings": vars(args),
        "training": training_variants(args, device),
        "methods": method_steps(args, device),
        "augmentation": augmentation(args, device),
        "embedding": embedding(args, device),
        "kmeans": kmeans_timing(args, device),
    }
    report["training"] += compile_variant(args, device)
    report["seconds"] = time.perf_counter() - STARTED
    print(table(report))
    Path(args.out).write_text(json.dumps(report, indent=2, default=str))
    print(f"\nraw numbers: {args.out}")
    return report


if __name__ == "__main__":
    main()
