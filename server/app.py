"""The aiohttp application: routes, API-key check, error handling, request accounting.

    create_app(args, engine, tokenizer, context_length) -> web.Application

Generation handlers run under `generation_endpoint`, which races them against a
client disconnect (cancelling them aborts their engine requests) and records
each request's outcome in the metrics exactly once.
"""
from __future__ import annotations

import asyncio
import hmac
import logging
import time
from typing import TYPE_CHECKING

from aiohttp import web

from engine.args import ServerArgs
from server.detokenizer import TokenTexts
from server.engine_client import EngineClient
from server.errors import APIError, error_middleware
from server.generate_api import generate
from server.metrics import Metrics
from server.openai_api import chat_completions, completions
from server.streaming import CONTEXT, ClientGone, FrontContext, json_response, outcome_of, race_disconnect

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

log = logging.getLogger("tandem.http")

OPEN_PATHS = frozenset({"/health", "/metrics"})
MAX_BODY_BYTES = 64 * 1024 * 1024
CLIENT_CLOSED_STATUS = 499


def create_app(args: ServerArgs, engine: EngineClient, tokenizer: PreTrainedTokenizerBase,
               context_length: int) -> web.Application:
    """The HTTP front of `engine`; `context_length` bounds prompt + output tokens."""
    app = web.Application(middlewares=[error_middleware, api_key_middleware(args.api_key)],
                          client_max_size=MAX_BODY_BYTES)
    app[CONTEXT] = FrontContext(args=args, engine=engine, tokenizer=tokenizer, context_length=context_length,
                                metrics=Metrics(engine), model_name=args.model_name, vocab_size=len(tokenizer),
                                token_texts=TokenTexts(tokenizer))
    app.router.add_post("/v1/completions", generation_endpoint(completions))
    app.router.add_post("/v1/chat/completions", generation_endpoint(chat_completions))
    app.router.add_post("/generate", generation_endpoint(generate))
    app.router.add_get("/v1/models", list_models)
    app.router.add_get("/health", health)
    app.router.add_get("/metrics", metrics)
    return app


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


async def metrics(request: web.Request) -> web.Response:
    body = request.app[CONTEXT].metrics.render()
    return web.Response(body=body, headers={"Content-Type": "text/plain; version=0.0.4; charset=utf-8"})
