"""Per-request logit controls, applied on the device to a batch's raw logits: penalties, bias, min_tokens.

What each request asks for (`SamplingParams`) is written once, when the request arrives on the worker,
into persistent per-slot device tensors; the step then applies every row's controls in one batched
function over the logits [B, V] (`LogitControls.apply`): no host sync, no per-row Python loop, fixed
shapes, so it also runs inside the captured decode graph. In order, on the raw logits (so greedy requests
are affected too; temperature, top-k, top-p and min_p come after, in the sampler):

0. allowed_token_ids: every other token is -inf (a scatter of the slot's id list into a mask).
   bad_words_token_ids: a sequence's last token is -inf where the output so far ends with the rest of
   it (a one-token sequence: always). Each slot keeps its output's last 15 ids (`recent`, advanced by
   `count` as the counts are), compared with every sequence's prefix at once.
1. logit_bias: the request's (id, value) pairs are added (a scatter_add over a sparse per-slot list).
2. min_tokens: while the output has fewer than min_tokens tokens, EOS (unless ignore_eos) and the
   stop_token_ids are -inf.
3. repetition_penalty p, over tokens of the prompt or the output so far: l / p where l > 0, else l * p.
4. frequency_penalty f and presence_penalty r, over the output so far: l - f * count - r * (count > 0).

Rows of requests with no control are returned untouched (a select, so bit-identical to not calling it),
and a step whose batch has no such row does not call it at all (`any_enabled`, a host-side check).

Per-slot device memory, R = max_num_seqs, plus the scratch slot of padded graph rows, V = vocabulary:
- `counts` int32 [R + 1, V]: each token's count in the output so far (4 (R + 1) V bytes: 67 MB for
  64 slots and a 262144-token vocabulary). Set from the token history when the request arrives and
  advanced on the device by the sampled ids of each step that has a controlled row (`count`).
- `prompt_seen` bool [R + 1, V]: the prompt's tokens ((R + 1) V bytes). "Seen" for the repetition penalty
  is `prompt_seen | counts > 0`.
- logit_bias as ids int64 [R + 1, 300] and values fp32 [R + 1, 300] (padding: id V, value 0, written to a
  column past the vocabulary that is dropped), allowed ids int64 [R + 1, 1024] (padding: V), stop ids
  int64 [R + 1, 1024 + #EOS], and a few [R + 1] vectors (flags, penalty values, min_tokens, prompt
  length).
- bad words, S = 256 sequences of at most T = 16 tokens: prefixes int64 [R + 1, S, T - 1] right-aligned
  (padding -1: any token), last tokens int64 [R + 1, S] (padding V), the output's last T - 1 ids int64
  [R + 1, T - 1] right-aligned (padding -2: no token yet, equal to no id): 2.2 MB for 64 slots.
"""

from __future__ import annotations

import numpy as np
import torch

from raystate.messages import (
    MAX_ALLOWED_TOKEN_IDS,
    MAX_BAD_WORD_SEQUENCES,
    MAX_BAD_WORD_TOKENS,
    MAX_LOGIT_BIAS,
    MAX_STOP_TOKEN_IDS,
    NewRequest,
    SamplingParams,
)

# bad words: a prefix position that any token matches (the sequence is shorter), and an output position
# that has no token yet (matched by no prefix id, nor by the padding)
_ANY_TOKEN = -1
_NO_TOKEN = -2
_PREFIX = MAX_BAD_WORD_TOKENS - 1  # a sequence's tokens before its last


class LogitControls:
    def __init__(
        self, num_slots: int, vocab_size: int, eos_token_ids: tuple[int, ...], device: torch.device
    ) -> None:
        """num_slots: state slots including the scratch slot (never enabled)."""
        self.vocab_size = v = vocab_size
        self.device = device
        self.eos_token_ids = tuple(i for i in eos_token_ids if 0 <= i < v)
        n = num_slots
        self.host_enabled = np.zeros(n, dtype=bool)
        self.enabled = torch.zeros(n, dtype=torch.bool, device=device)  # bool [R + 1]
        self.presence = torch.zeros(n, dtype=torch.float32, device=device)  # fp32 [R + 1]
        self.frequency = torch.zeros(n, dtype=torch.float32, device=device)  # fp32 [R + 1]
        self.repetition = torch.ones(n, dtype=torch.float32, device=device)  # fp32 [R + 1]
        self.min_tokens = torch.zeros(n, dtype=torch.int64, device=device)  # int64 [R + 1]
        self.prompt_len = torch.zeros(n, dtype=torch.int64, device=device)  # int64 [R + 1]
        self.counts = torch.zeros((n, v), dtype=torch.int32, device=device)  # int32 [R + 1, V]
        self.prompt_seen = torch.zeros((n, v), dtype=torch.bool, device=device)  # bool [R + 1, V]
        self.bias_ids = torch.full((n, MAX_LOGIT_BIAS), v, dtype=torch.int64, device=device)
        self.bias_values = torch.zeros((n, MAX_LOGIT_BIAS), dtype=torch.float32, device=device)
        # allowed_token_ids: the list (padding V) and whether the slot restricts at all
        self.allowed_ids = torch.full((n, MAX_ALLOWED_TOKEN_IDS), v, dtype=torch.int64, device=device)
        self.restricted = torch.zeros(n, dtype=torch.bool, device=device)  # bool [R + 1]
        # bad_words_token_ids: each sequence's prefix (right-aligned) and last token; the output's tail
        s = MAX_BAD_WORD_SEQUENCES
        self.bad_prefix = torch.full((n, s, _PREFIX), _ANY_TOKEN, dtype=torch.int64, device=device)
        self.bad_last = torch.full((n, s), v, dtype=torch.int64, device=device)  # int64 [R + 1, S]
        self.recent = torch.full((n, _PREFIX), _NO_TOKEN, dtype=torch.int64, device=device)
        self.max_stop_ids = MAX_STOP_TOKEN_IDS + len(self.eos_token_ids)
        self.stop_ids = torch.full((n, self.max_stop_ids), v, dtype=torch.int64, device=device)

    # -- per request (host side, at arrival and departure) --------------------------------------------

    def add(self, slot: int, req: NewRequest, history: torch.Tensor) -> None:
        """Sets the slot's controls for `req`; history: its token ids (int32 [n], on the device)."""
        p: SamplingParams = req.sampling
        if not p.has_logit_controls:
            self.remove(slot)
            return
        v = self.vocab_size
        hist = history.long()
        npr = req.num_prompt_tokens
        out = hist[npr:]
        self.counts[slot].zero_()
        self.counts[slot].scatter_add_(0, out, torch.ones_like(out, dtype=torch.int32))
        self.prompt_seen[slot].zero_()
        self.prompt_seen[slot].scatter_(0, hist[:npr], True)
        self.presence[slot] = float(p.presence_penalty)
        self.frequency[slot] = float(p.frequency_penalty)
        self.repetition[slot] = float(p.repetition_penalty)
        self.min_tokens[slot] = p.min_tokens
        self.prompt_len[slot] = npr
        bias = p.logit_bias or {}
        ids = np.full(MAX_LOGIT_BIAS, v, dtype=np.int64)
        vals = np.zeros(MAX_LOGIT_BIAS, dtype=np.float32)
        ids[: len(bias)] = list(bias.keys())
        vals[: len(bias)] = list(bias.values())
        self.bias_ids[slot].copy_(torch.from_numpy(ids))
        self.bias_values[slot].copy_(torch.from_numpy(vals))
        allowed = np.full(MAX_ALLOWED_TOKEN_IDS, v, dtype=np.int64)
        allowed[: len(p.allowed_token_ids or ())] = p.allowed_token_ids or []
        self.allowed_ids[slot].copy_(torch.from_numpy(allowed))
        self.restricted[slot] = p.allowed_token_ids is not None
        prefix = np.full((MAX_BAD_WORD_SEQUENCES, _PREFIX), _ANY_TOKEN, dtype=np.int64)
        last = np.full(MAX_BAD_WORD_SEQUENCES, v, dtype=np.int64)
        for i, seq in enumerate(p.bad_words_token_ids or ()):
            last[i] = seq[-1]
            if len(seq) > 1:
                prefix[i, _PREFIX - len(seq) + 1 :] = seq[:-1]
        self.bad_prefix[slot].copy_(torch.from_numpy(prefix))
        self.bad_last[slot].copy_(torch.from_numpy(last))
        self.recent[slot].fill_(_NO_TOKEN)
        k = min(out.shape[0], _PREFIX)
        if k:
            self.recent[slot, _PREFIX - k :] = out[out.shape[0] - k :]
        stops = np.full(self.max_stop_ids, v, dtype=np.int64)
        if p.min_tokens:
            ids_ = [*p.stop_token_ids, *(() if p.ignore_eos else self.eos_token_ids)]
            stops[: len(ids_)] = ids_
        self.stop_ids[slot].copy_(torch.from_numpy(stops))
        self.enabled[slot] = True
        self.host_enabled[slot] = True

    def remove(self, slot: int) -> None:
        if self.host_enabled[slot]:
            self.host_enabled[slot] = False
            self.enabled[slot] = False

    def any_enabled(self, slots: np.ndarray) -> bool:
        """Whether any of these slots has a control (a host-side check, no device work)."""
        return bool(self.host_enabled[slots].any())

    # -- per step (device side, no sync) --------------------------------------------------------------

    def apply(
        self,
        logits: torch.Tensor,  # fp32 [B, V]: raw logits
        slots: torch.Tensor,  # int64 [B] on the device: each row's slot
        num_output: torch.Tensor,  # int64 [B] on the device: output tokens before the one sampled now
    ) -> torch.Tensor:  # fp32 [B, V]
        """The controlled logits (a new tensor). Rows whose slot has no control are equal to the input's
        bit for bit. Fixed shapes and no host sync: CUDA-graph safe."""
        b, v = logits.shape
        x = logits
        # 0. allowed_token_ids: the rows that restrict keep only their ids (padding V: the dropped column).
        allowed = torch.zeros((b, v + 1), dtype=torch.bool, device=logits.device)
        allowed.scatter_(1, self.allowed_ids[slots], True)
        keep = allowed[:, :v] | ~self.restricted[slots].unsqueeze(1)
        x = x.masked_fill(~keep, float("-inf"))
        # 0b. bad words: the sequences whose prefix the output ends with ban their last token (the others'
        # index is V, the dropped column).
        tail = self.recent[slots].unsqueeze(1)  # int64 [B, 1, T - 1]
        prefix = self.bad_prefix[slots]  # int64 [B, S, T - 1]
        hit = ((prefix == tail) | (prefix == _ANY_TOKEN)).all(dim=-1)  # bool [B, S]
        banned = torch.zeros((b, v + 1), dtype=torch.bool, device=logits.device)
        banned.scatter_(1, torch.where(hit, self.bad_last[slots], v), True)
        x = x.masked_fill(banned[:, :v], float("-inf"))
        # 1. logit_bias: padding entries (id V) land in a column past the vocabulary, dropped.
        bias = torch.zeros((b, v + 1), dtype=logits.dtype, device=logits.device)
        bias.scatter_add_(1, self.bias_ids[slots], self.bias_values[slots])
        x = x + bias[:, :v]
        # 2. min_tokens: EOS and stop ids at -inf while the output is shorter than min_tokens.
        stop = torch.zeros((b, v + 1), dtype=torch.bool, device=logits.device)
        stop.scatter_(1, self.stop_ids[slots], True)
        early = (num_output < self.min_tokens[slots]).unsqueeze(1)  # bool [B, 1]
        x = x.masked_fill(stop[:, :v] & early, float("-inf"))
        # 3. repetition_penalty over the prompt and the output so far.
        counts = self.counts[slots]  # int32 [B, V]
        in_output = counts > 0
        seen = self.prompt_seen[slots] | in_output
        rep = self.repetition[slots].unsqueeze(1)
        x = torch.where(seen, torch.where(x > 0, x / rep, x * rep), x)
        # 4. frequency and presence penalties over the output so far.
        x = x - self.frequency[slots].unsqueeze(1) * counts.to(x.dtype)
        x = x - self.presence[slots].unsqueeze(1) * in_output.to(x.dtype)
        return torch.where(self.enabled[slots].unsqueeze(1), x, logits)

    def num_output(self, slots: torch.Tensor, num_tokens: torch.Tensor) -> torch.Tensor:
        """Output tokens of each row's request, from its history length (int64 [B], on the device)."""
        return num_tokens - self.prompt_len[slots]

    def count(self, slots: torch.Tensor, ids: torch.Tensor) -> None:
        """Adds this step's sampled ids (int [B], on the device; a failed row's FAILED_ROW counts as 0) to
        the rows' output counts and output tails. Rows must have distinct slots, except padding rows on the
        scratch slot."""
        v = self.vocab_size
        slots = slots.to(torch.int64)
        ids = ids.to(torch.int64).clamp(0, v - 1)
        self.counts.view(-1).scatter_add_(0, slots * v + ids, torch.ones_like(ids, dtype=torch.int32))
        self.recent[slots] = torch.cat([self.recent[slots, 1:], ids.unsqueeze(1)], dim=1)
