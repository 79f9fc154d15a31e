"""From engine TokenDeltas to per-choice text updates, and from those to the client.

`stream_sequence` runs one engine request: detokenizes, matches stop strings and
aborts the engine when one matches. `merge_sequences` runs several (n > 1, or
several prompts) side by side. `serve_sse` writes events as Server-Sent Events,
and `race_disconnect` cancels the work when the client goes away, which closes
the engine iterators and so aborts each engine request once.
"""
from __future__ import annotations

import asyncio
import logging
import time
from concurrent.futures import ThreadPoolExecutor
from contextlib import aclosing
from dataclasses import dataclass, field
from typing import Any, AsyncIterator, Awaitable

import msgspec
from aiohttp import web

from engine.args import ServerArgs
from engine.messages import SamplingParams, TokenDelta
from server.detokenizer import IncrementalDetokenizer, StopStringMatcher, TokenTexts
from server.engine_client import EngineClient, EngineDead, EngineFailed, EngineRejected
from server.errors import APIError, from_engine_error
from server.metrics import Metrics, RequestTracker

DISCONNECT_POLL_S = 0.5     # how often a request checks its connection (cheap even with 1000s in flight)
# A client that stops reading (socket buffers full, no FIN) never closes its transport, so the
# disconnect poll cannot see it; an SSE write that waits this long counts as a disconnect instead.
SSE_WRITE_TIMEOUT_S = 30.0
SSE_HEADERS = {"Content-Type": "text/event-stream", "Cache-Control": "no-cache", "X-Accel-Buffering": "no"}
_json = msgspec.json.Encoder()
log = logging.getLogger("tandem.http")


def json_response(body, status: int = 200) -> web.Response:
    """A JSON response encoded with msgspec (faster than aiohttp's json.dumps)."""
    return web.Response(body=_json.encode(body), status=status, content_type="application/json")


class ClientGone(Exception):
    """The client closed the connection before the response was complete."""


@dataclass
class FrontContext:
    """What every handler needs; stored on the app under CONTEXT."""
    args: ServerArgs
    engine: EngineClient
    tokenizer: Any
    context_length: int
    metrics: Metrics
    model_name: str
    vocab_size: int
    token_texts: TokenTexts
    max_token_chars: int                    # the most characters a single token stands for
    tokenize_pool: ThreadPoolExecutor

    @property
    def max_prompt_chars(self) -> int:
        """No text longer than this can fit the context, whatever its tokens."""
        return self.context_length * self.max_token_chars

    async def off_loop(self, fn, *args):
        """Run tokenizer work (encoding, chat templates) in the front's pool, so that a long text
        never stalls the event loop: the fast tokenizer releases the GIL while it encodes."""
        return await asyncio.get_running_loop().run_in_executor(self.tokenize_pool, fn, *args)

    def run(self, specs: list["SequenceSpec"], arrival: float) -> AsyncIterator["SeqUpdate"]:
        """Start the engine requests of `specs`; their updates, interleaved."""
        return merge_sequences([stream_sequence(self, spec, arrival) for spec in specs])


CONTEXT = web.AppKey("tandem_context", FrontContext)


@dataclass
class SequenceSpec:
    """One engine request: a choice of a completion."""
    index: int
    rid: str
    input_ids: list[int]
    params: SamplingParams
    stops: list[str] = field(default_factory=list)
    skip_special_tokens: bool = True


@dataclass
class TokenLogprob:
    token_id: int
    logprob: float
    top: list[tuple[int, float]]


@dataclass
class SeqUpdate:
    """What one delta added to a choice: final text only, never a partial character or stop string."""
    index: int
    text: str
    token_ids: list[int]
    logprobs: list[TokenLogprob]
    finish_reason: str | None       # "stop" | "length" | "abort" on the last update
    matched: int | str | None       # the stop token id or stop string that finished it
    prompt_tokens: int
    completion_tokens: int          # cumulative
    spec_verify_ct: int
    cached_tokens: int


class _Sequence:
    """Per-request state: detokenizer, stop matcher, token count and timing."""

    def __init__(self, spec: SequenceSpec, tokenizer, metrics: Metrics, arrival: float):
        self.spec, self.metrics, self.arrival = spec, metrics, arrival
        self.detok = IncrementalDetokenizer(tokenizer, spec.input_ids, spec.skip_special_tokens)
        self.stopper = StopStringMatcher(spec.stops)
        self.completion_tokens = 0
        self.last_arrival: float | None = None

    def observe(self, delta: TokenDelta) -> None:
        now, count = time.perf_counter(), len(delta.token_ids)
        if self.last_arrival is None:
            self.metrics.ttft.observe(now - self.arrival)
            self.metrics.prompt_tokens.inc(len(self.spec.input_ids))
        elif count:
            for _ in range(count):
                self.metrics.itl.observe((now - self.last_arrival) / count)
        self.metrics.generation_tokens.inc(count)
        self.last_arrival = now

    def consume(self, delta: TokenDelta) -> SeqUpdate:
        """Feed a delta token by token, so a stop string is pinned to the token that completed it."""
        final = delta.finish_reason is not None
        parts: list[str] = []
        used: list[int] = []
        stop_hit = None
        for i, tok in enumerate(delta.token_ids):
            used.append(tok)
            is_stop_token = final and delta.matched_stop == tok and i == len(delta.token_ids) - 1
            emit, stop_hit = self.stopper.feed("" if is_stop_token else self.detok.add([tok]))
            parts.append(emit)
            if stop_hit is not None:
                break
        if stop_hit is None and final:
            emit, stop_hit = self.stopper.feed(self.detok.flush())
            parts.append(emit if stop_hit is not None else emit + self.stopper.flush())
        # completion_tokens counts every token the engine generated up to and including the one
        # that completed a stop string; tokens after it (same delta) are dropped from the output.
        self.completion_tokens += len(used)
        return SeqUpdate(
            index=self.spec.index, text="".join(parts), token_ids=used,
            logprobs=_logprobs(delta, len(used)),
            finish_reason="stop" if stop_hit is not None else delta.finish_reason,
            matched=stop_hit if stop_hit is not None else delta.matched_stop,
            prompt_tokens=len(self.spec.input_ids), completion_tokens=self.completion_tokens,
            spec_verify_ct=delta.spec_verify_ct, cached_tokens=delta.cached_tokens)


def _logprobs(delta: TokenDelta, count: int) -> list[TokenLogprob]:
    if delta.logprobs is None:
        return []
    tops = delta.top_logprobs or [[] for _ in delta.token_ids]
    return [TokenLogprob(delta.token_ids[i], delta.logprobs[i], list(tops[i]) if i < len(tops) else [])
            for i in range(min(count, len(delta.logprobs)))]


async def stream_sequence(ctx: FrontContext, spec: SequenceSpec, arrival: float) -> AsyncIterator[SeqUpdate]:
    """Updates of one engine request; the last one has finish_reason set.

    On a stop-string match the engine is told `abort(rid, "stop")` and the iterator is closed.
    Closing this generator early closes the engine iterator, which aborts the request."""
    engine = ctx.engine
    seq = _Sequence(spec, ctx.tokenizer, ctx.metrics, arrival)
    deltas = engine.generate(spec.rid, spec.input_ids, spec.params)
    finished = False
    try:
        async for delta in deltas:
            if finished:
                continue
            seq.observe(delta)
            update = seq.consume(delta)
            finished = update.finish_reason is not None
            if finished and delta.finish_reason is None:    # we matched a stop string
                await engine.abort(spec.rid, "stop")
                yield update
                return
            yield update
    finally:
        close = getattr(deltas, "aclose", None)
        if close is not None:
            await close()
    if not finished:
        raise EngineDead(f"request {spec.rid} ended without a finish reason")


_DONE = object()      # a pumped stream's end, in merge_sequences' queue


async def merge_sequences(streams: list[AsyncIterator[SeqUpdate]]) -> AsyncIterator[SeqUpdate]:
    """Interleave several sequence streams as their updates arrive; closing this closes them all."""
    if len(streams) == 1:
        async with aclosing(streams[0]) as only:
            async for update in only:
                yield update
        return
    queue: asyncio.Queue = asyncio.Queue()
    tasks = [asyncio.create_task(pump(s, queue)) for s in streams]
    try:
        remaining = len(tasks)
        while remaining:
            item = await queue.get()
            if item is _DONE:
                remaining -= 1
            elif isinstance(item, Exception):
                raise item
            else:
                yield item
    finally:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)


async def pump(stream: AsyncIterator[SeqUpdate], queue: asyncio.Queue) -> None:
    """Move a stream's updates (then _DONE, or the exception it ended with) into the queue."""
    try:
        async with aclosing(stream):
            async for update in stream:
                queue.put_nowait(update)
        queue.put_nowait(_DONE)
    except Exception as exc:    # handed to the consumer, which raises it
        queue.put_nowait(exc)


@dataclass
class ChoiceResult:
    """A whole choice, accumulated from its updates (non-streaming responses)."""
    index: int
    text: str = ""
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[TokenLogprob] = field(default_factory=list)
    finish_reason: str | None = None
    matched: int | str | None = None
    prompt_tokens: int = 0
    completion_tokens: int = 0
    spec_verify_ct: int = 0
    cached_tokens: int = 0

    def add(self, update: SeqUpdate) -> None:
        self.text += update.text
        self.token_ids += update.token_ids
        self.logprobs += update.logprobs
        self.finish_reason, self.matched = update.finish_reason, update.matched
        self.prompt_tokens, self.completion_tokens = update.prompt_tokens, update.completion_tokens
        self.spec_verify_ct, self.cached_tokens = update.spec_verify_ct, update.cached_tokens


async def collect(updates: AsyncIterator[SeqUpdate], count: int) -> list[ChoiceResult]:
    results = [ChoiceResult(i) for i in range(count)]
    async with aclosing(updates):
        async for update in updates:
            results[update.index].add(update)
    return results


def outcome_of(exc: BaseException) -> str:
    """The metrics outcome of a failed request: "rejected" for refusals, "error" for failures."""
    if isinstance(exc, EngineRejected):
        return "rejected"
    if isinstance(exc, APIError):
        return "rejected" if exc.status < 500 or exc.code == "overloaded" else "error"
    if isinstance(exc, web.HTTPException):      # e.g. 413, a body over client_max_size
        return "rejected" if exc.status < 500 else "error"
    return "error"


def stream_error(request: web.Request, exc: Exception) -> APIError:
    """The error event for a failure after the SSE headers went out; unexpected ones are logged."""
    if isinstance(exc, APIError):
        return exc
    if isinstance(exc, (EngineRejected, EngineDead, EngineFailed)):
        return from_engine_error(exc)
    log.error("unhandled error while streaming %s", request.path, exc_info=exc)
    return APIError(500, "Internal server error.", code="internal_error")


async def write_or_gone(request: web.Request, write: Awaitable) -> None:
    """Await a write to the client; a lost connection, or a write stuck for SSE_WRITE_TIMEOUT_S
    (a client that stopped reading), raises ClientGone."""
    try:
        async with asyncio.timeout(SSE_WRITE_TIMEOUT_S):
            await write
    except TimeoutError:
        if request.transport is not None:
            request.transport.abort()       # drop what it never read, and the connection with it
        raise ClientGone() from None
    except ConnectionError:     # a reset, or a plain ConnectionError when lost while waiting to drain
        raise ClientGone() from None


def sse_event(body: Any) -> bytes:
    return b"data: " + _json.encode(body) + b"\n\n"


async def serve_sse(request: web.Request, events: AsyncIterator[dict], tracker: RequestTracker) -> web.StreamResponse:
    """Send events as `data: {json}\\n\\n`, then `data: [DONE]\\n\\n`.

    The first event is awaited before the headers go out, so an error up to then gets its
    own HTTP status; a later engine error is sent as an `{"error": ...}` event. A client that
    is gone or stopped reading raises ClientGone, and leaving closes `events`, which aborts
    the engine requests."""
    async with aclosing(events):
        first = await anext(events, None)
        response = web.StreamResponse(headers=SSE_HEADERS)
        await write_or_gone(request, response.prepare(request))
        if first is not None:
            await write_or_gone(request, response.write(sse_event(first)))
        try:
            async for event in events:
                await write_or_gone(request, response.write(sse_event(event)))
        except ClientGone:
            raise
        except Exception as exc:    # the headers are out: report it in the stream
            tracker.finish(outcome_of(exc))
            await write_or_gone(request, response.write(sse_event(stream_error(request, exc).body())))
        await write_or_gone(request, response.write(b"data: [DONE]\n\n"))
        await write_or_gone(request, response.write_eof())
    return response


async def _client_gone(request: web.Request) -> None:
    while True:
        transport = request.transport
        if transport is None or transport.is_closing():
            return
        await asyncio.sleep(DISCONNECT_POLL_S)


async def race_disconnect(request: web.Request, work):
    """Await `work`, cancelling it (and raising ClientGone) if the client disconnects first."""
    task = asyncio.ensure_future(work)
    watcher = asyncio.ensure_future(_client_gone(request))
    try:
        await asyncio.wait({task, watcher}, return_when=asyncio.FIRST_COMPLETED)
    except asyncio.CancelledError:      # the handler itself was cancelled (handler_cancellation)
        task.cancel()
        watcher.cancel()
        await asyncio.gather(task, watcher, return_exceptions=True)
        raise
    watcher.cancel()
    if task.done():
        return task.result()
    task.cancel()
    await asyncio.gather(task, return_exceptions=True)
    raise ClientGone()
