"""Every failure a client sees is an OpenAI error body: {"error": {"message", "type", "param", "code"}}."""

from __future__ import annotations

import logging
import math

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from pydantic import ValidationError
from starlette.exceptions import HTTPException as StarletteHTTPException

from api.async_engine import EngineDead, EngineFailure
from api.protocol import BodyErrors
from lm_engine.admission import EngineOverloaded
from lm_engine.outputs import RequestError
from lm_engine.processor import InputError

log = logging.getLogger("vlmserve.api")

# OpenAI's error types by status.
_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    413: "invalid_request_error",
    422: "invalid_request_error",
    429: "rate_limit_error",
}


class APIError(Exception):
    """A request that cannot be served, with the status and OpenAI error fields to answer it with."""

    def __init__(
        self,
        status: int,
        message: str,
        *,
        param: str | None = None,
        code: str | None = None,
        headers: dict[str, str] | None = None,
    ) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param
        self.code = code
        self.headers = headers

    def body(self) -> dict:
        kind = _TYPES.get(self.status, "server_error" if self.status >= 500 else "invalid_request_error")
        return {"error": {"message": self.message, "type": kind, "param": self.param, "code": self.code}}

    def response(self) -> JSONResponse:
        return JSONResponse(self.body(), status_code=self.status, headers=self.headers)


def _loc(loc: tuple) -> str:
    # FastAPI prefixes the source ("body", "query"); the OpenAI param is the field path inside it.
    parts = loc[1:] if loc and loc[0] in ("body", "query", "header", "path") else loc
    return ".".join(str(p) for p in parts)


def from_validation_error(exc: RequestValidationError | ValidationError | BodyErrors) -> APIError:
    errors = exc.errors()
    if not errors:
        return APIError(400, "invalid request body", code="invalid_request")
    first = errors[0]
    if first.get("type") == "json_invalid":
        detail = (first.get("ctx") or {}).get("error", "")
        return APIError(400, f"request body is not valid JSON: {detail}".rstrip(": "), code="json_invalid")
    param = _loc(tuple(first.get("loc", ())))
    msgs = [f"{_loc(tuple(e.get('loc', ()))) or 'body'}: {e.get('msg')}" for e in errors[:5]]
    more = f" (and {len(errors) - 5} more)" if len(errors) > 5 else ""
    return APIError(400, "; ".join(msgs) + more, param=param or None, code=first.get("type"))


def to_api_error(exc: BaseException | RequestError) -> APIError:
    """The one mapping from what went wrong to the status and OpenAI error body a client gets (with
    Retry-After where retrying helps); the server and ``vlmserve batch`` both answer with it."""
    if isinstance(exc, APIError):
        return exc
    if isinstance(exc, RequestError):  # a request the engine failed (a bad image, the encoder)
        retry = {"Retry-After": str(max(1, math.ceil(exc.retry_after_s)))} if exc.retry_after_s else None
        return APIError(exc.status, exc.message, param=exc.param, code=exc.code, headers=retry)
    if isinstance(exc, InputError):
        return APIError(400, str(exc), param=exc.param, code=exc.code)
    if isinstance(exc, (RequestValidationError, ValidationError)):  # the route's, or a batch line's
        return from_validation_error(exc)
    if isinstance(exc, EngineOverloaded):
        retry = str(max(1, math.ceil(exc.retry_after_s)))
        return APIError(503, str(exc), code="overloaded", headers={"Retry-After": retry})
    if isinstance(exc, EngineDead):
        return APIError(503, str(exc), code="engine_unavailable")
    if isinstance(exc, EngineFailure):
        return APIError(500, str(exc), code="engine_error")
    if isinstance(exc, StarletteHTTPException):
        code = {404: "not_found", 405: "method_not_allowed", 413: "request_too_large"}.get(exc.status_code)
        return APIError(exc.status_code, str(exc.detail), code=code, headers=exc.headers)
    log.error("unexpected error", exc_info=exc)
    return APIError(500, "internal server error", code="internal_error")


def install_error_handlers(app: FastAPI, on_error=None) -> None:
    """Every exception a route raises is answered through ``to_api_error``; ``on_error(request, status)``
    observes each error answered."""

    async def answer(request: Request, exc: Exception) -> JSONResponse:
        err = to_api_error(exc)
        if on_error is not None:
            on_error(request, err.status)
        return err.response()

    # NOTE: every expected kind by name. Starlette answers a bare ``Exception`` in its outermost middleware and
    # then re-raises it, so uvicorn logs a traceback and closes the keep-alive connection: a 503 under load
    # would cost a traceback in the log and a reconnect per refused request.
    expected = (APIError, InputError, RequestValidationError, ValidationError, StarletteHTTPException)
    for kind in (*expected, EngineOverloaded, EngineDead, EngineFailure, Exception):
        app.add_exception_handler(kind, answer)
