"""Start real Tandem servers (run.py in a subprocess) on free loopback ports for tests."""
from __future__ import annotations

import contextlib
import os
import random
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
DENSE = REPO / "models" / "tandem-dense"
MOE = REPO / "models" / "tandem-moe"
START_TIMEOUT_S = 180


def pinned_dtype(flags) -> list[str]:
    """The flags, in float32 unless they name a dtype. --dtype auto is bfloat16 on a CPU with
    AVX512-BF16 and the native kernels; the tests that hold tokens against transformers' float32
    run, or compare exact tokens between paths, pin float32 so that they mean the same on every
    CPU (tests/test_bf16_spec.py and tests/test_default_dtype.py run the bf16 path)."""
    flags = list(flags)
    return flags if any(f == "--dtype" or f.startswith("--dtype=") for f in flags) else [*flags, "--dtype", "float32"]


def free_port(span: int = 1) -> int:
    """A port P with P .. P + span - 1 free, drawn below the kernel's ephemeral range: a port the kernel
    hands out (bind to 0) is free again once closed, and any outgoing connection (a rank's, gloo's) may
    be given it before the server binds it; a port below the range is only ever taken by a bind."""
    low = int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0]) \
        if Path("/proc/sys/net/ipv4/ip_local_port_range").exists() else 32768
    for _ in range(200):
        port = random.randrange(max(1024, low - 12000), low - span)
        if all(bindable(port + i) for i in range(span)):
            return port
    raise RuntimeError(f"no {span} free consecutive ports below {low}")


def bindable(port: int) -> bool:
    with socket.socket() as s:
        try:
            s.bind(("127.0.0.1", port))
        except OSError:
            return False
        return True


class Server:
    def __init__(self, flags: list[str], log: Path, env: dict[str, str] | None = None):
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log = log
        with open(log, "w") as out:
            command = [sys.executable, "run.py", "--port", str(self.port), *pinned_dtype(flags)]
            self.process = subprocess.Popen(command, cwd=REPO,
                                            stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                            start_new_session=True, env={**os.environ, **(env or {})})

    def wait_healthy(self) -> "Server":
        deadline = time.monotonic() + START_TIMEOUT_S
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise RuntimeError(f"server exited with {self.process.returncode}:\n{self.log.read_text()[-3000:]}")
            with contextlib.suppress(OSError):
                with urllib.request.urlopen(self.url + "/health", timeout=2) as response:
                    if response.status == 200:
                        return self
            time.sleep(0.3)
        raise RuntimeError(f"no healthy server after {START_TIMEOUT_S} s:\n{self.log.read_text()[-3000:]}")

    def rank_pids(self) -> list[int]:
        """The rank processes (multiprocessing's spawned children; not its resource tracker)."""
        return [pid for pid in child_pids(self.process.pid) if b"spawn_main" in cmdline(pid)]

    def wait_ranks(self, count: int, timeout: float = START_TIMEOUT_S) -> list[int]:
        """The rank pids once `count` ranks are up and /health is 200 (after a restart, say)."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            with contextlib.suppress(OSError, KeyError):
                with urllib.request.urlopen(self.url + "/metrics", timeout=2) as response:
                    up = metric(response.read().decode(), "tandem_ranks_up")
                pids = self.rank_pids()
                if up == count and len(pids) == count:
                    return pids
            time.sleep(0.2)
        raise RuntimeError(f"{count} healthy ranks not seen in {timeout} s:\n{self.log.read_text()[-3000:]}")

    def stop(self) -> None:
        for sig, wait_s in ((signal.SIGTERM, 20), (signal.SIGKILL, 10)):
            if self.process.poll() is not None:
                break
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.process.pid, sig)
            with contextlib.suppress(subprocess.TimeoutExpired):
                self.process.wait(wait_s)


def child_pids(pid: int) -> list[int]:
    children = Path(f"/proc/{pid}/task/{pid}/children")
    with contextlib.suppress(OSError):
        return [int(child) for child in children.read_text().split()]
    return []


def cmdline(pid: int) -> bytes:
    with contextlib.suppress(OSError):
        return Path(f"/proc/{pid}/cmdline").read_bytes()
    return b""


def alive(pid: int) -> bool:
    """The process exists and is not a zombie."""
    with contextlib.suppress(OSError):
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    return False


@contextlib.contextmanager
def running_server(flags: list[str], log: Path):
    server = Server(flags, log)
    try:
        yield server.wait_healthy()
    finally:
        server.stop()


def metric(text: str, name: str) -> float:
    """Value of an unlabelled sample in Prometheus text."""
    for line in text.splitlines():
        if line.startswith(name + " "):
            return float(line.split()[1])
    raise KeyError(name)
