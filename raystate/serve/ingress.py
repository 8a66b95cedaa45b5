"""HTTP routes of the OpenAI-compatible API over a `RaystateServer` (FastAPI).

The request body is read and validated here rather than by FastAPI's own parameter binding, so that every
failure has OpenAI's error shape: a 400 whose `error.param` names the field (FastAPI would answer 422 with
its own layout), a 413 past the body size limit, a 401 without the API key. The API key guard is a plain
ASGI middleware: it covers every route (unknown ones included) except /health, and does not sit between a
stream and its client the way Starlette's BaseHTTPMiddleware would.

Routes: POST /v1/completions, POST /v1/chat/completions, GET /v1/models, GET /health (a real one-token
step), GET /metrics (Prometheus), GET /status (raystate extension: the backend's `Client.status()`).
"""

from __future__ import annotations

import hmac
import json
import logging
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from pydantic import BaseModel, ValidationError
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.types import ASGIApp, Receive, Scope, Send

from raystate.errors import EngineDead, InvalidRequest
from raystate.serve.generation import EventStream
from raystate.serve.metrics import CONTENT_TYPE, ServeMetrics
from raystate.serve.protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    dump_response,
    error_body,
    first_error,
)
from raystate.serve.server import RaystateServer

logger = logging.getLogger(__name__)

DEFAULT_MAX_BODY_BYTES = 1 << 20
OPEN_PATHS = frozenset({"/health"})
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


class APIKeyMiddleware:
    """Answers 401 unless `Authorization: Bearer <key>` matches, on every path but OPEN_PATHS."""

    def __init__(self, app: ASGIApp, api_key: str, metrics: ServeMetrics) -> None:
        self.app = app
        self._key = api_key.encode()
        self._metrics = metrics

    def _authorized(self, scope: Scope) -> bool:
        for name, value in scope.get("headers", []):
            if name == b"authorization":
                scheme, _, token = value.partition(b" ")
                return scheme.lower() == b"bearer" and hmac.compare_digest(token.strip(), self._key)
        return False

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http" and _route_path(scope) not in OPEN_PATHS and not self._authorized(scope):
            self._metrics.errors.labels("401").inc()
            body = error_body("invalid or missing API key", "invalid_request_error", None, "invalid_api_key")
            await JSONResponse(body, 401, headers={"WWW-Authenticate": "Bearer"})(scope, receive, send)
            return
        await self.app(scope, receive, send)


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
        data = json.loads(body)
    except ValueError as e:
        raise APIError(400, f"request body is not valid JSON: {e}", "invalid_request_error") from None
    if not isinstance(data, dict):
        raise APIError(400, "request body must be a JSON object", "invalid_request_error")
    return data


def _parse(model: type[BaseModel], data: dict) -> Any:
    try:
        return model.model_validate(data)
    except ValidationError as e:
        param, message = first_error(e)
        raise APIError(400, message, "invalid_request_error", param) from None


def _respond(result: BaseModel | EventStream, keep_token_ids: bool) -> Response:
    if isinstance(result, EventStream):
        return SSEResponse(result, media_type="text/event-stream", headers=SSE_HEADERS)
    return JSONResponse(dump_response(result, keep_token_ids))


def create_api(
    server: RaystateServer, api_key: str | None = None, max_body_bytes: int = DEFAULT_MAX_BODY_BYTES
) -> FastAPI:
    """The ASGI app. `api_key` None (or "") leaves every route open."""
    api = FastAPI(title="raystate", docs_url=None, redoc_url=None, openapi_url=None)
    metrics = server.metrics
    if api_key:
        api.add_middleware(APIKeyMiddleware, api_key=api_key, metrics=metrics)

    def _error(status: int, body: dict) -> JSONResponse:
        metrics.errors.labels(str(status)).inc()
        return JSONResponse(body, status)

    @api.exception_handler(APIError)
    async def _api_error(_: Request, exc: APIError) -> JSONResponse:
        return _error(exc.status, exc.body)

    @api.exception_handler(InvalidRequest)
    async def _invalid(_: Request, exc: InvalidRequest) -> JSONResponse:
        return _error(400, error_body(str(exc), "invalid_request_error", exc.field))

    @api.exception_handler(EngineDead)
    async def _dead(_: Request, exc: EngineDead) -> JSONResponse:
        return _error(503, error_body(f"the engine is not available: {exc}", "service_unavailable"))

    @api.exception_handler(StarletteHTTPException)
    async def _http(_: Request, exc: StarletteHTTPException) -> JSONResponse:
        return _error(exc.status_code, error_body(str(exc.detail), "invalid_request_error"))

    @api.exception_handler(Exception)
    async def _internal(_: Request, exc: Exception) -> JSONResponse:
        logger.exception("internal error")
        return _error(500, error_body(f"internal error: {type(exc).__name__}", "internal_error"))

    @api.post("/v1/completions")
    async def completions(request: Request) -> Response:
        req = _parse(CompletionRequest, await _read_json(request, max_body_bytes))
        return _respond(await server.completion(req), bool(req.return_token_ids))

    @api.post("/v1/chat/completions")
    async def chat_completions(request: Request) -> Response:
        req = _parse(ChatCompletionRequest, await _read_json(request, max_body_bytes))
        return _respond(await server.chat(req), bool(req.return_token_ids))

    @api.get("/v1/models")
    async def models() -> JSONResponse:
        return JSONResponse(server.models().model_dump())

    @api.get("/v1/models/{model_id}")
    async def model(model_id: str) -> JSONResponse:
        for card in server.models().data:
            if card.id == model_id:
                return JSONResponse(card.model_dump())
        raise APIError(
            404, f"model {model_id!r} not found", "invalid_request_error", "model", "model_not_found"
        )

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
