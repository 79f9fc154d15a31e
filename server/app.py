"""The aiohttp application: routes, API-key check, error handling, request accounting.

    create_app(args, engine, tokenizer, context_length) -> web.Application

Generation handlers run under `generation_endpoint`, which races them against a
client disconnect (cancelling them aborts their engine requests) and records
each request's outcome in the metrics exactly once.

Nothing a client sends may stall the event loop or hold a handler forever: bodies are
capped (--max-request-bytes, 413) and read under a timeout (408), texts too long for
the context are refused before tokenizing, tokenizing runs in a thread pool, SSE writes
time out, and TCP keep-alive probes notice dead peers within minutes.
"""
from __future__ import annotations

import asyncio
import hmac
import logging
import socket
import time
from types import SimpleNamespace
from concurrent.futures import ThreadPoolExecutor
from typing import TYPE_CHECKING

from aiohttp import web

from engine.args import ServerArgs
from server.detokenizer import TokenTexts
from server.engine_client import EngineClient
from server.errors import APIError, error_middleware
from server.generate_api import generate
from server.metrics import Metrics
from server.openai_api import chat_completions, completions
from server.schemas import max_token_chars
from server.streaming import CONTEXT, ClientGone, FrontContext, json_response, outcome_of, race_disconnect

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

log = logging.getLogger("tandem.http")

OPEN_PATHS = frozenset({"/health", "/metrics"})
CLIENT_CLOSED_STATUS = 499
TOKENIZE_THREADS = 4         # a few long prompts side by side; more would only crowd the loop off the cores
# Linux's default keep-alive notices a dead peer after 2 h 11 min; these make it about 4 minutes.
KEEPALIVE_OPTIONS = (("TCP_KEEPIDLE", 120), ("TCP_KEEPINTVL", 30), ("TCP_KEEPCNT", 4))


def create_app(args: ServerArgs, engine: EngineClient, tokenizer: PreTrainedTokenizerBase,
               context_length: int) -> web.Application:
    """The HTTP front of `engine`; `context_length` bounds prompt + output tokens."""
    middlewares = [keepalive_middleware, close_after_timeout_middleware, error_middleware,
                   api_key_middleware(args.api_key)]
    app = web.Application(middlewares=middlewares, client_max_size=args.max_request_bytes)
    app[CONTEXT] = FrontContext(args=args, engine=engine, tokenizer=tokenizer, context_length=context_length,
                                metrics=Metrics(engine), model_name=args.model_name, vocab_size=len(tokenizer),
                                token_texts=TokenTexts(tokenizer), max_token_chars=max_token_chars(tokenizer),
                                tokenize_pool=tokenize_pool(tokenizer))
    app.on_cleanup.append(stop_tokenize_pool)
    app.router.add_post("/v1/completions", generation_endpoint(completions))
    app.router.add_post("/v1/chat/completions", generation_endpoint(chat_completions))
    app.router.add_post("/generate", generation_endpoint(generate))
    app.router.add_get("/v1/models", list_models)
    app.router.add_get("/health", health)
    app.router.add_get("/metrics", metrics)
    app.router.add_route("*", "/flush_cache", flush_cache)
    return app


def create_prefill_app(args: ServerArgs, engine: EngineClient) -> web.Application:
    """A prefill node's HTTP port: /health and /metrics; its work comes over the bootstrap port."""
    app = web.Application(middlewares=[error_middleware, api_key_middleware(args.api_key)])
    app[PREFILL_CONTEXT] = SimpleNamespace(engine=engine, metrics=Metrics(engine))
    app.router.add_get("/health", prefill_health)
    app.router.add_get("/metrics", prefill_metrics)
    return app


PREFILL_CONTEXT = web.AppKey("tandem_prefill", SimpleNamespace)


async def prefill_health(request: web.Request) -> web.Response:
    if request.app[PREFILL_CONTEXT].engine.is_healthy():
        return json_response({"role": "prefill"})
    raise APIError(503, "The engine is not healthy.", code="engine_dead")


async def prefill_metrics(request: web.Request) -> web.Response:
    body = request.app[PREFILL_CONTEXT].metrics.render()
    return web.Response(body=body, headers={"Content-Type": "text/plain; version=0.0.4; charset=utf-8"})


def tokenize_pool(tokenizer) -> ThreadPoolExecutor:
    """Threads for tokenizing; the tokenizer is used once here first, because a fast tokenizer's
    first call may reset its truncation settings, which fails if another thread is encoding."""
    tokenizer.encode("warm-up")
    return ThreadPoolExecutor(TOKENIZE_THREADS, thread_name_prefix="tandem-tokenize")


async def stop_tokenize_pool(app: web.Application) -> None:
    app[CONTEXT].tokenize_pool.shutdown(wait=False, cancel_futures=True)


@web.middleware
async def keepalive_middleware(request: web.Request, handler):
    """Probe the peer of every TCP connection every few minutes (aiohttp turns SO_KEEPALIVE on,
    the kernel's timings are hours), so a dead client's request is aborted and its KV freed."""
    transport = request.transport
    sock = transport.get_extra_info("socket") if transport is not None else None
    if sock is not None and sock.family in (socket.AF_INET, socket.AF_INET6):
        for name, value in KEEPALIVE_OPTIONS:
            if hasattr(socket, name):       # Linux; other systems keep their defaults
                sock.setsockopt(socket.IPPROTO_TCP, getattr(socket, name), value)
    return await handler(request)


@web.middleware
async def close_after_timeout_middleware(request: web.Request, handler):
    """A 408 closes its connection: the client that stalled is not sent another response on it."""
    response = await handler(request)
    if response.status == 408:
        response.force_close()
    return response


def api_key_middleware(api_key: str | None):
    """With an API key, every path but /health and /metrics needs `Authorization: Bearer <key>`."""
    expected = f"Bearer {api_key}".encode() if api_key else None

    @web.middleware
    async def check_api_key(request: web.Request, handler):
        if expected is not None and request.path not in OPEN_PATHS:
            given = request.headers.get("Authorization", "").encode()
            if not hmac.compare_digest(given, expected):
                raise APIError(401, "Missing or incorrect API key; send `Authorization: Bearer <key>`.",
                               code="invalid_api_key")
        return await handler(request)

    return check_api_key


def generation_endpoint(handler):
    """Wrap a generation handler: disconnect handling and the request outcome metric."""

    async def endpoint(request: web.Request) -> web.StreamResponse:
        tracker = request.app[CONTEXT].metrics.start_request()
        try:
            response = await race_disconnect(request, handler(request, tracker))
        except (ClientGone, ConnectionResetError):      # the latter: lost while reading the body
            tracker.finish("abort")
            return web.Response(status=CLIENT_CLOSED_STATUS)
        except asyncio.CancelledError:
            tracker.finish("abort")
            raise
        except Exception as exc:
            tracker.finish(outcome_of(exc))
            raise
        tracker.finish("ok")
        return response

    return endpoint


async def list_models(request: web.Request) -> web.Response:
    ctx = request.app[CONTEXT]
    model = {"id": ctx.model_name, "object": "model", "created": int(time.time()), "owned_by": "tandem",
             "root": ctx.args.model_path, "max_model_len": ctx.context_length}
    return json_response({"object": "list", "data": [model]})


async def health(request: web.Request) -> web.Response:
    if request.app[CONTEXT].engine.is_healthy():
        return json_response({})
    raise APIError(503, "The engine is not healthy.", code="engine_dead")


async def flush_cache(request: web.Request) -> web.Response:
    """SGLang's /flush_cache (GET or POST): empty the prefix cache; 400 while requests run."""
    if request.method not in ("GET", "POST"):
        raise APIError(405, f"Method {request.method} is not allowed on /flush_cache.", code="method_not_allowed")
    refused = await request.app[CONTEXT].engine.flush_cache()
    if refused:
        raise APIError(400, f"The cache was not flushed: {refused}.", code="flush_refused")
    return web.Response(text="Cache flushed.\n")


async def metrics(request: web.Request) -> web.Response:
    body = request.app[CONTEXT].metrics.render()
    return web.Response(body=body, headers={"Content-Type": "text/plain; version=0.0.4; charset=utf-8"})
