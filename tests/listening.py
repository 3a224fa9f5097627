"""What a process tree listens on, read from ``/proc`` (Linux): a local sweep must be closed to
the network, every process of ``python -m raycl.tune``'s tree (the driver, Ray's GCS, raylet,
dashboard and agents, metrics exporters, Tune's workers, the MLflow relay) listening on loopback
only (docs/clusters.md "What listens where").

A trial that trains in its own process (``scaling.num_workers=0``, as ``make demo``) is what is
checked: a worker group adds torch.distributed's TCPStore, which binds every interface whatever
its address (pytorch/pytorch#173909)."""

from __future__ import annotations

import ipaddress
import os
import threading
from pathlib import Path

# /proc/net/* states: a TCP socket accepting connections; a UDP socket bound, unconnected.
LISTENING = {"tcp": "0A", "tcp6": "0A", "udp": "07", "udp6": "07"}


def _address(hex_ip: str) -> ipaddress.IPv4Address | ipaddress.IPv6Address:
    """An address as /proc/net prints it: 32-bit words, each in the host's (little-endian)
    byte order."""
    raw = bytes.fromhex(hex_ip)
    words = b"".join(raw[i:i + 4][::-1] for i in range(0, len(raw), 4))
    return ipaddress.ip_address(words)


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


def is_loopback(address: str) -> bool:
    parsed = ipaddress.ip_address(address)
    mapped = getattr(parsed, "ipv4_mapped", None)  # ::ffff:127.0.0.1 on a dual-stack socket
    return parsed.is_loopback or (mapped is not None and mapped.is_loopback)


class ListenerSampler:
    """Samples what ``root``'s process tree listens on every half second, in a thread, from
    ``start()`` to ``stop()``; ``seen`` holds (process name, protocol, address, port)."""

    def __init__(self, root: int) -> None:
        self.root = root
        self.seen: set[tuple[str, str, str, int]] = set()
        self._done = threading.Event()
        self._thread = threading.Thread(target=self._sample, daemon=True)

    def _sample(self) -> None:
        while not self._done.wait(0.5):
            self.seen |= listeners_of_tree(self.root)

    def start(self) -> ListenerSampler:
        self._thread.start()
        return self

    def stop(self) -> None:
        self._done.set()
        self._thread.join(timeout=30)

    def assert_loopback_only(self) -> None:
        """Ray itself and a trial were seen (not just the start or the end of the sweep), and
        nothing of the tree listened beyond 127.0.0.1 / ::1."""
        names = {name for name, *_ in self.seen}
        assert {"gcs_server", "raylet"} <= names, sorted(self.seen)
        assert any(name.startswith("ray::") for name in names), sorted(self.seen)
        open_ = sorted(entry for entry in self.seen if not is_loopback(entry[2]))
        assert open_ == [], f"listening beyond loopback: {open_}"
