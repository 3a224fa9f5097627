"""Whether rank 0's scoring leaves the cluster idle: a warning before launch, never an error.

Each evaluation embeds its rows on every rank, then rank 0 alone scores them (the closed-form
probe over the probe's training rows, kNN and retrieval over val) while the other ranks wait.
Uncapped at ImageNet scale that is 1.5–3 minutes per evaluation against a 15–25 s epoch on 64
GPUs (issue 46): most of the cluster's time idles. The estimate here compares rows: one row
scored on rank 0 costs about :data:`SCORED_ROW_COST` of one image trained on one GPU (that
issue's figures: ~1.3 M rows scored in ~2 min, ~1 000 images a second trained per GPU), and
an evaluation interval trains ``every_n_epochs x train / workers`` images per worker. Below
:data:`SCORED_ROWS_FLOOR` rows rank 0 scores in seconds and nothing is said.
"""

from __future__ import annotations

from collections.abc import Mapping

from raycl.config.schema import CoreConfig

# One row scored by rank 0 (probe, kNN, retrieval), in images trained on one GPU.
SCORED_ROW_COST = 0.1
# Warn when rank 0's scoring is estimated above this share of the training between evaluations.
IDLE_SHARE = 0.25
# Rows scored per evaluation below which rank 0's share is seconds, whatever the ratio.
SCORED_ROWS_FLOOR = 50_000


def scored_rows(config: CoreConfig, sizes: Mapping[str, int]) -> int:
    """Rows rank 0 scores at an intermediate evaluation: the probe's training rows
    (``eval.max_train_samples``) and val's (``eval.max_eval_samples``)."""
    evaluation = config.eval
    train, val = sizes.get("train", 0), sizes.get("val", 0)
    if evaluation.max_train_samples is not None:
        train = min(train, evaluation.max_train_samples)
    if evaluation.max_eval_samples is not None:
        val = min(val, evaluation.max_eval_samples)
    return train + val


def evaluation_idle_warning(config: CoreConfig, sizes: Mapping[str, int]) -> str | None:
    """The warning where rank 0's scoring of each evaluation is estimated to take more than
    :data:`IDLE_SHARE` of the training between two evaluations (``sizes``: the dataset's
    train/val/test rows, :func:`raycl.data.load.split_sizes_for`), or None. Only evaluations
    inside a stage count: ``eval.every_n_epochs: 0`` evaluates at each stage's end alone."""
    every = config.eval.every_n_epochs
    workers = config.scaling.num_workers
    train = sizes.get("train", 0)
    rows = scored_rows(config, sizes)
    if every == 0 or train == 0 or rows < SCORED_ROWS_FLOOR:
        return None
    share = rows * SCORED_ROW_COST / (every * train / workers)
    if share <= IDLE_SHARE:
        return None
    return (f"eval: each evaluation (every {every} epoch(s)) has rank 0 alone score {rows:,} "
            f"rows while the other {workers - 1} worker(s) wait: about {share:.0%} of the "
            f"training between two evaluations (an estimate; {train:,} training images over "
            f"{workers} worker(s)). Cap what it reads (eval.max_train_samples, "
            f"eval.max_eval_samples: 10000 is plenty to compare trials) or evaluate less often "
            f"(eval.every_n_epochs)")


__all__ = ["IDLE_SHARE", "SCORED_ROWS_FLOOR", "SCORED_ROW_COST", "evaluation_idle_warning",
           "scored_rows"]
