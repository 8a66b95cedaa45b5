"""The worker: one model-state shard. It applies a `StepMessage` and answers with the sampled ids.

Per step it (1) releases finished and preempted requests, (2) takes new requests (token history, blocks,
replay start) and running requests' new blocks, (3) prepares the batch (input ids from the device token
history, engram lookback, slot mappings with replayed slots padded, per-group attention metadata),
(4) runs the model, (5) samples the rows whose chunk reached the end of their known tokens and appends
those tokens to the history on the device. It holds no scheduling policy.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np
import torch

from raystate.config import EngineConfig
from raystate.engine_args import with_local_checkpoint
from raystate.errors import InvalidRequest
from raystate.kernels.token_history import write_token_ids
from raystate.messages import FAILED_ROW, NewRequest, StepMessage, StepResult, bytes_to_ids, ids_to_bytes
from raystate.model import load_model
from raystate.worker.block_table import BlockTables
from raystate.worker.cudagraph import DecodeGraphs, DecodeStepParts, ReadyEvent
from raystate.worker.input_batch import InputBatch
from raystate.worker.kv_cache import allocate_kv_caches, auto_group_blocks
from raystate.worker.logprobs import ID_COL, compute_logprobs, record, records
from raystate.worker.model_state import HybridModelState
from raystate.worker.penalties import LogitControls
from raystate.worker.requests import RequestStates
from raystate.worker.sampler import NONFINITE_LOGITS, Sampler, is_greedy
from raystate.worker.structured import StructuredOutputs, grammar_tokenizer

logger = logging.getLogger(__name__)

# (req_id, position of the first row, logits fp32 [n, V]) for every computed token; a test hook.
LogitRecorder = Callable[[str, int, torch.Tensor], None]


def resolve_dtype(config: EngineConfig) -> torch.dtype:
    if config.dtype == "auto":
        return torch.bfloat16 if config.device.startswith("cuda") else torch.float32
    return {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}[config.dtype]


@dataclass
class PendingStep:
    """A launched step: its answer (`result`), or where its sampled ids land and the event after which
    they are there (graph decode steps, whose device work may still be running)."""

    t0: int  # perf_counter_ns at launch
    result: StepResult | None
    step_id: int = 0
    req_ids: list[str] = field(default_factory=list)
    sampled_host: torch.Tensor | None = None  # int64 [B], pinned on CUDA
    ready: ReadyEvent | None = None
    errors: dict[str, str] = field(default_factory=dict)  # req_id -> why, for rows that failed
    row_order: list[str] | None = None  # the message's rows, when some were refused at launch
    # Graph decode steps with logprobs: each row's k (None: not asked); then `sampled_host` is the packed
    # int32 [B, logprobs.WIDTH] rows of `compute_logprobs`, the sampled ids in column ID_COL.
    logprob_ks: list[int | None] | None = None


class Worker:
    def __init__(self, config: EngineConfig, model: torch.nn.Module | None = None) -> None:
        # a hub checkpoint resolved on another node: this node's copy (fetched if it has none)
        config = with_local_checkpoint(config) if model is None else config
        self.config = config
        self.device = torch.device(config.device)
        dtype = resolve_dtype(config)
        # Seconds of each start-up phase (weights, buffers, kv_cache, cuda_graphs), logged at the end.
        self.startup_s: dict[str, float] = {}
        t0 = time.perf_counter()
        self.model = (
            model
            if model is not None
            else load_model(
                config.model_path or config.model.name, device=self.device, dtype=dtype, config=config.model
            )
        )
        self.model.eval()
        t0 = self._phase_done("weights", t0)
        self.groups = config.kv_groups
        max_reqs = config.scheduler.max_num_seqs
        max_len = config.max_model_len
        block_size = config.cache.block_size
        self.states = RequestStates(max_reqs, max_len, self.device)
        # Penalties, logit_bias and min_tokens per slot (the scratch slot included, never enabled).
        self.controls = LogitControls(
            max_reqs + 1, self.model.config.vocab_size, config.model.eos_token_ids, self.device
        )
        # Structured output: a grammar matcher per structured request, its token mask per step.
        self.structured = StructuredOutputs(
            max_reqs + 1, self.model.config.vocab_size, self.device, lambda: grammar_tokenizer(config)
        )
        # A step has at most max_num_batched_tokens tokens; a decode graph's padded batch, max_num_seqs.
        max_tokens = max(config.scheduler.max_num_batched_tokens, max_reqs)
        self.block_tables = BlockTables(
            len(self.groups), max_reqs, -(-max_len // block_size), block_size, max_tokens, self.device
        )
        self.model_state = HybridModelState(
            self.groups, self.model.token_lookback_depth, max_reqs, self.device
        )
        self.sampler = Sampler(self.device, config.seed)
        t0 = self._phase_done("buffers", t0)
        # Last of the fixed allocations, so a cache sized from the device's memory sees all the others.
        if config.kv_sized_at_start:
            torch.cuda.empty_cache()  # the loader's freed temporaries would count as this worker's
            free, total = torch.cuda.mem_get_info(self.device)
            own = torch.cuda.memory_reserved(self.device)
            counts = auto_group_blocks(config, self.groups, total, free, own)
            self.config = config = config.with_group_blocks(counts)
        self.kv_caches = allocate_kv_caches(
            self.groups, self.model.config.num_layers, config.group_num_blocks, dtype, self.device
        )
        t0 = self._phase_done("kv_cache", t0)
        self._refused: dict[str, str] = {}  # req_id -> why, until the scheduler ends the request
        self.logit_recorder: LogitRecorder | None = None
        # Profile mode (set through InProcessEngine.profile): execute() records last_phases, the ns of its
        # prepare / forward / sample phases, syncing a CUDA device at each boundary so GPU work lands in
        # the phase that queued it. Off: no syncs, one `if` per phase boundary.
        self.profile = False
        self.last_phases: tuple[int, int, int] = (0, 0, 0)
        self.graphs: DecodeGraphs | None = None
        if config.cuda_graphs and self.device.type == "cuda":
            self.graphs = self.new_decode_graphs()
            self.graphs.capture()  # the first launches also compile the Triton kernels (or load them)
            self._phase_done("cuda_graphs", t0)
        logger.info(
            "raystate worker on %s ready: %s",
            self.device,
            ", ".join(f"{k} {v:.2f} s" for k, v in self.startup_s.items()),
        )

    def _phase_done(self, name: str, since: float) -> float:
        """Records a start-up phase's seconds (after the device's queued work) and returns the time now."""
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        now = time.perf_counter()
        self.startup_s[name] = now - since
        logger.info("start-up: %s %.2f s", name, now - since)  # a long load or capture shows where it is
        return now

    def new_decode_graphs(self) -> DecodeGraphs:
        """Decode graphs over this worker's persistent state, not yet captured (`capture` does that; an
        uncaptured one runs its step eagerly, which the CPU tests use)."""
        parts = DecodeStepParts(
            self.model, self.kv_caches, self.states, self.block_tables, self.model_state, self.controls
        )
        return DecodeGraphs(parts, self.config.scheduler.max_num_seqs)

    # -- applying the message -------------------------------------------------------------------------

    def _check_new(self, req: NewRequest) -> str | None:
        """Why this worker must not take `req` (a bad value that got past the scheduler's checks), or
        None. A request refused here fails alone; a token id outside the vocabulary would otherwise
        index the embedding out of bounds, which on CUDA takes the whole device context down."""
        try:
            req.sampling.validate(self.model.config.vocab_size)
        except InvalidRequest as e:
            return f"invalid request: {e}"
        ids = np.frombuffer(req.token_ids, dtype="<i4")
        vocab = self.model.config.vocab_size
        if ids.size == 0 or ids.size > self.states.max_model_len:
            return f"invalid request: {ids.size} token ids (limit {self.states.max_model_len})"
        if int(ids.min()) < 0 or int(ids.max()) >= vocab:
            return f"invalid request: token ids must be in [0, {vocab})"
        return None

    def _remove(self, req_id: str) -> None:
        slot = self.states.remove(req_id)
        if slot is not None:
            self.controls.remove(slot)
            self.structured.remove(slot)

    def _apply(self, msg: StepMessage) -> tuple[list[str], list[int], dict[str, str]]:
        """Applies the message; returns the rows to compute (ids, tokens each) and the new requests
        refused (req_id -> why): those are not computed and their rows answer FAILED_ROW."""
        for req_id in (*msg.finished_ids, *msg.preempted_ids):
            self._remove(req_id)
            self._refused.pop(req_id, None)
        rows: list[str] = []
        num_scheduled: list[int] = []
        refused: dict[str, str] = {}
        for req in msg.new_requests:
            why = self._check_new(req)
            matcher = None
            if why is None and req.sampling.structured:
                matcher, why = self.structured.new_matcher(req)
            if why is not None:
                refused[req.req_id] = self._refused[req.req_id] = why
                continue
            slot = self.states.add(req)
            self.controls.add(slot, req, self.states.all_token_ids[slot, : self.states.num_tokens[slot]])
            if matcher is not None:
                self.structured.add(slot, matcher)
            self.block_tables.set_row(slot, req.block_ids)
            self.model_state.add_request(slot, req.replay_start)
            if req.num_scheduled > 0:
                rows.append(req.req_id)
                num_scheduled.append(req.num_scheduled)
        for delta in msg.running:
            slot = self.states.slot_of.get(delta.req_id)
            if slot is None and delta.req_id in self._refused:  # refused when admitted unscheduled
                refused[delta.req_id] = self._refused[delta.req_id]
                continue
            if slot is None:
                raise KeyError(f"running: request {delta.req_id!r} is not on this worker")
            self.block_tables.append(slot, delta.new_block_ids)
            rows.append(delta.req_id)
            num_scheduled.append(delta.num_scheduled)
        return rows, num_scheduled, refused

    # -- the step -------------------------------------------------------------------------------------

    def execute(self, msg: StepMessage) -> StepResult:
        """One step, start to answer."""
        return self.finish(self.launch(msg))

    @torch.inference_mode()
    def launch(self, msg: StepMessage) -> PendingStep:
        """Applies the message and queues the step's device work; returns without waiting for a graph
        decode step's device work (its answer is read by `finish`). Other steps are done on return.

        A caller may launch the next message before finishing this one (async scheduling): this step's
        sampled ids are appended to the device history before the next step reads them (one stream), and
        the host mirrors of lengths advance here, at launch.
        """
        t0 = self._phase_mark() if self.profile else time.perf_counter_ns()
        rows, num_scheduled, refused = self._apply(msg)
        pending = self._launch_rows(msg.step_id, rows, num_scheduled, t0)
        if refused:
            pending.errors.update(refused)
            pending.row_order = [r.req_id for r in msg.new_requests if r.num_scheduled > 0]
            pending.row_order += [d.req_id for d in msg.running]
        return pending

    def _launch_rows(self, step_id: int, rows: list[str], num_scheduled: list[int], t0: int) -> PendingStep:
        if not rows:
            if self.profile:
                self.last_phases = (self._phase_mark() - t0, 0, 0)
            return PendingStep(t0, StepResult(step_id=step_id, req_ids=[], sampled=b"", execute_ns=0))
        states = self.states
        self.block_tables.commit()
        if self.graphs is not None and self.logit_recorder is None:
            decode_rows = self._graph_decode_rows(rows, num_scheduled)
            if decode_rows is not None:
                return self._graph_decode(step_id, rows, *decode_rows, t0)
        states.sync_num_computed()
        batch = InputBatch.build(states, rows, num_scheduled)
        model_state = self.model_state
        lookback, meta = model_state.build_metadata(
            states,
            self.block_tables,
            batch.idx_mapping,
            batch.query_start_loc,
            batch.seq_lens,
            batch.positions,
            batch.max_query_len,
            replay_start=model_state.replay_starts(batch),
        )
        if self.profile:
            t_prepared = self._phase_mark()
        hidden = self.model(batch.input_ids, batch.positions, lookback, meta, self.kv_caches)
        if self.logit_recorder is not None:
            self._record_logits(batch, hidden)
        logits = self.model.compute_logits(hidden[batch.logits_indices])
        prompt_lp = self._prompt_logprob_inputs(batch, hidden)
        if self.profile:
            t_forward = self._phase_mark()
        sampled, errors, lp = self._sample(batch, logits, prompt_lp)
        if self.structured.any_enabled(batch.idx_mapping_np):  # the matchers take the kept ids
            self._accept_structured(rows, batch.idx_mapping_np, sampled, errors, batch.should_sample_np)
        states.num_computed[batch.idx_mapping_np] += batch.num_scheduled_np
        if self.profile:
            t_sampled = self._phase_mark()
            self.last_phases = (t_prepared - t0, t_forward - t_prepared, t_sampled - t_forward)
        result = StepResult(step_id=step_id, req_ids=rows, sampled=ids_to_bytes(sampled.tolist()))
        if lp is not None:
            result.logprobs, result.prompt_logprobs = lp
        return PendingStep(t0, result, errors=errors)

    def finish(self, pending: PendingStep) -> StepResult:
        """Waits for a launched step's sampled ids (if its device work is still running); its answer.

        Rows that failed (FAILED_ROW) carry why in `errors`; requests refused at launch get a FAILED_ROW
        row each, in the message's row order."""
        result = pending.result
        if result is None:
            pending.ready.synchronize()
            ks = pending.logprob_ks
            logprobs: dict[str, bytes] = {}
            if ks is None:
                ids = pending.sampled_host.tolist()
            else:
                host = pending.sampled_host.numpy()
                ids = host[:, ID_COL].tolist()
                for i, (r, k) in enumerate(zip(pending.req_ids, ks, strict=True)):
                    if k is not None and ids[i] != FAILED_ROW:
                        logprobs[r] = record(host[i], k)
            result = StepResult(
                step_id=pending.step_id,
                req_ids=pending.req_ids,
                sampled=ids_to_bytes(ids),
                logprobs=logprobs,
            )
        sampled = None
        if pending.row_order is not None:
            got = dict(zip(result.req_ids, bytes_to_ids(result.sampled), strict=True))
            sampled = [got.get(r, FAILED_ROW) for r in pending.row_order]
            result.req_ids = pending.row_order
            result.sampled = ids_to_bytes(sampled)
        # A byte search first: ids are < 2**24, so only an aligned FAILED_ROW can match it.
        if pending.errors or FAILED_ROW.to_bytes(4, "little", signed=True) in result.sampled:
            sampled = sampled or bytes_to_ids(result.sampled)
            errors = {
                r: pending.errors.get(r, NONFINITE_LOGITS)
                for r, t in zip(result.req_ids, sampled, strict=True)
                if t == FAILED_ROW
            }
            result.errors = errors
        result.execute_ns = time.perf_counter_ns() - pending.t0
        return result

    # -- decode steps through a captured graph --------------------------------------------------------

    def _graph_decode_rows(
        self, rows: list[str], num_scheduled: list[int]
    ) -> tuple[np.ndarray, np.ndarray] | None:
        """The rows' state slots and positions when the step can replay a graph: every row one decode token
        that reaches the end of its history (so it samples), past its prefill (no replay floor), within a
        captured size and below max_model_len. None otherwise (the eager path then runs it, or raises)."""
        b = len(rows)
        if sum(num_scheduled) != b or self.graphs.size_for(b) is None:
            return None
        states = self.states
        slot_of = states.slot_of
        slots = np.fromiter((slot_of[r] for r in rows), dtype=np.int64, count=b)
        starts = states.num_computed[slots]
        if (
            np.any(starts + 1 != states.num_tokens[slots])
            or np.any(starts < states.prefill_len[slots])
            or np.any(starts + 1 >= states.max_model_len)
        ):
            return None
        return slots, starts

    def _graph_decode(
        self,
        step_id: int,
        rows: list[str],
        slots: np.ndarray,  # int64 [B]: state slots
        positions: np.ndarray,  # int64 [B]: each row's query position (its chunk start)
        t0: int,
    ) -> PendingStep:
        states = self.states
        graphs = self.graphs
        b = slots.shape[0]
        # Logit controls in the batch: the graph variant that applies them (its logits carry them).
        controlled = self.controls.any_enabled(slots)
        # Logprobs: a greedy batch replays the variant that also computes them in the step; a batch that
        # samples on the host side computes them after that, from the same logits.
        ks = [states.sampling[s].logprobs for s in slots]
        want_lp = any(k is not None for k in ks)
        # Structured rows: their token masks apply to the graph's logits on the host-side sampling path.
        structured = self.structured.any_enabled(slots)
        all_greedy = not structured and all(is_greedy(states.sampling[s]) for s in slots)
        if self.profile:
            t_prepared = self._phase_mark()
        if want_lp and all_greedy:
            graphs.replay(slots, positions, controlled, logprobs=True)
        else:
            graphs.replay(slots, positions, controlled)
        if self.profile:
            t_forward = self._phase_mark()
        errors: dict[str, str] = {}
        if all_greedy:
            sampled = graphs.sampled[:b]  # FAILED_ROW where a row's logits were not finite
        else:  # sample on the host side from the graph's logits; overwrite the appended argmax
            sampled, failures, _ = self._sample_rows(
                slots, graphs.sampling_logits(b), graphs.sampled[:b], controlled_already=True
            )
            errors = {rows[i]: why for i, why in failures.items()}
            self._append_history(slots, positions + 1, sampled)
        if controlled:  # the output counts of the penalties, from the ids kept
            self.controls.count(graphs.staged_slots(b), sampled)
        if want_lp:  # the packed rows carry the sampled ids: still one copy back
            packed = graphs.lp_out[:b] if all_greedy else compute_logprobs(graphs.sampling_logits(b), sampled)
            host, ready = graphs.copy_packed(packed)
        else:
            host, ready = graphs.copy_sampled(sampled)
        states.num_tokens[slots] += 1
        states.num_computed[slots] += 1
        if structured:  # the matchers need these ids before the next step's masks: wait for them now
            ready.synchronize()
            ids = host.numpy()[:, ID_COL] if want_lp else host.numpy()  # views: FAILED_ROW lands in host
            self._accept_structured(rows, slots, ids, errors)
        if self.profile:
            t_sampled = self._phase_mark()
            self.last_phases = (t_prepared - t0, t_forward - t_prepared, t_sampled - t_forward)
        return PendingStep(t0, None, step_id, rows, host, ready, errors, logprob_ks=ks if want_lp else None)

    def _accept_structured(
        self,
        rows: list[str],
        slots: np.ndarray,
        ids: np.ndarray,  # the step's ids on the host, written in place: FAILED_ROW for failed rows
        errors: dict[str, str],
        keep: np.ndarray | None = None,  # bool [B]: rows whose id is kept (None: all)
    ) -> None:
        """The structured rows' matchers consume this step's ids; a row whose id the grammar rejects
        fails alone (a reason the sampler already gave wins)."""
        for i, why in self.structured.accept(slots, ids, keep).items():
            ids[i] = FAILED_ROW
            errors.setdefault(rows[i], why)

    def _phase_mark(self) -> int:
        """Profile mode's clock: waits for the device's queued work first, so it is charged to the phase
        that queued it rather than to the next one that blocks on it."""
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        return time.perf_counter_ns()

    def _prompt_logprob_inputs(
        self, batch: InputBatch, hidden: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor, list[tuple[str, int, int]]] | None:
        """For rows whose request asks for prompt logprobs: the logits of their chunk's positions p with
        p + 1 < prompt length (fp32 [N, V]), the prompt token at p + 1 of each (int64 [N]), and per row
        (req_id, k, positions). None when no row has such positions."""
        if not batch.is_prefilling_np.any():  # prompt positions lie in prefill chunks only
            return None
        states = self.states
        idx: list[np.ndarray] = []
        pos: list[np.ndarray] = []
        tslots: list[np.ndarray] = []
        rows: list[tuple[str, int, int]] = []
        qsl = 0
        for b, slot in enumerate(batch.idx_mapping_np.tolist()):
            n = int(batch.num_scheduled_np[b])
            k = states.sampling[slot].prompt_logprobs
            start = int(batch.chunk_start_np[b])
            end = min(start + n, int(states.num_prompt_tokens[slot]) - 1)
            if k is not None and end > start:
                idx.append(np.arange(qsl, qsl + end - start))
                pos.append(np.arange(start + 1, end + 1))
                tslots.append(np.full(end - start, slot))
                rows.append((batch.req_ids[b], k, end - start))
            qsl += n
        if not rows:
            return None
        dev = self.device
        at = torch.from_numpy(np.concatenate([np.concatenate(a) for a in (idx, tslots, pos)])).to(dev)
        m = at.shape[0] // 3
        logits = self.model.compute_logits(hidden[at[:m]])
        targets = self.states.all_token_ids[at[m : 2 * m], at[2 * m :]].to(torch.int64)
        return logits, targets, rows

    def _sample(
        self,
        batch: InputBatch,
        logits: torch.Tensor,
        prompt_lp: tuple[torch.Tensor, torch.Tensor, list[tuple[str, int, int]]] | None = None,
    ) -> tuple[np.ndarray, dict[str, str], tuple[dict[str, bytes], dict[str, bytes]] | None]:
        """Samples every row, keeps the rows whose chunk reached the end of the history, appends them.
        Returns the ids (-1 for rows not kept), why each kept row that failed did, and the logprob
        records (sampled tokens, prompt positions: `_prompt_logprob_inputs`) when some row asks; those
        are computed in one `compute_logprobs` call and come back in the sampled ids' copy."""
        states = self.states
        slots = batch.idx_mapping_np
        sampled, failures, sample_logits = self._sample_rows(slots, logits, rows=batch.should_sample_np)
        keep = batch.should_sample_np
        errors = {batch.req_ids[i]: why for i, why in failures.items() if keep[i]}
        if keep.any():
            keep_rows = np.nonzero(keep)[0]
            kslots = slots[keep_rows]
            kpos = states.num_tokens[kslots]
            if np.any(kpos >= states.max_model_len):
                raise ValueError(f"max_model_len: a request reached {states.max_model_len} tokens")
            kept = sampled[torch.from_numpy(keep_rows).to(self.device)]
            self._append_history(kslots, kpos, kept)
            if self.controls.any_enabled(kslots):
                self.controls.count(torch.from_numpy(kslots).to(self.device), kept)
            states.num_tokens[kslots] += 1
        lp_rows = [
            i for i, s in enumerate(slots.tolist()) if keep[i] and states.sampling[s].logprobs is not None
        ]
        if not lp_rows and prompt_lp is None:
            host = sampled.cpu().numpy()
            return np.where(keep, host, -1), errors, None
        parts_logits, parts_ids = [], []
        if prompt_lp is not None:
            parts_logits.append(prompt_lp[0])
            parts_ids.append(prompt_lp[1])
        if lp_rows:
            at = torch.tensor(lp_rows, device=self.device)
            parts_logits.append(sample_logits[at].float())
            parts_ids.append(sampled[at])
        packed = compute_logprobs(torch.cat(parts_logits), torch.cat(parts_ids))
        b = sampled.shape[0]
        flat = torch.cat([sampled.to(torch.int32), packed.flatten()]).cpu().numpy()  # one copy back
        host = flat[:b].astype(np.int64)
        packed_host = flat[b:].reshape(packed.shape)
        prompt_records: dict[str, bytes] = {}
        at = 0
        for req_id, k, n in prompt_lp[2] if prompt_lp is not None else ():
            prompt_records[req_id] = records(packed_host[at : at + n], k)
            at += n
        sample_records: dict[str, bytes] = {}
        for j, i in enumerate(lp_rows):
            if host[i] != FAILED_ROW:
                sample_records[batch.req_ids[i]] = record(
                    packed_host[at + j], states.sampling[slots[i]].logprobs
                )
        return np.where(keep, host, -1), errors, (sample_records, prompt_records)

    def _sample_rows(
        self,
        slots: np.ndarray,
        logits: torch.Tensor,
        greedy: torch.Tensor | None = None,
        controlled_already: bool = False,
        rows: np.ndarray | None = None,  # bool [B]: the rows whose id is kept (structured masks: None all)
    ) -> tuple[torch.Tensor, dict[int, str], torch.Tensor]:
        """One id per row (int64 [B], on the device) from raw logits fp32 [B, V] (or logits the controls
        were applied to already, with `controlled_already`), with each row's request's sampling
        parameters; FAILED_ROW for a row that failed, and {row: why} for those with a reason. Also
        returns the logits the sampler started from (after the controls, before the grammar masks):
        what logprobs are taken from."""
        states = self.states
        params = [states.sampling[s] for s in slots]
        out_len = states.num_tokens[slots] - states.num_prompt_tokens[slots]
        if not controlled_already and self.controls.any_enabled(slots):
            dev = self.device
            logits = self.controls.apply(
                logits, torch.from_numpy(slots).to(dev), torch.from_numpy(out_len).to(dev)
            )
            greedy = None
        controlled = logits
        if self.structured.any_enabled(slots):  # grammar masks, after the controls, before any sampling
            logits = self.structured.apply(logits, slots, rows)
            greedy = None
        sampled, failures = self.sampler(logits, params, out_len.tolist(), greedy)
        return sampled, failures, controlled

    def _append_history(self, slots: np.ndarray, positions: np.ndarray, ids: torch.Tensor) -> None:
        """Writes ids (int [N], on the device) into the token history at (slots, positions), no sync.
        A failed row's FAILED_ROW is stored as 0: a step planned on top of this one (async scheduling)
        may still read it as an input id before the scheduler ends that request."""
        dev = self.device
        write_token_ids(
            self.states.all_token_ids,
            torch.from_numpy(slots).to(dev),
            torch.from_numpy(positions).to(dev),
            ids,
        )

    def _record_logits(self, batch: InputBatch, hidden: torch.Tensor) -> None:
        all_logits = self.model.compute_logits(hidden)
        qsl = np.concatenate([[0], np.cumsum(batch.num_scheduled_np)])
        for b, req_id in enumerate(batch.req_ids):
            self.logit_recorder(
                req_id, int(batch.chunk_start_np[b]), all_logits[qsl[b] : qsl[b + 1]].float().cpu()
            )

    def reset(self) -> int:
        """Drops every request (their device state is stale after a lost step); returns how many."""
        ids = list(self.states.slot_of)
        for req_id in ids:
            self._remove(req_id)
        self._refused.clear()
        return len(ids)

    # -- health ---------------------------------------------------------------------------------------

    def num_active(self) -> int:
        return self.states.num_active
