"""Chained block hashes and the hash -> block index of one prefix-cacheable (shard, group) pool.

A full block's hash is `blake2b((parent hash, the block's int32 little-endian token ids))`, so equal
hashes mean equal whole prefixes, and the value is the same in every process and on every machine (a
scheduler actor restarted elsewhere rebuilds the same keys). A 128-bit cryptographic hash makes a forged
collision (one user's prompt reusing another's KV) impractical. Each block is hashed once per request:
prompt blocks at intake, output blocks as they fill.

Blocks whose last holder released them stay indexed until the pool reuses them; the least recently
released go first (the LRU lives in `BlockPool`, which calls `PrefixIndex.forget` on eviction).
"""

from __future__ import annotations

import array
import hashlib
import sys

import numpy as np

HASH_BYTES = 16
ROOT_HASH = hashlib.blake2b(b"raystate.prefix.v1", digest_size=HASH_BYTES).digest()
_LITTLE_ENDIAN = sys.byteorder == "little"


def hash_block(parent: bytes, block_token_bytes: bytes) -> bytes:
    """The chained hash of one full block: its parent's hash, then its token ids as int32 LE bytes."""
    return hashlib.blake2b(parent + block_token_bytes, digest_size=HASH_BYTES).digest()


def extend_block_hashes(
    hashes: list[bytes], token_ids: array.array, block_size: int, num_blocks: int
) -> None:
    """Appends the hashes of full blocks len(hashes) .. num_blocks-1 of `token_ids` (int32 array)."""
    start = len(hashes)
    if num_blocks <= start:
        return
    if num_blocks * block_size > len(token_ids):
        raise ValueError(
            f"num_blocks: {num_blocks} full blocks need {num_blocks * block_size} tokens, "
            f"got {len(token_ids)}"
        )
    ids = token_ids[start * block_size : num_blocks * block_size]
    if not _LITTLE_ENDIAN:
        ids.byteswap()
    data = ids.tobytes()
    step = 4 * block_size
    parent = hashes[-1] if hashes else ROOT_HASH
    blake2b = hashlib.blake2b
    for off in range(0, len(data), step):
        parent = blake2b(parent + data[off : off + step], digest_size=HASH_BYTES).digest()
        hashes.append(parent)


class PromptHasher:
    """Hashes prompts' full blocks at intake, reusing the hashes of the blocks a prompt shares with the
    last one it hashed.

    Why: a burst of requests with one long system prompt (32 x 8k tokens: 16k blocks) would hash the same
    blocks once per request, about a microsecond each, which dominates the burst's intake. Equal leading
    token ids give equal chained hashes, so the shared part is found by comparing the ids themselves
    (one vectorised pass, far cheaper than hashing) and only the blocks after it are hashed.
    """

    __slots__ = ("block_size", "_ids", "_hashes")

    def __init__(self, block_size: int) -> None:
        self.block_size = block_size
        self._ids = np.zeros(0, dtype=np.int32)  # the last prompt hashed
        self._hashes: list[bytes] = []  # its full blocks' hashes

    def hash_prompt(self, token_ids: array.array, hashes: list[bytes], num_blocks: int) -> None:
        """Appends to the empty `hashes` the chained hashes of the first `num_blocks` full blocks of
        `token_ids` (int32), exactly as `extend_block_hashes` would."""
        if hashes:
            raise ValueError("hashes: must start empty (a prompt is hashed once, at intake)")
        bs = self.block_size
        ids = np.frombuffer(token_ids, dtype=np.int32)[: num_blocks * bs]
        memo = self._ids
        n = min(len(ids), len(memo), len(self._hashes) * bs)
        differ = np.flatnonzero(ids[:n] != memo[:n])
        same_blocks = (int(differ[0]) if len(differ) else n) // bs
        hashes += self._hashes[:same_blocks]
        extend_block_hashes(hashes, token_ids, bs, num_blocks)
        self._ids = ids.copy()
        self._hashes = hashes.copy()


class PrefixIndex:
    """hash -> block id for one cacheable pool. Only a block whose tokens are computed is indexed."""

    __slots__ = ("blocks", "removals")

    def __init__(self) -> None:
        self.blocks: dict[bytes, int] = {}
        # Bumped whenever an entry goes (forget, clear): a hit found earlier is still valid while this
        # is unchanged, since an entry, once in, keeps its block until it is removed.
        self.removals = 0

    def __len__(self) -> int:
        return len(self.blocks)

    def __contains__(self, block_hash: bytes) -> bool:
        return block_hash in self.blocks

    def get(self, block_hash: bytes) -> int | None:
        return self.blocks.get(block_hash)

    def insert(self, block_hash: bytes, block: int) -> bool:
        """Indexes `block` under `block_hash` unless another block already holds it (then False)."""
        if block_hash in self.blocks:
            return False
        self.blocks[block_hash] = block
        return True

    def forget(self, block_hash: bytes, block: int) -> None:
        """Drops the entry if it still points at `block` (called when the pool evicts the block)."""
        if self.blocks.get(block_hash) == block:
            del self.blocks[block_hash]
            self.removals += 1

    def clear(self) -> None:
        self.blocks.clear()
        self.removals += 1
