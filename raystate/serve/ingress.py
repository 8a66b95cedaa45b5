"""HTTP routes of the OpenAI-compatible API over a `RaystateServer` (FastAPI).

The request body is read and validated here rather than by FastAPI's own parameter binding, so that every
failure has OpenAI's error shape: a 400 whose `error.param` names the field (FastAPI would answer 422 with
its own layout), a 413 past the body size limit, a 401 without the API key. The API key guard is a plain
ASGI middleware: it covers every route (unknown ones included) except /health, and does not sit between a
stream and its client the way Starlette's BaseHTTPMiddleware would.

The other guards are plain ASGI middlewares too (see `create_api`): an optional Host allow-list (400) and
CORS policy, a 408 when the body does not arrive in time (slow clients), and a 503 once the server drains
for shutdown. The POST routes answer 415 unless the request declares `application/json` (which shuts out
cross-site form posts).
The request head's own deadline cannot live here (the ASGI app sees a request only once its head is
complete): see proxy_guard.py.

Routes: POST /v1/completions, POST /v1/chat/completions, POST /v1/responses (OpenAI's Responses API, as a
chat), GET /v1/models, POST /tokenize and POST /detokenize (vLLM's), GET /version, GET /health (a real
one-token step), GET /metrics (Prometheus, our series and vLLM's), GET /status (raystate extension: the
backend's `Client.status()`).

Unknown request fields are ignored with one warning per request naming them (as vLLM does); a `model`
this server does not serve is a 404 (`NotFoundError`, as vLLM answers it).
"""

from __future__ import annotations

import asyncio
import contextlib
import hmac
import logging
from collections.abc import Awaitable
from typing import Any, TypeVar

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from pydantic import BaseModel, ValidationError
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.middleware.cors import CORSMiddleware
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from raystate.errors import EngineDead, InvalidRequest, RequestFailed
from raystate.serve.generation import EventStream
from raystate.serve.metrics import CONTENT_TYPE, ServeMetrics
from raystate.serve.protocol import (
    BodyError,
    ChatCompletionRequest,
    CompletionRequest,
    DetokenizeRequest,
    TokenizeChatRequest,
    TokenizeCompletionRequest,
    dump_response,
    error_body,
    first_error,
    load_body,
)
from raystate.serve.responses import ResponsesRequest
from raystate.serve.server import ModelNotFound, RaystateServer, ServerShuttingDown

logger = logging.getLogger(__name__)
T = TypeVar("T")

DEFAULT_MAX_BODY_BYTES = 1 << 20
OPEN_PATHS = frozenset({"/health"})
DEFAULT_BODY_TIMEOUT_S = 10.0
DRAIN_OPEN_PATHS = frozenset({"/metrics"})  # still answered while the server drains
DEFAULT_CORS_METHODS = ("GET", "POST")
DEFAULT_CORS_HEADERS = ("Authorization", "Content-Type")
SSE_HEADERS = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}


class APIError(Exception):
    """An HTTP error with OpenAI's body; raised by the routes, rendered by one handler."""

    def __init__(
        self, status: int, message: str, type_: str, param: str | None = None, code: str | None = None
    ):
        super().__init__(message)
        self.status = status
        self.body = error_body(message, type_, param, code)


def _route_path(scope: Scope) -> str:
    """The path below the app's mount point (Serve mounts an app at its route_prefix via root_path)."""
    path, root = scope.get("path", ""), scope.get("root_path", "")
    if root and path.startswith(root):
        path = path[len(root) :]
    return path or "/"


class _Guard:
    """A plain ASGI middleware that checks HTTP requests (`guard`) and passes every other scope (lifespan)
    through untouched; `reject` answers in OpenAI's error shape, counted like the routes' own errors."""

    def __init__(self, app: ASGIApp, metrics: ServeMetrics) -> None:
        self.app = app
        self._metrics = metrics

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        await self.guard(scope, receive, send)

    async def guard(self, scope: Scope, receive: Receive, send: Send) -> None:
        raise NotImplementedError

    async def reject(
        self,
        scope: Scope,
        receive: Receive,
        send: Send,
        status: int,
        body: dict,
        headers: dict[str, str] | None = None,
    ) -> None:
        self._metrics.errors.labels(str(status)).inc()
        await JSONResponse(body, status, headers=headers)(scope, receive, send)


class APIKeyMiddleware(_Guard):
    """Answers 401 unless `Authorization: Bearer <key>` matches, on every path but OPEN_PATHS."""

    def __init__(self, app: ASGIApp, api_key: str, metrics: ServeMetrics) -> None:
        super().__init__(app, metrics)
        self._key = api_key.encode()

    def _authorized(self, scope: Scope) -> bool:
        for name, value in scope.get("headers", []):
            if name == b"authorization":
                scheme, _, token = value.partition(b" ")
                return scheme.lower() == b"bearer" and hmac.compare_digest(token.strip(), self._key)
        return False

    async def guard(self, scope: Scope, receive: Receive, send: Send) -> None:
        if _route_path(scope) not in OPEN_PATHS and not self._authorized(scope):
            body = error_body("invalid or missing API key", "invalid_request_error", None, "invalid_api_key")
            await self.reject(scope, receive, send, 401, body, {"WWW-Authenticate": "Bearer"})
            return
        await self.app(scope, receive, send)


def _host_name(value: str) -> str:
    """The host of a Host header, lower case and without its port ("[::1]:8000" -> "[::1]")."""
    value = value.strip().lower()
    if value.startswith("["):
        end = value.find("]")
        return value[: end + 1] if end > 0 else value
    return value.rsplit(":", 1)[0] if value.count(":") == 1 else value


class AllowedHostsMiddleware(_Guard):
    """Answers 400 unless the Host header names an allowed host: a name, `*.domain` (its subdomains) or
    `*` (any). A port in the header or in the list is ignored.

    Why: listening on 127.0.0.1 does not keep web pages out. Through DNS rebinding a page's own name is
    made to resolve to 127.0.0.1, and the browser then sends it requests that carry that name in Host;
    checking Host is what refuses them.
    """

    def __init__(self, app: ASGIApp, hosts: list[str], metrics: ServeMetrics) -> None:
        super().__init__(app, metrics)
        names = [_host_name(h) for h in hosts]
        self._any = "*" in names
        self._exact = frozenset(n for n in names if not n.startswith("*"))
        self._suffixes = tuple(n[1:] for n in names if n.startswith("*."))  # ".domain"

    def _allowed(self, scope: Scope) -> bool:
        if self._any:
            return True
        for name, value in scope.get("headers", []):
            if name == b"host":
                host = _host_name(value.decode("latin-1"))
                return host in self._exact or (bool(self._suffixes) and host.endswith(self._suffixes))
        return False  # no Host header (HTTP/1.0)

    async def guard(self, scope: Scope, receive: Receive, send: Send) -> None:
        if not self._allowed(scope):
            body = error_body(
                "the Host header names a host this server does not serve", "invalid_request_error"
            )
            await self.reject(scope, receive, send, 400, body)
            return
        await self.app(scope, receive, send)


class DrainMiddleware(_Guard):
    """Counts the requests in progress for `RaystateServer.drain`; while the server drains, answers new
    requests 503 (except on DRAIN_OPEN_PATHS, so that a scrape still sees the drain progress), and a
    request that the drain's cut ended before its response began (`ServerShuttingDown`) 503 too."""

    def __init__(self, app: ASGIApp, server: RaystateServer, metrics: ServeMetrics) -> None:
        super().__init__(app, metrics)
        self._server = server

    async def guard(self, scope: Scope, receive: Receive, send: Send) -> None:
        if self._server.draining and _route_path(scope) not in DRAIN_OPEN_PATHS:
            body = error_body(
                "the server is shutting down", "service_unavailable", None, "server_shutting_down"
            )
            await self.reject(scope, receive, send, 503, body)
            return
        started = False

        async def send_tracked(message: Message) -> None:
            nonlocal started
            started = started or message["type"] == "http.response.start"
            await send(message)

        with self._server.track_request():
            try:
                await self.app(scope, receive, send_tracked)
            except ServerShuttingDown as e:
                if started:
                    raise
                body = error_body(str(e), "service_unavailable", None, "server_shutting_down")
                await self.reject(scope, receive, send, 503, body)


class _BodyTimeout(Exception):
    """Raised into the app by BodyTimeoutMiddleware's `receive`; no route handles it."""


class BodyTimeoutMiddleware(_Guard):
    """Answers 408 (and closes the connection) when a request's body has not fully arrived `timeout_s`
    after the request reached the app.

    Why: a client that sends its body one byte per second would otherwise hold a request slot and a
    connection for as long as it likes. The bound is on the whole body, not on the gap between two
    chunks, since a trickle never leaves a long gap. Once the body is complete, `receive` is left alone:
    a streamed response waits on it for the client's disconnect for as long as the stream runs.
    """

    def __init__(self, app: ASGIApp, timeout_s: float, metrics: ServeMetrics) -> None:
        super().__init__(app, metrics)
        self._timeout_s = timeout_s

    async def guard(self, scope: Scope, receive: Receive, send: Send) -> None:
        deadline = asyncio.get_running_loop().time() + self._timeout_s
        body_done = False
        started = False

        async def timed_receive() -> Message:
            nonlocal body_done
            if body_done:
                return await receive()
            try:
                async with asyncio.timeout_at(deadline):
                    message = await receive()
            except TimeoutError:
                raise _BodyTimeout from None
            body_done = message["type"] != "http.request" or not message.get("more_body", False)
            return message

        async def send_tracked(message: Message) -> None:
            nonlocal started
            started = started or message["type"] == "http.response.start"
            await send(message)

        try:
            await self.app(scope, timed_receive, send_tracked)
        except _BodyTimeout:
            if started:
                raise
            body = error_body(
                f"the request body did not arrive within {self._timeout_s:g} s",
                "invalid_request_error",
                None,
                "request_timeout",
            )
            # The rest of the body is still on its way: the connection cannot carry another request.
            await self.reject(scope, receive, send, 408, body, {"Connection": "close"})


def _require_json(request: Request) -> None:
    """415 unless the request declares a JSON body (`application/json`, parameters allowed).

    Why, beyond naming the client's mistake: any web page can make a browser send a cross-site POST
    without asking first, as long as it looks like a form (text/plain, form encodings); a JSON POST from
    another origin needs a CORS preflight, which this server refuses unless CORS is configured.
    """
    value = request.headers.get("content-type")
    if (value or "").split(";", 1)[0].strip().lower() != "application/json":
        got = f"got {value!r}" if value else "none was given"
        raise APIError(
            415,
            f"the Content-Type header must be application/json ({got})",
            "invalid_request_error",
            None,
            "unsupported_media_type",
        )


class SSEResponse(StreamingResponse):
    """A StreamingResponse that always closes its EventStream, however the response ends: a client that
    disconnects cancels the response task, and the request behind the stream must be aborted then."""

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            await self.body_iterator.aclose()


async def _read_json(request: Request, limit: int) -> Any:
    length = request.headers.get("content-length")
    if length is not None:
        if not length.isdigit():
            raise APIError(400, "invalid Content-Length header", "invalid_request_error")
        if int(length) > limit:
            raise APIError(
                413, f"request body over {limit} bytes", "invalid_request_error", None, "request_too_large"
            )
    body = bytearray()
    async for chunk in request.stream():
        body += chunk
        if len(body) > limit:
            raise APIError(
                413, f"request body over {limit} bytes", "invalid_request_error", None, "request_too_large"
            )
    try:
        return load_body(bytes(body))
    except BodyError as e:
        raise APIError(400, str(e), "invalid_request_error", e.param) from None


def _parse(model: type[BaseModel], data: dict) -> Any:
    """The validated request; its unknown fields (ignored) named in one warning."""
    try:
        req = model.model_validate(data)
    except ValidationError as e:
        param, message = first_error(e)
        raise APIError(400, message, "invalid_request_error", param) from None
    ignored = req.ignored_fields()
    if ignored:
        logger.warning("The following fields were present in the request but ignored: %s", ", ".join(ignored))
    return req


class ClientGone(Exception):
    """The client disconnected before its whole answer was ready (the work behind it was cancelled)."""


async def _wait_disconnect(request: Request) -> None:
    """Returns once the client disconnects (the body has been read: `receive` has nothing else to give)."""
    while (await request.receive())["type"] != "http.disconnect":
        pass


async def _unless_gone(request: Request, work: Awaitable[T], stream: bool | None) -> T:
    """`work`'s result, unless the client disconnects first: then `work` is cancelled, which aborts the
    requests behind it at once (their KV blocks go back) instead of generating max_tokens, or a beam
    search, for nobody, and ClientGone is raised. A stream is not watched here: its response watches
    for the disconnect from its first event on (one reader of `receive` at a time).

    Why here: uvicorn (direct HTTP, `raystate serve`) does not cancel a route whose client left, and a
    client that times out and retries would pile its abandoned requests onto the engine."""
    if stream:
        return await work
    task = asyncio.ensure_future(work)
    gone = asyncio.ensure_future(_wait_disconnect(request))
    try:
        await asyncio.wait({task, gone}, return_when=asyncio.FIRST_COMPLETED)
    except BaseException:  # this handler is cancelled itself (Serve's proxy saw the client go)
        task.cancel()
        raise
    finally:
        gone.cancel()
    if task.done():
        return task.result()
    task.cancel()
    with contextlib.suppress(asyncio.CancelledError):
        await task
    raise ClientGone


def _respond(result: BaseModel | EventStream, keep_token_ids: bool) -> Response:
    if isinstance(result, EventStream):
        return SSEResponse(result, media_type="text/event-stream", headers=SSE_HEADERS)
    return JSONResponse(dump_response(result, keep_token_ids))


def create_api(
    server: RaystateServer,
    api_key: str | None = None,
    max_body_bytes: int = DEFAULT_MAX_BODY_BYTES,
    *,
    body_timeout_s: float = DEFAULT_BODY_TIMEOUT_S,
    allowed_hosts: list[str] | None = None,
    cors_allow_origins: list[str] | None = None,
    cors_allow_methods: list[str] | tuple[str, ...] = DEFAULT_CORS_METHODS,
    cors_allow_headers: list[str] | tuple[str, ...] = DEFAULT_CORS_HEADERS,
) -> FastAPI:
    """The ASGI app. `api_key` None (or "") leaves every route open; `allowed_hosts` None (or empty)
    accepts any Host header; `cors_allow_origins` None (or empty) sends no CORS headers, so browsers keep
    other origins' pages from reading responses (and from sending JSON POSTs, which need a preflight).

    Middlewares, outermost first: allowed hosts (400), CORS (answers preflights before the key check,
    which browsers send without credentials), drain (503 while shutting down), API key (401), body
    timeout (408).
    """
    api = FastAPI(title="raystate", docs_url=None, redoc_url=None, openapi_url=None)
    metrics = server.metrics
    # add_middleware puts each one outside those added before it.
    api.add_middleware(BodyTimeoutMiddleware, timeout_s=body_timeout_s, metrics=metrics)
    if api_key:
        api.add_middleware(APIKeyMiddleware, api_key=api_key, metrics=metrics)
    api.add_middleware(DrainMiddleware, server=server, metrics=metrics)
    if cors_allow_origins:
        api.add_middleware(
            CORSMiddleware,
            allow_origins=list(cors_allow_origins),
            allow_methods=list(cors_allow_methods),
            allow_headers=list(cors_allow_headers),
            max_age=600,
        )
    if allowed_hosts:
        api.add_middleware(AllowedHostsMiddleware, hosts=list(allowed_hosts), metrics=metrics)

    def _error(status: int, body: dict) -> JSONResponse:
        metrics.errors.labels(str(status)).inc()
        return JSONResponse(body, status)

    @api.exception_handler(APIError)
    async def _api_error(_: Request, exc: APIError) -> JSONResponse:
        return _error(exc.status, exc.body)

    @api.exception_handler(InvalidRequest)
    async def _invalid(_: Request, exc: InvalidRequest) -> JSONResponse:
        return _error(400, error_body(str(exc), "invalid_request_error", exc.field))

    @api.exception_handler(ModelNotFound)
    async def _no_model(_: Request, exc: ModelNotFound) -> JSONResponse:
        return _error(404, error_body(str(exc), "NotFoundError", "model", 404))

    @api.exception_handler(EngineDead)
    async def _dead(_: Request, exc: EngineDead) -> JSONResponse:
        # EngineDead may carry the scheduler actor's traceback: the log keeps it, the client gets a fixed
        # message (no traceback, no file paths in a response body).
        logger.warning("engine not available: %s", exc)
        return _error(503, error_body("the engine is not available", "service_unavailable"))

    @api.exception_handler(ClientGone)
    async def _gone(_: Request, exc: ClientGone) -> JSONResponse:
        # nobody reads this answer; 499 (nginx's "client closed request") counts it in the metrics
        return _error(499, error_body("the client closed the request", "client_closed_request"))

    @api.exception_handler(RequestFailed)
    async def _failed(_: Request, exc: RequestFailed) -> JSONResponse:
        logger.warning("request failed: %s", exc)
        return _error(500, error_body(f"the request failed: {exc}", "internal_error"))

    @api.exception_handler(StarletteHTTPException)
    async def _http(_: Request, exc: StarletteHTTPException) -> JSONResponse:
        return _error(exc.status_code, error_body(str(exc.detail), "invalid_request_error"))

    @api.exception_handler(Exception)
    async def _internal(_: Request, exc: Exception) -> JSONResponse:
        logger.exception("internal error")
        return _error(500, error_body(f"internal error: {type(exc).__name__}", "internal_error"))

    @api.post("/v1/completions")
    async def completions(request: Request) -> Response:
        _require_json(request)
        req = _parse(CompletionRequest, await _read_json(request, max_body_bytes))
        return _respond(
            await _unless_gone(request, server.completion(req), req.stream), bool(req.return_token_ids)
        )

    @api.post("/v1/chat/completions")
    async def chat_completions(request: Request) -> Response:
        _require_json(request)
        req = _parse(ChatCompletionRequest, await _read_json(request, max_body_bytes))
        return _respond(await _unless_gone(request, server.chat(req), req.stream), bool(req.return_token_ids))

    @api.post("/v1/responses")
    async def responses(request: Request) -> Response:
        _require_json(request)
        req = _parse(ResponsesRequest, await _read_json(request, max_body_bytes))
        result = await _unless_gone(request, server.responses(req), req.stream)
        if isinstance(result, EventStream):
            return SSEResponse(result, media_type="text/event-stream", headers=SSE_HEADERS)
        return JSONResponse(result)

    @api.get("/v1/models")
    async def models() -> JSONResponse:
        return JSONResponse(server.models().model_dump())

    @api.get("/v1/models/{model_id}")
    async def model(model_id: str) -> JSONResponse:
        for card in server.models().data:
            if card.id == model_id:
                return JSONResponse(card.model_dump())
        raise ModelNotFound(model_id, server.model_name)

    @api.post("/tokenize")
    async def tokenize(request: Request) -> JSONResponse:
        _require_json(request)
        data = await _read_json(request, max_body_bytes)
        kind = TokenizeChatRequest if "messages" in data else TokenizeCompletionRequest
        return JSONResponse(server.tokenize(_parse(kind, data)).model_dump())

    @api.post("/detokenize")
    async def detokenize(request: Request) -> JSONResponse:
        _require_json(request)
        req = _parse(DetokenizeRequest, await _read_json(request, max_body_bytes))
        return JSONResponse(server.detokenize(req).model_dump())

    @api.get("/version")
    async def version() -> JSONResponse:
        return JSONResponse(server.version().model_dump())

    @api.get("/health")
    async def health() -> JSONResponse:
        if await server.health():
            return JSONResponse({"status": "ok"})
        return _error(503, error_body("health check failed", "service_unavailable"))

    @api.get("/metrics")
    async def metrics_route() -> Response:
        return Response(await server.metrics_text(), media_type=CONTENT_TYPE)

    @api.get("/status")
    async def status() -> JSONResponse:
        return JSONResponse(await server.status())

    return api
