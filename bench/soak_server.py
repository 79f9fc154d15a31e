"""The server under test as processes and gauges, for bench/soak.py: find its PID from the port
it listens on, list its rank processes, read resident memory from /proc (or, for a server
elsewhere, from its /metrics gauges), and parse Prometheus text.

Linux only (/proc); everything here fails soft: a process that is gone reads as None.
"""
from __future__ import annotations

import contextlib
import os
from dataclasses import dataclass
from pathlib import Path

LISTEN = "0A"           # TCP state in /proc/net/tcp
RSS_GAUGES = ("process_resident_memory_bytes", "tandem_rank_resident_memory_bytes")


def listening_inodes(port: int) -> set[str]:
    """Socket inodes of the TCP listeners on `port` (IPv4 and IPv6)."""
    inodes = set()
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        with contextlib.suppress(OSError):
            for line in Path(table).read_text().splitlines()[1:]:
                fields = line.split()
                if fields[3] == LISTEN and int(fields[1].rsplit(":", 1)[1], 16) == port:
                    inodes.add(fields[9])
    return inodes


def socket_owners(inodes: set[str]) -> list[int]:
    """PIDs with one of these sockets open (a scan of /proc/*/fd)."""
    targets = {f"socket:[{inode}]" for inode in inodes}
    owners = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        with contextlib.suppress(OSError):
            if any(os.readlink(fd) in targets for fd in (entry / "fd").iterdir()):
                owners.append(int(entry.name))
    return owners


def pid_listening_on(port: int) -> int | None:
    """The server process: the owner of the listening socket whose parent does not own it too
    (a forked worker inherits the socket; its parent is the server)."""
    owners = socket_owners(listening_inodes(port))
    roots = [pid for pid in owners if parent_pid(pid) not in owners]
    return min(roots) if roots else None


def parent_pid(pid: int) -> int | None:
    with contextlib.suppress(OSError, IndexError, ValueError):
        return int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[1])
    return None


def child_pids(pid: int) -> list[int]:
    """Direct children, from every thread's list (a child is listed under the thread that made it)."""
    children = []
    with contextlib.suppress(OSError):
        for task in Path(f"/proc/{pid}/task").iterdir():
            with contextlib.suppress(OSError):
                children += [int(c) for c in (task / "children").read_text().split()]
    return sorted(set(children))


def cmdline(pid: int) -> str:
    with contextlib.suppress(OSError):
        return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
    return ""


def alive(pid: int) -> bool:
    """The process exists and is not a zombie."""
    with contextlib.suppress(OSError, IndexError):
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    return False


def started(pid: int) -> int:
    """When the process started, in clock ticks since boot (0 when it is gone)."""
    with contextlib.suppress(OSError, IndexError, ValueError):
        return int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[19])
    return 0


def rank_pids(server_pid: int) -> list[int]:
    """The server's rank processes: its multiprocessing-spawned children (not the resource
    tracker); any other children when none looks spawned."""
    children = [pid for pid in child_pids(server_pid) if alive(pid)]
    spawned = [pid for pid in children if "spawn_main" in cmdline(pid)]
    return spawned or [pid for pid in children if "resource_tracker" not in cmdline(pid)]


def rss_bytes(pid: int) -> int | None:
    with contextlib.suppress(OSError):
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    return None


@dataclass
class RssSample:
    requests: int
    elapsed_s: float
    front_bytes: int
    ranks_bytes: int
    source: str                         # proc | metrics
    ranks: dict[int, int] | None = None  # pid -> bytes (from /proc)

    @property
    def total_bytes(self) -> int:
        return self.front_bytes + self.ranks_bytes


def sample_proc(server_pid: int, requests: int, elapsed_s: float) -> RssSample | None:
    """Resident memory of the server and its rank processes, from /proc (None once it is gone)."""
    front = rss_bytes(server_pid)
    if front is None:
        return None
    ranks = {pid: rss for pid in rank_pids(server_pid) if (rss := rss_bytes(pid)) is not None}
    return RssSample(requests, elapsed_s, front, sum(ranks.values()), "proc", ranks)


def sample_gauges(gauges: dict[str, float], requests: int, elapsed_s: float) -> RssSample | None:
    """The same from the server's own gauges (a server on another machine)."""
    if RSS_GAUGES[0] not in gauges:
        return None
    return RssSample(requests, elapsed_s, int(gauges[RSS_GAUGES[0]]), int(gauges.get(RSS_GAUGES[1], 0)), "metrics")


def parse_gauges(text: str) -> dict[str, float]:
    """Unlabelled samples of Prometheus text: name -> value."""
    values = {}
    for line in text.splitlines():
        if line and not line.startswith("#") and "{" not in line:
            name, _, value = line.partition(" ")
            with contextlib.suppress(ValueError):
                values[name] = float(value.split()[0])
    return values
