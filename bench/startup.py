"""How long a server takes to start (launch to /health 200) and to stop (SIGTERM to exit), and its
resident memory when idle: median over --repeats starts of one configuration.

    python bench/startup.py --repeats 5
    python bench/startup.py --tree /tmp/tandem-at-REV --repeats 5 -- --speculative-algorithm none

--tree runs another checkout's run.py (a `git worktree add` of an earlier commit, say) with the same
Python, so that two revisions can be measured one after the other on the same machine.
"""
from __future__ import annotations

import argparse
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from bench.compare import free_port, resident_mb  # noqa: E402

REPO = Path(__file__).resolve().parent.parent


def healthy(port: int) -> bool:
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=2) as response:
            return response.status == 200
    except OSError:
        return False


def one_start(tree: Path, flags: list[str], log: Path, timeout: float) -> tuple[float, float, float | None]:
    """(seconds to /health 200, seconds from SIGTERM to exit, PSS MB of the idle server)."""
    port = free_port()
    env = {**os.environ, "PYTHONPATH": str(tree)}
    started = time.monotonic()
    with open(log, "w") as out:
        process = subprocess.Popen([sys.executable, "run.py", "--port", str(port), *flags], cwd=tree, env=env,
                                   stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
    try:
        while not healthy(port):
            if process.poll() is not None or time.monotonic() - started > timeout:
                raise RuntimeError(f"no healthy server (log: {log})")
            time.sleep(0.05)
        up = time.monotonic() - started
        time.sleep(1.0)
        memory = resident_mb(process.pid)
        stopping = time.monotonic()
        os.killpg(process.pid, signal.SIGTERM)
        process.wait(60)
        return up, time.monotonic() - stopping, memory
    finally:
        if process.poll() is None:
            os.killpg(process.pid, signal.SIGKILL)
            process.wait()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tree", default=str(REPO), help="The checkout whose run.py starts.")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--timeout", type=float, default=180.0)
    parser.add_argument("flags", nargs="*", help="run.py flags (after --).")
    args = parser.parse_args(argv)
    log = Path(tempfile.mkdtemp(prefix="tandem-startup-")) / "server.log"
    runs = [one_start(Path(args.tree), args.flags, log, args.timeout) for _ in range(args.repeats)]
    ups, downs, memories = zip(*runs)
    print(f"{args.tree} {' '.join(args.flags)}: medians of {args.repeats} starts: "
          f"start {statistics.median(ups):.2f} s, stop {statistics.median(downs):.2f} s, "
          f"idle PSS {statistics.median(m for m in memories if m is not None):.0f} MB "
          f"(starts {', '.join(f'{u:.2f}' for u in ups)})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
