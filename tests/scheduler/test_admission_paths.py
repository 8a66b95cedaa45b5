"""The admission fast paths against plain reference versions: BlockPool's pre-set counts and counted
repeat shares, KVManager's hit memo, and admit_chunk's first allocation in one pass (against a one-token
first chunk grown by `allocate`)."""

import random
from collections import OrderedDict

import pytest
from sched_harness import make_config, make_req

from raystate.scheduler.block_pool import NULL_BLOCK, BlockPool
from raystate.scheduler.kv_manager import KVManager
from raystate.scheduler.prefix_cache import PrefixIndex
from raystate.scheduler.request import Request


def h(i: int) -> bytes:
    return i.to_bytes(16, "little")


class PlainPool:
    """The pool's rules written the direct way: one count per block, updated on every operation."""

    def __init__(self, num_blocks: int) -> None:
        self.ref = [0] * num_blocks
        self.hashed = [False] * num_blocks
        self.free = list(range(num_blocks - 1, 0, -1))
        self.lru: OrderedDict[int, None] = OrderedDict()

    def allocate(self, n: int) -> list[int]:
        out = []
        for _ in range(n):
            if self.free:
                b = self.free.pop()
            else:
                b, _ = self.lru.popitem(last=False)
                self.hashed[b] = False
            self.ref[b] = 1
            out.append(b)
        return out

    def share(self, blocks: list[int]) -> None:
        for b in blocks:
            if self.ref[b] == 0:
                del self.lru[b]
            self.ref[b] += 1

    def release(self, blocks: list[int]) -> None:
        for b in blocks:
            if b == NULL_BLOCK:
                continue
            assert self.ref[b] > 0
            self.ref[b] -= 1
            if self.ref[b] == 0:
                if self.hashed[b]:
                    self.lru[b] = None
                else:
                    self.free.append(b)


@pytest.mark.parametrize("seed", range(6))
def test_pool_agrees_with_the_plain_pool(seed):
    rng = random.Random(seed)
    n = 24
    pool, plain = BlockPool(n, PrefixIndex()), PlainPool(n)
    held: list[list[int]] = []  # one list per holder
    next_hash = 0

    def index_blocks(blocks: list[int]) -> None:  # as a request's computed blocks are registered
        nonlocal next_hash
        for b in blocks:
            if not plain.hashed[b]:
                next_hash += 1
                pool.register(b, h(next_hash))
                plain.hashed[b] = pool.block_hash[b] is not None

    def release(blocks: list[int]) -> None:
        pool.release(blocks[::-1])
        plain.release(blocks[::-1])

    for _ in range(600):
        op = rng.random()
        if op < 0.25 and pool.num_available:
            k = rng.randint(1, min(6, pool.num_available))
            got = pool.allocate(k)
            assert got == plain.allocate(k)
            held.append(got)
        elif op < 0.45 and held:
            # Share a held list again, often the very list shared last (a burst of equal hits).
            blocks = list(held[-1] if rng.random() < 0.6 else rng.choice(held))
            for _ in range(rng.randint(1, 4)):
                pool.share(blocks)
                plain.share(blocks)
                held.append(list(blocks))
        elif op < 0.6:
            # Share cached idle blocks (a hit on a released prefix), alone or with held ones.
            idle = [b for b in range(1, n) if plain.ref[b] == 0 and plain.hashed[b]]
            if not idle and held:  # make some: a holder's blocks get indexed, then it lets go
                blocks = held.pop(rng.randrange(len(held)))
                index_blocks(blocks)
                release(blocks)
            elif idle:
                blocks = rng.sample(idle, min(len(idle), rng.randint(1, 3)))
                if held and rng.random() < 0.5:
                    blocks += held[-1]
                pool.share(blocks)
                plain.share(blocks)
                held.append(blocks)
        elif op < 0.85 and held:
            release(held.pop(rng.randrange(len(held))))
        elif held:
            index_blocks(rng.choice(held))
        assert pool.ref_cnt == plain.ref
        assert pool.free_block_ids() == plain.free
        assert pool.num_evictable == len(plain.lru)
        pool.check_integrity()


def test_repeated_shares_count_before_a_release_reads_them():
    pool = BlockPool(8, PrefixIndex())
    blocks = pool.allocate(3)
    for i, b in enumerate(blocks):
        pool.register(b, h(i))
    pool.release(blocks[::-1])
    assert pool.num_evictable == 3
    for _ in range(5):  # the first pulls them out of the LRU, the rest are only counted
        pool.share(blocks)
    assert pool.num_evictable == 0 and pool.num_in_use == 3
    assert [pool.ref_cnt[b] for b in blocks] == [5, 5, 5]
    for _ in range(4):
        pool.release(blocks[::-1])
    assert [pool.ref_cnt[b] for b in blocks] == [1, 1, 1] and pool.num_evictable == 0
    pool.share(blocks)
    pool.release(blocks[::-1])
    pool.release(blocks[::-1])
    assert pool.num_evictable == 3 and pool.allocate(7 - 3 + 1)[-1] == blocks[2]  # tail first, LRU kept
    pool.check_integrity()


def test_a_free_block_released_again_is_caught():
    pool = BlockPool(5)
    a, b = pool.allocate(2)
    pool.release([a])
    with pytest.raises(RuntimeError, match="not in use"):
        pool.release([a])
    (c,) = pool.allocate(1)  # the block just freed comes back with count 1
    assert c == a and pool.ref_cnt[a] == 1
    pool.release([a, b])
    with pytest.raises(RuntimeError, match="not in use"):
        pool.release([b])
    pool.check_integrity()
    assert pool.num_free == 4


BS, W = 4, 8


def make_kv(num_blocks: int = 128, **kw) -> KVManager:
    config = make_config(block_size=BS, window=W, num_blocks=num_blocks, **kw)
    return KVManager(config.kv_groups, config.num_blocks, config.cache.enable_prefix_caching)


def run_to_end(kv: KVManager, req: Request) -> bool:
    """Computes the rest of req's tokens; False (and req freed) when the blocks are short."""
    if not kv.allocate(req, req.num_tokens - req.num_computed):
        kv.free(req)
        return False
    req.num_computed = req.num_tokens
    kv.advance(req)
    return True


def plain_hit(kv: KVManager, req: Request) -> list[list[int]]:
    """The hit blocks per cacheable group, looked up from scratch: the leading whole blocks (never the
    whole history) that every cacheable group's index holds."""
    limit = (req.num_tokens - 1) // kv.block_size
    indices = [kv.indices[i] for i in kv.cacheable]
    n = 0
    while n < min(limit, len(req.block_hashes)) and all(req.block_hashes[n] in idx for idx in indices):
        n += 1
    return [[index.blocks[x] for x in req.block_hashes[:n]] for index in indices]


@pytest.mark.parametrize("bounded", [True, False])
def test_hit_memo_agrees_with_a_fresh_lookup(bounded):
    rng = random.Random(7)
    kv = make_kv(num_blocks=60, bounded_replay=bounded)
    assert len(kv.cacheable) == (1 if bounded else 2)
    bases = [[rng.randrange(50) for _ in range(40)] for _ in range(3)]
    held: list[Request] = []
    for i in range(300):
        base = rng.choice(bases)
        tokens = base[: rng.randint(1, 40)] + [rng.randrange(50) for _ in range(rng.randint(0, 6))]
        req = make_req(kv, f"r{i}", tokens)
        expect = plain_hit(kv, req)
        assert kv.hit_block_ids(req) == expect
        if rng.random() < 0.5 and kv.admit_chunk(req, len(tokens)) and run_to_end(kv, req):
            held.append(req)
        while held and (rng.random() < 0.4 or len(held) > 6):
            kv.free(held.pop(rng.randrange(len(held))))
        kv.check_integrity()
    # Evictions happened (the pools are small), so the memo was invalidated on the way.
    assert sum(kv.indices[i].removals for i in kv.cacheable) > 0


def test_hit_memo_is_dropped_when_its_blocks_are_evicted():
    kv = make_kv(num_blocks=12)  # 11 usable blocks per group
    prefix = list(range(100, 120))  # 5 blocks
    a = make_req(kv, "a", prefix + [1])
    assert kv.admit_chunk(a, a.num_tokens) and run_to_end(kv, a)
    b = make_req(kv, "b", prefix + [2])
    assert [len(ids) for ids in kv.hit_block_ids(b)] == [5]  # remembered
    kv.free(a)
    full = kv.cacheable[0]
    pool = kv.pools[full]
    taken = pool.allocate(pool.num_available)  # evicts all cached blocks: their index entries go
    c = make_req(kv, "c", prefix + [3])
    assert kv.hit_block_ids(c) == [[]]
    pool.release(taken)
    kv.check_integrity(idle=True)


def one_token_then_allocate(kv: KVManager, req: Request, max_tokens: int) -> int:
    """admit_chunk's first chunk the long way: a one-token first chunk, then `allocate` for the rest."""
    assert kv.admit_chunk(req, 1)
    n = min(req.num_tokens - req.num_computed, max_tokens)
    assert kv.allocate(req, n)
    req.new_block_ids = None  # admitted this step: the NewRequest carries the whole lists
    return n


@pytest.mark.parametrize("bounded", [True, False])
def test_admit_chunk_equals_a_one_token_chunk_grown_by_allocate(bounded):
    """Where the chunk fits, the one-pass admission leaves the request and the pools exactly as the long
    way does; where it does not, it takes nothing (hit blocks it shared are given back)."""
    rng = random.Random(3)
    kvs = [make_kv(num_blocks=40, bounded_replay=bounded) for _ in range(2)]
    held: list[list[Request]] = [[], []]
    prefix = [rng.randrange(50) for _ in range(36)]
    shortages = 0
    for i in range(200):
        tokens = prefix[: rng.randint(1, 36)] + [rng.randrange(50) for _ in range(rng.randint(1, 30))]
        max_tokens = rng.randint(1, 40)
        reqs = [make_req(kv, f"r{i}", tokens) for kv in kvs]
        ref_cnt = [pool.ref_cnt for pool in kvs[0].pools]
        n = kvs[0].admit_chunk(reqs[0], max_tokens)
        if n:
            assert one_token_then_allocate(kvs[1], reqs[1], max_tokens) == n
        else:  # the same admission on both, so the two managers stay alike
            shortages += 1
            assert kvs[1].admit_chunk(reqs[1], max_tokens) == 0
            assert reqs[0].block_ids == [] and reqs[0].num_computed == 0
            assert [pool.ref_cnt for pool in kvs[0].pools] == ref_cnt
        for name in Request.__slots__:
            assert getattr(reqs[0], name) == getattr(reqs[1], name), name
        for p0, p1 in zip(kvs[0].pools, kvs[1].pools, strict=True):
            assert p0.ref_cnt == p1.ref_cnt and p0.free_block_ids() == p1.free_block_ids()
            assert list(p0._evictable) == list(p1._evictable)
        if n:
            done = [run_to_end(kv, req) for kv, req in zip(kvs, reqs, strict=True)]
            assert done[0] == done[1]
            if done[0]:
                for k in range(2):
                    held[k].append(reqs[k])
        if rng.random() < 0.5:
            j = rng.randrange(len(held[0])) if held[0] else -1
            for k, kv in enumerate(kvs):
                if j >= 0:
                    kv.free(held[k].pop(j))
        for kv in kvs:
            kv.check_integrity()
    assert shortages > 0
