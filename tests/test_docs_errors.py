"""Every ``error: …`` line README.md and docs/*.md show is what raycl prints for that mistake.

Each documented line has a reproduction here (a search YAML written to ``tmp_path``, command-line
arguments, fixture files); the command must exit 2 with a stderr line that the documented one
matches (``...`` stands for any text; raycl may add to the end, e.g. a hint). A documented error
with no reproduction fails :func:`test_every_documented_error_is_reproduced`.
"""

from __future__ import annotations

import re
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any, NamedTuple

import pytest
import yaml

REPO = Path(__file__).resolve().parents[1]
DOC_FILES = [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]
FENCE = re.compile(r"^```(\w*)\n(.*?)^```", re.S | re.M)


def documented_errors() -> list[tuple[str, str]]:
    """``(where, line)`` for every ``error:`` line in a plain code block of the docs."""
    errors = []
    for path in DOC_FILES:
        text = path.read_text()
        for block in FENCE.finditer(text):
            start = text[:block.start()].count("\n") + 2
            for offset, line in enumerate(block.group(2).splitlines()):
                if line.startswith("error: "):
                    where = f"{path.relative_to(REPO).as_posix()}:{start + offset}"
                    errors.append((where, line))
    return errors


def _weights(tmp: Path, name: str, architecture: str) -> None:
    """A torchvision ResNet state dict at ``tmp/name`` (random weights: only shapes matter)."""
    import torch
    import torchvision

    torch.save(getattr(torchvision.models, architecture)().state_dict(), tmp / name)


def _r50(tmp: Path) -> dict[str, str]:
    (tmp / "models").mkdir(exist_ok=True)
    _weights(tmp / "models", "r50.pt", "resnet50")
    shutil.copy(tmp / "models" / "r50.pt", tmp / "r50.pt")
    return {"/models/r50.pt": str(tmp / "models" / "r50.pt")}


def _r18(tmp: Path) -> dict[str, str]:
    _weights(tmp, "r18.pt", "resnet18")
    return {}


def _half_cub(tmp: Path) -> dict[str, str]:
    (tmp / "cub200" / "train" / "001.Albatross").mkdir(parents=True)
    return {"/data/cub200": str(tmp / "cub200")}


class Repro(NamedTuple):
    """How to make one documented error: start from ``base`` (a shipped search), replace the
    keys in ``changes``, save it as ``file`` and run it with ``args``; ``setup`` makes fixture
    files and returns what the documented line's placeholders become."""

    file: str
    base: str = "quickstart.yaml"
    changes: dict[tuple[str, ...], Any] | None = None
    args: tuple[str, ...] = ()
    setup: Callable[[Path], dict[str, str]] | None = None


PRETRAINED = {("model", "backbone"): "resnet50", ("model", "stem"): "cifar"}
# Keyed by a substring that singles out the documented line.
REPRODUCTIONS: dict[str, Repro] = {
    "train.epoch: unknown key": Repro("searches/x.yaml", changes={("train", "epoch"): 1}),
    "loss.temprature: not a searchable": Repro(
        "searches/x.yaml",
        changes={("tune", "search_space", "loss.temprature"): {"choice": [0.1, 0.2]}}),
    "--set train.epochs": Repro("searches/quickstart.yaml", args=("--set", "train.epochs=two")),
    "MCL needs K^N <= M/b with K=5, N=3": Repro(
        "searches/x.yaml", "mcl_k_n.yaml",
        {("tune", "search_space"): {}, ("mcl", "clusters"): 5, ("mcl", "stages"): 3}),
    "train.batch_size: 100000": Repro("searches/quickstart.yaml",
                                      changes={("train", "batch_size"): 100000}),
    "no MLflow server answers": Repro(
        "searches/quickstart.yaml", changes={("mlflow", "tracking_uri"): "http://127.0.0.1:1"}),
    "'eval/linear/mean' was renamed": Repro("searches/x.yaml",
                                            changes={("tune", "metric"): "eval/linear/mean"}),
    "layout train_test needs": Repro(
        "searches/x.yaml",
        changes={("data",): {"dataset": "folder", "root": "/data/cub200", "layout": "train_test"},
                 ("tune", "search_space"): {}},
        setup=_half_cub),
    "in /models/r50.pt but": Repro(
        "searches/x.yaml", changes={**PRETRAINED, ("model", "pretrained"): "/models/r50.pt"},
        setup=_r50),
    "in r50.pt but": Repro("searches/x.yaml",
                           changes={**PRETRAINED, ("model", "pretrained"): "r50.pt"}, setup=_r50),
    "r18.pt holds a resnet18": Repro(
        "searches/x.yaml", changes={**PRETRAINED, ("model", "pretrained"): "r18.pt"},
        setup=_r18),
    "scaling.gpus_per_worker: 0.5": Repro(
        "searches/x.yaml", changes={("scaling",): {"num_workers": 2, "gpus_per_worker": 0.5,
                                                   "use_gpu": True}}),
}
# Documented errors not reproduced here, with why.
NOT_REPRODUCED = {
    "one trial holds 4.01 CPU": "needs a started Ray (config.placement.CLUSTER_CHECKS); "
                                "tests/test_placement.py asserts this exact line",
}

ERRORS = documented_errors()


def _repro_for(line: str) -> Repro | None:
    matches = [repro for marker, repro in REPRODUCTIONS.items() if marker in line]
    assert len(matches) <= 1, f"two reproductions match {line!r}"
    return matches[0] if matches else None


def test_every_documented_error_is_reproduced() -> None:
    """Each documented error has a reproduction (or a reason not to), and nothing is stale."""
    missing = [f"{where}: {line}" for where, line in ERRORS
               if _repro_for(line) is None and not any(m in line for m in NOT_REPRODUCED)]
    assert not missing, "documented errors without a reproduction:\n" + "\n".join(missing)
    markers = [*REPRODUCTIONS, *NOT_REPRODUCED]
    stale = [m for m in markers if not any(m in line for _, line in ERRORS)]
    assert not stale, f"reproductions of errors the docs no longer show: {stale}"


def _substitute(value: Any, substitutions: dict[str, str]) -> Any:
    """``value`` with each documented placeholder path replaced by its fixture."""
    if isinstance(value, dict):
        return {key: _substitute(item, substitutions) for key, item in value.items()}
    return substitutions.get(value, value) if isinstance(value, str) else value


def _write_search(repro: Repro, tmp: Path, substitutions: dict[str, str]) -> None:
    """The search file of ``repro`` under ``tmp`` (placeholders replaced)."""
    config = yaml.safe_load((REPO / "searches" / repro.base).read_text())
    for path, value in (repro.changes or {}).items():
        value = _substitute(value, substitutions)
        node = config
        for part in path[:-1]:
            node = node.setdefault(part, {})
        node[path[-1]] = value
    target = tmp / repro.file
    target.parent.mkdir(parents=True, exist_ok=True)
    target.write_text(yaml.safe_dump(config, sort_keys=False))


@pytest.mark.parametrize("where,line", [e for e in ERRORS if _repro_for(e[1])],
                         ids=[w for w, line in ERRORS if _repro_for(line)])
def test_documented_error(where: str, line: str, tmp_path: Path,
                          monkeypatch: pytest.MonkeyPatch,
                          capsys: pytest.CaptureFixture[str]) -> None:
    """The reproduction exits 2 with the documented line."""
    from raycl.tune import main

    repro = _repro_for(line)
    assert repro is not None
    monkeypatch.chdir(tmp_path)
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    substitutions = repro.setup(tmp_path) if repro.setup else {}
    _write_search(repro, tmp_path, substitutions)
    args = [repro.file, *repro.args, "--dry-run", "--storage", str(tmp_path / "ray_results")]
    if "no MLflow server" not in line:
        args += ["--tracking-uri", f"sqlite:///{tmp_path}/mlflow.db"]
    code = main(args)
    err = capsys.readouterr().err
    expected = line
    for placeholder, value in substitutions.items():
        expected = expected.replace(placeholder, value)
    pattern = ".*".join(re.escape(part) for part in expected.split("..."))
    assert code == 2, f"{where}: exited {code}, expected the documented error: {err}"
    assert any(re.match(pattern, printed) for printed in err.splitlines()), \
        f"{where}: documented\n  {expected}\nprinted\n  {err}"
