"""A local sweep is closed to the network: every process of ``python -m raycl.tune``'s tree
(the driver, Ray's GCS, raylet, dashboard and agents, metrics exporters, Tune's workers, the
MLflow relay) listens on loopback only, sampled from ``/proc`` while a tiny sweep runs.

The trial trains in its own process (``scaling.num_workers=0``, as ``make demo``): a worker group
adds torch.distributed's TCPStore, which binds every interface whatever its address
(pytorch/pytorch#173909; docs/clusters.md "What listens where")."""

from __future__ import annotations

import ipaddress
import os
import subprocess
import sys
import time
from pathlib import Path

from local_servers import stop_group

REPO = Path(__file__).resolve().parents[1]
TINY = ["data.samples_per_combination=1", "data.resolution=16", "train.batch_size=64",
        "model.width=8", "model.projector_hidden_dim=32", "model.projector_dim=16",
        "eval.linear_max_iter=50", "train.epochs=1", "eval.every_n_epochs=1",
        "scaling.num_workers=0", "scaling.cpus_per_worker=1"]
# /proc/net/* states: a TCP socket accepting connections; a UDP socket bound, unconnected.
LISTENING = {"tcp": "0A", "tcp6": "0A", "udp": "07", "udp6": "07"}


def _address(hex_ip: str) -> ipaddress.IPv4Address | ipaddress.IPv6Address:
    """An address as /proc/net prints it: 32-bit words, each in the host's (little-endian)
    byte order."""
    raw = bytes.fromhex(hex_ip)
    words = b"".join(raw[i:i + 4][::-1] for i in range(0, len(raw), 4))
    return ipaddress.ip_address(words)


def _is_loopback(address: ipaddress.IPv4Address | ipaddress.IPv6Address) -> bool:
    mapped = getattr(address, "ipv4_mapped", None)  # ::ffff:127.0.0.1 on a dual-stack socket
    return address.is_loopback or (mapped is not None and mapped.is_loopback)


def listening_sockets() -> dict[int, tuple[str, str, int]]:
    """Every listening socket of this network namespace: inode -> (protocol, address, port)."""
    found = {}
    for protocol, state in LISTENING.items():
        try:
            lines = Path(f"/proc/net/{protocol}").read_text().splitlines()[1:]
        except OSError:  # no IPv6 on this kernel
            continue
        for line in lines:
            fields = line.split()
            if fields[3] != state:
                continue
            hex_ip, hex_port = fields[1].split(":")
            found[int(fields[9])] = (protocol, str(_address(hex_ip)), int(hex_port, 16))
    return found


def process_tree(root: int) -> dict[int, str]:
    """``root`` and all its descendants: pid -> command name."""
    children: dict[int, list[int]] = {}
    names = {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
        except OSError:  # exited meanwhile
            continue
        name, rest = stat[stat.index("(") + 1:].rsplit(")", 1)
        names[int(entry.name)] = name
        children.setdefault(int(rest.split()[1]), []).append(int(entry.name))
    tree, todo = {}, [root]
    while todo:
        pid = todo.pop()
        tree[pid] = names.get(pid, "?")
        todo.extend(children.get(pid, []))
    return tree


def socket_inodes(pid: int) -> set[int]:
    inodes = set()
    try:
        for fd in Path(f"/proc/{pid}/fd").iterdir():
            target = os.readlink(fd)
            if target.startswith("socket:["):
                inodes.add(int(target[8:-1]))
    except OSError:  # exited, or a descriptor closed while listed
        pass
    return inodes


def listeners_of_tree(root: int) -> set[tuple[str, str, str, int]]:
    """(process name, protocol, address, port) of every socket the tree listens on."""
    sockets = listening_sockets()
    return {(name, *sockets[inode]) for pid, name in process_tree(root).items()
            for inode in socket_inodes(pid) if inode in sockets}


def test_a_local_sweep_listens_on_loopback_only(data_cache: Path, tmp_path: Path) -> None:
    """A sweep that starts its own Ray (RAY_ADDRESS=local, as tests/conftest.py sets it: what a
    workstation without a cluster gets): sampled every half second from start to end, nothing
    of its tree listens beyond 127.0.0.1 / ::1, and the sweep finishes."""
    overrides = [arg for override in TINY for arg in ("--set", override)]
    command = [sys.executable, "-m", "raycl.tune", str(REPO / "searches" / "quickstart.yaml"),
               *overrides, "--num-samples", "1", "--name", "loopback",
               "--storage", str(tmp_path / "ray"),
               "--tracking-uri", f"sqlite:///{tmp_path / 'mlflow.db'}"]
    log = tmp_path / "sweep.log"
    env = {**os.environ, "RAY_ADDRESS": "local"}
    with log.open("w") as out:
        sweep = subprocess.Popen(command, stdout=out, stderr=subprocess.STDOUT, env=env,
                                 start_new_session=True)
    seen: set[tuple[str, str, str, int]] = set()
    try:
        deadline = time.monotonic() + 400
        while sweep.poll() is None and time.monotonic() < deadline:
            seen |= listeners_of_tree(sweep.pid)
            time.sleep(0.5)
        code = sweep.wait(timeout=max(1.0, deadline - time.monotonic()))
    finally:
        stop_group(sweep, grace_s=5.0)
    assert code == 0, log.read_text()[-3000:]
    names = {name for name, *_ in seen}
    # The sampling saw Ray itself and a trial, not just the start or the end.
    assert {"gcs_server", "raylet"} <= names, sorted(seen)
    assert any(name.startswith("ray::") for name in names), sorted(seen)
    open_ = sorted(entry for entry in seen if not _is_loopback(ipaddress.ip_address(entry[2])))
    assert open_ == [], f"listening beyond loopback: {open_}"
