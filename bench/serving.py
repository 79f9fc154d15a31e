"""Load test for an OpenAI-compatible or SGLang-native server, in the manner of SGLang's bench_serving.

    python bench/serving.py --backend tandem --port 30000 --dataset-name code --num-prompts 64

Datasets are made locally (no download). Prints a summary table, appends one JSON line
per run with --output-file, draws CDFs and throughput over time with --plot. Failed
requests are counted with their reasons and never stop the run.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import sys
import sysconfig
import time
from collections import Counter
from dataclasses import dataclass, field
from functools import lru_cache
from pathlib import Path

import aiohttp
import numpy as np

try:
    from bench import prefix_datasets
except ImportError:         # run as a script: its folder is on sys.path, the repository may not be
    import prefix_datasets  # type: ignore[no-redef]

REPO = Path(__file__).resolve().parent.parent
DEFAULT_TOKENIZER = str(REPO / "models" / "tandem-dense")
BACKENDS = ("tandem", "sglang", "vllm", "openai", "openai-chat")
DEFAULT_CONSTRAINT = {"regex": "[a-z ]{4000}"}
DATASETS = ("random", "prompts", "code", "generated-shared-prefix", "multi-turn")


# ---- requests and their results ------------------------------------------------

@dataclass
class Request:
    prompt: str
    prompt_len: int
    output_len: int
    turns: list[tuple[str, int]] = field(default_factory=list)   # multi-turn: later questions, output lens
    constrained: bool = False         # sent with --constraint (structured outputs)


@dataclass
class RequestResult:
    success: bool = False
    error: str = ""
    prompt_len: int = 0
    output_len: int = 0
    ttft: float = 0.0                 # seconds to the first output token
    latency: float = 0.0              # seconds from send to the last byte
    itl: list[float] = field(default_factory=list)            # per-token gaps after the first
    token_times: list[tuple[float, float]] = field(default_factory=list)  # (perf_counter, new tokens)
    text: str = ""
    accept_length: float | None = None
    spec_verify_ct: int | None = None
    constrained: bool = False
    turn: int = 0                     # multi-turn: which turn of its conversation (0: the first)


# ---- datasets ------------------------------------------------------------------

@lru_cache(maxsize=8)
def load_tokenizer(path: str):
    from transformers import AutoTokenizer
    return AutoTokenizer.from_pretrained(path)


def count_tokens(tokenizer, text: str) -> int:
    return len(tokenizer.encode(text, add_special_tokens=False))


def draw_len(rng: random.Random, length: int, ratio: float) -> int:
    """A length in [length * ratio, length], at least 1."""
    return rng.randint(max(int(length * ratio), 1), max(length, 1))


def random_requests(args, tokenizer) -> list[Request]:
    """Random token ids (no special tokens) decoded to text."""
    rng = random.Random(args.seed)
    special = set(tokenizer.all_special_ids)
    vocab = [i for i in range(tokenizer.vocab_size)
             if i not in special and "\ufffd" not in tokenizer.decode([i])]  # whole characters only
    requests = []
    for _ in range(args.num_prompts):
        want = draw_len(rng, args.random_input_len, args.random_range_ratio)
        ids = [rng.choice(vocab) for _ in range(want)]
        for _ in range(8):  # decoding then encoding again may merge or split tokens: top up or cut
            ids = tokenizer.encode(tokenizer.decode(ids), add_special_tokens=False)
            if len(ids) == want:
                break
            ids = ids[:want] + [rng.choice(vocab) for _ in range(want - len(ids))]
        prompt = tokenizer.decode(ids)
        out_len = draw_len(rng, args.random_output_len, args.random_range_ratio)
        requests.append(Request(prompt, count_tokens(tokenizer, prompt), out_len))
    return requests


def prompts_requests(args, tokenizer) -> list[Request]:
    """A JSONL file of {"prompt", "output_len"?}, repeated in order to reach --num-prompts."""
    rng = random.Random(args.seed)
    rows = [json.loads(line) for line in Path(args.dataset_path).read_text().splitlines() if line.strip()]
    if not rows:
        raise ValueError(f"{args.dataset_path} holds no prompts")
    requests = []
    for i in range(args.num_prompts):
        row = rows[i % len(rows)]
        out_len = row.get("output_len") or draw_len(rng, args.random_output_len, args.random_range_ratio)
        requests.append(Request(row["prompt"], count_tokens(tokenizer, row["prompt"]), int(out_len)))
    return requests


def python_sources(root: str | None = None) -> list[Path]:
    """The standard library's Python files, sorted so a seed picks the same ones."""
    root = Path(root or sysconfig.get_paths()["stdlib"])
    skip = {"site-packages", "dist-packages", "__pycache__"}
    return sorted(p for p in root.rglob("*.py") if not skip.intersection(p.relative_to(root).parts))


def code_requests(args, tokenizer) -> list[Request]:
    """Prompts cut from local Python sources, starting at a random line of a random file."""
    rng = random.Random(args.seed)
    files = python_sources(args.dataset_path)
    if not files:
        raise ValueError("no Python sources found for the code dataset")
    requests = []
    for _ in range(args.num_prompts):
        want = draw_len(rng, args.random_input_len, args.random_range_ratio)
        index = rng.randrange(len(files))
        lines = files[index].read_text(errors="replace").splitlines(keepends=True)
        text = "".join(lines[rng.randrange(len(lines)):] if lines else [])
        ids = tokenizer.encode(text[: want * 16], add_special_tokens=False)
        while len(ids) < want:  # short tail: continue into the next files
            index = (index + 1) % len(files)
            ids += tokenizer.encode(files[index].read_text(errors="replace")[: want * 16], add_special_tokens=False)
        prompt = tokenizer.decode(ids[:want])
        out_len = draw_len(rng, args.random_output_len, args.random_range_ratio)
        requests.append(Request(prompt, count_tokens(tokenizer, prompt), out_len))
    return requests


def build_requests(args, tokenizer) -> list[Request]:
    def make(prompt: str, output_len: int) -> Request:
        return Request(prompt, count_tokens(tokenizer, prompt), output_len)
    makers = {"random": random_requests, "prompts": prompts_requests, "code": code_requests,
              "generated-shared-prefix": lambda a, t: prefix_datasets.shared_prefix_requests(a, t, make),
              "multi-turn": lambda a, t: prefix_datasets.multi_turn_requests(a, t, make)}
    requests = makers[args.dataset_name](args, tokenizer)
    share = getattr(args, "constrained_fraction", 0.0)
    for i, request in enumerate(requests):          # spread evenly: request i when (i+1)*share crosses an integer
        request.constrained = int((i + 1) * share) > int(i * share)
    return requests


# ---- streaming clients ---------------------------------------------------------

async def sse_payloads(response: aiohttp.ClientResponse):
    """Yield (arrival time, payload) for every `data:` line of a server-sent-event stream."""
    buffer = b""
    async for chunk in response.content.iter_any():
        now = time.perf_counter()
        buffer += chunk
        *lines, buffer = buffer.split(b"\n")
        for line in lines:
            line = line.strip()
            if line.startswith(b"data:"):
                yield now, line[5:].strip().decode()
    if buffer.strip().startswith(b"data:"):
        yield time.perf_counter(), buffer.strip()[5:].strip().decode()


class TokenClock:
    """Turns stream chunks into TTFT, inter-token latencies and a token timeline."""

    def __init__(self, result: RequestResult, start: float):
        self.result, self.start, self.count, self.last = result, start, 0, start

    def tokens(self, now: float, cumulative: int | None = None) -> None:
        """Record a chunk: its cumulative token count when the server says, else one token."""
        new = (cumulative - self.count) if cumulative is not None else 1
        if new <= 0:
            return
        if self.count == 0:
            self.result.ttft = now - self.start
        else:
            self.result.itl.extend([(now - self.last) / new] * new)
        self.result.token_times.append((now, new))
        self.count += new
        self.last = now


def spec_stats(result: RequestResult, info: dict) -> None:
    """Speculative-decoding counters from meta_info (or usage), when the server reports them."""
    if info.get("spec_verify_ct"):
        result.spec_verify_ct = int(info["spec_verify_ct"])
    if info.get("spec_accept_length"):
        result.accept_length = float(info["spec_accept_length"])


def build_payload(args, request: Request) -> tuple[str, dict]:
    """The endpoint and JSON body for one request on the chosen backend."""
    if args.backend in ("tandem", "sglang"):
        params = {"max_new_tokens": request.output_len, "temperature": 0.0, "ignore_eos": not args.disable_ignore_eos}
        body = {"text": request.prompt, "sampling_params": params, "stream": True}
        path = "/generate"
    else:
        body = {"model": args.model, "temperature": 0.0, "max_tokens": request.output_len, "stream": True,
                "stream_options": {"include_usage": True}, "ignore_eos": not args.disable_ignore_eos}
        if args.backend == "openai-chat":
            body["messages"] = [{"role": "user", "content": request.prompt}]
            path = "/v1/chat/completions"
        else:
            body["prompt"] = request.prompt
            path = "/v1/completions"
    body.update(args.extra_request_body or {})
    if request.constrained:
        (body["sampling_params"] if "sampling_params" in body else body).update(args.constraint)
    return args.base_url.rstrip("/") + path, body


def read_chunk(args, data: dict, result: RequestResult, clock: TokenClock, now: float) -> bool:
    """Apply one parsed chunk; returns True when it carried a finish reason."""
    if args.backend in ("tandem", "sglang"):
        meta = data.get("meta_info") or {}
        text = data.get("text", result.text)  # cumulative
        grew, result.text = text != result.text, text
        spec_stats(result, meta)
        count = meta.get("completion_tokens")
        if count is not None:
            result.output_len = int(count)
            result.prompt_len = int(meta.get("prompt_tokens") or result.prompt_len)
        if count is not None or grew:
            clock.tokens(now, count)
        return meta.get("finish_reason") is not None
    usage = data.get("usage") or {}
    if usage:
        result.output_len = int(usage.get("completion_tokens") or result.output_len)
        result.prompt_len = int(usage.get("prompt_tokens") or result.prompt_len)
        spec_stats(result, usage)
    finished = False
    for choice in data.get("choices") or []:
        piece = choice.get("text") if args.backend != "openai-chat" else (choice.get("delta") or {}).get("content")
        if piece:
            result.text += piece
            clock.tokens(now, usage.get("completion_tokens"))  # per-chunk usage, when the server streams it
        finished = finished or choice.get("finish_reason") is not None
    return finished


async def send_request(session: aiohttp.ClientSession, args, request: Request) -> RequestResult:
    """Send one streaming request; every failure is caught and described. A request whose pooled
    connection the server had closed (nothing sent or received yet) is sent once more, as HTTP clients
    do (llama-server closes idle keep-alive connections)."""
    result = await send_once(session, args, request)
    if result.error.startswith("ClientOSError") and "Can not write request body" in result.error:
        result = await send_once(session, args, request)
    return result


async def send_once(session: aiohttp.ClientSession, args, request: Request) -> RequestResult:
    result = RequestResult(prompt_len=request.prompt_len, constrained=request.constrained)
    url, body = build_payload(args, request)
    start = time.perf_counter()
    clock = TokenClock(result, start)
    done = finished = False
    try:
        async with session.post(url, json=body, headers=args.headers) as response:
            if response.status != 200:
                text = (await response.text())[:200].strip()
                result.error = f"HTTP {response.status}: {text}"
                return result
            async for now, payload in sse_payloads(response):
                if payload == "[DONE]":
                    done = True
                    break
                data = json.loads(payload)
                if "error" in data:
                    error = data["error"]
                    message = error.get("message", error) if isinstance(error, dict) else error
                    result.error = "stream error: " + str(message)[:200]
                    return result
                finished = read_chunk(args, data, result, clock, now) or finished
        result.latency = time.perf_counter() - start
        if not (done or finished):
            result.error = "stream ended before [DONE]"
        elif clock.count == 0:
            result.error = "no output tokens"
        else:
            result.success = True
    except asyncio.TimeoutError:
        result.error = f"timeout after {args.timeout:g} s"
    except aiohttp.ClientConnectorError as exc:
        result.error = f"connection failed: {exc.os_error.strerror if exc.os_error else exc}"
    except aiohttp.ClientPayloadError as exc:
        result.error = f"broken stream: {type(exc).__name__}"
    except (aiohttp.ClientError, ConnectionError) as exc:
        result.error = f"{type(exc).__name__}: {exc}"[:200]
    except json.JSONDecodeError:
        result.error = "malformed stream chunk (not JSON)"
    except Exception as exc:  # a server bug must not end the benchmark
        result.error = f"unexpected {type(exc).__name__}: {exc}"[:200]
    return result


# ---- the run -------------------------------------------------------------------

async def arrivals(requests: list[Request], rate: float, rng: random.Random):
    """Yield requests with Poisson arrivals at `rate` per second (all at once when inf)."""
    for i, request in enumerate(requests):
        if i and rate != float("inf"):
            await asyncio.sleep(rng.expovariate(rate))
        yield request


async def resolve_model(session: aiohttp.ClientSession, args) -> str:
    """The first model /v1/models lists, or "default" when it cannot be asked."""
    try:
        async with session.get(args.base_url.rstrip("/") + "/v1/models", headers=args.headers) as response:
            return (await response.json())["data"][0]["id"]
    except Exception:
        return "default"


async def run_benchmark(args, verbose: bool = True, requests: list[Request] | None = None) -> dict:
    """Run the benchmark described by `args` (see parse_args) and return its metrics.

    `requests` replaces the dataset (bench/pd_compare.py builds them first, so that building one class's
    prompts never stalls the event loop while another class streams)."""
    finish_args(args)
    tokenizer = load_tokenizer(args.tokenizer)
    if requests is None:
        requests = build_requests(args, tokenizer)
    connector = aiohttp.TCPConnector(limit=0)
    timeout = aiohttp.ClientTimeout(total=args.timeout)
    async with aiohttp.ClientSession(connector=connector, timeout=timeout) as session:
        if args.backend in ("vllm", "openai", "openai-chat") and not args.model:
            args.model = await resolve_model(session, args)
        await warm_up(session, args, requests, verbose)
        await flush_cache(session, args)
        pd_before = await scrape_pd_pair(session, args)
        results, start, duration = await run_requests(session, args, requests)
        pd_after = await scrape_pd_pair(session, args)

    for result in results:
        if result.success:
            settle_token_count(result, tokenizer)
    metrics = summarize(args, results, duration)
    if pd_before is not None:
        metrics["pd"] = pd_report(pd_before, pd_after, metrics)
    if verbose:
        print_summary(metrics)
    if args.output_file:
        record = {"date": time.strftime("%Y-%m-%d %H:%M:%S"), **metrics, "args": args_record(args)}
        with open(args.output_file, "a") as f:
            f.write(json.dumps(jsonable(record)) + "\n")
    if args.plot:
        plot(args.plot, results, start, metrics)
    return metrics


async def flush_cache(session: aiohttp.ClientSession, args) -> None:
    """Empty Tandem's (or SGLang's) prefix cache before the measured requests, as SGLang's benchmark does:
    the warm-up's prompt (and an earlier round's) must not be found there. Other servers: nothing."""
    if args.backend not in ("tandem", "sglang"):
        return
    try:
        async with session.post(args.base_url.rstrip("/") + "/flush_cache", headers=args.headers) as response:
            await response.read()
    except aiohttp.ClientError:
        pass


async def send_conversation(session: aiohttp.ClientSession, args, request: Request) -> list[RequestResult]:
    """A multi-turn conversation: each turn sends the conversation so far and its question, after the
    answer before it; a failed turn ends the conversation."""
    results = [await send_request(session, args, request)]
    history = request.prompt
    for question, output_len in request.turns:
        if not results[-1].success:
            break
        history += results[-1].text + question
        results.append(await send_request(session, args, Request(history, 0, output_len)))
        results[-1].turn = len(results) - 1
    return results


async def warm_up(session: aiohttp.ClientSession, args, requests: list[Request], verbose: bool) -> None:
    """--warmup-requests copies of the first request, at most 16 tokens long, sent at once and not counted."""
    if args.warmup_requests <= 0 or not requests:
        return
    first = requests[0]
    warm = [Request(first.prompt, first.prompt_len, min(first.output_len, 16))] * args.warmup_requests
    if any(r.constrained for r in requests):        # and the constraint once: its first use compiles it
        warm.append(Request(first.prompt, first.prompt_len, min(first.output_len, 16), constrained=True))
    warmups = await asyncio.gather(*(send_request(session, args, request) for request in warm))
    failed = [r.error for r in warmups if not r.success]
    if failed and verbose:
        print(f"warning: {len(failed)} warm-up request(s) failed: {failed[0]}", file=sys.stderr)


async def run_requests(session: aiohttp.ClientSession, args,
                       requests: list[Request]) -> tuple[list[RequestResult], float, float]:
    """Send every request on its arrival schedule, at most --max-concurrency at once: (results, start, seconds)."""
    semaphore = asyncio.Semaphore(args.max_concurrency) if args.max_concurrency else None
    bar = None
    if not args.disable_tqdm:
        from tqdm import tqdm
        bar = tqdm(total=len(requests), desc=f"{args.backend}", file=sys.stderr)

    async def limited(request: Request) -> list[RequestResult]:
        if semaphore is None:
            results = await send_conversation(session, args, request)
        else:
            async with semaphore:
                results = await send_conversation(session, args, request)
        if bar is not None:
            bar.update(1)
        return results

    start = time.perf_counter()
    schedule = arrivals(requests, args.request_rate, random.Random(args.seed))
    tasks = [asyncio.create_task(limited(r)) async for r in schedule]
    results = [result for turns in await asyncio.gather(*tasks) for result in turns]
    duration = time.perf_counter() - start
    if bar is not None:
        bar.close()
    return results, start, duration


# ---- prefill/decode counters -----------------------------------------------------
# A PD pair's nodes count their rooms (one per request) and the KV they move. tandem_pd_transfer_seconds
# sums each room's life: on the decode node from handing the prompt to a prefill node to the last KV and
# first token arriving (the prefill's compute included), on the prefill node from the prompt's arrival to
# its last frame written. Their difference per room is what the hand-off and the wire add.

PD_COUNTERS = {"tandem_pd_transferred_bytes_total": "transferred_bytes",
               "tandem_pd_transfer_seconds_total": "transfer_seconds"}


def parse_pd_counters(text: str) -> dict | None:
    """A node's tandem_pd_* counters from Prometheus text; None when it has none (not a PD node)."""
    counters = {"transferred_bytes": 0.0, "transfer_seconds": 0.0, "rooms_done": 0.0, "rooms_failed": 0.0,
                "failures": {}}
    seen = False
    for line in text.splitlines():
        name, labels, value = prometheus_sample(line)
        if name in PD_COUNTERS:
            counters[PD_COUNTERS[name]] = value
        elif name == "tandem_pd_rooms_finished_total" and labels.get("state") in ("done", "failed"):
            counters["rooms_" + labels["state"]] = value
        elif name == "tandem_pd_failures_total":
            counters["failures"][labels.get("reason", "")] = value
        else:
            continue
        seen = True
    return counters if seen else None


def prometheus_sample(line: str) -> tuple[str, dict[str, str], float]:
    """(name, labels, value) of one sample line; ("", {}, 0.0) for comments and lines that do not parse."""
    if not line or line.startswith("#"):
        return "", {}, 0.0
    head, _, value = line.rpartition(" ")
    name, _, label_text = head.partition("{")
    labels = dict(part.split("=", 1) for part in label_text.rstrip("}").split(",") if "=" in part)
    try:
        return name.strip(), {k.strip(): v.strip().strip('"') for k, v in labels.items()}, float(value)
    except ValueError:
        return "", {}, 0.0


async def scrape_pd(session: aiohttp.ClientSession, url: str) -> dict | None:
    """One node's PD counters, None when its /metrics cannot be read or has none."""
    try:
        async with session.get(url.rstrip("/") + "/metrics", timeout=aiohttp.ClientTimeout(total=10)) as response:
            return parse_pd_counters(await response.text()) if response.status == 200 else None
    except (aiohttp.ClientError, asyncio.TimeoutError, ConnectionError):
        return None


async def scrape_pd_pair(session: aiohttp.ClientSession, args) -> dict | None:
    """{"prefill", "decode"} counters of the pair under test, or None without --prefill-url."""
    if not getattr(args, "prefill_url", None):
        return None
    return {"prefill": await scrape_pd(session, args.prefill_url), "decode": await scrape_pd(session, args.base_url)}


def pd_delta(before: dict | None, after: dict | None) -> dict | None:
    """What a node counted during the run: after - before (None when either scrape failed)."""
    if before is None or after is None:
        return None
    delta = {key: after[key] - before[key] for key in ("transferred_bytes", "transfer_seconds", "rooms_done",
                                                        "rooms_failed")}
    failures = {reason: count - before["failures"].get(reason, 0.0) for reason, count in after["failures"].items()}
    delta["failures"] = {reason: count for reason, count in failures.items() if count}
    return delta


def pd_report(before: dict, after: dict, metrics: dict) -> dict:
    """Both nodes' counters over the run, and per room: bytes, room seconds and their share of the mean TTFT."""
    prefill, decode = pd_delta(before["prefill"], after["prefill"]), pd_delta(before["decode"], after["decode"])
    report = {"prefill": prefill, "decode": decode}
    report |= per_room(prefill, decode, metrics.get("mean_ttft_ms"))
    return report


def per_room(prefill: dict | None, decode: dict | None, mean_ttft_ms: float | None) -> dict:
    """Mean bytes and room seconds per finished room; the wire's overhead (decode room - prefill room); the
    decode room's and the overhead's shares of the mean TTFT."""
    out = dict.fromkeys(["bytes_per_room", "decode_room_ms", "prefill_room_ms", "handoff_ms", "room_share_of_ttft",
                         "handoff_share_of_ttft"])
    rooms = decode and decode["rooms_done"] + decode["rooms_failed"]
    if not rooms:
        return out
    out["bytes_per_room"] = decode["transferred_bytes"] / rooms
    out["decode_room_ms"] = 1000.0 * decode["transfer_seconds"] / rooms
    prefill_rooms = prefill and prefill["rooms_done"] + prefill["rooms_failed"]
    if prefill_rooms:
        out["prefill_room_ms"] = 1000.0 * prefill["transfer_seconds"] / prefill_rooms
        out["handoff_ms"] = out["decode_room_ms"] - out["prefill_room_ms"]
    if mean_ttft_ms:
        out["room_share_of_ttft"] = out["decode_room_ms"] / mean_ttft_ms
        if out["handoff_ms"] is not None:
            out["handoff_share_of_ttft"] = out["handoff_ms"] / mean_ttft_ms
    return out


# ---- metrics -------------------------------------------------------------------

def settle_token_count(result: RequestResult, tokenizer) -> None:
    """Output tokens from the server when it said, else the tokenizer; the timeline is scaled to match
    (OpenAI chunks do not say how many tokens they carry, so they were counted as one each)."""
    if result.output_len == 0:
        result.output_len = count_tokens(tokenizer, result.text)
    seen = sum(n for _, n in result.token_times)
    if seen and seen != result.output_len:
        result.token_times = [(t, n * result.output_len / seen) for t, n in result.token_times]


def stats(name: str, values_s: list[float]) -> dict:
    """mean/median/p90/p99 in milliseconds (None when there are no values)."""
    keys = [f"mean_{name}_ms", f"median_{name}_ms", f"p90_{name}_ms", f"p99_{name}_ms"]
    if not values_s:
        return dict.fromkeys(keys)
    ms = np.asarray(values_s) * 1000.0
    numbers = [ms.mean(), np.median(ms), np.percentile(ms, 90), np.percentile(ms, 99)]
    return {k: float(v) for k, v in zip(keys, numbers)}


def accept_length(ok: list[RequestResult]) -> float | None:
    """Tokens per verify step: completion tokens / verify steps, else the servers' own per-request figures."""
    counted = [r for r in ok if r.spec_verify_ct]
    if counted:
        return sum(r.output_len for r in counted) / sum(r.spec_verify_ct for r in counted)
    reported = [r.accept_length for r in ok if r.accept_length]
    return float(np.mean(reported)) if reported else None


def decode_speed(decoding: list[RequestResult]) -> float | None:
    """Tokens after the first over the time from the first to the last, over these streams."""
    if not decoding:
        return None
    return sum(r.output_len - 1 for r in decoding) / max(sum(r.latency - r.ttft for r in decoding), 1e-9)


def summarize(args, results: list[RequestResult], duration: float) -> dict:
    ok = [r for r in results if r.success]
    decoding = [r for r in ok if r.output_len > 1]
    tpots = [(r.latency - r.ttft) / (r.output_len - 1) for r in decoding]
    total_in = sum(r.prompt_len for r in ok)
    total_out = sum(r.output_len for r in ok)
    duration = max(duration, 1e-9)
    metrics = {
        "backend": args.backend, "dataset_name": args.dataset_name, "request_rate": args.request_rate,
        "max_concurrency": args.max_concurrency, "num_prompts": len(results),
        "completed": len(ok), "failed": len(results) - len(ok),
        "failure_reasons": dict(Counter(r.error for r in results if not r.success)),
        "duration": duration, "total_input_tokens": total_in, "total_output_tokens": total_out,
        "request_throughput": len(ok) / duration, "input_throughput": total_in / duration,
        "output_throughput": total_out / duration,
        # a stream's decode speed: tokens after the first over the time from the first to the last
        "decode_throughput_per_request": (sum(r.output_len - 1 for r in decoding)
                                          / max(sum(r.latency - r.ttft for r in decoding), 1e-9)
                                          if decoding else None),
    }
    for kind, constrained in (("free", False), ("constrained", True)):   # --constrained-fraction's two kinds
        metrics[f"{kind}_decode_throughput_per_request"] = decode_speed([r for r in decoding
                                                                         if r.constrained == constrained])
    metrics |= stats("ttft", [r.ttft for r in ok])
    turns = max((r.turn for r in ok), default=0) + 1
    if turns > 1:                                    # multi-turn: each turn sends a longer conversation
        metrics["median_ttft_ms_by_turn"] = [stats("ttft", [r.ttft for r in ok if r.turn == t])["median_ttft_ms"]
                                             for t in range(turns)]
    metrics |= stats("tpot", tpots)
    metrics |= stats("itl", [gap for r in ok for gap in r.itl])
    metrics |= stats("e2e_latency", [r.latency for r in ok])
    metrics["concurrency"] = sum(r.latency for r in ok) / duration
    metrics["accept_length"] = accept_length(ok)
    return metrics


def row(label: str, value, fmt: str = "{:.2f}") -> None:
    """One line of the summary: a label and its value, n/a when None."""
    text = "n/a" if value is None else (fmt.format(value) if isinstance(value, float) else str(value))
    print(f"{label:<40}{text:>12}")


def print_summary(m: dict) -> None:
    print("{s:{c}^52}".format(s=" Serving Benchmark Result ", c="="))
    row("Backend:", m["backend"])
    row("Traffic request rate:", m["request_rate"], "{:g}")
    row("Max request concurrency:", m["max_concurrency"] or "not set")
    row("Successful requests:", m["completed"])
    row("Failed requests:", m["failed"])
    for reason, count in m["failure_reasons"].items():
        print(f"  {count} x {reason}")
    row("Benchmark duration (s):", m["duration"])
    row("Total input tokens:", m["total_input_tokens"])
    row("Total generated tokens:", m["total_output_tokens"])
    row("Request throughput (req/s):", m["request_throughput"])
    row("Input token throughput (tok/s):", m["input_throughput"])
    row("Output token throughput (tok/s):", m["output_throughput"])
    row("Decode tok/s per request:", m["decode_throughput_per_request"])
    if m["constrained_decode_throughput_per_request"] is not None:
        row("  of free streams:", m["free_decode_throughput_per_request"])
        row("  of constrained streams:", m["constrained_decode_throughput_per_request"])
    row("Concurrency:", m["concurrency"])
    if m["accept_length"] is not None:
        row("Accept length:", m["accept_length"])
    for turn, ttft in enumerate(m.get("median_ttft_ms_by_turn") or []):
        row(f"Median TTFT of turn {turn + 1} (ms):", ttft)
    for key, title in [("e2e_latency", "End-to-End Latency"), ("ttft", "Time to First Token"),
                       ("tpot", "Time per Output Token (excl. 1st token)"), ("itl", "Inter-Token Latency")]:
        print("{s:{c}^52}".format(s=f" {title} ", c="-"))
        short = {"e2e_latency": "E2E Latency"}.get(key, key.upper())
        for stat in ("mean", "median", "p90", "p99"):
            row(f"{stat.capitalize()} {short} (ms):", m[f"{stat}_{key}_ms"])
    if m.get("pd"):
        print_pd(m["pd"])
    print("=" * 52)


def print_pd(pd: dict) -> None:
    """The PD pair's counters over the run (the prefill node's, then the decode node's), and per room."""
    for node in ("prefill", "decode"):
        print("{s:{c}^52}".format(s=f" PD: {node} node ", c="-"))
        counters = pd[node]
        if counters is None:
            print(f"{'(no tandem_pd_* counters on its /metrics)':<52}")
            continue
        row("Rooms done / failed:", f"{counters['rooms_done']:.0f} / {counters['rooms_failed']:.0f}")
        row("KV transferred (MB):", counters["transferred_bytes"] / 1e6)
        row("Transfer seconds (room lives, summed):", counters["transfer_seconds"])
        for reason, count in counters["failures"].items():
            print(f"  {count:.0f} x {reason}")
    print("{s:{c}^52}".format(s=" PD: per room ", c="-"))
    row("KV per room (MB):", None if pd["bytes_per_room"] is None else pd["bytes_per_room"] / 1e6, "{:.3f}")
    row("Decode room (ms):", pd["decode_room_ms"])
    row("Prefill room (ms):", pd["prefill_room_ms"])
    row("Hand-off and wire (ms):", pd["handoff_ms"])
    row("Decode room / mean TTFT:", pd["room_share_of_ttft"])
    row("Hand-off and wire / mean TTFT:", pd["handoff_share_of_ttft"], "{:.3f}")


def plot(path: str, results: list[RequestResult], start: float, metrics: dict) -> None:
    """TTFT and ITL CDFs, and output tokens/s over time, in one PNG."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    ok = [r for r in results if r.success]
    fig, axes = plt.subplots(1, 3, figsize=(15, 4))
    for ax, values, title in [(axes[0], [r.ttft * 1000 for r in ok], "TTFT"),
                              (axes[1], [g * 1000 for r in ok for g in r.itl], "ITL")]:
        values = np.sort(values)
        if len(values):
            ax.plot(values, np.arange(1, len(values) + 1) / len(values))
        ax.set(title=f"{title} CDF", xlabel="ms", ylabel="fraction")
        ax.grid(alpha=0.3)
    times = [(t - start, n) for r in ok for t, n in r.token_times]
    duration = metrics["duration"]
    bin_s = max(duration / 50, 0.05)
    edges = np.arange(0, duration + bin_s, bin_s)
    if times and len(edges) > 1:
        counts, _ = np.histogram([t for t, _ in times], bins=edges, weights=[n for _, n in times])
        axes[2].plot(edges[:-1], counts / bin_s)
    axes[2].set(title="Output tokens/s over time", xlabel="s since start", ylabel="tok/s")
    axes[2].grid(alpha=0.3)
    fig.suptitle(f"{metrics['backend']}: {metrics['completed']} ok, {metrics['failed']} failed, "
                 f"{metrics['output_throughput']:.1f} output tok/s")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


# ---- arguments -----------------------------------------------------------------

def add_workload_args(parser: argparse.ArgumentParser) -> None:
    """Flags shared with bench/compare.py and bench/baseline_hf.py (same defaults, so the same prompts)."""
    parser.add_argument("--dataset-name", choices=DATASETS, default="code",
                        help="random: random token ids; prompts: a JSONL file; code: cuts of local Python sources; "
                             "generated-shared-prefix, multi-turn: prompts that share prefixes "
                             "(bench/prefix_datasets.py).")
    parser.add_argument("--dataset-path", default=None,
                        help="JSONL file for `prompts` ({\"prompt\", \"output_len\"?}); source folder for `code` "
                             "(default: the Python standard library).")
    parser.add_argument("--num-prompts", type=int, default=32, help="Requests to send.")
    parser.add_argument("--random-input-len", type=int, default=256, help="Most prompt tokens (random, code).")
    parser.add_argument("--random-output-len", type=int, default=64, help="Most output tokens.")
    parser.add_argument("--random-range-ratio", type=float, default=0.5,
                        help="Lengths are drawn from [len * ratio, len]; 1.0 makes them exact.")
    parser.add_argument("--seed", type=int, default=1, help="Seed of the dataset and the arrivals.")
    parser.add_argument("--tokenizer", default=None,
                        help="Tokenizer folder (default: --model if it is a folder, else models/tandem-dense).")
    parser.add_argument("--constrained-fraction", type=float, default=0.0,
                        help="Share of the requests sent with --constraint (spread evenly); the summary gives "
                             "free and constrained streams' decode speeds apart.")
    parser.add_argument("--constraint", type=json.loads, default=DEFAULT_CONSTRAINT,
                        help="The grammar fields a constrained request adds (to /generate's sampling_params, or "
                             "the OpenAI body). The default never ends before its length limit.")
    prefix_datasets.add_args(parser)


def add_client_args(parser: argparse.ArgumentParser) -> None:
    """Flags that shape each request, shared with bench/compare.py."""
    parser.add_argument("--backend", choices=BACKENDS, default="tandem",
                        help="tandem/sglang: POST /generate; vllm/openai: /v1/completions; openai-chat: "
                             "/v1/chat/completions.")
    parser.add_argument("--model", default=None, help="Model name for OpenAI requests (default: the first of "
                                                      "/v1/models).")
    parser.add_argument("--request-rate", type=float, default=float("inf"),
                        help="Requests per second with Poisson arrivals; inf sends all at once.")
    parser.add_argument("--warmup-requests", type=int, default=1, help="Requests sent (and not counted) before "
                                                                       "the run.")
    parser.add_argument("--extra-request-body", type=json.loads, default=None,
                        help="JSON object merged into every request body, e.g. '{\"top_p\": 0.9}'.")
    parser.add_argument("--disable-ignore-eos", action="store_true",
                        help="Let requests stop at EOS (by default ignore_eos is sent so output lengths are exact).")
    parser.add_argument("--timeout", type=float, default=600.0, help="Seconds one request may take.")
    parser.add_argument("--api-key", default=os.environ.get("OPENAI_API_KEY"),
                        help="Sent as `Authorization: Bearer KEY` (default: $OPENAI_API_KEY).")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    parser.add_argument("--base-url", default=None, help="Server URL (default: http://HOST:PORT).")
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=30000)
    add_client_args(parser)
    add_workload_args(parser)
    parser.add_argument("--max-concurrency", type=int, default=None, help="Most requests in flight at once.")
    parser.add_argument("--output-file", default=None, help="Append one JSON line (metrics + args) per run.")
    parser.add_argument("--disable-tqdm", action="store_true", help="No progress bar.")
    parser.add_argument("--plot", default=None, metavar="FILE.png", help="Write TTFT/ITL CDFs and tok/s over time.")
    parser.add_argument("--prefill-url", default=None, metavar="URL",
                        help="A prefill/decode pair: the prefill node's HTTP URL (its --port), the decode node being "
                             "the server under test. Both nodes' tandem_pd_* counters are scraped before and after "
                             "the run and reported (the JSON result's `pd`).")
    return parser


def finish_args(args) -> None:
    """Fill in derived fields (base URL, tokenizer, headers) and reject bad values with ValueError."""
    if not getattr(args, "base_url", None):
        args.base_url = f"http://{args.host}:{args.port}"
    if not args.tokenizer:
        args.tokenizer = args.model if args.model and Path(args.model).is_dir() else DEFAULT_TOKENIZER
    args.headers = {"Authorization": f"Bearer {args.api_key}"} if getattr(args, "api_key", None) else {}
    if args.num_prompts < 1:
        raise ValueError("--num-prompts must be at least 1")
    if min(args.random_input_len, args.random_output_len) < 1 or not 0.0 <= args.random_range_ratio <= 1.0:
        raise ValueError("lengths must be >= 1 and --random-range-ratio in [0, 1]")
    if args.request_rate <= 0:
        raise ValueError("--request-rate must be positive (or inf)")
    if args.max_concurrency is not None and args.max_concurrency < 1:
        raise ValueError("--max-concurrency must be at least 1")
    if args.dataset_name == "prompts" and not (args.dataset_path and Path(args.dataset_path).is_file()):
        raise ValueError("--dataset-name prompts needs --dataset-path to a JSONL file")
    if not 0.0 <= getattr(args, "constrained_fraction", 0.0) <= 1.0 or not isinstance(getattr(
            args, "constraint", {}), dict):
        raise ValueError("--constrained-fraction must be in [0, 1] and --constraint a JSON object")
    if args.extra_request_body is not None and not isinstance(args.extra_request_body, dict):
        raise ValueError("--extra-request-body must be a JSON object")
    if getattr(args, "prefill_url", None) and not args.prefill_url.startswith(("http://", "https://")):
        raise ValueError("--prefill-url wants http://HOST:PORT")
    if not Path(args.tokenizer).is_dir():
        raise ValueError(f"tokenizer folder {args.tokenizer} not found (pass --tokenizer)")


def jsonable(value):
    """Strict JSON: infinities and NaN become strings."""
    if isinstance(value, dict):
        return {k: jsonable(v) for k, v in value.items()}
    if isinstance(value, list):
        return [jsonable(v) for v in value]
    if isinstance(value, float) and not np.isfinite(value):
        return str(value)
    return value


def args_record(args) -> dict:
    """The arguments as JSON-safe values (headers left out: they may hold the API key)."""
    skip = {"headers", "api_key"}
    plain = (str, int, float, bool, dict, list, type(None))
    return {k: v for k, v in vars(args).items() if k not in skip and isinstance(v, plain)}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """Parse and check the flags; bad values exit with status 2."""
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        finish_args(args)
    except ValueError as exc:
        parser.error(str(exc))
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    asyncio.run(run_benchmark(args))
    return 0


if __name__ == "__main__":
    sys.exit(main())
