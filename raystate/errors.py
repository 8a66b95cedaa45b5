"""Exception types shared by every layer (no torch, no ray)."""

from __future__ import annotations


class InvalidRequest(ValueError):
    """A request or config field is out of range. The message names the field, the limit and the value."""

    def __init__(self, field: str, limit: str, got: object) -> None:
        self.field = field
        self.limit = limit
        self.got = got
        super().__init__(f"{field}: must be {limit}, got {got!r}")


class EngineDead(RuntimeError):
    """The scheduler (or the in-process engine) is gone; pending calls fail with this instead of hanging."""


class RequestFailed(RuntimeError):
    """One request failed on its shard (finish_reason "error": non-finite logits, a bad value that got
    past validation) and ended alone; the engine and every other request run on."""
