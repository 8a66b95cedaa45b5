"""Per-shard coordinator over the model's KV cache groups: admit, allocate, advance, free.

Every group has its own pool (`BlockPool`) and block table, all with the same block size, so block j of
every group covers tokens [j * block_size, (j + 1) * block_size). Groups fall in three kinds:

- cacheable (full attention; window groups too when bounded replay is off): hit blocks are shared, full
  computed blocks are registered in the group's prefix index, nothing is released before the request ends.
- window (sliding attention with bounded replay on): never shared; null blocks below `replay_start`;
  blocks wholly before `num_computed - W + 1` are released as the request advances (SPEC 3.8).
- plain (prefix caching off): fresh blocks only.

A request's per-group block lists are index-aligned with its tokens; a released or null entry is 0.
"""

from __future__ import annotations

from raystate.config import KVCacheGroupSpec, replay_tokens
from raystate.scheduler.block_pool import NULL_BLOCK, BlockPool
from raystate.scheduler.prefix_cache import PrefixIndex, extend_block_hashes, longest_hit
from raystate.scheduler.replay import NO_HIT, ReplayPlan, max_hit_blocks, plan_replay
from raystate.scheduler.request import Request

_NEVER = 1 << 62


class KVManager:
    def __init__(
        self,
        groups: tuple[KVCacheGroupSpec, ...],
        num_blocks: int,
        enable_prefix_caching: bool = True,
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
        # Window groups release blocks behind the window unless they are cached (SPEC 3.7-3.8).
        self.window = [
            (i, g.sliding_window) for i, g in enumerate(groups) if g.is_sliding and i not in self.cacheable
        ]
        self.indices = [PrefixIndex() if i in self.cacheable else None for i in range(len(groups))]
        self.pools = [BlockPool(num_blocks, index) for index in self.indices]
        self._cacheable_indices = [self.indices[i] for i in self.cacheable]
        self._no_blocks = ((),) * len(groups)  # list(map(list, ...)) of it: one empty list per group
        # The most tokens one request can hold blocks for (a full group keeps all of them; a prefill
        # chunk needs window blocks for all of its tokens at once).
        self.max_tokens_held = (num_blocks - 1) * self.block_size

    # -- admission ---------------------------------------------------------------------------------------

    def hash_blocks(self, req: Request, num_blocks: int) -> None:
        """Makes sure `req.block_hashes` covers its first `num_blocks` full blocks (each hashed once)."""
        if self.caching and len(req.block_hashes) < num_blocks:
            extend_block_hashes(req.block_hashes, req.token_ids, self.block_size, num_blocks)

    def lookup(self, req: Request) -> int:
        """Leading whole blocks of req's history held by every cacheable group (capped below its length)."""
        if not self._cacheable_indices:
            return 0
        limit = max_hit_blocks(req.num_tokens, self.block_size)
        self.hash_blocks(req, limit)
        return longest_hit(self._cacheable_indices, req.block_hashes, limit)

    def plan(self, req: Request) -> ReplayPlan:
        """What admitting req here would give (SPEC 3 steps 1-4), without taking anything."""
        if not self._cacheable_indices:
            return NO_HIT
        return plan_replay(self.lookup(req), req.num_tokens, self.block_size, self.replay_tokens)

    def admit(self, req: Request) -> ReplayPlan:
        """Starts req (num_computed == 0, no blocks): shares its hit blocks and sets num_computed,
        replay_start and num_cached_tokens. Blocks for its first chunk come from `allocate`."""
        if req.block_ids:
            raise RuntimeError(f"admit: request {req.req_id!r} already holds blocks")
        plan = self.plan(req)
        bs = self.block_size
        shared = plan.num_shared_blocks
        hashes = req.block_hashes
        block_ids: list[list[int]] = [[] for _ in self.groups]
        for i in self.cacheable:
            if shared:
                ids = list(map(self.indices[i].blocks.__getitem__, hashes[:shared]))
                self.pools[i].share(ids)
                block_ids[i] = ids
        num_null = plan.replay_start // bs
        for i, _ in self.window:
            block_ids[i] = [NULL_BLOCK] * num_null
        req.block_ids = block_ids
        req.new_block_ids = None
        req.block_capacity = min(map(len, block_ids)) * bs
        req.num_registered = shared
        req.num_released = [num_null] * len(self.window)
        req.num_computed = plan.num_computed
        req.replay_start = plan.replay_start
        req.num_cached_tokens = plan.hit_tokens
        self._set_check_at(req)
        return plan

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
        for pool, ids in zip(pools, block_ids, strict=True):
            if need - len(ids) > pool.num_available:
                return False
        new = req.new_block_ids
        if new is None:
            new = req.new_block_ids = list(map(list, self._no_blocks))
        for pool, ids, new_ids in zip(pools, block_ids, new, strict=True):
            n = need - len(ids)
            if n > 0:
                fresh = pool.allocate(n)
                ids += fresh
                new_ids += fresh
        req.block_capacity = min(map(len, block_ids)) * bs
        return True

    def take_new_block_ids(self, req: Request) -> list[list[int]]:
        """The blocks allocated since the last message (what a RunningDelta carries); resets them."""
        new = req.new_block_ids
        req.new_block_ids = None
        return new if new is not None else list(map(list, self._no_blocks))

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
        for k, (_, window) in enumerate(self.window):
            check_at = min(check_at, (req.num_released[k] + 1) * bs + window - 1)
        if self._cacheable_indices:
            register_at = (req.num_registered + 1) * bs
            if not register_at <= check_at < register_at + bs:
                check_at = min(check_at, register_at)
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
        """Preemption by recompute (SPEC 3.6), or an admission taken back: frees req's blocks and resets
        its KV progress, so its next admission starts again from SPEC 3 step 1."""
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
