"""Precision and CUDA set-up (issue 25, findings 7a and 8): ``train.amp: auto`` picks bf16
where the GPU has it natively; evaluation embeds in the trial's precision on CUDA only; the
float32 blocks (CLIP's logits, the kNN lookup, FGVR's Grad-CAM) stay float32 under autocast;
TF32 / cuDNN autotuning touch nothing on CPU; channels_last applies on CUDA, and on the
CPU to ResNets."""

from __future__ import annotations

from contextlib import nullcontext
from types import SimpleNamespace

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from torch import nn

from raycl.methods import SearchConfig, build_method
from raycl.methods.clip import clip_loss
from raycl.methods.fgvr import gradcam_scores
from raycl.methods.queues import cosine_topk
from raycl.models.backbones import build_backbone
from raycl.worker.cuda import configure_cuda_backends, prefer_channels_last
from raycl.worker.embed import embed_images
from raycl.worker.optim import autocast_and_scaler, inference_autocast, resolve_amp

CUDA = torch.device("cuda")
CPU = torch.device("cpu")


def config(amp: str = "auto") -> SearchConfig:
    return SearchConfig(name="t", method="simclr", data={"resolution": 16}, train={"amp": amp},
                        model={"backbone": "small_cnn", "width": 4, "projector_hidden_dim": 16,
                               "projector_dim": 8})


def fake_gpu(monkeypatch: pytest.MonkeyPatch, major: int) -> None:
    """Pretend the CUDA device has compute capability ``major``.x (no GPU needed)."""
    monkeypatch.setattr(torch.cuda, "get_device_properties",
                        lambda device=None: SimpleNamespace(major=major, minor=0))


@pytest.mark.parametrize(("major", "expected"), [(9, "bf16"), (8, "bf16"), (7, "fp16")])
def test_amp_auto_is_bf16_on_gpus_with_native_bf16_else_fp16(
    monkeypatch: pytest.MonkeyPatch, major: int, expected: str
) -> None:
    fake_gpu(monkeypatch, major)
    assert resolve_amp("auto", CUDA) == expected
    assert resolve_amp("auto", CPU) == "off"
    for mode in ("off", "bf16", "fp16"):
        assert resolve_amp(mode, CUDA) == mode  # an explicit mode is kept


@pytest.mark.filterwarnings("ignore:CUDA is not available")
def test_amp_auto_on_an_ampere_gpu_has_no_loss_scaler(monkeypatch: pytest.MonkeyPatch) -> None:
    """bf16 needs no scaler: no inf check read on the host every step."""
    fake_gpu(monkeypatch, 8)
    _, scaler = autocast_and_scaler(config("auto"), CUDA)
    assert not scaler.is_enabled()
    autocast = inference_autocast(config("auto"), CUDA)()
    assert isinstance(autocast, torch.autocast) and autocast.fast_dtype == torch.bfloat16


@pytest.mark.parametrize("amp", ["auto", "off", "bf16", "fp16"])
def test_cpu_evaluation_and_auto_training_stay_float32(amp: str) -> None:
    assert inference_autocast(config(amp), CPU) is nullcontext
    if amp in ("auto", "off"):
        autocast, scaler = autocast_and_scaler(config(amp), CPU)
        assert autocast is nullcontext and not scaler.is_enabled()


def test_embedding_under_autocast_returns_float32_and_cpu_default_is_unchanged() -> None:
    torch.manual_seed(0)
    method = build_method(config(), in_channels=3)
    images = np.random.default_rng(0).integers(0, 256, (10, 3, 16, 16), dtype=np.uint8)
    session = SimpleNamespace(rank=0, world_size=1, device=CPU)
    plain = embed_images(method, images, session, batch_size=4)
    with torch.no_grad():
        reference = method.eval().embed((torch.from_numpy(images).float() / 255 - 0.5) / 0.5)
    assert plain.dtype == np.float32  # CPU: float32, as before
    np.testing.assert_allclose(plain, reference.numpy(), rtol=1e-5, atol=1e-6)
    half = embed_images(method, images, session, batch_size=4,
                        autocast=lambda: torch.autocast("cpu", dtype=torch.bfloat16))
    assert half.dtype == np.float32
    np.testing.assert_allclose(half, plain, atol=0.1, rtol=0.1)


def bf16_autocast() -> torch.autocast:
    return torch.autocast("cpu", dtype=torch.bfloat16)


def test_knn_lookup_is_float32_under_autocast() -> None:
    generator = torch.Generator().manual_seed(0)
    queries = torch.randn(16, 32, generator=generator)
    keys = F.normalize(torch.randn(500, 32, generator=generator), dim=1)
    exact = cosine_topk(queries, keys, 5)
    with bf16_autocast():
        inside = cosine_topk(queries, keys, 5)
    assert inside[0].dtype == torch.float32
    assert torch.equal(inside[0], exact[0]) and torch.equal(inside[1], exact[1])


def test_clip_logits_are_float32_under_autocast() -> None:
    generator = torch.Generator().manual_seed(0)
    images = F.normalize(torch.randn(8, 16, generator=generator), dim=1).requires_grad_(True)
    texts = F.normalize(torch.randn(8, 16, generator=generator), dim=1)
    exact = clip_loss(images, texts, torch.tensor(100.0))
    with bf16_autocast():
        inside = clip_loss(images, texts, torch.tensor(100.0))
    assert inside.dtype == torch.float32 and torch.equal(inside, exact)
    inside.backward()
    assert images.grad is not None and images.grad.dtype == torch.float32


def test_gradcam_gradient_is_float32_under_autocast() -> None:
    torch.manual_seed(0)
    projector = nn.Sequential(nn.Linear(12, 16), nn.ReLU(), nn.Linear(16, 8))
    features, view = torch.randn(6, 12).relu(), torch.randn(6, 12).relu()
    exact = gradcam_scores(features, view, projector, 0.2, gather=False)
    with bf16_autocast():
        inside = gradcam_scores(features, view, projector, 0.2, gather=False)
    assert inside.dtype == torch.float32 and torch.equal(inside, exact)


def test_cuda_settings_leave_a_cpu_run_alone() -> None:
    benchmark, precision = torch.backends.cudnn.benchmark, torch.get_float32_matmul_precision()
    assert configure_cuda_backends(CPU) is False
    assert torch.backends.cudnn.benchmark == benchmark
    assert torch.get_float32_matmul_precision() == precision
    conv = nn.Sequential(nn.Conv2d(3, 4, 3), nn.Flatten(), nn.LazyLinear(2))
    assert prefer_channels_last(conv, CPU)[0].weight.is_contiguous()


def test_channels_last_for_resnets_on_the_cpu_too() -> None:
    """oneDNN's CPU convolutions are faster in NHWC (issue 37): a ResNet's weights go
    channels_last on the CPU as well, and its NCHW input still gives the same result; a
    network of a few convolutions (small_cnn) stays as it was."""
    torch.manual_seed(0)
    resnet = build_backbone("resnet18", in_channels=3)[0].eval()
    images = torch.randn(2, 3, 16, 16)
    reference = resnet(images)
    assert prefer_channels_last(resnet, CPU) is resnet
    assert resnet.conv1.weight.is_contiguous(memory_format=torch.channels_last)
    torch.testing.assert_close(resnet(images), reference, rtol=1e-4, atol=1e-4)
    small = build_backbone("small_cnn", in_channels=3)[0]
    assert prefer_channels_last(small, CPU)[0][0].weight.is_contiguous()


def test_channels_last_for_conv_models_on_cuda() -> None:
    """``Module.to(memory_format=...)`` does not move the module, so the CUDA branch is
    checked on CPU tensors."""
    patch_embedding = nn.Sequential(nn.Conv2d(3, 4, 4, stride=4), nn.Flatten())  # a ViT's
    assert prefer_channels_last(patch_embedding, CUDA)[0].weight.is_contiguous()
    conv = nn.Sequential(nn.Conv2d(3, 4, 3), nn.ReLU(), nn.Conv2d(4, 4, 3),
                         nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(4, 2))
    reference = conv(torch.randn(2, 3, 8, 8))
    assert prefer_channels_last(conv, CUDA) is conv
    assert conv[0].weight.is_contiguous(memory_format=torch.channels_last)
    assert not conv[0].weight.is_contiguous()
    assert conv(torch.randn(2, 3, 8, 8)).shape == reference.shape  # NCHW input still works
    linear = nn.Linear(4, 2)
    assert prefer_channels_last(linear, CUDA).weight.is_contiguous()


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_backends_are_configured() -> None:
    assert configure_cuda_backends(CUDA) is True
    assert torch.backends.cudnn.benchmark
    assert torch.get_float32_matmul_precision() == "high"
