"""CUDA graphs for decode-only steps: the whole step on the device is one graph replay.

A decode step of the bench model launches hundreds of small kernels; eagerly, the host cannot issue them
as fast as the GPU runs them, and even the host-side input preparation (a dozen small copies, gathers and
casts) costs more than the forward's launches once those are replayed. So each graph, captured once per
padded batch size (1, 2, 4, ... max_num_seqs), holds the step's device work from its host inputs on:

    staged row data (one pinned host -> device copy per step: state slot, position, seq len, query start)
    -> chunk starts scattered into the token-state's device copy (engram models, whose lookback gather
    reads it) -> input ids gathered from the token history -> engram lookback, slot mappings, block
    tables gathered per row and attention metadata (the model state's `build_metadata`, the eager step's
    own) -> forward -> logits -> greedy argmax (FAILED_ROW where a row's logits are not finite) -> the
    argmax appended to the history (one launch: `raystate.kernels.token_history`). The plain variant
    keeps the head's output in the model's dtype (the greedy ids are read from it; at a 262k vocabulary
    an fp32 copy costs ~1% of a step); the others, and host-side sampling after it (`sampling_logits`),
    have fp32 logits.

The host's share per step is filling the staging buffer, one copy, one replay, one copy of the sampled
ids back. Rows past the batch size are padding: they point at the token state's scratch slot (never a
request's), have no query tokens and a zero sequence length, so they write no KV and no request's
history. A batch with any non-greedy row samples from the graph's logits on the host side afterwards and
overwrites the appended argmax. The lookback and replay-start buffers are the model state's persistent
tensors and the slot mappings the block tables' persistent buffer, so graphs read the same addresses every
replay; decode rows have no replay floor.

Logit controls (penalties, logit_bias, min_tokens: `raystate.worker.penalties`) are applied to the raw
logits inside the step, before the argmax, so the appended id and the logits left for host-side sampling
carry them. Each size is captured twice, without and with the controls; a step replays the controlled
variant only when a row of its batch has some (a host-side flag per slot). Two variants rather than
one that always applies them: the controls read and write several [B, V] tensors (the output counts,
the seen mask, the bias and stop masks), memory traffic comparable to a small layer's, which the common
batch with no controls should not pay; the graphs share one memory pool, so the second set costs only
capture time. Rows without controls are bit-identical either way.

Logprobs (`raystate.worker.logprobs`): a third flag, captured likewise. Its variants also run
`compute_logprobs` on the step's logits (after the controls) and greedy ids, into the persistent
`lp_out` int32 [Bmax, WIDTH] whose column ID_COL is the sampled id, so a step with logprobs copies that
one buffer back instead of the ids: still one device -> host copy, no extra sync. Variants rather than
always computing them: at batch 64 and a 262k vocabulary they cost about 2% of a Gemma-3-4B decode step
(BENCHMARKS.md), which batches without logprobs (the common case) should not pay; with them the cost is
`compute_logprobs`'s one pass over the logits. A batch that samples on the host side
replays a variant without them and computes them there, from the same logits, after sampling.

A graph is handed what its step touches (`DecodeStepParts`), never the worker.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from raystate.kernels.token_history import write_token_ids
from raystate.worker.block_table import BlockTables
from raystate.worker.logprobs import WIDTH, compute_logprobs
from raystate.worker.model_state import HybridModelState
from raystate.worker.penalties import LogitControls
from raystate.worker.requests import RequestStates
from raystate.worker.sampler import greedy_checked


def capture_sizes(max_num_seqs: int) -> list[int]:
    sizes = []
    b = 1
    while b < max_num_seqs:
        sizes.append(b)
        b *= 2
    sizes.append(max_num_seqs)
    return sizes


@dataclass(frozen=True)
class DecodeStepParts:
    """What a decode step's device work reads and writes. All of it is allocated once, so a replay
    touches the addresses its capture saw."""

    model: torch.nn.Module
    kv_caches: list[tuple[torch.Tensor, torch.Tensor]]  # per layer: k, v
    states: RequestStates  # token history, device chunk starts, the scratch slot of padding rows
    block_tables: BlockTables  # device tables and the persistent slot-mapping buffer
    model_state: HybridModelState  # the persistent lookback buffer and `build_metadata`
    controls: LogitControls | None = None  # per-slot penalties, bias, min_tokens (None: no such variant)


class DecodeGraphs:
    def __init__(self, parts: DecodeStepParts, max_num_seqs: int) -> None:
        self.parts = parts
        self.sizes = capture_sizes(max_num_seqs)
        max_b = self.max_b = self.sizes[-1]
        dev = parts.states.device
        # Staging: slots and positions as int64 [Bmax] each (torch's indexing takes int64), then seq_lens
        # [Bmax] and query_start_loc [Bmax + 1] as int32 in the bytes after them (the attention kernels'
        # dtype, read through an int32 view: no cast launches in the step). One buffer, so one copy, in
        # pinned memory on CUDA so that it is asynchronous.
        pin = dev.type == "cuda"
        n = 3 * max_b + 1  # 2 Bmax int64, then 2 Bmax + 1 int32 in the Bmax + 1 int64 after them
        self.staged = torch.zeros(n, dtype=torch.int64, device=dev)  # int64 [3 Bmax + 1]
        vocab_size = parts.model.config.vocab_size
        self.logits = torch.zeros((max_b, vocab_size), dtype=torch.float32, device=dev)  # fp32 [Bmax, V]
        # The head's output in the model's dtype: the plain variant's greedy ids are taken from it, and
        # it becomes fp32 logits only when a batch samples on the host side (`sampling_logits`).
        head_dtype = parts.model.lm_head.weight.dtype
        if head_dtype == torch.float32:
            self.head_out = self.logits
        else:
            self.head_out = torch.zeros((max_b, vocab_size), dtype=head_dtype, device=dev)  # [Bmax, V]
        self._logits_written = False  # whether the last replay wrote fp32 logits into `logits`
        self.sampled = torch.zeros(max_b, dtype=torch.int64, device=dev)  # greedy ids [Bmax]
        # Two of each host buffer, used in turn: a step may be launched before the last one is finished.
        self.host_bufs = [torch.zeros(n, dtype=torch.int64, pin_memory=pin) for _ in range(2)]  # [3 Bmax + 1]
        self.sampled_bufs = [torch.zeros(max_b, dtype=torch.int64, pin_memory=pin) for _ in range(2)]
        # Logprob variants: packed rows (sampled id included), and their host buffers, used in turn.
        self.lp_out = torch.zeros((max_b, WIDTH), dtype=torch.int32, device=dev)  # int32 [Bmax, WIDTH]
        self.lp_bufs = [torch.zeros((max_b, WIDTH), dtype=torch.int32, pin_memory=pin) for _ in range(2)]
        self._turn = 0
        # (size, controlled, logprobs) -> graph
        self.graphs: dict[tuple[int, bool, bool], torch.cuda.CUDAGraph] = {}
        self.pool = None
        self.num_replays = 0
        self.num_eager_steps = 0  # steps of sizes not captured (CPU tests)

    # -- the captured step ----------------------------------------------------------------------------

    def _views(self, size: int) -> tuple[torch.Tensor, ...]:
        """slots, positions (int64 [size]), seq_lens (int32 [size]), query_start_loc (int32 [size + 1])."""
        m, st = self.max_b, self.staged
        st32 = st[2 * m :].view(torch.int32)
        return st[:size], st[m : m + size], st32[:size], st32[m : m + size + 1]

    def staged_slots(self, b: int) -> torch.Tensor:
        """The slots of the last replayed step's first b rows (int64 [b], on the device)."""
        return self.staged[:b]

    def _step(self, size: int, controlled: bool = False, logprobs: bool = False) -> None:
        """Everything a decode step does on the device, for `size` rows (captured, then replayed); with
        `controlled`, the rows' logit controls are applied to the raw logits first; with `logprobs`, the
        greedy ids' logprob rows are packed into `lp_out`."""
        p = self.parts
        states = p.states
        slots, positions, seq_lens, qsl = self._views(size)  # int64 [size] x2, int32 [size], [size + 1]
        if p.model_state.lookback_depth:
            # A decode row's chunk starts at its position: the lookback gather reads the device copy of
            # chunk starts (its only reader; an eager step copies the host's in first).
            states.num_computed_tokens[slots] = positions.to(torch.int32)
        input_ids = states.all_token_ids[slots, positions]  # int32 [size]
        # No replay starts: decode rows have no replay floor, and the graph captures no host copy.
        lookback, meta = p.model_state.build_metadata(
            states, p.block_tables, slots, qsl, seq_lens, positions, max_query_len=1
        )
        hidden = p.model(input_ids, positions, lookback, meta, p.kv_caches)
        if controlled or logprobs:
            # fp32 [size, V]: the head's output converted into the buffer that host-side sampling reads
            logits = p.model.compute_logits(hidden, out=self.logits[:size])
        else:  # [size, V] in the model's dtype: the greedy ids need no fp32 copy
            logits = p.model.compute_head(hidden, out=self.head_out[:size])
        if controlled:  # this row's output so far: its history (positions + 1) less its prompt
            logits.copy_(p.controls.apply(logits, slots, p.controls.num_output(slots, positions + 1)))
        sampled = greedy_checked(logits, out=self.sampled[:size])  # FAILED_ROW: logits not finite
        # Each id goes one past its row's input position. Padding rows write to the scratch slot's
        # history, which no request reads; a failed row writes 0, a valid id, for a step planned on top
        # of this one to read.
        write_token_ids(states.all_token_ids, slots, positions, sampled, offset=1)
        if logprobs:
            self.lp_out[:size].copy_(compute_logprobs(logits, sampled))

    def _stage_padding(self) -> None:
        """Every row padding: what capture runs on (nothing a request owns is read or written)."""
        host = self.host_bufs[self._turn]
        m, h = self.max_b, host.numpy()
        h[:m] = self.parts.states.scratch_slot
        h[m:] = 0
        self.staged.copy_(host)

    @property
    def variants(self) -> tuple[tuple[bool, bool], ...]:
        """(controlled, logprobs) pairs captured per size."""
        controlled = (False, True) if self.parts.controls is not None else (False,)
        return tuple((c, lp) for c in controlled for lp in (False, True))

    @torch.inference_mode()
    def capture(self) -> None:
        model_state = self.parts.model_state
        model_state.prepare_dummy_inputs(model_state.max_num_reqs)
        self._stage_padding()
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            for controlled, logprobs in self.variants:
                for size in reversed(self.sizes):
                    self._step(size, controlled, logprobs)  # warm-up: Triton compiles outside the capture
        torch.cuda.current_stream().wait_stream(stream)
        for controlled, logprobs in self.variants:
            for size in reversed(self.sizes):
                graph = torch.cuda.CUDAGraph()
                with torch.cuda.graph(graph, pool=self.pool):
                    self._step(size, controlled, logprobs)
                if self.pool is None:
                    self.pool = graph.pool()
                self.graphs[size, controlled, logprobs] = graph
        torch.cuda.synchronize()

    # -- a step ---------------------------------------------------------------------------------------

    def size_for(self, num_reqs: int) -> int | None:
        for s in self.sizes:
            if s >= num_reqs:
                return s
        return None

    def replay(
        self,
        slots: np.ndarray,  # int64 [B]: state slots of the batch rows
        positions: np.ndarray,  # int64 [B]: each row's one query position (= its chunk start)
        controlled: bool = False,  # some row has logit controls: the variant that applies them
        logprobs: bool = False,  # the variant that also packs the greedy ids' logprobs into `lp_out`
    ) -> int:
        """Stages the rows (one copy) and replays the graph of the next captured size up; returns that size.
        Before `capture` (or on the CPU) the same step runs eagerly instead.

        The sampled greedy ids are then in `sampled[:B]` and appended to the history; fp32 logits in
        `sampling_logits(B)`. Nothing here waits for the device.
        """
        b = slots.shape[0]
        size = self.size_for(b)
        self._turn ^= 1
        host = self.host_bufs[self._turn]  # the other step's buffer may still be copying
        m, h = self.max_b, host.numpy()
        h[:b] = slots
        h[b:size] = self.parts.states.scratch_slot
        h[m : m + b] = positions
        h[m + b : m + size] = 0
        h32 = h[2 * m :].view(np.int32)  # seq_lens, query_start_loc: int32, as `_views` reads them
        h32[:b] = positions + 1
        h32[b:size] = 0
        qsl = h32[m : m + size + 1]
        qsl[: b + 1] = np.arange(b + 1)
        qsl[b + 1 :] = b  # padding rows: no query tokens
        self.staged.copy_(host, non_blocking=True)
        if controlled and self.parts.controls is None:
            raise ValueError("controlled: these graphs have no logit controls")
        graph = self.graphs.get((size, controlled, logprobs))
        self._logits_written = controlled or logprobs or self.head_out is self.logits
        if graph is not None:
            graph.replay()
            self.num_replays += 1
        else:  # not captured (CPU tests of this path): the same step, run eagerly
            self._step(size, controlled, logprobs)
            self.num_eager_steps += 1
        return size

    def sampling_logits(self, b: int) -> torch.Tensor:  # fp32 [b, V]
        """The last replay's logits in fp32 (with its logit controls applied, for a controlled variant),
        for sampling and logprobs on the host side. The plain variant keeps only the head's output in
        the model's dtype; it is converted here, on the stream after the replay."""
        if not self._logits_written:
            self.logits[:b].copy_(self.head_out[:b])
            self._logits_written = True  # once: the caller may mask them in place
        return self.logits[:b]

    def copy_sampled(self, sampled: torch.Tensor) -> tuple[torch.Tensor, ReadyEvent]:
        """Queues the copy of this step's sampled ids (int64 [B] on the device) to host memory; returns
        the host tensor and an event to wait on before reading it. Nothing here waits."""
        out = self.sampled_bufs[self._turn][: sampled.shape[0]]
        out.copy_(sampled, non_blocking=True)
        return out, ReadyEvent.record(sampled.device)

    def copy_packed(self, packed: torch.Tensor) -> tuple[torch.Tensor, ReadyEvent]:
        """`copy_sampled` for a step with logprobs: its packed rows (int32 [B, WIDTH] on the device, the
        sampled ids in column ID_COL) in place of the ids."""
        out = self.lp_bufs[self._turn][: packed.shape[0]]
        out.copy_(packed, non_blocking=True)
        return out, ReadyEvent.record(packed.device)


class ReadyEvent:
    """Marks the point in the device's stream after which a step's host copy is complete (a no-op on
    the CPU, where the copy is done when it returns)."""

    def __init__(self, event: torch.cuda.Event | None) -> None:
        self.event = event

    @classmethod
    def record(cls, device: torch.device) -> ReadyEvent:
        if device.type != "cuda":
            return cls(None)
        event = torch.cuda.Event()
        event.record()
        return cls(event)

    def synchronize(self) -> None:
        if self.event is not None:
            self.event.synchronize()
