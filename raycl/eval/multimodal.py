"""Image-text evaluation of a multimodal method at every evaluation of the loop.

For each scored split (``val``; ``test`` after a stage's last epoch), with the image features
the loop embedded (one stage's, or the stages' integration) and text features from the method's
text tower:

- ``{split}/mmvp/<attribute>`` and ``/mean``: MMVP-style pairs (:mod:`raycl.eval.mmvp`), whose
  images the loop embeds as the pseudo-splits ``mmvp:val`` / ``mmvp:test``;
- ``{split}/zeroshot/<attribute>`` and ``/mean``: zero-shot classification of the Trifeature
  attributes with one prompt per class ("a red object");
- ``{split}/i2t/r1|r5|r10`` and ``{split}/t2i/...``: caption retrieval among the split's images
  and captions (hits by caption text, so repeated template captions count as the same text).

Concatenated stage features are scored by the mean of the stages' cosines
(:func:`raycl.eval.image_text.image_text_similarity`): the frozen text tower is the same in
every stage.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import numpy as np
import torch

from raycl.config.metric_names import MMVP, ZEROSHOT, metric_name
from raycl.data.sources.captions import WORDS, class_prompts
from raycl.data.stream.shard_captions import present_captions
from raycl.eval.image_text import (
    caption_recall,
    image_text_similarity,
    mmvp_scores,
    zero_shot_accuracy,
)
from raycl.eval.mmvp import MMVPSet, load_mmvp_vlm, synthetic_mmvp

if TYPE_CHECKING:
    from raycl.config.schema import CoreConfig
    from raycl.data import DatasetSplits
    from raycl.eval.transfer import TransferSet
    from raycl.methods.base import Method

# Seeds of the synthetic MMVP sets, offset from the trial seed: val and test pairs differ.
MMVP_VAL_SEED, MMVP_TEST_SEED = 104_729, 130_363


@dataclass
class EvalSets:
    """Evaluation data beside the dataset's splits, loaded once per trial.

    Attributes:
        transfer: labelled transfer sets (linear probes after each stage).
        mmvp: split ("val", "test") -> MMVP-style pair set.
    """

    transfer: list[TransferSet] = field(default_factory=list)
    mmvp: dict[str, MMVPSet] = field(default_factory=dict)


def load_mmvp_sets(config: CoreConfig) -> dict[str, MMVPSet]:
    """The MMVP pair sets ``eval.mmvp`` names: synthetic val and test sets at the data's
    resolution, or the real MMVP-VLM benchmark as the test set; none when it is off."""
    source = config.eval.mmvp
    if source is None:
        return {}
    resolution = config.data.resolution
    if source == "synthetic":
        pairs = config.eval.mmvp_pairs
        return {"val": synthetic_mmvp(pairs, resolution, config.data_seed + MMVP_VAL_SEED),
                "test": synthetic_mmvp(pairs, resolution, config.data_seed + MMVP_TEST_SEED)}
    return {"test": load_mmvp_vlm(source, resolution)}


@torch.no_grad()
def embed_texts(method: Method, texts: Sequence[str], device: torch.device,
                batch_size: int = 512) -> np.ndarray:
    """L2-normalised text features of ``texts`` from ``method``'s text tower (eval mode)."""
    was_training = method.training
    method.eval()
    try:
        tokens = method.tokenize(list(texts))
        chunks = [method.embed_texts(tokens[i:i + batch_size].to(device)).float().cpu()
                  for i in range(0, len(tokens), batch_size)]
    finally:
        method.train(was_training)
    return torch.cat(chunks).numpy()


def image_text_metrics(
    method: Method,
    data: DatasetSplits,
    features: dict[str, np.ndarray],
    mmvp: dict[str, MMVPSet],
    stage: int | None,
    device: torch.device,
    mmvp_direction: str = "text_to_image",
) -> dict[str, float]:
    """MMVP-style, zero-shot and caption-retrieval scores of every scored split in
    ``features`` (see the module docstring), named with MCL's ``stage<j>/`` when ``stage`` is
    one stage alone (:func:`raycl.config.metric_names.metric_name`)."""
    metrics: dict[str, float] = {}
    texts: dict[str, np.ndarray] = {}

    def text_features(strings: Sequence[str]) -> np.ndarray:
        # Each distinct string is embedded once per evaluation.
        missing = sorted({s for s in strings if s not in texts})
        if missing:
            texts.update(zip(missing, embed_texts(method, missing, device), strict=True))
        return np.stack([texts[s] for s in strings])

    for split in ("val", "test"):
        if split not in features:
            continue
        images = features[split]
        pairs = mmvp.get(split)
        if pairs is not None and f"mmvp:{split}" in features:
            similarity = image_text_similarity(features[f"mmvp:{split}"],
                                               text_features(list(pairs.statements)))
            metrics.update({metric_name(split, MMVP, name, stage=stage): value
                            for name, value in mmvp_scores(similarity, pairs.patterns,
                                                              mmvp_direction).items()})
        labels = data.split(split).labels
        prompted = [name for name in data.attributes if name in WORDS]
        if prompted:
            prompts = {name: text_features(class_prompts(name)) for name in prompted}
            scores = zero_shot_accuracy(images, {name: labels[name] for name in prompted},
                                        prompts)
            metrics.update({metric_name(split, ZEROSHOT, name, stage=stage): value
                            for name, value in scores.items()})
        # Held-out shards' captions are read here, by the scoring rank, on first use.
        captions = present_captions(data.split(split).captions)
        if captions is not None:
            recall = caption_recall(images, list(captions), text_features(list(captions)))
            for name, value in recall.items():
                direction, k = name.split("_")  # i2t_r1: family i2t, score r1
                metrics[metric_name(split, direction, k, stage=stage)] = value
    return metrics
