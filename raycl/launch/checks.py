"""Everything knowable before launch, checked before launch: one convention, one entry point.

A config can be valid field by field and the sweep still doomed: an unknown method, a dataset
whose files are missing, a metric the dataset cannot score, a searched value that breaks another
section, pretrained weights that do not fit, a batch larger than the training split, an MLflow
server that does not answer, storage that cannot be written.

Every check is ``check_x(config) -> Iterator[Problem]``: it yields what is wrong, the first
problem first, as ``Problem(key, why)``. :func:`run_checks` runs every check in order and raises
all they find (:func:`raycl.config.problems.all_problems`: one per key) as a
:class:`~raycl.config.schema.ConfigErrors`, one line each, ``FILE: key: why``, the first
first: a user fixes a config in one pass. :data:`CONFIG_CHECKS` need
only the config and the files it names (:func:`raycl.launch.load.load_search` runs them);
:data:`ENVIRONMENT_CHECKS` look at where the sweep writes, once every override is applied
(``python -m raycl.tune`` runs them before Ray or MLflow start). Where trials' processes go is
:mod:`raycl.launch.placement`: ranks sharing a GPU (a config check) and trials no node set of the
running Ray can hold (its ``CLUSTER_CHECKS``, run once Ray has started).
"""

from __future__ import annotations

import os
import urllib.error
import urllib.request
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import get_args
from urllib.parse import urlparse

from pydantic import BaseModel, ValidationError

from raycl.config.problems import all_problems
from raycl.config.schema import (
    ConfigErrors,
    CoreConfig,
    Problem,
    conditional_keys,
    resolve_tracking_uri,
)
from raycl.config.search_config import (
    RENAMED_KEYS,
    apply_overrides,
    config_keys,
    did_you_mean,
    search_config_class,
    searched_note,
    searched_variants,
)
from raycl.config.training import DataConfig
from raycl.launch.feasibility import CONSTRAINED_KEYS, joint_domain, trial_problem
from raycl.launch.linear_sgd_check import check_linear_sgd
from raycl.launch.objectives_check import check_collapse, check_metric, check_objectives
from raycl.launch.online_probe_check import check_online_probe
from raycl.launch.optimizer_check import check_optimizer
from raycl.launch.paper_check import check_paper
from raycl.launch.pbt_check import check_pbt
from raycl.launch.placement import check_gpu_sharing
from raycl.launch.timm_check import check_timm
from raycl.sweep.warm_start import check_warm_start

Check = Callable[[CoreConfig], Iterator[Problem]]

# Keys a search may not vary: they name the sweep, or they change what is measured (the
# validation and test splits), which would make trials incomparable.
UNSEARCHABLE_KEYS = ("name", "data.val_fraction", "data.test_fraction", "data.cache_dir",
                     "data.skip_unreadable")
UNSEARCHABLE_SECTIONS = ("tune.", "mlflow.", "paper.")
# Keys that decide whether model.pretrained fits the backbone a trial builds.
PRETRAINED_KEYS = ("model.pretrained", "model.backbone", "model.stem", "model.width",
                   "data.resolution", "data.dataset")


def _trained(config: CoreConfig) -> str:
    """The (base) method a trial trains: MCL's ``mcl.base``, else ``method``."""
    return config.mcl.base if config.method == "mcl" else config.method


def _method_problems(config: CoreConfig) -> Iterator[Problem]:
    """The (base) method's :meth:`~raycl.methods.base.Method.config_problems` for ``config``."""
    from raycl.methods import METHODS  # late: keeps `--help` and config errors fast

    method = METHODS.get(_trained(config))
    for key, why in method.config_problems(config) if method is not None else []:
        yield Problem(key, why)


def check_method(config: CoreConfig) -> Iterator[Problem]:
    """``method`` and ``mcl.base`` name registered methods; ``mcl.negatives: mask`` needs a base
    method that restricts its negatives."""
    from raycl.methods import METHODS

    if config.method != "mcl" and config.method not in METHODS:
        yield Problem("method", f"unknown method {config.method!r} "
                                f"(known: {', '.join(sorted([*METHODS, 'mcl']))})")
        return
    if config.method == "mcl" and config.mcl.base not in METHODS:
        yield Problem("mcl.base", f"unknown method {config.mcl.base!r} "
                                  f"(known: {', '.join(sorted(METHODS))})")
        return
    method = METHODS[_trained(config)]
    if (config.method == "mcl" and config.mcl.negatives == "mask"
            and not method.accepts_negative_mask):
        takes_mask = sorted(name for name, cls in METHODS.items() if cls.accepts_negative_mask)
        yield Problem("mcl.negatives", f"'mask' needs a base method that restricts its "
                                       f"negatives ({', '.join(takes_mask)}); {config.mcl.base} "
                                       f"does not: use 'sampler'")


def check_method_settings(config: CoreConfig) -> Iterator[Problem]:
    """What the (base) method finds wrong with the config, across sections too."""
    yield from _method_problems(config)


def check_labels(config: CoreConfig) -> Iterator[Problem]:
    """A dataset without labels (captions only, or a folder without class folders) is scored
    by an image-text method's caption retrieval, or by the label-free figures
    (eval.label_free): with neither, nothing."""
    from raycl.data import attributes_of
    from raycl.methods import METHODS

    method = METHODS.get(_trained(config))
    if method is not None and attributes_of(config.data) == () \
            and not method.multimodal and not config.eval.label_free:
        yield Problem("data.dataset", f"{config.data.dataset} has no labels, which "
                                      f"only an image-text method (method: clip, or mcl.base: "
                                      f"clip) or the label-free figures (eval.label_free: true) "
                                      f"score; {_trained(config)} would have nothing to be "
                                      f"evaluated on")


def dataset_problems(data: DataConfig, section: str) -> Iterator[Problem]:
    """What the dataset's reader finds missing or unreadable among its files
    (:meth:`Reader.check <raycl.data.types.Reader.check>`: a folder's images, the pairs file,
    Fashion-MNIST's package, CIFAR's, STL-10's, ImageNet's and the shards' files), as a problem
    of ``<section>.<key>``. ``data``: the data section, or a transfer set's data settings.
    """
    from raycl.data.registry import SOURCES, reader
    from raycl.data.unreadable import SKIP_HINT

    if data.dataset not in SOURCES:
        return  # pydantic's message names an unknown dataset
    problem = reader(data.dataset).check(data)
    if problem is None:
        return
    why = problem.why
    if section != "data":  # a transfer set has no data.skip_unreadable to offer
        why = why.removesuffix(f": {SKIP_HINT}")
    yield Problem(f"{section}.{problem.key}", why)


def check_data(config: CoreConfig) -> Iterator[Problem]:
    """The files of the dataset and of every transfer dataset (each by its reader's check,
    :func:`dataset_problems`) and of a real MMVP-VLM copy."""
    from raycl.eval.transfer import transfer_data_config

    yield from dataset_problems(config.data, "data")
    mmvp = config.eval.mmvp
    if mmvp not in (None, "synthetic"):
        from raycl.eval.mmvp import load_mmvp_vlm

        try:
            load_mmvp_vlm(mmvp, 8, check_only=True)
        except (OSError, ValueError) as exc:
            yield Problem("eval.mmvp", str(exc))
    for i, entry in enumerate(config.eval.transfer):
        yield from dataset_problems(transfer_data_config(config, entry), f"eval.transfer.{i}")


# Data keys that change the split sizes.
_SPLIT_KEYS = ("data.val_fraction", "data.test_fraction", "data.samples_per_combination",
               "data.num_samples")


def check_splits(config: CoreConfig) -> Iterator[Problem]:
    """Validation and test each get at least one image: probes are scored there, and an empty
    split would end every trial at its first evaluation."""
    from raycl.data import split_sizes_for

    for chosen, candidate in searched_variants(config, _SPLIT_KEYS):
        try:
            sizes = split_sizes_for(candidate.data)
        except (OSError, ValueError):
            return  # unreadable data or bad fractions: check_data's and pydantic's messages
        for split, key in (("val", "data.val_fraction"), ("test", "data.test_fraction")):
            if sizes[split] == 0:
                yield Problem(key, f"{searched_note(chosen)}leaves the {split} split empty "
                                   f"({sizes['train']} train images; shares are rounded per "
                                   f"class): raise it or use more data")
                return


def check_pretrain_unlabeled(config: CoreConfig) -> Iterator[Problem]:
    """MCL on STL-10 needs ``data.pretrain_unlabeled: false``: its stages pretrain on the
    images its pseudo labels cover, the labelled training images only."""
    keys = ("method", "data.dataset", "data.pretrain_unlabeled")
    for chosen, candidate in searched_variants(config, keys):
        data = candidate.data
        if candidate.method == "mcl" and data.dataset == "stl10" and data.pretrain_unlabeled:
            yield Problem("data.pretrain_unlabeled",
                          f"{searched_note(chosen)}MCL's pseudo labels cover the labelled "
                          f"training images only; set data.pretrain_unlabeled: false")
            return


def check_loader(config: CoreConfig) -> Iterator[Problem]:
    """``data.loader`` fits the dataset: stream mode reads files or shards, shards stream only,
    and MCL's sampler negatives need random access to the samples."""
    from raycl.data.registry import streamed_only, streams

    data = config.data
    if data.loader == "stream" and not streams(data.dataset):
        yield Problem("data.loader", f"dataset {data.dataset} is read whole from its files and "
                                     f"has nothing to stream (stream mode reads folder, pairs, "
                                     f"imagenet, imagenet100, webdataset, parquet): use "
                                     f"data.loader: memory or auto")
    if data.loader == "memory" and streamed_only(data.dataset):
        yield Problem("data.loader", f"dataset {data.dataset} is streamed only: set "
                                     f"data.loader: stream (or auto)")
    if not streamed_only(data.dataset):
        return
    for chosen, candidate in searched_variants(config, ("method", "mcl.negatives")):
        if candidate.num_stages > 1 and candidate.mcl.negatives == "sampler":
            yield Problem("mcl.negatives", f"{searched_note(chosen)}batches drawn within one "
                                           f"pseudo label need random access to the samples, "
                                           f"and {data.dataset} shards are read in sequence: "
                                           f"use mcl.negatives: mask")
            return


def _missing_cache_bytes(data: DataConfig, seed: int) -> int:
    """Bytes the decoded cache of ``data`` will take in memory mode, 0 when it is built on this
    machine already or its size is unknown (a problem :func:`check_data` names)."""
    from raycl.data.cache.store import cache_path
    from raycl.data.load import class_counts
    from raycl.data.registry import CHANNELS, reader, streamed_only, streams
    from raycl.data.stream.files import decoded_bytes

    # data.loader: auto is settled at launch (on the cluster's memory): a trial checks its own.
    if data.loader == "stream" or streamed_only(data.dataset) or (
            data.loader == "auto" and streams(data.dataset)):
        return 0
    try:
        if cache_path(data, reader(data.dataset).content_key(data, seed)).is_dir():
            return 0
        count = sum(class_counts(data))
    except (OSError, ValueError):
        return 0
    return decoded_bytes(count, int(data.resolution), CHANNELS.get(data.dataset, 3))


def check_cache_disk(config: CoreConfig) -> Iterator[Problem]:
    """The data caches the trials will build (the data's and every transfer set's, in memory
    mode) fit the free disk of ``data.cache_dir`` on this machine: a cache that outgrows its
    disk kills its builder with SIGBUS midway, and the retry the same (each trial checks its
    own node again before it builds).

    Only where the trials run on this machine's Ray (``RAY_ADDRESS`` unset, ``local``,
    ``auto`` or a loopback address: ``make demo``, a local sweep): a job on a cluster
    (``ray job submit`` sets ``RAY_ADDRESS`` to the head's) is launched from a head node whose
    disk is not its workers', so there each trial's own check decides."""
    import os

    address = os.environ.get("RAY_ADDRESS", "local")
    if address not in ("local", "auto") and not address.startswith(("127.", "localhost")):
        return
    from raycl.data.cache.store import default_cache_dir, free_space_problem
    from raycl.eval.transfer import transfer_data_config

    datasets = [config.data, *(transfer_data_config(config, entry)
                               for entry in config.eval.transfer)]
    by_dir: dict[Path, list[tuple[str, int]]] = {}
    for data in datasets:
        needed = _missing_cache_bytes(data, config.data_seed)
        if needed:
            cache_dir = Path(data.cache_dir) if data.cache_dir else default_cache_dir()
            by_dir.setdefault(cache_dir, []).append((data.dataset, needed))
    for cache_dir, caches in by_dir.items():
        names = " and ".join(dict.fromkeys(name for name, _ in caches))
        problem = free_space_problem(cache_dir, sum(needed for _, needed in caches),
                                     f"the data cache of {names}")
        if problem:
            yield Problem("data.cache_dir", problem)
            return


def _is_integer_key(key: str) -> bool:
    model: type[BaseModel] = search_config_class()
    *parents, leaf = key.split(".")
    for part in parents:
        model = model.model_fields[part].annotation  # type: ignore[assignment]
    annotation = model.model_fields[leaf].annotation
    return annotation is int or (int in get_args(annotation) and float not in get_args(annotation))


def check_search_space(config: CoreConfig) -> Iterator[Problem]:
    """Every searched key is a searchable config key, and every value it can take is valid (in
    its own section and across sections)."""
    for key, domain in config.tune.search_space.items():
        where = f"tune.search_space.{key}"
        if key in RENAMED_KEYS:
            yield Problem(where, f"renamed to {RENAMED_KEYS[key]} (a method's knobs live in its "
                                 f"own section)")
        elif key not in config_keys() or key.startswith(UNSEARCHABLE_SECTIONS):
            hint = did_you_mean(key) if key not in config_keys() else ""
            yield Problem(where, f"not a searchable config key{hint}")
        elif key in UNSEARCHABLE_KEYS:
            yield Problem(where, "not searchable: it changes the sweep's name or the splits "
                                 "trials are compared on")
        elif domain.kind in ("uniform", "loguniform") and _is_integer_key(key):
            yield Problem(where, f"{key} is an integer: search it with randint or choice")
        else:
            for value in domain.candidates():
                try:
                    candidate = apply_overrides(config, {key: value})
                except ValidationError as exc:
                    yield Problem(where, f"value {value!r} is invalid: "
                                         f"{exc.errors()[0]['msg']}")
                    continue
                # Checks across sections too (All4One's heads must divide model.projector_dim).
                for problem in _method_problems(candidate):
                    yield Problem(where, f"value {value!r}: {problem.why}")
                    break


def check_pretrained(config: CoreConfig) -> Iterator[Problem]:
    """``model.pretrained`` exists, is readable and fits the backbone every trial builds (its
    architecture, its stem and the data's channels), for each searched value of those keys."""
    from raycl.data import CHANNELS
    from raycl.models import resolve_stem
    from raycl.models.pretrained import pretrained_problem

    space = config.tune.search_space
    if config.model.pretrained is None and "model.pretrained" not in space:
        return
    for chosen, candidate in searched_variants(config, PRETRAINED_KEYS):
        model = candidate.model
        if model.pretrained is None or model.backbone.startswith("timm/"):
            continue  # a timm backbone's file is check_timm's
        problem = pretrained_problem(
            model.pretrained, model.backbone, CHANNELS[candidate.data.dataset], model.width,
            resolve_stem(model.stem, candidate.data.resolution))
        if problem:
            note = searched_note(chosen, leave_out=("model.pretrained",))
            yield Problem("model.pretrained", f"{note}{problem}")


def check_feasible(config: CoreConfig) -> Iterator[Problem]:
    """Batch size and MCL budget: fixed values must fit; searched ones must leave a choice."""
    if not any(key in config.tune.search_space for key in CONSTRAINED_KEYS):
        problem = trial_problem(config)
        if problem:
            yield problem
        return
    try:
        joint_domain(config)
    except ValueError as exc:
        yield Problem("tune.search_space", str(exc))


def check_grid(config: CoreConfig) -> Iterator[Problem]:
    """``tune.searcher: grid`` needs choice domains."""
    if config.tune.searcher != "grid":
        return
    for key, domain in config.tune.search_space.items():
        if domain.kind != "choice":
            yield Problem(f"tune.search_space.{key}", f"tune.searcher 'grid' needs choice "
                                                      f"domains, got {domain.kind}")
    # Optuna's grid is the product of every key's choices: a knob only some methods read would
    # repeat the other methods' trials once per value.
    conditional = conditional_keys(config)
    if conditional:
        yield Problem(f"tune.search_space.{conditional[0]}",
                      f"read by some of the searched methods only ({', '.join(conditional)}); "
                      f"tune.searcher 'grid' would repeat the other methods' trials once per "
                      f"value: use optuna or random, or one grid sweep per method")


# ---------------------------------------------------------------------------------------------
# The environment: an MLflow server that does not answer (MLflow retries for minutes, then the
# driver dies), a sqlite database in a directory that does not exist, storage that cannot be
# written.

TRACKING_TIMEOUT_S = 5.0


def _nearest_existing(path: Path) -> Path:
    """``path`` or its nearest ancestor that exists."""
    while not path.exists() and path != path.parent:
        path = path.parent
    return path


def _writable_location(path: Path) -> str | None:
    """Why files cannot be created at ``path`` (which may not exist yet), or None."""
    existing = _nearest_existing(path)
    if existing == path and not path.is_dir():
        return f"{path} exists and is not a directory"
    if not existing.is_dir():
        return f"{existing} is not a directory"
    if not os.access(existing, os.W_OK | os.X_OK):
        return f"{existing} is not writable"
    return None


def tracking_uri_problem(uri: str, timeout_s: float = TRACKING_TIMEOUT_S) -> str | None:
    """Why MLflow could not log to ``uri``, or None. http(s): the server must answer within
    ``timeout_s`` (any HTTP status counts as an answer); sqlite: the database's directory must
    exist and be writable; plain file stores are refused by MLflow 3 unless allowed."""
    parsed = urlparse(uri)
    if parsed.scheme in ("http", "https"):
        url = uri.rstrip("/") + "/health"
        try:
            with urllib.request.urlopen(url, timeout=timeout_s):
                return None
        except urllib.error.HTTPError:
            return None  # it answered; authentication and routing are MLflow's business
        except (urllib.error.URLError, TimeoutError, OSError) as exc:
            reason = getattr(exc, "reason", exc)
            return f"no MLflow server answers at {uri} within {timeout_s:g} s ({reason})"
    if parsed.scheme == "sqlite":
        database = Path(resolve_tracking_uri(uri)[len("sqlite:///"):])
        if not database.parent.is_dir():
            return f"directory {database.parent} of the sqlite database does not exist"
        # sqlite writes a journal beside the database: the directory must be writable too.
        for target in (database.parent, database):
            if target.exists() and not os.access(target, os.W_OK):
                return f"{target} is not writable"
        return None
    if parsed.scheme in ("", "file") and os.environ.get("MLFLOW_ALLOW_FILE_STORE") != "true":
        return (f"MLflow 3 refuses plain file stores ({uri}); use sqlite:///mlflow.db or an "
                f"http server (or set MLFLOW_ALLOW_FILE_STORE=true)")
    return None


def storage_path_problem(path: str) -> str | None:
    """Why Ray could not write sweep state under ``path``, or None (remote URIs pass)."""
    if "://" in path:
        return None  # s3://, gs://: credentials and buckets are checked by Ray's pyarrow
    return _writable_location(Path(path).expanduser().resolve())


def check_storage(config: CoreConfig) -> Iterator[Problem]:
    """Ray can write the sweep's state under ``tune.storage_path``."""
    problem = storage_path_problem(config.tune.storage_path)
    if problem:
        yield Problem("tune.storage_path", problem)


def check_tracking(config: CoreConfig) -> Iterator[Problem]:
    """MLflow can log to ``mlflow.tracking_uri`` (a server answers, a database can be written)."""
    problem = tracking_uri_problem(config.mlflow.tracking_uri)
    if problem:
        yield Problem("mlflow.tracking_uri", problem)


# The order is the order of the messages: names before data, data before the metric, single
# values before combinations, the config before the environment.
CONFIG_CHECKS: tuple[Check, ...] = (
    check_method, check_method_settings, check_optimizer, check_labels, check_data,
    check_loader, check_cache_disk, check_pretrain_unlabeled,
    check_splits, check_objectives, check_metric, check_collapse, check_linear_sgd,
    check_online_probe, check_paper,
    check_search_space, check_pretrained, check_timm,
    check_feasible, check_gpu_sharing, check_grid, check_pbt,
)
ENVIRONMENT_CHECKS: tuple[Check, ...] = (check_storage, check_tracking, check_warm_start)
ALL_CHECKS: tuple[Check, ...] = CONFIG_CHECKS + ENVIRONMENT_CHECKS


def run_checks(config: CoreConfig, source: str, checks: tuple[Check, ...] = ALL_CHECKS) -> None:
    """Run ``checks`` in order; raise every problem they find.

    Args:
        config: the validated config (every override applied).
        source: the YAML file, for the message.
        checks: which checks: :data:`CONFIG_CHECKS`, :data:`ENVIRONMENT_CHECKS` or all.

    Raises:
        ConfigErrors: one ``FILE: key: why`` line per problem; the message is the first.
    """
    problems = all_problems(config, checks)
    if problems:
        raise ConfigErrors([problem.line(source) for problem in problems])


__all__ = ["ALL_CHECKS", "CONFIG_CHECKS", "ENVIRONMENT_CHECKS", "PRETRAINED_KEYS",
           "TRACKING_TIMEOUT_S", "UNSEARCHABLE_KEYS", "UNSEARCHABLE_SECTIONS", "Check",
           "check_cache_disk", "check_data", "check_feasible", "check_gpu_sharing", "check_grid",
           "check_labels", "check_method", "check_method_settings", "check_metric",
           "check_pretrain_unlabeled", "check_pretrained", "check_search_space", "check_splits",
           "check_storage", "check_tracking", "run_checks", "storage_path_problem",
           "tracking_uri_problem"]
