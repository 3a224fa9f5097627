"""The papers' linear evaluation (``eval.linear_sgd``) of a finished trial's checkpoint, without
Ray: the core (:func:`raycl.eval.linear_sgd.evaluate_linear_sgd`) as an "evaluate a checkpoint"
command calls it, one settings variant per argument, in one process on the CPU.

The trial's search file rebuilds the method and the data (the searched values do not change the
architecture); the checkpoint gives the weights. One line per variant on stdout: its settings,
seconds, ``val/linear_sgd/...`` and the learning rate each attribute kept, the test mean, and
every rate's validation scores.

    .venv/bin/python benchmarks/linear_sgd_checkpoint.py searches/quickstart.yaml \\
        RUN_DIR/checkpoint_000007 '{"epochs": 30, "lrs": [10.0, 1.0, 0.1], "augment": false}'
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch

from raycl.config.evaluation import LinearSGDConfig
from raycl.data import DatasetSplits, load_dataset
from raycl.eval.linear_sgd import (
    FrozenEncoder,
    LabelledImages,
    evaluate_linear_sgd,
    linear_sgd_metrics,
)
from raycl.launch.load import load_search
from raycl.methods import build_method
from raycl.worker.checkpoints import read_checkpoint


def labelled(data: DatasetSplits, split: str) -> LabelledImages:
    """A split as the protocol reads it."""
    part = data.split(split)
    return LabelledImages(part.images, part.labels)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("search", type=Path, help="the trial's search file")
    parser.add_argument("checkpoint", type=Path, help="a checkpoint directory of the trial")
    parser.add_argument("variants", nargs="+", help="eval.linear_sgd settings, JSON each")
    args = parser.parse_args()
    config = load_search(args.search, [])
    data = load_dataset(config.data, config.seed)
    method = build_method(config, data.channels)
    method.load_state_dict(read_checkpoint(args.checkpoint).state["model"])
    encoder = FrozenEncoder(model=method, embed=method.embed)
    num_classes = {attribute: data.num_classes[attribute] for attribute in data.attributes}
    for variant in args.variants:
        settings = LinearSGDConfig.model_validate_json(variant)
        started = time.perf_counter()
        results = evaluate_linear_sgd(
            encoder, labelled(data, "train"), labelled(data, "val"),
            lambda: labelled(data, "test"), num_classes, settings, torch.device("cpu"),
            config.seed)
        metrics = linear_sgd_metrics(results)
        print(json.dumps({
            "settings": json.loads(variant), "seconds": round(time.perf_counter() - started),
            **{key: round(value, 4) for key, value in metrics.items()
               if key.startswith(("val/", "diag/")) or key == "test/linear_sgd/mean"},
            "val_by_lr": {str(lr): scores for lr, scores in results[None].val_by_lr.items()},
        }))


if __name__ == "__main__":
    main()
