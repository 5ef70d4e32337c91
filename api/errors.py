"""Every failure a client sees is an OpenAI error body: {"error": {"message", "type", "param", "code"}}."""

from __future__ import annotations

import logging

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

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


def from_input_error(exc: InputError) -> APIError:
    return APIError(400, str(exc), param=exc.param, code=exc.code)


def _loc(loc: tuple) -> str:
    # FastAPI prefixes the source ("body", "query"); the OpenAI param is the field path inside it.
    parts = [str(p) for p in loc[1:]] if loc and loc[0] in ("body", "query", "header", "path") else list(loc)
    return ".".join(parts)


def from_validation_error(exc: RequestValidationError) -> APIError:
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


def install_error_handlers(app: FastAPI, on_error=None) -> None:
    """Map every exception to the OpenAI body; ``on_error(request, status)`` observes each error answered."""

    def answer(request: Request, err: APIError) -> JSONResponse:
        if on_error is not None:
            on_error(request, err.status)
        return err.response()

    @app.exception_handler(APIError)
    async def _api_error(request: Request, exc: APIError) -> JSONResponse:
        return answer(request, exc)

    @app.exception_handler(InputError)
    async def _input_error(request: Request, exc: InputError) -> JSONResponse:
        return answer(request, from_input_error(exc))

    @app.exception_handler(RequestValidationError)
    async def _validation_error(request: Request, exc: RequestValidationError) -> JSONResponse:
        return answer(request, from_validation_error(exc))

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        code = {404: "not_found", 405: "method_not_allowed", 413: "request_too_large"}.get(exc.status_code)
        return answer(request, APIError(exc.status_code, str(exc.detail), code=code, headers=exc.headers))

    @app.exception_handler(Exception)
    async def _unexpected(request: Request, exc: Exception) -> JSONResponse:
        log.exception("unhandled error on %s %s", request.method, request.url.path)
        return answer(request, APIError(500, "internal server error", code="internal_error"))
