"""The modules and values an exported encoder is made of: its :class:`Preprocessing`, the
wrappers :class:`MethodEmbedding` and :class:`StageConcat` (and how a concat export names each
stage's tensors: :data:`STAGE_PREFIX`), and reading a trial's config.

The ground floor of :mod:`raycl.export` (both :mod:`raycl.export.encoder` and
:mod:`raycl.export.formats` build on it).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass, field
from typing import TYPE_CHECKING, Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

if TYPE_CHECKING:
    from raycl.config.schema import CoreConfig
    from raycl.methods.base import Method

# raycl's normalisation (raycl.data.augment.to_float): x in [0, 1] -> (x - 0.5) / 0.5.
RAYCL_MEAN, RAYCL_STD = 0.5, 0.5
# How raycl's readers square an image before the encoder sees it (raycl.data.decode).
RAYCL_CROP = "centre square crop, bicubic resize to resolution x resolution"
# How each dataset's reader brings its images to data.resolution (issue 47: the card said
# bicubic for all); each names the function that does it.
_TORCH_RESIZE = ("no crop (the images are square); {mode} resize with antialiasing to resolution"
                 " x resolution: torch.nn.functional.interpolate(images.float(), mode='{mode}', "
                 "align_corners=False, antialias=True), rounded to uint8 ({where})")
_PIL_RESIZE = ("centre square crop, then bicubic resize to resolution x resolution: Pillow "
               "Image.resize(..., Image.Resampling.BICUBIC) on RGB (raycl.data.decode.square_rgb)")
DATASET_RESIZE: dict[str, str] = {
    "trifeature": ("none: generated at resolution x resolution (drawn supersampled, then "
                   "box-filtered down; raycl.data.sources.trifeature)"),
    "mnist_fashion": _TORCH_RESIZE.format(
        mode="bilinear", where="raycl.data.sources.packaged.resize_images, from 28 x 28"),
    "digits": _TORCH_RESIZE.format(
        mode="bilinear", where="raycl.data.sources.packaged.resize_images, from 8 x 8"),
    **{name: _TORCH_RESIZE.format(mode="bicubic",
                                  where=f"raycl.data.sources.shipped.resize_into, from {side}")
       for name, side in (("cifar10", "32 x 32"), ("cifar100", "32 x 32"),
                          ("stl10", "96 x 96"), ("fashion_mnist", "28 x 28"))},
    **{name: _PIL_RESIZE for name in ("folder", "pairs", "imagenet", "imagenet100",
                                      "webdataset", "parquet")},
}
# The floor on a row's norm in the MCL integration (raycl.kmeans.l2_normalize's eps).
_NORM_EPS = 1e-12


@dataclass(frozen=True)
class Preprocessing:
    """How images must be prepared before the exported encoder sees them.

    Attributes:
        resolution: square side in pixels the encoder was trained and evaluated at.
        channels: image channels (3: RGB, 1: greyscale).
        mean: per-channel mean subtracted from images scaled to [0, 1].
        std: per-channel divisor after the mean.
        crop: how the trial's images were made ``resolution`` square (crop and resize;
            :func:`dataset_resize`). Words, not numbers: left out of ``==``.
    """

    resolution: int
    channels: int
    mean: tuple[float, ...]
    std: tuple[float, ...]
    crop: str = field(default=RAYCL_CROP, compare=False)

    def normalise(self, images: Tensor) -> Tensor:
        """uint8 or [0, 1] float images (B, C, H, W) -> what the encoder takes.

        Args:
            images: uint8 (0..255) or float (0..1) batch.

        Returns:
            Float batch with ``mean`` subtracted and divided by ``std``.
        """
        scaled = images.float().div(255.0) if images.dtype == torch.uint8 else images.float()
        mean = torch.tensor(self.mean, device=scaled.device).view(1, -1, 1, 1)
        std = torch.tensor(self.std, device=scaled.device).view(1, -1, 1, 1)
        return (scaled - mean) / std

    def to_dict(self) -> dict[str, Any]:
        """Plain JSON values (for the model card)."""
        return {**asdict(self), "mean": list(self.mean), "std": list(self.std)}

    @classmethod
    def from_dict(cls, raw: dict[str, Any]) -> Preprocessing:
        """The inverse of :meth:`to_dict`."""
        return cls(resolution=int(raw["resolution"]), channels=int(raw["channels"]),
                   mean=tuple(raw["mean"]), std=tuple(raw["std"]),
                   crop=str(raw.get("crop", RAYCL_CROP)))


def dataset_resize(dataset: str) -> str:
    """How raycl's reader of ``data.dataset`` crops and resizes its images (model card)."""
    return DATASET_RESIZE.get(dataset, f"as raycl's {dataset!r} reader resizes its images "
                                       f"(raycl.data.sources)")


def raycl_preprocessing(config: CoreConfig, channels: int) -> Preprocessing:
    """raycl's own preprocessing of the trial's images (mean 0.5, std 0.5 per channel).

    Args:
        config: the trial's config (``data.resolution``, ``data.dataset``).
        channels: image channels of its data.

    Returns:
        The :class:`Preprocessing`.
    """
    return Preprocessing(resolution=config.data.resolution, channels=channels,
                         mean=(RAYCL_MEAN,) * channels, std=(RAYCL_STD,) * channels,
                         crop=dataset_resize(config.data.dataset))


class MethodEmbedding(nn.Module):
    """A method whose ``embed`` is its own (CLIP), as a module: images -> ``method.embed``."""

    def __init__(self, method: Method) -> None:
        super().__init__()
        self.method = method

    def forward(self, images: Tensor) -> Tensor:
        return self.method.embed(images)


class StageConcat(nn.Module):
    """MCL's ``concat`` integration as a module: each stage's features L2-normalised,
    concatenated and normalised again (:func:`raycl.worker.stage_integration.integrate`)."""

    def __init__(self, stages: Sequence[nn.Module]) -> None:
        super().__init__()
        if not stages:
            raise ValueError("StageConcat needs at least one stage encoder")
        self.stages = nn.ModuleList(stages)

    def forward(self, images: Tensor) -> Tensor:
        features = [stage(images) for stage in self.stages]
        if len(features) == 1:  # integrate() leaves a single stage's features as they are
            return features[0]
        joined = torch.cat([F.normalize(f.float(), dim=1, eps=_NORM_EPS) for f in features], 1)
        return F.normalize(joined, dim=1, eps=_NORM_EPS)


def concat_encoder(stages: Sequence[nn.Module]) -> StageConcat:
    """The MCL concat integration of ``stages`` (each an encoder of one stage), in eval mode.

    Args:
        stages: the stages' encoders, in stage order.

    Returns:
        A :class:`StageConcat`.
    """
    return StageConcat(stages).eval()


# The key prefix of stage j's tensors in a concat export's state dict.
STAGE_PREFIX = "stage{}."


def concat_trial(config: CoreConfig) -> bool:
    """Whether ``config``'s trial integrates several MCL stages by concatenation."""
    return config.num_stages > 1 and config.mcl.integration == "concat"


def split_stages(state: Mapping[str, Tensor]) -> list[dict[str, Tensor]]:
    """The inverse of :func:`raycl.export.formats.concat_state`: the stages' state dicts, in
    stage order.

    Raises:
        ValueError: a key without a ``stage<j>.`` prefix, or stages missing in between.
    """
    stages: dict[int, dict[str, Tensor]] = {}
    for key, value in state.items():
        head, _, rest = key.partition(".")
        if not (head.startswith("stage") and head[5:].isdigit() and rest):
            raise ValueError(f"{key!r} is not a concat export's key (stage<j>.<key>)")
        stages.setdefault(int(head[5:]), {})[rest] = value
    if sorted(stages) != list(range(len(stages))):
        raise ValueError(f"a concat export's stages must be 0..N-1, not {sorted(stages)}")
    return [stages[j] for j in range(len(stages))]


def base_method_name(config: CoreConfig) -> str:
    """The method a trial trains (MCL: its base method)."""
    return config.mcl.base if config.method == "mcl" else config.method


def read_config(raw: dict[str, Any]) -> CoreConfig:
    """A trial config from its JSON values (a model card's ``config``)."""
    # The method sections register when raycl.methods is imported: an interpreter that only
    # did `import raycl` has none (issue 47). It imports no Ray.
    import raycl.methods  # noqa: F401
    from raycl.config.search_config import search_config_class

    return search_config_class().model_validate(raw)


__all__ = ["DATASET_RESIZE", "RAYCL_CROP", "STAGE_PREFIX", "MethodEmbedding", "Preprocessing",
           "StageConcat", "base_method_name", "concat_encoder", "concat_trial", "dataset_resize",
           "raycl_preprocessing", "read_config", "split_stages"]
