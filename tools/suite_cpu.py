"""Where a command's CPU goes, by kind of process: the test suite's profile.

The suite is CPU-bound on 2 cores (both busy for the whole run), so its time is the CPU of
everything it starts: pytest's workers, Ray's daemons, every Ray worker process (a Tune trial, a
Train worker, a Train controller and its helper actors), drivers started as subprocesses, MLflow
servers. Process accounting (Linux ``acct``) records each process's CPU when it exits; a
sampler reads every process's command line (Ray renames its workers ``ray::ImplicitFunc``,
``ray::RayTrainWorker``, ...) twice a second, so each record is named by what the process was.

    # as root, with Debian's acct package (apt-get install acct)
    python tools/suite_cpu.py /var/tmp/profile -- make test
    python tools/suite_cpu.py /var/tmp/profile            # the report again

Writes ``pacct`` (the accounting file), ``titles.json`` (pid -> command lines seen) and
``report.txt`` (CPU seconds by kind, largest first) into the output directory. A process still
running when the command ends (a leaked server) is not counted.
"""

from __future__ import annotations

import json
import re
import struct
import subprocess
import sys
import threading
import time
from collections import Counter
from pathlib import Path

ACCT_V3 = struct.Struct("<BBHIIIIIIfHHHHHHHH16s")  # struct acct_v3 (linux/acct.h), 64 bytes
TICKS_PER_S = 100  # AHZ
SAMPLE_S = 0.5
# (kind, pattern on the process's last meaningful command line), first match wins.
KINDS: tuple[tuple[str, str], ...] = (
    ("pytest (xdist worker or main)", r"import sys;exec\(eval|-m pytest|xdist"),
    ("ray gcs_server", r"gcs_server"),
    ("ray raylet", r"/raylet "),
    ("ray dashboard", r"dashboard/dashboard\.py"),
    ("ray dashboard agent", r"dashboard/agent\.py"),
    ("ray log_monitor", r"log_monitor\.py"),
    ("ray autoscaler monitor", r"autoscaler/_private/monitor\.py"),
    ("ray runtime_env agent", r"runtime_env/agent"),
    ("raycl.tune driver (subprocess)", r"-m raycl\.tune|raycl-tune"),
    ("tests/cloud_local.py", r"cloud_local\.py"),
    ("ray job / ray start (CLI)", r"bin/ray (job|start)"),
    ("mlflow server", r"uvicorn|mlflow (server|ui)|raycl\.server"),
    ("multiprocessing spawn (fake worlds)", r"multiprocessing\.(spawn|forkserver)"),
    ("postgres", r"postgres"),
    ("chromium", r"chrom"),
    ("pip", r"-m pip"),
)


def sample_titles(into: dict[str, list[str]], stop: threading.Event) -> None:
    """pid -> every distinct command line seen, read from /proc until ``stop``."""
    while not stop.is_set():
        for proc in Path("/proc").iterdir():
            if not proc.name.isdigit():
                continue
            try:
                raw = (proc / "cmdline").read_bytes()
            except OSError:
                continue
            title = raw.replace(b"\0", b" ").decode(errors="replace").strip()[:300]
            seen = into.setdefault(proc.name, [])
            if title and (not seen or seen[-1] != title):
                seen.append(title)
        stop.wait(SAMPLE_S)


def _comp_t(value: int) -> int:
    """acct's comp_t: a 13-bit mantissa and a 3-bit base-8 exponent."""
    return (value & 0x1FFF) << (3 * ((value >> 13) & 7))


def read_pacct(path: Path) -> list[tuple[int, float, str]]:
    """``(pid, CPU seconds, comm)`` of every process the accounting file recorded."""
    data = path.read_bytes()
    records = []
    for offset in range(0, len(data) - ACCT_V3.size + 1, ACCT_V3.size):
        fields = ACCT_V3.unpack_from(data, offset)
        pid, utime, stime, comm = fields[6], fields[10], fields[11], fields[18]
        cpu = (_comp_t(utime) + _comp_t(stime)) / TICKS_PER_S
        records.append((pid, cpu, comm.split(b"\0")[0].decode(errors="replace")))
    return records


def kind_of(titles: list[str], comm: str) -> str:
    """A process's kind: its last Ray role (``ray::X``) if it had one, else :data:`KINDS`."""
    roles = [title.split()[0] for title in titles
             if title.startswith("ray::") and not title.startswith("ray::IDLE")]
    if roles:
        return roles[-1].split(".")[0]
    if any("default_worker.py" in title for title in titles):
        return "ray::IDLE (a worker that never ran anything)"
    first = titles[0] if titles else comm
    for kind, pattern in KINDS:
        if re.search(pattern, first):
            return kind
    return "python (other)" if "python" in first else f"other ({comm})"


def report(out: Path) -> str:
    titles: dict[str, list[str]] = json.loads((out / "titles.json").read_text())
    cpu: Counter[str] = Counter()
    count: Counter[str] = Counter()
    for pid, seconds, comm in read_pacct(out / "pacct"):
        kind = kind_of(titles.get(str(pid), []), comm)
        cpu[kind] += seconds
        count[kind] += 1
    # Ray's worker titles are cut to the length of the process's first command line
    # (ray::ImplicitFu): one kind per 15-character start, named by its longest title.
    names: dict[str, str] = {}
    for kind in cpu:
        if kind.startswith("ray::") and len(kind) > len(names.get(kind[:15], "")):
            names[kind[:15]] = kind
    merged_cpu: Counter[str] = Counter()
    merged_count: Counter[str] = Counter()
    for kind in cpu:
        name = names.get(kind[:15], kind) if kind.startswith("ray::") else kind
        merged_cpu[name] += cpu[kind]
        merged_count[name] += count[kind]
    cpu, count = merged_cpu, merged_count
    total = sum(cpu.values())
    lines = [f"{total:.0f} s of CPU in {sum(count.values())} processes"]
    lines += [f"{seconds:8.1f} s {100 * seconds / total:5.1f} %  {count[kind]:5d} x  {kind}"
              for kind, seconds in cpu.most_common()]
    return "\n".join(lines)


def main(argv: list[str]) -> int:
    if not argv or (len(argv) > 1 and argv[1] != "--"):
        print(__doc__)
        return 2
    out = Path(argv[0])
    if len(argv) > 2:
        out.mkdir(parents=True, exist_ok=True)
        pacct = out / "pacct"
        pacct.write_bytes(b"")
        titles: dict[str, list[str]] = {}
        stop = threading.Event()
        sampler = threading.Thread(target=sample_titles, args=(titles, stop), daemon=True)
        sampler.start()
        subprocess.run(["accton", str(pacct)], check=True)
        started = time.monotonic()
        try:
            code = subprocess.run(argv[2:]).returncode
        finally:
            subprocess.run(["accton", "off"], check=False)
            stop.set()
            sampler.join()
            (out / "titles.json").write_text(json.dumps(titles))
        print(f"exit {code} after {time.monotonic() - started:.0f} s")
    text = report(out)
    (out / "report.txt").write_text(text + "\n")
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
