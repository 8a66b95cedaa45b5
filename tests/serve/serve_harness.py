"""What the tests of tests/serve share besides their fixtures: a free loopback port, a served app's
address and key, and a wait for the backend to go idle.

A module of its own (not conftest.py) so that `from serve_harness import App` names one file whatever
other folders' conftest modules pytest has imported in the same run.
"""

from __future__ import annotations

import socket
import time
from dataclasses import dataclass

import httpx


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@dataclass(frozen=True)
class App:
    url: str  # the app's root: {url}/v1/completions, {url}/health, ...
    api_key: str | None

    @property
    def v1(self) -> str:
        return f"{self.url}/v1"

    def headers(self) -> dict[str, str]:
        return {"Authorization": f"Bearer {self.api_key}"} if self.api_key else {}

    def status(self) -> dict:
        r = httpx.get(f"{self.url}/status", headers=self.headers(), timeout=30)
        r.raise_for_status()
        return r.json()

    def metrics(self) -> str:
        r = httpx.get(f"{self.url}/metrics", headers=self.headers(), timeout=30)
        r.raise_for_status()
        return r.text


def wait_idle(app: App, free_blocks, timeout_s: float = 20.0) -> dict:
    """Polls /status until nothing runs or waits and the free blocks are back to `free_blocks`."""
    deadline = time.monotonic() + timeout_s
    while True:
        status = app.status()
        idle = sum(status["num_running"]) == 0 and sum(status["num_waiting"]) == 0
        if idle and status["num_free_blocks"] == free_blocks:
            return status
        if time.monotonic() > deadline:
            raise AssertionError(f"backend not idle after {timeout_s} s: {status}")
        time.sleep(0.05)
