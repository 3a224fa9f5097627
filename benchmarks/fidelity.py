"""Each seed paper's claim as the paired comparison the paper makes, over seeds, with a 95 % CI.

    python benchmarks/fidelity.py --quick                   # CI smoke: 2 seeds, < 3 min, 2 cores
    python benchmarks/fidelity.py --scale cpu               # 3 seeds, about an hour on 2 cores
    python benchmarks/fidelity.py --scale gpu --device cuda # ResNet-18, one GPU
    options: --claims mcl_trifeature,hscl_spectral  --seeds 5  --json-out fidelity.jsonl
             --cifar10 DIR --cifar100 DIR (the python batches as distributed; else Fashion-MNIST)
             --fashion-mnist DIR (the four IDX files; default Debian's dataset-fashion-mnist)

Every arm is a raycl trial: the search file's config with the claim's overrides, trained and
scored by the worker loop a Ray trial runs (``raycl.worker.loop.run_trial_loop``) in this
process, with no Ray: it runs on a bare GPU machine. Within a claim the arms differ only in the
method or its knob; each seed trains every arm on the same data (``data.seed`` fixed, as
raycl's seed confirmation), so the arms are paired seed by seed. The paired difference and its
interval are raycl's seed confirmation's (``raycl.sweep.confirmation``: ``Confirmed``,
``paired_differences``, ``t_interval``). Selection plays no part: every arm runs its file's
fixed settings, and test is reported (validation beside it).

One JSON line per claim (stdout and ``--json-out``): ``claim``, ``method``, ``baseline``,
``dataset``, ``metric``, ``split`` (test), ``method_mean``, ``baseline_mean``, ``delta``,
``ci95`` (of the paired delta), ``seeds``, the per-seed values (``method_values``,
``baseline_val_values``, ...), ``val_delta``/``val_ci95``,
``paper_delta`` and ``paper``, ``at_init_mean`` (the method's encoder before training, scored
by the same probe: what a number is read against), ``per_attribute`` (MCL's shape and texture
each), ``verdict`` (``reproduced`` when the interval excludes 0 in the
paper's direction, ``opposite`` when it excludes 0 the other way, ``inconclusive`` otherwise)
and ``wall_s``. Results: docs/benchmarks.md, "Fidelity: each seed's claim".
"""

from __future__ import annotations

import argparse
import json
import math
import shutil
import statistics
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))  # run as a script from anywhere, as the other benchmarks

SEARCHES = REPO / "searches"
SCALES = ("quick", "cpu", "gpu")
DEFAULT_SEEDS = {"quick": 2, "cpu": 3, "gpu": 3}
DATA_SEED = 0  # every arm and seed trains and is scored on the same data (paired seeds)
FIXED = "tune.search_space={}"  # every arm runs its file's settings: nothing is searched
REPRODUCED, OPPOSITE, INCONCLUSIVE = "reproduced", "opposite", "inconclusive"
LINEAR = "linear"  # the probe family of every claim but CLIP's (MMVP)
AT_INIT = "at init"  # the reports of the method's encoder before training


@dataclass(frozen=True)
class Arm:
    """One side of a claim.

    Attributes:
        label: what the JSON line calls it (``hscl p=0.3``).
        overrides: ``--set`` lines on top of the claim's (the method or its knob).
        prefix: the metric's prefix in the trial's report: ``stage0/`` reads MCL's first stage
            alone from the same trial as the integrated representation.
    """

    label: str
    overrides: tuple[str, ...] = ()
    prefix: str = ""


@dataclass(frozen=True)
class Claim:
    """A paper's claim as a paired comparison.

    Attributes:
        name: the claim's id (``--claims``).
        search: the search file whose settings every arm starts from.
        method, baseline: the two arms; ``others``: further baselines (their own deltas).
        attributes: the probe attributes averaged into the metric (``mean``: the trial's mean).
        family: the metric family (``linear``, ``mmvp``).
        paper_delta: the paper's method - baseline on its own data, in the metric's unit (0-1).
        paper: where that number comes from.
        pretrain: overrides of a run before the arms whose final weights every arm starts from
            (``pretrained_key``), trained once on the claim's data (the papers start from
            pretrained encoders); empty: the arms start from scratch.
    """

    name: str
    search: str
    method: Arm
    baseline: Arm
    attributes: tuple[str, ...]
    family: str
    paper_delta: float
    paper: str
    others: tuple[Arm, ...] = ()
    pretrain: tuple[str, ...] = ()
    pretrained_key: str = "model.pretrained"

    def metric(self, split: str) -> str:
        """``test/linear shape+texture (mean)`` or ``test/linear/mean``: how the JSON line names
        it."""
        if len(self.attributes) == 1:
            return f"{split}/{self.family}/{self.attributes[0]}"
        return f"{split}/{self.family} {'+'.join(self.attributes)} (mean)"

    def value(self, report: dict[str, float], arm: Arm, split: str) -> float:
        """The arm's metric in a trial's report (the mean of the attributes); NaN if missing."""
        values = [report.get(f"{arm.prefix}{split}/{self.family}/{name}", math.nan)
                  for name in self.attributes]
        return sum(values) / len(values)


@dataclass
class Settings:
    """What a scale fixes for every claim, as ``--set`` lines per kind of data."""

    trifeature: tuple[str, ...]
    images: tuple[str, ...]  # Fashion-MNIST / CIFAR through the comparison's search file
    mcl: tuple[str, ...]
    clip: tuple[str, ...]
    clip_pretrain: tuple[str, ...]
    fgvr_pretrain: tuple[str, ...]
    clip_single_epochs: int
    fgvr: tuple[str, ...] = ()
    all4one: tuple[str, ...] = ()


def scale_settings(scale: str) -> Settings:
    """The sizes of a scale: ``quick`` seconds a trial; ``cpu`` the largest whose whole run
    (5 claims, 3 seeds) fits about an hour on 2 cores; ``gpu`` ResNet-18 at the papers' batch."""
    if scale == "quick":
        return Settings(
            trifeature=("data.samples_per_combination=1", "model.width=8", "train.epochs=1",
                        "eval.diagnostics=false"),
            images=("data.num_samples=1000", "model.width=8", "train.epochs=1",
                    "train.batch_size=128", "eval.diagnostics=false"),
            mcl=("mcl.stages=2", "mcl.clusters=2", "train.batch_size=128"),
            clip=("mcl.stages=2", "mcl.clusters=2", "train.epochs=1",
                  "data.samples_per_combination=1"),
            clip_pretrain=("train.epochs=1", "data.samples_per_combination=1"),
            clip_single_epochs=2,
            fgvr_pretrain=("train.epochs=1",),
            fgvr=("fgvr.decoder_epochs=1", "fgvr.memory_size=256", "mocov2.queue_size=512"),
            all4one=("all4one.queue_size=512",))
    if scale == "cpu":  # the search files' own sizes: about an hour for 5 claims x 3 seeds
        return Settings(
            trifeature=("data.samples_per_combination=5", "train.epochs=4"),
            images=("data.num_samples=7000", "train.epochs=4"),
            mcl=("mcl.stages=3", "mcl.clusters=2"),
            clip=("mcl.stages=3", "mcl.clusters=3", "train.epochs=5"),
            clip_pretrain=("train.epochs=20", "train.batch_size=256"),
            clip_single_epochs=15,
            fgvr_pretrain=("train.epochs=4",),
            fgvr=("fgvr.decoder_epochs=2", "fgvr.memory_size=1024", "mocov2.queue_size=2048"),
            all4one=("all4one.queue_size=1024",))
    # ResNet-18 (CIFAR stem), the papers' batch; sized for ~8 min on one H100 from the 1.2-2e4
    # two-view images/s measured at 32 px (docs/benchmarks.md): an estimate, not yet run.
    if scale == "gpu":
        resnet = ("model.backbone=resnet18", "model.stem=cifar", "model.projector_dim=128",
                  "model.projector_hidden_dim=2048", "data.on_device=true",
                  "eval.diagnostics=false")
        return Settings(
            trifeature=(*resnet, "data.samples_per_combination=5", "train.epochs=20"),
            images=(*resnet, "data.num_samples=20000", "train.epochs=10",
                    "train.batch_size=256"),
            mcl=("mcl.stages=3", "mcl.clusters=2"),
            clip=("mcl.stages=3", "mcl.clusters=3", "train.epochs=5"),
            clip_pretrain=("train.epochs=20", "train.batch_size=256"),
            clip_single_epochs=15,
            fgvr_pretrain=("train.epochs=10",),
            fgvr=("fgvr.memory_size=5632", "mocov2.queue_size=16384"),
            all4one=("all4one.queue_size=16384",))
    raise ValueError(f"scale must be one of {', '.join(SCALES)}, got {scale!r}")


def image_data(dataset: str, root: str | None) -> tuple[str, ...]:
    """``--set`` lines that point the comparison's search file at ``dataset``."""
    lines = [f"data.dataset={dataset}"]
    if root:
        lines.append(f"data.root={root}")
    if dataset.startswith("cifar"):  # 3 colour channels: the file's grey-image augmentation
        lines += ["data.resolution=32", "augment.color_jitter=0.4"]
    return tuple(lines)


def claims(settings: Settings) -> list[Claim]:
    """The five claims of issue 49 at ``settings``' sizes."""
    mcl = Arm("mcl (integrated stages)")
    return [
        Claim("mcl_trifeature", "mcl_shape_texture.yaml", mcl,
              Arm("mcl stage 0 (= simclr)", prefix="stage0/"),
              ("shape", "texture"), LINEAR, (0.31 + 0.07) / 2,
              "MCL Tab. 2, Trifeature tau=0.5: shape 0.44 -> 0.75, texture 0.92 -> 0.99 "
              "(SimCLR -> MCL)",
              # The mechanism: the same stages with ordinary negatives are an ensemble of
              # three encoders; what MCL gains over it is the feature-aware negatives' share.
              others=(Arm("mcl without feature-aware negatives (ensemble of 3)",
                          ("mcl.negatives=none",)),)),
        Claim("hscl_spectral", "compare_hscl_simclr.yaml",
              Arm("hscl p=0.3", ("method=hscl", "hscl.filter_exponent=0.3")),
              Arm("spectral cl", ("method=spectral",)), ("mean",), LINEAR, 0.9056 - 0.8607,
              "HSCL Tab. 3, CIFAR-10 linear: Spectral CL 86.07 -> HSCL p=0.3 90.56",
              others=(Arm("simclr", ("method=simclr",)),)),
        Claim("all4one_nnclr", "compare_hscl_simclr.yaml",
              Arm("all4one", ("method=all4one", *settings.all4one)),
              Arm("nnclr", ("method=nnclr",)), ("mean",), LINEAR, 0.7217 - 0.6962,
              "All4One Tab. 1, CIFAR-100 linear: NNCLR 69.62 -> All4One 72.17"),
        Claim("fgvr_mocov2", "compare_hscl_simclr.yaml",
              Arm("fgvr (moco v2 base)", ("method=fgvr", "fgvr.base=mocov2", *settings.fgvr)),
              Arm("moco v2", ("method=mocov2",
                              *(line for line in settings.fgvr if line.startswith("mocov2.")))),
              ("mean",), LINEAR, 0.03,
              "FGVR Tab. 1: +2 to +4 points linear top-1 over MoCo v2 (fine-grained sets, "
              "from ImageNet weights)", pretrain=("method=mocov2", *settings.fgvr_pretrain)),
        Claim("mcl_clip_mmvp", "clip_mcl.yaml", Arm("mcl on clip (concat)"),
              Arm("one-stage tuning, same epochs",
                  ("method=clip", f"train.epochs={settings.clip_single_epochs}")),
              ("mean",), "mmvp", 0.326 - 0.200,
              "MCL Tab. 7, MMVP average: OpenAI 20.0 -> MCL concat 32.6 (against the untuned "
              "model; here against tuning for the same epochs)",
              pretrain=("method=clip", "clip.train_text=true", "clip.trainable_blocks=4",
                        "data.captions={color: 1.0, shape: 0.3, texture: 0.1}",
                        "train.lr=0.001", "train.lr_schedule=cosine", "train.warmup_epochs=1",
                        *settings.clip_pretrain),
              pretrained_key="clip.pretrained"),
    ]


def claim_overrides(claim: Claim, settings: Settings, roots: dict[str, str | None]
                    ) -> list[str]:
    """The claim's ``--set`` lines shared by its arms (and its pretraining); ``roots``: where
    CIFAR-10/100 and Fashion-MNIST lie (:func:`image_data_for`)."""
    if claim.search == "mcl_shape_texture.yaml":
        return [FIXED, "tune.objectives=null", "tune.metric=val/linear/mean", "tune.mode=max",
                *settings.trifeature, *settings.mcl]
    if claim.search == "clip_mcl.yaml":
        return [FIXED, *settings.clip]
    return [FIXED, "tune.compare=null", "tune.confirm=null", *settings.images,
            *image_data_for(claim, roots)]


def verdict(low: float, high: float, paper_delta: float) -> str:
    """``reproduced`` when the interval ``[low, high]`` of method - baseline excludes 0 on the
    paper's side, ``opposite`` when it excludes 0 on the other, ``inconclusive`` otherwise
    (an unknown bound too).

    Example:
        >>> verdict(0.01, 0.05, 0.04), verdict(-0.05, -0.01, 0.04), verdict(-0.01, 0.02, 0.04)
        ('reproduced', 'opposite', 'inconclusive')
    """
    if math.isnan(low) or math.isnan(high) or paper_delta == 0:
        return INCONCLUSIVE
    side = 1.0 if paper_delta > 0 else -1.0
    if side * low > 0 and side * high > 0:
        return REPRODUCED
    if side * low < 0 and side * high < 0:
        return OPPOSITE
    return INCONCLUSIVE


def paired_summary(seeds: Sequence[int], method: Sequence[tuple[float, float]],
                   baseline: Sequence[tuple[float, float]], paper_delta: float
                   ) -> dict[str, Any]:
    """Means, the paired test delta with its 95 % interval and the verdict (and the same on
    validation) from each seed's ``(val, test)`` of the two arms, through raycl's seed
    confirmation's statistics: a seed missing on either side (NaN) leaves the pair out."""
    from raycl.sweep.confirmation import Confirmed, paired_differences, t_interval

    sides = []
    for values in (method, baseline):
        side = Confirmed(rank=len(sides) + 1, values={}, seeds=list(seeds))
        for seed, (val, test) in zip(seeds, values, strict=True):
            side.add(seed, val, test)
        sides.append(side)
    out: dict[str, Any] = {}
    for split, prefix in (("test", ""), ("val", "val_")):
        delta, low, high = t_interval(paired_differences(sides[0], sides[1], split))
        out[f"{prefix}delta"] = _rounded(delta)
        out[f"{prefix}ci95"] = [_rounded(low), _rounded(high)]
        if split == "test":
            out["method_mean"] = _rounded(t_interval(sides[0].test)[0])
            out["baseline_mean"] = _rounded(t_interval(sides[1].test)[0])
            out["verdict"] = verdict(low, high, paper_delta)
    for name, values in (("method", method), ("baseline", baseline)):  # in ``seeds``' order
        out[f"{name}_values"] = [_rounded(test) for _, test in values]
        out[f"{name}_val_values"] = [_rounded(val) for val, _ in values]
    return out


def _rounded(value: float) -> float | None:
    return None if math.isnan(value) else round(value, 4)


class _Runner:
    """Runs a claim's trials in this process (raycl's worker loop, no Ray) and keeps each
    trial's last reported value of every metric."""

    def __init__(self, device: str, workdir: Path, log: Callable[[str], None]) -> None:
        import torch

        self.device = torch.device(device)
        self.workdir = workdir
        self.log = log

    def config(self, search: str, overrides: Sequence[str]) -> Any:
        """The trial's config: the search file with ``overrides``, on this runner's device."""
        from raycl.launch.load import load_search

        return load_search(SEARCHES / search, [
            *overrides, f"tune.storage_path={self.workdir / 'ray'}",
            f"scaling.use_gpu={self.device.type == 'cuda'}"])

    def at_init(self, search: str, overrides: Sequence[str]) -> dict[str, float]:
        """The trial's encoder before any training (``model.pretrained``'s weights where set)
        scored by the trial's own probes on its data: the floor its number is read against."""
        from raycl.data import load_dataset
        from raycl.eval.scoring import evaluate_features
        from raycl.export.encoder import at_init_encoder
        from raycl.worker.embed import OneProcess, embed_images

        config = self.config(search, overrides)
        splits = load_dataset(config.data, config.data_seed)
        encoder = at_init_encoder(config, splits.channels).to(self.device)
        features = {name: embed_images(encoder, splits.split(name).images,
                                       OneProcess(self.device), embed=encoder)
                    for name in ("train", "val", "test")}
        return evaluate_features(config, splits, features, device=self.device)

    def trial(self, search: str, overrides: Sequence[str], keep_checkpoint: bool = False
              ) -> tuple[dict[str, float], Path | None]:
        """The trial's metrics, and the directory of its last checkpoint when
        ``keep_checkpoint`` (the others are deleted as the trial ends)."""
        from raycl.worker.context import TrialContext
        from raycl.worker.loop import run_trial_loop
        from raycl.worker.outcome import FAILED_KEY
        from raycl.worker.session import InProcessSession

        config = self.config(search, overrides)
        session = InProcessSession(self.device)
        metrics: dict[str, float] = {}
        report = session.report

        def keep(values: dict[str, Any], checkpoint_dir: str | None) -> None:
            report(values, checkpoint_dir)
            metrics.update({key: value for key, value in values.items()
                            if isinstance(value, int | float)})

        session.report = keep  # type: ignore[method-assign]
        started = time.perf_counter()
        run_trial_loop(TrialContext(config=config), session)
        self.log(f"  {time.perf_counter() - started:6.1f} s  {' '.join(overrides[-4:])}")
        last = session.last_checkpoint_dir
        if metrics.get(FAILED_KEY):
            self.log(f"  failed: {metrics}")
            metrics = {}
        if not (keep_checkpoint and metrics and last):
            if last:
                shutil.rmtree(last, ignore_errors=True)
            return metrics, None
        kept = self.workdir / f"checkpoint_{len(list(self.workdir.glob('checkpoint_*')))}"
        shutil.move(last, kept)
        return metrics, kept


def run_claim(claim: Claim, shared: list[str], seeds: Sequence[int], runner: _Runner
              ) -> dict[str, Any]:
    """Every arm of ``claim`` over ``seeds`` (an arm reading another's trial, MCL's stage 0,
    shares it), then the claim's JSON line."""
    started = time.perf_counter()
    base = [*shared, f"data.seed={DATA_SEED}"]
    if claim.pretrain:
        runner.log(f"{claim.name}: pretraining")
        _, checkpoint = runner.trial(claim.search, [*base, "seed=0", *claim.pretrain],
                                     keep_checkpoint=True)
        if checkpoint is None:  # every arm would start from nothing: stop here, not in each arm
            raise RuntimeError(f"{claim.name}: the pretraining run failed (its report above)")
        base.append(f"{claim.pretrained_key}={checkpoint / 'state.pt'}")
    arms = [claim.method, claim.baseline, *claim.others]
    reports: dict[str, list[dict[str, float]]] = {arm.label: [] for arm in arms}
    reports[AT_INIT] = []
    for seed in seeds:
        trials: dict[tuple[str, ...], dict[str, float]] = {}
        for arm in arms:
            if arm.overrides not in trials:
                runner.log(f"{claim.name}: {arm.label}, seed {seed}")
                trials[arm.overrides] = runner.trial(
                    claim.search, [*base, f"seed={seed}", *arm.overrides])[0]
            reports[arm.label].append(trials[arm.overrides])
        if claim.family == LINEAR:  # the method's encoder untrained, as the same probes see it
            reports[AT_INIT].append(runner.at_init(
                claim.search, [*base, f"seed={seed}", *claim.method.overrides]))
    line = {"claim": claim.name, "method": claim.method.label, "baseline": claim.baseline.label,
            "dataset": runner.config(claim.search, base).data.dataset,
            "metric": claim.metric("test"), "split": "test",
            **_compare(claim, claim.baseline, reports, seeds), "seeds": list(seeds),
            "paper_delta": round(claim.paper_delta, 4), "paper": claim.paper}
    if reports[AT_INIT]:  # how far training moved either arm from a random (or pretrained) start
        untrained = Arm(AT_INIT)
        for key, split in (("at_init_mean", "test"), ("at_init_val_mean", "val")):
            line[key] = _rounded(statistics.fmean(
                claim.value(report, untrained, split) for report in reports[AT_INIT]))
    line["also"] = [{"baseline": other.label, **_compare(claim, other, reports, seeds)}
                    for other in claim.others]
    if len(claim.attributes) > 1:  # MCL's shape and texture each: which one moved
        line["per_attribute"] = {name: _compare(replace(claim, attributes=(name,)),
                                                claim.baseline, reports, seeds)
                                 for name in claim.attributes}
    line["wall_s"] = round(time.perf_counter() - started, 1)
    return line


def _compare(claim: Claim, baseline: Arm, reports: dict[str, list[dict[str, float]]],
             seeds: Sequence[int]) -> dict[str, Any]:
    """:func:`paired_summary` of the claim's method against ``baseline`` from the trials'
    reports."""
    def values(arm: Arm) -> list[tuple[float, float]]:
        return [(claim.value(report, arm, "val"), claim.value(report, arm, "test"))
                for report in reports[arm.label]]

    return paired_summary(seeds, values(claim.method), values(baseline), claim.paper_delta)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--scale", choices=SCALES, default="cpu")
    parser.add_argument("--quick", action="store_true", help="the same as --scale quick")
    parser.add_argument("--claims", help="comma-separated claim names (default: all five)")
    parser.add_argument("--seeds", type=int, help="seeds per claim (default: 2 quick, else 3)")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--cifar10")
    parser.add_argument("--cifar100")
    parser.add_argument("--fashion-mnist")
    parser.add_argument("--json-out")
    args = parser.parse_args(argv)
    scale = "quick" if args.quick else args.scale
    seeds = list(range(args.seeds or DEFAULT_SEEDS[scale]))
    if len(seeds) < 2:
        parser.error("--seeds: at least 2 (a paired interval needs two)")
    settings = scale_settings(scale)
    roots = {"cifar10": args.cifar10, "cifar100": args.cifar100,
             "fashion_mnist": args.fashion_mnist}
    chosen = claims(settings)
    if args.claims:
        names = args.claims.split(",")
        unknown = sorted(set(names) - {claim.name for claim in chosen})
        if unknown:
            parser.error(f"--claims: unknown {', '.join(unknown)}; the claims are "
                         f"{', '.join(claim.name for claim in chosen)}")
        chosen = [claim for claim in chosen if claim.name in names]
    _quiet_logs()
    workdir = Path(tempfile.mkdtemp(prefix="raycl-fidelity-"))
    runner = _Runner(args.device, workdir,
                     lambda text: print(text, file=sys.stderr, flush=True))
    try:
        for claim in chosen:
            line = run_claim(claim, claim_overrides(claim, settings, roots), seeds, runner)
            line.update(scale=scale, device=args.device)
            if scale == "quick":  # 143 test images, one epoch: a 0-width interval happens
                line["note"] = "quick: toy sizes; a smoke test, its verdict is no evidence"
            print(json.dumps(line), flush=True)
            if args.json_out:  # each claim as it ends: an interrupted run keeps the others
                with Path(args.json_out).open("a") as out:
                    out.write(json.dumps(line) + "\n")
    finally:
        shutil.rmtree(workdir, ignore_errors=True)
    return 0


def image_data_for(claim: Claim, roots: dict[str, str | None]) -> tuple[str, ...]:
    """The image claims' data: CIFAR-10 for HSCL and CIFAR-100 for All4One and FGVR where
    given (the papers' data), Fashion-MNIST otherwise."""
    wanted = "cifar10" if claim.name == "hscl_spectral" else "cifar100"
    if roots[wanted]:
        return image_data(wanted, roots[wanted])
    return image_data("fashion_mnist", roots["fashion_mnist"])


def _quiet_logs() -> None:
    import logging
    import warnings

    logging.basicConfig(level=logging.WARNING)
    warnings.filterwarnings("ignore")


if __name__ == "__main__":
    sys.exit(main())
