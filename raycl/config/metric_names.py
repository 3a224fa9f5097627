"""Metric names, the one contract between the worker that reports them and everything that reads
them: Optuna and ASHA (``tune.metric``), the checks before launch, MLflow and the leaderboard.

A name is ``[stage<j>/]<split>/<family>/<name>``:

- ``val/linear/shape``, ``test/knn/mean``, ``val/linear_50pct/mean`` (a probe fit on 50 % of
  the training labels), ``test/linear_sgd/mean`` and ``val/linear_sgd_50pct/shape`` (the
  papers' SGD linear evaluation at a trial's end), ``val/retrieval/rank1``,
  ``val/nn_retrieval/mean``, ``val/label_free/rankme`` (no labels), ``val/mmvp/mean``,
  ``val/zeroshot/colour``, ``val/i2t/r1``: a split (``val``, ``test``) scored by a family;
- ``transfer/<set>/linear/<attribute>``: a transfer set's held-out share, probed (and
  ``transfer/<set>/knn/...``, ``.../retrieval/...``, ``.../linear_50pct/...`` from
  ``python -m raycl.evaluate``);
- ``train/loss``, ``perf/eval_seconds``, ``data/skipped``, ``diag/effective_rank``,
  ``mcl/ami/stage0_stage1``: figures that score no split (a group, an optional family, a name);
- ``stage<j>/...``: MCL's stage ``j`` alone; the integrated representation has no prefix.

:class:`MetricName` builds (:meth:`~MetricName.format`) and reads (:meth:`~MetricName.parse`)
them; the names are exactly those of earlier sweeps (MLflow histories and stored sweeps name
them). Imports nothing else of raycl: the schema validates ``tune.metric`` with it.

Example:
    >>> metric_name(VAL, LINEAR, "mean", stage=1)
    'stage1/val/linear/mean'
    >>> parse_metric("val/linear_50pct/shape").percent
    '50'
"""

from __future__ import annotations

import dataclasses
import re
from dataclasses import dataclass

# Splits a family scores (what a sweep selects on, and what it reports once per trial).
VAL = "val"
TEST = "test"
SCORED_SPLITS: tuple[str, ...] = (VAL, TEST)
# A transfer set's held-out share: ``transfer/<set>/<family>/<name>``.
TRANSFER = "transfer"
# Figures that score no split: ``<group>/[<family>/]<name>``.
TRAIN = "train"
PERF = "perf"
DATA = "data"
DIAG = "diag"
MCL = "mcl"
GROUPS: tuple[str, ...] = (TRAIN, PERF, DATA, DIAG, MCL)

# Families: how a split is scored.
LINEAR = "linear"  # linear probe per attribute (and ``linear_<percent>pct``: fewer labels)
KNN = "knn"  # k-nearest-neighbour classifier per attribute
RETRIEVAL = "retrieval"  # image retrieval within the split: rank1, rank5, map
NN_RETRIEVAL = "nn_retrieval"  # a support set's nearest neighbour shares the label (NNCLR)
MMVP = "mmvp"  # MMVP-style image-text pairs per attribute
ZEROSHOT = "zeroshot"  # zero-shot classification from class prompts
I2T = "i2t"  # caption retrieval, image to text: r1, r5, r10
T2I = "t2i"  # caption retrieval, text to image
# The papers' linear evaluation: an SGD-trained head on the frozen backbone per attribute (and
# ``linear_sgd_<percent>pct``), its learning rate chosen on val (eval.linear_sgd).
LINEAR_SGD = "linear_sgd"
# Figures of the features alone, no labels (raycl.eval.label_free): rankme, alpha, std.
LABEL_FREE = "label_free"
# The online probe's heads, trained beside the method (eval.online_probe): per attribute, also
# ``train/online_linear/<attribute>`` (the epoch's running accuracy).
ONLINE_LINEAR = "online_linear"
FAMILIES: tuple[str, ...] = (LINEAR, KNN, RETRIEVAL, NN_RETRIEVAL, MMVP, ZEROSHOT, I2T, T2I,
                             LINEAR_SGD, LABEL_FREE, ONLINE_LINEAR)
# Families that classify by the labels: a dataset without attributes has none of them.
LABEL_FAMILIES: tuple[str, ...] = (LINEAR, KNN, RETRIEVAL, NN_RETRIEVAL, ZEROSHOT, LINEAR_SGD,
                                   ONLINE_LINEAR)
# Families with label-fraction variants (``<family>_<percent>pct``).
FRACTION_FAMILIES: tuple[str, ...] = (LINEAR, LINEAR_SGD)
# raycl.evaluate scores a set by every label family (kNN, retrieval, the SGD protocol) too.
TRANSFER_FAMILIES: tuple[str, ...] = (LINEAR, KNN, RETRIEVAL, LINEAR_SGD)
# The mean over a family's attributes: ``val/linear/mean``.
MEAN = "mean"
# The sweep's backbone at initialisation, scored once by the trials' val probes (eval.baseline;
# on the parent run, raycl.sweep.baseline): a name behind this prefix (``baseline/val/linear/
# mean``); no objective, no column: the leaderboard's "at init" row.
BASELINE_PREFIX = "baseline/"

_STAGE = re.compile(r"stage(0|[1-9]\d*)")
_FRACTION_PROBE = re.compile(r"(linear(?:_sgd)?)_(\d+(?:\.\d+)?(?:e-\d+)?)pct")
_SCORE = re.compile(r"\w+")  # an attribute (shape, colour) or a score (rank1, map, r5)
_PART = re.compile(r"[^/\s]+")  # a transfer set's name; a train/perf/... figure's name


class MetricNameError(ValueError):
    """A string that is no metric raycl reports; the message says which part is wrong."""


@dataclass(frozen=True)
class MetricName:
    """One metric name, parts typed: :meth:`format` writes it, :meth:`parse` reads it back.

    Attributes:
        split: the split scored (``val``, ``test``, ``transfer``) or, for a figure that scores
            none, its group (``train``, ``perf``, ``data``, ``diag``, ``mcl``).
        family: how the split was scored (:data:`FAMILIES`); for a group an optional middle
            part (``mcl/ami/...``), else None.
        name: the attribute (``shape``, ``mean``) or score (``rank1``, ``r5``, ``loss``).
        stage: MCL's stage ``j`` alone (``stage<j>/``), None for the trial's representation.
        percent: a label-fraction probe's share as its name writes it (``"50"`` in
            ``linear_50pct``; :func:`fraction_percent`); families ``linear`` and
            ``linear_sgd`` only (:data:`FRACTION_FAMILIES`).
        transfer: the transfer set's name (split ``transfer`` only).

    Raises:
        MetricNameError: parts that no name of raycl's combines.
    """

    split: str
    family: str | None
    name: str
    stage: int | None = None
    percent: str | None = None
    transfer: str | None = None

    def __post_init__(self) -> None:
        problem = self._problem()
        if problem:
            raise MetricNameError(f"not a metric name: {problem}")

    def _problem(self) -> str | None:
        """Why these parts make no metric name (None when they do)."""
        if self.stage is not None and (type(self.stage) is not int or self.stage < 0):
            return f"stage must be an integer >= 0, got {self.stage!r}"
        if self.percent is not None and (self.family not in FRACTION_FAMILIES
                                         or self.split not in (*SCORED_SPLITS, TRANSFER)
                                         or not _FRACTION_PROBE.fullmatch(
                                             f"{self.family}_{self.percent}pct")):
            return (f"a label-fraction percent ({self.percent!r}) goes with families "
                    f"{', '.join(FRACTION_FAMILIES)} of {VAL!r} or {TEST!r} only, as digits "
                    f"(50, 12.5)")
        if (self.transfer is None) != (self.split != TRANSFER):
            return f"a transfer set's name goes with split {TRANSFER!r}, and only there"
        if self.split in SCORED_SPLITS or self.split == TRANSFER:
            families = FAMILIES if self.split in SCORED_SPLITS else TRANSFER_FAMILIES
            if self.family not in families:
                return (f"{self.split} is scored by {', '.join(families)}, not "
                        f"{self.family!r}")
            if self.transfer is not None and not _PART.fullmatch(self.transfer):
                return f"transfer set {self.transfer!r} must be one path part"
            if not _SCORE.fullmatch(self.name):
                return f"{self.name!r} is no attribute or score (letters, digits, _)"
            return None
        if self.split not in GROUPS:
            return (f"{self.split!r} is no split ({', '.join((*SCORED_SPLITS, TRANSFER))}) or "
                    f"group ({', '.join(GROUPS)})")
        if self.family is not None and not _PART.fullmatch(self.family):
            return f"{self.family!r} must be one path part"
        if not _PART.fullmatch(self.name):
            return f"{self.name!r} must be one non-empty path part"
        return None

    def format(self) -> str:
        """The name as reported: ``stage1/val/linear_50pct/mean``, ``transfer/digits/linear/
        mean``, ``train/loss``."""
        family = f"{self.family}_{self.percent}pct" if self.percent is not None else self.family
        parts = [self.split, self.transfer, family, self.name]
        if self.stage is not None:
            parts.insert(0, f"stage{self.stage}")
        return "/".join(part for part in parts if part is not None)

    def __str__(self) -> str:
        return self.format()

    def replace(self, **changes: object) -> MetricName:
        """A copy with some parts changed (validated again): ``name.replace(split=TEST)``."""
        return dataclasses.replace(self, **changes)  # type: ignore[arg-type]

    @classmethod
    def parse(cls, text: str) -> MetricName:
        """The parts of a reported name; ``MetricName.parse(text).format() == text``.

        Raises:
            MetricNameError: ``text`` is no metric name raycl reports (the message says why).
        """
        stage, rest = split_stage(text) if isinstance(text, str) else (None, "")
        parts = rest.split("/")
        head = parts[0] if parts else ""
        shapes = {TRANSFER: (4,), **dict.fromkeys(SCORED_SPLITS, (3,))}
        if len(parts) not in shapes.get(head, (2, 3)):
            expected = ("transfer/<set>/<family>/<name>" if head == TRANSFER
                        else f"{head}/<family>/<name>" if head in SCORED_SPLITS
                        else "<split>/<family>/<name> or <group>/<name>")
            raise MetricNameError(f"{text!r} is not a metric name: expected "
                                  f"[stage<j>/]{expected}")
        transfer = parts.pop(1) if head == TRANSFER else None
        family, percent = (parts[1] if len(parts) == 3 else None), None
        if head in SCORED_SPLITS and family and (match := _FRACTION_PROBE.fullmatch(family)):
            family, percent = match.group(1), match.group(2)
        try:
            parsed = cls(head, family, parts[-1], stage, percent, transfer)
        except MetricNameError as exc:
            raise MetricNameError(f"{text!r} is {exc}") from None
        if parsed.format() != text:  # e.g. an empty part: no name is written so
            raise MetricNameError(f"{text!r} is not a metric name (read as {parsed.format()!r})")
        return parsed


def metric_name(
    split: str,
    family: str | None,
    name: str,
    *,
    stage: int | None = None,
    percent: str | None = None,
    transfer: str | None = None,
) -> str:
    """The reported name of these parts (:class:`MetricName`): ``metric_name(VAL, LINEAR,
    "mean")`` is ``"val/linear/mean"``, ``metric_name(TRAIN, None, "loss")`` ``"train/loss"``.

    Raises:
        MetricNameError: parts that no name of raycl's combines.
    """
    return MetricName(split, family, name, stage, percent, transfer).format()


def parse_metric(text: str) -> MetricName:
    """:meth:`MetricName.parse`: the parts of a reported name, or :class:`MetricNameError`."""
    return MetricName.parse(text)


def maybe_metric(text: str) -> MetricName | None:
    """The parts of ``text``, or None when it is no metric name (MLflow holds others too:
    ``objective``, ``best/...``)."""
    try:
        return MetricName.parse(text)
    except MetricNameError:
        return None


def baseline_metric(text: str) -> str:
    """``text`` as the random-init baseline reports it: ``val/linear/mean`` ->
    ``baseline/val/linear/mean``.

    Raises:
        MetricNameError: ``text`` is no metric name (:func:`parse_metric`).
    """
    return BASELINE_PREFIX + MetricName.parse(text).format()


def split_stage(text: str) -> tuple[int | None, str]:
    """MCL's stage prefix apart: ``stage1/val/linear/mean`` -> ``(1, "val/linear/mean")``;
    ``(None, text)`` without one (the rest is not checked: see :func:`parse_metric`)."""
    head, _, rest = text.partition("/")
    match = _STAGE.fullmatch(head) if rest else None
    return (int(match.group(1)), rest) if match else (None, text)


def staged(text: str, stage: int) -> str:
    """``text`` as MCL's stage ``stage`` alone reports it: ``train/loss`` ->
    ``stage1/train/loss``."""
    return MetricName.parse(text).replace(stage=stage).format()


def fraction_percent(fraction: float) -> str:
    """A label fraction as its metric names write it: 0.5 -> ``"50"`` (``linear_50pct``).

    Args:
        fraction: share of the training labels, in (0, 1).

    Returns:
        ``100 × fraction`` to 6 significant digits, without trailing zeros ("12.5", "20").
    """
    return f"{100 * fraction:g}"


__all__ = ["BASELINE_PREFIX", "DATA", "DIAG", "FAMILIES", "FRACTION_FAMILIES", "GROUPS", "I2T",
           "KNN", "LABEL_FAMILIES", "LABEL_FREE", "LINEAR", "LINEAR_SGD", "MCL",
           "MEAN", "MMVP", "NN_RETRIEVAL", "PERF", "RETRIEVAL", "SCORED_SPLITS", "T2I", "TEST",
           "TRAIN", "TRANSFER", "TRANSFER_FAMILIES", "VAL", "ZEROSHOT", "MetricName",
           "MetricNameError", "baseline_metric", "fraction_percent", "maybe_metric",
           "metric_name", "parse_metric", "split_stage", "staged"]
