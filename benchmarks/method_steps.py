"""Time one training step of each method, side by side: what a method's loss costs.

A step is what the worker loop does per batch once the views exist: forward both views, the loss,
backward, the optimizer step. Augmentation is excluded (it is the same for every method and
measured by ``make bench``). For NNCLR and All4One the step also includes the support-set
lookups and enqueue (inside the forward) and ``on_train_step_end`` (All4One's EMA update), as in
the worker loop. Methods are interleaved within each repeat so drift on a shared machine hits all
alike; the figure is the median step time and its ratio to the baseline's (Spectral CL's, or the
first selected variant's when ``--variants`` leaves it out).
Needs torch only (no Ray or MLflow), so it runs on a bare GPU machine too:

    .venv/bin/python benchmarks/method_steps.py                      # the hscl_filter CPU config
    python benchmarks/method_steps.py --device cuda --backbone resnet18 --batch-size 256 \
        --projector-hidden-dim 2048 --projector-dim 128 --amp           # the paper's GPU setting

NNCLR and All4One at their papers' shape (ResNet-18, batch 256, projector 2048 -> 256, predictor
hidden 4096, queue 98 304); on 2 CPU cores a step takes seconds, so 1 warm-up and 3 steps:

    .venv/bin/python benchmarks/method_steps.py --variants all4one nnclr --backbone resnet18 \
        --projector-hidden-dim 2048 --projector-dim 256 --predictor-hidden-dim 4096 \
        --queue-size 98304 --warmup 1 --steps 1 --repeats 3 \
        --out benchmarks/method_steps_all4one.json
    python benchmarks/method_steps.py --variants all4one nnclr --device cuda --backbone resnet18 \
        --projector-hidden-dim 2048 --projector-dim 256 --predictor-hidden-dim 4096 \
        --queue-size 98304 --amp --out method_steps_all4one_cuda.json   # the same on a GPU

A ViT beside ResNet-18 (any timm model is a backbone, ``timm/<name>``; ``--backbones`` times
every variant on each, interleaved; ``--timm-kwargs`` is passed to timm.create_model):

    .venv/bin/python benchmarks/method_steps.py --variants simclr nnclr \
        --backbones resnet18 timm/vit_tiny_patch16_224 --timm-kwargs \
        '{"img_size": 32, "patch_size": 4}' --batch-size 64 --warmup 1 --steps 1 --repeats 3 \
        --out benchmarks/method_steps_vit.json
    python benchmarks/method_steps.py --variants simclr --device cuda --resolution 224 \
        --backbones resnet18 timm/vit_small_patch16_224 --batch-size 256 --amp   # ViT-S/16

FGVR on MoCo v2 against MoCo v2 alone (the joint phase's step: the base loss, the clean image's
features, reconstruction, Grad-CAM, the perturbed decode and the pair loss) at the fgvr_eps CPU
config; the paper's shape is ResNet-50 at 224 px, batch 128:

    .venv/bin/python benchmarks/method_steps.py --variants mocov2 fgvr "fgvr random" simsiam \
        --width 16 --out benchmarks/method_steps_fgvr.json
    python benchmarks/method_steps.py --variants mocov2 fgvr --device cuda --backbone resnet50 \
        --resolution 224 --batch-size 128 --projector-hidden-dim 2048 --projector-dim 128 --amp
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import torch

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

# (label, method, section overrides)
VARIANTS: list[tuple[str, str, dict[str, Any]]] = [
    ("spectral", "spectral", {}),
    ("hscl p=0.1", "hscl", {"hscl": {"filter_exponent": 0.1}}),
    ("hscl p=0.5", "hscl", {"hscl": {"filter_exponent": 0.5}}),
    ("simclr", "simclr", {}),
    ("nnclr", "nnclr", {}),
    ("all4one", "all4one", {}),
    ("mocov2", "mocov2", {}),
    ("simsiam", "simsiam", {}),
    ("fgvr", "fgvr", {}),
    ("fgvr random", "fgvr", {"fgvr": {"perturbation": "random"}}),
]


def build(args: argparse.Namespace, method: str, sections: dict[str, Any],
          backbone: str) -> torch.nn.Module:
    from raycl.methods import SearchConfig, build_method

    if method in ("nnclr", "all4one"):
        # The support set and the predictor are sized from the flags; ψ's heads must divide D.
        sizes = {"queue_size": args.queue_size, "predictor_hidden_dim": args.predictor_hidden_dim
                 or 2 * args.projector_hidden_dim}
        if method == "all4one":
            sizes["transformer_heads"] = math.gcd(8, args.projector_dim)
        sections = {**sections, method: {**sizes, **sections.get(method, {})}}
    config = SearchConfig.model_validate({
        "name": "steps", "method": method, **sections,
        # The resolution sizes FGVR's decoder and picks the ResNet stem (model.stem: auto).
        "data": {"resolution": args.resolution},
        "model": {"backbone": backbone, "width": args.width,
                  "timm_kwargs": json.loads(args.timm_kwargs) if backbone.startswith("timm/")
                  else {},
                  "projector_hidden_dim": args.projector_hidden_dim,
                  "projector_dim": args.projector_dim}})
    torch.manual_seed(0)
    return build_method(config, in_channels=3).to(args.device)


def time_steps(method: torch.nn.Module, args: argparse.Namespace, steps: int) -> float:
    """Median seconds per step over ``steps`` steps (after they are issued and synchronised).

    A step: forward (for NNCLR / All4One: with the support-set lookups and enqueue), backward,
    optimizer step and ``on_train_step_end`` (All4One: the EMA update of the momentum branch).
    """
    from raycl.methods.base import Batch

    device = torch.device(args.device)
    generator = torch.Generator(device=device).manual_seed(0)
    shape = (args.batch_size, 3, args.resolution, args.resolution)
    views = [torch.randn(shape, generator=generator, device=device) for _ in range(2)]
    batch = Batch(images=views[0], views=views, index=torch.arange(args.batch_size, device=device))
    optimizer = torch.optim.SGD(method.parameters(), lr=1e-3, momentum=0.9)
    autocast = torch.autocast(device.type, dtype=torch.float16, enabled=args.amp)
    scaler = torch.amp.GradScaler(device.type, enabled=args.amp)
    times = []
    for _ in range(steps):
        if device.type == "cuda":
            torch.cuda.synchronize()
        started = time.perf_counter()
        with autocast:
            loss = method(batch)["loss"]
        optimizer.zero_grad(set_to_none=True)
        scaler.scale(loss).backward()
        scaler.step(optimizer)
        scaler.update()
        method.on_train_step_end(1, 1_000_000)  # a step early in a long run
        if device.type == "cuda":
            torch.cuda.synchronize()
        times.append(time.perf_counter() - started)
    return statistics.median(times)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--backbone", default="small_cnn")
    parser.add_argument("--backbones", nargs="+", default=None,
                        help="time every variant on each of these backbones (labels "
                        "'<variant> @ <backbone>'); overrides --backbone")
    parser.add_argument("--timm-kwargs", default="{}",
                        help="JSON keyword arguments of timm.create_model for timm/ backbones")
    parser.add_argument("--width", type=int, default=32)
    parser.add_argument("--projector-hidden-dim", type=int, default=256)
    parser.add_argument("--projector-dim", type=int, default=64)
    parser.add_argument("--predictor-hidden-dim", type=int, default=None,
                        help="NNCLR / All4One predictor hidden width (default: 2 x projector "
                        "hidden, the papers' 4096 for 2048)")
    parser.add_argument("--queue-size", type=int, default=4096,
                        help="NNCLR / All4One support-set entries (the papers: 98304)")
    parser.add_argument("--batch-size", type=int, default=256)
    parser.add_argument("--resolution", type=int, default=32)
    parser.add_argument("--amp", action="store_true", help="fp16 autocast (CUDA)")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--steps", type=int, default=10, help="timed steps per repeat")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--warmup", type=int, default=3, help="untimed steps per method first")
    labels = [label for label, _, _ in VARIANTS]
    parser.add_argument("--variants", nargs="+", choices=labels, default=labels,
                        help="which variants to time (default: all)")
    parser.add_argument("--json", "--out", dest="json", default=None,
                        help="write the raw numbers here")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)

    backbones = args.backbones or [args.backbone]
    methods = {label if len(backbones) == 1 else f"{label} @ {backbone}":
               build(args, method, sections, backbone)
               for backbone in backbones
               for label, method, sections in VARIANTS if label in args.variants}
    for method in methods.values():
        if args.warmup:
            time_steps(method, args, args.warmup)  # warm-up: allocator, kernels, autotuning
    seconds: dict[str, list[float]] = {label: [] for label in methods}
    for _ in range(args.repeats):
        for label, method in methods.items():
            seconds[label].append(time_steps(method, args, args.steps))
            print(f"  {label}: {1e3 * seconds[label][-1]:.1f} ms", file=sys.stderr, flush=True)
    base_label = "spectral" if "spectral" in seconds else next(iter(seconds))
    baseline = seconds[base_label]
    print(f"| method | step (ms), median [min–max] of {args.repeats} | ratio to {base_label} |")
    print("|---|---|---|")
    report: dict[str, Any] = {"settings": vars(args), "seconds": seconds, "baseline": base_label,
                              f"ratio_to_{base_label}": {}}
    for label, values in seconds.items():
        ratios = [v / b for v, b in zip(values, baseline, strict=True)]
        report[f"ratio_to_{base_label}"][label] = ratios
        print(f"| {label} | {1e3 * statistics.median(values):.1f} [{1e3 * min(values):.1f}–"
              f"{1e3 * max(values):.1f}] | {statistics.median(ratios):.3f} [{min(ratios):.3f}–"
              f"{max(ratios):.3f}] |")
    if args.json:
        Path(args.json).write_text(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
