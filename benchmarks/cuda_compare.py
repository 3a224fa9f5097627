"""CUDA against the CPU for raycl's torch-level code (issues 34-35): the same inputs and seeds
on both devices, the results compared by ``max |cuda - cpu| / max |cpu|``. Needs torch only (no
Ray, no MLflow), so it runs on a bare GPU machine:

    python benchmarks/cuda_compare.py --out cuda_compare.json   # CUDA against the CPU
    python benchmarks/cuda_compare.py --device cpu              # a smoke test (CPU vs CPU)

Checks: LARS steps (trust ratios, clip_lr, momentum), per-view BatchAugment (blur on view 0,
solarization on view 1; a CPU generator on both devices, and deterministic settings under a
CUDA generator), the guarded SyncBatchNorm (torch's fused CUDA layer and GlobalBatchNorm) in
one process and in a one-rank NCCL group, eval.linear_sgd's heads, and the export encoder's
embedding. TF32 is switched off here, so float32 on both devices should agree to ~1e-5.
"""

from __future__ import annotations

import argparse
import copy
import json
import sys
import tempfile
import traceback
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import Tensor, nn

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

import raycl.methods  # noqa: E402,F401  (registers every method's config section)
from raycl.methods import SearchConfig, build_method  # noqa: E402

TOLERANCE = 1e-4  # float32 on two devices (different reduction orders), TF32 off


def relative_error(cuda: Tensor | Iterable[Tensor], cpu: Tensor | Iterable[Tensor]) -> float:
    """``max |a - b| / max(max |b|, 1e-12)`` over one tensor or a list of tensors.

    Args:
        cuda: the device's results.
        cpu: the CPU's results (same shapes).

    Returns:
        The largest relative difference; inf when a result is not finite.
    """
    pairs = ([(cuda, cpu)] if isinstance(cuda, Tensor)
             else list(zip(cuda, cpu, strict=True)))  # type: ignore[arg-type]
    worst = 0.0
    for a, b in pairs:
        a, b = a.detach().double().cpu(), b.detach().double().cpu()
        if not (torch.isfinite(a).all() and torch.isfinite(b).all()):
            return float("inf")
        scale = max(float(b.abs().max()), 1e-12) if b.numel() else 1.0
        worst = max(worst, float((a - b).abs().max()) / scale if a.numel() else 0.0)
    return worst


def config(**sections: Any) -> SearchConfig:
    """A small SimCLR config with ``sections`` merged in."""
    raw: dict[str, Any] = {"name": "cuda-compare", "method": "simclr", "seed": 0,
                           "data": {"resolution": 32},
                           "model": {"backbone": "small_cnn", "width": 8}}
    for key, value in sections.items():
        raw[key] = {**raw.get(key, {}), **value}
    return SearchConfig.model_validate(raw)


# ---------------------------------------------------------------------------------------------
# the checks: each returns {"error": relative error, ...}


def check_lars(device: torch.device) -> dict[str, Any]:
    """Five LARS steps of a conv + BN + linear model, for each setting, on both devices."""
    from raycl.worker.lars import LARS, lars_param_groups

    torch.manual_seed(0)
    model = nn.Sequential(nn.Conv2d(3, 8, 3), nn.BatchNorm2d(8), nn.ReLU(), nn.Flatten(),
                          nn.Linear(8 * 6 * 6, 5))
    inputs, targets = torch.randn(16, 3, 8, 8), torch.randn(16, 5)
    out: dict[str, Any] = {}
    for label, settings in (("plain", {}), ("clip_lr", {"clip_lr": True}),
                            ("no_momentum", {"momentum": 0.0})):
        results = []
        for where in (torch.device("cpu"), device):
            net = copy.deepcopy(model).to(where)
            groups = lars_param_groups([{"params": list(net.parameters())}], weight_decay=1e-4)
            optimizer = LARS(groups, lr=0.3, eta=0.02, **{"momentum": 0.9, **settings})
            for _ in range(5):
                loss = nn.functional.mse_loss(net(inputs.to(where)), targets.to(where))
                optimizer.zero_grad(set_to_none=True)
                loss.backward()
                optimizer.step()
            results.append([p.detach() for p in net.parameters()])
        out[label] = relative_error(results[1], results[0])
    return {"error": max(out.values()), "per_setting": out}


def check_augment(device: torch.device) -> dict[str, Any]:
    """BYOL's per-view augmentation (blur on view 0, solarization on view 1): the device's
    views under a CPU generator equal the CPU's; with every random choice made certain (crop of
    the whole image, no flip, fixed sigma), a device generator gives the CPU's views too."""
    from raycl.data.augment import BatchAugment, blur_radius, gaussian_blur, solarize

    images = torch.randint(0, 256, (32, 3, 32, 32), dtype=torch.uint8,
                           generator=torch.Generator().manual_seed(0))
    byol = BatchAugment(config(augment={
        "crop_scale": [0.08, 1.0], "color_jitter": 0.5, "grayscale_prob": 0.2,
        "blur_prob": [1.0, 0.1], "solarize_prob": [0.0, 0.2]}).augment)
    errors: dict[str, float] = {}
    for view in (0, 1):
        cpu = byol(images, torch.Generator().manual_seed(3), view=view)
        on_device = byol(images.to(device), torch.Generator().manual_seed(3), view=view)
        assert on_device.device.type == device.type
        errors[f"byol_view{view}_cpu_generator"] = relative_error(on_device, cpu)
    certain = BatchAugment(config(augment={
        "crop_scale": [1.0, 1.0], "flip": False, "color_jitter": 0.0, "grayscale_prob": 0.0,
        "blur_prob": [1.0, 0.0], "blur_sigma": [1.5, 1.5], "solarize_prob": [0.0, 1.0]}).augment,
        ratio=(1.0, 1.0))
    views = [certain(images.to(device), torch.Generator(device=device).manual_seed(1), view=v)
             for v in (0, 1)]
    for view, out in enumerate(views):
        cpu = certain(images, torch.Generator().manual_seed(7), view=view)
        errors[f"certain_view{view}_device_generator"] = relative_error(out, cpu)
    # View 0 is blurred only, view 1 solarized only: each against the bare operation.
    unit = images.float() / 255.0
    sigma = torch.full((len(images),), 1.5 * 32 / 224)  # blur_sigma is given at 224 px
    blurred = gaussian_blur(unit, sigma, blur_radius(32)) * 2 - 1  # to_float's [-1, 1]
    blurred_error = relative_error(views[0], blurred)
    solarized = solarize(unit) * 2 - 1
    return {"error": max(errors.values()), "views": errors,
            "view0_vs_bare_blur": blurred_error,
            "view1_vs_bare_solarize": relative_error(views[1], solarized),
            "views_differ": bool((views[0] - views[1]).abs().max() > 0.1)}


def batchnorm_model() -> nn.Module:
    torch.manual_seed(0)
    # No biases before the norms: their gradients are zero up to rounding (no relative error).
    return nn.Sequential(nn.Conv2d(3, 6, 3, bias=False), nn.BatchNorm2d(6), nn.ReLU(),
                         nn.Flatten(), nn.Linear(6 * 6 * 6, 4, bias=False), nn.BatchNorm1d(4))


def batchnorm_pass(model: nn.Module, inputs: Tensor) -> list[Tensor]:
    """Output, gradients and running statistics of one training step."""
    model.train()
    out = model(inputs)
    (out * torch.arange(out.numel(), device=out.device).view_as(out).sin()).sum().backward()
    return [out, *(p.grad for p in model.parameters()),
            *(b for name, b in model.named_buffers() if "running" in name)]


def check_sync_batchnorm(device: torch.device) -> dict[str, Any]:
    """convert_batchnorm (fused CUDA SyncBatchNorm, and GlobalBatchNorm) against plain
    BatchNorm on the CPU: in one process without a group, then (CUDA) in a one-rank NCCL group;
    the guard raises inside a single-rank section."""
    import torch.distributed as dist

    from raycl.distributed import CollectiveInSingleRankSection, single_rank_section
    from raycl.models.sync_batchnorm import GuardedSyncBatchNorm, convert_batchnorm

    inputs = torch.randn(10, 3, 8, 8, generator=torch.Generator().manual_seed(0))
    reference = batchnorm_pass(batchnorm_model(), inputs)
    errors: dict[str, float] = {}

    def converted(fused: bool) -> nn.Module:
        model = batchnorm_model().to(device)
        assert convert_batchnorm(model, fused_cuda=fused) == 2
        return model

    kinds = [("global", False)] + ([("fused_sync", True)] if device.type == "cuda" else [])
    for label, fused in kinds:
        errors[f"{label}_no_group"] = relative_error(
            batchnorm_pass(converted(fused), inputs.to(device)), reference)
    guarded = converted(device.type == "cuda")
    raised = False
    try:
        with single_rank_section("cuda_compare"):
            guarded(inputs.to(device))
    except CollectiveInSingleRankSection:
        raised = True
    group = "none"
    if device.type == "cuda" and dist.is_nccl_available() and not dist.is_initialized():
        with tempfile.TemporaryDirectory() as tmp:
            dist.init_process_group("nccl", init_method=f"file://{tmp}/store", rank=0,
                                    world_size=1,
                                    device_id=torch.device("cuda", torch.cuda.current_device()))
            try:
                for label, fused in kinds:
                    errors[f"{label}_nccl_world1"] = relative_error(
                        batchnorm_pass(converted(fused), inputs.to(device)), reference)
                group = "nccl world_size=1"
            finally:
                dist.destroy_process_group()
    return {"error": max(errors.values()), "per_case": errors, "group": group,
            "guard_raised_in_single_rank_section": raised,
            "fused_layer": any(isinstance(m, GuardedSyncBatchNorm) for m in guarded.modules())}


def check_linear_sgd(device: torch.device) -> dict[str, Any]:
    """eval.linear_sgd's heads on a frozen conv encoder: weights after training, and the whole
    protocol's accuracies, on both devices (no augmentation: the same batches); then once with
    the paper's augmentation on the device (runs, finite)."""
    from raycl.config.evaluation import LinearSGDConfig
    from raycl.eval.linear_sgd import (
        FrozenEncoder,
        LabelledImages,
        evaluate_linear_sgd,
        train_heads,
    )

    rng = np.random.default_rng(0)
    images = rng.integers(0, 256, (96, 3, 16, 16), dtype=np.uint8)
    labels = {"shape": rng.integers(0, 3, 96), "colour": rng.integers(0, 2, 96)}
    split = LabelledImages(images=images, labels=labels)
    num_classes = {"shape": 3, "colour": 2}
    settings = LinearSGDConfig.model_validate({"epochs": 3, "batch_size": 32,
                                               "lrs": [0.1, 0.01], "augment": False,
                                               "label_fractions": [0.5]})
    torch.manual_seed(0)
    backbone = nn.Sequential(nn.Conv2d(3, 8, 3), nn.BatchNorm2d(8), nn.ReLU(),
                             nn.AdaptiveAvgPool2d(1), nn.Flatten())
    heads, accuracies = [], []
    for where in (torch.device("cpu"), device):
        model = copy.deepcopy(backbone).to(where)
        encoder = FrozenEncoder(model=model, embed=model)
        trained = train_heads(encoder, split, np.arange(96), num_classes, settings, where, 0)
        heads.append([p.detach() for p in trained.parameters()])
        results = evaluate_linear_sgd(encoder, split, split, lambda: split, num_classes,
                                      settings, where, 0)
        accuracies.append({str(k): {"val": v.val, "test": v.test, "chosen_lr": v.chosen_lr}
                           for k, v in results.items()})
    model = copy.deepcopy(backbone).to(device)
    augmented = train_heads(FrozenEncoder(model=model, embed=model), split, np.arange(96),
                            num_classes, settings.model_copy(update={"augment": True}), device, 0)
    return {"error": relative_error(heads[1], heads[0]),
            "accuracies_equal": accuracies[0] == accuracies[1],
            "cpu": accuracies[0], "device": accuracies[1],
            "augmented_finite": all(bool(torch.isfinite(p).all())
                                    for p in augmented.parameters())}


def check_export(device: torch.device) -> dict[str, Any]:
    """The export encoder of a ResNet-18 SimCLR checkpoint (state.pt), embedding on both
    devices; and its safetensors export read back and run on the device."""
    from raycl.data.augment import to_float
    from raycl.export.encoder import trained_encoder
    from raycl.export.formats import load_exported, write_encoder

    trial = config(model={"backbone": "resnet18"})
    torch.manual_seed(0)
    method = build_method(trial, 3)
    images = to_float(torch.randint(0, 256, (8, 3, 32, 32), dtype=torch.uint8,
                                    generator=torch.Generator().manual_seed(0)))
    with tempfile.TemporaryDirectory() as tmp, torch.no_grad():
        directory = Path(tmp)
        torch.save({"model": method.state_dict()}, directory / "state.pt")
        cpu_encoder = trained_encoder(directory, trial, "cpu")
        cpu = cpu_encoder(images)
        on_device = trained_encoder(directory, trial, device)(images.to(device))
        write_encoder(cpu_encoder, trial, "safetensors", directory / "encoder.safetensors", 3)
        loaded, _ = load_exported(directory / "encoder.safetensors")
        exported = loaded.to(device).eval()(images.to(device))
    return {"error": max(relative_error(on_device, cpu), relative_error(exported, cpu)),
            "checkpoint_encoder": relative_error(on_device, cpu),
            "safetensors_export": relative_error(exported, cpu),
            "embedding_shape": list(cpu.shape),
            "method_embed": relative_error(method.eval().embed(images), cpu)}


CHECKS: dict[str, Callable[[torch.device], dict[str, Any]]] = {
    "lars": check_lars, "augment": check_augment, "sync_batchnorm": check_sync_batchnorm,
    "linear_sgd": check_linear_sgd, "export": check_export}


def passed(name: str, result: dict[str, Any]) -> bool:
    """A check passes when its relative error is under TOLERANCE and its own flags hold."""
    flags = {"augment": ("views_differ",),
             "sync_batchnorm": ("guard_raised_in_single_rank_section",),
             "linear_sgd": ("accuracies_equal", "augmented_finite")}.get(name, ())
    return "error" in result and result["error"] < TOLERANCE and all(result[f] for f in flags)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--out", default=None, help="JSON of every figure")
    parser.add_argument("--only", nargs="+", choices=sorted(CHECKS), default=None)
    args = parser.parse_args(argv)
    device = torch.device(args.device)
    # Float32 on both devices: TF32 would put ~1e-3 between them by design.
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    report: dict[str, Any] = {
        "device": str(device), "torch": torch.__version__,
        "device_name": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
        "tolerance": TOLERANCE, "checks": {}}
    failures = 0
    for name in args.only or CHECKS:
        try:
            result = CHECKS[name](device)
        except Exception as exc:  # one broken check must not hide the others' figures
            result = {"exception": f"{type(exc).__name__}: {exc}",
                      "traceback": traceback.format_exc()}
        ok = passed(name, result)
        failures += not ok
        result["passed"] = ok
        report["checks"][name] = result
        shown = {k: v for k, v in result.items() if k != "traceback"}
        print(f"{'PASS' if ok else 'FAIL'} {name}: {json.dumps(shown, default=str)}", flush=True)
        if "traceback" in result:
            print(result["traceback"], flush=True)
    if args.out:
        Path(args.out).write_text(json.dumps(report, indent=2, default=str))
    print(f"cuda_compare on {report['device_name']} (torch {torch.__version__}): "
          f"{len(report['checks']) - failures} passed, {failures} failed", flush=True)
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
