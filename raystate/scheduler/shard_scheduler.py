"""One shard's queue, running set and step policy; the multi-shard `Scheduler` routes requests to these.

Step policy (`schedule`), within the shard's max_num_seqs running requests and max_num_batched_tokens:
1. running decodes (one token: the last sampled one), in arrival order;
2. running partial prefills, in arrival order;
3. waiting requests, first come first served, admitted through DESIGN 3 steps 1-5 (`KVManager.admit_chunk`).
A prefill chunk takes at most long_prefill_token_threshold tokens when that is > 0. When a running
request cannot get blocks, the latest-arrived running request is preempted by recompute (its blocks are
freed, num_computed reset, and it goes back to the front of the queue) until it can; a step that had to
preempt admits nothing new. Waiting requests never preempt: the queue stops at the first that does not fit.

Steps in flight: a shard gets its next normal step only once every message it got was answered
(`update`). With lookahead (async scheduling) it may get one decode step planned on top of the one in
flight (`_schedule_lookahead`), so at most two are in flight; answers are applied in the order the
messages were sent. A request's `num_computed` only moves when the answer to its row arrives (a
lookahead row's tokens are counted in the step it records, not in `num_scheduled`).
"""

from __future__ import annotations

import bisect
from collections import deque
from operator import attrgetter
from typing import NamedTuple

from raystate.config import EngineConfig
from raystate.messages import (
    FAILED_ROW,
    NewRequest,
    RequestUpdate,
    RunningDelta,
    StepMessage,
    StepResult,
    bytes_to_ids,
    logprob_record_size,
)
from raystate.scheduler.kv_manager import KVManager
from raystate.scheduler.request import Request, RequestStatus

_RUNNING = RequestStatus.RUNNING
PROMPT_LOGITS_BYTES = 128 << 20
_num_scheduled = attrgetter("num_scheduled")
_by_arrival = attrgetter("arrival")
_FINISHED = {
    "stop": RequestStatus.FINISHED_STOPPED,
    "length": RequestStatus.FINISHED_LENGTH,
    "error": RequestStatus.FINISHED_ERROR,
}


class _InflightStep(NamedTuple):
    """A message sent and not yet answered: its rows in row order and, for a lookahead step, each row's
    scheduled tokens (None: a normal step, whose rows' `num_scheduled` hold them until its answer)."""

    step_id: int
    rows: list[Request]
    ids: list[str]
    counts: list[int] | None


class ShardScheduler:
    def __init__(self, shard: int, config: EngineConfig) -> None:
        self.shard = shard
        self.kv = KVManager(
            config.kv_groups,
            config.group_num_blocks,
            config.cache.enable_prefix_caching,
            config.cache.share_replay,
        )
        sched = config.scheduler
        self.max_num_seqs = sched.max_num_seqs
        self.max_num_batched_tokens = sched.max_num_batched_tokens
        self.chunk_limit = sched.long_prefill_token_threshold or sched.max_num_batched_tokens
        # A request with prompt logprobs needs fp32 logits for every prompt position of its chunk: its
        # chunks are cut so those stay within PROMPT_LOGITS_BYTES (128 positions at a 262k vocabulary).
        self.prompt_logprobs_chunk = max(16, PROMPT_LOGITS_BYTES // (4 * config.model.vocab_size))
        self.vocab_size = config.model.vocab_size
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []  # sorted by arrival: the tail is preempted first
        self._finished_ids: list[str] = []  # to send with the next message
        self._preempted_ids: list[str] = []
        # Messages awaiting their results, oldest first: at most two (a step and its lookahead).
        self._inflight: deque[_InflightStep] = deque()
        self.num_preemptions = 0
        self.prefix_hit_tokens = 0
        self.replayed_tokens = 0
        self.shared_replay_tokens = 0
        self.forked_tokens = 0  # sum of the fork points f of the siblings forked (KVManager.fork)
        self.num_parked = 0  # siblings parked on a request of this shard (`park`)

    def enqueue(self, req: Request, front: bool = False) -> None:
        req.shard = self.shard
        if front:
            self.waiting.appendleft(req)
        else:
            self.waiting.append(req)

    def park(self, req: Request, parent: Request) -> None:
        """Holds req, a sibling with parent's prompt (n > 1), until parent's last prompt chunk is
        scheduled: then it is forked from parent (`_fork_siblings`) or, if it cannot be, queued."""
        req.shard = self.shard
        req.fork_parent = parent
        if parent.forks is None:
            parent.forks = []
        parent.forks.append(req)
        self.num_parked += 1

    def _unpark(self, parent: Request, front: bool = True) -> list[Request]:
        """Takes parent's parked siblings back into the queue (at its front by default, in arrival
        order: they arrived with parent), and returns them."""
        siblings = parent.forks or []
        parent.forks = None
        for req in siblings:
            req.fork_parent = None
        self.num_parked -= len(siblings)
        if front:
            self.waiting.extendleft(reversed(siblings))
        return siblings

    def unpark_all(self) -> list[Request]:
        """Every parked sibling of this shard, unparked and not queued (the shard is going away)."""
        out = []
        for req in [*self.running, *self.waiting]:
            if req.forks:
                out += self._unpark(req, front=False)
        return out

    # -- the step ----------------------------------------------------------------------------------------

    def schedule(self, step_id: int, lookahead: bool = False) -> StepMessage | None:
        """This shard's next step, or None when it has nothing to do or its last step is unanswered.

        With `lookahead`, a shard whose last step is unanswered may still get a decode step planned on top
        of it (see `_schedule_lookahead`); without it, it gets None until that answer is applied.
        """
        if self._inflight:
            return self._schedule_lookahead(step_id) if lookahead and len(self._inflight) == 1 else None
        kv = self.kv
        budget = self.max_num_batched_tokens
        preempted = self.num_preemptions
        rows: list[Request] = []  # running requests scheduled this step
        prefills: list[Request] = []
        # Preemption only removes running's tail (the latest arrivals, not yet visited, or req itself),
        # which a list iterator tolerates: it stops at the new end.
        for req in self.running:
            if req.num_tokens - req.num_computed > 1:
                prefills.append(req)
                continue
            if budget == 0:
                continue
            if req.num_computed + 1 > req.block_capacity and not kv.allocate(req, 1):
                ok = self._preempt_for(req, 1, rows)
                budget = self._budget_left(rows)
                if not ok:
                    continue
            req.num_scheduled = 1
            rows.append(req)
            budget -= 1
        for req in prefills:
            if budget == 0:
                break
            if req.status is not _RUNNING:
                continue
            n = min(req.num_tokens - req.num_computed, budget, self.chunk_limit)
            if req.sampling.prompt_logprobs is not None:
                n = min(n, self.prompt_logprobs_chunk)
            if not kv.allocate(req, n):
                ok = self._preempt_for(req, n, rows)
                budget = self._budget_left(rows)
                if not ok:
                    continue
            req.num_scheduled = n
            rows.append(req)
            budget -= n
        new_rows = self._admit_waiting(budget) if self.num_preemptions == preempted else []
        if self.num_parked:
            new_rows += self._fork_siblings(new_rows, rows)
        if not (new_rows or rows or self._finished_ids or self._preempted_ids):
            return None
        new_requests = [self._new_request(req) for req in new_rows]
        row_ids = [req.req_id for req in new_rows]
        deltas = []
        # Rows without new blocks share one empty value (deltas are only ever encoded, never edited).
        no_new_blocks = [[] for _ in kv.groups]
        for req in rows:  # the hot loop at high decode batch: keep it flat
            req_id = req.req_id
            new_block_ids = req.new_block_ids
            if new_block_ids is None:
                new_block_ids = no_new_blocks
            else:
                req.new_block_ids = None
            deltas.append(RunningDelta(req_id, new_block_ids, req.num_scheduled))
            row_ids.append(req_id)
        return self._message(_InflightStep(step_id, new_rows + rows, row_ids, None), new_requests, deltas)

    def _schedule_lookahead(self, step_id: int) -> StepMessage | None:
        """A decode step planned while the last one runs (async scheduling), or None when that is unsafe.

        Only the steady decode state qualifies: every running request has a row in the step in flight
        that samples its next token, and gets one more decode row for the token that step will sample
        (its id is on the worker's device by the time this step runs; the scheduler never needs it).
        Anything else (admissions that could start, prefill chunks, a block shortage that would preempt)
        waits for the answer and a normal step. A request that reaches max_tokens with the token in
        flight gets no row; one that stops on EOS gets a row whose token is dropped on arrival.
        """
        if self.waiting and len(self.running) < self.max_num_seqs:
            return None
        prev = self._inflight[0]
        prev_counts = prev.counts if prev.counts is not None else map(_num_scheduled, prev.rows)
        in_flight = {req.req_id: n for req, n in zip(prev.rows, prev_counts, strict=True)}
        rows: list[Request] = []
        counts: list[int] = []  # each row's tokens in flight
        new_blocks = 0
        for req in self.running:
            n = in_flight.get(req.req_id, 0)
            computed = req.num_computed + n
            if n == 0 or computed != req.num_tokens:  # not in flight, or mid-prefill
                return None
            if req.num_tokens + 1 >= req.max_num_tokens:  # the token in flight is its last
                continue
            if computed + 1 > req.block_capacity:
                new_blocks += 1
            rows.append(req)
            counts.append(n)
        if not rows or len(rows) > self.max_num_batched_tokens:
            return None
        kv = self.kv
        if new_blocks and new_blocks > min(kv.num_available()):  # one block per group at most each
            return None
        deltas = []
        no_new_blocks = [[] for _ in kv.groups]  # shared, as in `schedule`: deltas are only encoded
        for req, n in zip(rows, counts, strict=True):
            if not kv.allocate(req, n + 1):  # the tokens in flight and this step's one
                raise RuntimeError(f"lookahead: blocks for {req.req_id!r} ran out after the check")
            new_block_ids = req.new_block_ids
            req.new_block_ids = None
            deltas.append(
                RunningDelta(req.req_id, no_new_blocks if new_block_ids is None else new_block_ids, 1)
            )
        step = _InflightStep(step_id, rows, [r.req_id for r in rows], [1] * len(rows))
        return self._message(step, [], deltas)

    def _message(
        self, step: _InflightStep, new_requests: list[NewRequest], deltas: list[RunningDelta]
    ) -> StepMessage:
        """The step's message, carrying the finished and preempted ids gathered since the last one; the
        step is recorded as in flight until its answer."""
        msg = StepMessage(
            step_id=step.step_id,
            new_requests=new_requests,
            running=deltas,
            finished_ids=self._finished_ids,
            preempted_ids=self._preempted_ids,
        )
        self._finished_ids = []
        self._preempted_ids = []
        self._inflight.append(step)
        return msg

    def _budget_left(self, rows: list[Request]) -> int:
        return self.max_num_batched_tokens - sum(req.num_scheduled for req in rows)

    def _admit_waiting(self, budget: int) -> list[Request]:
        """Admits waiting requests in FCFS order while slots, tokens and blocks last."""
        admit_chunk = self.kv.admit_chunk
        waiting = self.waiting
        running = self.running
        max_num_seqs = self.max_num_seqs
        chunk_limit = self.chunk_limit
        admitted: list[Request] = []
        hit_tokens = replayed_tokens = shared_tokens = 0
        donors: dict = {}  # this step's replayed hits (KVManager.admit_chunk)
        while waiting and budget > 0 and len(running) < max_num_seqs:
            req = waiting[0]
            limit = budget if budget < chunk_limit else chunk_limit
            if req.sampling.prompt_logprobs is not None and limit > self.prompt_logprobs_chunk:
                limit = self.prompt_logprobs_chunk
            n = admit_chunk(req, limit, donors)
            if not n:  # blocks are short: the admission was taken back
                break
            waiting.popleft()
            req.status = _RUNNING
            req.num_scheduled = n
            if not running or running[-1].arrival < req.arrival:  # the usual case: the latest arrival
                running.append(req)
            else:  # re-admitted after preemption
                bisect.insort(running, req, key=_by_arrival)
            admitted.append(req)
            budget -= n
            hit_tokens += req.num_cached_tokens
            if req.replay_start:
                if req.num_computed == req.num_cached_tokens:  # borrowed a donor's rebuilt window
                    shared_tokens += req.num_cached_tokens - req.replay_start
                else:
                    replayed_tokens += req.num_cached_tokens - req.replay_start
        self.prefix_hit_tokens += hit_tokens
        self.replayed_tokens += replayed_tokens
        self.shared_replay_tokens += shared_tokens
        return admitted

    def _fork_siblings(self, new_rows: list[Request], rows: list[Request]) -> list[Request]:
        """Forks the parked siblings of every request whose last prompt chunk this step schedules
        (KVManager.fork), while sequence slots, tokens and blocks last; the rest are queued at the front.
        Returns the forked ones, admitted as new rows of this step."""
        budget = self._budget_left([*new_rows, *rows])
        forked: list[Request] = []
        for parent in [*new_rows, *rows]:
            if not parent.forks:
                continue
            end = parent.num_computed + parent.num_scheduled
            if end != parent.num_prompt_tokens or parent.num_tokens != end:
                continue  # a chunk before the last: the siblings stay parked
            siblings = self._unpark(parent, front=False)
            tail = end - (end - 1) // self.kv.block_size * self.kv.block_size  # tokens a child computes
            for k, req in enumerate(siblings):
                n = 0
                if len(self.running) < self.max_num_seqs and budget >= tail:
                    n = self.kv.fork(req, parent)
                if not n:  # no room or no fork: this one and the rest take the queue's way
                    self.waiting.extendleft(reversed(siblings[k:]))
                    break
                req.status = _RUNNING
                req.num_scheduled = n
                bisect.insort(self.running, req, key=_by_arrival)
                forked.append(req)
                budget -= n
                self.forked_tokens += req.num_computed
        return forked

    def _new_request(self, req: Request) -> NewRequest:
        req.new_block_ids = None  # the full lists below include them
        # Positional: msgspec builds a Struct from positional arguments faster than from keywords.
        return NewRequest(
            req.req_id,
            req.token_bytes(),  # token_ids
            req.num_prompt_tokens,
            req.num_computed,
            req.replay_start,
            [ids.copy() for ids in req.block_ids],  # copies: the request's lists keep changing
            req.num_scheduled,
            req.sampling,
        )

    def _preempt_for(self, req: Request, num_tokens: int, rows: list[Request]) -> bool:
        """Preempts the latest-arrived running requests until req gets blocks for num_tokens more
        tokens; False when req itself had to go."""
        while True:
            victim = self.running[-1]
            self.preempt(victim, rows)
            if victim is req:
                return False
            if self.kv.allocate(req, num_tokens):
                return True

    def preempt(self, req: Request, rows: list[Request] | None = None) -> None:
        """Preemption by recompute (DESIGN 3.6): frees req's blocks, resets its progress and queues it at
        the front; the worker drops it on the next message and later receives it anew."""
        self.running.remove(req)
        if rows is not None and req.num_scheduled and req in rows:
            rows.remove(req)
        self.kv.preempt(req)
        req.num_scheduled = 0
        req.status = RequestStatus.PREEMPTED
        self.waiting.appendleft(req)
        self._preempted_ids.append(req.req_id)
        self.num_preemptions += 1

    # -- results -----------------------------------------------------------------------------------------

    def update(self, result: StepResult) -> tuple[list[RequestUpdate], list[Request]]:
        """Applies the shard's answer to its oldest message in flight: advances every row by its chunk,
        appends sampled tokens and finishes requests. Returns the client updates and the requests that
        finished."""
        if not self._inflight:
            raise RuntimeError(f"update: shard {self.shard} has no step in flight")
        step = self._inflight[0]
        if result.step_id != step.step_id:
            raise ValueError(f"step_id: shard {self.shard} awaits step {step.step_id}, got {result.step_id}")
        if result.req_ids != step.ids:
            raise ValueError(
                f"req_ids: shard {self.shard} step {result.step_id} rows do not match the batch sent"
            )
        sampled = bytes_to_ids(result.sampled)
        if len(sampled) != len(step.ids):
            raise ValueError(f"sampled: {len(sampled)} ids for {len(step.ids)} rows")
        self._inflight.popleft()
        kv = self.kv
        vocab = self.vocab_size
        running = _RUNNING
        updates: list[RequestUpdate] = []
        finished: list[Request] = []
        # A normal step's rows hold their counts in num_scheduled; a lookahead step (which leaves those
        # alone) lists its own.
        counts = step.counts if step.counts is not None else map(_num_scheduled, step.rows)
        logprobs = result.logprobs
        prompt_logprobs = result.prompt_logprobs
        for req, n, token in zip(step.rows, counts, sampled, strict=True):  # the hot loop
            if req.status is not running:  # aborted, or finished by the step before (lookahead)
                continue
            if token == FAILED_ROW:  # this request alone failed: end it, keep none of this step's KV
                why = result.errors.get(req.req_id, "the worker could not compute this request")
                self._finish(req, "error")
                finished.append(req)
                updates.append(
                    RequestUpdate(req.req_id, [], True, "error", req.num_cached_tokens, req.replay_start, why)
                )
                continue
            if prompt_logprobs and req.req_id in prompt_logprobs:
                _collect_prompt_logprobs(req, prompt_logprobs[req.req_id])
            computed = req.num_computed + n
            req.num_computed = computed
            req.num_scheduled = 0
            if computed >= req.kv_check_at:
                kv.advance(req)
            if computed < req.num_tokens:
                if token != -1:
                    raise ValueError(f"sampled: request {req.req_id!r} got a token mid-prefill ({token})")
                continue
            if not 0 <= token < vocab:
                raise ValueError(f"sampled: request {req.req_id!r} got {token}, outside [0, {vocab})")
            # Append and finish: a stop (EOS unless ignore_eos, or a stop id, once the output has
            # min_tokens tokens) wins over the length limit when both hold; the stop token stays in the
            # output. Inline: this loop runs per decode row.
            req.token_ids.append(token)
            num_tokens = req.num_tokens = req.num_tokens + 1
            if (
                token == req.eos_token_id or token in req.stop_token_ids
            ) and num_tokens >= req.min_stop_tokens:
                reason = "stop"
            elif num_tokens >= req.max_num_tokens:
                reason = "length"
            else:
                reason = None
            if reason is None:
                update = RequestUpdate(
                    req.req_id, [token], False, None, req.num_cached_tokens, req.replay_start
                )
            else:
                self._finish(req, reason)
                finished.append(req)
                update = RequestUpdate(
                    req.req_id, [token], True, reason, req.num_cached_tokens, req.replay_start
                )
            if logprobs:
                update.logprobs = logprobs.get(req.req_id, b"")
            if req.prompt_logprobs is not None:  # the first output token: the prompt's records with it
                update.prompt_logprobs = b"".join(req.prompt_logprobs)
                req.prompt_logprobs = None
            updates.append(update)
        return updates, finished

    def _finish(self, req: Request, reason: str) -> None:
        self.running.remove(req)
        self.kv.free(req)
        if req.forks:  # failed before its last prompt chunk: the siblings compute the prompt themselves
            self._unpark(req)
        req.status = _FINISHED[reason]
        req.finish_reason = reason
        self._finished_ids.append(req.req_id)

    def abort(self, req: Request) -> None:
        """Drops req wherever it is; a running one's id goes out in the next finished_ids. Siblings
        parked on it are queued (the first of them computes the prompt instead)."""
        if req.fork_parent is not None:  # a parked sibling
            req.fork_parent.forks.remove(req)
            req.fork_parent = None
            self.num_parked -= 1
        elif req.status is _RUNNING:
            self.running.remove(req)
            self.kv.free(req)
            self._finished_ids.append(req.req_id)
        else:
            self.waiting.remove(req)
        if req.forks:
            self._unpark(req)
        req.num_scheduled = 0
        req.status = RequestStatus.FINISHED_ABORTED
        req.finish_reason = "abort"

    def reset(self) -> list[Request]:
        """The shard's worker lost its state: forgets every block and cached prefix, takes back the step in
        flight, and re-queues all of the shard's requests in arrival order, to be sent anew in full."""
        reqs = sorted([*self.running, *self.waiting], key=_by_arrival)
        self.kv.reset(reqs)
        for req in reqs:
            req.num_scheduled = 0
            if req.status is _RUNNING:
                req.status = RequestStatus.PREEMPTED
        self.running = []
        self.waiting = deque(reqs)
        self._finished_ids = []
        self._preempted_ids = []
        self._inflight.clear()
        return reqs

    # -- checks ------------------------------------------------------------------------------------------

    def check_integrity(self) -> None:
        """Every pool's invariant, and every block's reference count equals the running requests holding
        it (so nothing leaks and nothing is freed twice)."""
        idle = not self.running
        self.kv.check_integrity(idle=idle)
        for g, pool in enumerate(self.kv.pools):
            held = [0] * pool.num_blocks
            for req in self.running:
                for b in req.block_ids[g]:
                    if b:
                        held[b] += 1
            ref_cnt = pool.ref_cnt  # a copy, built once
            for b in range(1, pool.num_blocks):
                assert held[b] == ref_cnt[b], (
                    f"shard {self.shard} group {g} block {b}: {held[b]} holders, ref count {ref_cnt[b]}"
                )
        parked = 0
        for req in [*self.waiting, *self.running]:
            assert not req.block_ids or req.status is _RUNNING, f"waiting request {req.req_id!r} holds blocks"
            for sibling in req.forks or ():
                assert sibling.fork_parent is req and not sibling.block_ids, f"parked {sibling.req_id!r}"
                parked += 1
        assert parked == self.num_parked, f"shard {self.shard}: {parked} parked, counted {self.num_parked}"


def _collect_prompt_logprobs(req: Request, blob: bytes) -> None:
    """Keeps a chunk's prompt-logprob records (one per position from the chunk start, req.num_computed)
    that the request does not have yet: a chunk computed again after preemption repeats some."""
    if req.prompt_logprobs is None or not blob:  # sent already
        return
    start = req.num_computed
    size = logprob_record_size(blob)
    skip = req.prompt_logprobs_next - start
    if skip > 0:
        blob = blob[skip * size :]
    if blob:
        req.prompt_logprobs.append(blob)
        req.prompt_logprobs_next = max(start, req.prompt_logprobs_next) + len(blob) // size
