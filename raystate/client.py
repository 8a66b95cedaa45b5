"""The asynchronous client API every front end uses (Ray Serve ingress, CLI, Python programs).

`Client` is the contract: submit a request and iterate its `RequestUpdate`s as tokens arrive, abort,
check health with a real one-token step, read status, shut down. `InProcessClient` implements it over the
in-process engine (a background thread runs the step loop); the Ray backend's `raystate.cluster`
implements it over the scheduler actor. No torch here: the local engine is imported when started.
"""

from __future__ import annotations

import abc
import asyncio
import dataclasses
import itertools
import logging
import threading
from collections.abc import AsyncIterator, Callable
from typing import Any

from raystate.config import EngineConfig
from raystate.errors import EngineDead, InvalidRequest
from raystate.fanout import ChildRequest
from raystate.messages import RequestUpdate, SamplingParams

logger = logging.getLogger(__name__)
_ids = itertools.count()  # request ids of `Client.new_request_id`


class UpdateStream:
    """One request's updates out of the queue its sink fills: an async iterator (what `generate_group`
    returns), which also hands out, without waiting, what is already queued (`drain_nowait`).

    Like an async generator over the queue: an error item ends it (raised as `wrap_error(item)`), and once
    iteration began, its end (the last update, an error, a cancelled wait, `aclose`) calls
    `on_end(finished)` once, finished telling whether the request's last update was handed out."""

    __slots__ = ("_queue", "_on_end", "_wrap_error", "_started", "_finished", "_ended", "_error")

    def __init__(
        self,
        queue: asyncio.Queue,
        on_end: Callable[[bool], None],
        wrap_error: Callable[[BaseException], BaseException],
    ) -> None:
        self._queue = queue
        self._on_end = on_end
        self._wrap_error = wrap_error
        self._started = False
        self._finished = False  # the last update was handed out
        self._ended = False
        self._error: BaseException | None = None  # an error item `drain_nowait` took out of the queue

    def __aiter__(self) -> UpdateStream:
        return self

    async def __anext__(self) -> RequestUpdate:
        if self._ended or self._finished:
            self._end()
            raise StopAsyncIteration
        self._started = True
        item = self._error
        if item is None:
            try:
                item = await self._queue.get()
            except BaseException:  # cancelled: the caller went away
                self._end()
                raise
        if isinstance(item, BaseException):
            self._end()
            raise self._wrap_error(item) from item
        self._finished = item.finished
        return item

    def drain_nowait(self) -> list[RequestUpdate]:
        """The updates already queued, in order (up to the last one; empty when none is): what a reader
        that fell behind merges into one. An error item stays for the next `__anext__` to raise."""
        out: list[RequestUpdate] = []
        queue = self._queue
        if self._ended or self._finished or self._error is not None:
            return out
        while not queue.empty():
            item = queue.get_nowait()
            if isinstance(item, BaseException):
                self._error = item
                break
            out.append(item)
            if item.finished:
                self._finished = True
                break
        if out:
            self._started = True
        return out

    def _end(self) -> None:
        if not self._ended:
            self._ended = True
            if self._started:
                self._on_end(self._finished)

    async def aclose(self) -> None:
        self._end()


class Client(abc.ABC):
    """What a front end may rely on. Updates for one request arrive in order; the last has finished=True."""

    def new_request_id(self) -> str:
        """A request id unique within this client (for callers that give none)."""
        return f"{type(self).__name__.lower()}-{id(self):x}-{next(_ids)}"

    async def generate(
        self, prompt_token_ids: list[int], sampling: SamplingParams, request_id: str | None = None
    ) -> AsyncIterator[RequestUpdate]:
        """Queues the request (raising InvalidRequest before anything is queued if it is bad) and yields
        its updates. Closing the iterator early (a client that went away) aborts the request."""
        rid = request_id or self.new_request_id()
        (updates,) = await self.generate_group([ChildRequest(rid, list(prompt_token_ids), sampling, None, 0)])
        try:
            async for u in updates:
                yield u
        finally:
            await updates.aclose()

    @abc.abstractmethod
    async def generate_group(self, requests: list[ChildRequest]) -> list[AsyncIterator[RequestUpdate]]:
        """Queues several requests at once, atomically (all accepted, or InvalidRequest and none), and
        returns each one's updates. This is how the n choices of a prompt are submitted
        (`raystate.fanout.child_requests`): together, so that the later ones are forked from the first.
        Closing an iterator early aborts its request; a caller that never iterates one aborts it itself."""

    @abc.abstractmethod
    async def abort(self, request_id: str) -> None: ...

    @abc.abstractmethod
    async def health(self) -> bool:
        """Runs a real one-token step through every shard; False (or an exception) when unhealthy."""

    @abc.abstractmethod
    async def check_alive(self) -> None:
        """Raises EngineDead unless the engine's step loop runs. Cheap (no step): what a supervisor
        such as Serve's replica health check polls, so that a dead loop gets its replica replaced."""

    @abc.abstractmethod
    async def status(self) -> dict[str, Any]:
        """Shards, running and waiting requests, cache use, prefix-hit and replayed tokens, preemptions."""

    @abc.abstractmethod
    async def shutdown(self) -> None: ...

    @property
    @abc.abstractmethod
    def config(self) -> EngineConfig: ...


class InProcessClient(Client):
    """The in-process backend behind the async client API: one thread steps the engine."""

    def __init__(self, config: EngineConfig) -> None:
        from raystate.engine import InProcessEngine

        self._engine = InProcessEngine(config)
        self._config = self._engine.config  # KV blocks fixed (a CUDA worker may size them at start)
        self._lock = threading.Lock()
        self._wake = threading.Event()
        self._queues: dict[str, tuple[asyncio.AbstractEventLoop, asyncio.Queue]] = {}
        self._stopped = False
        self._error: BaseException | None = None
        self._thread = threading.Thread(target=self._loop, name="raystate-engine", daemon=True)
        self._thread.start()

    @property
    def config(self) -> EngineConfig:
        return self._config

    def _loop(self) -> None:
        try:
            while not self._stopped:
                with self._lock:
                    busy = self._engine.has_unfinished()
                    updates = self._engine.step() if busy else []
                for u in updates:
                    target = self._queues.get(u.req_id)
                    if target is not None:
                        loop, queue = target
                        loop.call_soon_threadsafe(queue.put_nowait, u)
                if not busy:
                    self._wake.wait(0.05)
                    self._wake.clear()
        except BaseException as e:  # surfaces to every waiting caller instead of a hang
            logger.exception("the in-process engine's step loop failed")
            self._error = e
            for loop, queue in list(self._queues.values()):
                loop.call_soon_threadsafe(queue.put_nowait, e)

    async def generate_group(self, requests: list[ChildRequest]) -> list[AsyncIterator[RequestUpdate]]:
        if self._error is not None or self._stopped:
            await self.check_alive()
        loop = asyncio.get_running_loop()
        queues = {r.req_id: asyncio.Queue() for r in requests}
        if len(queues) < len(requests) or any(rid in self._queues for rid in queues):
            raise InvalidRequest("request_id", "unique among unfinished requests", list(queues))
        for rid, queue in queues.items():
            self._queues[rid] = (loop, queue)
        added: list[str] = []
        try:
            with self._lock:
                for r in requests:
                    self._engine.add_request(r.req_id, list(r.prompt_token_ids), r.sampling, r.fork_of)
                    added.append(r.req_id)
        except BaseException:
            with self._lock:
                for rid in added:
                    self._engine.abort(rid)
            for rid in queues:
                self._queues.pop(rid, None)
            raise
        self._wake.set()
        return [self._updates(rid, queue) for rid, queue in queues.items()]

    def _updates(self, rid: str, queue: asyncio.Queue) -> UpdateStream:
        def on_end(finished: bool) -> None:
            self._queues.pop(rid, None)
            if not finished:
                with self._lock:
                    self._engine.abort(rid)

        return UpdateStream(
            queue, on_end, lambda e: EngineDead(f"the engine's step loop failed ({type(e).__name__})")
        )

    async def abort(self, request_id: str) -> None:
        """Drops the request; as on the Ray backend, its stream gets a last update with finish_reason
        "abort" (and a stream never iterated leaves nothing behind)."""
        with self._lock:
            req = self._engine.scheduler.get_request(request_id)
            self._engine.abort(request_id)
        target = self._queues.pop(request_id, None)
        if req is not None and target is not None:
            loop, queue = target
            update = RequestUpdate(request_id, [], True, "abort", req.num_cached_tokens, req.replay_start)
            loop.call_soon_threadsafe(queue.put_nowait, update)

    async def health(self) -> bool:
        params = SamplingParams(max_tokens=1, ignore_eos=True)
        async for u in self.generate([self._config.model.probe_token_id], params):
            if u.finished:
                return len(u.new_token_ids) == 1
        return False

    async def check_alive(self) -> None:
        if self._error is not None:
            raise EngineDead(f"the engine's step loop failed ({type(self._error).__name__})")
        if self._stopped or not self._thread.is_alive():
            raise EngineDead("the engine's step loop is not running")

    async def status(self) -> dict[str, Any]:
        with self._lock:
            stats = dataclasses.asdict(self._engine.scheduler.stats())
        alive = self._error is None and not self._stopped and self._thread.is_alive()
        return {"backend": "inprocess", "num_shards": 1, **stats, "step_loop_alive": alive}

    async def shutdown(self) -> None:
        self._stopped = True
        self._wake.set()
        await asyncio.to_thread(self._thread.join, 5.0)
