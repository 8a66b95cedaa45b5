"""One KV block pool per (shard, group): free list, reference counts, the null block, cached-block LRU.

Block 0 is the null block: block tables point at it for window blocks the request does not hold (below
its replay start, or released behind the window); it is never allocated and never freed.

A block whose reference count drops to 0 goes back to the free list, unless it carries a block hash (its
KV is a cached prefix block): then it waits in an LRU of evictable blocks, still findable through the
prefix index, until a hit takes it back (`share`) or an allocation evicts it (which forgets its hash).
Allocation takes free blocks first, then evicts the least recently released cached block.

Invariant, checked by `check_integrity`: free + evictable + in use == num_blocks - 1.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterable

from raystate.scheduler.prefix_cache import PrefixIndex

NULL_BLOCK = 0


class BlockPool:
    def __init__(self, num_blocks: int, index: PrefixIndex | None = None) -> None:
        if num_blocks < 2:
            raise ValueError(f"num_blocks: must be >= 2 (one is the null block), got {num_blocks}")
        self.num_blocks = num_blocks
        self.index = index  # the prefix index of this pool; None when its group is not cacheable
        self.ref_cnt = [0] * num_blocks
        self.block_hash: list[bytes | None] = [None] * num_blocks
        # Popped from the end: low ids first, which keeps small test pools easy to read.
        self._free = list(range(num_blocks - 1, NULL_BLOCK, -1))
        self._evictable: OrderedDict[int, None] = OrderedDict()  # oldest release first

    @property
    def num_free(self) -> int:
        return len(self._free)

    @property
    def num_evictable(self) -> int:
        return len(self._evictable)

    @property
    def num_available(self) -> int:
        """Blocks an allocation can take now: free ones, then evictable cached ones."""
        return len(self._free) + len(self._evictable)

    @property
    def num_in_use(self) -> int:
        return self.num_blocks - 1 - len(self._free) - len(self._evictable)

    def free_block_ids(self) -> list[int]:
        """A copy of the free list (blocks whose content nobody may read)."""
        return list(self._free)

    def allocate(self, n: int) -> list[int]:
        """n fresh blocks with reference count 1; the caller checked `num_available >= n`."""
        free = self._free
        ref_cnt = self.ref_cnt
        if n <= len(free):
            if n == 1:  # a decode crossing a block boundary
                block = free.pop()
                ref_cnt[block] = 1
                return [block]
            blocks = free[-n:]
            del free[-n:]
            blocks.reverse()
        else:
            if n > len(free) + len(self._evictable):
                raise RuntimeError(
                    f"allocate: {n} blocks asked, {len(free) + len(self._evictable)} available"
                )
            blocks = free[::-1]
            free.clear()
            blocks += [self._evict() for _ in range(n - len(blocks))]
        for b in blocks:
            ref_cnt[b] = 1
        return blocks

    def _evict(self) -> int:
        block, _ = self._evictable.popitem(last=False)
        block_hash = self.block_hash[block]
        self.block_hash[block] = None
        if self.index is not None and block_hash is not None:
            self.index.forget(block_hash, block)
        return block

    def share(self, blocks: Iterable[int]) -> None:
        """Takes one more reference on each (cached) block, pulling it out of the LRU if it was idle."""
        ref_cnt = self.ref_cnt
        evictable = self._evictable
        for b in blocks:
            if ref_cnt[b] == 0:
                del evictable[b]
            ref_cnt[b] += 1

    def release(self, blocks: Iterable[int]) -> None:
        """Drops one reference on each block, in the given order (the first to reach 0 is evicted first).

        Callers pass a request's blocks tail first, so a prefix's last blocks, the least likely to be hit
        again, leave the cache before its first ones.
        """
        ref_cnt = self.ref_cnt
        block_hash = self.block_hash
        for b in blocks:
            if b == NULL_BLOCK:
                continue
            n = ref_cnt[b] - 1
            if n < 0:
                raise RuntimeError(f"release: block {b} is not in use")
            ref_cnt[b] = n
            if n == 0:
                if block_hash[b] is not None:
                    self._evictable[b] = None
                else:
                    self._free.append(b)

    def register(self, block: int, block_hash: bytes) -> None:
        """Records that `block` holds the computed KV of the prefix `block_hash` and indexes it, unless
        the index already has another block for that prefix (then this one stays private)."""
        if self.index is None or self.block_hash[block] is not None:
            return
        if self.index.insert(block_hash, block):
            self.block_hash[block] = block_hash

    def reset(self) -> None:
        """Forgets every block and hash (the shard's KV is gone, e.g. its worker died)."""
        self.ref_cnt = [0] * self.num_blocks
        self.block_hash = [None] * self.num_blocks
        self._free = list(range(self.num_blocks - 1, NULL_BLOCK, -1))
        self._evictable.clear()
        if self.index is not None:
            self.index.clear()

    def check_integrity(self) -> None:
        """Raises AssertionError unless free + evictable + in use == num_blocks - 1 and every block's
        state agrees with its reference count, its hash and the index."""
        free = set(self._free)
        evictable = set(self._evictable)
        assert NULL_BLOCK not in free and NULL_BLOCK not in evictable, "null block in the free or cached list"
        assert self.ref_cnt[NULL_BLOCK] == 0, "null block has references"
        assert len(free) == len(self._free), "a block is twice in the free list"
        assert not free & evictable, "a block is both free and cached"
        in_use = sum(1 for b in range(1, self.num_blocks) if self.ref_cnt[b] > 0)
        assert len(free) + len(evictable) + in_use == self.num_blocks - 1, (
            f"free {len(free)} + cached {len(evictable)} + in use {in_use} != {self.num_blocks - 1}"
        )
        for b in free:
            assert self.ref_cnt[b] == 0 and self.block_hash[b] is None, (
                f"free block {b} is referenced or hashed"
            )
        for b in evictable:
            assert self.ref_cnt[b] == 0 and self.block_hash[b] is not None, (
                f"cached block {b} is held or unhashed"
            )
        if self.index is not None:
            for block_hash, b in self.index.blocks.items():
                assert self.block_hash[b] == block_hash, f"index entry for block {b} disagrees with the pool"
            assert sum(h is not None for h in self.block_hash) == len(self.index), "hashed blocks not indexed"
