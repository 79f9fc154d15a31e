"""bench/: the load-test client against a fake server (all three API paths), failures,
output files and plots, the comparison driver, and the Hugging Face baseline.

Run as a script, this file is a fake server that takes run.py's flags (for bench/compare.py).
"""
from __future__ import annotations

import argparse
import asyncio
import json
import math
import os
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
from aiohttp import web

REPO = Path(__file__).resolve().parent.parent
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

from bench import serving  # noqa: E402

METRIC_KEYS = [
    "completed", "failed", "failure_reasons", "duration", "total_input_tokens", "total_output_tokens",
    "request_throughput", "input_throughput", "output_throughput", "decode_throughput_per_request", "concurrency",
    "accept_length",
] + [f"{s}_{k}_ms" for k in ("ttft", "tpot", "itl", "e2e_latency") for s in ("mean", "median", "p90", "p99")]


# ---- a fake OpenAI-compatible / SGLang-native server ------------------------------

def fake_app(mode: str = "ok", delay: float = 0.002, tokens_per_chunk: int = 1, pd: bool = False,
             log: list | None = None) -> web.Application:
    """Streams exactly max_new_tokens / max_tokens tokens (" t0 t1 ...").

    mode: ok | error500 (every request) | flaky (every other request 500) | break (the
    connection drops after two chunks). tokens_per_chunk > 1 imitates speculative decoding
    and reports spec_verify_ct on /generate. pd: /metrics also has a PD node's counters, growing
    by PD_STEP at every scrape. log: gets each /generate prompt, and "flush" for each /flush_cache.
    """
    calls = {"n": 0}
    log = [] if log is None else log

    def failing() -> bool:
        calls["n"] += 1
        return mode == "error500" or (mode == "flaky" and calls["n"] % 2 == 0)

    async def stream(request: web.Request, chunks):
        response = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await response.prepare(request)
        for i, chunk in enumerate(chunks):
            if mode == "break" and i == 2:
                request.transport.close()
                return response
            await asyncio.sleep(delay)
            await response.write(b"data: " + json.dumps(chunk).encode() + b"\n\n")
        await response.write(b"data: [DONE]\n\n")
        return response

    def pieces(n: int):
        """Token counts per chunk: tokens_per_chunk at a time, the rest last."""
        done = 0
        while done < n:
            step = min(tokens_per_chunk, n - done)
            yield done, step
            done += step

    async def generate(request: web.Request):
        if failing():
            return web.Response(status=500, text="boom: fake failure")
        body = await request.json()
        log.append(body["text"])
        n = body["sampling_params"]["max_new_tokens"]
        prompt_tokens = len(body["text"].split())
        chunks, verify = [], 0
        for done, step in pieces(n):
            verify += 1
            meta = {"prompt_tokens": prompt_tokens, "completion_tokens": done + step,
                    "finish_reason": {"type": "length"} if done + step == n else None}
            if tokens_per_chunk > 1:
                meta["spec_verify_ct"] = verify
            chunks.append({"text": "".join(f" t{i}" for i in range(done + step)),
                           "output_ids": list(range(done + step)), "meta_info": meta})
        return await stream(request, chunks)

    async def completions(request: web.Request):
        if failing():
            return web.Response(status=500, text="boom: fake failure")
        body = await request.json()
        chat = "messages" in body
        n = body["max_tokens"]
        prompt_tokens = len((body["messages"][-1]["content"] if chat else body["prompt"]).split())
        chunks = [{"choices": [{"index": 0, "delta": {"role": "assistant", "content": ""}}]}] if chat else []
        for done, step in pieces(n):
            piece = "".join(f" t{i}" for i in range(done, done + step))
            finish = "length" if done + step == n else None
            choice = {"index": 0, "delta": {"content": piece}} if chat else {"index": 0, "text": piece}
            chunks.append({"choices": [choice | {"finish_reason": finish}]})
        if (body.get("stream_options") or {}).get("include_usage"):
            chunks.append({"choices": [], "usage": {"prompt_tokens": prompt_tokens, "completion_tokens": n,
                                                    "total_tokens": prompt_tokens + n}})
        return await stream(request, chunks)

    async def models(_):
        return web.json_response({"object": "list", "data": [{"id": "fake-model", "object": "model"}]})

    async def health(_):
        return web.Response(text="ok")

    scrapes = [0]

    async def metrics(_):
        scrapes[0] += 1           # phase counters grow as a speculating server's would: draft 1/4 of the time
        return web.Response(text="# TYPE tandem_hidden_cpu_fraction gauge\ntandem_hidden_cpu_fraction 0.75\n"
                                 f'tandem_spec_phase_seconds_total{{phase="draft"}} {scrapes[0] * 0.5}\n'
                                 f'tandem_spec_phase_seconds_total{{phase="verify"}} {scrapes[0] * 1.5}\n'
                                 + (pd_metrics(scrapes[0]) if pd else ""))

    async def flush_cache(_):
        log.append("flush")
        return web.Response(text="ok")

    app = web.Application()
    app.router.add_post("/flush_cache", flush_cache)
    app.router.add_post("/generate", generate)
    app.router.add_post("/v1/completions", completions)
    app.router.add_post("/v1/chat/completions", completions)
    app.router.add_get("/v1/models", models)
    app.router.add_get("/health", health)
    app.router.add_get("/metrics", metrics)
    return app


PD_STEP = {"rooms_done": 4.0, "rooms_failed": 1.0, "transferred_bytes": 4e6, "transfer_seconds": 2.0}


def pd_metrics(scrapes: int) -> str:
    """A PD node's counters after `scrapes` scrapes (failures: one timeout per scrape)."""
    n = {key: step * scrapes for key, step in PD_STEP.items()}
    return ("# TYPE tandem_pd_rooms gauge\ntandem_pd_rooms{state=\"waiting\"} 0.0\n"
            f'tandem_pd_rooms_finished_total{{state="done"}} {n["rooms_done"]}\n'
            f'tandem_pd_rooms_finished_total{{state="failed"}} {n["rooms_failed"]}\n'
            f'tandem_pd_failures_total{{reason="timeout"}} {n["rooms_failed"]}\n'
            f'tandem_pd_transferred_bytes_total {n["transferred_bytes"]}\n'
            f'tandem_pd_transfer_seconds_total {n["transfer_seconds"]}\n')


class FakeServer:
    """A fake_app served on a free loopback port from a background thread."""

    def __init__(self, **options):
        self.options, self.loop, self.port = options, asyncio.new_event_loop(), None
        ready = threading.Event()
        self.thread = threading.Thread(target=self._serve, args=(ready,), daemon=True)
        self.thread.start()
        assert ready.wait(10), "fake server did not start"
        self.url = f"http://127.0.0.1:{self.port}"

    def _serve(self, ready: threading.Event) -> None:
        asyncio.set_event_loop(self.loop)
        self.runner = web.AppRunner(fake_app(**self.options), access_log=None)
        self.loop.run_until_complete(self.runner.setup())
        site = web.TCPSite(self.runner, "127.0.0.1", 0)
        self.loop.run_until_complete(site.start())
        self.port = site._server.sockets[0].getsockname()[1]
        ready.set()
        self.loop.run_forever()

    def close(self) -> None:
        asyncio.run_coroutine_threadsafe(self.runner.cleanup(), self.loop).result(10)
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(10)


# ---- fixtures ------------------------------------------------------------------

def build_tiny_tokenizer(folder: Path) -> Path:
    """A small byte-level BPE tokenizer trained on a few standard-library files."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=400, special_tokens=["<|endoftext|>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    texts = [p.read_text(errors="replace") for p in serving.python_sources()[:20]]
    tokenizer.train_from_iterator(texts, trainer)
    fast = PreTrainedTokenizerFast(tokenizer_object=tokenizer, eos_token="<|endoftext|>",
                                   pad_token="<|endoftext|>")
    fast.save_pretrained(str(folder))
    return folder


@pytest.fixture(scope="module")
def tokenizer_dir(tmp_path_factory) -> Path:
    return build_tiny_tokenizer(tmp_path_factory.mktemp("tokenizer"))


@pytest.fixture(scope="module")
def fake_server():
    server = FakeServer()
    yield server
    server.close()


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def bench_args(url: str, tokenizer: Path, *extra: str) -> argparse.Namespace:
    return serving.parse_args(["--base-url", url, "--tokenizer", str(tokenizer), "--disable-tqdm",
                               "--dataset-name", "random", "--num-prompts", "8", "--random-input-len", "32",
                               "--random-output-len", "6", "--random-range-ratio", "1.0", *extra])


def run(args) -> dict:
    return asyncio.run(asyncio.wait_for(serving.run_benchmark(args, verbose=False), 60))


def check_sane(m: dict, num_prompts: int) -> None:
    for key in METRIC_KEYS:
        assert key in m, key
    assert m["completed"] + m["failed"] == num_prompts
    assert m["duration"] > 0
    if m["completed"]:
        for name in ("ttft", "tpot", "itl", "e2e_latency"):
            values = [m[f"{s}_{name}_ms"] for s in ("median", "p90", "p99")]
            assert all(v is not None and v >= 0 for v in values), name
            assert values[0] <= values[1] <= values[2], name
        assert m["mean_ttft_ms"] <= m["mean_e2e_latency_ms"]
        assert m["p99_ttft_ms"] <= m["p99_e2e_latency_ms"]
        assert m["request_throughput"] > 0 and m["output_throughput"] > 0 and m["input_throughput"] > 0
        assert m["concurrency"] > 0
        if m["decode_throughput_per_request"] is not None:     # tokens after the first / their time
            assert 0.5 < m["decode_throughput_per_request"] * m["mean_tpot_ms"] / 1000 < 2.0


# ---- (a) every backend path ------------------------------------------------------

@pytest.mark.parametrize("backend", serving.BACKENDS)
def test_backends_report_sane_metrics(fake_server, tokenizer_dir, backend):
    m = run(bench_args(fake_server.url, tokenizer_dir, "--backend", backend, "--max-concurrency", "4"))
    check_sane(m, 8)
    assert m["completed"] == 8 and m["failed"] == 0 and m["failure_reasons"] == {}
    assert m["total_output_tokens"] == 8 * 6
    assert m["total_input_tokens"] > 0
    assert m["accept_length"] is None
    assert m["backend"] == backend


def test_code_and_prompts_datasets_with_poisson_arrivals(fake_server, tokenizer_dir, tmp_path):
    m = run(bench_args(fake_server.url, tokenizer_dir, "--dataset-name", "code", "--request-rate", "200",
                       "--random-range-ratio", "0.5"))
    check_sane(m, 8)
    assert m["completed"] == 8
    assert 8 * 3 <= m["total_output_tokens"] <= 8 * 6

    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text('{"prompt": "def add(a, b):", "output_len": 3}\n{"prompt": "import os\\n"}\n')
    m = run(bench_args(fake_server.url, tokenizer_dir, "--dataset-name", "prompts", "--dataset-path", str(prompts),
                       "--num-prompts", "4", "--backend", "openai"))
    check_sane(m, 4)
    assert m["total_output_tokens"] == 3 + 6 + 3 + 6


def test_shared_prefix_and_multi_turn_workloads_flush_the_cache_first(tokenizer_dir):
    """generated-shared-prefix: groups x questions, each after its group's system prompt; multi-turn: each
    turn sends the conversation so far (its earlier prompts and their answers) and a new question; the
    prefix cache is flushed after the warm-up, before the measured requests."""
    log: list = []
    server = FakeServer(log=log)
    try:
        gsp = bench_args(server.url, tokenizer_dir, "--dataset-name", "generated-shared-prefix", "--gsp-num-groups",
                         "3", "--gsp-prompts-per-group", "4", "--gsp-system-prompt-len", "40", "--gsp-question-len",
                         "5", "--gsp-output-len", "3")
        m = run(gsp)
        assert m["completed"] == 12 and log[1] == "flush"
        systems = {prompt.split("\n")[0] for prompt in log[2:]}
        assert len(systems) == 3 and len(set(log[2:])) == 12
        log.clear()
        m = run(bench_args(server.url, tokenizer_dir, "--dataset-name", "multi-turn", "--num-prompts", "3",
                           "--multi-turn-turns", "3", "--max-concurrency", "2"))
        assert m["completed"] == 9 and log[1] == "flush"
        prompts = log[2:]
        for prompt in prompts:
            earlier = [p for p in prompts if p != prompt and prompt.startswith(p)]
            assert len(earlier) in (0, 1, 2)              # a first, second or third turn
            if earlier:                                    # the answer (" t0 t1 ...") follows the turn before
                longest = max(earlier, key=len)
                assert prompt[len(longest):].startswith(" t0 t1 t2 t3 t4 t5")
        assert sum(not any(prompt.startswith(p) for p in prompts if p != prompt) for prompt in prompts) == 3
        assert len(m["median_ttft_ms_by_turn"]) == 3 and all(t > 0 for t in m["median_ttft_ms_by_turn"])
    finally:
        server.close()


def test_datasets_are_deterministic_by_seed(tokenizer_dir):
    tokenizer = serving.load_tokenizer(str(tokenizer_dir))
    for name in ("random", "code"):
        a = serving.build_requests(bench_args("http://x", tokenizer_dir, "--dataset-name", name), tokenizer)
        b = serving.build_requests(bench_args("http://x", tokenizer_dir, "--dataset-name", name), tokenizer)
        c = serving.build_requests(bench_args("http://x", tokenizer_dir, "--dataset-name", name, "--seed", "7"),
                                   tokenizer)
        assert [r.prompt for r in a] == [r.prompt for r in b] != [r.prompt for r in c]
        assert all(abs(r.prompt_len - 32) <= 4 for r in a), [r.prompt_len for r in a]


def test_multi_token_chunks_and_accept_length(tokenizer_dir):
    server = FakeServer(tokens_per_chunk=3, delay=0.01)
    try:
        generate = run(bench_args(server.url, tokenizer_dir, "--backend", "tandem"))
        chat = run(bench_args(server.url, tokenizer_dir, "--backend", "openai-chat"))
    finally:
        server.close()
    for m in (generate, chat):
        check_sane(m, 8)
        assert m["total_output_tokens"] == 48  # 6 tokens a request, in two chunks of 3
    assert generate["accept_length"] == pytest.approx(3.0)
    assert generate["mean_itl_ms"] < chat["mean_itl_ms"]  # per token on /generate, per chunk on OpenAI paths


# ---- (b) failures are counted, never fatal -------------------------------------------

@pytest.mark.parametrize("mode, reason", [("error500", "HTTP 500: boom"), ("break", "broken stream")])
@pytest.mark.parametrize("backend", ["tandem", "openai-chat"])
def test_server_failures_are_counted(tokenizer_dir, mode, reason, backend):
    server = FakeServer(mode=mode)
    try:
        m = run(bench_args(server.url, tokenizer_dir, "--backend", backend))
    finally:
        server.close()
    check_sane(m, 8)
    assert m["completed"] == 0 and m["failed"] == 8
    assert list(m["failure_reasons"]) and all(reason in r for r in m["failure_reasons"]), m["failure_reasons"]
    assert sum(m["failure_reasons"].values()) == 8
    assert m["mean_ttft_ms"] is None and m["total_output_tokens"] == 0


def test_partial_failures(tokenizer_dir):
    server = FakeServer(mode="flaky")
    try:
        m = run(bench_args(server.url, tokenizer_dir, "--backend", "openai", "--warmup-requests", "0"))
    finally:
        server.close()
    check_sane(m, 8)
    assert m["completed"] == 4 and m["failed"] == 4
    assert m["total_output_tokens"] == 4 * 6


def test_refused_connection_is_a_failure(tokenizer_dir):
    m = run(bench_args(f"http://127.0.0.1:{free_port()}", tokenizer_dir, "--backend", "vllm", "--model", "m"))
    check_sane(m, 8)
    assert m["failed"] == 8
    assert all("connection failed" in r for r in m["failure_reasons"]), m["failure_reasons"]


def test_timeout_is_a_failure(tokenizer_dir):
    server = FakeServer(delay=0.5)
    try:
        m = run(bench_args(server.url, tokenizer_dir, "--timeout", "0.3", "--warmup-requests", "0"))
    finally:
        server.close()
    assert m["failed"] == 8 and all("timeout" in r for r in m["failure_reasons"])


# ---- (c) the command line: output file, plot, exit codes ------------------------------

def cli(*argv: str, timeout: float = 120) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, *argv], cwd=REPO, capture_output=True, text=True, timeout=timeout)


def test_cli_writes_json_lines_and_plot(fake_server, tokenizer_dir, tmp_path):
    out, png = tmp_path / "runs.jsonl", tmp_path / "plot.png"
    common = ["bench/serving.py", "--base-url", fake_server.url, "--tokenizer", str(tokenizer_dir),
              "--num-prompts", "6", "--random-input-len", "16", "--random-output-len", "5",
              "--random-range-ratio", "1", "--output-file", str(out)]
    first = cli(*common, "--plot", str(png))
    assert first.returncode == 0, first.stderr
    assert "Serving Benchmark Result" in first.stdout and "Mean TTFT (ms):" in first.stdout
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    second = cli(*common, "--backend", "openai-chat", "--disable-tqdm", "--max-concurrency", "2")
    assert second.returncode == 0, second.stderr
    lines = out.read_text().splitlines()
    assert len(lines) == 2
    records = [json.loads(line, parse_constant=pytest.fail) for line in lines]  # strict JSON
    assert [r["backend"] for r in records] == ["tandem", "openai-chat"]
    assert records[0]["request_rate"] == "inf" and records[1]["max_concurrency"] == 2
    for record in records:
        check_sane(record, 6)
        assert record["total_output_tokens"] == 30 and record["args"]["num_prompts"] == 6


def test_cli_exit_codes(tokenizer_dir):
    refused = cli("bench/serving.py", "--port", str(free_port()), "--tokenizer", str(tokenizer_dir),
                  "--num-prompts", "3", "--random-input-len", "8", "--random-output-len", "2", "--disable-tqdm")
    assert refused.returncode == 0, refused.stderr
    assert "connection failed" in refused.stdout
    assert cli("bench/serving.py", "--backend", "nope").returncode == 2
    assert cli("bench/serving.py", "--tokenizer", str(tokenizer_dir), "--dataset-name", "prompts").returncode == 2
    assert cli("bench/serving.py", "--tokenizer", str(tokenizer_dir), "--request-rate", "0").returncode == 2


# ---- bench/compare.py with fake servers ----------------------------------------------

def test_compare_runs_rounds_and_stops_servers(tokenizer_dir, tmp_path):
    out = tmp_path / "compare.jsonl"
    result = cli("bench/compare.py", "--server-script", "tests/test_bench.py", "--tokenizer", str(tokenizer_dir),
                 "--config", "fast=", "--config", "slow=--fake-delay 0.01", "--rounds", "2",
                 "--num-prompts", "4", "--random-input-len", "16", "--random-output-len", "4",
                 "--max-concurrency", "1,4", "--output-file", str(out), "--log-dir", str(tmp_path / "logs"))
    assert result.returncode == 0, result.stdout + result.stderr
    assert "fast" in result.stdout and "slow" in result.stdout
    record = json.loads(out.read_text().splitlines()[-1])
    assert [c["name"] for c in record["configs"]] == ["fast", "slow"]
    rows = record["results"]
    assert len(rows) == 4  # 2 configs x 2 concurrencies
    for row in rows:
        assert len(row["runs"]) == 2 and row["median"]["completed"] == 4
        assert row["median"]["hidden_cpu_fraction"] == pytest.approx(0.75)
        assert row["median"]["draft_share"] == pytest.approx(0.25)
    fast = next(r for r in rows if r["config"] == "fast" and r["max_concurrency"] == 1)
    slow = next(r for r in rows if r["config"] == "slow" and r["max_concurrency"] == 1)
    assert slow["median"]["mean_tpot_ms"] > fast["median"]["mean_tpot_ms"]
    pairs = {p["max_concurrency"]: p for p in record["paired_output"]}
    assert sorted(pairs) == [1, 4] and all(p["config"] == "slow" and p["against"] == "fast" for p in pairs.values())
    assert pairs[1]["rounds"] == 2 and pairs[1]["low"] <= pairs[1]["median"] < 1 and "round by round" in result.stdout
    pids = [int(p) for p in record["server_pids"]]
    time.sleep(0.2)
    for pid in pids:
        assert not Path(f"/proc/{pid}").exists() or "zombie" in Path(f"/proc/{pid}/status").read_text().lower()


def test_paired_ratios_follow_rounds_that_drift_together():
    """Two servers whose speed drifts 2x over the rounds, one 5% behind in every round: the ratio of
    their medians swings, the median of the per-round ratios reads 0.95 with a tight interval."""
    from bench.paired import paired
    speeds = [100, 200, 60, 150, 90, 180, 120, 70]
    old = [{"tok": s} for s in speeds]
    new = [{"tok": s * 0.95} for s in speeds[1:] + speeds[:1]]           # rounds out of step: a wide interval
    drifted = paired(new, old, "tok")
    together = paired([{"tok": s * 0.95} for s in speeds], old, "tok")
    assert together.median == pytest.approx(0.95) and together.high - together.low < 1e-9
    assert drifted.high - drifted.low > 0.3 and together.rounds == drifted.rounds == 8
    assert paired(new[:1], old[:1], "tok") is None                           # one round: nothing to bound
    assert paired([{"tok": None}] * 3, old[:3], "tok") is None


def test_trace_spans_merges_steps_of_a_kind_and_compares_labels(tmp_path):
    from bench import trace_spans
    events = [{"name": "thread_name", "ph": "M", "pid": 0, "tid": 3},
              {"name": "forward 7", "ph": "X", "pid": 0, "tid": 3, "ts": 0.0, "dur": 10.0},
              {"name": "forward 8", "ph": "X", "pid": 0, "tid": 3, "ts": 20.0, "dur": 30.0},
              {"name": "schedule 8", "ph": "X", "pid": 0, "tid": 1, "ts": 5.0, "dur": 2.0}]
    path = tmp_path / "t.json"
    path.write_text("[\n" + "".join(json.dumps(e) + ",\n" for e in events))       # cut short, as after a crash
    got = trace_spans.summary(trace_spans.spans(path))
    assert got["device/forward"] == (20.0, 2, 0.04) and got["schedule/schedule"] == (2.0, 1, 0.002)
    assert got["run/wall"][0] == 50.0
    result = cli("bench/trace_spans.py", f"a={path}", f"b={path}")
    assert result.returncode == 0 and "device/forward" in result.stdout and "b: median" in result.stdout
    assert cli("bench/trace_spans.py", str(path)).returncode == 2


def test_compare_reports_a_server_that_never_gets_healthy_and_measures_the_rest(tokenizer_dir, tmp_path):
    out = tmp_path / "compare.jsonl"
    result = cli("bench/compare.py", "--server-script", "tests/test_bench.py", "--tokenizer", str(tokenizer_dir),
                 "--config", "ok=", "--config", "dead=--fake-exit", "--health-timeout", "20", "--rounds", "1",
                 "--num-prompts", "2", "--max-concurrency", "1", "--output-file", str(out),
                 "--log-dir", str(tmp_path / "logs"))
    assert result.returncode == 1, result.stdout + result.stderr
    assert "'dead' exited with status 1" in result.stderr and "fake server: asked to fail" in result.stderr
    record = json.loads(out.read_text())
    assert [row["config"] for row in record["results"]] == ["ok"]
    assert record["results"][0]["median"]["completed"] == 2
    assert "fake server: asked to fail" in record["failed_servers"]["dead"]


def test_compare_names_each_config_per_tree_and_ratios_the_working_tree_to_the_checkout():
    from bench import compare
    from bench.worktree import WORKING_TREE, Tree

    old = Tree(Path("/elsewhere/old"), "ab" * 20, "abababa")
    specs = compare.plan_servers([("a", ["--x"]), ("b", [])], [old, WORKING_TREE])
    assert [s.name for s in specs] == ["a@abababa", "a", "b@abababa", "b"]      # side by side, old first
    assert specs[0].flags == specs[1].flags == ("--x",) and specs[0].tree is old

    model = str(REPO / "models" / "tandem-dense")         # the embedded model moves into the old tree ...
    assert old.place(model, within=REPO / "models") == "/elsewhere/old/models/tandem-dense"
    assert old.place("models/tandem-dense", within=REPO / "models") == "/elsewhere/old/models/tandem-dense"
    assert old.place("/data/m", within=REPO / "models") == "/data/m"      # ... a model elsewhere stays
    assert old.place("run.py") == "/elsewhere/old/run.py"
    assert WORKING_TREE.place("run.py") == str(REPO / "run.py")

    def row(config, tok_s, ttft):
        return {"config": config, "max_concurrency": 1,
                "median": {"output_throughput": tok_s, "decode_throughput_per_request": 2 * tok_s,
                           "median_ttft_ms": ttft, "median_itl_ms": None}}
    rows = [row("a@abababa", 100.0, 20.0), row("a", 125.0, 10.0), row("b", 50.0, 5.0)]   # b@... never started
    ab = compare.ab_ratios(rows, ["a", "b"], old.suffix)
    assert [(e["config"], e["against"]) for e in ab] == [("a", "a@abababa"), ("b", "b@abababa")]
    assert ab[0]["ratios"] == {"output_throughput": 1.25, "decode_throughput_per_request": 1.25,
                               "median_ttft_ms": 0.5, "median_itl_ms": None}
    assert set(ab[1]["ratios"].values()) == {None}
    medians = {r["config"]: r["median"] for r in rows}
    assert compare.ab_cell(medians["a"], medians["a@abababa"], "output_throughput") == "100.0 -> 125.0 (1.25x)"
    assert compare.ab_cell(medians["b"], None, "output_throughput") == "not measured"


def test_worktree_is_made_reused_refused_when_edited_and_models_mirrored(tmp_path, capsys):
    from bench import worktree

    commit, short = worktree.resolve_revision("HEAD")
    assert commit.startswith(short) and len(commit) == 40
    with pytest.raises(worktree.CheckoutFailed, match="not a commit"):
        worktree.resolve_revision("no-such-revision-anywhere")
    where = tmp_path / "wt"
    try:
        assert worktree.open_worktree(commit, where) is False
        assert worktree.git("rev-parse", "HEAD", cwd=where) == commit and (where / "run.py").is_file()
        source = tmp_path / "models"
        (source / "m").mkdir(parents=True)
        (source / "m" / "w.bin").write_bytes(b"new")
        (where / "models" / "stale.bin").write_bytes(b"old")
        changed = worktree.mirror_files(source, where / "models")
        assert "m/w.bin" in changed and "stale.bin" in changed
        assert (where / "models" / "m" / "w.bin").read_bytes() == b"new"
        assert not (where / "models" / "stale.bin").exists()
        assert worktree.mirror_files(source, where / "models") == []
        assert worktree.open_worktree(commit, where) is True           # mirrored models do not count as edits
        (where / "run.py").write_text("# edited\n")
        with pytest.raises(worktree.CheckoutFailed, match="local edits"):
            worktree.open_worktree(commit, where)
    finally:
        worktree.remove_worktree(where)
    assert not where.exists() and str(where) not in worktree.git("worktree", "list")
    worktree.remove_worktree(where)                                    # already gone: a warning, not a crash
    assert "warning: could not remove the worktree" in capsys.readouterr().err
    (tmp_path / "plain").mkdir()
    with pytest.raises(worktree.CheckoutFailed, match="not a worktree"):
        worktree.open_worktree(commit, tmp_path / "plain")


# Loaded by every Python process of the checkout test: says where the `engine` package is read from.
IMPORT_PROBE = """import re, sys
def _report_engine(event, args):
    if event == "open" and isinstance(args[0], str) and re.search(r"/engine/(__pycache__/)?__init__[.]", args[0]):
        print("probe: engine read from " + args[0], file=sys.stderr, flush=True)
sys.addaudithook(_report_engine)
"""


@pytest.mark.slow
def test_compare_checkout_runs_both_trees_side_by_side(tmp_path):
    """Real servers (the embedded model, no speculation) from a worktree of HEAD and from the working tree.
    One decode step a launch: with several, a 4-token answer's last tokens often come in one chunk, and its
    median inter-token latency (a ratio below) is then 0. Even so, on a loaded machine the client can read
    two tokens' events at once (CI, once in a 15-minute run): that ratio may be 0, the others may not.
    `--cpu-kernels torch`: the worktree would build its own native kernels first (a minute of the suite)."""
    out, logs, where, probe = tmp_path / "compare.jsonl", tmp_path / "logs", tmp_path / "wt", tmp_path / "probe"
    probe.mkdir()
    (probe / "sitecustomize.py").write_text(IMPORT_PROBE)
    commit = subprocess.run(["git", "rev-parse", "HEAD"], cwd=REPO, capture_output=True, text=True).stdout.strip()
    short = subprocess.run(["git", "rev-parse", "--short", commit], cwd=REPO, capture_output=True,
                           text=True).stdout.strip()
    result = subprocess.run(
        [sys.executable, "bench/compare.py", "--checkout", commit, "--checkout-dir", str(where),
         "--config", "none=--speculative-algorithm none --num-scheduler-steps 1 --cpu-kernels torch", "--rounds", "1",
         "--max-concurrency", "1",
         "--num-prompts", "2", "--random-input-len", "16", "--random-output-len", "4", "--random-range-ratio", "1",
         "--warmup-requests", "0", "--output-file", str(out), "--log-dir", str(logs), "--health-timeout", "120"],
        cwd=REPO, env=os.environ | {"PYTHONPATH": str(probe)}, capture_output=True, text=True, timeout=240)
    assert result.returncode == 0, result.stdout + result.stderr
    assert f"Working tree against {short}" in result.stdout
    record = json.loads(out.read_text())
    old_name = f"none@{short}"
    assert [s["name"] for s in record["servers"]] == [old_name, "none"]
    assert [s["commit"] for s in record["servers"]] == [commit, None]
    for row in record["results"]:
        m = row["median"]
        assert m["completed"] == 2 and m["failed_total"] == 0 and m["total_output_tokens"] == 8
        assert m["output_throughput"] > 0 and m["decode_throughput_per_request"] > 0 and m["median_ttft_ms"] > 0
    (ab,) = record["ab"]
    assert ab["config"] == "none" and ab["against"] == old_name
    itl = ab["ratios"].pop("median_itl_ms")
    assert all(0 < r < 100 for r in ab["ratios"].values()), ab
    # 0 (None): the working tree's (the old tree's) answers had two of their three gaps in one read of the stream
    assert itl is None or 0 <= itl < 100, ab
    old_log, new_log = (logs / f"{old_name}.log").read_text(), (logs / "none.log").read_text()
    assert f"worktree {where} at {commit}" in old_log and f" {where}/run.py " in old_log
    assert f"probe: engine read from {where}/engine/" in old_log and str(REPO / "engine") not in old_log
    assert f"probe: engine read from {REPO}/engine/" in new_log and str(where) not in new_log
    assert "serving tandem-dense" in old_log and "serving tandem-dense" in new_log
    assert record["checkout"]["path"] == str(where) and not record["checkout"]["kept"]
    assert not where.exists()
    worktrees = subprocess.run(["git", "worktree", "list"], cwd=REPO, capture_output=True, text=True).stdout
    assert str(where) not in worktrees


# ---- prefill/decode pairs: serving.py --prefill-url and bench/pd_compare.py ------------------

def test_serving_reports_both_pd_nodes_counters_over_the_run(tokenizer_dir, capsys):
    decode, prefill = FakeServer(pd=True), FakeServer(pd=True)
    try:
        m = run(bench_args(decode.url, tokenizer_dir, "--prefill-url", prefill.url))
        verbose = asyncio.run(serving.run_benchmark(bench_args(decode.url, tokenizer_dir, "--prefill-url",
                                                               fake_server_url(free_port()))))
    finally:
        decode.close()
        prefill.close()
    check_sane(m, 8)
    for node in ("prefill", "decode"):           # scraped once before and once after: one step's worth
        assert m["pd"][node] == {**PD_STEP, "failures": {"timeout": 1.0}}
    assert m["pd"]["bytes_per_room"] == pytest.approx(4e6 / 5)
    assert m["pd"]["decode_room_ms"] == pytest.approx(400.0) and m["pd"]["handoff_ms"] == pytest.approx(0.0)
    assert m["pd"]["room_share_of_ttft"] == pytest.approx(400.0 / m["mean_ttft_ms"])
    assert verbose["pd"]["prefill"] is None and verbose["pd"]["decode"] is not None   # a node that cannot answer
    printed = capsys.readouterr().out
    assert "PD: decode node" in printed and "no tandem_pd_* counters" in printed
    assert serving.parse_pd_counters("# HELP x\ntandem_kv_slots_used 3\n") is None          # not a PD node
    assert "--prefill-url" in cli("bench/serving.py", "--prefill-url", "127.0.0.1:1").stderr


def fake_server_url(port: int) -> str:
    return f"http://127.0.0.1:{port}"


def test_pd_compare_runs_unified_and_a_pinned_pair_on_one_workload(tokenizer_dir, tmp_path):
    out = tmp_path / "pd.jsonl"
    pair = "pd-pinned" if len(os.sched_getaffinity(0)) >= 2 else "pd-shared"
    result = cli("bench/pd_compare.py", "--server-script", "tests/test_bench.py", "--tokenizer", str(tokenizer_dir),
                 "--dataset-name", "random", "--setups", f"unified-1core,{pair}", "--rounds", "2",
                 "--short-prompts", "4", "--short-input-len", "8", "--short-output-len", "12",
                 "--short-range-ratio", "1",
                 "--long-prompts", "2", "--long-input-len", "64", "--long-output-len", "3", "--long-interval", "0.05",
                 "--long-start-delay", "0", "--output-file", str(out), "--log-dir", str(tmp_path / "logs"))
    assert result.returncode == 0, result.stdout + result.stderr
    assert "ITL p99 ms" in result.stdout and "KV MB/room" in result.stdout
    record = json.loads(out.read_text())
    unified, pd = record["results"]
    assert [unified["setup"], pd["setup"]] == ["unified-1core", pair]
    for row in (unified, pd):
        assert len(row["runs"]) == 2
        assert row["median"]["short"]["completed"] == 4 and row["median"]["long"]["completed"] == 2
        assert row["median"]["short"]["total_output_tokens"] == 4 * 12
    assert "pd" not in unified["median"] and pd["median"]["pd"]["decode_rooms_done"] == PD_STEP["rooms_done"]
    commands = record["commands"]
    assert commands["unified-1core"].startswith("taskset -c ") and "--cpu-threads 1" in commands["unified-1core"]
    bootstrap = commands[f"{pair}/prefill"].split("--disaggregation-bootstrap-port ")[1].split()[0]
    assert f"--role decode --prefill-addr 127.0.0.1:{bootstrap}" in commands[f"{pair}/decode"]
    assert cli("bench/pd_compare.py", "--setups", "unified,nope").returncode == 2


# ---- bench/baseline_hf.py on a tiny random model ---------------------------------------

def test_baseline_hf_on_a_tiny_model(tokenizer_dir, tmp_path):
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    model_dir = tmp_path / "tiny-llama"
    config = LlamaConfig(vocab_size=400, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
                         eos_token_id=0, bos_token_id=0, pad_token_id=0)
    LlamaForCausalLM(config).save_pretrained(str(model_dir))
    for f in tokenizer_dir.iterdir():
        (model_dir / f.name).write_bytes(f.read_bytes())
    out = tmp_path / "hf.jsonl"
    result = cli("bench/baseline_hf.py", "--model-path", str(model_dir), "--num-prompts", "4",
                 "--random-input-len", "16", "--random-output-len", "5", "--random-range-ratio", "1",
                 "--batch-size", "1,4", "--output-file", str(out))
    assert result.returncode == 0, result.stderr
    records = [json.loads(line) for line in out.read_text().splitlines()]
    assert [r["batch_size"] for r in records] == [1, 4]
    for r in records:
        assert r["total_output_tokens"] == 20 and r["output_throughput"] > 0 and r["completed"] == 4
        assert math.isfinite(r["duration"])


def test_resident_memory_counts_a_process_and_its_descendants():
    from bench.compare import resident_mb
    alone = resident_mb(os.getpid())
    holder = ("import time; b = bytearray(64 * 2**20); b[::4096] = b'x' * len(b[::4096]); print(1, flush=True); "
              "time.sleep(60)")
    child = subprocess.Popen([sys.executable, "-c", holder], stdout=subprocess.PIPE)
    try:
        child.stdout.readline()                                  # its 64 MB are written
        with_child = resident_mb(os.getpid())
    finally:
        child.kill()
        child.wait()
    assert alone > 10 and with_child - alone > 60, (alone, with_child)
    assert resident_mb(2**22 + 12345) is None                    # no such process


FAKE_CONVERTER = """
import sys
class TextModel:
    def get_vocab_base_pre(self, tokenizer):
        raise NotImplementedError
def main():
    assert TextModel().get_vocab_base_pre(None) == "gpt-2"          # the script answered it
    out = sys.argv[sys.argv.index("--outfile") + 1]
    open(out, "w").write(sys.argv[sys.argv.index("--outtype") + 1])
"""


def fake_llama_cpp(root: Path) -> Path:
    """A llama.cpp folder whose converter writes a stub and whose llama-server is this file's fake server."""
    (root / "build" / "bin").mkdir(parents=True)
    (root / "convert_hf_to_gguf.py").write_text(FAKE_CONVERTER)
    server = root / "build" / "bin" / "llama-server"
    server.write_text(f"#!/bin/sh\necho \"$@\" > {root}/args.txt\n"
                      f"exec {sys.executable} {REPO / 'tests' / 'test_bench.py'} \"$@\"\n")
    server.chmod(0o755)
    return root


def test_baseline_llamacpp_converts_once_and_runs_both_servers_side_by_side(tokenizer_dir, tmp_path):
    root = fake_llama_cpp(tmp_path / "llama.cpp")
    out, gguf = tmp_path / "out.jsonl", tmp_path / "gguf"
    argv = ["bench/baseline_llamacpp.py", "--llama-cpp", str(root), "--gguf-dir", str(gguf), "--outtype", "bf16",
            "--server-script", "tests/test_bench.py", "--model-path", str(tokenizer_dir), "--rounds", "2",
            "--max-concurrency", "1,2", "--num-prompts", "3", "--output-file", str(out), "--threads", "3"]
    result = cli(*argv)
    assert result.returncode == 0, result.stdout + result.stderr
    assert (gguf / f"{tokenizer_dir.name}-bf16.gguf").read_text() == "bf16"
    assert "--parallel 2 --threads 3" in (root / "args.txt").read_text()
    [record] = [json.loads(line) for line in out.read_text().splitlines()]
    names = {row["config"] for row in record["results"]}
    assert names == {"llama.cpp-bf16", "none"} and len(record["results"]) == 4
    assert all(len(row["runs"]) == 2 and row["median"]["completed"] == 3 for row in record["results"])
    assert "ratios are to 'llama.cpp-bf16'" in result.stdout and "Resident memory" in result.stdout
    missing = cli("bench/baseline_llamacpp.py", "--llama-cpp", str(tmp_path / "nowhere"))
    assert missing.returncode != 0 and "build/bin/llama-server" in missing.stderr


def test_startup_times_starts_and_stops_of_a_tree(tmp_path):
    tree = tmp_path / "tree"
    tree.mkdir()
    (tree / "run.py").write_text(f"import runpy, sys\nsys.argv[0] = {str(REPO / 'tests' / 'test_bench.py')!r}\n"
                                 f"runpy.run_path(sys.argv[0], run_name='__main__')\n")
    result = cli("bench/startup.py", "--tree", str(tree), "--repeats", "2", "--", "--fake-delay", "0.001")
    assert result.returncode == 0, result.stdout + result.stderr
    assert "medians of 2 starts: start " in result.stdout and "idle PSS" in result.stdout
    assert cli("bench/startup.py", "--tree", str(tmp_path), "--repeats", "1", "--timeout", "5").returncode != 0


def test_cpu_linear_times_every_path_at_each_shape():
    result = cli("bench/cpu_linear.py", "--shapes", "64x32,16x64", "--rows", "1,4", "--weights", "3", "--repeats", "5")
    assert result.returncode == 0, result.stderr
    lines = [line for line in result.stdout.splitlines() if line.startswith("M=")]
    from devices.cpu_native import cpu_kernels
    native = [f"native {fmt} " for fmt in ("float32", "bfloat16", "int8", "w8a8_int8", "int4")] \
        if cpu_kernels("auto") is not None else []
    assert len(lines) == 4 and all("torch f32" in line and all(n in line for n in native) for line in lines)


def test_bandwidth_times_a_decode_step_with_a_tuning_switch_on_and_off():
    result = cli("bench/bandwidth.py", "--gib", "0.05", "--repeats", "4", "--model", "models/tandem-dense",
                 "--switch", "weight_prefetch")
    assert result.returncode == 0, result.stderr
    lines = result.stdout.splitlines()
    steps = [line for line in lines if "median fraction of the read rate" in line]
    assert [("weight_prefetch on" in line, "weight_prefetch off" in line) for line in steps] == [(True, False),
                                                                                                  (False, True)]
    assert float(steps[0].rsplit(" ", 1)[1]) > 0 and lines[-1].startswith("weight_prefetch on / off, paired: ")
    refused = cli("bench/bandwidth.py", "--gib", "0.05", "--repeats", "2", "--model", "models/tandem-dense",
                  "--switch", "no_such_switch")
    assert refused.returncode != 0 and "not a tuning switch" in refused.stderr


def test_cpu_kernels_times_each_path_on_each_case():
    result = cli("bench/cpu_kernels.py", "--steps", "7", "--rounds", "1", "--context", "16", timeout=300)
    assert result.returncode == 0, result.stderr
    from bench import cpu_kernels
    rows = [line.split() for line in result.stdout.splitlines() if "tokens" in line or "prompt of" in line]
    assert len(rows) == len(cpu_kernels.DECODE_CASES) + len(cpu_kernels.PROMPTS)
    assert all(len(row) >= 5 for row in rows)
    assert all(float(value) > 0 for row in rows for value in row[-5:])      # 3 paths and 2 ratios, all measured


def test_verify_rows_times_both_ways_and_finds_the_same_logits():
    result = cli("bench/verify_rows.py", "--dtype", "float32", "--tokens", "1,5", "--forwards", "4", "--context", "16",
                 timeout=300)
    assert result.returncode == 0, result.stderr
    lines = [line for line in result.stdout.splitlines() if line.startswith("float32, 1 x ")]
    assert len(lines) == 2 and all(line.endswith("same logits: True") for line in lines)
    result = cli("bench/verify_rows.py", "--dtype", "bfloat16", "--quantization", "w8a8_int8", "--switch", "teams",
                 "--seqs", "1,3", "--tokens", "1,5", "--forwards", "4", "--context", "16", timeout=300)
    assert result.returncode == 0, result.stderr
    lines = [line for line in result.stdout.splitlines() if line.startswith("bfloat16 w8a8_int8, ")]
    assert [line.split(":")[0] for line in lines] == [f"bfloat16 w8a8_int8, {b} x {q}" for b in (1, 3) for q in (1, 5)]
    assert all("in one region" in line and line.endswith("same logits: True") for line in lines)


def test_draft_chain_times_the_chain_both_ways_and_finds_the_same_drafts():
    for against, words in (("python", "step by step"), ("regions", "a region a loop")):
        result = cli("bench/draft_chain.py", "--rows", "1,2", "--steps", "2", "--context", "16", "--repeats", "7",
                     "--quantization", "w8a8_int8", "--against", against, timeout=300)
        assert result.returncode == 0, result.stderr
        lines = [line for line in result.stdout.splitlines() if line.startswith("rows ")]
        assert len(lines) == 4 and all(line.endswith("same drafts: True") for line in lines)
        assert words in lines[0]


def test_perplexity_scores_held_out_tokens_for_each_variant(tmp_path):
    out = tmp_path / "ppl.json"
    result = cli("tools/perplexity.py", "--max-tokens", "600", "--window", "128", "--variant", "none",
                 "--variant", "q8_0", "--json", str(out), timeout=300)
    assert result.returncode == 0, result.stderr
    results = json.loads(out.read_text())["results"]
    assert set(results) == {"none", "q8_0"}
    assert results["none"]["tokens"] == 600 - 5          # 5 windows, the first token of each unscored
    assert 1 < results["none"]["perplexity"] < 100
    ratio = results["q8_0"]["perplexity"] / results["none"]["perplexity"]
    assert ratio != 1 and abs(ratio - 1) < 0.01                     # the weights did change, a little


# ---- run as a fake server for bench/compare.py -------------------------------------

if __name__ == "__main__":
    parser = argparse.ArgumentParser()
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--fake-delay", type=float, default=0.002)
    parser.add_argument("--fake-exit", action="store_true")
    parser.add_argument("--role", default="unified")
    options, _ = parser.parse_known_args()
    if options.fake_exit:
        sys.exit("fake server: asked to fail")
    web.run_app(fake_app(delay=options.fake_delay, pd=options.role != "unified"), host="127.0.0.1", port=options.port,
                print=None)

