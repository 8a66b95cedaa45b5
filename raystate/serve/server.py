"""RaystateServer: the OpenAI endpoints as plain async methods around an injected `Client`.

No HTTP and no Ray Serve here (ingress.py maps routes onto these methods; app.py makes the deployment), so
the same server runs over the Ray backend in a Serve replica, over `LocalClient` in a test, or behind any
other front end. It turns OpenAI requests into token ids and `SamplingParams`, streams `RequestUpdate`s
back as text, and records latency metrics.

Every request is validated before anything is queued: field errors raise `InvalidRequest` named after the
OpenAI field (`prompt`, `messages[0].role`, `max_tokens`), never after an internal one. A request whose
consumer goes away (a disconnected stream, a matched stop string) is aborted at once, so its KV blocks go
back to the pool without waiting for max_tokens.
"""

from __future__ import annotations

import asyncio
import json
import uuid
from collections.abc import AsyncIterator
from typing import Any

from pydantic import BaseModel

from raystate.client import Client
from raystate.errors import EngineDead, InvalidRequest
from raystate.messages import SamplingParams
from raystate.serve.generation import EventStream, Generation, Prepared
from raystate.serve.metrics import ServeMetrics
from raystate.serve.protocol import (
    AssistantMessage,
    ChatChoice,
    ChatChunkChoice,
    ChatCompletionChunk,
    ChatCompletionRequest,
    ChatCompletionResponse,
    ChatDelta,
    CompletionChoice,
    CompletionChunk,
    CompletionRequest,
    CompletionResponse,
    ModelCard,
    ModelList,
    dump_response,
    error_body,
)
from raystate.tokenizer import ByteTokenizer

HEALTH_TIMEOUT_S = 60.0


def _sse(payload: BaseModel, keep_token_ids: bool) -> str:
    data = dump_response(payload, keep_token_ids)
    return f"data: {json.dumps(data, ensure_ascii=False, separators=(',', ':'))}\n\n"


SSE_DONE = "data: [DONE]\n\n"


def _stream_error(exc: BaseException) -> str:
    if isinstance(exc, InvalidRequest):
        body = error_body(str(exc), "invalid_request_error", exc.field)
    else:
        body = error_body(f"generation failed: {type(exc).__name__}", "internal_error")
    return f"data: {json.dumps(body)}\n\n"


class RaystateServer:
    """The OpenAI endpoints over one `Client`. Methods return response models, or for `stream=True` an
    `EventStream` of server-sent-event strings (`data: {...}\\n\\n`, ending with `data: [DONE]`) that the
    caller must `aclose()` when done with it."""

    def __init__(
        self, client: Client, model_name: str | None = None, metrics: ServeMetrics | None = None
    ) -> None:
        self.client = client
        config = client.config
        self.model_name = model_name or config.model.name
        self.vocab_size = config.model.vocab_size
        self.max_model_len = config.max_model_len
        self.tokenizer = ByteTokenizer()
        self.metrics = metrics or ServeMetrics()
        self._aborts: set[asyncio.Task] = set()

    # -- request preparation --------------------------------------------------------------------------

    def _check_model(self, model: str | None) -> None:
        if model not in (None, "", self.model_name):
            raise InvalidRequest("model", f"'{self.model_name}' (see GET /v1/models)", model)

    def _sampling(
        self, req: CompletionRequest | ChatCompletionRequest, max_tokens: int | None, n_prompt: int
    ) -> SamplingParams:
        """OpenAI's defaults where a field is absent (temperature 1, top_p 1; max_tokens: what fits)."""
        top_k = req.top_k or 0
        params = SamplingParams(
            max_tokens=max_tokens if max_tokens is not None else max(1, self.max_model_len - n_prompt),
            temperature=1.0 if req.temperature is None else req.temperature,
            top_p=1.0 if req.top_p is None else req.top_p,
            top_k=0 if top_k == -1 else top_k,
            seed=req.seed,
            stop_token_ids=list(req.stop_token_ids or []),
            ignore_eos=bool(req.ignore_eos),
        )
        params.validate(self.vocab_size)
        if n_prompt + params.max_tokens > self.max_model_len:
            room = self.max_model_len - n_prompt
            limit = f"<= {room} (max_model_len={self.max_model_len}; the prompt has {n_prompt} tokens)"
            raise InvalidRequest("max_tokens", limit, params.max_tokens)
        return params

    def _prepare_completion(self, req: CompletionRequest) -> Prepared:
        self._check_model(req.model)
        if isinstance(req.prompt, str):
            ids = self.tokenizer.encode(req.prompt, add_bos=True)
        else:
            ids = list(req.prompt)
            bad = [t for t in ids if not 0 <= t < self.vocab_size]
            if bad:
                raise InvalidRequest("prompt", f"token ids in [0, {self.vocab_size})", bad[0])
        if len(ids) >= self.max_model_len:
            raise InvalidRequest(
                "prompt", f"shorter than max_model_len={self.max_model_len} tokens", len(ids)
            )
        return Prepared(
            request_id=f"cmpl-{uuid.uuid4().hex}",
            endpoint="completions",
            prompt_ids=ids,
            sampling=self._sampling(req, req.max_tokens, len(ids)),
            stop=req.stop,
            return_token_ids=bool(req.return_token_ids),
            include_usage=req.include_usage,
        )

    def _prepare_chat(self, req: ChatCompletionRequest) -> Prepared:
        self._check_model(req.model)
        messages = [m.model_dump(exclude_none=True) for m in req.messages]
        for m in messages:
            m.setdefault("content", None)
        text = self.tokenizer.apply_chat_template(messages, add_generation_prompt=True)
        ids = self.tokenizer.encode(text, add_bos=True)
        if len(ids) >= self.max_model_len:
            raise InvalidRequest(
                "messages", f"shorter than max_model_len={self.max_model_len} tokens", len(ids)
            )
        max_field = "max_completion_tokens" if req.max_completion_tokens is not None else "max_tokens"
        if req.max_tokens is not None and req.max_tokens != req.output_limit:
            raise InvalidRequest(
                "max_completion_tokens", f"equal to max_tokens={req.max_tokens}", req.output_limit
            )
        try:
            sampling = self._sampling(req, req.output_limit, len(ids))
        except InvalidRequest as e:
            if e.field != "max_tokens":
                raise
            raise InvalidRequest(max_field, e.limit, e.got) from None
        return Prepared(
            request_id=f"chatcmpl-{uuid.uuid4().hex}",
            endpoint="chat",
            prompt_ids=ids,
            sampling=sampling,
            stop=req.stop,
            return_token_ids=bool(req.return_token_ids),
            include_usage=req.include_usage,
        )

    async def _start(self, prep: Prepared) -> Generation:
        gen = Generation(self.client, prep, self.metrics, self._aborts)
        try:
            await gen.start()
        except InvalidRequest as e:  # the backend's own checks, renamed to the OpenAI field
            if e.field == "prompt_token_ids":
                raise InvalidRequest(
                    "prompt" if prep.endpoint == "completions" else "messages", e.limit, e.got
                ) from None
            raise
        return gen

    # -- endpoints ------------------------------------------------------------------------------------

    async def completion(self, req: CompletionRequest) -> CompletionResponse | EventStream:
        prep = self._prepare_completion(req)
        gen = await self._start(prep)
        if req.stream:
            return EventStream(self._stream_completion(gen, prep), gen)
        async for _ in gen.deltas():
            pass
        choice = CompletionChoice(
            text=gen.text,
            finish_reason=gen.finish_reason,
            token_ids=gen.token_ids if prep.return_token_ids else None,
        )
        return CompletionResponse(
            id=prep.request_id,
            created=prep.created,
            model=self.model_name,
            choices=[choice],
            usage=gen.usage(),
        )

    async def _stream_completion(self, gen: Generation, prep: Prepared) -> AsyncIterator[str]:
        head = dict(id=prep.request_id, created=prep.created, model=self.model_name)
        try:
            async for d in gen.deltas():
                choice = CompletionChoice(text=d.text, finish_reason=d.finish_reason, token_ids=d.token_ids)
                yield _sse(CompletionChunk(**head, choices=[choice]), prep.return_token_ids)
        except (InvalidRequest, EngineDead) as e:
            yield _stream_error(e)
            return
        if prep.include_usage:
            yield _sse(CompletionChunk(**head, choices=[], usage=gen.usage()), False)
        yield SSE_DONE

    async def chat(self, req: ChatCompletionRequest) -> ChatCompletionResponse | EventStream:
        prep = self._prepare_chat(req)
        gen = await self._start(prep)
        if req.stream:
            return EventStream(self._stream_chat(gen, prep), gen)
        async for _ in gen.deltas():
            pass
        choice = ChatChoice(
            message=AssistantMessage(content=gen.text),
            finish_reason=gen.finish_reason,
            token_ids=gen.token_ids if prep.return_token_ids else None,
        )
        return ChatCompletionResponse(
            id=prep.request_id,
            created=prep.created,
            model=self.model_name,
            choices=[choice],
            usage=gen.usage(),
        )

    async def _stream_chat(self, gen: Generation, prep: Prepared) -> AsyncIterator[str]:
        head = dict(id=prep.request_id, created=prep.created, model=self.model_name)
        keep_ids = prep.return_token_ids
        try:
            yield _sse(
                ChatCompletionChunk(
                    **head, choices=[ChatChunkChoice(delta=ChatDelta(role="assistant", content=""))]
                ),
                False,
            )
            async for d in gen.deltas():
                choice = ChatChunkChoice(
                    delta=ChatDelta(content=d.text), finish_reason=d.finish_reason, token_ids=d.token_ids
                )
                yield _sse(ChatCompletionChunk(**head, choices=[choice]), keep_ids)
        except (InvalidRequest, EngineDead) as e:
            yield _stream_error(e)
            return
        if prep.include_usage:
            yield _sse(ChatCompletionChunk(**head, choices=[], usage=gen.usage()), False)
        yield SSE_DONE

    def models(self) -> ModelList:
        return ModelList(data=[ModelCard(id=self.model_name, max_model_len=self.max_model_len)])

    async def health(self) -> bool:
        """A real one-token step through every shard (Client.health), bounded in time."""
        try:
            return bool(await asyncio.wait_for(self.client.health(), HEALTH_TIMEOUT_S))
        except (TimeoutError, EngineDead):
            return False

    async def status(self) -> dict[str, Any]:
        """`Client.status()`, plus the usable KV blocks per group and shard (block 0 is the null block)."""
        status = dict(await self.client.status())
        status.setdefault("num_blocks", self.client.config.num_blocks - 1)
        return status

    async def metrics_text(self) -> bytes:
        try:
            status = await asyncio.wait_for(self.client.status(), HEALTH_TIMEOUT_S)
        except Exception:  # the scrape still reports latencies, with raystate_backend_up 0
            status = None
        return self.metrics.render(status)

    async def shutdown(self) -> None:
        await self.client.shutdown()
