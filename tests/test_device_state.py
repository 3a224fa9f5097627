"""Checkpoint state across devices and AMP modes (issue 25, findings 2, 4 and 6), on the CPU.

A checkpoint is read to the CPU whatever device the trial trains on, and ``load_state_dict``
moves it to the parameters' device; the soup averages weights wherever they are; a resumed
trial keeps no reference to the state it loaded; a change of AMP mode does not break a resume.
The ``meta`` device stands in for a GPU: a tensor there is on "another device" than the CPU.
"""

from __future__ import annotations

import gc
import inspect
import logging
import shutil
import weakref
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import ray.train
import torch
from test_methods import build_simclr, make_batch
from test_reliability import StoredSession, config_dict, run
from torch import nn

import raycl.worker.checkpoints
import raycl.worker.loop
import raycl.worker.stage
from raycl.methods import SearchConfig
from raycl.worker.checkpoints import read_checkpoint, restore, write_checkpoint
from raycl.worker.context import TrialContext
from raycl.worker.embed import soup_method
from raycl.worker.stage_integration import StageInputs, average_weights, soup_weights

META = torch.device("meta")


def tensors(value: Any) -> Iterator[torch.Tensor]:
    """Every tensor in a nest of dicts, lists and tuples."""
    if isinstance(value, torch.Tensor):
        yield value
    elif isinstance(value, dict):
        for item in value.values():
            yield from tensors(item)
    elif isinstance(value, list | tuple):
        for item in value:
            yield from tensors(item)


class MetaSession:
    """A session that trains on "another device" than the CPU and resumes from ``directory``."""

    rank, world_size, device = 0, 1, META

    def __init__(self, directory: Path) -> None:
        self.directory = directory

    def latest_checkpoint(self) -> ray.train.Checkpoint:
        return ray.train.Checkpoint(str(self.directory))


def soup_checkpoint(directory: Path) -> None:
    """A stage-1 checkpoint at the end of its stage: model, AdamW and scaler state, the stage's
    soup weights, and stage 0's soup weights among its inputs."""
    directory.mkdir()
    method = build_simclr(seed=0)
    optimizer = torch.optim.AdamW(method.parameters(), lr=1e-3)
    method(make_batch())["loss"].backward()
    optimizer.step()
    earlier = soup_weights(build_simclr(seed=1))
    inputs = StageInputs(stage=1, features=[{}], weights=[earlier])
    write_checkpoint(directory, method, optimizer, torch.amp.GradScaler("cpu", enabled=False),
                     {"stage": 1, "epoch": 1, "stage_complete": False}, inputs, None,
                     {"train/loss": 1.0}, soup=soup_weights(method))


# --------------------------------------------------------------------------------- finding 2


def test_a_checkpoint_is_read_to_the_cpu_whatever_the_session_trains_on(tmp_path) -> None:
    """Resumed on another device, every tensor of the state is still on the CPU, so the stored
    soup averages with the earlier stages' weights (read to the CPU too): on a GPU the soup's
    average stacked tensors of two devices and crashed."""
    soup_checkpoint(tmp_path / "checkpoint")
    restored = restore(MetaSession(tmp_path / "checkpoint"))  # type: ignore[arg-type]
    assert restored is not None
    devices = {tensor.device.type for tensor in tensors(restored.state)}
    assert devices == {"cpu"}
    assert {t.device.type for t in tensors(restored.inputs.weights)} == {"cpu"}
    soup = average_weights([*restored.inputs.weights, restored.state["soup"]])
    assert set(soup) == set(restored.state["soup"])
    assert "device" not in inspect.signature(read_checkpoint).parameters


def test_load_state_dict_moves_cpu_state_to_the_parameters_device() -> None:
    """What reading to the CPU relies on (a module's ``load_state_dict`` copies into its
    parameters): the optimizer's puts CPU state on the parameters' device (AdamW's moments, SGD's
    momentum buffers;
    AdamW's non-capturable ``step`` stays on the CPU, where AdamW wants it)."""
    for make in (lambda p: torch.optim.AdamW(p, lr=1e-3),
                 lambda p: torch.optim.SGD(p, lr=1e-3, momentum=0.9)):
        source = build_simclr(seed=0)
        optimizer = make(source.parameters())
        source(make_batch())["loss"].backward()
        optimizer.step()
        target = build_simclr(seed=1).to(META)
        moved = make(target.parameters())
        moved.load_state_dict(optimizer.state_dict())
        for state in moved.state.values():
            assert state, "the loaded optimizer holds state for every parameter"
            for key, value in state.items():
                assert value.device.type == ("cpu" if key == "step" else "meta"), key


def test_the_soup_averages_stages_whose_weights_sit_on_different_devices() -> None:
    """A stage restored from a checkpoint and one just trained need not hold their weights on
    one device: the soup averages on the model's device whatever device each stage is on."""
    cpu = {"weight": torch.ones(2, 3), "bias": torch.zeros(2)}
    meta = {key: torch.empty_like(value, device=META) for key, value in cpu.items()}
    soup = soup_method(nn.Linear(3, 2, device=META), [cpu, meta])  # type: ignore[arg-type]
    assert soup.weight.device == META
    averaged = average_weights([meta, cpu], device=META)
    assert {value.device for value in averaged.values()} == {META}
    on_cpu = average_weights([cpu, {"weight": 3 * cpu["weight"], "bias": cpu["bias"] + 1}])
    assert torch.equal(on_cpu["weight"], torch.full((2, 3), 2.0))
    assert torch.equal(on_cpu["bias"], torch.full((2,), 0.5))


# ---------------------------------------------------------------------- findings 4 and 6


@pytest.fixture(scope="module")
def crashed(data_cache, tmp_path_factory) -> Path:
    """A tiny SimCLR trial on the CPU (loss scaler disabled), killed after epoch 1 of 2."""
    root = tmp_path_factory.mktemp("crashed") / "run"
    marker = root.parent / "crashed"
    with pytest.raises(RuntimeError, match="injected fault"):
        run(root, fault={"after_epoch": 1, "marker": str(marker)}, epochs=2)
    return root


def test_a_resumed_trial_keeps_no_reference_to_the_state_it_loaded(
    crashed, tmp_path, monkeypatch
) -> None:
    """Once the model has its weights, nothing holds the checkpoint's copy of them: on a GPU
    the whole checkpoint (model, optimizer, soup) stayed referenced for the rest of the trial.
    (The optimizer's own state may alias the loaded CPU tensors: that state is in use.)"""
    root = tmp_path / "run"
    shutil.copytree(crashed, root)
    loaded: list[weakref.ref[torch.Tensor]] = []
    original = raycl.worker.checkpoints.read_checkpoint

    def recording(directory: Path, *device: torch.device) -> raycl.worker.checkpoints.Restored:
        restored = original(directory, *device)
        loaded.extend(weakref.ref(tensor) for tensor in tensors(restored.state["model"]))
        return restored

    alive: list[int] = []

    class Watching(StoredSession):
        def report(self, metrics: dict[str, Any], checkpoint_dir: str | None) -> None:
            gc.collect()
            alive.append(sum(ref() is not None for ref in loaded))
            super().report(metrics, checkpoint_dir)

    monkeypatch.setattr(raycl.worker.checkpoints, "read_checkpoint", recording)
    session = Watching(root)
    context = TrialContext(config=SearchConfig.model_validate(config_dict(epochs=2)))
    raycl.worker.loop.run_trial_loop(context, session)
    assert loaded and session.reports[0]["resumed_from_epoch"] == 1
    assert alive == [0]


def test_a_cpu_checkpoint_resumes_with_a_loss_scaler_that_scales(
    crashed, tmp_path, monkeypatch, caplog
) -> None:
    """A checkpoint written without loss scaling (CPU, or amp off/bf16) resumed where the scaler
    scales (fp16 on CUDA, here an enabled CPU scaler): the scaler starts afresh, with a
    warning, where ``GradScaler.load_state_dict`` refused the empty state and the trial died."""
    root = tmp_path / "run"
    shutil.copytree(crashed, root)
    original = raycl.worker.stage.autocast_and_scaler

    def scaling(config: Any, device: torch.device) -> Any:
        autocast, _ = original(config, device)
        return autocast, torch.amp.GradScaler("cpu", enabled=True)

    monkeypatch.setattr(raycl.worker.stage, "autocast_and_scaler", scaling)
    with caplog.at_level(logging.WARNING, logger="raycl.worker.optim"):
        resumed = run(root, epochs=2)
    assert [report["epoch"] for report in resumed.reports] == [2]
    assert [r.message for r in caplog.records if "AMP mode changed" in r.message]


def test_the_loss_scaler_state_loads_only_where_both_sides_scale(caplog) -> None:
    """Scaling then and now: the scale carries over. A change of mode either way: the scaler
    keeps its own state, and the log says so once. Neither scaling: nothing to say."""
    from raycl.worker.optim import load_scaler_state

    saved = torch.amp.GradScaler("cpu", enabled=True, init_scale=1024.0).state_dict()
    with caplog.at_level(logging.WARNING, logger="raycl.worker.optim"):
        both = torch.amp.GradScaler("cpu", enabled=True)
        load_scaler_state(both, saved)
        assert both.get_scale() == 1024.0
        assert not caplog.records
        now_scaling = torch.amp.GradScaler("cpu", enabled=True)
        load_scaler_state(now_scaling, {})
        assert now_scaling.get_scale() == 65536.0
        load_scaler_state(torch.amp.GradScaler("cpu", enabled=False), saved)
        load_scaler_state(torch.amp.GradScaler("cpu", enabled=False), {})
    assert len([r for r in caplog.records if "AMP mode changed" in r.message]) == 2


def test_no_state_is_left_in_a_checkpoint_resumed_at_a_stage_boundary(tmp_path) -> None:
    """Resumed after a finished stage, the stage's model and optimizer state are dropped as soon
    as the soup weights are taken out (they would stay referenced for the whole next stage)."""
    soup_checkpoint(tmp_path / "checkpoint")
    restored = restore(MetaSession(tmp_path / "checkpoint"))  # type: ignore[arg-type]
    assert restored is not None
    restored.progress["stage_complete"] = True
    restored.features = {"train": torch.randn(8, 4).numpy()}
    captured: dict[str, Any] = {}

    def between(config: Any, inputs: StageInputs, features: Any, metrics: Any, weights: Any,
                session: Any, clock: Any) -> StageInputs:
        captured["weights"] = weights
        return StageInputs(stage=inputs.stage + 1)

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(raycl.worker.loop, "between_stages", between)
        inputs, resume = raycl.worker.loop._resume_point(None, restored, None, None)  # type: ignore[arg-type]
    assert resume is None and inputs.stage == 2
    assert set(captured["weights"]) == set(soup_weights(build_simclr()))
    assert restored.state == {}

