"""A deadline on reading a request's head (request line and headers) in Ray Serve's HTTP proxy.

Why this exists: the HTTP server that accepts connections for Serve is uvicorn, run inside Serve's proxy
actor. uvicorn bounds only the idle time between two requests of a kept-alive connection
(`keep_alive_timeout_s` of Serve's `http_options`); nothing bounds how long a client may take to send a
request's head, or to send its first byte. A client that trickles its headers one byte per second holds
its connection (a file descriptor, a protocol object) for as long as it likes, and many such clients are
a cheap denial of service (slowloris). The application never sees these connections: uvicorn calls the
ASGI app only once the head is complete, so no middleware of ours can bound this.

Serve passes no protocol option through to that uvicorn, but it does call one function of ours inside
the proxy actor before its server starts: the one named by the `RAY_SERVE_HTTP_PROXY_CALLBACK_IMPORT_PATH`
environment variable (Serve's hook for proxy middlewares). `install` is that function. It swaps uvicorn's
"auto" HTTP protocol (the one Serve gets, since it names none) for a subclass that closes a connection,
after a `408 Request Timeout`, when a request head is not complete `RAYSTATE_HEADER_TIMEOUT_S` seconds
after the connection opened or after the head's first byte arrived on a kept-alive connection.

Limits: it relies on uvicorn's protocol classes keeping a `cycle` attribute that changes when a request's
head is complete (true of its h11 and httptools protocols); for any other protocol class `install` logs a
warning and changes nothing. Both environment variables must be in the proxy actor's environment when
the proxy starts: `raystate serve` sets them for the local Ray it starts; on a cluster, export them on
every node before `ray start`. A proxy already running is not affected.
"""

from __future__ import annotations

import asyncio
import logging
import os

logger = logging.getLogger(__name__)

CALLBACK_ENV = "RAY_SERVE_HTTP_PROXY_CALLBACK_IMPORT_PATH"
CALLBACK = "raystate.serve.proxy_guard:install"
HEADER_TIMEOUT_ENV = "RAYSTATE_HEADER_TIMEOUT_S"
DEFAULT_HEADER_TIMEOUT_S = 5.0

RESPONSE_408 = (
    b"HTTP/1.1 408 Request Timeout\r\ncontent-type: text/plain; charset=utf-8\r\n"
    b"connection: close\r\ncontent-length: 28\r\n\r\nrequest header read timeout\n"
)

# What `install` puts under uvicorn's "auto" protocol name (uvicorn imports it by this module's path).
HeaderDeadlineProtocol: type[asyncio.Protocol] | None = None


def header_deadline_protocol(base: type[asyncio.Protocol], timeout_s: float) -> type[asyncio.Protocol]:
    """`base` (a uvicorn HTTP/1.1 protocol) with a deadline on each request head.

    The deadline is armed when the connection opens and when the first bytes of a further request arrive
    after a response ended (the idle time in between is the keep-alive timeout's business), and disarmed
    once uvicorn has a new request cycle, which it makes when a head is complete. Body bytes never arm it.
    """

    class _HeaderDeadline(base):  # type: ignore[misc, valid-type]
        _head_timer: asyncio.TimerHandle | None = None
        _head_cycle: object = None

        def connection_made(self, transport):  # type: ignore[override]
            super().connection_made(transport)
            self._arm_head_deadline()

        def data_received(self, data: bytes) -> None:
            super().data_received(data)
            if self._head_timer is not None:
                if self.cycle is not self._head_cycle:  # the head is complete: a new cycle runs
                    self._disarm_head_deadline()
            elif self.cycle is not None and self.cycle.response_complete and not self.transport.is_closing():
                # Bytes of a further request's head on a kept-alive connection (uvicorn has just
                # cancelled its keep-alive timer); a head that completed within this call made a new
                # cycle, so it is not re-armed.
                self._arm_head_deadline()

        def connection_lost(self, exc: Exception | None) -> None:
            self._disarm_head_deadline()
            super().connection_lost(exc)

        def _arm_head_deadline(self) -> None:
            self._head_cycle = self.cycle
            self._head_timer = self.loop.call_later(timeout_s, self._head_deadline_passed)

        def _disarm_head_deadline(self) -> None:
            if self._head_timer is not None:
                self._head_timer.cancel()
                self._head_timer = None

        def _head_deadline_passed(self) -> None:
            self._head_timer = None
            if not self.transport.is_closing():
                self.transport.write(RESPONSE_408)
                self.transport.close()

    _HeaderDeadline.__name__ = _HeaderDeadline.__qualname__ = f"HeaderDeadline{base.__name__}"
    return _HeaderDeadline


def header_timeout_from_env() -> float:
    """RAYSTATE_HEADER_TIMEOUT_S (default 5 s); 0 or less turns the deadline off."""
    raw = os.environ.get(HEADER_TIMEOUT_ENV, "").strip()
    return float(raw) if raw else DEFAULT_HEADER_TIMEOUT_S


def install() -> list:
    """Serve's proxy callback: installs the head deadline in this process's uvicorn; no middlewares.

    Never raises (the proxy would fail to start): a uvicorn it does not recognise is left as it is, with
    a warning in the proxy's log.
    """
    global HeaderDeadlineProtocol
    try:
        timeout_s = header_timeout_from_env()
        if timeout_s <= 0 or HeaderDeadlineProtocol is not None:
            return []
        from uvicorn import config
        from uvicorn.importer import import_from_string
        from uvicorn.protocols.http.h11_impl import H11Protocol

        known: list[type] = [H11Protocol]
        try:
            from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

            known.append(HttpToolsProtocol)
        except ImportError:  # httptools is optional
            pass
        base = import_from_string(config.HTTP_PROTOCOLS["auto"])
        if not (isinstance(base, type) and issubclass(base, tuple(known))):
            logger.warning("raystate: no request header deadline: unknown uvicorn protocol %r", base)
            return []
        HeaderDeadlineProtocol = header_deadline_protocol(base, timeout_s)
        config.HTTP_PROTOCOLS["auto"] = f"{__name__}:HeaderDeadlineProtocol"
        logger.info("raystate: request headers must arrive within %g s (%s)", timeout_s, base.__name__)
    except Exception:
        logger.exception("raystate: no request header deadline")
    return []
