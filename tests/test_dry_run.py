"""``--dry-run`` prints what a newcomer needs, and a collapsed search says so (issue 26)."""

from __future__ import annotations

from pathlib import Path

import pytest

from raycl.launch.load import load_search
from raycl.sweep.dry_run import collapse_notices, dry_run_dict, used_sections

REPO = Path(__file__).resolve().parents[1]


@pytest.fixture
def sandbox(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> tuple[list[str], list[str]]:
    """Arguments sending storage and tracking to ``tmp_path``, and the list a launch is
    recorded in (nothing is launched)."""
    import raycl.tune

    monkeypatch.chdir(REPO)
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    launched: list[str] = []
    monkeypatch.setattr(raycl.tune, "run", lambda *a, **k: launched.append("run") or 0)
    return ["--storage", str(tmp_path / "ray_results"),
            "--tracking-uri", f"sqlite:///{tmp_path}/mlflow.db"], launched


def test_dry_run_prints_used_sections_compact_domains_and_feasible_set(
        sandbox: tuple[list[str], list[str]], capsys: pytest.CaptureFixture[str]) -> None:
    from raycl.tune import main

    args, launched = sandbox
    assert main(["searches/mcl_k_n.yaml", "--dry-run", *args]) == 0
    out = capsys.readouterr().out
    sections = {line.rstrip(":") for line in out.splitlines()
                if line and not line.startswith((" ", "#", "raycl:")) and line.endswith(":")}
    assert {"mcl", "simclr"} <= sections
    assert not sections & {"all4one", "clip", "fgvr", "hscl", "mocov2", "spectral"}
    assert "    mcl.clusters: {choice: [2, 5, 10]}" in out
    assert "    simclr.temperature: {loguniform: [0.1, 0.5]}" in out
    space = out[out.index("search_space:"):out.index("searcher:")]
    assert "null" not in space
    assert ("# feasible (mcl.clusters, mcl.stages): 4 of 9 combinations with "
            "train.batch_size=128 and 3500 training images:") in out
    assert "#   (2, 1), (2, 2), (2, 3), (5, 2)" in out
    assert launched == []


def test_dry_run_dict_is_the_config_less_unused_sections() -> None:
    """The printed YAML reads back as the resolved config, minus other methods' sections."""
    config = load_search(str(REPO / "searches" / "fgvr_eps.yaml"), [])
    printed = dry_run_dict(config)
    assert {"fgvr", "mocov2"} <= used_sections(config)  # FGVR's base through fgvr.base
    assert "mocov2" in printed and "simsiam" not in printed and "mcl" not in printed
    full = config.to_dict()
    for key, value in printed.items():
        if key != "tune":
            assert full[key] == value
    for key, domain in printed["tune"]["search_space"].items():
        stored = {kind: v for kind, v in full["tune"]["search_space"][key].items()
                  if v is not None}
        assert dict(domain) == stored


def test_collapsed_search_is_one_printed_line_also_on_a_real_run(
        sandbox: tuple[list[str], list[str]], capsys: pytest.CaptureFixture[str]) -> None:
    """A batch of 1024 leaves MCL one stage: said before launch, not silently."""
    from raycl.tune import main

    args, launched = sandbox
    assert main(["searches/mcl_k_n.yaml", "--set", "train.batch_size=1024", *args]) == 0
    out = capsys.readouterr().out
    assert launched == ["run"]
    assert ("raycl: mcl.stages: only 1 of [1, 2, 3] is feasible with train.batch_size=1024 and "
            "3500 training images; the search does not vary it (one stage: plain simclr, "
            "mcl.clusters unused)") in out.splitlines()
    assert "raycl: mcl.clusters: only" not in out


def test_no_collapse_notice_for_an_open_search() -> None:
    config = load_search(str(REPO / "searches" / "mcl_k_n.yaml"), [])
    assert collapse_notices(config) == []
    quickstart = load_search(str(REPO / "searches" / "quickstart.yaml"), [])
    assert collapse_notices(quickstart) == []


def test_mcl_on_a_small_folder_says_it_runs_one_stage(
        sandbox: tuple[list[str], list[str]], tmp_path: Path,
        capsys: pytest.CaptureFixture[str]) -> None:
    """Issue 26's case: MCL on ~120 training images with a batch of 32 is one stage."""
    from PIL import Image

    from raycl.launch.feasibility import train_split_size
    from raycl.tune import main

    for name in ("circle", "square"):
        (tmp_path / "imgs" / name).mkdir(parents=True)
        for index in range(86):
            Image.new("RGB", (8, 8), (index, 0, 0)).save(tmp_path / "imgs" / name / f"{index}.png")
    args, launched = sandbox
    overrides = ["--set", "data.dataset=folder", "--set", f"data.root={tmp_path / 'imgs'}",
                 "--set", "train.batch_size=32"]
    assert main(["searches/mcl_k_n.yaml", *overrides, "--dry-run", *args]) == 0
    out = capsys.readouterr().out
    size = train_split_size(load_search(str(REPO / "searches" / "mcl_k_n.yaml"),
                                        [o for o in overrides if o != "--set"]).data)
    assert 110 <= size <= 130
    assert (f"raycl: mcl.stages: only 1 of [1, 2, 3] is feasible with train.batch_size=32 and "
            f"{size} training images; the search does not vary it (one stage: plain simclr, "
            f"mcl.clusters unused)") in out.splitlines()
    assert "#   (2, 1)" in out.splitlines()
    assert launched == []
