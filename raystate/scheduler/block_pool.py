"""One KV block pool per (shard, group): free list, reference counts, the null block, cached-block LRU.

Block 0 is the null block: block tables point at it for window blocks the request does not hold (below
its replay start, or released behind the window); it is never allocated and never freed.

A block whose reference count drops to 0 goes back to the free list, unless it carries a block hash (its
KV is a cached prefix block): then it waits in an LRU of evictable blocks, still findable through the
prefix index, until a hit takes it back (`share`) or an allocation evicts it (which forgets its hash).
Allocation takes free blocks first, then evicts the least recently released cached block.

Invariant, checked by `check_integrity`: free + evictable + in use == num_blocks - 1.

Reference counts live in `_refs`, where a free block keeps the count 1, set for the allocation that takes
it next: admission allocates thousands of blocks at once (64 prompts of 2k tokens: 8k blocks), and this
way allocating one is a slice of the free list, not a Python-level write per block. `ref_cnt` gives the
true counts (0 for free blocks). A release that drops a block to 0 tells a double release (the block is
already free) from a real one through `_free_pos`, each free block's place in the free list; and
`_num_held` counts the blocks in use, so `check_integrity` still sees a block that is both in use and free.

Sharing the same hit blocks again (a burst of prompts with one cached system prompt: 64 requests x 64
blocks) is counted, not applied: `_repeat_blocks` is the last block list shared, `_repeat_times` how often it
was shared since, and those references are added (`_settle`) before anything reads the counts (a release,
`ref_cnt`). Until then `_refs` undercounts only blocks that are in use anyway, which no allocation takes.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Collection, Iterable

from raystate.scheduler.prefix_cache import PrefixIndex

NULL_BLOCK = 0


class BlockPool:
    def __init__(self, num_blocks: int, index: PrefixIndex | None = None) -> None:
        if num_blocks < 2:
            raise ValueError(f"num_blocks: must be >= 2 (one is the null block), got {num_blocks}")
        self.num_blocks = num_blocks
        self.index = index  # the prefix index of this pool; None when its group is not cacheable
        self.block_hash: list[bytes | None] = [None] * num_blocks
        self._evictable: OrderedDict[int, None] = OrderedDict()  # oldest release first
        self._reset_free()

    def _reset_free(self) -> None:
        """Every block free (reference count field 1, see the module docstring) but the null block."""
        n = self.num_blocks
        self._refs = [1] * n  # holders of a block in use, 0 for a cached idle block, 1 for a free one
        self._refs[NULL_BLOCK] = 0
        # Popped from the end: low ids first, which keeps small test pools easy to read.
        self._free = list(range(n - 1, NULL_BLOCK, -1))
        # _free[_free_pos[b]] == b for a free block b; stale (out of range, or another block) otherwise.
        self._free_pos = [n - 1 - b for b in range(n)]
        self._num_held = 0  # blocks with a reference count > 0
        self._repeat_blocks: list[int] | None = None  # the last blocks shared (see `share`)
        self._repeat_times = 0  # shares of them since, not yet in _refs

    @property
    def ref_cnt(self) -> list[int]:
        """Each block's reference count (a copy: 0 for free, evictable and the null block)."""
        self._settle()
        refs = self._refs.copy()
        for b in self._free:
            refs[b] = 0
        return refs

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
        if n <= len(free):  # free blocks carry the count 1 already
            if n == 1:  # a decode crossing a block boundary
                self._num_held += 1
                return [free.pop()]
            if n <= 0:  # (free[-0:] would be the whole list)
                return []
            self._num_held += n
            blocks = free[-n:]
            del free[-n:]
            blocks.reverse()
            return blocks
        if n > len(free) + len(self._evictable):
            raise RuntimeError(f"allocate: {n} blocks asked, {len(free) + len(self._evictable)} available")
        self._num_held += n
        blocks = free[::-1]
        free.clear()
        refs = self._refs
        for _ in range(n - len(blocks)):
            b = self._evict()
            refs[b] = 1
            blocks.append(b)
        return blocks

    def _evict(self) -> int:
        block, _ = self._evictable.popitem(last=False)
        block_hash = self.block_hash[block]
        self.block_hash[block] = None
        if self.index is not None and block_hash is not None:
            self.index.forget(block_hash, block)
        return block

    def share(self, blocks: Collection[int]) -> None:
        """Takes one more reference on each (cached) block, pulling it out of the LRU if it was idle.

        Admission shares a whole hit prefix per request, mostly the very blocks the previous admission
        shared: then this only counts the repeat (see the module docstring). Otherwise a set test in C
        finds whether any block is idle in the LRU; if none is, the loop only counts.
        """
        last = self._repeat_blocks
        if last is not None:
            if blocks == last:  # compared in C; every block is in use since the last share
                self._repeat_times += 1
                return
            self._settle()
        self._repeat_blocks = list(blocks)
        refs = self._refs
        evictable = self._evictable
        if not evictable or evictable.keys().isdisjoint(blocks):
            for b in blocks:
                refs[b] += 1
            return
        for b in blocks:
            if refs[b] == 0:
                del evictable[b]
                self._num_held += 1
            refs[b] += 1

    def release(self, blocks: Iterable[int]) -> None:
        """Drops one reference on each block, in the given order (the first to reach 0 is evicted first).

        Callers pass a request's blocks tail first, so a prefix's last blocks, the least likely to be hit
        again, leave the cache before its first ones.
        """
        if self._repeat_blocks is not None:
            self._settle()
        refs = self._refs
        block_hash = self.block_hash
        free = self._free
        free_pos = self._free_pos
        dropped = 0  # blocks that reached 0
        try:
            for b in blocks:
                if b == NULL_BLOCK:
                    continue
                n = refs[b] - 1
                if n > 0:
                    refs[b] = n
                    continue
                if block_hash[b] is not None:
                    if n < 0:  # a cached idle block
                        raise RuntimeError(f"release: block {b} is not in use")
                    refs[b] = 0
                    self._evictable[b] = None
                else:  # back to the free list, keeping the count 1 for its next allocation
                    pos = free_pos[b]
                    if n < 0 or (pos < len(free) and free[pos] == b):
                        raise RuntimeError(f"release: block {b} is not in use")
                    free_pos[b] = len(free)
                    free.append(b)
                dropped += 1
        finally:
            self._num_held -= dropped

    def _settle(self) -> None:
        """Adds the references of repeated shares (`share`) to `_refs`."""
        blocks = self._repeat_blocks
        times = self._repeat_times
        self._repeat_blocks = None
        self._repeat_times = 0
        if blocks is not None and times:
            refs = self._refs
            for b in blocks:
                refs[b] += times

    def register(self, block: int, block_hash: bytes) -> None:
        """Records that `block` holds the computed KV of the prefix `block_hash` and indexes it, unless
        the index already has another block for that prefix (then this one stays private)."""
        if self.index is None or self.block_hash[block] is not None:
            return
        if self.index.insert(block_hash, block):
            self.block_hash[block] = block_hash

    def reset(self) -> None:
        """Forgets every block and hash (the shard's KV is gone, e.g. its worker died)."""
        self.block_hash = [None] * self.num_blocks
        self._reset_free()
        self._evictable.clear()
        if self.index is not None:
            self.index.clear()

    def check_integrity(self) -> None:
        """Raises AssertionError unless free + evictable + in use == num_blocks - 1 and every block's
        state agrees with its reference count, its hash and the index."""
        free = set(self._free)
        evictable = set(self._evictable)
        ref_cnt = self.ref_cnt
        assert NULL_BLOCK not in free and NULL_BLOCK not in evictable, "null block in the free or cached list"
        assert self._refs[NULL_BLOCK] == 0, "null block has references"
        assert len(free) == len(self._free), "a block is twice in the free list"
        assert not free & evictable, "a block is both free and cached"
        in_use = sum(1 for b in range(1, self.num_blocks) if ref_cnt[b] > 0)
        assert in_use == self._num_held, f"{in_use} blocks referenced, {self._num_held} handed out"
        assert len(free) + len(evictable) + in_use == self.num_blocks - 1, (
            f"free {len(free)} + cached {len(evictable)} + in use {in_use} != {self.num_blocks - 1}"
        )
        for pos, b in enumerate(self._free):
            assert self._refs[b] == 1 and self._free_pos[b] == pos, f"free block {b}: count or place is off"
            assert self.block_hash[b] is None, f"free block {b} is hashed"
        for b in evictable:
            assert ref_cnt[b] == 0 and self.block_hash[b] is not None, f"cached block {b} is held or unhashed"
        if self.index is not None:
            for block_hash, b in self.index.blocks.items():
                assert self.block_hash[b] == block_hash, f"index entry for block {b} disagrees with the pool"
            assert sum(h is not None for h in self.block_hash) == len(self.index), "hashed blocks not indexed"
