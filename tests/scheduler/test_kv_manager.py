"""KVManager: DESIGN section 3 on one shard's pools (hits, replay, null/fresh window blocks, SWA release)."""

from sched_harness import make_config, make_req

from raystate.scheduler.kv_manager import KVManager
from raystate.scheduler.request import Request

BS, W = 4, 8


def make_kv(**kw) -> tuple[KVManager, int, int]:
    config = make_config(block_size=BS, window=W, **kw)
    kv = KVManager(config.kv_groups, config.num_blocks, config.cache.enable_prefix_caching)
    names = [g.name for g in config.kv_groups]
    return kv, names.index("full"), (names.index("sliding") if "sliding" in names else -1)


def compute(kv: KVManager, req: Request, n: int) -> None:
    """What the scheduler does around one step: blocks for the chunk, then the chunk is computed."""
    assert kv.allocate(req, n)
    req.num_computed += n
    if req.num_computed >= req.kv_check_at:
        kv.advance(req)


def run_cold(kv: KVManager, req_id: str, tokens: list[int]) -> Request:
    req = make_req(kv, req_id, tokens)
    assert kv.admit_chunk(req, len(tokens)) == len(tokens) and req.num_cached_tokens == 0
    compute(kv, req, len(tokens))
    return req


PREFIX = list(range(100, 120))  # 20 tokens: 5 whole blocks


def test_cold_request_registers_full_blocks_and_releases_the_window():
    kv, full, sliding = make_kv()
    a = run_cold(kv, "a", PREFIX)
    assert len(kv.indices[full]) == 5 and kv.indices[sliding] is None
    # Window blocks wholly before 20 - 8 + 1 = 13 (blocks 0..2) went back to the pool.
    assert a.block_ids[sliding][:3] == [0, 0, 0] and all(a.block_ids[sliding][3:])
    assert kv.pools[sliding].num_in_use == 2
    kv.free(a)
    assert kv.pools[full].num_evictable == 5 and kv.pools[full].num_in_use == 0
    assert kv.pools[sliding].num_in_use == 0 and kv.pools[sliding].num_evictable == 0
    kv.check_integrity(idle=True)


def test_hit_longer_than_window_replays_and_shares_every_hit_block():
    kv, full, sliding = make_kv()
    a = run_cold(kv, "a", PREFIX)
    a_full = list(a.block_ids[full])
    b = make_req(kv, "b", PREFIX + [1, 2, 3, 4, 5])
    assert kv.plan(b).hit_tokens == 20
    # A first chunk ending inside [replay_start, h) = [12, 20): no new full block, a fresh window block.
    in_use = kv.pools[full].num_in_use
    assert kv.admit_chunk(b, 4) == 4
    assert b.num_cached_tokens == 20 and b.replay_start == b.num_computed == 20 - W
    assert b.block_ids[full] == a_full  # replayed blocks 3-4 stay shared too
    assert all(kv.pools[full].ref_cnt[blk] == 2 for blk in a_full)
    assert kv.pools[full].num_in_use == in_use
    assert b.block_ids[sliding][:3] == [0, 0, 0]  # null below replay_start (12 = 3 blocks)
    assert len(b.block_ids[sliding]) == 4 and b.block_ids[sliding][3] != 0
    assert b.new_block_ids is None  # the NewRequest carries the whole lists
    b.num_computed += 4
    kv.advance(b)
    assert b.num_computed == 16 and b.num_registered == 5

    # The rest: blocks past h are new in both groups.
    assert kv.allocate(b, 9)
    assert b.block_ids[full][:5] == a_full and len(b.block_ids[full]) == 7
    assert len(b.block_ids[sliding]) == 7
    new = b.new_block_ids  # everything allocated since admission: the next RunningDelta's
    assert new[full] == b.block_ids[full][5:] and new[sliding] == b.block_ids[sliding][4:]

    kv.free(a)
    assert all(kv.pools[full].ref_cnt[blk] == 1 for blk in a_full)
    kv.free(b)
    kv.check_integrity(idle=True)


def test_hit_of_exactly_the_window_is_dropped():
    kv, full, sliding = make_kv()
    kv.free(run_cold(kv, "a", PREFIX[:8] + [7, 7, 7]))  # caches 2 blocks = 8 tokens = W
    b = make_req(kv, "b", PREFIX[:8] + [9, 9, 9, 9, 9])
    assert kv.lookup(b) == 2
    assert kv.plan(b).hit_tokens == 0
    assert kv.admit_chunk(b, 1) == 1
    assert b.num_computed == 0 and b.replay_start == 0 and b.num_cached_tokens == 0
    assert [len(ids) for ids in b.block_ids] == [1, 1]
    assert kv.pools[full].num_in_use == 1 and kv.pools[full].num_evictable == 2  # nothing shared


def test_hit_shorter_than_the_window_is_dropped():
    kv, full, _ = make_kv()
    kv.free(run_cold(kv, "a", PREFIX[:4] + [7, 7, 7]))
    b = make_req(kv, "b", PREFIX[:4] + [9, 9, 9, 9, 9])
    assert kv.lookup(b) == 1
    assert kv.admit_chunk(b, 1) and b.num_cached_tokens == 0 and b.num_computed == 0


def test_full_prompt_hit_still_computes_the_last_token():
    kv, full, sliding = make_kv()
    prompt = PREFIX[:16]  # 4 whole blocks
    run_cold(kv, "a", prompt + [5])
    b = make_req(kv, "b", prompt)
    assert kv.lookup(b) == 3  # capped below the prompt length
    assert kv.admit_chunk(b, 1)
    assert b.num_cached_tokens == 12 and b.num_computed == b.replay_start == 12 - W

    kv0, full0, _ = make_kv(layer_types=("full", "full"))  # P = 0: plain prefix hit
    a0 = run_cold(kv0, "a", prompt + [5])
    c = make_req(kv0, "c", prompt)
    assert kv0.admit_chunk(c, 4) == 4
    assert c.num_computed == 12 and c.replay_start == 0
    assert c.block_ids[full0][:3] == a0.block_ids[full0][:3]
    assert len(c.block_ids[full0]) == 4 and c.block_ids[full0][3] not in a0.block_ids[full0]


def test_window_blocks_are_released_as_the_request_advances():
    kv, full, sliding = make_kv()
    req = make_req(kv, "a", list(range(60)))
    assert kv.admit_chunk(req, 1)
    for _ in range(60):
        compute(kv, req, 1)
        floor = (req.num_computed - W + 1) // BS
        held = [j for j, blk in enumerate(req.block_ids[sliding]) if blk]
        assert held == list(range(max(floor, 0), len(req.block_ids[sliding])))
        assert kv.pools[sliding].num_in_use == len(held) <= W // BS + 1
    assert kv.pools[full].num_in_use == 15  # full attention keeps everything
    kv.free(req)
    kv.check_integrity(idle=True)


def test_bounded_replay_off_caches_window_blocks_and_releases_none():
    kv, full, sliding = make_kv(bounded_replay=False)
    assert kv.replay_tokens == 0 and kv.indices[sliding] is not None
    a = run_cold(kv, "a", PREFIX)
    assert all(a.block_ids[sliding]) and kv.pools[sliding].num_in_use == 5
    b = make_req(kv, "b", PREFIX + [1, 2])
    assert kv.admit_chunk(b, 1)
    assert b.num_cached_tokens == 20 and b.num_computed == 20 and b.replay_start == 0
    assert b.block_ids[sliding][:5] == a.block_ids[sliding] and b.block_ids[full][:5] == a.block_ids[full]
    assert all(kv.pools[sliding].ref_cnt[blk] == 2 for blk in a.block_ids[sliding])
    kv.free(a)
    kv.free(b)
    # A hit needs every cacheable group: evict the window group's copy of block 4 only (a request's
    # blocks are released tail first, so its last block is the least recently used).
    pool = kv.pools[sliding]
    taken = pool.allocate(pool.num_free + 1)
    c = make_req(kv, "c", PREFIX + [3, 3])
    assert kv.lookup(c) == 4 and len(kv.indices[full]) == 5
    pool.release(taken)
    kv.check_integrity(idle=True)


def test_prefix_caching_off_has_no_hits():
    kv, full, sliding = make_kv(caching=False)
    a = run_cold(kv, "a", PREFIX)
    assert a.block_hashes == [] and kv.indices == [None, None]
    b = make_req(kv, "b", PREFIX + [1])
    assert kv.lookup(b) == 0 and kv.admit_chunk(b, 1) and b.num_cached_tokens == 0 and b.num_computed == 0
    kv.free(a)
    assert kv.pools[full].num_evictable == 0


def test_failed_allocation_takes_nothing():
    kv, full, sliding = make_kv(num_blocks=6)  # 5 usable blocks per group
    a = make_req(kv, "a", list(range(40)))
    before = kv.num_available()
    assert kv.admit_chunk(a, 24) == 0  # 6 blocks: the admission is taken back
    assert kv.num_available() == before and a.block_ids == [] and a.num_computed == 0
    assert kv.admit_chunk(a, 4) == 4
    before = kv.num_available()
    assert not kv.allocate(a, 24)
    assert kv.num_available() == before and [len(ids) for ids in a.block_ids] == [1, 1]
    assert a.new_block_ids is None
    assert kv.allocate(a, 20)
    kv.free(a)
    kv.check_integrity(idle=True)


def test_registration_is_at_most_one_block_late_and_free_completes_it():
    kv, full, _ = make_kv()
    req = make_req(kv, "a", list(range(40)))
    assert kv.admit_chunk(req, 1)
    late = 0
    while req.num_computed < 39:
        compute(kv, req, 1)
        lag = req.num_computed // BS - req.num_registered
        assert 0 <= lag <= 1
        late += lag
        if lag and late > 3:
            break
    assert lag == 1  # stopped with a full block not yet indexed
    computed = req.num_computed
    kv.free(req)
    assert len(kv.indices[full]) == computed // BS  # free indexed it
    again = make_req(kv, "b", list(range(40)))
    assert kv.lookup(again) == computed // BS


def test_a_hit_needs_every_cacheable_group_and_stops_at_the_first_miss():
    kv, full, sliding = make_kv(bounded_replay=False)  # both groups cacheable
    req = make_req(kv, "r", list(range(25)))  # 6 whole blocks below the last token
    hashes = req.block_hashes
    for j, h in enumerate(hashes):
        if j != 2:
            kv.indices[full].insert(h, 10 + j)
        kv.indices[sliding].insert(h, 20 + j)
    assert kv.lookup(req) == 2
    assert kv.hit_block_ids(req) == [[10, 11], [20, 21]]
    kv.indices[sliding].forget(hashes[1], 21)
    assert kv.lookup(req) == 1
    short = make_req(kv, "s", list(range(17)))  # 4 whole blocks below the last token
    kv.indices[full].insert(hashes[2], 12)
    kv.indices[sliding].insert(hashes[1], 21)
    assert kv.lookup(short) == 4 and kv.lookup(req) == 6
