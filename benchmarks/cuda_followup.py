"""Two questions the first CUDA run of ``benchmarks/gpu.py`` left open (docs/benchmarks.md):

1. Is raycl's embedding pass (``embed_images``: one ``autocast`` context per batch, in
   ``batch_features``) slower than a bare loop because leaving autocast drops its cache of
   low-precision weight copies, so every batch casts the weights again? Timed: raycl, a bare
   loop with one autocast around all batches, and a bare loop with one autocast per batch;
   every batch shape warmed first.
2. raycl's default epoch against the plain loop with more timed epochs than gpu.py's three.

    python benchmarks/cuda_followup.py --out followup.json [--device cpu --quick]
"""

from __future__ import annotations

import json
import statistics
import sys
from collections.abc import Callable
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

import gpu

from raycl.data.augment import to_float
from raycl.methods import build_method
from raycl.worker.cuda import configure_cuda_backends, prefer_channels_last
from raycl.worker.embed import embed_images
from raycl.worker.optim import inference_autocast


def embedding_variants(args: Any, device: torch.device, repeats: int) -> dict[str, Any]:
    """Images/s of raycl's pass and of the two bare loops, interleaved, after a warm-up of
    each (every batch shape, the last one included)."""
    config = gpu.make_config(args)
    torch.manual_seed(0)
    method = prefer_channels_last(build_method(config, 3).to(device).eval(), device)
    images = np.random.default_rng(0).integers(
        0, 256, (args.embed_images, 3, args.resolution, args.resolution), dtype=np.uint8)
    session = SimpleNamespace(rank=0, world_size=1, device=device)
    autocast = inference_autocast(config, device)

    def outer() -> None:
        with torch.no_grad(), autocast():
            for i in range(0, len(images), 512):
                method.backbone(to_float(torch.from_numpy(images[i:i + 512]).to(device))
                                ).float().cpu()

    def per_batch() -> None:
        for i in range(0, len(images), 512):
            with torch.no_grad(), autocast():
                method.backbone(to_float(torch.from_numpy(images[i:i + 512]).to(device))
                                ).float().cpu()

    variants: dict[str, Callable[[], Any]] = {
        "raycl": lambda: embed_images(method, images, session, autocast=autocast),
        "bare_one_autocast": outer, "bare_autocast_per_batch": per_batch}
    for work in variants.values():
        work()
    out: dict[str, list[float]] = {name: [] for name in variants}
    for _ in range(repeats):
        for name, work in variants.items():
            out[name].append(len(images) / gpu.timed(device, work))
    return {"images": len(images), **out,
            "median": {name: statistics.median(v) for name, v in out.items()}}


def main() -> None:
    args = gpu.parse_args(sys.argv[1:])  # gpu.py's flags (--device, --quick, --out)
    args.epochs = 2 if args.quick else 10
    device = torch.device(args.device)
    configure_cuda_backends(device)
    report = {"device_name": torch.cuda.get_device_name(device) if device.type == "cuda"
              else "cpu", "torch": torch.__version__,
              "embedding": embedding_variants(args, device, 2 if args.quick else 7)}
    print(json.dumps(report["embedding"]["median"]), flush=True)
    default = gpu.run_variants(args, device, [("default", gpu.resolve_amp("auto", device),
                                                device.type == "cuda", False)])[0]
    report["default_training"] = default
    if "ratio" in default:
        default["ratio_median"] = statistics.median(default["ratio"])
        default["ratio_of_medians"] = (statistics.median(default["raycl_img_per_s"])
                                       / statistics.median(default["plain_img_per_s"]))
    print(json.dumps(report, default=str), flush=True)
    Path(args.out).write_text(json.dumps(report, indent=2, default=str))


if __name__ == "__main__":
    main()
