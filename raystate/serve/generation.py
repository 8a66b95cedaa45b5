"""One request's run through a `Client`, as the OpenAI server sees it.

`Generation` turns the request's `RequestUpdate`s into text deltas (through the model's text stream:
`TextStream` or `HFTextStream`, which apply stop strings), records time to first token and inter-token
gaps, and guarantees the request ends: unless the backend finished it, closing the generation aborts it,
so its KV blocks go back to the pool at once (a client that disconnected, a stop string matched).
`EventStream` ties a streamed response to its generation so that closing the stream always closes the
request too.
"""

from __future__ import annotations

import asyncio
import contextlib
import contextvars
import logging
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any, NamedTuple

from raystate.client import Client
from raystate.errors import EngineDead, RequestFailed
from raystate.messages import RequestUpdate, SamplingParams
from raystate.serve.detokenize import TextStream
from raystate.serve.metrics import ServeMetrics
from raystate.serve.protocol import PromptTokensDetails, Usage

logger = logging.getLogger(__name__)


@dataclass
class Prepared:
    """A validated request, ready for `Client.generate`."""

    request_id: str
    endpoint: str
    prompt_ids: list[int]
    sampling: SamplingParams
    stop: list[str] | None
    return_token_ids: bool
    include_usage: bool
    created: int = field(default_factory=lambda: int(time.time()))
    # completions `echo`: the prompt's text, sent before the output (None: no echo); `prompt_only`:
    # max_tokens 0 with echo, run for one token that is dropped
    echo_text: str | None = None
    prompt_only: bool = False


class Delta(NamedTuple):
    text: str
    token_ids: list[int]
    finish_reason: str | None  # set on the last delta only
    logprobs: bytes = b""  # records of token_ids (raystate.messages.pack_logprobs), when asked for
    prompt_logprobs: bytes = b""  # prompt tokens 1.. (on the first delta with a token), when asked for


class Generation:
    """One request's run through the client: deltas out, metrics in, abort on early exit."""

    def __init__(
        self, client: Client, prep: Prepared, metrics: ServeMetrics, aborts: set, text: Any = None
    ) -> None:
        """`text`: the request's text stream (`push(ids, final) -> delta`, `text`, `stopped`), e.g.
        `ModelText.text_stream(prep.stop)`; default: the byte model's `TextStream`."""
        self._client = client
        self._prep = prep
        self._metrics = metrics
        self._aborts = aborts  # strong references to detached abort tasks
        self._t0 = time.perf_counter()
        self._last_token_t: float | None = None
        self._updates = client.generate(prep.prompt_ids, prep.sampling, prep.request_id)
        self._first: RequestUpdate | None = None
        self._text = text if text is not None else TextStream(prep.stop)
        self._done = False  # the backend finished the request (nothing to abort)
        self._closed = False
        self.token_ids: list[int] = []
        self.logprobs = bytearray()  # records of token_ids, when the request asks for them
        self.prompt_logprobs = b""
        self.finish_reason: str | None = None
        self.num_cached_tokens = 0
        self.replay_start = 0
        metrics.in_flight.inc()

    async def start(self) -> None:
        """Waits for the first update, so that a request the backend refuses fails before any response."""
        try:
            self._first = await anext(self._updates)
        except BaseException:
            await self.close()
            raise

    async def deltas(self) -> AsyncIterator[Delta]:
        """One delta per update (its text may be "" while a character or a stop string is incomplete)."""
        try:
            update = self._first
            while update is not None:
                delta = self._consume(update)
                yield delta
                if delta.finish_reason is not None:
                    return
                update = await anext(self._updates, None)
            raise EngineDead(f"request {self._prep.request_id}: updates ended before it finished")
        finally:
            await self.close()

    def _consume(self, update: RequestUpdate) -> Delta:
        now = time.perf_counter()
        new = list(update.new_token_ids)
        if new:
            if self._last_token_t is None:
                self._metrics.ttft.observe(now - self._t0)
            else:
                gap = (now - self._last_token_t) / len(new)
                for _ in new:
                    self._metrics.inter_token.observe(gap)
            self._last_token_t = now
        self.token_ids.extend(new)
        self.logprobs += update.logprobs
        if update.prompt_logprobs:
            self.prompt_logprobs = update.prompt_logprobs
        self.num_cached_tokens = update.num_cached_tokens
        self.replay_start = update.replay_start
        if update.finish_reason == "error":  # this request alone failed; the metrics count it
            self.finish_reason = "error"
            self._done = True
            raise RequestFailed(update.error or "the request failed")
        text = self._text.push(new, final=update.finished)
        if self._text.stopped:
            self.finish_reason = "stop"
        elif update.finished:
            self.finish_reason = update.finish_reason or "stop"
            self._done = True
        return Delta(text, new, self.finish_reason, update.logprobs, update.prompt_logprobs)

    @property
    def text(self) -> str:
        return self._text.text

    def usage(self) -> Usage:
        n_prompt, n_out = len(self._prep.prompt_ids), len(self.token_ids)
        if self._prep.prompt_only:
            n_out = 0
        replayed = self.num_cached_tokens - self.replay_start if self.replay_start else 0
        return Usage(
            prompt_tokens=n_prompt,
            completion_tokens=n_out,
            total_tokens=n_prompt + n_out,
            prompt_tokens_details=PromptTokensDetails(
                cached_tokens=self.num_cached_tokens, replayed_tokens=replayed
            ),
        )

    def _abort_detached(self) -> None:
        """Aborts the request from a task of its own, in a fresh context.

        The caller is often being cancelled (a client that disconnected): an abort awaited here would be
        cancelled with it, and Ray Serve cancels, with a request, the Ray calls made in its context, which
        an empty `contextvars.Context` keeps the abort out of.
        """
        aborts = self._aborts

        def done(task: asyncio.Task) -> None:
            aborts.discard(task)
            if not task.cancelled() and task.exception() is not None:
                logger.warning("abort of %s failed: %r", self._prep.request_id, task.exception())

        loop = asyncio.get_running_loop()
        task = loop.create_task(self._client.abort(self._prep.request_id), context=contextvars.Context())
        aborts.add(task)
        task.add_done_callback(done)

    async def close(self) -> None:
        """Ends the request; unless the backend finished it, it is aborted (`_abort_detached`)."""
        if self._closed:
            return
        self._closed = True
        m = self._metrics
        m.in_flight.dec()
        if not self._done:
            self._abort_detached()
        if self.finish_reason is not None:
            m.requests.labels(self._prep.endpoint, self.finish_reason).inc()
            m.prompt_tokens.inc(len(self._prep.prompt_ids))
            m.cached_tokens.inc(self.num_cached_tokens)
            m.e2e.observe(time.perf_counter() - self._t0)
        m.generation_tokens.inc(len(self.token_ids))
        with contextlib.suppress(RuntimeError):  # still running in a task being cancelled: it ends itself
            await self._updates.aclose()


class EventStream:
    """The server-sent events of one streamed request.

    `aclose()` ends the request even when iteration never began (a client that went away before the
    first chunk) or stopped at a `yield` (cancelled while a chunk was being sent), the two cases where
    closing the event generator alone would not reach the request.
    """

    def __init__(self, events: AsyncIterator[str], generation: Generation) -> None:
        self._events = events
        self._generation = generation

    def __aiter__(self) -> AsyncIterator[str]:
        return self._events

    async def aclose(self) -> None:
        try:
            await self._events.aclose()
        finally:
            await self._generation.close()
