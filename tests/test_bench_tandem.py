"""bench/serving.py against the real server (run.py with the embedded model), on every API path."""
from __future__ import annotations

import asyncio
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest

from bench import serving

REPO = Path(__file__).resolve().parent.parent
MODEL = REPO / "models" / "tandem-dense"
HEALTH_TIMEOUT_S = 120

pytestmark = pytest.mark.slow


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_healthy(process: subprocess.Popen, url: str, log: Path) -> None:
    deadline = time.monotonic() + HEALTH_TIMEOUT_S
    while time.monotonic() < deadline:
        if process.poll() is not None:
            pytest.fail(f"server exited with {process.returncode}:\n{log.read_text()[-3000:]}")
        try:
            with urllib.request.urlopen(url + "/health", timeout=2) as response:
                if response.status == 200:
                    return
        except OSError:
            time.sleep(0.5)
    pytest.fail(f"no healthy server after {HEALTH_TIMEOUT_S} s:\n{log.read_text()[-3000:]}")


@pytest.fixture(scope="module")
def tandem_url(tmp_path_factory):
    if not (REPO / "run.py").is_file() or not (MODEL / "config.json").is_file():
        pytest.fail("run.py or models/tandem-dense/config.json does not exist yet")
    port = free_port()
    log = tmp_path_factory.mktemp("tandem") / "server.log"
    with open(log, "w") as out:
        process = subprocess.Popen([sys.executable, "run.py", "--port", str(port), "--model-path", str(MODEL)],
                                   cwd=REPO, stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                   start_new_session=True)
    try:
        url = f"http://127.0.0.1:{port}"
        wait_healthy(process, url, log)
        yield url
    finally:
        for sig, wait_s in ((signal.SIGTERM, 15), (signal.SIGKILL, 10)):
            try:
                os.killpg(process.pid, sig)  # the session we started it in
            except ProcessLookupError:
                break
            try:
                process.wait(wait_s)
                break
            except subprocess.TimeoutExpired:
                continue


@pytest.mark.parametrize("backend", ["tandem", "openai", "openai-chat"])
def test_real_server_backends(tandem_url, backend):
    num_prompts, output_len = 4, 8
    args = serving.parse_args(["--base-url", tandem_url, "--backend", backend, "--tokenizer", str(MODEL),
                               "--dataset-name", "code", "--num-prompts", str(num_prompts),
                               "--random-input-len", "32", "--random-output-len", str(output_len),
                               "--random-range-ratio", "1", "--max-concurrency", "2", "--disable-tqdm",
                               "--timeout", "30"])
    m = asyncio.run(asyncio.wait_for(serving.run_benchmark(args, verbose=False), 120))
    assert m["failed"] == 0, m["failure_reasons"]
    assert m["completed"] == num_prompts
    assert m["total_output_tokens"] == num_prompts * output_len  # ignore_eos makes lengths exact
    assert m["total_input_tokens"] >= num_prompts * 30
    assert 0 < m["mean_ttft_ms"] <= m["mean_e2e_latency_ms"]
    assert m["p99_ttft_ms"] <= m["p99_e2e_latency_ms"]
    for name in ("ttft", "tpot", "itl", "e2e_latency"):
        assert m[f"median_{name}_ms"] <= m[f"p90_{name}_ms"] <= m[f"p99_{name}_ms"]
    assert m["output_throughput"] > 0 and m["request_throughput"] > 0 and m["concurrency"] > 0
    assert m["accept_length"] is None or m["accept_length"] >= 1.0  # the embedded model speculates by default


def test_a_constrained_share_follows_its_grammar_and_is_measured_apart(tandem_url):
    args = serving.parse_args(["--base-url", tandem_url, "--tokenizer", str(MODEL), "--dataset-name", "code",
                               "--num-prompts", "4", "--random-input-len", "32", "--random-output-len", "12",
                               "--random-range-ratio", "1", "--max-concurrency", "4", "--disable-tqdm",
                               "--timeout", "60", "--constrained-fraction", "0.5"])
    requests = serving.build_requests(args, serving.load_tokenizer(str(MODEL)))
    assert [r.constrained for r in requests] == [False, True, False, True]
    m = asyncio.run(asyncio.wait_for(serving.run_benchmark(args, verbose=False, requests=requests), 120))
    assert m["failed"] == 0, m["failure_reasons"]
    assert m["free_decode_throughput_per_request"] > 0 and m["constrained_decode_throughput_per_request"] > 0
    assert m["total_output_tokens"] == 4 * 12            # the default constraint never ends before the limit
