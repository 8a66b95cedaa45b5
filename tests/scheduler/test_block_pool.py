"""BlockPool: null block, free list, reference counts, cached-block LRU, integrity."""

import random

import pytest

from raystate.scheduler.block_pool import NULL_BLOCK, BlockPool
from raystate.scheduler.prefix_cache import PrefixIndex


def h(i: int) -> bytes:
    return i.to_bytes(16, "little")


def test_null_block_is_never_allocated():
    pool = BlockPool(8)
    blocks = pool.allocate(7)
    assert NULL_BLOCK not in blocks and sorted(blocks) == list(range(1, 8))
    assert pool.num_available == 0
    with pytest.raises(RuntimeError, match="available"):
        pool.allocate(1)
    pool.release([NULL_BLOCK, *blocks])  # a null entry in a block list is skipped
    assert pool.num_free == 7
    pool.check_integrity()


def test_reference_counts():
    pool = BlockPool(4)
    (b,) = pool.allocate(1)
    pool.share([b])
    assert pool.ref_cnt[b] == 2
    pool.release([b])
    assert pool.ref_cnt[b] == 1 and pool.num_free == 2
    pool.release([b])
    assert pool.ref_cnt[b] == 0 and pool.num_free == 3
    with pytest.raises(RuntimeError, match="not in use"):
        pool.release([b])


def test_cached_block_waits_in_the_lru_until_hit_or_evicted():
    index = PrefixIndex()
    pool = BlockPool(4, index)
    a, b, c = pool.allocate(3)
    pool.register(a, h(1))
    pool.register(b, h(2))
    pool.release([b, a, c])  # b then a become evictable; c (unhashed) is free
    assert pool.num_free == 1 and pool.num_evictable == 2 and pool.num_available == 3
    assert index.get(h(1)) == a and index.get(h(2)) == b
    pool.share([a])  # a hit takes a back out of the LRU
    assert pool.ref_cnt[a] == 1 and pool.num_evictable == 1
    got = pool.allocate(2)  # the free block first, then the least recently released cached one
    assert got == [c, b]
    assert h(2) not in index and pool.block_hash[b] is None
    assert index.get(h(1)) == a
    pool.check_integrity()


def test_lru_order_is_release_order():
    index = PrefixIndex()
    pool = BlockPool(5, index)
    blocks = pool.allocate(4)
    for i, blk in enumerate(blocks):
        pool.register(blk, h(i))
    pool.release([blocks[2], blocks[0], blocks[3], blocks[1]])
    assert [pool.allocate(1)[0] for _ in range(4)] == [blocks[2], blocks[0], blocks[3], blocks[1]]
    assert len(index) == 0


def test_register_keeps_an_existing_entry():
    index = PrefixIndex()
    pool = BlockPool(4, index)
    a, b = pool.allocate(2)
    pool.register(a, h(7))
    pool.register(b, h(7))  # the same prefix computed twice: b stays private
    assert index.get(h(7)) == a and pool.block_hash[b] is None
    pool.release([a, b])
    assert pool.num_evictable == 1 and pool.num_free == 2
    pool.check_integrity()


def test_pool_without_index_never_caches():
    pool = BlockPool(3)
    (a,) = pool.allocate(1)
    pool.register(a, h(1))
    pool.release([a])
    assert pool.num_free == 2 and pool.num_evictable == 0


def test_integrity_over_random_operations():
    rng = random.Random(0)
    index = PrefixIndex()
    pool = BlockPool(33, index)
    held: list[int] = []
    for _ in range(2000):
        op = rng.random()
        if op < 0.4 and pool.num_available:
            got = pool.allocate(rng.randint(1, min(4, pool.num_available)))
            held += got
            for b in got:
                if rng.random() < 0.5:
                    pool.register(b, h(rng.randrange(40)))
        elif op < 0.55 and index.blocks:
            b = rng.choice(list(index.blocks.values()))
            pool.share([b])
            held.append(b)
        elif held:
            pool.release([held.pop(rng.randrange(len(held)))])
        pool.check_integrity()
        assert pool.num_in_use == len(set(held))
    pool.release(held)
    pool.check_integrity()
    assert pool.num_free + pool.num_evictable == 32


def test_integrity_check_catches_a_double_free():
    pool = BlockPool(4)
    (a,) = pool.allocate(1)
    pool._free.append(a)  # corrupt: a is both in use and free
    with pytest.raises(AssertionError):
        pool.check_integrity()


def test_reset_forgets_everything():
    index = PrefixIndex()
    pool = BlockPool(4, index)
    a, _ = pool.allocate(2)
    pool.register(a, h(1))
    pool.reset()
    assert pool.num_free == 3 and len(index) == 0
    pool.check_integrity()
