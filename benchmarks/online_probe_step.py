"""What the online probe (``eval.online_probe``) adds to a training step, side by side.

The same SimCLR step (forward of both views, loss, backward, optimizer step) timed with and
without the probe's part (the forward hook that keeps the backbone's outputs, then the heads'
own step on them: three attributes of 10 classes, as Trifeature's), the two interleaved within
each repeat so drift on a shared machine hits both alike. The figure is the median step time of
each and their ratio, and the probe's own part alone (the heads' step; a ratio near 1 is within
the machine's noise, the probe's seconds say what it adds). Needs torch only (no Ray or
MLflow), so it runs on a bare GPU machine:

    .venv/bin/python benchmarks/online_probe_step.py                 # quickstart's CPU shape
    python benchmarks/online_probe_step.py --device cuda --backbone resnet18 --batch-size 256 \
        --projector-hidden-dim 2048 --projector-dim 128 --amp

One JSON line on stdout.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import numpy as np
import torch

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

ATTRIBUTES = {"shape": 10, "texture": 10, "color": 10}


def main() -> None:
    from raycl.methods import SearchConfig, build_method
    from raycl.methods.base import Batch
    from raycl.worker.online_probe import OnlineProbe

    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--backbone", default="small_cnn")
    parser.add_argument("--width", type=int, default=32)
    parser.add_argument("--projector-hidden-dim", type=int, default=256)
    parser.add_argument("--projector-dim", type=int, default=64)
    parser.add_argument("--batch-size", type=int, default=256)
    parser.add_argument("--resolution", type=int, default=32)
    parser.add_argument("--amp", action="store_true", help="fp16 autocast (CUDA)")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    device = torch.device(args.device)
    config = SearchConfig.model_validate({
        "name": "probe-step", "method": "simclr", "data": {"resolution": args.resolution},
        "model": {"backbone": args.backbone, "width": args.width,
                  "projector_hidden_dim": args.projector_hidden_dim,
                  "projector_dim": args.projector_dim}})
    methods = {}
    for variant in ("plain", "online_probe"):
        torch.manual_seed(0)
        methods[variant] = build_method(config, in_channels=3).to(device)
    rng = np.random.default_rng(0)
    labels = {name: rng.integers(0, classes, args.batch_size) for name, classes in
              ATTRIBUTES.items()}
    probe = OnlineProbe(methods["online_probe"].backbone, labels, ATTRIBUTES, 1e-3, device)
    generator = torch.Generator(device=device).manual_seed(0)
    shape = (args.batch_size, 3, args.resolution, args.resolution)
    views = [torch.randn(shape, generator=generator, device=device) for _ in range(2)]
    batch = Batch(images=views[0], views=views,
                  index=torch.arange(args.batch_size, device=device))
    optimizers = {variant: torch.optim.SGD(method.parameters(), lr=1e-3, momentum=0.9)
                  for variant, method in methods.items()}

    probe_seconds: list[float] = []

    def step(variant: str) -> float:
        method, optimizer = methods[variant], optimizers[variant]
        with_probe = variant == "online_probe"
        if device.type == "cuda":
            torch.cuda.synchronize()
        started = time.perf_counter()
        with torch.autocast(device.type, dtype=torch.float16, enabled=args.amp):
            if with_probe:
                with probe.capturing():
                    loss = method(batch)["loss"]
            else:
                loss = method(batch)["loss"]
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        optimizer.step()
        if with_probe:
            if device.type == "cuda":
                torch.cuda.synchronize()
            probe_started = time.perf_counter()
            probe.step(batch.index)
            if device.type == "cuda":
                torch.cuda.synchronize()
            probe_seconds.append(time.perf_counter() - probe_started)
        if device.type == "cuda":
            torch.cuda.synchronize()
        return time.perf_counter() - started

    for variant in methods:  # warm-up
        for _ in range(3):
            step(variant)
    times: dict[str, list[float]] = {variant: [] for variant in methods}
    for _ in range(args.repeats):
        for variant in methods:
            times[variant].append(statistics.median(step(variant) for _ in range(args.steps)))
    medians = {variant: statistics.median(values) for variant, values in times.items()}
    print(json.dumps({
        "device": str(device), "backbone": args.backbone, "batch_size": args.batch_size,
        "resolution": args.resolution, "amp": args.amp,
        "step_seconds": medians,
        "online_probe_over_plain": medians["online_probe"] / medians["plain"],
        "probe_step_seconds": statistics.median(probe_seconds),
        "probe_step_share": statistics.median(probe_seconds) / medians["plain"]}))


if __name__ == "__main__":
    main()
