"""Start real Tandem servers (run.py in a subprocess) on free loopback ports for tests."""
from __future__ import annotations

import contextlib
import os
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


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Server:
    def __init__(self, flags: list[str], log: Path):
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log = log
        with open(log, "w") as out:
            self.process = subprocess.Popen([sys.executable, "run.py", "--port", str(self.port), *flags], cwd=REPO,
                                            stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                            start_new_session=True)

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
        children = Path(f"/proc/{self.process.pid}/task/{self.process.pid}/children")
        return [int(pid) for pid in children.read_text().split()] if children.exists() else []

    def stop(self) -> None:
        for sig, wait_s in ((signal.SIGTERM, 20), (signal.SIGKILL, 10)):
            if self.process.poll() is not None:
                break
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.process.pid, sig)
            with contextlib.suppress(subprocess.TimeoutExpired):
                self.process.wait(wait_s)


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
