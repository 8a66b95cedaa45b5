"""Engram n-gram memory (DESIGN section 2): hash constants, the hash call and the gated fusion.

Each engram layer hashes the compressed ids of the n-grams ending at every token into rows of one
table, concatenates the rows and adds a gated projection of them to the residual stream. The hash must be
bit-exact whatever the chunking (DESIGN section 1), so its constants are fixed by the config alone: they are
built by the pure function `engram_hash_constants`, kept as int64 buffers and never saved with the
weights.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch
from torch import nn

from raystate.config import ModelConfig
from raystate.kernels import engram_hash
from raystate.kernels.engram_gate import engram_gate
from raystate.model.layers import RMSNorm


@dataclass(frozen=True)
class EngramHashConstants:
    """Everything `raystate.kernels.engram_hash` needs for one layer besides the ids."""

    layer_id: int
    compress: np.ndarray  # int64 [vocab]: token id -> compressed id
    pad_id: int  # compressed id of PAD: what a blocked n-gram position reads
    multipliers: np.ndarray  # int64 [N], odd
    primes: np.ndarray  # int64 [N - 1, H]
    offsets: np.ndarray  # int64 [(N - 1) * H]: exclusive prefix sum of the layer's primes

    @property
    def num_compressed(self) -> int:
        return int(self.compress.max()) + 1

    @property
    def table_rows(self) -> int:
        return int(self.primes.sum())


def compressed_vocab(vocab_size: int, pad_token_id: int) -> tuple[np.ndarray, int]:
    """Token id -> dense compressed id, ASCII letters case-folded; returns (compress, pad_id).

    Folding case makes "The" and "the" share n-gram buckets. Ids are assigned in token order to each new
    folded id, so they are dense in [0, V').
    """
    folded = np.arange(vocab_size, dtype=np.int64)
    upper = (folded >= ord("A")) & (folded <= ord("Z"))
    folded[upper] += ord("a") - ord("A")
    _, first, inverse = np.unique(folded, return_index=True, return_inverse=True)
    # np.unique numbers folded ids in sorted order; renumber them by first appearance instead.
    rank = np.empty_like(first)
    rank[np.argsort(first, kind="stable")] = np.arange(first.shape[0])
    compress = rank[inverse].astype(np.int64)
    return compress, int(compress[pad_token_id])


def _is_prime(n: int) -> bool:
    if n < 2:
        return False
    if n % 2 == 0:
        return n == 2
    f = 3
    while f * f <= n:
        if n % f == 0:
            return False
        f += 2
    return True


def consecutive_primes(start: int, count: int) -> list[int]:
    """The `count` smallest primes at or above `start`."""
    out = []
    n = max(start, 2)
    while len(out) < count:
        if _is_prime(n):
            out.append(n)
        n += 1
    return out


def engram_hash_constants(config: ModelConfig) -> dict[int, EngramHashConstants]:
    """DESIGN section 2, by engram layer id: multipliers from default_rng(10007 * layer_id); primes taken in
    order layer (ascending id), order (2..N), head, consecutive from engram_vocab_size, never reused."""
    compress, pad_id = compressed_vocab(config.vocab_size, config.pad_token_id)
    num_compressed = int(compress.max()) + 1
    bound = max(1, (2**63 - 1) // num_compressed // 2)
    n, heads = config.engram_max_ngram, config.engram_heads
    layer_ids = sorted(set(config.engram_layer_ids))
    per_layer = (n - 1) * heads
    all_primes = np.asarray(
        consecutive_primes(config.engram_vocab_size, per_layer * len(layer_ids)), dtype=np.int64
    )
    out = {}
    for i, layer_id in enumerate(layer_ids):
        draws = np.random.default_rng(10007 * layer_id).integers(0, bound, size=n, dtype=np.int64)
        primes = all_primes[i * per_layer : (i + 1) * per_layer]
        offsets = np.concatenate([[0], np.cumsum(primes)[:-1]]).astype(np.int64)
        out[layer_id] = EngramHashConstants(
            layer_id=layer_id,
            compress=compress,
            pad_id=pad_id,
            multipliers=(2 * draws + 1).astype(np.int64),
            primes=primes.reshape(n - 1, heads).copy(),
            offsets=offsets,
        )
    return out


class Engram(nn.Module):
    """One layer's engram: hash -> rows -> key/value -> gate -> residual update.

    Fusion (a reference simplification DESIGN section 2 allows): key = W_k(rows), value = W_v(rows),
    d = <rmsnorm(h), rmsnorm(key)> / sqrt(hidden), gate = sigmoid(sign(d) * sqrt(max(|d|, 1e-6))),
    h + gate * value. The signed square root compresses large similarities, so the gate rarely saturates
    and the memory's contribution stays a smooth function of how well the n-gram matches the context.
    """

    def __init__(self, config: ModelConfig, layer_id: int) -> None:
        super().__init__()
        self.layer_id = layer_id
        self.hidden_size = config.hidden_size
        n, heads = config.engram_max_ngram, config.engram_heads
        self.num_columns = (n - 1) * heads
        self.head_dim = config.engram_head_dim
        constants = engram_hash_constants(config)[layer_id]
        self.pad_id = constants.pad_id
        self.table = nn.Parameter(torch.empty(constants.table_rows, self.head_dim))
        self.key_proj = nn.Linear(self.num_columns * self.head_dim, config.hidden_size, bias=False)
        self.value_proj = nn.Linear(self.num_columns * self.head_dim, config.hidden_size, bias=False)
        self.hidden_norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.key_norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.register_buffer("compress", torch.empty(0, dtype=torch.int64), persistent=False)
        self.register_buffer("multipliers", torch.empty(0, dtype=torch.int64), persistent=False)
        self.register_buffer("primes", torch.empty(0, dtype=torch.int64), persistent=False)
        self.register_buffer("offsets", torch.empty(0, dtype=torch.int64), persistent=False)
        self._constants = constants
        self.reset_hash_buffers()

    def reset_hash_buffers(self) -> None:
        """(Re)builds the int64 hash buffers on the module's device, e.g. after `to_empty`."""
        c = self._constants
        device = self.table.device
        self.compress = torch.from_numpy(c.compress).to(device)  # int64 [vocab]
        self.multipliers = torch.from_numpy(c.multipliers).to(device)  # int64 [N]
        self.primes = torch.from_numpy(c.primes).to(device)  # int64 [N - 1, H]
        self.offsets = torch.from_numpy(c.offsets).to(device)  # int64 [(N - 1) * H]

    def hash(
        self,
        input_ids: torch.Tensor,  # int [T]
        query_start_loc: torch.Tensor,  # int32 [B + 1]
        lookback_token_ids: torch.Tensor,  # int32 [>= B, D]
    ) -> torch.Tensor:  # int64 [T, (N - 1) * H]: table rows
        return engram_hash(
            input_ids,
            query_start_loc,
            lookback_token_ids,
            self.compress,
            self.multipliers,
            self.primes,
            self.offsets,
            self.pad_id,
        )

    def fuse(
        self,
        hidden: torch.Tensor,  # [T, hidden]: the residual stream
        rows: torch.Tensor,  # int64 [T, (N - 1) * H]
    ) -> torch.Tensor:  # [T, hidden]
        num_tokens = hidden.shape[0]
        memory = self.table[rows].reshape(num_tokens, self.num_columns * self.head_dim)
        key = self.key_proj(memory)  # [T, hidden]
        value = self.value_proj(memory)
        return engram_gate(
            hidden, key, value, self.hidden_norm.weight, self.key_norm.weight, self.hidden_norm.eps
        )

    def forward(
        self,
        hidden: torch.Tensor,  # [T, hidden]
        input_ids: torch.Tensor,  # int [T]
        query_start_loc: torch.Tensor,  # int32 [B + 1]
        lookback_token_ids: torch.Tensor,  # int32 [>= B, D]
    ) -> torch.Tensor:  # [T, hidden]
        return self.fuse(hidden, self.hash(input_ids, query_start_loc, lookback_token_ids))
