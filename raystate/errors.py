"""Exception types shared by every layer (no torch, no ray)."""

from __future__ import annotations


def _rebuilt_error(cls: type[BaseException], args: tuple, state: dict) -> BaseException:
    """Unpickles an error without calling its __init__ (see InvalidRequest.__reduce__)."""
    error = cls.__new__(cls)
    error.args = args
    error.__dict__.update(state)
    return error


class InvalidRequest(ValueError):
    """A request or config field is out of range. The message names the field, the limit and the value."""

    def __init__(self, field: str, limit: str, got: object) -> None:
        self.field = field
        self.limit = limit
        self.got = got
        super().__init__(f"{field}: must be {limit}, got {got!r}")

    def __reduce__(self):
        """Pickles the message and fields as they are. The default would call `cls(*self.args)`, which this
        __init__ (and each subclass's) does not take, so the error could not cross a process: a Ray worker
        refusing its config reached the caller as "Failed to deserialize exception", its type lost."""
        return (_rebuilt_error, (type(self), self.args, dict(self.__dict__)))


class EngineDead(RuntimeError):
    """The scheduler (or the in-process engine) is gone; pending calls fail with this instead of hanging."""


class RequestFailed(RuntimeError):
    """One request failed on its shard (finish_reason "error": non-finite logits, a bad value that got
    past validation) and ended alone; the engine and every other request run on."""
