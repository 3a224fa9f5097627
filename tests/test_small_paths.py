"""Issue 33, finding 13 (the smaller items), each seen on a CPU: the on-device loader's index
copy (a), ``data.on_device: auto`` under a GPU fraction (b), the warning for too few stream
decoders (c), captions tokenised by the decoders, not the training thread (d), decoder
processes free of torch and faiss (e), BatchNorm over the global batch (f), NT-Xent in float32
under autocast (g) and one multi-tensor EMA update (h)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import numpy as np
import pytest
import torch
from data_fixtures import write_webdataset
from test_end_to_end import tiny_config
from torch import nn

from raycl.config.search_config import apply_overrides
from raycl.data import load_dataset
from raycl.losses import nt_xent
from raycl.models.momentum import ema_update, momentum_copy
from raycl.worker.batches import TrainBatch
from raycl.worker.loader import DeviceImages, HostImages, ResidentImages, trial_training_images

CUDA = torch.device("cuda", 0)


# --- (a) the on-device loader's index -------------------------------------------------------

class _FakeCudaImages:
    """Stands for a uint8 image tensor on a GPU: what ResidentImages reads of it."""

    device = CUDA

    def __len__(self) -> int:
        return 100

    def __getitem__(self, index: torch.Tensor) -> torch.Tensor:
        return index


def test_device_index_is_a_pinned_non_blocking_copy(monkeypatch: pytest.MonkeyPatch) -> None:
    """(a) A batch's index reaches the GPU from pinned memory, queued without a host wait; a
    pageable ``as_tensor(device=cuda)`` copy (blocking, every step) is never made."""
    moves: list[tuple[Any, bool]] = []
    pinned: list[torch.Tensor] = []

    def pin_memory(self: torch.Tensor, *args: Any) -> torch.Tensor:
        pinned.append(self)
        return self

    def to(self: torch.Tensor, device: Any, *args: Any, non_blocking: bool = False,
           **kwargs: Any) -> torch.Tensor:
        moves.append((torch.device(device), non_blocking))
        return self

    monkeypatch.setattr(torch.Tensor, "pin_memory", pin_memory)
    monkeypatch.setattr(torch.Tensor, "to", to)
    resident = ResidentImages(_FakeCudaImages())  # type: ignore[arg-type]
    gathered, index = resident.__getitems__([3, 1, 4])
    assert gathered is index  # the images are gathered by the copied index itself
    assert index.tolist() == [3, 1, 4] and index.dtype == torch.long
    assert len(pinned) == 1 and moves == [(CUDA, True)]


# --- (b) data.on_device: auto under a GPU fraction ------------------------------------------

def test_on_device_auto_counts_only_the_trials_share_of_the_gpu(
    data_cache: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """(b) With ``scaling.gpus_per_worker: 0.5`` two trials share a GPU: ``auto`` keeps the
    images on it only when they fit a quarter of half of it."""
    config = tiny_config(tmp_path, "quickstart.yaml")
    data = load_dataset(config.data, config.seed)
    nbytes = int(np.asarray(data.train.images).nbytes)
    # A quarter of this fake GPU holds the images 1.5 times over; a quarter of half of it not.
    memory = SimpleNamespace(total_memory=6 * nbytes)
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda device: memory)
    monkeypatch.setattr("raycl.worker.loader.copy_to_device",
                        lambda images, device: torch.from_numpy(np.asarray(images)))
    whole = apply_overrides(config, {"scaling.use_gpu": True, "scaling.gpus_per_worker": 1.0})
    half = apply_overrides(whole, {"scaling.gpus_per_worker": 0.5})
    assert isinstance(trial_training_images(whole, data, CUDA), DeviceImages)
    assert isinstance(trial_training_images(half, data, CUDA), HostImages)


# --- (c) too few stream decoders per GPU -----------------------------------------------------

def test_stream_mode_on_gpus_with_one_decoder_cpu_is_warned_before_launch(
    data_cache: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """(c) ``data.stream_cpus: 1`` on GPU workers: a warning naming the key and the figure,
    printed with the launch's other warnings (not an error); none with enough decoders, on CPU
    workers or in memory mode."""
    from raycl.launch.stream_rate import STREAM_CPUS_PER_GPU, stream_cpus_warning
    from raycl.sweep.run import _warn_if_trials_wait

    monkeypatch.setattr("raycl.sweep.run.placement_warning", lambda config: None)
    base = tiny_config(tmp_path, "quickstart.yaml")
    few = apply_overrides(base, {"data.loader": "stream", "scaling.use_gpu": True,
                                 "data.stream_cpus": 1.0})
    _warn_if_trials_wait(few)
    err = capsys.readouterr().err
    assert err.startswith("raycl: warning: data.stream_cpus: 1 decoding CPU(s) per GPU worker")
    assert f"at least {STREAM_CPUS_PER_GPU:g}" in err
    assert stream_cpus_warning(apply_overrides(few, {"data.stream_cpus": 4.0})) is None
    assert stream_cpus_warning(apply_overrides(few, {"scaling.use_gpu": False})) is None
    assert stream_cpus_warning(apply_overrides(few, {"data.loader": "memory"})) is None
    # Half a GPU per worker wants half the decoders.
    assert stream_cpus_warning(apply_overrides(few, {"scaling.gpus_per_worker": 0.5,
                                                     "data.stream_cpus": 2.0})) is None


# --- (d) captions tokenised by the decoders --------------------------------------------------

def test_streamed_captions_are_tokenised_by_the_decoders_not_each_step(
    data_cache: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """(d) A shard's captions come out of the decoding task as CLIP's own tokens, and an epoch
    of such batches calls the method's tokenizer in the training process not once."""
    from raycl.data.stream.decoders import decode_shards
    from raycl.methods import build_method, method_class
    from raycl.worker.epoch import _batch

    write_webdataset(tmp_path / "wds", shards=4, per_shard=8)
    config = tiny_config(tmp_path, "quickstart.yaml", "method=clip", "data.dataset=webdataset",
                         f"data.root={tmp_path / 'wds'}", "data.resolution=12",
                         "data.val_fraction=0.25", "data.test_fraction=0.25",
                         "train.batch_size=4", "tune.search_space={}", "tune.metric=val/i2t/r1")
    method = build_method(config, in_channels=3)
    tokenizer = method_class(config).caption_tokenizer(config)
    rows = {"path": np.array([str(tmp_path / "wds" / "00000.tar")]),
            "count": np.array([8]), "offset": np.array([0])}
    chunks = list(decode_shards(rows, "webdataset", 12, True, tokenizer))
    captions = [str(text) for chunk in chunks for text in chunk["caption"]]
    tokens = torch.from_numpy(np.concatenate([chunk["tokens"] for chunk in chunks]))
    assert len(captions) == 8
    assert torch.equal(tokens, method.tokenize(captions))

    calls: list[int] = []
    real = method.tokenize
    monkeypatch.setattr(method, "tokenize", lambda texts: calls.append(len(texts)) or real(texts))
    images = torch.from_numpy(np.concatenate([chunk["images"] for chunk in chunks]))
    parts = SimpleNamespace(device=torch.device("cpu"), method=method, tokens=None,
                            pseudo_labels=None, augment=None)
    epoch = [TrainBatch(images[i:i + 4], torch.arange(i, i + 4), captions[i:i + 4],
                        tokens[i:i + 4]) for i in (0, 4)]
    texts = [_batch(parts, loaded, False, torch.Generator()).texts  # type: ignore[arg-type]
             for loaded in epoch]
    assert calls == []  # nothing tokenised in the training process this epoch
    assert torch.equal(torch.cat(texts), method.tokenize(captions))


# --- (e) decoder processes import neither torch nor faiss -----------------------------------

def test_the_decoders_module_imports_neither_torch_nor_faiss() -> None:
    """(e) Ray pickles the decoding functions by reference: a decoder process imports their
    module, which must not bring torch or faiss (3.7 s and 600 MB per process)."""
    from raycl.worker import stream_loader

    assert stream_loader.decode_shards.__module__ == "raycl.data.stream.decoders"
    assert stream_loader.decode_file_batch.__module__ == "raycl.data.stream.decoders"
    probe = ("import sys, raycl.data.stream.decoders; "
             "print('torch' in sys.modules, 'faiss' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True,
                         check=True, timeout=120).stdout
    assert out.split() == ["False", "False"]


# --- (f) BatchNorm over the global batch -----------------------------------------------------

class _Projector(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.mlp = nn.Sequential(nn.Linear(4, 8), nn.BatchNorm1d(8), nn.ReLU(), nn.Linear(8, 2))
        self.moved_to: list[torch.device] = []

    def to(self, device: Any, *args: Any, **kwargs: Any) -> _Projector:  # type: ignore[override]
        self.moved_to.append(torch.device(device))  # no GPU here: placement only recorded
        return self


def test_sync_batchnorm_under_a_fake_two_gpu_world(monkeypatch: pytest.MonkeyPatch) -> None:
    """(f) ``model.sync_batchnorm`` (default on): with two ranks the method's BatchNorm layers
    are converted before DDP wraps it, in place (same parameters: the optimizer and the
    checkpoint keys are unchanged): torch's fused SyncBatchNorm (guarded) on CUDA, raycl's
    GlobalBatchNorm on CPU (gloo) ranks; one rank, or sync off, keeps plain BatchNorm.
    (tests/test_sync_batchnorm.py checks the statistics in a real two-worker world.)"""
    from raycl.config.training import ModelConfig
    from raycl.models.sync_batchnorm import GlobalBatchNorm, GuardedSyncBatchNorm
    from raycl.worker.session import InProcessSession, sync_batchnorm
    from raycl.worker.stage import data_parallel

    assert ModelConfig().sync_batchnorm is True
    for device, world, layer in ((CUDA, 1, nn.BatchNorm1d), (CUDA, 2, GuardedSyncBatchNorm),
                                 (torch.device("cpu"), 2, GlobalBatchNorm)):
        model = _Projector()
        sync_batchnorm(model, device, world)
        assert type(model.mlp[1]) is layer

    wrapped_layers: list[type[nn.Module]] = []

    def fake_ddp(model: _Projector, device_ids: Any) -> tuple[str, nn.Module]:
        wrapped_layers.append(type(model.mlp[1]))  # converted before DDP sees the model
        return ("ddp", model)

    monkeypatch.setattr("raycl.worker.session.DistributedDataParallel", fake_ddp)
    for device, layer in ((CUDA, GuardedSyncBatchNorm), (torch.device("cpu"), GlobalBatchNorm)):
        session = InProcessSession(torch.device("cpu"))
        session.device, session.world_size = device, 2
        method = _Projector()
        params, keys = list(method.parameters()), list(method.state_dict())
        wrapped = data_parallel(method, session, sync_bn=True)  # type: ignore[arg-type]
        assert wrapped == ("ddp", method) and method.moved_to == [device]
        assert type(method.mlp[1]) is layer and wrapped_layers[-1] is layer
        assert all(a is b for a, b in zip(params, method.parameters(), strict=True))
        assert list(method.state_dict()) == keys
        plain = _Projector()
        data_parallel(plain, session, sync_bn=False)  # type: ignore[arg-type]
        assert type(plain.mlp[1]) is nn.BatchNorm1d


# --- (g) NT-Xent in float32 under autocast ---------------------------------------------------

def test_nt_xent_is_float32_under_bf16_autocast() -> None:
    """(g) Like the other InfoNCE losses, NT-Xent's logits are float32 under autocast: the loss
    equals the float32 one, from float32 or bf16 projections."""
    generator = torch.Generator().manual_seed(0)
    z1, z2 = torch.randn(16, 32, generator=generator), torch.randn(16, 32, generator=generator)
    reference = nt_xent(z1, z2, temperature=0.1)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        loss = nt_xent(z1, z2, temperature=0.1)
        from_bf16 = nt_xent(z1.bfloat16(), z2.bfloat16(), temperature=0.1)
    assert loss.dtype == torch.float32 and from_bf16.dtype == torch.float32
    torch.testing.assert_close(loss, reference)
    reference_bf16 = nt_xent(z1.bfloat16().float(), z2.bfloat16().float(), temperature=0.1)
    torch.testing.assert_close(from_bf16, reference_bf16)


# --- (h) one multi-tensor EMA update ---------------------------------------------------------

def test_ema_update_is_one_foreach_call_equal_to_the_per_parameter_loop(
    monkeypatch: pytest.MonkeyPatch
) -> None:
    """(h) The momentum copy moves in one multi-tensor call over all its parameters, to exactly
    what a ``lerp_`` per parameter gives."""
    torch.manual_seed(0)
    online = nn.Sequential(nn.Linear(6, 5), nn.BatchNorm1d(5), nn.Linear(5, 3))
    target = momentum_copy(online)
    with torch.no_grad():
        for param in online.parameters():
            param.add_(torch.randn_like(param))
    expected = [t.detach().clone().lerp_(o.detach(), 1.0 - 0.99)
                for o, t in zip(online.parameters(), target.parameters(), strict=True)]
    calls: list[int] = []
    real = torch._foreach_lerp_

    def counted(targets: list[torch.Tensor], *args: Any) -> None:
        calls.append(len(targets))
        real(targets, *args)

    monkeypatch.setattr(torch, "_foreach_lerp_", counted)
    ema_update(online, target, 0.99)
    assert calls == [len(expected)]
    for got, want in zip(target.parameters(), expected, strict=True):
        assert torch.equal(got, want)
