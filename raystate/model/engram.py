"""Engram n-gram memory (DESIGN section 2): hash constants, the hash call and the gated fusion.

Each engram layer hashes the compressed ids of the n-grams ending at every token into rows of one
table, concatenates the rows and adds a gated projection of them to the residual stream. The hash must be
bit-exact whatever the chunking (DESIGN section 1), so its constants are fixed by the config alone: they are
built by the pure function `engram_hash_constants`, kept as int64 buffers and never saved with the
weights.
"""

from __future__ import annotations

import re
import unicodedata
from dataclasses import dataclass

import numpy as np
import torch
from torch import nn

from raystate.config import ModelConfig
from raystate.kernels import engram_hash
from raystate.kernels.engram_gate import engram_gate
from raystate.model.layers import RMSNorm
from raystate.tokenizer import ByteTokenizer


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


# DESIGN section 2, "Compression": the key of a token's text, as DeepSeek's Engram reference computes it
# with a `tokenizers` normalizer sequence (NFKC, NFD, StripAccents, Lowercase, Replace("[ \t\r\n]+", " "),
# Replace("^ $", U+E000), Strip, Replace(U+E000, " ")), written here with the standard library.
_SENTINEL = "\ue000"  # protects a lone space from Strip; any U+E000 already in the text also ends as " "
_SPACE_RUN = re.compile(r"[ \t\r\n]+")
# What the `Strip` normalizer removes: Rust's `char::is_whitespace`, the Unicode White_Space property.
# Python's bare `str.strip()` would also remove U+001C..U+001F, which are not White_Space.
_WHITE_SPACE = (
    "\t\n\x0b\x0c\r \x85\xa0\u1680\u2000\u2001\u2002\u2003\u2004\u2005\u2006\u2007\u2008\u2009\u200a"
    "\u2028\u2029\u202f\u205f\u3000"
)


def engram_normalize(text: str) -> str:
    """The normalized key of `text` (may be empty): NFKC, NFD, combining marks (category M*) dropped,
    lowercased character by character (no final-sigma rule), runs of space/tab/CR/LF collapsed to one space,
    then stripped of White_Space unless the whole text is that one space."""
    s = unicodedata.normalize("NFD", unicodedata.normalize("NFKC", text))
    s = "".join(c.lower() for c in s if unicodedata.category(c)[0] != "M")
    s = _SPACE_RUN.sub(" ", s)
    if s == " ":
        s = _SENTINEL
    return s.strip(_WHITE_SPACE).replace(_SENTINEL, " ")


def compressed_vocab_from_tokenizer(tokenizer, pad_token_id: int) -> tuple[np.ndarray, int, int]:
    """Token id -> dense compressed id; returns (lookup int64 [len(tokenizer)], V', compressed pad id).

    DESIGN section 2: every id is decoded alone with `skip_special_tokens=False`; its key is
    `engram_normalize(text)`, or the text itself where that is empty, or the raw token string
    (`convert_ids_to_tokens`) where the text holds U+FFFD (a partial UTF-8 sequence), all in one key space.
    Keys are numbered by first appearance in id order, so ids that share a key ("The", "the", "THE") share
    n-gram buckets. Duck-typed: our `ByteTokenizer` or a Hugging Face tokenizer.
    """
    vocab_size = len(tokenizer)
    if not 0 <= pad_token_id < vocab_size:
        raise ValueError(f"pad_token_id must be in [0, {vocab_size}), got {pad_token_id}")
    numbers: dict[str, int] = {}
    lookup = np.empty(vocab_size, dtype=np.int64)
    for token_id in range(vocab_size):
        text = tokenizer.decode([token_id], skip_special_tokens=False)
        partial = "\ufffd" in text  # a partial UTF-8 sequence: keyed by the raw token string
        key = tokenizer.convert_ids_to_tokens(token_id) if partial else (engram_normalize(text) or text)
        lookup[token_id] = numbers.setdefault(key, len(numbers))
    return lookup, len(numbers), int(lookup[pad_token_id])


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
    tokenizer = ByteTokenizer()  # the reference models' tokenizer
    if config.vocab_size != len(tokenizer):
        raise ValueError(
            f"engram compresses the byte tokenizer's {len(tokenizer)} ids; vocab_size is {config.vocab_size}"
        )
    compress, num_compressed, pad_id = compressed_vocab_from_tokenizer(tokenizer, config.pad_token_id)
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
