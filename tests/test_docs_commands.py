"""Every raycl command in README.md and docs/*.md runs here, so no example can rot silently.

Commands come from the shell code blocks (continuation lines joined, ``&&`` split, the raycl part
of ``ray job submit … -- python -m raycl.tune …``) and from inline code starting with
``python -m raycl.``, ``raycl-tune``, ``raycl-leaderboard`` or ``make``. Each runs in-process:
``raycl.tune`` with ``--dry-run`` (no Ray), ``raycl.server`` with its own ``--dry-run``,
``raycl.leaderboard`` against a fake MLflow client; storage and tracking go to ``tmp_path``.
What cannot run here is in :data:`NOT_RUN`, with the reason; a new command that is neither fails
:func:`test_every_doc_command_is_run_or_listed`. The error lines the docs show are reproduced by
``tests/test_docs_errors.py``.
"""

from __future__ import annotations

import os
import re
import shlex
from collections.abc import Callable
from pathlib import Path
from typing import Any, NamedTuple

import pytest

REPO = Path(__file__).resolve().parents[1]
DOC_FILES = [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]
SHELL_LANGS = {"", "bash", "sh", "shell", "console"}
FENCE = re.compile(r"^```(\w*)\n(.*?)^```", re.S | re.M)
INLINE = re.compile(r"`([^`\n]+)`")
STARTS = re.compile(r"^(?:[A-Z_]+=\S+\s+)*(?:(?:\.venv/bin/)?python -m raycl\.|raycl-tune\b|"
                    r"raycl-leaderboard\b|make\b)")
CONSOLE_SCRIPTS = {"raycl-tune": "tune", "raycl-leaderboard": "leaderboard"}
# Placeholders the docs use, and what stands in for them here.
PLACEHOLDERS = {"SEARCH.yaml": "searches/quickstart.yaml", "NAME": "quickstart", "K": "3"}

# Documented commands that are not run, with why (the key is the command as normalised below).
NOT_RUN: dict[str, str] = {
    "make demo": "installs into .venv and trains a whole sweep for minutes; the target is "
                 "checked to exist",
    "make test": "is this test suite (and ruff, tools/structure.py); checked to exist",
    "make server": "execs a long-running MLflow server; its `python -m raycl.server` runs "
                   "here with --dry-run; checked to exist",
    "make bench": "benchmarks for minutes; checked to exist",
    "make bench-gpu": "benchmarks on a GPU for minutes; checked to exist",
    "make fidelity": "an hour of paired trials; one claim of its --quick scale runs in "
                     "tests/test_fidelity.py; checked to exist",
    "make clean": "deletes this checkout's caches; checked to exist",
    "make clean-results": "lists this checkout's results; checked to exist",
    "make clean-results CONFIRM=1": "deletes this checkout's results; checked to exist",
    "python -m raycl.tune searches/x.yaml --set k=v": "a pattern in architecture.md's data "
                                                     "flow, not a command",
}


class DocCommand(NamedTuple):
    """One documented command: where it is and its words (comments dropped)."""

    where: str
    words: tuple[str, ...]

    @property
    def key(self) -> str:
        return " ".join(self.words)


def _normalise(text: str) -> tuple[str, ...]:
    """Shell words of a command, without leading ``VAR=value``s; ``.venv/bin/python`` is
    ``python``."""
    words = shlex.split(text, comments=True)
    while words and re.fullmatch(r"[A-Z_]+=\S*", words[0]):
        words.pop(0)
    if words and words[0] == ".venv/bin/python":
        words[0] = "python"
    return tuple(words)


def _candidates(line: str) -> list[str]:
    """The raycl parts of one shell line: each ``&&`` piece, and after ``--`` in a job submit."""
    pieces = []
    for piece in line.split("&&"):
        piece = piece.strip()
        if piece.startswith(("ray job submit", "RAY_AUTH_MODE=token ray job submit")):
            _, _, piece = piece.partition(" -- ")
        if STARTS.match(piece.strip()):
            pieces.append(piece.strip())
    return pieces


def doc_commands() -> list[DocCommand]:
    """Every raycl command in the docs, once each (the first place it appears)."""
    found: dict[str, DocCommand] = {}
    for path in DOC_FILES:
        text = path.read_text()
        name = path.relative_to(REPO).as_posix()
        for block in FENCE.finditer(text):
            if block.group(1) not in SHELL_LANGS:
                continue
            start = text[:block.start()].count("\n") + 2
            lines = block.group(2).replace("\\\n", " ").split("\n")
            for offset, line in enumerate(lines):
                for piece in _candidates(line):
                    command = DocCommand(f"{name}:{start + offset}", _normalise(piece))
                    found.setdefault(command.key, command)
        outside = FENCE.sub(lambda match: "\n" * match.group(0).count("\n"), text)
        for span in INLINE.finditer(outside):
            if STARTS.match(span.group(1)):
                line = outside[:span.start()].count("\n") + 1
                command = DocCommand(f"{name}:{line}", _normalise(span.group(1)))
                found.setdefault(command.key, command)
    return list(found.values())


def _module(words: tuple[str, ...]) -> tuple[str, list[str]] | None:
    """``(raycl module, its arguments)`` of a command, None for make."""
    if words[0] in CONSOLE_SCRIPTS:
        return CONSOLE_SCRIPTS[words[0]], list(words[1:])
    if words[:2] == ("python", "-m") and words[2].startswith("raycl."):
        return words[2].removeprefix("raycl."), list(words[3:])
    return None


def _arguments(words: list[str]) -> list[str]:
    """Synopsis brackets and a trailing ``...`` dropped, placeholders filled, ``$VAR``s
    expanded."""
    out = []
    for word in words:
        word = word.strip("[]")
        if word and word != "...":
            out.append(os.path.expandvars(PLACEHOLDERS.get(word, word)))
    return out


def _redirect(args: list[str], flag: str, value: str) -> list[str]:
    """``args`` with ``flag``'s value replaced by ``value`` (added when absent)."""
    if flag in args:
        index = args.index(flag) + 1
        return [*args[:index], value, *args[index + 1:]]
    return [*args, flag, value]


COMMANDS = doc_commands()
RUN = [command for command in COMMANDS if command.key not in NOT_RUN]


@pytest.fixture
def sandbox(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """Run from the repository (the docs' relative paths), write only under ``tmp_path``, and
    fail if a dry run would launch the sweep."""
    import raycl.tune

    def no_launch(*args: Any, **kwargs: Any) -> int:
        raise AssertionError("a --dry-run launched the sweep")

    monkeypatch.chdir(REPO)
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    monkeypatch.setenv("HOME", str(tmp_path))
    monkeypatch.setenv("RAYCL_CACHE", os.environ.get("RAYCL_CACHE", str(tmp_path / "cache")))
    monkeypatch.setattr(raycl.tune, "run", no_launch)
    return tmp_path


def _run_tune(args: list[str], tmp: Path, monkeypatch: pytest.MonkeyPatch) -> int:
    from raycl.tune import main

    if not args:  # a mention of the command: its --help
        with pytest.raises(SystemExit) as exit_:
            main(["--help"])
        return int(exit_.value.code or 0)
    if "data.root=/path/to/images" in args:  # the README's own folder: a small one here
        args[args.index("data.root=/path/to/images")] = f"data.root={_image_folder(tmp)}"
    args = _redirect(args, "--storage", str(tmp / "ray_results"))
    args = _redirect(args, "--tracking-uri", f"sqlite:///{tmp}/mlflow.db")
    return main([*args, "--dry-run"])


def _image_folder(tmp: Path) -> Path:
    """``tmp/images/<class>/*.png``: 3 classes of 40 small images, enough for the training
    split to hold searches/folder.yaml's batch."""
    import numpy as np
    from PIL import Image

    rng = np.random.default_rng(0)
    for label in range(3):
        folder = tmp / "images" / f"class{label}"
        folder.mkdir(parents=True)
        for index in range(40):
            pixels = rng.integers(0, 256, (12, 12, 3), dtype=np.uint8)
            Image.fromarray(pixels).save(folder / f"{index}.png")
    return tmp / "images"


def _run_server(args: list[str], tmp: Path, monkeypatch: pytest.MonkeyPatch) -> int:
    from raycl.server import main

    return main([*args, "--dry-run"])


class _FakeClient:
    """Just enough of an MLflow client for the leaderboard to find its latest sweep."""

    def search_experiments(self) -> list[Any]:
        return []

    def search_runs(self, *args: Any, **kwargs: Any) -> list[Any]:
        return [type("Run", (), {"info": type("Info", (), {"experiment_id": "1"})})]

    def get_experiment(self, experiment_id: str) -> Any:
        return type("Experiment", (), {"name": "quickstart"})


def _run_leaderboard(args: list[str], tmp: Path, monkeypatch: pytest.MonkeyPatch) -> int:
    import raycl.leaderboard

    shown: list[tuple[Any, ...]] = []
    monkeypatch.setattr(raycl.leaderboard, "mlflow_client", lambda uri: _FakeClient())
    monkeypatch.setattr(raycl.leaderboard, "print_leaderboard", lambda *a: shown.append(a))
    code = raycl.leaderboard.main(_redirect(args, "--tracking-uri", f"sqlite:///{tmp}/m.db"))
    assert code != 0 or shown, "the leaderboard printed nothing"
    return code


def _run_evaluate(args: list[str], tmp: Path, monkeypatch: pytest.MonkeyPatch) -> int:
    """``raycl.evaluate`` on a hand-built finished sweep of the command's experiment (in this
    process: ``--no-ray``), the docs' image folder a small one here."""
    from raycl.evaluate import main
    from tests.finished_sweep import make_sweep

    if not args:  # a mention of the command: its --help
        with pytest.raises(SystemExit) as exit_:
            main(["--help"])
        return int(exit_.value.code or 0)
    experiment = args[args.index("--experiment") + 1]
    sweep = make_sweep(tmp / "sweep", experiment, "small_cnn", log_encoders=False)
    args = [f"data.root={sweep.folder}" if word == "data.root=/path/to/images" else word
            for word in args]
    if "--features-out" in args:
        args = _redirect(args, "--features-out", str(tmp / "features"))
    return main([*_redirect(args, "--tracking-uri", sweep.uri), "--no-ray"])


def _run_export(args: list[str], tmp: Path, monkeypatch: pytest.MonkeyPatch) -> int:
    """``raycl.export`` on a hand-built finished sweep of the command's experiment (a ResNet
    for torchvision/timm, else a small CNN), writing its file under ``tmp``."""
    from raycl.export.__main__ import main
    from tests.finished_sweep import make_sweep

    if not args:  # a mention of the command: its --help
        with pytest.raises(SystemExit) as exit_:
            main(["--help"])
        return int(exit_.value.code or 0)
    experiment = args[args.index("--experiment") + 1]
    resnet = args[args.index("--format") + 1] in ("torchvision", "timm")
    sweep = make_sweep(tmp / "sweep", experiment, "resnet18" if resnet else "small_cnn",
                       log_encoders=False)
    args = _redirect(args, "--out", str(tmp / Path(args[args.index("--out") + 1]).name))
    return main(_redirect(args, "--tracking-uri", sweep.uri))


RUNNERS: dict[str, Callable[[list[str], Path, pytest.MonkeyPatch], int]] = {
    "tune": _run_tune, "server": _run_server, "leaderboard": _run_leaderboard,
    "evaluate": _run_evaluate, "export": _run_export}


def test_every_doc_command_is_run_or_listed() -> None:
    """A command is run here or listed in NOT_RUN with a reason; NOT_RUN holds no stale
    entry."""
    unhandled = [f"{command.where}: {command.key}" for command in RUN
                 if (_module(command.words) or ("make",))[0] not in RUNNERS]
    assert not unhandled, "documented commands neither run nor in NOT_RUN:\n" + \
        "\n".join(unhandled)
    stale = set(NOT_RUN) - {command.key for command in COMMANDS}
    assert not stale, f"NOT_RUN lists commands the docs no longer show: {sorted(stale)}"
    assert len(RUN) >= 15, "the extraction found suspiciously few commands"


def test_documented_make_targets_exist() -> None:
    """`make X` in the docs names a target of the Makefile."""
    makefile = (REPO / "Makefile").read_text()
    for command in COMMANDS:
        if command.words[0] == "make":
            target = command.words[1]
            assert re.search(rf"^{re.escape(target)}:", makefile, re.M), \
                f"{command.where}: make {target}: no such target"


@pytest.mark.parametrize("command", RUN, ids=[f"{c.where} {c.key}"[:90] for c in RUN])
def test_doc_command_runs(command: DocCommand, sandbox: Path, monkeypatch: pytest.MonkeyPatch,
                          capsys: pytest.CaptureFixture[str]) -> None:
    """The command exits 0 (tune: as a dry run; nothing under the repository is written)."""
    parsed = _module(command.words)
    assert parsed is not None and parsed[0] in RUNNERS, command
    module, words = parsed
    before = _written()
    code = RUNNERS[module](_arguments(words), sandbox, monkeypatch)
    err = capsys.readouterr().err
    assert code == 0, f"{command.where}: {command.key} exited {code}: {err}"
    assert _written() == before, f"{command.where}: wrote into the repository"


def _written() -> dict[str, int | None]:
    """Modification times of what a sweep or server writes by default in the launch
    directory."""
    paths = [REPO / name for name in ("mlflow.db", "ray_results", "mlartifacts")]
    return {path.name: path.stat().st_mtime_ns if path.exists() else None for path in paths}


def test_readme_lists_every_dataset_name_once() -> None:
    """The README's data section has one line per name ``data.dataset`` accepts, no more."""
    from typing import get_args

    from raycl.config.training import DataConfig

    text = (REPO / "README.md").read_text()
    section = text.split("## Data (nothing downloads)", 1)[1].split("\n## ", 1)[0]
    first_list = re.search(r"^- `.*?(?=^[^- ])", section, re.M | re.S)
    assert first_list is not None, "the data section lists no dataset"
    listed = re.findall(r"^- `(\w+)`: ", first_list.group(0), re.M)
    accepted = get_args(DataConfig.model_fields["dataset"].annotation)
    assert listed == list(accepted), "README's data section vs data.dataset's names"
