"""OpenAI-style errors: `{"error": {"message", "type", "param", "code"}}` with an HTTP status.

Handlers raise `APIError`; `error_middleware` turns it (and aiohttp's own HTTP
errors, and anything unexpected) into that body, so no caller ever sees an
aiohttp HTML page or a bare 500.
"""
from __future__ import annotations

import logging
import re

import msgspec
from aiohttp import web

from server.engine_client import EngineDead, EngineFailed, EngineRejected

log = logging.getLogger("tandem.http")

_AT_PATH = re.compile(r" - at `\$\.?(?P<path>[^`]*)`$")
_MISSING = re.compile(r"missing required field `(?P<field>[^`]+)`")
_UNKNOWN = re.compile(r"unknown field `(?P<field>[^`]+)`")


class APIError(Exception):
    """An error answered to the client as an OpenAI error body."""

    def __init__(self, status: int, message: str, *, type: str | None = None,
                 param: str | None = None, code: str | None = None):
        super().__init__(message)
        self.status, self.message, self.param, self.code = status, message, param, code
        self.type = type or default_type(status)

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}

    def response(self) -> web.Response:
        return web.json_response(self.body(), status=self.status)


def default_type(status: int) -> str:
    if status == 401:
        return "authentication_error"
    if status == 404:
        return "not_found_error"
    if status == 503:
        return "service_unavailable"
    return "server_error" if status >= 500 else "invalid_request_error"


def bad_request(message: str, param: str | None = None, code: str | None = None) -> APIError:
    return APIError(400, message, param=param, code=code)


def from_validation_error(exc: msgspec.ValidationError) -> APIError:
    """msgspec's message already names the field (`... - at `$.messages[0].role``); lift it into `param`."""
    text = str(exc)
    at = _AT_PATH.search(text)
    path = at.group("path") if at else ""
    unknown = _UNKNOWN.search(text)
    if unknown:
        name = f"{path}.{unknown.group('field')}" if path else unknown.group("field")
        return bad_request(f"`{name}` is not a parameter this server knows; remove it.", param=name,
                           code="unsupported_parameter")
    missing = _MISSING.search(text)
    if missing:
        path = f"{path}.{missing.group('field')}" if path else missing.group("field")
    message = text if not path else f"Invalid value for `{path}`: {text}"
    return bad_request(message, param=path or None, code="invalid_type")


def from_engine_error(exc: Exception) -> APIError:
    """EngineRejected keeps its status (503 for overload); EngineDead is a 503 as well."""
    if isinstance(exc, EngineRejected):
        code = "overloaded" if exc.status == 503 else "engine_rejected"
        return APIError(exc.status, str(exc) or "The engine rejected the request.", code=code)
    if isinstance(exc, EngineDead):
        return APIError(503, f"The engine is unavailable: {exc}" if str(exc) else "The engine is unavailable.",
                        code="engine_dead")
    if isinstance(exc, EngineFailed):
        return APIError(500, f"The engine failed while running this request: {exc}", code="engine_error")
    raise TypeError(f"not an engine error: {exc!r}")


ENGINE_ERRORS = (EngineRejected, EngineDead, EngineFailed)


@web.middleware
async def error_middleware(request: web.Request, handler):
    """Every error leaves as an OpenAI-style body; unexpected exceptions are logged and become a 500."""
    try:
        return await handler(request)
    except APIError as err:
        return err.response()
    except ENGINE_ERRORS as exc:
        return from_engine_error(exc).response()
    except web.HTTPException as exc:
        if exc.status < 400:
            raise
        return APIError(exc.status, exc.reason or "HTTP error", code=str(exc.status)).response()
    except Exception:
        log.exception("unhandled error in %s %s", request.method, request.path)
        return APIError(500, "Internal server error.", code="internal_error").response()
