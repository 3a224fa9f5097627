"""Memory and time of loading a folder dataset: one decoded copy per node, shared (issue 22).

    python benchmarks/data_memory.py 4000 8000 --ray-workers  # the sizes of the issue's table
    python benchmarks/data_memory.py 200 --workdir /tmp/x      # a quick check that it runs
    python benchmarks/data_memory.py 2000 --resolution 64 --ray-workers  # ~30 s in all

For each N it writes N 256x256 JPEGs into ``<workdir>/images-N/`` (10 class folders; kept for
the next run) and measures ``raycl.data.load_dataset`` at ``resolution: 224`` (``--resolution``),
every figure in a fresh Python process:

- first build (an empty cache, ``data.decode_workers: 0`` = every core) and load from the cache:
  seconds, peak RSS (``resource.getrusage(...).ru_maxrss``), PSS and anonymous memory at the end
  (``/proc/self/smaps_rollup``), and the cache's size on disk;
- decoding rate: images/s of the first build on every core against one thread
  (``decode_workers: 1``), the same folder, a cache of its own each;
- two processes at once, each loading the set and touching every training image as an epoch
  does (a batch's rows read, then dropped): each one's anonymous (private) memory above what
  it held before loading, and the two PSS summed, against the decoded set's size. The issue
  asks that the sum be about one copy of the set, not two.
- with ``--ray-workers``: the same with two Ray Train workers on this node (a ``TorchTrainer``,
  ``num_workers=2``, one CPU each, on a Ray of its own started with ``address="local"``). Each
  worker measures itself "empty" (torch, Ray Train, raycl's loader imported, the process group
  up, nothing loaded), loads the set from the cache the driver built, reads every pretraining
  image through raycl's own loader (``IndexedImages`` over ``pretraining_images``, 256-row
  batches in a shuffled order) and, once both have, measures again: peak RSS, PSS, private and
  anonymous memory above empty, and the RSS / PSS of its mapping of the cache's ``images.npy``.

Why PSS and not RSS for the last ones: RSS counts every resident page a process maps, including
the file-backed page-cache pages of the memory-mapped cache that the other process maps too;
summing two processes' RSS counts each shared page twice, though the node holds it once. PSS
(proportional set size) charges a page shared by k processes 1/k to each, so the PSS of all
processes sums to what they really occupy; ``Anonymous`` is memory no file backs (copies a
process made for itself, the old loader's per-split arrays for instance), the part that does
grow with every worker. RSS is still printed, as the issue's table reports it.

What "about one copy of the decoded set" means in each figure of the Ray table, where both
workers read every pretraining image:

- peak RSS above empty: about one copy *per worker* (each maps every page it read), so the sum
  is about two copies though the node holds one; the sum double-counts the shared page-cache
  pages. The issue's wording, "peak RSS above empty sums to about one copy", cannot hold for any
  scheme where workers read the same physical pages (a memory map and Ray's object store
  alike); its RSS form is "each worker's RSS grows by one copy, its private memory does not".
- PSS above empty: about half a copy per worker, summing to about one copy: what the node
  really spends. The cache mapping's PSS column is that part alone, without the rest below.
- private and anonymous above empty: no copy at all, a constant per worker that does not grow
  with N: a couple of batches' buffers that the allocator keeps for the next batch (256 rows,
  3 MB at 64 px, 38 MB at 224 px) and code imported on first use. The same constant is in the
  worker's RSS and PSS, so at small sets (a few MB) it dominates them; at the issue's sizes
  (hundreds of MB) the copy does.
- "one copy" itself lies between the pretraining images' bytes (``train``, 70% of the set
  here) and the whole cache file: a page fault maps the neighbouring pages already cached too
  (the kernel's fault-around, 64 KB), so where a row is a few KB (64 px) the validation and test
  rows between training rows get mapped as well; at 224 px (150 KB a row) far fewer.

The decoded set is ``N x 3 x R x R`` bytes (150 KB per image at 224 px). Prints markdown tables.
Not run by the test suite (``tests/test_data_cache.py`` smoke-tests it at a tiny size).
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

if TYPE_CHECKING:
    from raycl.config.training import DataConfig

REPO = Path(__file__).resolve().parents[1]
RESOLUTION = 224  # the default; --resolution changes it
SOURCE_SIDE = 256
CLASSES = 10
BATCH = 256  # rows an epoch's batch reads at once


def write_jpegs(folder: Path, count: int, seed: int = 0) -> None:
    """``count`` distinct 256x256 JPEGs in ``folder/<class>/`` (kept when already complete)."""
    from PIL import Image

    marker = folder / ".complete"
    if marker.exists():
        return
    rng = np.random.default_rng(seed)
    for index in range(count):
        # Smooth colour fields with some noise: JPEG sizes and decode costs like photos'.
        coarse = rng.integers(0, 256, (8, 8, 3), dtype=np.uint8)
        image = Image.fromarray(coarse).resize((SOURCE_SIDE, SOURCE_SIDE),
                                               Image.Resampling.BILINEAR)
        noisy = np.asarray(image, dtype=np.int16) + rng.integers(-12, 13, (SOURCE_SIDE,
                                                                          SOURCE_SIDE, 3))
        path = folder / f"class{index % CLASSES:02d}" / f"{index:06d}.jpg"
        path.parent.mkdir(parents=True, exist_ok=True)
        Image.fromarray(np.clip(noisy, 0, 255).astype(np.uint8)).save(path, quality=90)
    marker.write_text(f"{count}\n")


def data_config(folder: Path, cache: Path, workers: int,
                resolution: int = RESOLUTION) -> DataConfig:
    """The data settings load_dataset reads, for the folder at ``resolution`` px."""
    from raycl.config.training import DataConfig

    return DataConfig(dataset="folder", root=str(folder), layout="flat", resolution=resolution,
                      val_fraction=0.1, test_fraction=0.2, cache_dir=str(cache),
                      decode_workers=workers, loader="memory")


def memory_now() -> dict[str, float]:
    """This process's peak RSS and current RSS, PSS, private and anonymous memory, in MB."""
    fields: dict[str, float] = {}
    with open("/proc/self/smaps_rollup") as rollup:
        for line in rollup:
            parts = line.split()
            if len(parts) == 3 and parts[2] == "kB":
                fields[parts[0].rstrip(":")] = int(parts[1]) / 1024
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # kB on Linux
    return {"peak_rss_mb": peak, "rss_mb": fields.get("Rss", 0.0),
            "pss_mb": fields.get("Pss", 0.0), "pss_file_mb": fields.get("Pss_File", 0.0),
            "private_mb": fields.get("Private_Clean", 0.0) + fields.get("Private_Dirty", 0.0),
            "anon_mb": fields.get("Anonymous", 0.0)}


def mapping_memory(file_name: str) -> dict[str, float]:
    """RSS and PSS of this process's mappings of files named ``file_name`` (the cache's
    ``images.npy``), in MB: the decoded set's pages this process holds, and its share of them."""
    totals = {"map_rss_mb": 0.0, "map_pss_mb": 0.0}
    inside = False
    with open("/proc/self/smaps") as smaps:
        for line in smaps:
            parts = line.split()
            if parts and not parts[0].endswith(":"):  # a mapping's header: range perms ... path
                inside = len(parts) >= 6 and Path(parts[-1]).name == file_name
            elif inside and len(parts) == 3 and parts[0] in ("Rss:", "Pss:"):
                totals[f"map_{parts[0][:-1].lower()}_mb"] += int(parts[1]) / 1024
    return totals


# --- the measurements, each in a fresh process ---------------------------------------------------


def child_load(args: argparse.Namespace) -> dict[str, Any]:
    """Load the set once (building the cache when it is empty): seconds and memory."""
    from raycl.data import load_dataset

    started = time.perf_counter()
    splits = load_dataset(data_config(Path(args.folder), Path(args.cache), args.workers,
                                      args.resolution), 0)
    seconds = time.perf_counter() - started
    return {"seconds": seconds, "train": len(splits.train.images), **memory_now()}


def child_touch(args: argparse.Namespace) -> dict[str, Any]:
    """Load the set from the cache and read every training row in batches, as an epoch does;
    then wait for ``args.go`` (so both processes map the set when measured) and measure."""
    import raycl.data.cache.build
    import raycl.data.sources.folders  # noqa: F401 (what loading imports, so "before" holds it too)
    from raycl.data import load_dataset

    before = memory_now()  # an "empty" process: interpreter, numpy, Pillow, raycl.data
    splits = load_dataset(data_config(Path(args.folder), Path(args.cache), args.workers,
                                      args.resolution), 0)
    images = splits.train.images
    order = np.random.default_rng(0).permutation(len(images))
    checksum = 0
    for start in range(0, len(order), BATCH):
        batch = images[order[start:start + BATCH]]
        checksum += int(batch[:, 0, 0, 0].sum())  # the batch is read, then dropped
        del batch
    Path(args.ready).write_text("")
    deadline = time.monotonic() + 600
    while not Path(args.go).exists() and time.monotonic() < deadline:
        time.sleep(0.01)
    after = memory_now()
    return {"before": before, "after": after, "checksum": checksum}


def run_child(mode: str, folder: Path, cache: Path, workers: int = 0,
              extra: list[str] | None = None, wait: bool = True,
              resolution: int = RESOLUTION) -> Any:
    """Start this script in ``mode`` in a fresh process; its JSON result (or the process)."""
    command = [sys.executable, __file__, "--child", mode, "--folder", str(folder),
               "--cache", str(cache), "--workers", str(workers),
               "--resolution", str(resolution), *(extra or [])]
    process = subprocess.Popen(command, cwd=REPO, stdout=subprocess.PIPE, text=True,
                               env={**os.environ, "PYTHONPATH": str(REPO)})
    return finish(process) if wait else process


def finish(process: subprocess.Popen) -> dict[str, Any]:
    """The JSON a child printed last; raise when it failed."""
    out, _ = process.communicate()
    if process.returncode != 0:
        raise RuntimeError(f"child {process.args} exited with {process.returncode}")
    return json.loads(out.strip().splitlines()[-1])


def disk_mb(path: Path) -> float:
    """Bytes under ``path`` (its files), in MB."""
    return sum(file.stat().st_size for file in path.rglob("*") if file.is_file()) / 2**20


def two_processes(folder: Path, cache: Path, workdir: Path,
                  resolution: int = RESOLUTION) -> list[dict[str, Any]]:
    """Two processes loading and touching the set at once; each one's memory."""
    go = workdir / "go"
    go.unlink(missing_ok=True)
    readies = [workdir / f"ready{i}" for i in range(2)]
    for ready in readies:
        ready.unlink(missing_ok=True)
    children = [run_child("touch", folder, cache, extra=["--ready", str(ready), "--go", str(go)],
                          wait=False, resolution=resolution) for ready in readies]
    deadline = time.monotonic() + 600
    while not all(ready.exists() for ready in readies) and time.monotonic() < deadline:
        if any(child.poll() not in (None, 0) for child in children):
            break
        time.sleep(0.05)
    go.write_text("")
    return [finish(child) for child in children]


def measure(count: int, workdir: Path, resolution: int = RESOLUTION,
            ray_workers: bool = False) -> dict[str, Any]:
    """Every figure for a folder of ``count`` JPEGs at ``resolution`` px; the two Ray Train
    workers' too when ``ray_workers``."""
    folder = workdir / f"images-{count}"
    write_jpegs(folder, count)
    caches = {name: Path(tempfile.mkdtemp(dir=workdir, prefix=f"cache-{count}-{name}-"))
              for name in ("all", "one")}
    built = run_child("load", folder, caches["all"], workers=0, resolution=resolution)
    cached = run_child("load", folder, caches["all"], workers=0, resolution=resolution)
    one = run_child("load", folder, caches["one"], workers=1, resolution=resolution)
    pair = two_processes(folder, caches["all"], workdir, resolution)
    result = {"images": count, "built": built, "cached": cached, "one_worker": one,
              "pair": pair, "cache_mb": disk_mb(caches["all"]),
              "images_file_mb": sum(file.stat().st_size for file in
                                    caches["all"].rglob("images.npy")) / 2**20,
              "cores": len(os.sched_getaffinity(0)),
              "decoded_mb": count * 3 * resolution * resolution / 2**20}
    if ray_workers:  # the cache is built: the workers only map it
        result["ray"] = run_child("ray", folder, caches["all"], resolution=resolution)
    return result


def tables(results: list[dict[str, Any]]) -> str:
    """The markdown tables of :func:`measure`'s results."""
    lines = ["| images | first build | load from cache | peak RSS (build) | peak RSS (cache "
             "load) | cache on disk | decode, all cores | decode, 1 thread |",
             "|---|---|---|---|---|---|---|---|"]
    for r in results:
        lines.append(
            f"| {r['images']} | {r['built']['seconds']:.1f} s | {r['cached']['seconds']:.2f} s "
            f"| {r['built']['peak_rss_mb']:.0f} MB | {r['cached']['peak_rss_mb']:.0f} MB "
            f"| {r['cache_mb']:.0f} MB | {r['images'] / r['built']['seconds']:.0f} img/s "
            f"({r['cores']} cores) | {r['images'] / r['one_worker']['seconds']:.0f} img/s |")
    lines += ["", "Two processes, each loading the set and reading every training image:", "",
              "| images | decoded set | anonymous above empty, each | PSS summed | of it the "
              "cache file's | RSS summed (counts shared pages twice) |",
              "|---|---|---|---|---|---|"]
    for r in results:
        anon = " / ".join(f"{p['after']['anon_mb'] - p['before']['anon_mb']:.0f} MB"
                          for p in r["pair"])
        pss = sum(p["after"]["pss_mb"] - p["before"]["pss_mb"] for p in r["pair"])
        pss_file = sum(p["after"]["pss_file_mb"] - p["before"]["pss_file_mb"]
                       for p in r["pair"])
        rss = sum(p["after"]["rss_mb"] - p["before"]["rss_mb"] for p in r["pair"])
        lines.append(f"| {r['images']} | {r['decoded_mb']:.0f} MB | {anon} | {pss:.0f} MB "
                     f"| {pss_file:.0f} MB | {rss:.0f} MB |")
    return "\n".join(lines + ray_table(results))


# --- two Ray Train workers on one node (--ray-workers) -------------------------------------------


def _batch_as_is(batch: Any) -> Any:
    """The DataLoader's collate function: ``IndexedImages`` returns whole batches already."""
    return batch


def ray_worker_loop(train_config: dict[str, Any]) -> None:
    """One Ray Train worker: measure itself empty, load the set from the cache, read every
    pretraining image through raycl's loader, measure again once both workers have; every
    worker reports all workers' figures (``w<rank>/<phase>/<figure>``, gathered over gloo),
    rank 0 with a checkpoint, as Ray Train 2.60's ``Result.metrics`` holds only the metrics
    reported with one."""
    import logging

    import ray.train
    import torch
    import torch.distributed as dist
    from torch.utils.data import BatchSampler, DataLoader, RandomSampler

    import raycl.data.cache.build
    import raycl.data.sources.folders  # noqa: F401 (what loading imports, so "empty" holds it too)
    from raycl.data import load_dataset
    from raycl.data.cache.store import IMAGES_FILE
    from raycl.worker.loader import IndexedImages
    from raycl.worker.resident import pretraining_images

    for name in ("", "ray.train"):  # not every report's metrics at INFO
        logging.getLogger(name).setLevel(logging.WARNING)
    rank = ray.train.get_context().get_world_rank()
    dist.barrier()  # both hold their imports, so shared libraries' PSS is settled when measured
    empty = {**memory_now(), **mapping_memory(IMAGES_FILE)}
    cfg = data_config(Path(train_config["folder"]), Path(train_config["cache"]), 0,
                      train_config["resolution"])
    images = pretraining_images(load_dataset(cfg, 0))
    order = RandomSampler(range(len(images)), generator=torch.Generator().manual_seed(rank))
    loader = DataLoader(IndexedImages(images), collate_fn=_batch_as_is,
                        batch_sampler=BatchSampler(order, BATCH, drop_last=False))
    checksum = 0
    for batch, _ in loader:
        checksum += int(batch[:, 0, 0, 0].sum())  # the batch is read, then dropped
        del batch
    dist.barrier()  # both have read every image: each maps the whole set when measured
    full = {**memory_now(), **mapping_memory(IMAGES_FILE)}
    mine = {**{f"empty/{key}": value for key, value in empty.items()},
            **{f"full/{key}": value for key, value in full.items()},
            "pretrain_mb": images.nbytes / 2**20, "checksum": float(checksum)}
    everyone: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, mine)
    metrics = {f"w{worker}/{key}": value for worker, figures in enumerate(everyone)
               for key, value in figures.items()}
    with tempfile.TemporaryDirectory() as directory:
        Path(directory, "figures.json").write_text(json.dumps(everyone))
        checkpoint = ray.train.Checkpoint.from_directory(directory) if rank == 0 else None
        ray.train.report(metrics, checkpoint=checkpoint)


def child_ray(args: argparse.Namespace) -> dict[str, Any]:
    """Two Ray Train workers (a ``TorchTrainer`` on a Ray of its own) loading the built cache;
    each worker's figures, read back from the Result, and the seconds it all took."""
    import ray
    from ray.train import RunConfig, ScalingConfig
    from ray.train.torch import TorchTrainer

    started = time.perf_counter()
    # address="local": a Ray of its own even when another one runs on this machine.
    ray.init(address="local", num_cpus=2, include_dashboard=False, logging_level="WARNING")
    try:
        trainer = TorchTrainer(
            ray_worker_loop,
            train_loop_config={"folder": args.folder, "cache": args.cache,
                               "resolution": args.resolution},
            scaling_config=ScalingConfig(num_workers=2, use_gpu=False,
                                         resources_per_worker={"CPU": 1}),
            # A name per cache (a fresh directory each measurement): no run resumes another.
            run_config=RunConfig(name=f"data-memory-{Path(args.cache).name}",
                                 storage_path=str(Path(args.cache).parent / "ray-results")))
        metrics = dict(trainer.fit().metrics or {})
    finally:
        ray.shutdown()
    if not metrics:
        raise RuntimeError("the Ray Train workers reported no figures")
    workers: dict[int, dict[str, Any]] = {}
    for key, value in metrics.items():
        worker, _, figure = key.partition("/")
        if worker.startswith("w") and worker[1:].isdigit():
            workers.setdefault(int(worker[1:]), {})[figure] = value
    return {"seconds": time.perf_counter() - started,
            "workers": [workers[rank] for rank in sorted(workers)]}


def ray_table(results: list[dict[str, Any]]) -> list[str]:
    """The lines of the Ray Train workers' table (none when no result has them)."""
    rows = [r for r in results if "ray" in r]
    if not rows:
        return []
    lines = ["", "Two Ray Train workers on one node (TorchTrainer, 2 x 1 CPU), each loading the "
             "set from the cache and reading every pretraining image through raycl's loader; "
             "memory above what the empty worker held (peak RSS: ru_maxrss at the end less "
             "the empty worker's RSS):", "",
             "| images | pretraining images / cache file | worker | peak RSS (counts shared "
             "pages in each) | PSS | private | anonymous | cache mapping RSS / PSS |",
             "|---|---|---|---|---|---|---|---|"]
    for r in rows:
        deltas = [worker_deltas(worker) for worker in r["ray"]["workers"]]
        both = {key: sum(delta[key] for delta in deltas) for key in deltas[0]}
        size = (f"{r['ray']['workers'][0]['pretrain_mb']:.1f} / "
                f"{r['images_file_mb']:.1f} MB")
        for index, delta in enumerate([*deltas, both]):
            name = "both" if index == len(deltas) else str(index)
            lines.append(
                f"| {r['images'] if index == 0 else ''} | {size if index == 0 else ''} "
                f"| {name} | {delta['peak_rss']:.1f} MB | {delta['pss']:.1f} MB "
                f"| {delta['private']:.1f} MB | {delta['anon']:.1f} MB "
                f"| {delta['map_rss']:.1f} / {delta['map_pss']:.1f} MB |")
        lines.append(f"|  |  | both, in copies of the cache file | "
                     f"{both['peak_rss'] / r['images_file_mb']:.2f} "
                     f"| {both['pss'] / r['images_file_mb']:.2f} "
                     f"| {both['private'] / r['images_file_mb']:.2f} "
                     f"| {both['anon'] / r['images_file_mb']:.2f} "
                     f"| {both['map_rss'] / r['images_file_mb']:.2f} / "
                     f"{both['map_pss'] / r['images_file_mb']:.2f} |")
    lines += ["", "Ray part (start, fit, shutdown): " + ", ".join(
        f"{r['ray']['seconds']:.0f} s at {r['images']} images" for r in rows)]
    return lines


def worker_deltas(worker: dict[str, Any]) -> dict[str, float]:
    """One Ray Train worker's memory at the end above its empty self, in MB."""
    def grown(figure: str) -> float:
        return worker[f"full/{figure}"] - worker[f"empty/{figure}"]

    return {"peak_rss": worker["full/peak_rss_mb"] - worker["empty/rss_mb"],
            "pss": grown("pss_mb"), "private": grown("private_mb"), "anon": grown("anon_mb"),
            "map_rss": grown("map_rss_mb"), "map_pss": grown("map_pss_mb")}


CHILDREN = {"load": child_load, "touch": child_touch, "ray": child_ray}


def main(argv: list[str] | None = None) -> None:
    """Parse the command line; run the sizes (or, with --child, one measurement)."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("sizes", nargs="*", type=int, help="images per folder, e.g. 4000 8000")
    parser.add_argument("--workdir", type=Path, help="where folders and caches go (default: "
                        "a new temporary directory)")
    parser.add_argument("--json", type=Path, help="also write the raw results here")
    parser.add_argument("--resolution", type=int, default=RESOLUTION,
                        help=f"decoded side in pixels (default {RESOLUTION})")
    parser.add_argument("--ray-workers", action="store_true", help="also measure two Ray "
                        "Train workers on this node (a Ray of its own, 2 CPUs)")
    parser.add_argument("--child", choices=list(CHILDREN), help=argparse.SUPPRESS)
    for name in ("--folder", "--cache", "--ready", "--go"):
        parser.add_argument(name, help=argparse.SUPPRESS)
    parser.add_argument("--workers", type=int, default=0, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.child:
        result = CHILDREN[args.child](args)
        print(json.dumps(result))
        return
    if not args.sizes:
        parser.error("give at least one size, e.g. 4000 8000")
    workdir = args.workdir or Path(tempfile.mkdtemp(prefix="raycl-data-memory-"))
    workdir.mkdir(parents=True, exist_ok=True)
    results = [measure(count, workdir, args.resolution, args.ray_workers)
               for count in args.sizes]
    if args.json:
        args.json.write_text(json.dumps(results, indent=1) + "\n")
    print(tables(results))


if __name__ == "__main__":
    main()
