"""Exporting a ``model.backbone: timm/<name>`` trial's encoder (issue 52, "export back").

The backbone raycl trains is ``timm.create_model(name, pretrained=False, num_classes=0,
in_chans=C, **model.timm_kwargs)`` itself (:mod:`raycl.models.timm_backbones`), so its state dict
needs no key mapping: the ``timm`` format (``torch.save``) and ``safetensors`` hold it as it is,
and it loads with ``strict=True`` into the model those arguments create. An MCL concat trial's
file holds every stage's backbone under ``stage<j>.``, as for the ResNets.

What this module adds is what the model card says of such a file: the timm model name, its
``create_model`` keyword arguments, the channels, the input size and the normalisation the weights
expect (raycl's ``(x - 0.5) / 0.5``, not timm's ImageNet default), the Python lines that create
the model and load the file, and timm's ``pretrained_cfg`` overlay, so that
``timm.data.resolve_data_config(model=model)`` builds the transform raycl fed the weights.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from raycl.models.timm_backbones import RESERVED_KWARGS, timm_name

if TYPE_CHECKING:
    from raycl.config.schema import CoreConfig
    from raycl.export.modules import Preprocessing

# The create_model argument timm reads the data config from; raycl's own entries win over a
# user's overlay in model.timm_kwargs.
OVERLAY_KEY = "pretrained_cfg_overlay"


def timm_kwargs(config: CoreConfig) -> dict[str, Any]:
    """``model.timm_kwargs`` without a ``pretrained_cfg_overlay`` (the export writes its own)."""
    return {key: value for key, value in config.model.timm_kwargs.items() if key != OVERLAY_KEY}


def pretrained_cfg_overlay(config: CoreConfig, preprocessing: Preprocessing) -> dict[str, Any]:
    """timm's ``pretrained_cfg`` entries that make ``resolve_data_config`` describe raycl's
    input: its mean and std, the trial's input size, and no border cropped away (raycl's
    readers bring the whole square image to the resolution; timm's default crops 12.5 %).

    Args:
        config: the trial's config (a user's own overlay in ``model.timm_kwargs`` is kept
            under raycl's entries).
        preprocessing: what the exported weights expect (:func:`~raycl.export.formats
            .export_preprocessing`).

    Returns:
        The overlay, JSON values.
    """
    side = preprocessing.resolution
    own = dict(config.model.timm_kwargs.get(OVERLAY_KEY) or {})
    return {**own, "mean": list(preprocessing.mean), "std": list(preprocessing.std),
            "input_size": [preprocessing.channels, side, side], "crop_pct": 1.0}


def _python(value: Any) -> str:
    """``value`` as Python source: JSON lists as tuples where timm takes sizes and statistics."""
    if isinstance(value, list):
        return repr(tuple(value))
    if isinstance(value, dict):
        return "dict(" + ", ".join(f"{key}={_python(item)}" for key, item in value.items()) + ")"
    return repr(value)


def timm_lines(config: CoreConfig, channels: int, preprocessing: Preprocessing) -> list[str]:
    """Python lines creating the empty timm model an exported state dict loads into, as
    ``model``; the first line is the import.

    Args:
        config: the trial's config (``model.backbone``, ``model.timm_kwargs``).
        channels: image channels (``in_chans``).
        preprocessing: what the weights expect (the ``pretrained_cfg_overlay``).

    Returns:
        The lines.
    """
    arguments = {"pretrained": False, "num_classes": 0, "in_chans": channels,
                 **timm_kwargs(config),
                 OVERLAY_KEY: pretrained_cfg_overlay(config, preprocessing)}
    lines = ["import timm, torch",
             f"model = timm.create_model({timm_name(config.model.backbone)!r},"]
    lines += [f"    {key}={_python(value)}," for key, value in arguments.items()]
    lines[-1] = lines[-1].removesuffix(",") + ")"
    return lines


def timm_how_to_load(config: CoreConfig, export_format: str, file: str, channels: int,
                     preprocessing: Preprocessing) -> str:
    """The model card's lines loading a (single-stage) timm export without raycl, strictly.

    Args:
        config: the trial's config.
        export_format: ``timm`` (torch.save) or ``safetensors``.
        file: the exported file's name.
        channels: image channels.
        preprocessing: what the weights expect.

    Returns:
        The lines.
    """
    lines = timm_lines(config, channels, preprocessing)
    if export_format == "safetensors":
        lines.insert(0, "import safetensors.torch")
        load = f"safetensors.torch.load_file({file!r})"
    else:
        load = f"torch.load({file!r}, weights_only=True)"
    return "\n".join([
        *lines, f"model.load_state_dict({load}, strict=True)", "model.eval()",
        "# images: (B, C, H, W) in [0, 1] at input_size, then (x - mean) / std per channel:",
        "config = timm.data.resolve_data_config(model=model)  # mean, std, input_size as trained",
        "features = model((images - torch.tensor(config['mean']).view(1, -1, 1, 1))",
        "                 / torch.tensor(config['std']).view(1, -1, 1, 1))"])


def timm_card(config: CoreConfig, channels: int, preprocessing: Preprocessing) -> dict[str, Any]:
    """The model card's ``timm`` entry: what creates the network the file loads into, and the
    input it expects.

    Args:
        config: the trial's config.
        channels: image channels.
        preprocessing: what the weights expect.

    Returns:
        JSON values: ``model`` (the timm name), ``kwargs`` (``model.timm_kwargs``),
        ``create_model`` (every keyword argument, raycl's included), ``in_chans``,
        ``input_size``, ``mean``, ``std``, ``normalisation`` and ``resize`` in words, and
        ``pretrained_cfg_overlay``.
    """
    side = preprocessing.resolution
    kwargs = timm_kwargs(config)
    overlay = pretrained_cfg_overlay(config, preprocessing)
    raycl_args = dict(zip(RESERVED_KWARGS, (False, 0, channels), strict=True))
    return {
        "model": timm_name(config.model.backbone),
        "kwargs": kwargs,
        "create_model": {**raycl_args, **kwargs, OVERLAY_KEY: overlay},
        "in_chans": channels,
        "input_size": [channels, side, side],
        "mean": list(preprocessing.mean),
        "std": list(preprocessing.std),
        "normalisation": ("images scaled to [0, 1], then (x - mean) / std per channel "
                          "(raycl.data.augment.to_float)"),
        "resize": preprocessing.crop,
        OVERLAY_KEY: overlay,
    }


__all__ = ["OVERLAY_KEY", "pretrained_cfg_overlay", "timm_card", "timm_how_to_load",
           "timm_kwargs", "timm_lines"]
