"""The scheduler actor's client side: who owns each request, and each client's updates until it polls.

A client long-polls for all of its requests at once (`take`), so a step costs one reply per client,
not one per request. Health checks are requests too, owned by `HEALTH`: their last update resolves a
future instead of going to a mailbox. A client that stops polling for `client_timeout_s` is gone
without saying so: `forget_silent` drops its mailbox and returns its requests, for the actor to abort.

Event-loop thread only (the step thread hands updates over with `call_soon_threadsafe`); no ray here.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import time

from raystate.errors import EngineDead
from raystate.messages import RequestUpdate

HEALTH = "__health__"  # owner of the health-check requests
_GC_INTERVAL_S = 10.0  # how often silent clients are looked for


@dataclasses.dataclass
class _Mailbox:
    """One client's updates waiting for its next poll."""

    updates: list[RequestUpdate] = dataclasses.field(default_factory=list)
    event: asyncio.Event = dataclasses.field(default_factory=asyncio.Event)
    last_poll: float = dataclasses.field(default_factory=time.monotonic)


class Outbox:
    def __init__(self, client_timeout_s: float) -> None:
        self.client_timeout_s = client_timeout_s
        self._owner: dict[str, str] = {}  # req_id -> client id
        self._boxes: dict[str, _Mailbox] = {}
        self._health: dict[str, asyncio.Future] = {}  # health request id -> its last update
        self._next_gc = 0.0

    def own(self, client_id: str, req_ids) -> None:
        """The client's mailbox (opened if new) receives these requests' updates."""
        self._boxes.setdefault(client_id, _Mailbox())
        for rid in req_ids:
            self._owner[rid] = client_id

    def expect_health(self, req_id: str, fut: asyncio.Future) -> None:
        """A health request: its last update resolves `fut`."""
        self._owner[req_id] = HEALTH
        self._health[req_id] = fut

    def health_requests(self) -> list[str]:
        return [r for r, c in self._owner.items() if c == HEALTH]

    def deliver(self, updates: list[RequestUpdate]) -> None:
        """Files each update with its owner (forgetting the owner at a request's last update) and wakes
        the clients that got some."""
        owner = self._owner
        woken = set()
        for u in updates:
            cid = owner.pop(u.req_id, None) if u.finished else owner.get(u.req_id)
            if cid == HEALTH:
                fut = self._health.pop(u.req_id, None)
                if fut is not None and not fut.done() and u.finished:
                    fut.set_result(u)
            elif cid is not None and (box := self._boxes.get(cid)) is not None:
                box.updates.append(u)
                woken.add(cid)
        for cid in woken:
            self._boxes[cid].event.set()

    async def take(self, client_id: str, max_wait_s: float, wait: bool = True) -> list[RequestUpdate]:
        """The client's updates since its last poll, waiting up to max_wait_s for some when there are
        none (unless `wait` is False: the engine is dead and the poll answers at once)."""
        box = self._boxes.setdefault(client_id, _Mailbox())
        box.last_poll = time.monotonic()
        if not box.updates and wait:
            box.event.clear()
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(box.event.wait(), max_wait_s)
        updates, box.updates = box.updates, []
        return updates

    def forget_silent(self) -> list[str]:
        """Drops the mailboxes of clients that stopped polling; returns their requests (looked for at most
        every 10 s; [] in between)."""
        now = time.monotonic()
        if now < self._next_gc:
            return []
        self._next_gc = now + _GC_INTERVAL_S
        gone = {c for c, box in self._boxes.items() if now - box.last_poll > self.client_timeout_s}
        if not gone:
            return []
        orphans = [r for r, c in self._owner.items() if c in gone]
        for rid in orphans:
            del self._owner[rid]
        for c in gone:
            del self._boxes[c]
        return orphans

    def fail(self, why: str) -> None:
        """The engine is dead: every waiting poll answers now, every health check raises EngineDead."""
        for box in self._boxes.values():
            box.event.set()
        for fut in self._health.values():
            if not fut.done():
                fut.set_exception(EngineDead(why))
