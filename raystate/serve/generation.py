"""One request's run through a `Client`, as the OpenAI server sees it.

A request of n choices (of each of its prompts) runs as n engine requests per prompt
(`raystate.fanout.child_requests`), all submitted in one `Client.generate_group` call so that a prompt's
later choices are forked from its first. `Generation` is one choice: it turns its engine request's
`RequestUpdate`s into text deltas (through the model's text stream: `TextStream` or `HFTextStream`, which
apply stop strings), records time to first token and inter-token gaps, and guarantees the engine request
ends: unless the backend finished it, closing the generation aborts it, so its KV blocks go back to the
pool at once (a client that disconnected, a stop string matched), also when its updates were never read.
`merged_deltas` interleaves the choices' deltas as they come; `EventStream` ties a streamed response to
its generations so that closing the stream always closes every choice too.
"""

from __future__ import annotations

import asyncio
import contextlib
import contextvars
import logging
import time
from collections.abc import AsyncIterator, Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, NamedTuple

from raystate.client import Client
from raystate.errors import EngineDead, RequestFailed
from raystate.fanout import ChildRequest, child_requests
from raystate.messages import RequestUpdate, SamplingParams
from raystate.serve.detokenize import TextStream
from raystate.serve.metrics import ServeMetrics
from raystate.serve.protocol import PromptTokensDetails, Usage

logger = logging.getLogger(__name__)


class PromptPart(NamedTuple):
    """One prompt of a request: its ids, its sampling (`n` choices of it) and, for a completion with
    `echo`, its text, sent before each choice's output (None: no echo)."""

    ids: list[int]
    sampling: SamplingParams
    echo_text: str | None = None


@dataclass
class Prepared:
    """A validated request, ready for `Client.generate_group`: one prompt (chat), or one or more
    (completions), each run for `n` choices; choice i of prompt p has index p * n + i in the response."""

    request_id: str
    endpoint: str
    prompts: list[PromptPart]
    stop: list[str] | None
    return_token_ids: bool
    include_usage: bool
    created: int = field(default_factory=lambda: int(time.time()))
    # max_tokens 0 with echo: each choice runs for one token that is dropped
    prompt_only: bool = False
    # the text ends after the stop string found, not before it (vLLM's include_stop_str_in_output); also
    # keeps the text of the token that ended the request (EOS or a stop_token_ids id)
    include_stop: bool = False
    # false: special tokens' text is written into the output (vLLM's skip_special_tokens)
    skip_special_tokens: bool = True
    # A chat with tools: makes each choice's `raystate.serve.tool_calls.ToolCallStream`, which turns its
    # text into content and tool calls; None: the text is the content.
    tool_stream: Callable[[], Any] | None = None
    # With a reasoning parser: makes each choice's `raystate.serve.reasoning.ThinkStream`, which splits its
    # text into reasoning and answer (the answer then goes to the tool stream, if any).
    reasoning_stream: Callable[[], Any] | None = None

    @property
    def prompt_ids(self) -> list[int]:
        """The first prompt's ids (the only prompt of a chat)."""
        return self.prompts[0].ids

    @property
    def sampling(self) -> SamplingParams:
        """The first prompt's sampling (the prompts' differ at most in max_tokens)."""
        return self.prompts[0].sampling

    @property
    def n(self) -> int:
        return self.sampling.n

    def child_requests(self) -> list[ChildRequest]:
        """The engine requests of every choice of every prompt, in index order (`ChildRequest.index`: the
        response's, p * n + i); their ids are the request's id (one prompt) or `{id}-{p}` (prompt p of
        several), `-{i}` added for n > 1."""
        n, out = self.n, []
        for p, part in enumerate(self.prompts):  # (the module's child_requests: the class is no scope)
            rid = self.request_id if len(self.prompts) == 1 else f"{self.request_id}-{p}"
            out += [c._replace(index=p * n + c.index) for c in child_requests(rid, part.ids, part.sampling)]
        return out


class Delta(NamedTuple):
    text: str
    token_ids: list[int]
    finish_reason: str | None  # set on the last delta only
    logprobs: bytes = b""  # records of token_ids (raystate.messages.pack_logprobs), when asked for
    prompt_logprobs: bytes = b""  # prompt tokens 1.. (on the first delta with a token), when asked for


class Generation:
    """One choice's run through the client: deltas out, metrics in, abort on early exit."""

    def __init__(
        self,
        client: Client,
        prep: Prepared,
        metrics: ServeMetrics,
        aborts: set,
        child: ChildRequest,
        updates: AsyncIterator[RequestUpdate],
        text: Any = None,
    ) -> None:
        """`child`: the choice's engine request (`Prepared.child_requests`: its index is the response's),
        already submitted (`Client.generate_group`), whose updates `updates` are: the generation owns them
        from here on (closing it ends the request, read or not). `text`: the choice's text stream
        (`push(ids, final) -> delta`, `text`, `stopped`), e.g. `ModelText.text_stream(prep.stop)`;
        default: the byte model's `TextStream`."""
        self._client = client
        self._prep = prep
        self._metrics = metrics
        self._aborts = aborts  # strong references to detached abort tasks
        self._t0 = time.perf_counter()
        self._last_token_t: float | None = None
        self.request_id = child.req_id  # the engine request's
        self.prompt_ids = child.prompt_token_ids
        self.index = child.index  # in the response: prompt_index * n + choice
        self.choice = child.index % prep.n  # among its prompt's n choices
        self._updates = updates
        self._first: RequestUpdate | None = None
        self._text = text if text is not None else TextStream(prep.stop, include_stop=prep.include_stop)
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
        """One delta per update, or per run of updates that queued up while the previous delta was being
        sent (the server fell behind): merged into one (`_consume`), so a reader behind by k steps pays
        for one chunk, not k. Its text may be "" while a character or a stop string is incomplete.

        Merging needs an update iterator that hands out what is queued without waiting
        (`drain_nowait`, as `raystate.client.UpdateStream`); over any other, one delta per update.
        When the reader keeps up there is nothing queued: no wait, no timer, one `drain_nowait` call."""
        drain = getattr(self._updates, "drain_nowait", None)
        held: RequestUpdate | None = None  # a drained update left for the next delta (an error's)
        try:
            update = self._first
            while update is not None:
                batch = [update]
                if drain is not None and not update.finished:
                    for u in drain():
                        if u.finish_reason == "error":  # a failed request's last update: alone, as ever
                            held = u
                        else:
                            batch.append(u)
                delta = self._consume(batch)
                yield delta
                if delta.finish_reason is not None:
                    return
                if held is not None:
                    update, held = held, None
                else:
                    update = await anext(self._updates, None)
            raise EngineDead(f"request {self.request_id}: updates ended before it finished")
        finally:
            await self.close()

    def _text_ids(self, update: RequestUpdate, ids: list[int] | None = None) -> list[int]:
        """The ids whose text the output carries: the update's (or `ids`, its merge with earlier ones),
        less the id that ended the request (EOS, or one of stop_token_ids: the engine's "stop"), as vLLM
        writes it, unless include_stop_str_in_output keeps it."""
        ids = list(update.new_token_ids) if ids is None else ids
        if update.finished and update.finish_reason == "stop" and ids and not self._prep.include_stop:
            return ids[:-1]
        return ids

    def _consume(self, updates: list[RequestUpdate]) -> Delta:
        """One update, or several of the request's in order (none but the first failed), as one delta:
        their token ids and logprob records concatenated (records of one request have one size), the
        prompt logprobs of the one that carries them, the finish of the last. Its text goes through the
        text stream once, but with stop strings update by update, so that the updates after the one
        that completes a stop string are dropped, as they would be unmerged."""
        update = updates[-1]
        if len(updates) > 1 and self._prep.stop:
            texts = []
            for i, u in enumerate(updates):
                texts.append(self._text.push(self._text_ids(u), final=u.finished))
                if self._text.stopped:
                    updates = updates[: i + 1]
                    break
            text: str | None = "".join(texts)
            update = updates[-1]
        else:
            text = None
        if len(updates) == 1:
            new = list(update.new_token_ids)
            logprobs, prompt_logprobs = update.logprobs, update.prompt_logprobs
        else:
            new = [t for u in updates for t in u.new_token_ids]
            logprobs = b"".join(u.logprobs for u in updates)
            prompt_logprobs = next((u.prompt_logprobs for u in updates if u.prompt_logprobs), b"")
        now = time.perf_counter()
        if new:
            # One inter-token gap per token after a request's first, however the tokens arrive: an
            # event's gap is shared by its tokens, and tokens that came with the first (a reader that fell
            # behind before the first delta) arrived 0 s after it.
            if self._last_token_t is None:
                self._metrics.ttft.observe(now - self._t0)
                gaps = [0.0] * (len(new) - 1)
            else:
                gaps = [(now - self._last_token_t) / len(new)] * len(new)
            for gap in gaps:
                self._metrics.inter_token.observe(gap)
            self._last_token_t = now
        self.token_ids.extend(new)
        self.logprobs += logprobs
        if prompt_logprobs:
            self.prompt_logprobs = prompt_logprobs
        self.num_cached_tokens = update.num_cached_tokens
        self.replay_start = update.replay_start
        if update.finish_reason == "error":  # this request alone failed; the metrics count it
            self.finish_reason = "error"
            self._done = True
            raise RequestFailed(update.error or "the request failed")
        if text is None:
            text = self._text.push(self._text_ids(update, new), final=update.finished)
        if self._text.stopped:
            self.finish_reason = "stop"
        elif update.finished:
            self.finish_reason = update.finish_reason or "stop"
            self._done = True
        return Delta(text, new, self.finish_reason, logprobs, prompt_logprobs)

    @property
    def text(self) -> str:
        return self._text.text

    def usage(self) -> Usage:
        n_prompt, n_out = len(self.prompt_ids), len(self.token_ids)
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
                logger.warning("abort of %s failed: %r", self.request_id, task.exception())

        loop = asyncio.get_running_loop()
        task = loop.create_task(self._client.abort(self.request_id), context=contextvars.Context())
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
            m.prompt_tokens.inc(len(self.prompt_ids))
            m.cached_tokens.inc(self.num_cached_tokens)
            m.e2e.observe(time.perf_counter() - self._t0)
        m.generation_tokens.inc(len(self.token_ids))
        with contextlib.suppress(RuntimeError):  # still running in a task being cancelled: it ends itself
            await self._updates.aclose()


def total_usage(gens: Sequence[Generation]) -> Usage:
    """A request's usage over its choices: the completion tokens of every choice; the prompt tokens (and
    their cached and replayed parts) of each prompt once, from its first choice (as vLLM counts them)."""
    prompt = completion = cached = replayed = 0
    for g in gens:
        u = g.usage()
        completion += u.completion_tokens
        if g.choice == 0:
            prompt += u.prompt_tokens
            cached += u.prompt_tokens_details.cached_tokens
            replayed += u.prompt_tokens_details.replayed_tokens
    return Usage(
        prompt_tokens=prompt,
        completion_tokens=completion,
        total_tokens=prompt + completion,
        prompt_tokens_details=PromptTokensDetails(cached_tokens=cached, replayed_tokens=replayed),
    )


async def close_all(gens: Sequence[Generation]) -> None:
    """Closes every generation, even when closing one fails."""
    error: BaseException | None = None
    for g in gens:
        try:
            await g.close()
        except BaseException as e:  # re-raised once the others are closed
            error = error or e
    if error is not None:
        raise error


_ENDED = object()  # a choice's deltas ended (merged_deltas)


async def merged_deltas(gens: Sequence[Generation]) -> AsyncIterator[tuple[Generation, Delta]]:
    """Every generation's deltas as they come, as (generation, delta): a choice's in order, the choices
    interleaved. An error of one choice ends the whole (raised here); leaving early, or an error, closes
    every generation (the unfinished ones are aborted).

    One task per choice reads its deltas into a shared queue (a wait over every choice per delta would
    cost O(choices) per token)."""
    if len(gens) == 1:  # no task: the common case costs what it did before n > 1
        (g,) = gens
        deltas = g.deltas()
        try:
            async for d in deltas:
                yield g, d
        finally:
            try:
                await deltas.aclose()
            finally:
                await g.close()
        return
    queue: asyncio.Queue = asyncio.Queue()

    async def pump(g: Generation) -> None:
        try:
            async for d in g.deltas():
                queue.put_nowait((g, d))
        except Exception as e:  # handed to the reader, which raises it
            queue.put_nowait((g, e))
        else:
            queue.put_nowait((g, _ENDED))

    tasks = [asyncio.create_task(pump(g)) for g in gens]
    try:
        live = len(tasks)
        while live:
            g, item = await queue.get()
            if item is _ENDED:
                live -= 1
            elif isinstance(item, BaseException):
                raise item
            else:
                yield g, item
    finally:
        for t in tasks:
            t.cancel()
        try:
            await close_all(gens)  # abort now: the wait for the cancelled tasks may itself be cut
        finally:
            await asyncio.gather(*tasks, return_exceptions=True)


class EventStream:
    """The server-sent events of one streamed request.

    `aclose()` ends every choice of the request even when iteration never began (a client that went
    away before the first chunk) or stopped at a `yield` (cancelled while a chunk was being sent), the
    two cases where closing the event generator alone would not reach the engine requests.
    """

    def __init__(self, events: AsyncIterator[str], generations: Sequence[Generation]) -> None:
        self._events = events
        self._generations = list(generations)

    def __aiter__(self) -> AsyncIterator[str]:
        return self._events

    async def aclose(self) -> None:
        try:
            await self._events.aclose()
        finally:
            await close_all(self._generations)
