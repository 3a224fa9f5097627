"""Two pre-launch messages that used to confuse: a missing shard named its key twice, and a
stream-mode trial too large for the machine did not say what its CPUs were for."""

from __future__ import annotations

from pathlib import Path

from data_fixtures import write_webdataset

from raycl.config.search_config import search_config_class
from raycl.launch.checks import check_data
from raycl.launch.placement import Cluster, check_placement

LOCAL = "the local Ray this command started has no autoscaler"


def test_a_missing_shard_names_data_root_once(tmp_path: Path) -> None:
    write_webdataset(tmp_path, 3, 4)
    pattern = f"{tmp_path}/{{00000..00003}}.tar"
    config = search_config_class().model_validate(
        {"name": "x", "method": "clip", "data": {"dataset": "webdataset", "root": pattern,
                                                 "loader": "stream"}})
    problems = list(check_data(config))
    assert [problem.key for problem in problems] == ["data.root"]
    line = problems[0].line("s.yaml")
    assert line.count("data.root") == 1, line
    assert line == (f"s.yaml: data.root: shard '{tmp_path / '00003.tar'}' (from the brace "
                    f"pattern) not found")


def test_a_stream_trial_too_large_names_its_parts_and_what_to_lower() -> None:
    two_cpus = Cluster(({"CPU": 2.0},), False, LOCAL)
    in_process = search_config_class().model_validate(
        {"name": "x", "data": {"dataset": "folder", "root": "/images", "loader": "stream"},
         "scaling": {"num_workers": 0, "cpus_per_worker": 2}})
    [problem] = check_placement(in_process, two_cpus)
    assert problem.key == "scaling.cpus_per_worker"
    assert problem.why.startswith(
        "a trial trains in its own process (scaling.num_workers: 0) and needs 3 CPU (2 for the "
        "trial + 1 data.stream_cpus for its decoders; lower scaling.cpus_per_worker or "
        "data.stream_cpus); none of this Ray's 1 node (2 CPU) has that")
    # With workers: each worker's bundle holds its decoders' CPUs, named apart.
    for stream_cpus, key, parts in (
            (1, "scaling.num_workers", "holds 3.01 CPU at once (2 workers x 1.5 CPU + 0.01 CPU "
                                       "for the trial process; a worker's 1.5 CPU: 0.5 "
                                       "scaling.cpus_per_worker + 1 data.stream_cpus for its "
                                       "decoders)"),
            (2, "data.stream_cpus", "one worker needs 2.5 CPU (0.5 for training + 2 "
                                    "data.stream_cpus for its decoders; lower "
                                    "scaling.cpus_per_worker or data.stream_cpus)")):
        workers = search_config_class().model_validate(
            {"name": "x", "scaling": {"num_workers": 2, "cpus_per_worker": 0.5},
             "data": {"dataset": "folder", "root": "/images", "loader": "stream",
                      "stream_cpus": stream_cpus}})
        [problem] = check_placement(workers, two_cpus)
        assert problem.key == key and parts in problem.why, problem
    # Memory mode: the one key's CPUs, as before.
    memory = search_config_class().model_validate(
        {"name": "x", "data": {"dataset": "folder", "root": "/images", "loader": "memory"},
         "scaling": {"num_workers": 0, "cpus_per_worker": 3}})
    [problem] = check_placement(memory, two_cpus)
    assert "data.stream_cpus" not in problem.why and "needs 3 CPU; none of" in problem.why
