"""Test helpers for the scheduler: small configs, a fake worker that checks block usage, stepping through
the real step loop (`StepDriver` over `LocalDispatch`).

`FakeWorker` plays a worker shard at the level of block tables: it keeps each request's token history
and per-group block table from the messages, writes a "KV" entry per computed token into a simulated
paged cache (skipping, as the real worker does, prefix-cacheable slots in [replay_start, replay_start +
P) of a replayed prefill), and before answering checks that every key the step's attention would read
holds the KV of exactly that prefix. A block handed out twice, freed too early, or a hit pointing at
the wrong blocks shows up as a wrong read. Its tokens are a deterministic function of the history (or a
script per request), so a run can be compared with `reference_output`.
"""

from __future__ import annotations

import array
from collections import defaultdict
from dataclasses import dataclass, field

from raystate.config import EngineConfig, ModelConfig
from raystate.engine_args import EngineArgs, ResolvedModel, build_engine_config
from raystate.kv_layout import replay_tokens
from raystate.messages import (
    SamplingParams,
    StepMessage,
    StepResult,
    bytes_to_ids,
    decode_step,
    encode,
    ids_to_bytes,
)
from raystate.scheduler import RequestUpdate, Scheduler
from raystate.scheduler.dispatch import IDLE_STEP, LocalDispatch, PipelinedDispatch
from raystate.scheduler.driver import Step, StepDriver
from raystate.scheduler.kv_manager import KVManager
from raystate.scheduler.request import Request
from raystate.worker.actor import WorkerActor


def make_config(
    *,
    block_size: int = 4,
    window: int = 8,
    num_blocks: int = 128,
    caching: bool = True,
    bounded_replay: bool = True,
    share_replay: bool = True,
    max_num_seqs: int = 8,
    max_batched: int = 512,
    threshold: int = 0,
    max_model_len: int = 256,
    layer_types: tuple[str, ...] = ("sliding", "full", "sliding", "full"),
) -> EngineConfig:
    model = ModelConfig(
        layer_types=layer_types,
        sliding_window=window,
        max_model_len=max_model_len,
        engram_layer_ids=tuple(i for i in (1, 2) if i < len(layer_types)),
    )
    args = EngineArgs(
        block_size=block_size,
        num_blocks=num_blocks,
        enable_prefix_caching=caching,
        swa_bounded_replay=bounded_replay,
        share_replay=share_replay,
        max_num_seqs=max_num_seqs,
        max_num_batched_tokens=max_batched,
        long_prefill_token_threshold=threshold,
    )
    return build_engine_config(args, ResolvedModel(model))


def one_shard(**config_kw) -> tuple[Scheduler, FakeWorker]:
    """A one-shard scheduler on `make_config(**config_kw)` and its checking fake worker."""
    config = make_config(**config_kw)
    return Scheduler(config), FakeWorker(config)


def make_req(kv: KVManager, req_id: str, tokens: list[int]) -> Request:
    """A request on its own, its prompt's full blocks hashed, for tests of one shard's KVManager."""
    req = Request(req_id, array.array("i", tokens), SamplingParams(max_tokens=4), 0, eos_token_id=257)
    kv.hash_blocks(req, len(tokens) // kv.block_size)
    return req


def group_index(config: EngineConfig, name: str) -> int:
    return [g.name for g in config.kv_groups].index(name)


def next_token(history: list[int]) -> int:
    """The fake model: a byte (never EOS) fixed by the history's last token and length."""
    return (history[-1] * 31 + len(history) * 17 + 3) % 256


def reference_output(
    prompt: list[int], sampling: SamplingParams, eos: int, script: list[int] = ()
) -> list[int]:
    """What a request must produce, from the finishing rules alone (no scheduler)."""
    history = list(prompt)
    out: list[int] = []
    while True:
        tok = script[len(out)] if len(out) < len(script) else next_token(history)
        history.append(tok)
        out.append(tok)
        if (tok == eos and not sampling.ignore_eos) or tok in sampling.stop_token_ids:
            return out
        if len(out) >= sampling.max_tokens:
            return out


@dataclass
class _FakeState:
    tokens: list[int]
    num_prompt: int
    num_computed: int
    prefill_len: int
    replay_start: int
    tables: list[list[int]]
    keys: list[int] = field(default_factory=list)

    def key(self, pos: int) -> int:
        """Identity of the prefix tokens[: pos + 1] (what the KV at pos depends on)."""
        while len(self.keys) <= pos:
            p = len(self.keys)
            self.keys.append(hash((self.keys[p - 1] if p else 0, self.tokens[p])))
        return self.keys[pos]


class FakeWorker:
    def __init__(self, config: EngineConfig, scripts: dict[str, list[int]] | None = None) -> None:
        groups = config.kv_groups
        self.config = config
        self.block_size = config.cache.block_size
        self.windows = [g.sliding_window for g in groups]
        self.cacheable = [g.prefix_cacheable for g in groups]
        self.replay_tokens = replay_tokens(groups)
        self.kv: list[dict[int, int]] = [{} for _ in groups]  # group -> slot -> prefix key
        self.reqs: dict[str, _FakeState] = {}
        self.scripts = scripts or {}
        self.log: list[tuple[str, int, int, int]] = []  # (req_id, chunk start, num_scheduled, row rs)

    def launch(self, msg: StepMessage) -> StepResult:
        """`LocalDispatch`'s call: the fake computes at once, so its handle is the answer."""
        return self.execute(msg)

    def finish(self, result: StepResult) -> StepResult:
        return result

    def execute(self, msg: StepMessage) -> StepResult:
        for req_id in (*msg.finished_ids, *msg.preempted_ids):
            self.reqs.pop(req_id, None)
        rows: list[tuple[str, int]] = []
        for new in msg.new_requests:
            assert new.req_id not in self.reqs, f"{new.req_id} sent twice"
            tokens = bytes_to_ids(new.token_ids)
            tables = [list(ids) for ids in new.block_ids]
            self.reqs[new.req_id] = _FakeState(
                tokens, new.num_prompt_tokens, new.num_computed, len(tokens), new.replay_start, tables
            )
            if new.num_scheduled:
                rows.append((new.req_id, new.num_scheduled))
        for delta in msg.running:
            state = self.reqs[delta.req_id]
            for g, ids in enumerate(delta.new_block_ids):
                state.tables[g].extend(ids)
            rows.append((delta.req_id, delta.num_scheduled))
        sampled = []
        for req_id, n in rows:
            state = self.reqs[req_id]
            start, end = state.num_computed, state.num_computed + n
            assert n > 0 and end <= len(state.tokens), f"{req_id}: chunk [{start}, {end}) past its tokens"
            rs = state.replay_start if start < state.prefill_len else 0
            self.log.append((req_id, start, n, rs))
            self._write(req_id, state, start, end, rs)
            self._check_reads(req_id, state, start, end, rs)
            state.num_computed = end
            if end == len(state.tokens):
                script = self.scripts.get(req_id, ())
                out_idx = len(state.tokens) - state.num_prompt
                tok = script[out_idx] if out_idx < len(script) else next_token(state.tokens)
                state.tokens.append(tok)
                sampled.append(tok)
            else:
                sampled.append(-1)
        return StepResult(step_id=msg.step_id, req_ids=[r for r, _ in rows], sampled=ids_to_bytes(sampled))

    def poison_free_blocks(self, sched: Scheduler, shard: int) -> None:
        """Wipes the KV of every block the scheduler holds free, so reading one fails the read check."""
        bs = self.block_size
        for g, pool in enumerate(sched.shards[shard].kv.pools):
            kv = self.kv[g]
            for block in pool.free_block_ids():
                for slot in range(block * bs, (block + 1) * bs):
                    kv.pop(slot, None)

    def _slot(self, req_id: str, state: _FakeState, g: int, pos: int) -> int:
        table = state.tables[g]
        j = pos // self.block_size
        assert j < len(table), f"{req_id}: group {g} has no block for position {pos}"
        assert table[j] != 0, f"{req_id}: group {g} position {pos} maps to the null block"
        return table[j] * self.block_size + pos % self.block_size

    def _write(self, req_id: str, state: _FakeState, start: int, end: int, rs: int) -> None:
        for g in range(len(self.kv)):
            for pos in range(start, end):
                if self.cacheable[g] and rs > 0 and rs <= pos < rs + self.replay_tokens:
                    continue  # slot padding: the cached KV stays as it is
                self.kv[g][self._slot(req_id, state, g, pos)] = state.key(pos)

    def _check_reads(self, req_id: str, state: _FakeState, start: int, end: int, rs: int) -> None:
        for g, window in enumerate(self.windows):
            lo = max(rs, start - window + 1, 0) if window else 0
            for pos in range(lo, end):
                got = self.kv[g].get(self._slot(req_id, state, g, pos))
                assert got == state.key(pos), f"{req_id}: group {g} position {pos} reads another prefix's KV"


@dataclass
class RunLog:
    outputs: dict[str, list[int]]
    finals: dict[str, RequestUpdate]
    messages: list[dict[int, StepMessage]]
    updates: list[RequestUpdate]


@dataclass
class _Launched:
    """A fake step launched whose answer is read only when it is finished, as a GPU decode step's is (so
    a worker actor may hold it)."""

    answer: StepResult
    result: None = None  # `PendingStep.result`: None while the device work may still run


class _DeviceLikeWorker:
    """A FakeWorker whose answers wait for `finish`. Its steps still run at launch: a device runs them
    in launch order, before any step launched later (which is what the free-block poisoning stands
    for), whenever their answers are read."""

    def __init__(self, fake: FakeWorker) -> None:
        self.fake = fake

    def launch(self, msg: StepMessage) -> _Launched:
        return _Launched(self.fake.execute(msg))

    def finish(self, launched: _Launched) -> StepResult:
        return launched.answer


class BehindDispatch(PipelinedDispatch):
    """`PipelinedDispatch` over worker actors built in this process (`WorkerActor.execute_behind` around a
    fake worker whose steps run when finished): what the compiled graph does, without Ray. Answers are
    read when the messages are sent, which changes nothing the dispatcher relies on (it reads handles in
    the order it sent them)."""

    def __init__(self, workers: list[FakeWorker], sender: str = "graph-1") -> None:
        super().__init__()
        self.actors = {}
        for s, w in enumerate(workers):
            actor = WorkerActor(w.config, s, dry_run=True)
            actor.worker = _DeviceLikeWorker(w)
            self.actors[s] = actor
        self.sender = sender
        self.held_counts: list[int] = []  # per message, how many steps shard 0 answered

    def _send(self, payloads: dict[int, bytes], hold: bool):
        outs = {
            s: a.execute_behind(payloads.get(s, IDLE_STEP), hold, self.sender) for s, a in self.actors.items()
        }
        self.held_counts.append(len(outs[0]))
        return outs

    def _read(self, handle, timeout_s: float | None):
        return handle, {}


def driver(
    sched: Scheduler, workers: list[FakeWorker], lookahead: bool = False, answer_behind: bool = False
) -> StepDriver:
    """The real step loop over the fake workers (every message and result goes through msgspec); with
    `answer_behind`, through worker actors that answer one step late (`PipelinedDispatch`)."""
    dispatch = BehindDispatch(workers) if answer_behind else LocalDispatch(dict(enumerate(workers)))
    return StepDriver(sched, dispatch, lookahead=lookahead)


def record(done: Step, sched: Scheduler, workers: list[FakeWorker], log: RunLog | None) -> None:
    """After a pass: wipes the freed blocks' KV on the shards that answered, and logs the pass."""
    for shard in done.results:
        workers[shard].poison_free_blocks(sched, shard)
    if log is None:
        return
    for upd in done.updates:
        log.outputs[upd.req_id].extend(upd.new_token_ids)
        log.updates.append(upd)
        if upd.finished:
            assert upd.req_id not in log.finals, f"{upd.req_id} finished twice"
            log.finals[upd.req_id] = upd
    log.messages.append(done.messages)


def step(sched: Scheduler, workers: list[FakeWorker], log: RunLog | None = None) -> dict[int, StepMessage]:
    """One schedule -> dispatch -> collect -> update pass; returns the messages sent."""
    one = driver(sched, workers).step()
    for msg in one.messages.values():
        assert decode_step(encode(msg)) == msg, "StepMessage does not survive a msgspec round trip"
    record(one, sched, workers, log)
    return one.messages


def new_log() -> RunLog:
    return RunLog(defaultdict(list), {}, [], [])


def blocks_sent(log: RunLog, req_id: str, shard: int = 0) -> list[list[int]]:
    """The block table a worker holds for req_id after the logged messages (from its last NewRequest)."""
    tables: list[list[int]] = []
    for msgs in log.messages:
        msg = msgs.get(shard)
        if msg is None:
            continue
        for new in msg.new_requests:
            if new.req_id == req_id:
                tables = [list(ids) for ids in new.block_ids]
        for delta in msg.running:
            if delta.req_id == req_id:
                for g, ids in enumerate(delta.new_block_ids):
                    tables[g] += ids
    return tables


def run(
    sched: Scheduler, workers: list[FakeWorker], log: RunLog | None = None, max_steps: int = 2000
) -> RunLog:
    """Steps until every request finished; fails on a step with nothing to do (a stall)."""
    log = log if log is not None else new_log()
    for _ in range(max_steps):
        if not sched.has_unfinished():
            return log
        assert step(sched, workers, log), "unfinished requests but no shard has anything to do"
    raise AssertionError(f"not finished after {max_steps} steps")
