"""The poll thread's hand-over of a batch of updates (`RayClient._dispatch`) and the update streams
`generate_group` returns (`UpdateStream`), without Ray: the client's sinks are registered by hand.

One event loop gets one callback per poll batch carrying every `LoopSink`'s updates; a plain sink (what
`LLM._generate_ray` passes: `inbox.put`) is called per update; an error reaches every sink once.
"""

from __future__ import annotations

import asyncio
import threading
from types import SimpleNamespace

import pytest

from raystate.client import UpdateStream
from raystate.cluster import LoopSink, RayClient
from raystate.errors import EngineDead
from raystate.fanout import ChildRequest
from raystate.messages import RequestUpdate, SamplingParams


def update(rid, ids, finished=False):
    return RequestUpdate(rid, list(ids), finished, "length" if finished else None, 0, 0)


class RecordingLoop:
    """Stands in for an event loop: records `call_soon_threadsafe` calls, runs them on `run()`."""

    def __init__(self, closed: bool = False) -> None:
        self.calls: list = []
        self.closed = closed

    def call_soon_threadsafe(self, fn, *args):
        if self.closed:
            raise RuntimeError("Event loop is closed")
        self.calls.append((fn, args))

    def run(self) -> None:
        calls, self.calls = self.calls, []
        for fn, args in calls:
            fn(*args)


class FakeScheduler:
    def __init__(self) -> None:
        self.aborted: list[str] = []
        self.abort = SimpleNamespace(remote=self.aborted.append)


def client() -> RayClient:
    return RayClient(FakeScheduler(), config=None)


def test_one_callback_per_loop_per_poll_batch():
    c = client()
    loop_a, loop_b = RecordingLoop(), RecordingLoop()
    got: dict[str, list] = {"a1": [], "a2": [], "b": []}
    sink_a1 = LoopSink(loop_a, got["a1"].extend)
    sink_a2 = LoopSink(loop_a, got["a2"].extend)
    sink_b = LoopSink(loop_b, got["b"].extend)
    plain: list = []
    c._sinks.update({"x": sink_a1, "y": sink_a1, "z": sink_a2, "w": sink_b, "p": plain.append})
    batch = [update("x", [1]), update("z", [2]), update("y", [3]), update("w", [4]), update("p", [5])]
    batch += [update("x", [6], True), update("gone", [7])]
    c._dispatch(batch)
    assert len(loop_a.calls) == 1 and len(loop_b.calls) == 1  # one hand-over per loop
    assert [u.req_id for u in plain] == ["p"]  # a plain sink: called per update, on the poll thread
    loop_a.run()
    loop_b.run()
    assert [(u.req_id, u.new_token_ids) for u in got["a1"]] == [("x", [1]), ("y", [3]), ("x", [6])]
    assert [u.req_id for u in got["a2"]] == ["z"] and [u.req_id for u in got["b"]] == ["w"]
    assert "x" not in c._sinks and set(c._sinks) == {"y", "z", "w", "p"}  # finished: unregistered


def test_a_closed_loop_drops_its_requests_only():
    c = client()
    closed, live = RecordingLoop(closed=True), RecordingLoop()
    got: list = []
    c._sinks.update({"a": LoopSink(closed, got.extend), "b": LoopSink(live, got.extend)})
    c._dispatch([update("a", [1]), update("b", [2])])
    live.run()
    assert [u.req_id for u in got] == ["b"]
    assert set(c._sinks) == {"b"}


def test_an_error_reaches_every_sink_once():
    c = client()
    loop, closed = RecordingLoop(), RecordingLoop(closed=True)
    group: list = []
    plain: list = []
    other: list = []
    shared = LoopSink(loop, group.extend)
    put = plain.append  # one bound method for a whole batch, as `LLM._generate_ray` registers it
    dead = LoopSink(closed, [].extend)  # its caller's loop is closed: the others still get the error
    c._sinks.update(
        {"a": shared, "b": shared, "p": put, "q": put, "c": dead, "o": LoopSink(loop, other.extend)}
    )
    c._fail(RuntimeError("poll failed"))
    loop.run()
    for got in (group, plain, other):
        assert len(got) == 1 and isinstance(got[0], EngineDead), got
    assert c._sinks == {}
    with pytest.raises(EngineDead):
        c._register(["new"], plain.append)


def test_generate_group_streams_drain_what_one_batch_delivered():
    async def main():
        c = client()

        async def submit_async(items, sink):  # registers as the real one does, without the actor
            for rid, *_ in items:
                c._sinks[rid] = sink

        c.submit_async = submit_async
        sp = SamplingParams(max_tokens=4)
        s0, s1 = await c.generate_group(
            [ChildRequest("r0", [1], sp, None, 0), ChildRequest("r1", [1], sp, "r0", 1)]
        )
        assert isinstance(s0, UpdateStream)
        batch = [update("r0", [1]), update("r1", [2]), update("r0", [3]), update("r0", [4], True)]
        th = threading.Thread(target=c._dispatch, args=(batch,))
        th.start()
        th.join()
        first = await anext(s0)
        assert first.new_token_ids == [1]
        rest = s0.drain_nowait()
        assert [u.new_token_ids for u in rest] == [[3], [4]]
        assert s0.drain_nowait() == []
        with pytest.raises(StopAsyncIteration):
            await anext(s0)
        assert (await anext(s1)).new_token_ids == [2]
        assert s1.drain_nowait() == []
        await s1.aclose()  # unfinished: aborted
        await s0.aclose()
        assert c._scheduler.aborted == ["r1"]
        assert set(c._sinks) == set()

    asyncio.run(main())


def test_update_stream_ends_once():
    async def main():
        ended: list[bool] = []

        def stream(*items):
            q: asyncio.Queue = asyncio.Queue()
            for it in items:
                q.put_nowait(it)
            return q, UpdateStream(q, ended.append, lambda e: EngineDead(str(e)))

        _, s = stream(update("a", [1]))
        await s.aclose()  # never iterated: the caller aborts it itself (as with an async generator)
        assert ended == []

        _, s = stream(update("a", [1]))
        assert (await anext(s)).new_token_ids == [1]
        await s.aclose()
        await s.aclose()
        assert ended == [False]

        ended.clear()
        _, s = stream(update("a", [1], True))
        assert [u.finished async for u in s] == [True]
        await s.aclose()
        assert ended == [True]

        ended.clear()
        _, s = stream()
        task = asyncio.create_task(anext(s))
        await asyncio.sleep(0)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        await s.aclose()
        assert ended == [False]

        ended.clear()
        _, s = stream(update("a", [1]), update("a", [2]), RuntimeError("dead"), update("a", [3]))
        assert [u.new_token_ids for u in s.drain_nowait()] == [[1], [2]]
        assert s.drain_nowait() == []  # the error waits for the next __anext__
        with pytest.raises(EngineDead, match="dead"):
            await anext(s)
        with pytest.raises(StopAsyncIteration):
            await anext(s)
        assert ended == [False]

    asyncio.run(main())
