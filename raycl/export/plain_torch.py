"""What plain torch needs of an exported encoder (issue 47): the Python lines that rebuild its
network (a ResNet from torchvision / timm, raycl's small CNN from ``torch.nn`` alone) and what
the model card says of small_cnn's architecture, and a ``torch.export`` program as an ordinary
``nn.Module``.

:func:`plain_module` exists because ``ExportedProgram.module()`` returns a module whose
``train()`` and ``eval()`` raise ``NotImplementedError``, and whose guard submodule does not
pickle: MLflow's ``load_model`` of a pt2 model hands users exactly that module.
"""

from __future__ import annotations

import copy
from typing import TYPE_CHECKING, Any

import torch
from torch import Tensor, nn

if TYPE_CHECKING:
    from torch.export import ExportedProgram

    from raycl.export.modules import Preprocessing


def export_program(module: nn.Module, example: Tensor) -> ExportedProgram:
    """``module`` (put in eval mode) as a ``torch.export`` program with a dynamic batch
    dimension (``example``: a batch of at least 2, so the batch size is not specialised)."""
    from torch.export import Dim

    return torch.export.export(module.eval(), (example,),
                               dynamic_shapes=({0: Dim("batch", min=1)},))


def plain_module(program: ExportedProgram) -> nn.Module:
    """``program``'s computation as an ordinary ``torch.fx.GraphModule``: ``train()`` and
    ``eval()`` work (the graph was traced in eval mode and stays so), it pickles, and
    unpickling it needs torch alone (no raycl class is in it).

    Args:
        program: a program of :func:`export_program`.

    Returns:
        The module, in eval mode.
    """
    try:  # torch >= 2.9: leave out the input guards (a submodule that does not pickle)
        module = program.module(check_guards=False)
    except TypeError:  # older torch: no guards, no such argument
        module = program.module()
    graph = copy.deepcopy(module.graph)
    # Unpickling re-traces the saved code with the graph's tracer: torch.export's
    # (_ModuleStackTracer) cannot be built so; fx's default Tracer can.
    graph._tracer_cls, graph._tracer_extras = None, {}
    return torch.fx.GraphModule(module, graph).eval()


def small_cnn_blocks(channels: int, width: int) -> list[tuple[int, int, int]]:
    """(in channels, out channels, stride) of each conv-BN-ReLU block of raycl's small CNN,
    read off :func:`raycl.models.backbones.small_cnn` itself (what the card says is what was
    built)."""
    from raycl.models.backbones import small_cnn

    network, _ = small_cnn(channels, width)
    convs = [layer for layer in network.modules() if isinstance(layer, nn.Conv2d)]
    return [(conv.in_channels, conv.out_channels, int(conv.stride[0])) for conv in convs]


def small_cnn_architecture(channels: int, width: int) -> dict[str, Any]:
    """The model card's ``architecture`` of a small_cnn encoder: enough to rebuild it without
    raycl (its ``how_to_load`` does), and the raycl function and config keys that build it."""
    blocks = small_cnn_blocks(channels, width)
    return {
        "network": "torch.nn.Sequential: conv-BN-ReLU blocks, then global average pool",
        "blocks": [{"conv": f"Conv2d({cin}, {cout}, kernel_size=3, stride={stride}, "
                            f"padding=1, bias=False)",
                    "then": f"BatchNorm2d({cout}), ReLU", "out_channels": cout, "stride": stride}
                   for cin, cout, stride in blocks],
        "head": "AdaptiveAvgPool2d(1), Flatten (no projector)",
        "feature_dim": blocks[-1][1],
        "state_dict_keys": "<block>.0.weight (conv), <block>.1.* (BatchNorm), blocks 0..3",
        "raycl": f"raycl.models.backbones.small_cnn(in_channels={channels}, width={width})",
        "config_keys": {"model.backbone": "small_cnn", "model.width": width},
    }


def small_cnn_lines(channels: int, width: int) -> list[str]:
    """Python lines building raycl's small CNN (empty) with ``torch.nn`` alone, as ``model``;
    the first line is the import."""
    blocks = small_cnn_blocks(channels, width)
    return ["import torch",
            "model = torch.nn.Sequential(*(torch.nn.Sequential(  # raycl small_cnn, "
            f"width {width}",
            "    torch.nn.Conv2d(c_in, c_out, 3, stride, 1, bias=False),",
            "    torch.nn.BatchNorm2d(c_out), torch.nn.ReLU(inplace=True))",
            f"    for c_in, c_out, stride in {blocks!r}),",
            "    torch.nn.AdaptiveAvgPool2d(1), torch.nn.Flatten())"]


def resnet_lines(backbone: str, stem: str, channels: int, library: str,
                 preprocessing: Preprocessing | None = None) -> list[str]:
    """Python lines building the empty ResNet an exported state dict loads into.

    Args:
        backbone: resnet18 or resnet50.
        stem: "cifar" or "imagenet".
        channels: image channels.
        library: "torchvision" or "timm".
        preprocessing: what the weights expect; timm's model then carries it in its
            ``pretrained_cfg`` (its default says ImageNet's mean and std, and
            ``timm.data.resolve_data_config`` would build a transform the weights never saw).

    Returns:
        The lines (``model`` is the network).
    """
    if library == "timm":
        overlay = "" if preprocessing is None else (
            f", pretrained_cfg_overlay=dict(mean={tuple(preprocessing.mean)!r}, "
            f"std={tuple(preprocessing.std)!r}, input_size=({preprocessing.channels}, "
            f"{preprocessing.resolution}, {preprocessing.resolution}))")
        lines = ["import timm, torch",
                 f"model = timm.create_model({backbone!r}, num_classes=0{overlay})"]
    else:
        lines = ["import torch, torchvision",
                 f"model = torchvision.models.{backbone}()",
                 "model.fc = torch.nn.Identity()"]
    if stem == "cifar":
        lines += [f"model.conv1 = torch.nn.Conv2d({channels}, 64, 3, 1, 1, bias=False)",
                  "model.maxpool = torch.nn.Identity()"]
    elif channels != 3:
        lines.append(f"model.conv1 = torch.nn.Conv2d({channels}, 64, 7, 2, 3, bias=False)")
    return lines


__all__ = ["export_program", "plain_module", "resnet_lines", "small_cnn_architecture",
           "small_cnn_blocks", "small_cnn_lines"]
