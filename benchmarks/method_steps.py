"""Time one training step of each method, side by side: what a method's loss costs.

A step is what the worker loop does per batch once the views exist: forward both views, the loss,
backward, the optimizer step. Augmentation is excluded (it is the same for every method and
measured by ``make bench``). Methods are interleaved within each repeat so drift on a shared
machine hits all alike; the figure is the median step time and its ratio to Spectral CL's.
Needs torch only (no Ray or MLflow), so it runs on a bare GPU machine too:

    .venv/bin/python benchmarks/method_steps.py                      # the hscl_filter CPU config
    python benchmarks/method_steps.py --device cuda --backbone resnet18 --batch-size 256 \
        --projector-hidden-dim 2048 --projector-dim 128 --amp           # the paper's GPU setting
"""

from __future__ import annotations

import argparse
import json
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
]


def build(args: argparse.Namespace, method: str, sections: dict[str, Any]) -> torch.nn.Module:
    from raycl.config import SearchConfig
    from raycl.methods import build_method

    config = SearchConfig.model_validate({
        "name": "steps", "method": method, **sections,
        "model": {"backbone": args.backbone, "width": args.width,
                  "projector_hidden_dim": args.projector_hidden_dim,
                  "projector_dim": args.projector_dim}})
    torch.manual_seed(0)
    return build_method(config, in_channels=3).to(args.device)


def time_steps(method: torch.nn.Module, args: argparse.Namespace, steps: int) -> float:
    """Median seconds per step over ``steps`` steps (after they are issued and synchronised)."""
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
        if device.type == "cuda":
            torch.cuda.synchronize()
        times.append(time.perf_counter() - started)
    return statistics.median(times)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--backbone", default="small_cnn")
    parser.add_argument("--width", type=int, default=32)
    parser.add_argument("--projector-hidden-dim", type=int, default=256)
    parser.add_argument("--projector-dim", type=int, default=64)
    parser.add_argument("--batch-size", type=int, default=256)
    parser.add_argument("--resolution", type=int, default=32)
    parser.add_argument("--amp", action="store_true", help="fp16 autocast (CUDA)")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--steps", type=int, default=10, help="timed steps per repeat")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--json", default=None, help="write the raw numbers here")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)

    methods = {label: build(args, method, sections) for label, method, sections in VARIANTS}
    for method in methods.values():
        time_steps(method, args, 3)  # warm-up: allocator, kernels, autotuning
    seconds: dict[str, list[float]] = {label: [] for label in methods}
    for _ in range(args.repeats):
        for label, method in methods.items():
            seconds[label].append(time_steps(method, args, args.steps))
    baseline = seconds["spectral"]
    print(f"| method | step (ms), median [min–max] of {args.repeats} | ratio to spectral |")
    print("|---|---|---|")
    report: dict[str, Any] = {"settings": vars(args), "seconds": seconds, "ratio_to_spectral": {}}
    for label, values in seconds.items():
        ratios = [v / b for v, b in zip(values, baseline, strict=True)]
        report["ratio_to_spectral"][label] = ratios
        print(f"| {label} | {1e3 * statistics.median(values):.1f} [{1e3 * min(values):.1f}–"
              f"{1e3 * max(values):.1f}] | {statistics.median(ratios):.3f} [{min(ratios):.3f}–"
              f"{max(ratios):.3f}] |")
    if args.json:
        Path(args.json).write_text(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
