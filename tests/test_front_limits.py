"""The front never stalls: input limits, tokenizing off the event loop, and timeouts on
half-open connections (server/app.py, server/schemas.py, server/streaming.py), against FakeEngine."""
from __future__ import annotations

import asyncio
import asyncio.base_events
import inspect
import json
import socket
import statistics
import threading
import time
from dataclasses import dataclass

import aiohttp
import pytest
import pytest_asyncio
from aiohttp import web

import server.schemas
import server.streaming
from engine.args import ServerArgs
from server.app import KEEPALIVE_OPTIONS, create_app
from server.streaming import CONTEXT
from tests.fake_engine import FakeEngine, build_test_tokenizer
from tests.test_http_api import MODEL, SCRIPT, Harness, bounded

pytestmark = pytest.mark.asyncio
TOKENIZE_THREAD_PREFIX = "tandem-tokenize"


@dataclass
class TokenizerCall:
    kind: str           # "encode", "call" or "chat_template"
    chars: int
    thread: str
    seconds: float


class SpyTokenizer:
    """The test tokenizer, recording how many characters each call tokenized, in which thread, how long."""

    def __init__(self, inner):
        self._inner = inner
        self.calls: list[TokenizerCall] = []

    def __getattr__(self, name):
        return getattr(self._inner, name)

    def __len__(self) -> int:
        return len(self._inner)

    def _record(self, kind: str, chars: int, fn, *args, **kwargs):
        start = time.perf_counter()
        try:
            return fn(*args, **kwargs)
        finally:
            self.calls.append(TokenizerCall(kind, chars, threading.current_thread().name,
                                            time.perf_counter() - start))

    def encode(self, text, *args, **kwargs):
        return self._record("encode", len(text), self._inner.encode, text, *args, **kwargs)

    def __call__(self, text, *args, **kwargs):
        return self._record("call", len(text), self._inner, text, *args, **kwargs)

    def apply_chat_template(self, conversation, *args, **kwargs):
        chars = sum(len(m["content"]) for m in conversation)
        return self._record("chat_template", chars, self._inner.apply_chat_template, conversation, *args, **kwargs)


@dataclass
class Front:
    h: Harness
    tokenizer: SpyTokenizer
    app: web.Application


@pytest_asyncio.fixture
async def serve():
    runners, harnesses = [], []

    async def start(context_length: int = 64, token_delay: float = 0.001, routes=(), **args) -> Front:
        tokenizer = SpyTokenizer(build_test_tokenizer())
        engine = FakeEngine(tokenizer, token_delay=token_delay)
        engine.script_text(tokenizer, SCRIPT)
        app = create_app(ServerArgs(served_model_name=MODEL, **args), engine, tokenizer, context_length)
        for path, handler in routes:
            app.router.add_get(path, handler)
        runner = web.AppRunner(app, access_log=None)
        await runner.setup()
        runners.append(runner)
        await web.TCPSite(runner, "127.0.0.1", 0).start()
        host, port = runner.addresses[0][:2]
        harnesses.append(Harness(f"http://{host}:{port}", engine,
                                 aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=20))))
        tokenizer.calls.clear()     # the start-up warm-up
        return Front(harnesses[-1], tokenizer, app)

    yield start
    for h in harnesses:
        await h.http.close()
    for runner in runners:
        await runner.cleanup()


def long_text(chars: int) -> str:
    """Varied text (the standard library's asyncio source), so that it makes many tokens."""
    source = inspect.getsource(asyncio.base_events)
    return (source * (chars // len(source) + 1))[:chars]


def text_request(path: str, text: str) -> dict:
    """A one-token request whose prompt is `text`."""
    if path == "/v1/chat/completions":
        return {"messages": [{"role": "user", "content": text}], "max_tokens": 1}
    if path == "/generate":
        return {"text": text, "sampling_params": {"max_new_tokens": 1}}
    return {"prompt": text, "max_tokens": 1}


async def timed(coro) -> float:
    start = time.perf_counter()
    await coro
    return time.perf_counter() - start


# ---- texts too long for the context are refused before tokenizing ---------------------

HUGE = long_text(2_000_000)     # over aiohttp's default 1 MiB body limit, under --max-request-bytes
HUGE_CASES = [
    ("/v1/completions", {"prompt": HUGE}, "prompt"),
    ("/v1/completions", {"prompt": ["a short one", HUGE]}, "prompt[1]"),
    ("/v1/chat/completions", {"messages": [{"role": "system", "content": "be brief"},
                                           {"role": "user", "content": HUGE}]}, "messages"),
    ("/generate", {"text": HUGE}, "text"),
]


@pytest.mark.parametrize("path,body,param", HUGE_CASES)
@bounded()
async def test_a_text_too_long_for_the_context_is_refused_without_tokenizing(serve, path, body, param):
    front = await serve(context_length=64)
    status, answer = await front.h.post(path, body)
    assert status == 400 and answer["error"]["code"] == "context_length_exceeded"
    assert answer["error"]["param"] == param and str(front.app[CONTEXT].max_prompt_chars) in answer["error"]["message"]
    assert front.tokenizer.calls == [] and front.h.engine.requests == []


@bounded()
async def test_the_character_limit_is_exact(serve):
    """A text of exactly context * max_token_chars characters is tokenized (and refused by its token
    count); one character more is refused unread."""
    front = await serve(context_length=64)
    limit = front.app[CONTEXT].max_prompt_chars
    assert front.app[CONTEXT].max_token_chars >= max(len(p) for p in front.tokenizer.get_vocab())
    for chars, tokenized in ((limit, True), (limit + 1, False)):
        front.tokenizer.calls.clear()
        status, answer = await front.h.post("/v1/completions", {"prompt": long_text(chars)})
        assert status == 400 and answer["error"]["code"] == "context_length_exceeded"
        assert bool(front.tokenizer.calls) == tokenized


@bounded(60)
async def test_small_requests_stay_prompt_while_a_huge_prompt_is_refused(serve):
    front = await serve(context_length=64)
    small = {"prompt": "x", "max_tokens": 2}
    baseline = statistics.median([await timed(front.h.post("/v1/completions", small)) for _ in range(5)])
    stall = await timed(asyncio.to_thread(build_test_tokenizer().encode, HUGE))    # how long tokenizing HUGE takes
    huge = asyncio.create_task(front.h.post("/v1/completions", {"prompt": HUGE}))
    latencies = []
    while not huge.done():
        latencies.append(await timed(front.h.post("/v1/completions", small)))
    assert (await huge)[0] == 400
    assert max(latencies) < stall / 4, (latencies, baseline, stall)
    assert front.tokenizer.calls and max(c.chars for c in front.tokenizer.calls) == 1


# ---- long texts that fit are tokenized in the pool, the loop keeps running ------------

async def tick_gaps(stop: asyncio.Event) -> list[float]:
    gaps, last = [], time.perf_counter()
    while not stop.is_set():
        await asyncio.sleep(0.01)
        now = time.perf_counter()
        gaps.append(now - last)
        last = now
    return gaps


@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions", "/generate"])
@bounded(60)
async def test_a_long_text_is_tokenized_off_the_event_loop(serve, path):
    front = await serve(context_length=10**6)
    text = long_text(1_000_000)
    stop = asyncio.Event()
    ticker = asyncio.create_task(tick_gaps(stop))
    status, answer = await front.h.post(path, text_request(path, text))
    stop.set()
    gaps = await ticker
    assert status == 200, answer
    long_calls = [c for c in front.tokenizer.calls if c.chars >= len(text) and c.kind != "chat_template"]
    assert len(long_calls) == 1 and long_calls[0].thread.startswith(TOKENIZE_THREAD_PREFIX)
    # On the loop, one tick would wait the whole tokenization.
    assert max(gaps) < long_calls[0].seconds / 3, (max(gaps), long_calls[0].seconds)


# ---- size limits ----------------------------------------------------------------------

@bounded()
async def test_a_body_over_max_request_bytes_gets_a_json_413(serve):
    front = await serve(context_length=10**4, max_request_bytes=4096)
    for path in ("/v1/completions", "/v1/chat/completions", "/generate"):
        async with front.h.http.post(front.h.url + path, json=text_request(path, "x" * 5000)) as resp:
            assert resp.status == 413 and resp.content_type == "application/json"
            error = (await resp.json())["error"]
        assert error["code"] == "request_too_large" and "4096" in error["message"]
        assert error["type"] == "invalid_request_error"
    status, _ = await front.h.post("/v1/completions", {"prompt": "x" * 3000, "max_tokens": 1})
    assert status == 200
    metrics = await front.h.metrics()
    assert metrics["tandem_requests_total{rejected}"] == 3 and metrics["tandem_requests_total{ok}"] == 1


@bounded()
async def test_stop_strings_up_to_the_limits_are_accepted(serve):
    front = await serve()
    stops = ["s" * server.schemas.MAX_STOP_CHARS] * server.schemas.MAX_STOP_STRINGS
    status, _ = await front.h.post("/v1/completions", {"prompt": "x", "max_tokens": 2, "stop": stops})
    assert status == 200
    status, answer = await front.h.post("/v1/completions", {"prompt": "x", "stop": stops[:1] + ["s" * 257]})
    assert status == 400 and answer["error"]["param"] == "stop" and "256 characters" in answer["error"]["message"]


# ---- half-open connections -------------------------------------------------------------

async def raw_connection(front: Front, request_head: bytes, rcvbuf: int | None = None) -> socket.socket:
    """A client socket that sends `request_head` and then reads or sends only what the test tells it to."""
    sock = socket.socket()
    sock.setblocking(False)
    if rcvbuf is not None:      # before connecting, so that the window stays small
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, rcvbuf)
    host, port = front.h.url.removeprefix("http://").split(":")
    loop = asyncio.get_running_loop()
    await loop.sock_connect(sock, (host, int(port)))
    await loop.sock_sendall(sock, request_head)
    return sock


async def read_response(sock: socket.socket) -> tuple[str, bytes]:
    """The head and body of one response with a Content-Length."""
    data, loop = b"", asyncio.get_running_loop()
    while b"\r\n\r\n" not in data:
        data += await loop.sock_recv(sock, 65536)
    head, body = data.split(b"\r\n\r\n", 1)
    length = int(next(line.split(b":")[1] for line in head.split(b"\r\n") if line.startswith(b"Content-Length")))
    while len(body) < length:
        body += await loop.sock_recv(sock, 65536)
    return head.decode(), body


def post_head(path: str, body: bytes, content_length: int | None = None) -> bytes:
    length = len(body) if content_length is None else content_length
    return (f"POST {path} HTTP/1.1\r\nHost: test\r\nContent-Type: application/json\r\n"
            f"Content-Length: {length}\r\n\r\n").encode() + body


@bounded()
async def test_a_stalled_body_read_gets_408_and_frees_the_handler(serve, monkeypatch):
    monkeypatch.setattr(server.schemas, "BODY_READ_TIMEOUT_S", 0.3)
    front = await serve()
    with await raw_connection(front, post_head("/v1/completions", b'{"prompt": "x', content_length=100)) as sock:
        head, body = await read_response(sock)
    assert head.startswith("HTTP/1.1 408") and "Connection: close" in head
    assert json.loads(body)["error"]["code"] == "request_timeout"
    metrics = await front.h.metrics()
    assert metrics["tandem_requests_total{rejected}"] == 1 and front.h.engine.requests == []


def endless_stream(path: str) -> bytes:
    """A streaming request that would run for a million tokens, with logprobs for bigger events."""
    if path == "/generate":
        body = {"text": "x", "stream": True, "return_logprob": True, "top_logprobs_num": 5,
                "sampling_params": {"ignore_eos": True, "max_new_tokens": 10**6}}
    else:
        body = {"prompt": "x", "stream": True, "ignore_eos": True, "max_tokens": 10**6, "logprobs": 5}
    return post_head(path, json.dumps(body).encode())


async def generation_stalled(front: Front) -> None:
    """Wait until the engine's output stops growing: the SSE writes wait on a full socket."""
    previous = -1.0
    while True:
        await asyncio.sleep(0.2)
        produced = (await front.h.metrics())["tandem_generation_tokens_total"]
        if produced == previous and produced > 0:
            return
        previous = produced


async def wait_for_abort(front: Front) -> None:
    while not front.h.engine.aborts or front.h.engine.active:
        await asyncio.sleep(0.02)


@bounded()
async def test_a_streaming_client_that_stops_reading_is_aborted_after_the_write_timeout(serve, monkeypatch):
    monkeypatch.setattr(server.streaming, "SSE_WRITE_TIMEOUT_S", 0.5)
    front = await serve(context_length=10**7, token_delay=0)
    with await raw_connection(front, endless_stream("/v1/completions"), rcvbuf=4096):
        await wait_for_abort(front)      # the client neither reads nor closes
        rid = front.h.engine.requests[0][0]
        assert front.h.engine.aborts == [(rid, "abort")]
        metrics = await front.h.metrics()
    assert metrics["tandem_requests_total{abort}"] == 1 and metrics["tandem_requests_total{error}"] == 0


@bounded()
async def test_a_client_that_stops_reading_and_then_leaves_is_an_abort_not_an_error(serve, caplog):
    """While a write waits for the socket to drain, losing the connection raises a plain ConnectionError."""
    front = await serve(context_length=10**7, token_delay=0)
    sock = await raw_connection(front, endless_stream("/generate"), rcvbuf=4096)
    await generation_stalled(front)
    sock.close()        # with unread data: the peer gets a reset
    await wait_for_abort(front)
    await asyncio.sleep(0.1)
    metrics = await front.h.metrics()
    assert metrics["tandem_requests_total{abort}"] == 1 and metrics["tandem_requests_total{error}"] == 0
    assert not [r for r in caplog.records if r.levelname == "ERROR"]


@pytest.mark.skipif(not hasattr(socket, "TCP_KEEPIDLE"), reason="TCP keep-alive timings are set on Linux only")
@bounded()
async def test_accepted_connections_probe_their_peer_every_few_minutes(serve):
    async def socket_options(request: web.Request) -> web.Response:
        sock = request.transport.get_extra_info("socket")
        options = {name: sock.getsockopt(socket.IPPROTO_TCP, getattr(socket, name)) for name, _ in KEEPALIVE_OPTIONS}
        return web.json_response({**options, "SO_KEEPALIVE": sock.getsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE)})

    front = await serve(routes=[("/socket-options", socket_options)])
    async with front.h.http.get(front.h.url + "/socket-options") as resp:
        options = await resp.json()
    assert options == {**dict(KEEPALIVE_OPTIONS), "SO_KEEPALIVE": 1}
