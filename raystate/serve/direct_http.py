"""Direct HTTP: each ingress replica answers HTTP itself, on a port its node's replicas share.

Why: through Serve's HTTP proxy every streamed chunk crosses two processes (the proxy's uvicorn and the
replica) as a Ray call. Measured with our app over a stand-in engine that gives 64 streams one token every
10 ms (ideal 6400 tokens/s, `bench/profile_serve.py --fake-step-ms 10`): through the proxy 2945-3177
tokens/s, time to first token 400-470 ms and tokens arriving in bursts; the same app under a plain uvicorn
6000 tokens/s at one token per step. The proxy and the replica each spend about 0.17 ms of CPU per token,
our app 0.03 ms. A streaming LLM server sends one chunk per token, so this hop is its bottleneck.

So with `direct_http_port` set, the replica runs uvicorn with the same ASGI app (`create_api`: every
route, guard and metric) on its own event loop, over a socket bound with SO_REUSEPORT: the replicas on
one node share the port and the kernel spreads connections across them. Serve still starts, checks,
replaces and stops the replicas; its proxy carries no traffic (`raystate serve --direct-http` disables
it). Across nodes, a load balancer in front of the nodes' ports takes the proxy's other job. The request
head deadline (`proxy_guard`) is installed into this uvicorn too.
"""

from __future__ import annotations

import asyncio
import logging
import socket
from typing import Any

logger = logging.getLogger(__name__)


def reuse_port_socket(host: str, port: int) -> socket.socket:
    """A listening TCP socket on (host, port) that other processes of this user may bind too."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
        sock.bind((host, port))
        sock.listen(2048)
        sock.setblocking(False)
    except BaseException:
        sock.close()
        raise
    return sock


def port_in_use(host: str, port: int) -> bool:
    """Whether something listens on (host, port) already, another raystate's replicas included: a socket
    without SO_REUSEPORT cannot bind where one is listening, with it or without. `raystate serve` asks
    before starting, since its own replicas' SO_REUSEPORT bind would join another server's port and the
    kernel would split the connections between the two servers."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    with socket.socket(family, socket.SOCK_STREAM) as probe:
        probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # a closed server's TIME_WAIT is free
        try:
            probe.bind((host, port))
        except OSError:
            return True
    return False


class DirectHTTPServer:
    """uvicorn serving `app` on this process's running event loop, on a shared port (module docstring)."""

    def __init__(self, app: Any, host: str, port: int, keep_alive_timeout_s: float = 5.0) -> None:
        import uvicorn

        from raystate.serve import proxy_guard

        proxy_guard.install()  # the head deadline, when RAYSTATE_HEADER_TIMEOUT_S is set
        self.host, self.port = host, port
        self._sock = reuse_port_socket(host, port)  # bound now: connections queue until serving starts
        config = uvicorn.Config(
            app,
            lifespan="off",
            log_level="warning",
            access_log=False,
            timeout_keep_alive=keep_alive_timeout_s,
            backlog=2048,
        )
        self._server = uvicorn.Server(config)
        self._server.install_signal_handlers = lambda: None  # the replica's signals are Ray's
        self._task: asyncio.Task | None = None

    async def start(self) -> None:
        """Serves from a task of the running loop; returns once uvicorn accepts connections."""
        self._task = asyncio.get_running_loop().create_task(self._server.serve(sockets=[self._sock]))
        while not self._server.started:
            if self._task.done():  # failed to start: raise its error here
                self._task.result()
                raise RuntimeError("direct HTTP: uvicorn stopped before it started")
            await asyncio.sleep(0.01)
        logger.info("raystate: this replica serves HTTP at %s:%d directly", self.host, self.port)

    async def stop(self) -> None:
        """Stops accepting and closes the connections (streams still open are cut: drain first)."""
        if self._task is None:
            self._sock.close()
            return
        self._server.should_exit = True
        try:
            await asyncio.wait_for(asyncio.shield(self._task), timeout=10)
        except (TimeoutError, asyncio.CancelledError):
            self._server.force_exit = True
        finally:
            self._sock.close()
