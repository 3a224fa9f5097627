"""End-of-trial principal-angle diagnostics at scale (issue 46, finding 2).

Times :func:`raycl.eval.subspaces.class_principal_angles` on synthetic class-structured
features, capped (the default: 64 classes) and uncapped, and with ``--reference`` the per-class
SVD it replaced (kept in tests/test_subspaces.py as the agreement test's reference), with the
largest angle difference between the two.

    .venv/bin/python benchmarks/diagnostics_scale.py --rows 10000 --dim 256 --classes 100 \
        --reference
    .venv/bin/python benchmarks/diagnostics_scale.py --rows 20000 --dim 2048 --classes 1000
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import numpy as np
import torch

from raycl.eval.subspaces import class_principal_angles


def _features(rows: int, dim: int, classes: int, seed: int) -> tuple[np.ndarray, np.ndarray]:
    """Class centres plus a 64-dimensional shared low-rank part and weak isotropic noise."""
    rng = np.random.default_rng(seed)
    labels = np.repeat(np.arange(classes), rows // classes)
    low_rank = rng.standard_normal((labels.size, 64)) @ rng.standard_normal((64, dim))
    features = low_rank + 0.1 * rng.standard_normal((labels.size, dim))
    return (features + rng.standard_normal((classes, dim))[labels]).astype(np.float32), labels


def _timed(function, *args, **kwargs) -> tuple[dict[int, np.ndarray], float]:
    started = time.perf_counter()
    result = function(*args, **kwargs)
    return result, time.perf_counter() - started


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, default=10000)
    parser.add_argument("--dim", type=int, default=256)
    parser.add_argument("--classes", type=int, default=100)
    parser.add_argument("--reference", action="store_true",
                        help="also time the per-class SVD (O(classes N D^2): small sizes only)")
    parser.add_argument("--device", default=None, help="e.g. cuda (default: the CPU)")
    args = parser.parse_args()
    features, labels = _features(args.rows, args.dim, args.classes, seed=0)
    capped, capped_s = _timed(class_principal_angles, features, labels, device=args.device)
    line = (f"rows={labels.size} dim={args.dim} classes={args.classes} "
            f"threads={torch.get_num_threads()}: capped ({len(capped)} classes) {capped_s:.1f} s")
    if args.reference:
        uncapped, uncapped_s = _timed(class_principal_angles, features, labels,
                                      max_classes=None, device=args.device)
        sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
        from test_subspaces import _reference_class_angles

        reference, reference_s = _timed(_reference_class_angles,
                                        features.astype(np.float64), labels)
        difference = max(float(np.abs(uncapped[c] - reference[c]).max()) for c in reference)
        line += (f", every class {uncapped_s:.1f} s, per-class SVD {reference_s:.1f} s "
                 f"({reference_s / uncapped_s:.1f}x), largest angle difference "
                 f"{difference:.1e} degrees")
    print(line)


if __name__ == "__main__":
    main()
