"""The FastAPI app: routes, auth, client-disconnect handling, lifespan; and the uvicorn runner."""

from __future__ import annotations

import asyncio
import hmac
import logging
import time
from concurrent.futures import ThreadPoolExecutor
from contextlib import asynccontextmanager, suppress
from typing import Annotated

from fastapi import APIRouter, Depends, FastAPI, Request, Response
from fastapi.responses import JSONResponse
from fastapi.security import HTTPAuthorizationCredentials, HTTPBearer
from pydantic import ValidationError
from pydantic.json_schema import models_json_schema
from starlette.exceptions import HTTPException as StarletteHTTPException

from api.async_engine import AsyncEngine
from api.chat import ChatService, visual_level_header
from api.config import ServerArgs
from api.errors import APIError, from_validation_error, install_error_handlers
from api.media import MediaFetcher
from api.metrics import ServerMetrics, StartupCollector
from api.protocol import (
    BodyErrors,
    ChatCompletion,
    ChatCompletionRequest,
    ErrorBody,
    ModelCard,
    ModelList,
    parse_large_request,
)
from api.replica import ReplicaHeader
from cache.metrics import EmbeddingCacheCollector
from encoder.metrics import VisionPathCollector
from lm_engine.engine import LLMEngine
from lm_engine.startup import StartupPhases

log = logging.getLogger("vlmserve.api")

CHAT_PATH = "/v1/chat/completions"
_BEARER = HTTPBearer(auto_error=False)
_ERRORS = {code: {"model": ErrorBody} for code in (400, 401, 404, 413, 500, 503)}


class _BodyLimit:
    """Requests over ``max_bytes`` get a 413 with the OpenAI error body: at once when Content-Length says
    so, else when the count of bytes read passes it (the route then fails with the 413)."""

    def __init__(self, app, max_bytes: int) -> None:
        self.app = app
        self.max_bytes = max_bytes

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        message = f"request body is larger than {self.max_bytes} bytes"
        declared = dict(scope["headers"]).get(b"content-length", b"")
        if declared.isdigit() and int(declared) > self.max_bytes:
            return await APIError(413, message, code="request_too_large").response()(scope, receive, send)
        total = 0

        async def counted():
            nonlocal total
            msg = await receive()
            total += len(msg.get("body", b""))
            if total > self.max_bytes:
                # NOTE: FastAPI re-raises Starlette HTTPExceptions from body reading; the handler answers it.
                raise StarletteHTTPException(413, message)
            return msg

        await self.app(scope, counted, send)


async def _until_disconnect(request: Request) -> None:
    # The body is already read, so the next ASGI message is the client hanging up.
    while (await request.receive())["type"] != "http.disconnect":
        pass


async def cancel_on_disconnect(request: Request, work):
    """Run ``work`` until it finishes or the client disconnects, which cancels it (and so aborts its engine
    request) and returns None. Starlette's StreamingResponse does the same for a stream once it started."""
    task = asyncio.ensure_future(work)
    watch = asyncio.ensure_future(_until_disconnect(request))
    try:
        await asyncio.wait({task, watch}, return_when=asyncio.FIRST_COMPLETED)
    except BaseException:
        task.cancel()
        raise
    finally:
        watch.cancel()
    if task.done():
        return task.result()
    task.cancel()
    with suppress(asyncio.CancelledError):
        await task
    return None


class _Server:
    """The app's parts: the engine on its thread, media fetching, metrics, the chat service; and its routes."""

    def __init__(self, args: ServerArgs, engine: LLMEngine) -> None:
        self.args = args
        self.engine = engine
        self.async_engine = AsyncEngine(engine)
        self.media = MediaFetcher(args.media)
        self.metrics = ServerMetrics(lambda: self.async_engine.stats)
        self.metrics.register(EmbeddingCacheCollector(engine.embedding_cache))  # its stats() is thread-safe
        self.metrics.register(VisionPathCollector(engine.vision, engine.preprocess_pool))
        self.metrics.register(StartupCollector(engine.startup_phases))
        self.executor = ThreadPoolExecutor(
            max_workers=args.preprocess_threads, thread_name_prefix="vlmserve-prompt"
        )
        self.chat = ChatService(args, self.async_engine, self.media, self.metrics, self.executor)
        self.created = int(time.time())

    @asynccontextmanager
    async def lifespan(self, app: FastAPI):
        self.async_engine.start()
        try:
            yield
        finally:
            await self.media.aclose()
            await asyncio.to_thread(self.async_engine.shutdown)
            self.executor.shutdown(wait=False, cancel_futures=True)

    def count_error(self, request: Request, status: int) -> None:
        if request.url.path == CHAT_PATH:
            self.metrics.count_error(status)

    def routes(self) -> APIRouter:
        router = APIRouter()
        auth = [Depends(self.check_key)]
        tenant_of = Depends(self.check_key)

        async def chat_completions(request: Request, response: Response, tenant: str | None = tenant_of):
            """Chat completion; with ``stream: true`` the response is ``text/event-stream`` chunks."""
            return await self.chat_completions(request, response, tenant)

        router.add_api_route(
            CHAT_PATH,
            chat_completions,
            methods=["POST"],
            response_model=ChatCompletion,
            response_model_exclude_unset=True,  # extension fields appear only when asked for
            responses=_ERRORS,
            openapi_extra=_CHAT_BODY,
        )
        router.add_api_route(
            "/v1/models", self.models, response_model=ModelList, responses=_ERRORS, dependencies=auth
        )
        router.add_api_route("/health", self.health, responses={503: {"model": ErrorBody}})
        metrics_auth = [] if self.args.metrics_public else auth
        router.add_api_route("/metrics", self.prometheus, response_class=Response, dependencies=metrics_auth)
        return router

    async def check_key(
        self, creds: Annotated[HTTPAuthorizationCredentials | None, Depends(_BEARER)]
    ) -> str | None:
        """The caller's tenant (None when no keys are configured); a 401 without a valid key."""
        keys = self.args.api_keys
        if not keys:
            return None
        given = creds.credentials.encode() if creds is not None else b""
        tenant = None
        for key, name in keys.items():  # NOTE: every key compared, in constant time each
            if hmac.compare_digest(given, key.encode()) and creds is not None:
                tenant = name
        if tenant is None:
            raise APIError(
                401, "invalid or missing API key (Authorization: Bearer ...)", code="invalid_api_key"
            )
        return tenant

    async def chat_body(self, request: Request) -> ChatCompletionRequest:
        """The request body, parsed and validated; a large one on a worker thread and in pieces, so that the
        event loop keeps answering (health checks, other clients' streams) while megabytes of JSON are parsed."""
        raw = await request.body()
        try:
            if len(raw) > self.args.parse_off_loop_bytes:
                return await asyncio.to_thread(parse_large_request, raw)
            return ChatCompletionRequest.model_validate_json(raw)
        except (ValidationError, BodyErrors) as exc:
            raise from_validation_error(exc) from None

    async def chat_completions(self, request: Request, response: Response, tenant: str | None):
        arrival = time.monotonic()
        body = await self.chat_body(request)
        # NOTE: the peer's address; uvicorn takes it from X-Forwarded-For only for --trusted-proxies.
        caller = request.client.host if request.client else ""
        work = self.chat.create(body, arrival, caller=caller, tenant=tenant)
        result = await cancel_on_disconnect(request, work)
        if result is None:
            self.metrics.count("aborted")
            return Response(status_code=499)  # nginx's "client closed request"; nobody reads it
        if isinstance(result, dict):
            response.headers.update(visual_level_header(result["usage"]["visual_levels"]))
        return result

    async def models(self) -> dict:
        card = {
            "created": self.created,
            "root": self.args.engine.model,
            "max_model_len": self.engine.max_model_len,
        }
        return {"object": "list", "data": [ModelCard(id=name, **card) for name in self.args.model_names]}

    async def health(self) -> JSONResponse:
        engine = self.async_engine
        if not engine.alive:
            why = f": {type(engine.error).__name__}: {engine.error}" if engine.error else ""
            raise APIError(503, f"the engine is not running{why}", code="engine_unavailable")
        return JSONResponse({"status": "ok"})

    async def prometheus(self) -> Response:
        data, content_type = self.metrics.render()
        return Response(data, media_type=content_type)


# The chat route parses its own body (see _Server.chat_body); this gives the schema its place in /openapi.json.
_CHAT_BODY = {
    "requestBody": {
        "required": True,
        "content": {"application/json": {"schema": {"$ref": "#/components/schemas/ChatCompletionRequest"}}},
    }
}


def _openapi_with_request_schema(app: FastAPI):
    """``app.openapi`` with ChatCompletionRequest (and what it refers to) among the component schemas."""
    plain = app.openapi

    def openapi() -> dict:
        if app.openapi_schema is None:
            schema = plain()
            _, defs = models_json_schema(
                [(ChatCompletionRequest, "validation")], ref_template="#/components/schemas/{model}"
            )
            schema.setdefault("components", {}).setdefault("schemas", {}).update(defs.get("$defs", {}))
            app.openapi_schema = schema
        return app.openapi_schema

    return openapi


def create_app(args: ServerArgs, engine: LLMEngine | None = None) -> FastAPI:
    """The server app; builds the engine from ``args.engine`` unless one is given."""
    server = _Server(args, engine or LLMEngine(args.engine))
    app = FastAPI(
        title="vlmserve",
        summary="OpenAI-compatible serving of vision-language models",
        version="0.1.0",
        lifespan=server.lifespan,
    )
    app.add_middleware(_BodyLimit, max_bytes=args.max_request_bytes)
    if args.replica_name:
        app.add_middleware(ReplicaHeader, name=args.replica_name)  # outermost: on every response
    app.state.engine = server.async_engine
    app.state.metrics = server.metrics  # app.state.metrics.register(collector) adds a stage's collector
    install_error_handlers(app, server.count_error)
    app.include_router(server.routes())
    app.openapi = _openapi_with_request_schema(app)
    return app


def run_server(args: ServerArgs, startup: StartupPhases | None = None) -> None:
    """Build the engine (``startup``: the phases timed before it) and serve until stopped."""
    import uvicorn

    from api.http_guard import guarded_protocol

    if not args.api_keys and args.host not in ("127.0.0.1", "::1", "localhost"):
        log.warning("listening on %s without --api-key: anyone who can reach it can use it", args.host)
    app = create_app(args, LLMEngine(args.engine, startup=startup))
    log.info("serving %s as %r on http://%s:%d", args.engine.model, args.model_names[0], args.host, args.port)
    uvicorn.run(
        app,
        host=args.host,
        port=args.port,
        log_level=args.log_level,
        timeout_graceful_shutdown=5,
        http=guarded_protocol(args.limits),
        # NOTE: X-Forwarded-For names the client only when a trusted balancer sent it; uvicorn's own default
        # trusts it from 127.0.0.1, where a balancer that passes a client's header through would let any
        # client pick its own address (its fair share, or a victim to get refused).
        proxy_headers=bool(args.trusted_proxies),
        forwarded_allow_ips=",".join(args.trusted_proxies) or None,
    )
