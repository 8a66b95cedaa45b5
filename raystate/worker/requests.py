"""Per-request state on the worker, one state slot per request.

The token history `all_token_ids[R, L]` lives on the device: prompt plus every generated token, written
when a request arrives and appended by the sampler on the device. The engram lookback is gathered from
it every step, so it never depends on where earlier KV came from. Host mirrors hold what the host needs
to plan a step (lengths, chunk starts) without reading the device.

The device tensors have one extra row, `scratch_slot` = max_num_reqs, never given to a request: the
padding rows of a captured decode graph point at it, so they read and write nothing a request owns.
"""

from __future__ import annotations

import numpy as np
import torch

from raystate.messages import NewRequest, SamplingParams, bytes_to_ids


class RequestStates:
    def __init__(self, max_num_reqs: int, max_model_len: int, device: torch.device) -> None:
        self.max_num_reqs = max_num_reqs
        self.max_model_len = max_model_len
        self.device = device
        self.scratch_slot = max_num_reqs
        # Token history: prompt + generated ids; -1 past the end. The scratch row holds 0s (a valid id).
        self.all_token_ids = torch.full(
            (max_num_reqs + 1, max_model_len), -1, dtype=torch.int32, device=device
        )  # int32 [R + 1, L]
        self.all_token_ids[self.scratch_slot].zero_()
        # Chunk start of each slot (tokens whose KV is computed), on the device for gather_lookback.
        self.num_computed_tokens = torch.zeros(max_num_reqs + 1, dtype=torch.int32, device=device)
        # Host mirrors.
        self.num_computed = np.zeros(max_num_reqs, dtype=np.int64)
        self.num_tokens = np.zeros(max_num_reqs, dtype=np.int64)  # history length
        self.num_prompt_tokens = np.zeros(max_num_reqs, dtype=np.int64)
        # History length when the request (re)arrived: chunks starting below it are prefill chunks.
        self.prefill_len = np.zeros(max_num_reqs, dtype=np.int64)
        self.sampling: list[SamplingParams | None] = [None] * max_num_reqs
        self.req_ids: list[str | None] = [None] * max_num_reqs
        self.slot_of: dict[str, int] = {}
        self._free = list(range(max_num_reqs - 1, -1, -1))

    @property
    def num_active(self) -> int:
        return len(self.slot_of)

    def add(self, req: NewRequest) -> int:
        """Takes a free slot and writes the request's whole history to the device (one copy)."""
        if req.req_id in self.slot_of:
            raise ValueError(f"req_id: {req.req_id!r} is already on this worker")
        if not self._free:
            raise RuntimeError(f"max_num_reqs: all {self.max_num_reqs} state slots are in use")
        ids = bytes_to_ids(req.token_ids)
        if len(ids) > self.max_model_len:
            raise ValueError(f"token_ids: at most max_model_len={self.max_model_len} tokens, got {len(ids)}")
        slot = self._free.pop()
        self.slot_of[req.req_id] = slot
        self.req_ids[slot] = req.req_id
        self.sampling[slot] = req.sampling
        n = len(ids)
        row = torch.frombuffer(bytearray(req.token_ids), dtype=torch.int32)
        self.all_token_ids[slot, :n].copy_(row, non_blocking=True)
        self.all_token_ids[slot, n:].fill_(-1)
        self.num_tokens[slot] = n
        self.prefill_len[slot] = n
        self.num_prompt_tokens[slot] = req.num_prompt_tokens
        self.num_computed[slot] = req.num_computed
        return slot

    def remove(self, req_id: str) -> int | None:
        slot = self.slot_of.pop(req_id, None)
        if slot is None:
            return None
        self.req_ids[slot] = None
        self.sampling[slot] = None
        self._free.append(slot)
        return slot

    def sync_num_computed(self) -> None:
        """Copies the host chunk starts to the device (one copy, no sync)."""
        self.num_computed_tokens[: self.max_num_reqs].copy_(
            torch.from_numpy(self.num_computed.astype(np.int32)), non_blocking=True
        )
