"""NN-retrieval accuracy of a method's support set (NNCLR, All4One)."""

from __future__ import annotations

import numpy as np
import torch

from raycl.config.metric_names import MEAN, NN_RETRIEVAL, metric_name
from raycl.data import DatasetSplits
from raycl.data.augment import to_float
from raycl.methods.base import Method


@torch.no_grad()
def neighbour_retrieval_accuracy(
    method: Method,
    data: DatasetSplits,
    splits: tuple[str, ...],
    device: torch.device,
    batch_size: int = 512,
    stage: int | None = None,
) -> dict[str, float]:
    """NN-retrieval accuracy of a method's support set: for every image of each split, does the
    training sample behind its nearest support-set entry share its label?

    Returns ``[stage<j>/]{split}/nn_retrieval/<attribute>`` (and ``/mean``; the prefix for MCL's
    ``stage`` alone) over the queries whose neighbour holds a sample; ``{}`` for a method
    without a support set. The queries are held-out images (the papers measure training
    batches), so the figure is comparable across trials.
    """
    if type(method).neighbour_retrieval is Method.neighbour_retrieval:
        return {}
    was_training = method.training
    method.eval()
    metrics: dict[str, float] = {}
    try:
        for split in splits:
            images = data.split(split).images
            found = np.concatenate([
                method.neighbour_retrieval(
                    to_float(torch.from_numpy(images[i:i + batch_size]).to(device))).cpu().numpy()
                for i in range(0, len(images), batch_size)])
            holds_sample = found >= 0
            if not holds_sample.any():
                continue
            scores = {name: float(np.mean(data.train.labels[name][found[holds_sample]]
                                          == labels[holds_sample]))
                      for name, labels in data.split(split).labels.items()}
            scores[MEAN] = float(np.mean(list(scores.values())))
            metrics.update({metric_name(split, NN_RETRIEVAL, name, stage=stage): value
                            for name, value in scores.items()})
    finally:
        method.train(was_training)
    return metrics
