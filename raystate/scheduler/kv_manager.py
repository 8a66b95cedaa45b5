"""Per-shard coordinator over the model's KV cache groups: admit, allocate, advance, free.

Every group has its own pool (`BlockPool`) and block table, all with the same block size, so block j of
every group covers tokens [j * block_size, (j + 1) * block_size). Groups fall in three kinds:

- cacheable (full attention; window groups too when bounded replay is off): hit blocks are shared, full
  computed blocks are registered in the group's prefix index, nothing is released before the request ends.
- window (sliding attention with bounded replay on): never cached; null blocks below `replay_start`;
  blocks wholly before `num_computed - W + 1` are released as the request advances (DESIGN 3.8). Shared
  only within one step, by requests that replay the same hit (shared replay, below).
- plain (prefix caching off): fresh blocks only.

A request's per-group block lists are index-aligned with its tokens; a released or null entry is 0.

Shared replay: a burst of requests with one cached system prompt all hit the same h and would each
recompute the same P tokens [h - P, h) to rebuild the same window KV. With `share_replay`, the first of
them admitted in a step replays (DESIGN 3.3) and becomes that hit's donor; each later one in the same step
shares the donor's window blocks over [replay_start, h) and starts computing at h, its replay start still
h - P (the floor of its window reads). That is exact against DESIGN 4's truncated-replay reference: the
window KV over [h - P, h) is the same function of the same tokens and the same cached full-attention KV
whichever request computes it, and within one step every layer writes all rows' KV before any row reads
it, so the borrowers read what the donor wrote. Only within a step: a donor's blocks behind its window
are released as it advances, so a later step never borrows.
"""

from __future__ import annotations

from collections.abc import Sequence

from raystate.kv_layout import KVCacheGroupSpec, replay_tokens
from raystate.scheduler.block_pool import NULL_BLOCK, BlockPool
from raystate.scheduler.prefix_cache import PrefixIndex, extend_block_hashes
from raystate.scheduler.replay import NO_HIT, ReplayPlan, max_hit_blocks, plan_replay
from raystate.scheduler.request import Request

_NEVER = 1 << 62


class KVManager:
    def __init__(
        self,
        groups: tuple[KVCacheGroupSpec, ...],
        num_blocks: int | Sequence[int],  # per group (one int: the same for every group)
        enable_prefix_caching: bool = True,
        share_replay: bool = True,
    ) -> None:
        if not groups:
            raise ValueError("groups: the model needs at least one KV cache group")
        sizes = {g.block_size for g in groups}
        if len(sizes) != 1:
            raise ValueError(f"block_size: every group must use the same block size, got {sorted(sizes)}")
        self.groups = groups
        self.block_size = sizes.pop()
        self.caching = enable_prefix_caching
        self.replay_tokens = replay_tokens(groups) if enable_prefix_caching else 0
        self.cacheable = [i for i, g in enumerate(groups) if enable_prefix_caching and g.prefix_cacheable]
        # Window groups release blocks behind the window unless they are cached (DESIGN 3.7-3.8).
        self.window = [
            (i, g.sliding_window) for i, g in enumerate(groups) if g.is_sliding and i not in self.cacheable
        ]
        self.share_replay = share_replay and self.replay_tokens > 0 and bool(self.window)
        self.indices = [PrefixIndex() if i in self.cacheable else None for i in range(len(groups))]
        counts = [num_blocks] * len(groups) if isinstance(num_blocks, int) else list(num_blocks)
        if len(counts) != len(groups):
            raise ValueError(f"num_blocks: one count per group ({len(groups)}), got {len(counts)}")
        self.pools = [BlockPool(n, index) for n, index in zip(counts, self.indices, strict=True)]
        self._cacheable_indices = [self.indices[i] for i in self.cacheable]
        # hit_block_ids' memo of the last hit: its hashes, its block ids per cacheable group, and the
        # sum of the indices' removal counts when it was found.
        self._memo_hashes: list[bytes] = []
        self._memo_ids: list[list[int]] = [[] for _ in self.cacheable]
        self._memo_stamp = 0
        self._no_blocks = ((),) * len(groups)  # list(map(list, ...)) of it: one empty list per group
        # The most tokens one request can hold blocks for: what its smallest non-window pool holds (window
        # groups hold only a window and a chunk; `EngineConfig.group_num_blocks` sizes them for that).
        window_ids = {i for i, _ in self.window}
        held = [n for i, n in enumerate(counts) if i not in window_ids] or counts
        self.max_tokens_held = (min(held) - 1) * self.block_size

    # -- admission ---------------------------------------------------------------------------------------

    def hash_blocks(self, req: Request, num_blocks: int) -> None:
        """Makes sure `req.block_hashes` covers its first `num_blocks` full blocks (each hashed once)."""
        if self.caching and len(req.block_hashes) < num_blocks:
            extend_block_hashes(req.block_hashes, req.token_ids, self.block_size, num_blocks)

    def lookup(self, req: Request) -> int:
        """Leading whole blocks of req's history held by every cacheable group (capped below its length)."""
        if not self._cacheable_indices:
            return 0
        return len(self.hit_block_ids(req)[0])

    def plan(self, req: Request) -> ReplayPlan:
        """What admitting req here would give (DESIGN 3 steps 1-4), without taking anything."""
        if not self._cacheable_indices:
            return NO_HIT
        return plan_replay(self.lookup(req), req.num_tokens, self.block_size, self.replay_tokens)

    def hit_block_ids(self, req: Request) -> list[list[int]]:
        """Per cacheable group, the ids of the leading blocks of req's history that every cacheable group
        holds (capped below its length; every list has the same length): the one hit lookup, for routing
        (`plan`) and admission alike.

        One pass per group over the hashes finds the hit and collects its blocks, so admission does not
        look the hashes up a second time to share them. The last hit found is remembered: the leading
        blocks a request has in common with it (equal chained hashes: the same whole prefix) come from
        the memo and only the blocks after them are looked up, so a burst of prompts sharing a long
        system prompt looks the shared blocks up once. The memo holds while no index entry is removed
        (an entry, once in, keeps its block until then).
        """
        indices = self._cacheable_indices
        if not indices:
            return []
        limit = max_hit_blocks(req.num_tokens, self.block_size)
        self.hash_blocks(req, limit)
        hashes = req.block_hashes
        stamp = 0
        for index in indices:
            stamp += index.removals
        start = 0  # leading blocks known from the memo
        if stamp == self._memo_stamp:
            memo = self._memo_hashes
            hi = len(memo) if len(memo) < limit else limit
            if hi and hashes[hi - 1] == memo[hi - 1]:
                start = hi
            elif hi > 1 and hashes[0] == memo[0]:
                # Chained hashes agree up to where the prefixes part and differ after: bisect for it.
                lo = 1  # hashes[lo - 1] == memo[lo - 1] and hashes[hi - 1] != memo[hi - 1]
                while hi - lo > 1:
                    mid = (lo + hi) // 2
                    if hashes[mid - 1] == memo[mid - 1]:
                        lo = mid
                    else:
                        hi = mid
                start = lo
        stop = limit  # the hit ends here or at the first block some group lacks
        hit: list[list[int]] = []
        known = self._memo_ids
        for k, index in enumerate(indices):
            ids = known[k][:start]
            if stop > start:
                get = index.blocks.get
                for j in range(start, stop):
                    if (block := get(hashes[j])) is None:
                        break
                    ids.append(block)
                stop = len(ids)  # later groups need look no further than this one holds
            hit.append(ids)
        if len(hit) > 1:  # an earlier group may hold more than a later one: the hit is the common part
            for ids in hit:
                del ids[stop:]
        if stop > start or stamp != self._memo_stamp:  # found blocks the memo did not know
            self._memo_hashes = hashes[:stop]
            self._memo_ids = [ids.copy() for ids in hit]
            self._memo_stamp = stamp
        return hit

    def admit_chunk(self, req: Request, max_tokens: int, donors: dict | None = None) -> int:
        """Starts req (num_computed == 0, no blocks): DESIGN 3 steps 1-4 (shares its hit blocks, sets
        num_computed, replay_start and num_cached_tokens), then blocks for its first chunk of n =
        min(tokens to compute, max_tokens) tokens, in one pass. Returns n, or 0 when some pool is short:
        then the admission is taken back (`preempt`) and req holds nothing.

        `donors` is the step's record of replayed hits (an empty dict at the step's first admission,
        the same dict for every admission of the step): with shared replay, a request whose hit was
        already replayed in this step borrows that window instead (module docstring), and one whose
        first chunk replays a whole hit is recorded as its donor.

        The new blocks are not recorded in `req.new_block_ids`: a request admitted in this step goes
        out as a NewRequest carrying its whole block lists.

        Admission runs once per request but a burst admits many at once, so this is written flat:
        no zip(strict=...) (it builds a kwargs dict per call) and no min() of two ints.
        """
        if req.block_ids:
            raise RuntimeError(f"admit: request {req.req_id!r} already holds blocks")
        bs = self.block_size
        pools = self.pools
        block_ids: list[list[int]] = list(map(list, self._no_blocks))
        plan = NO_HIT
        # A request with prompt_logprobs takes no hit: every prompt position's logits are computed (its
        # full blocks are still registered for later requests as they fill).
        if self._cacheable_indices and req.sampling.prompt_logprobs is None:
            hit = self.hit_block_ids(req)
            plan = plan_replay(len(hit[0]), req.num_tokens, bs, self.replay_tokens)
            if plan.num_shared_blocks:  # then every hit list has exactly that many blocks
                for k, i in enumerate(self.cacheable):
                    ids = hit[k]
                    pools[i].share(ids)
                    block_ids[i] = ids
        num_computed, replay_start, num_shared, hit_tokens = plan
        num_null = replay_start // bs  # window blocks wholly below the replay start
        window = self.window
        if num_null:
            for i, _ in window:
                block_ids[i] = [NULL_BLOCK] * num_null
        donor_key = None
        if replay_start and donors is not None and self.share_replay:
            # The hit's identity: its length and its last block (ids are unique per chained hash while
            # the hit holds them, and every hit block is held through this step).
            donor_key = (num_shared, block_ids[self.cacheable[0]][-1])
            borrowed = donors.get(donor_key)
            if borrowed is not None:  # the window over [replay_start, h) is rebuilt by the donor
                for k, (i, _) in enumerate(window):
                    pools[i].share(borrowed[k])
                    block_ids[i] += borrowed[k]
                num_computed = hit_tokens
                donor_key = None
        n = 0
        if max_tokens > 0:
            n = req.num_tokens - num_computed
            if n > max_tokens:
                n = max_tokens
            need = -(-(num_computed + n) // bs)  # blocks covering the first chunk, in every group
            for i, pool in enumerate(pools):
                if need - len(block_ids[i]) > pool.num_available:
                    n = -1
                    break
            else:
                for i, pool in enumerate(pools):
                    ids = block_ids[i]
                    if need > len(ids):
                        ids += pool.allocate(need - len(ids))
                if donor_key is not None and num_computed + n >= hit_tokens:  # replays the whole hit
                    hit_blocks = hit_tokens // bs
                    donors[donor_key] = [block_ids[i][num_null:hit_blocks] for i, _ in window]
        capacity = _NEVER
        for ids in block_ids:
            if len(ids) < capacity:
                capacity = len(ids)
        req.block_ids = block_ids
        req.new_block_ids = None
        req.block_capacity = capacity * bs
        req.num_registered = num_shared
        req.num_released = [num_null] * len(window)
        req.num_computed = num_computed
        req.replay_start = replay_start
        req.num_cached_tokens = hit_tokens
        self._set_check_at(req)
        if n < 0:  # a pool is short: take the admission back
            self.preempt(req)
            n = 0
        return n

    def fork(self, child: Request, parent: Request) -> int:
        """Starts `child`, a sibling with parent's prompt (n > 1), on parent's blocks: parent's last prompt
        chunk is scheduled in this step, so parent holds blocks for its whole prompt of P tokens and writes
        its KV in this step. The child shares parent's blocks below the fork point f (the whole blocks
        before the one holding token P - 1, in every group), takes fresh blocks from f on and computes
        [f, P) in this same step: within one step every layer writes all rows' KV before any row reads
        it, so the child reads what parent writes (as shared replay's borrowers do). The block at f is the
        first one the two may write differently, so it is never shared.

        A window group shares only the blocks the child's queries read (from f - W + 1 on); if parent has
        already released one of them (a last chunk that starts past f), there is no fork. Returns the
        tokens the child computes (P - f), or 0 when it cannot fork here (the child then holds nothing).
        """
        if child.block_ids:
            raise RuntimeError(f"fork: request {child.req_id!r} already holds blocks")
        bs = self.block_size
        prompt = parent.num_tokens
        fork_at = (prompt - 1) // bs * bs
        shared = fork_at // bs
        if not shared or len(parent.block_ids) != len(self.pools):
            return 0
        window = dict(self.window)
        block_ids: list[list[int]] = []
        released: list[int] = []
        for i, parent_ids in enumerate(parent.block_ids):
            lo = 0
            if i in window:
                lo = max(0, fork_at - window[i] + 1) // bs  # the first block the child's queries read
                released.append(lo)
            ids = parent_ids[lo:shared]
            if len(ids) != shared - lo or NULL_BLOCK in ids:
                return 0
            block_ids.append(ids)
        need = -(-prompt // bs)
        for pool in self.pools:
            if need - shared > pool.num_available:
                return 0
        for i, pool in enumerate(self.pools):
            pool.share(block_ids[i])
            lo = shared - len(block_ids[i])
            block_ids[i] = [NULL_BLOCK] * lo + block_ids[i] + pool.allocate(need - shared)
        child.block_ids = block_ids
        child.new_block_ids = None
        child.block_capacity = need * bs
        child.num_registered = shared if self._cacheable_indices else 0  # parent registers those
        child.num_released = released
        child.num_computed = fork_at
        child.replay_start = parent.replay_start  # the floor parent's window KV was computed under
        child.num_cached_tokens = fork_at
        self._set_check_at(child)
        return prompt - fork_at

    # -- growth ------------------------------------------------------------------------------------------

    def allocate(self, req: Request, num_scheduled: int) -> bool:
        """Gives req blocks for every token below num_computed + num_scheduled, in every group; False (and
        nothing taken) when some pool is short. A chunk ending inside the shared hit allocates no new
        cacheable block. New ids are also appended to `req.new_block_ids` until they are sent."""
        end = req.num_computed + num_scheduled
        if end <= req.block_capacity:
            return True
        bs = self.block_size
        need = -(-end // bs)
        block_ids = req.block_ids
        pools = self.pools
        for i, pool in enumerate(pools):  # not zip(strict=...): it builds a kwargs dict per call
            if need - len(block_ids[i]) > pool.num_available:
                return False
        new = req.new_block_ids
        if new is None:
            new = req.new_block_ids = list(map(list, self._no_blocks))
        capacity = _NEVER
        for i, pool in enumerate(pools):
            ids = block_ids[i]
            n = need - len(ids)
            if n > 0:
                fresh = pool.allocate(n)
                ids += fresh
                new[i] += fresh
            if len(ids) < capacity:
                capacity = len(ids)
        req.block_capacity = capacity * bs
        return True

    def advance(self, req: Request) -> None:
        """After req.num_computed grew: registers newly full blocks in the cacheable groups' indices and
        releases window blocks that fell wholly behind the window. Callers skip the call while
        req.num_computed < req.kv_check_at (nothing is due before then)."""
        bs = self.block_size
        computed = req.num_computed
        if self._cacheable_indices and computed // bs > req.num_registered:
            self._register(req, computed // bs)
        released = req.num_released
        for k, (i, window) in enumerate(self.window):
            start = released[k]
            floor = (computed - window + 1) // bs  # blocks below it are outside every query's window
            if floor > start:
                ids = req.block_ids[i]
                dead = ids[start:floor]
                ids[start:floor] = [NULL_BLOCK] * (floor - start)
                dead.reverse()
                self.pools[i].release(dead)
                released[k] = floor
        self._set_check_at(req)

    def _register(self, req: Request, stop: int) -> None:
        """Indexes req's full blocks num_registered .. stop-1 in every cacheable group."""
        start = req.num_registered
        hashes = req.block_hashes
        if len(hashes) < stop:
            extend_block_hashes(hashes, req.token_ids, self.block_size, stop)
        for i in self.cacheable:
            register = self.pools[i].register
            ids = req.block_ids[i]
            for j in range(start, stop):
                register(ids[j], hashes[j])
        req.num_registered = stop

    def _set_check_at(self, req: Request) -> None:
        """The num_computed at which `advance` has work: the next window release or block registration.

        A registration due less than a block before the next release waits for it, so one call does both
        (during decode that halves the calls); a block then reaches the prefix index at most
        block_size - 1 tokens late, and `free` registers whatever is still due.
        """
        bs = self.block_size
        check_at = _NEVER
        released = req.num_released
        for k, (_, window) in enumerate(self.window):
            release_at = (released[k] + 1) * bs + window - 1
            if release_at < check_at:
                check_at = release_at
        if self._cacheable_indices:
            register_at = (req.num_registered + 1) * bs
            if check_at >= register_at + bs:  # else the release is due first, or soon enough after
                check_at = register_at
        req.kv_check_at = check_at

    # -- release -----------------------------------------------------------------------------------------

    def free(self, req: Request) -> None:
        """Drops every block req holds (cached ones stay indexed, evictable) and its block state. Full
        computed blocks not yet registered are registered first, so a finished or preempted request's
        whole computed prefix stays findable."""
        if (
            self._cacheable_indices
            and req.block_ids
            and req.num_computed // self.block_size > req.num_registered
        ):
            self._register(req, req.num_computed // self.block_size)
        for i, ids in enumerate(req.block_ids):
            self.pools[i].release(reversed(ids))
        req.block_ids = []
        req.new_block_ids = None
        req.block_capacity = 0
        req.num_registered = 0
        req.num_released = []
        req.kv_check_at = _NEVER

    def preempt(self, req: Request) -> None:
        """Preemption by recompute (DESIGN 3.6), or an admission taken back: frees req's blocks and resets
        its KV progress, so its next admission starts again from DESIGN 3 step 1."""
        self.free(req)
        req.num_computed = 0
        req.replay_start = 0
        req.num_cached_tokens = 0

    def reset(self, reqs: list[Request]) -> None:
        """The shard's KV is gone (its worker died): forgets every block and cached prefix, and the block
        state and progress of `reqs`, the requests that held blocks here."""
        for pool in self.pools:
            pool.reset()
        for req in reqs:
            req.block_ids = []
            self.preempt(req)

    # -- introspection -----------------------------------------------------------------------------------

    def num_available(self) -> list[int]:
        return [pool.num_available for pool in self.pools]

    def check_integrity(self, idle: bool = False) -> None:
        """Each pool's invariant; with idle=True also that no block is in use (no request holds any)."""
        for spec, pool in zip(self.groups, self.pools, strict=True):
            pool.check_integrity()
            if idle:
                assert pool.num_in_use == 0, f"group {spec.name}: {pool.num_in_use} blocks in use while idle"
