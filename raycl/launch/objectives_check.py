"""Pre-launch checks of what a sweep selects on: ``tune.metric`` (:func:`check_metric`) and a
multi-objective sweep's ``tune.objectives`` (:func:`check_objectives`).

Each objective is checked as ``tune.metric`` is (:func:`check_metric`, and
:func:`raycl.launch.linear_sgd_check.check_linear_sgd` for a linear-SGD metric), its problems
named ``tune.objectives.<i>.metric``. A cost objective must be a ``perf/`` figure every epoch
reports: the others (``perf/kmeans_seconds``, ...) are reported once or now and then.
"""

from __future__ import annotations

from collections.abc import Iterator

from raycl.config.metric_names import (
    I2T,
    KNN,
    LABEL_FAMILIES,
    LABEL_FREE,
    LINEAR,
    LINEAR_SGD,
    MEAN,
    MMVP,
    ONLINE_LINEAR,
    PERF,
    T2I,
    VAL,
    ZEROSHOT,
    maybe_metric,
)
from raycl.config.schema import CoreConfig, Problem

# Families only an image-text method reports.
IMAGE_TEXT_FAMILIES: tuple[str, ...] = (I2T, T2I, ZEROSHOT, MMVP)
# The perf/ figures every epoch's report carries (raycl.worker.stage); the others come once.
EVERY_EPOCH_PERF: tuple[str, ...] = ("perf/device_hours", "perf/peak_rss_mb")


def selecting_on(config: CoreConfig, metric: str) -> CoreConfig:
    """``config`` as if it selected on ``metric`` alone (``tune.metric``), unvalidated: what
    the single-metric checks read."""
    tune = config.tune.model_copy(update={"metric": metric, "objectives": None})
    return config.model_copy(update={"tune": tune})


def check_objectives(config: CoreConfig) -> Iterator[Problem]:
    """Every objective names a metric this sweep's trials report (an attribute the dataset has,
    a linear-SGD metric with ``eval.linear_sgd`` set, a per-epoch ``perf/`` figure)."""
    from raycl.launch.linear_sgd_check import check_linear_sgd
    from raycl.launch.online_probe_check import check_online_probe

    for index, objective in enumerate(config.tune.objectives or []):
        key = f"tune.objectives.{index}.metric"
        name = maybe_metric(objective.metric)
        if name is not None and name.split == PERF and objective.metric not in EVERY_EPOCH_PERF:
            yield Problem(key, f"{objective.metric} is not reported every epoch; a cost "
                               f"objective is one of {', '.join(EVERY_EPOCH_PERF)}")
            continue
        single = selecting_on(config, objective.metric)
        for problem in (*check_metric(single), *check_linear_sgd(single),
                        *check_online_probe(single)):
            if problem.key == "tune.metric":
                yield Problem(key, problem.why)
                break


def trains_image_text(config: CoreConfig) -> bool:
    """Whether the (base) method a trial trains is an image-text one (CLIP)."""
    from raycl.methods import METHODS

    trained = config.mcl.base if config.method == "mcl" else config.method
    method = METHODS.get(trained)
    return method is None or method.multimodal  # an unknown method is named elsewhere


def unlabelled_data_name(config: CoreConfig) -> str:
    """What unlabelled data is called in a message: the dataset, or the root whose content
    says it has no labels (a folder without class folders)."""
    from raycl.data.registry import SOURCES

    source = SOURCES.get(config.data.dataset)
    if source is not None and source.labels_from_root:
        return f"data.root {config.data.root} (images without class folders)"
    return config.data.dataset


def check_metric(config: CoreConfig) -> Iterator[Problem]:
    """A probe metric must name an attribute the dataset has."""
    from raycl.data import attributes_of

    dataset, metric = config.data.dataset, config.tune.metric
    if config.tune.objectives:  # each checked by check_objectives, under its own key
        return
    name = maybe_metric(metric)  # the schema let only reported names through
    if name is None or name.split != VAL:
        return
    known = attributes_of(config.data)
    if name.family in (LINEAR, KNN, LINEAR_SGD, ONLINE_LINEAR) and known \
            and name.name not in (*known, MEAN):
        yield Problem("tune.metric", f"{dataset} has no attribute {name.name!r} "
                                     f"(attributes: {', '.join(known)}, or mean)")
    if known == () and name.family in LABEL_FAMILIES:
        yield Problem("tune.metric", f"{unlabelled_data_name(config)} has no labels to probe or "
                                     f"classify; select on "
                                     f"a label-free figure (val/label_free/rankme), caption "
                                     f"retrieval (val/i2t/r1, val/t2i/r1) or val/mmvp/mean "
                                     f"with eval.mmvp: synthetic")
    if name.family in IMAGE_TEXT_FAMILIES and not trains_image_text(config):
        yield Problem("tune.metric", f"{metric} is reported by an image-text method only "
                                     f"(method: clip, or mcl.base: clip)")
    if name.family == LABEL_FREE and not config.eval.label_free:
        yield Problem("tune.metric", f"{metric} needs eval.label_free: true")
    if name.family == MMVP and config.eval.mmvp != "synthetic":
        yield Problem("tune.metric", f"{metric} needs validation pairs: eval.mmvp: synthetic (a "
                                     f"real MMVP-VLM directory is a test set)")


def check_collapse(config: CoreConfig) -> Iterator[Problem]:
    """``tune.collapse`` judges the label-free figures: they must be computed, at evaluations
    a trial reaches."""
    if config.tune.collapse is not None and not config.eval.label_free:
        yield Problem("tune.collapse", "judges the label-free figures: needs eval.label_free: "
                                       "true")


__all__ = ["EVERY_EPOCH_PERF", "check_collapse", "check_metric", "check_objectives",
           "selecting_on", "trains_image_text", "unlabelled_data_name"]
