"""tools/suite_cpu.py, the suite's CPU profile: accounting records read and named by kind."""

from __future__ import annotations

import json
from pathlib import Path

from script_modules import load_script

suite_cpu = load_script("tools/suite_cpu.py", "suite_cpu")


def _record(pid: int, utime: int, stime: int, comm: bytes) -> bytes:
    fields = [0, 3, 0, 0, 0, 0, pid, 1, 0, 0.0, utime, stime, 0, 0, 0, 0, 0, 0, comm]
    return suite_cpu.ACCT_V3.pack(*fields)


def test_comp_t_decodes_mantissa_and_base_8_exponent() -> None:
    assert suite_cpu._comp_t(150) == 150
    assert suite_cpu._comp_t((1 << 13) | 100) == 800  # 100 * 8


def test_processes_are_named_by_their_last_ray_role_else_their_command(tmp_path: Path) -> None:
    python = "/venv/bin/python /venv/lib/ray/_private/workers/default_worker.py --x"
    titles = {
        "10": [python, "ray::IDLE", "ray::ImplicitFunc.train"],
        "11": [python, "ray::IDLE", "ray::ImplicitFu"],  # a title Ray had to cut short
        "12": [python, "ray::IDLE"],
        "13": ["/venv/bin/python -m raycl.tune searches/quickstart.yaml"],
    }
    (tmp_path / "titles.json").write_text(json.dumps(titles))
    (tmp_path / "pacct").write_bytes(
        _record(10, 250, 50, b"ray::ImplicitFu") + _record(11, 100, 0, b"gcs_client_io_s")
        + _record(12, 10, 0, b"python") + _record(13, 300, 0, b"python")
        + _record(14, 5, 0, b"sleep"))
    lines = suite_cpu.report(tmp_path).splitlines()
    assert lines[0] == "7 s of CPU in 5 processes"
    assert lines[1].split() == ["4.0", "s", "55.9", "%", "2", "x", "ray::ImplicitFunc"]
    assert lines[2].endswith("1 x  raycl.tune driver (subprocess)")
    assert lines[3].endswith("1 x  ray::IDLE (a worker that never ran anything)")
    assert lines[4].endswith("1 x  other (sleep)")
