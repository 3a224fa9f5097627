"""Stream mode (``data.loader: stream``, issue 23): memory that does not grow with the dataset,
and images/s against a torchvision ``ImageFolder`` + ``DataLoader`` on the same cores.

    python benchmarks/stream.py memory 10000 100000              # the issue's sizes (~10-15 min)
    python benchmarks/stream.py throughput 20000 --repeats 3 --workers 1
    python benchmarks/stream.py memory 500 1000 --steps 10       # a quick check that it runs
    python benchmarks/stream.py throughput 1000 --repeats 1 --batches 5 --warmup 1

Two commands, each writing its section of one JSON file (``--out``, default
``benchmarks/stream.json``; the other command's section is kept) and printing a markdown table.
Folders of N distinct 64x64 JPEGs (10 class sub-folders) are written once under ``--workdir``
(default ``/tmp/raycl-bench-stream``, ``images-N/``) and reused by later runs; memory mode's
decoded cache goes to ``<workdir>/cache``. Every measurement runs in a fresh Python process
(this script with ``--child``); the parent imports neither torch nor Ray, so it stays small: a
child's ``ru_maxrss`` starts from its parent's at ``exec``.

``memory N1 N2 ...``: for each folder a training process as a trial runs it in stream mode:
``searches/quickstart.yaml`` with ``data.dataset: folder``, ``data.loader: stream``,
``data.resolution: 64``, ``train.batch_size: 256``, ``model.width: 16``; a local Ray of its own
(``ray.init(address="local", num_cpus=W)``: W decoding tasks at once), ``load_dataset``,
``trial_training_images``, ``build_loader``, then ``--steps`` optimizer steps of the real
method (SimCLR's ``method(Batch(...))`` on two ``BatchAugment`` views, as
``raycl.worker.epoch`` builds it), epoch after epoch. Reported: the process's peak RSS
(``resource.getrusage(RUSAGE_SELF).ru_maxrss``), its RSS after ``ray.init`` (before any data)
and the ratio of the largest set's peak to the smallest's (the issue: < 1.10 for 10x the
images). What that RSS covers: the training process alone: its own memory, plus the pages of
Ray's object store (shared memory) it has touched while reading a batch. The decoding tasks run
in Ray's worker processes and the object store lives in the raylet: none of it is in that
figure; their RSS, summed and sampled every 0.25 s, is reported beside it (``ray_rss``; it
counts a shared object-store page once in each process that maps it), and so is the peak of
the object store's use (``object_store_peak``: decoded batches not yet read, the epoch's file
lists; read through Ray's private ``get_memory_info_reply``, left out when it is not there).

``throughput N``: images/s of three loaders making the same two views of 64 px batches of 256,
over ``--batches`` batches after ``--warmup`` batches (Ray's start, the workers' start and the
first batches are not timed), ``--repeats`` times, the loaders' order rotated every repeat:

- ``torchvision``: ``ImageFolder`` over the folder, ``DataLoader(num_workers=W, shuffle=True,
  drop_last=True)``, per sample ``RandomResizedCrop(64, scale=(0.2, 1))``, horizontal flip,
  ``ToTensor``, ``Normalize(0.5, 0.5)``, twice (two views), collated by the workers;
- ``stream``: raycl's stream loader over the same folder (Ray Data tasks decode a batch each,
  W at once), then ``BatchAugment`` twice on the batch in the training process (crop scale
  (0.2, 1), flip, no colour jitter or grayscale: quickstart's, the same as the baseline's);
- ``memory``: raycl's memory mode over the same folder (its decoded cache built first, not
  timed; ``train.loader_workers: 0``, batches read from the memory map in the training
  process), then the same ``BatchAugment``: the record that memory mode stays as fast as after
  the datasets issue (issue 22). It uses the training process only, no decoders.

Same cores for both decoders: W worker processes decode (DataLoader workers / Ray tasks on a
Ray with ``num_cpus=W``), and the training process, which makes the views in stream and memory
mode, runs torch on one thread in all three (DataLoader workers run one each too). Both use
W + 1 cores, plus Ray's own processes (raylet, GCS) in stream mode, which are part of its cost.
Pass ``--workers`` = cores - 1 on a quiet machine (1 on a 2-core one). Reported: the median
images/s of the repeats, their min-max, and the ratios of the medians. No model step is timed:
the loaders are compared, not the training.

Not run by the test suite.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import resource
import statistics
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Generator, Iterator
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import numpy as np

REPO = Path(__file__).resolve().parents[1]
SIDE = 64  # of the JPEGs and of the decoded images (data.resolution)
CLASSES = 10
BATCH = 256  # train.batch_size
WIDTH = 16  # model.width of the small CNN
LOADERS = ("torchvision", "stream", "memory")


def write_jpegs(folder: Path, count: int, seed: int = 0) -> None:
    """``count`` distinct SIDE x SIDE JPEGs in ``folder/class<k>/`` (kept when complete)."""
    from PIL import Image

    marker = folder / ".complete"
    if marker.exists():
        return
    print(f"writing {count} JPEGs to {folder} ...", file=sys.stderr, flush=True)
    rng = np.random.default_rng(seed)
    for index in range(count):
        # Smooth colour fields with some noise: JPEG sizes and decode costs like photos'.
        coarse = rng.integers(0, 256, (4, 4, 3), dtype=np.uint8)
        image = Image.fromarray(coarse).resize((SIDE, SIDE), Image.Resampling.BILINEAR)
        noisy = np.asarray(image, dtype=np.int16) + rng.integers(-12, 13, (SIDE, SIDE, 3))
        path = folder / f"class{index % CLASSES:02d}" / f"{index:06d}.jpg"
        path.parent.mkdir(parents=True, exist_ok=True)
        Image.fromarray(np.clip(noisy, 0, 255).astype(np.uint8)).save(path, quality=90)
    marker.write_text(f"{count}\n")


# --- in the child: raycl's config, loader and a training step ----------------------------------


def trial_config(folder: Path, cache: Path, loader: str) -> Any:
    """quickstart.yaml on the folder at 64 px, ``data.loader`` = ``loader``."""
    from raycl.launch.load import load_search

    overrides = ["data.dataset=folder", f"data.root={folder}", "data.layout=flat",
                 f"data.loader={loader}", f"data.resolution={SIDE}", f"data.cache_dir={cache}",
                 f"train.batch_size={BATCH}", f"model.width={WIDTH}", "train.loader_workers=0"]
    # No reference checks: they would open every file's header before the measurement.
    return load_search(REPO / "searches" / "quickstart.yaml", overrides, check_references=False)


def raycl_loader(config: Any) -> tuple[Any, Any]:
    """The trial's training images and its stage-0 loader, as a single-process trial builds
    them (rank 0 of 1, on the CPU)."""
    import torch

    from raycl.data import load_dataset
    from raycl.worker.loader import build_loader, trial_training_images
    from raycl.worker.stage_integration import StageInputs

    session = SimpleNamespace(rank=0, world_size=1, device=torch.device("cpu"))
    data = load_dataset(config.data, config.seed)
    images = trial_training_images(config, data, torch.device("cpu"))
    return images, build_loader(config, images, StageInputs(), session)  # type: ignore[arg-type]


def endless(loader: Any) -> Iterator[Any]:
    """The loader's batches (:class:`raycl.worker.batches.TrainBatch`), epoch after epoch
    (each epoch reshuffled)."""
    epoch = 0
    while True:
        loader.set_epoch(epoch)
        yield from loader
        epoch += 1


def start_ray(workers: int) -> None:
    """A local Ray of its own with ``workers`` CPUs: that many decoding tasks at once."""
    import logging

    import ray
    import ray.data  # configures its loggers on import: quieted below

    # address="local": a Ray of its own even when another one runs on this machine.
    ray.init(address="local", num_cpus=workers, include_dashboard=False,
             logging_level=logging.WARNING, log_to_driver=False)
    logging.getLogger("ray.data").setLevel(logging.WARNING)  # no line per epoch's dataset


def descendants_rss_mb() -> float:
    """RSS summed over this process's descendants (Ray's raylet, GCS and workers), in MB."""
    parents: dict[int, int] = {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                stat = (entry / "stat").read_text()
                parents[int(entry.name)] = int(stat.rsplit(")", 1)[1].split()[1])
            except (OSError, IndexError, ValueError):
                continue
    mine, frontier = set(), [os.getpid()]
    while frontier:
        parent = frontier.pop()
        children = [pid for pid, ppid in parents.items() if ppid == parent]
        mine.update(children)
        frontier.extend(children)
    total_kb = 0
    for pid in mine:
        try:
            for line in Path(f"/proc/{pid}/status").read_text().splitlines():
                if line.startswith("VmRSS:"):
                    total_kb += int(line.split()[1])
        except OSError:
            continue
    return total_kb / 1024


def object_store_probe() -> Callable[[], float] | None:
    """A function giving the MB used in this Ray's object store (decoded batches waiting to be
    read, the epoch's file lists), or None when Ray's private API for it is not there."""
    try:
        import ray
        from ray._private.internal_api import get_memory_info_reply, get_state_from_address

        state = get_state_from_address(ray.get_runtime_context().gcs_address)
        get_memory_info_reply(state)
    except Exception:  # a private API: its absence only drops a column
        return None
    return lambda: get_memory_info_reply(state).store_stats.object_store_bytes_used / 2**20


class PeakSampler:
    """Samples the Ray processes' RSS (:func:`descendants_rss_mb`) and the object store's use
    every ``period`` seconds on a thread; keeps their peaks (MB; the store's None when it
    cannot be read)."""

    def __init__(self, period: float = 0.25) -> None:
        self.period, self.peak = period, 0.0
        self.store_probe = object_store_probe()
        self.store_peak: float | None = 0.0 if self.store_probe else None
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        while not self._stop.is_set():
            self.peak = max(self.peak, descendants_rss_mb())
            if self.store_probe is not None and self.store_peak is not None:
                self.store_peak = max(self.store_peak, self.store_probe())
            self._stop.wait(self.period)

    def __enter__(self) -> PeakSampler:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()


def rss_mb() -> tuple[float, float]:
    """This process's (current RSS, peak RSS) in MB."""
    current = 0.0
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            current = int(line.split()[1]) / 1024
    return current, resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # kB on Linux


def child_memory(args: argparse.Namespace) -> dict[str, Any]:
    """Train ``args.steps`` steps in stream mode on the folder; this process's memory."""
    import ray
    import torch

    from raycl.data.augment import BatchAugment, to_float
    from raycl.methods import build_method
    from raycl.methods.base import Batch

    torch.manual_seed(0)
    start_ray(args.workers)
    try:
        with PeakSampler() as ray_memory:
            after_ray, _ = rss_mb()
            config = trial_config(Path(args.folder), Path(args.cache), "stream")
            images, loader = raycl_loader(config)
            after_load, _ = rss_mb()
            method = build_method(config, 3)
            optimizer = torch.optim.AdamW(method.parameters(), lr=config.train.lr)
            augment = BatchAugment(config.augment)
            started, losses = time.perf_counter(), []
            for step, loaded in enumerate(endless(loader)):
                if step == args.steps:
                    break
                batch = loaded.images
                views = [augment(batch, view=0), augment(batch, view=1)]
                loss = method(Batch(images=to_float(batch), views=views,
                                    index=loaded.index))["loss"]
                optimizer.zero_grad(set_to_none=True)
                loss.backward()
                optimizer.step()
                losses.append(float(loss.detach()))
            seconds = time.perf_counter() - started
            current, peak = rss_mb()
    finally:
        ray.shutdown()
    return {"images": int(args.size), "train_images": len(images), "steps": len(losses),
            "steps_per_epoch": len(loader), "seconds": seconds, "after_ray_mb": after_ray,
            "after_load_mb": after_load, "end_rss_mb": current, "peak_rss_mb": peak,
            "ray_rss_peak_mb": ray_memory.peak, "object_store_peak_mb": ray_memory.store_peak,
            "last_loss": losses[-1] if losses else None}


class TwoViews:
    """Two independent draws of a per-sample transform (the baseline's views)."""

    def __init__(self, transform: Any) -> None:
        self.transform = transform

    def __call__(self, image: Any) -> tuple[Any, Any]:
        return self.transform(image), self.transform(image)


def torchvision_batches(args: argparse.Namespace) -> Generator[int, None, None]:
    """The baseline: ``ImageFolder`` + ``DataLoader`` making both views per sample in its
    workers; yields each batch's size."""
    import torch
    from torchvision import datasets, transforms

    view = transforms.Compose([
        transforms.RandomResizedCrop(SIDE, scale=(0.2, 1.0)),
        transforms.RandomHorizontalFlip(),
        transforms.ToTensor(),
        transforms.Normalize((0.5, 0.5, 0.5), (0.5, 0.5, 0.5)),
    ])
    folder = datasets.ImageFolder(args.folder, transform=TwoViews(view))
    loader = torch.utils.data.DataLoader(folder, batch_size=BATCH, shuffle=True, drop_last=True,
                                         num_workers=args.workers)
    while True:
        for (first, _second), _labels in loader:
            yield len(first)


def raycl_batches(args: argparse.Namespace, loader_kind: str) -> Generator[int, None, None]:
    """raycl's stream or memory loader, then two ``BatchAugment`` views in this process."""
    from raycl.data.augment import BatchAugment

    config = trial_config(Path(args.folder), Path(args.cache), loader_kind)
    _, loader = raycl_loader(config)  # memory mode: the cache is built here, before timing
    augment = BatchAugment(config.augment)
    for loaded in endless(loader):
        views = [augment(loaded.images, view=0), augment(loaded.images, view=1)]
        yield len(views[0])


def child_throughput(args: argparse.Namespace) -> dict[str, Any]:
    """Images/s of one loader over ``args.batches`` batches after ``args.warmup``."""
    import ray
    import torch

    torch.set_num_threads(1)  # the training process: one core in every loader (see docstring)
    torch.manual_seed(0)
    if args.loader == "stream":
        start_ray(args.workers)
    try:
        batches = (torchvision_batches(args) if args.loader == "torchvision"
                   else raycl_batches(args, args.loader))
        for _ in range(args.warmup):
            next(batches)
        started, images = time.perf_counter(), 0
        for _ in range(args.batches):
            images += next(batches)
        seconds = time.perf_counter() - started
        batches.close()  # stops the workers / the Ray Data pipeline before Ray
    finally:
        if ray.is_initialized():
            ray.shutdown()
    return {"loader": args.loader, "images": images, "seconds": seconds,
            "images_per_s": images / seconds}


CHILDREN = {"memory": child_memory, "throughput": child_throughput}


# --- in the parent: children, tables, the JSON ---------------------------------------------------


def run_child(mode: str, folder: Path, workdir: Path, args: argparse.Namespace,
              extra: list[str]) -> dict[str, Any]:
    """This script in ``mode`` in a fresh process; the JSON it printed last."""
    command = [sys.executable, __file__, "--child", mode, "--folder", str(folder),
               "--cache", str(workdir / "cache"), "--workers", str(args.workers), *extra]
    process = subprocess.run(command, cwd=REPO, stdout=subprocess.PIPE, text=True, check=False,
                             env={**os.environ, "PYTHONPATH": str(REPO)})
    if process.returncode != 0:
        raise RuntimeError(f"child {' '.join(command)} exited with {process.returncode}")
    return json.loads(process.stdout.strip().splitlines()[-1])


def measure_memory(args: argparse.Namespace) -> dict[str, Any]:
    """The memory section: one fresh training process per size."""
    runs = []
    for size in args.sizes:
        folder = args.workdir / f"images-{size}"
        write_jpegs(folder, size)
        runs.append(run_child("memory", folder, args.workdir, args,
                              ["--size", str(size), "--steps", str(args.steps)]))
        print(f"{size} images: peak RSS {runs[-1]['peak_rss_mb']:.0f} MB", file=sys.stderr)
    smallest, largest = min(runs, key=lambda r: r["images"]), max(runs, key=lambda r: r["images"])
    # A child's ru_maxrss starts at its parent's peak (kept across exec): this must stay far
    # below the children's figures for them to be the children's own.
    parent_peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    return {"workers": args.workers, "steps": args.steps, "runs": runs,
            "parent_peak_rss_mb": parent_peak,
            "images_ratio": largest["images"] / smallest["images"],
            "peak_rss_ratio": largest["peak_rss_mb"] / smallest["peak_rss_mb"]}


def measure_throughput(args: argparse.Namespace) -> dict[str, Any]:
    """The throughput section: every loader ``args.repeats`` times, their order rotated."""
    (size,) = args.sizes
    folder = args.workdir / f"images-{size}"
    write_jpegs(folder, size)
    runs: dict[str, list[float]] = {name: [] for name in args.loaders}
    for repeat in range(args.repeats):
        shift = repeat % len(args.loaders)
        for name in [*args.loaders[shift:], *args.loaders[:shift]]:
            result = run_child("throughput", folder, args.workdir, args,
                               ["--loader", name, "--batches", str(args.batches),
                                "--warmup", str(args.warmup)])
            runs[name].append(result["images_per_s"])
            print(f"repeat {repeat + 1}: {name} {result['images_per_s']:.0f} images/s",
                  file=sys.stderr)
    medians = {name: statistics.median(values) for name, values in runs.items()}
    ratios = {f"{name}/torchvision": medians[name] / medians["torchvision"]
              for name in medians if name != "torchvision" and "torchvision" in medians}
    return {"images": size, "workers": args.workers, "batches": args.batches,
            "warmup": args.warmup, "batch_size": BATCH, "repeats": args.repeats,
            "images_per_s": runs, "median": medians,
            "spread": {name: [min(values), max(values)] for name, values in runs.items()},
            "ratios": ratios}


def memory_table(section: dict[str, Any]) -> str:
    """Markdown table of the memory section."""
    lines = [f"Stream mode, {section['steps']} training steps, {section['workers']} decoder(s):",
             "", "| images | train images | RSS after ray.init | after loading | peak RSS "
             "| Ray processes' peak RSS (summed) | object store peak | s/step |",
             "|---|---|---|---|---|---|---|---|"]
    for run in section["runs"]:
        peak_store = run.get("object_store_peak_mb")
        store = "-" if peak_store is None else f"{peak_store:.0f} MB"
        lines.append(f"| {run['images']} | {run['train_images']} | {run['after_ray_mb']:.0f} MB "
                     f"| {run['after_load_mb']:.0f} MB | {run['peak_rss_mb']:.0f} MB "
                     f"| {run['ray_rss_peak_mb']:.0f} MB | {store} "
                     f"| {run['seconds'] / max(1, run['steps']):.2f} |")
    lines += ["", f"Peak RSS at {section['images_ratio']:.0f}x the images: "
              f"{section['peak_rss_ratio']:.3f}x (issue: < 1.10). This script's own peak RSS, "
              f"a floor under every child's: {section['parent_peak_rss_mb']:.0f} MB."]
    return "\n".join(lines)


def throughput_table(section: dict[str, Any]) -> str:
    """Markdown table of the throughput section."""
    lines = [f"{section['images']} images at {SIDE} px, batches of {section['batch_size']}, "
             f"{section['workers']} decoder(s), {section['batches']} batches timed after "
             f"{section['warmup']}, {section['repeats']} repeat(s):", "",
             "| loader | images/s (median) | min-max | vs torchvision |", "|---|---|---|---|"]
    for name, median in section["median"].items():
        low, high = section["spread"][name]
        ratio = section["ratios"].get(f"{name}/torchvision")
        lines.append(f"| {name} | {median:.0f} | {low:.0f}-{high:.0f} "
                     f"| {'' if ratio is None else f'{ratio:.2f}x'} |")
    return "\n".join(lines)


def write_json(path: Path, mode: str, section: dict[str, Any]) -> None:
    """Write ``section`` under ``mode`` in ``path``, keeping the other command's section."""
    results = json.loads(path.read_text()) if path.exists() else {}
    results[mode] = {"command": " ".join(["python", *sys.argv]), "cores": os.cpu_count(),
                     "usable_cores": len(os.sched_getaffinity(0)),
                     "machine": f"{platform.machine()} {platform.processor()}".strip(),
                     "python": platform.python_version(),
                     "measured": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), **section}
    path.write_text(json.dumps(results, indent=1) + "\n")


def parse(argv: list[str] | None) -> argparse.Namespace:
    """The command line (see the module docstring)."""
    parser = argparse.ArgumentParser(description="Stream mode's memory and throughput "
                                     "(issue 23); see the module docstring.")
    parser.add_argument("mode", choices=list(CHILDREN), nargs="?",
                        help="memory: peak RSS per size; throughput: images/s of the loaders")
    parser.add_argument("sizes", nargs="*", type=int, help="images per folder")
    parser.add_argument("--workers", type=int, default=1,
                        help="decoders: DataLoader workers / Ray CPUs (default 1)")
    parser.add_argument("--steps", type=int, default=150, help="memory: training steps")
    parser.add_argument("--repeats", type=int, default=3, help="throughput: repeats")
    parser.add_argument("--batches", type=int, default=40, help="throughput: batches timed")
    parser.add_argument("--warmup", type=int, default=5, help="throughput: batches not timed")
    parser.add_argument("--loaders", nargs="+", choices=LOADERS, default=list(LOADERS),
                        help="throughput: the loaders compared (ratios need torchvision)")
    parser.add_argument("--workdir", type=Path, default=Path("/tmp/raycl-bench-stream"),
                        help="folders and memory mode's cache (kept for the next run)")
    parser.add_argument("--out", type=Path, default=REPO / "benchmarks" / "stream.json",
                        help="the JSON results (this command's section replaced)")
    parser.add_argument("--child", choices=list(CHILDREN), help=argparse.SUPPRESS)
    for name in ("--folder", "--cache", "--loader", "--size"):
        parser.add_argument(name, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if not args.child:
        if args.mode is None or not args.sizes:
            parser.error("give a mode and sizes, e.g. memory 10000 100000")
        if args.mode == "throughput" and len(args.sizes) != 1:
            parser.error("throughput takes one size, e.g. throughput 20000")
        if args.workers < 1:
            parser.error("--workers must be >= 1")
    return args


def main(argv: list[str] | None = None) -> None:
    """Run one command (or, with --child, one measurement)."""
    args = parse(argv)
    if args.child:
        print(json.dumps(CHILDREN[args.child](args)))
        return
    args.workdir.mkdir(parents=True, exist_ok=True)
    if args.mode == "memory":
        section = measure_memory(args)
        table = memory_table(section)
    else:
        section = measure_throughput(args)
        table = throughput_table(section)
    write_json(args.out, args.mode, section)
    print(table)


if __name__ == "__main__":
    main()
