"""`Generation.deltas` merges the updates that queued up while the server was behind into one delta.

No Ray: the update iterators are `raystate.client.UpdateStream`s over queues filled by hand, as the poll
thread's hand-over fills them; `drain_nowait` is what lets the reader see what is already queued.
"""

from __future__ import annotations

import asyncio

import pytest

from raystate.client import UpdateStream
from raystate.errors import EngineDead, RequestFailed
from raystate.fanout import ChildRequest
from raystate.messages import RequestUpdate, SamplingParams, pack_logprobs, unpack_logprobs
from raystate.serve.generation import Generation, Prepared, PromptPart, merged_deltas
from raystate.serve.metrics import ServeMetrics


class Aborts:
    """The part of a `Client` a `Generation` calls: abort."""

    def __init__(self) -> None:
        self.aborted: list[str] = []

    async def abort(self, request_id: str) -> None:
        self.aborted.append(request_id)


def update(rid, ids, finished=False, reason=None, logprobs=b"", prompt_logprobs=b"", error=None):
    return RequestUpdate(rid, list(ids), finished, reason, 3, 0, error, logprobs, prompt_logprobs)


def records(ids):
    """One logprob record per token: the token and one alternative (W = 2)."""
    return pack_logprobs([[t, t + 1] for t in ids], [[-0.5 * t, -9.0] for t in ids], [1] * len(ids))


def generation(queue, stop=None, n=1, rid="r"):
    client, metrics = Aborts(), ServeMetrics()
    sampling = SamplingParams(max_tokens=16, n=n)
    prep = Prepared(rid, "completions", [PromptPart([1, 2, 3], sampling)], stop, True, False)
    ended: list[bool] = []
    stream = UpdateStream(queue, ended.append, lambda e: EngineDead(str(e)))
    gen = Generation(client, prep, metrics, set(), ChildRequest(rid, [1, 2, 3], sampling, None, 0), stream)
    return gen, client, metrics, ended


def count(histogram) -> float:
    return next(s.value for s in histogram.collect()[0].samples if s.name.endswith("_count"))


async def collect(gen):
    await gen.start()
    return [d async for d in gen.deltas()]


def test_queued_updates_merge_into_one_delta():
    async def main():
        q: asyncio.Queue = asyncio.Queue()
        first = update("r", [97], logprobs=records([97]), prompt_logprobs=records([2, 3]))
        q.put_nowait(first)
        for ids in ([98, 99], [100]):
            q.put_nowait(update("r", ids, logprobs=records(ids)))
        q.put_nowait(update("r", [101], True, "length", logprobs=records([101])))
        gen, client, metrics, ended = generation(q)
        deltas = await collect(gen)
        assert len(deltas) == 1, deltas
        (d,) = deltas
        assert d.token_ids == [97, 98, 99, 100, 101]
        assert d.text == "abcde"
        assert d.finish_reason == "length"
        assert d.prompt_logprobs == records([2, 3])
        assert d.logprobs == records([97, 98, 99, 100, 101])  # fixed-size records: they concatenate
        ids, lps, ranks = unpack_logprobs(d.logprobs)
        assert ids[:, 0].tolist() == [97, 98, 99, 100, 101] and ranks.tolist() == [1] * 5
        assert gen.token_ids == d.token_ids and bytes(gen.logprobs) == d.logprobs
        assert gen.finish_reason == "length" and gen.num_cached_tokens == 3
        assert gen.usage().completion_tokens == 5
        assert client.aborted == [] and ended == [True]  # finished: nothing to abort
        # Merged into the first delta, the four tokens after the first still count one gap each.
        assert count(metrics.ttft) == 1 and count(metrics.inter_token) == 4

    asyncio.run(main())


def test_a_reader_that_keeps_up_gets_one_delta_per_update():
    async def main():
        q: asyncio.Queue = asyncio.Queue()
        gen, client, metrics, _ = generation(q)
        steps = [[97], [98], [99], [100]]

        async def produce():
            for i, ids in enumerate(steps):
                await asyncio.sleep(0.005)
                last = i == len(steps) - 1
                q.put_nowait(update("r", ids, last, "length" if last else None))

        task = asyncio.create_task(produce())
        deltas = await collect(gen)
        await task
        assert [d.token_ids for d in deltas] == steps
        assert "".join(d.text for d in deltas) == "abcd"
        assert count(metrics.ttft) == 1 and count(metrics.inter_token) == 3

    asyncio.run(main())


def test_updates_after_a_stop_string_are_not_merged():
    async def main():
        q: asyncio.Queue = asyncio.Queue()
        for ids in ([104], [105, 88], [89, 122], [122]):  # "h", "iX", "Yz", "z"; stop "XY"
            q.put_nowait(update("r", ids))
        q.put_nowait(update("r", [122], True, "length"))
        gen, client, _, ended = generation(q, stop=["XY"])
        deltas = await collect(gen)
        assert [(d.text, d.token_ids, d.finish_reason) for d in deltas] == [
            ("hi", [104, 105, 88, 89, 122], "stop")
        ]
        assert gen.token_ids == [104, 105, 88, 89, 122]  # as unmerged: up to the update that completed it
        assert gen.text == "hi"
        await asyncio.sleep(0)  # the detached abort's task
        assert client.aborted == ["r"]  # its last update was never read: aborted, as before

    asyncio.run(main())


def test_a_failed_requests_last_update_is_not_merged():
    async def main():
        q: asyncio.Queue = asyncio.Queue()
        for ids in ([97], [98]):
            q.put_nowait(update("r", ids))
        q.put_nowait(update("r", [], True, "error", error="row failed"))
        gen, *_ = generation(q)
        await gen.start()
        got = []
        with pytest.raises(RequestFailed, match="row failed"):
            async for d in gen.deltas():
                got.append(d)
        assert [d.token_ids for d in got] == [[97, 98]]
        assert gen.finish_reason == "error"

    asyncio.run(main())


def test_an_engine_error_queued_behind_updates_still_ends_the_stream():
    async def main():
        q: asyncio.Queue = asyncio.Queue()
        for ids in ([97], [98]):
            q.put_nowait(update("r", ids))
        q.put_nowait(RuntimeError("poll failed"))
        gen, client, _, ended = generation(q)
        await gen.start()
        got = []
        with pytest.raises(EngineDead, match="poll failed"):
            async for d in gen.deltas():
                got.append(d)
        assert [d.token_ids for d in got] == [[97, 98]]
        assert ended == [False]

    asyncio.run(main())


def test_an_iterator_without_drain_nowait_gives_one_delta_per_update():
    async def main():
        gen, *_ = generation(asyncio.Queue())

        async def updates():
            for i in range(3):
                yield update("r", [97 + i], i == 2, "length" if i == 2 else None)

        gen._updates = updates()
        deltas = await collect(gen)
        assert [d.token_ids for d in deltas] == [[97], [98], [99]]

    asyncio.run(main())


def test_n_choices_merge_each_their_own_updates():
    async def main():
        queues = [asyncio.Queue() for _ in range(2)]
        gens = []
        for i, q in enumerate(queues):
            rid = f"r-{i}"
            for j in range(3):
                q.put_nowait(update(rid, [97 + i * 10 + j], j == 2, "length" if j == 2 else None))
            gen, *_ = generation(q, n=2, rid=rid)
            await gen.start()
            gens.append(gen)
        got: dict[str, list] = {}
        async for g, d in merged_deltas(gens):
            got.setdefault(g.request_id, []).append(d.token_ids)
        assert got == {"r-0": [[97, 98, 99]], "r-1": [[107, 108, 109]]}

    asyncio.run(main())
