"""One step's batch: which state slot each batch row is, where its chunk lies, and its tokens.

Built on the host from the host mirrors in `RequestStates` (no device reads), then moved to the device
in one copy of a packed int64 buffer. Input ids are gathered on the device from the token history.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from raystate.worker.requests import RequestStates


@dataclass
class InputBatch:
    req_ids: list[str]
    num_reqs: int
    num_tokens: int
    max_query_len: int
    idx_mapping_np: np.ndarray  # int64 [B]: batch row -> state slot
    num_scheduled_np: np.ndarray  # int64 [B]
    chunk_start_np: np.ndarray  # int64 [B]: num_computed before this step
    is_prefilling_np: np.ndarray  # bool [B]
    should_sample_np: np.ndarray  # bool [B]: the chunk reaches the end of the known tokens
    idx_mapping: torch.Tensor  # int64 [B]
    query_start_loc: torch.Tensor  # int32 [B + 1]
    seq_lens: torch.Tensor  # int32 [B]
    positions: torch.Tensor  # int64 [T]
    token_slots: torch.Tensor  # int64 [T]: state slot of each token
    input_ids: torch.Tensor  # int32 [T]
    logits_indices: torch.Tensor  # int64 [B]: each row's last token

    @classmethod
    def build(cls, states: RequestStates, req_ids: list[str], num_scheduled: list[int]) -> InputBatch:
        num_reqs = len(req_ids)
        slots = np.fromiter((states.slot_of[r] for r in req_ids), dtype=np.int64, count=num_reqs)
        n_sched = np.asarray(num_scheduled, dtype=np.int64).reshape(num_reqs)
        starts = states.num_computed[slots]
        ends = starts + n_sched
        if np.any(ends > states.num_tokens[slots]):
            bad = int(np.argmax(ends > states.num_tokens[slots]))
            raise ValueError(
                f"num_scheduled: row {req_ids[bad]!r} schedules past its known tokens "
                f"({int(ends[bad])} > {int(states.num_tokens[slots][bad])})"
            )
        qsl = np.zeros(num_reqs + 1, dtype=np.int64)
        np.cumsum(n_sched, out=qsl[1:])
        num_tokens = int(qsl[-1])
        row_of_token = np.repeat(np.arange(num_reqs), n_sched)
        positions = np.arange(num_tokens, dtype=np.int64) - qsl[row_of_token] + starts[row_of_token]
        token_slots = slots[row_of_token]
        # One packed host buffer, one copy to the device.
        packed = np.concatenate([slots, qsl, ends, positions, token_slots, qsl[1:] - 1])
        dev = torch.from_numpy(packed).to(states.device, non_blocking=True)
        b, t = num_reqs, num_tokens
        idx_mapping = dev[:b]
        query_start_loc = dev[b : 2 * b + 1].to(torch.int32)
        seq_lens = dev[2 * b + 1 : 3 * b + 1].to(torch.int32)
        positions_d = dev[3 * b + 1 : 3 * b + 1 + t]
        token_slots_d = dev[3 * b + 1 + t : 3 * b + 1 + 2 * t]
        logits_indices = dev[3 * b + 1 + 2 * t :]
        input_ids = states.all_token_ids[token_slots_d, positions_d]
        return cls(
            req_ids=list(req_ids),
            num_reqs=num_reqs,
            num_tokens=num_tokens,
            max_query_len=int(n_sched.max()) if num_reqs else 0,
            idx_mapping_np=slots,
            num_scheduled_np=n_sched,
            chunk_start_np=starts,
            is_prefilling_np=starts < states.prefill_len[slots],
            should_sample_np=ends == states.num_tokens[slots],
            idx_mapping=idx_mapping,
            query_start_loc=query_start_loc,
            seq_lens=seq_lens,
            positions=positions_d,
            token_slots=token_slots_d,
            input_ids=input_ids,
            logits_indices=logits_indices,
        )
