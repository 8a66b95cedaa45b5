"""`raystate serve` (the real CLI, a subprocess with a local Ray of its own) against slow clients and on
shutdown, over loopback.

Slow clients: fifty raw sockets trickle a request head or a body at one byte per second; each must be
dropped within a few seconds (the head by the deadline proxy_guard installs in Serve's proxy, the body by
the ingress's 408) while a normal request is served meanwhile; the same server also shows that the
allowed-host, CORS and content-type guards reach the app through Serve. Shutdown: SIGINT with streams
running; new requests get 503 during the drain, streams that finish within the grace period end
normally, the others end with an error event and `data: [DONE]`, and the process exits 0.

Named to sort before test_cli_serve.py, so that both run before the shared Ray session of tests/serve.
"""

from __future__ import annotations

import json
import os
import queue
import select
import signal
import socket
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest
from serve_harness import free_port
from test_cli_serve import _reader, _wait_for

pytestmark = pytest.mark.slow

GOOD = {"model": "tiny", "prompt": "G0 guards", "max_tokens": 4, "temperature": 0}


class Server:
    def __init__(self, *flags: str) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        env = {**os.environ, "RAYSTATE_KERNELS": "reference", "PYTHONUNBUFFERED": "1"}
        env.pop("RAYSTATE_API_KEY", None)
        cmd = [
            sys.executable,
            "-m",
            "raystate",
            "serve",
            "--port",
            str(self.port),
            "--name",
            "guards",
            *flags,
        ]
        self.proc = subprocess.Popen(
            cmd, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True, env=env
        )
        self.lines: queue.Queue = queue.Queue()
        threading.Thread(target=_reader, args=(self.proc.stdout, self.lines), daemon=True).start()

    def __enter__(self) -> Server:
        try:
            _wait_for(self.lines, "Ctrl-C", timeout_s=240)
        except BaseException:
            self.__exit__()
            raise
        return self

    def __exit__(self, *exc) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()


def _trickle(port: int, burst: bytes, trickled: bytes, limit_s: float) -> tuple[float | None, bytes]:
    """Sends `burst` at once, then `trickled` one byte per second, until the server closes the
    connection (returns how long after the connection opened, and what the server sent) or `limit_s`
    passes (returns None)."""
    received = b""
    with socket.create_connection(("127.0.0.1", port), timeout=5) as s:
        t0 = time.monotonic()
        try:
            if burst:
                s.sendall(burst)
            for i in range(len(trickled) + int(limit_s) + 1):
                if time.monotonic() - t0 > limit_s:
                    return None, received
                if i < len(trickled):
                    s.sendall(trickled[i : i + 1])
                ready, _, _ = select.select([s], [], [], 1.0)
                while ready:
                    chunk = s.recv(4096)
                    if not chunk:
                        return time.monotonic() - t0, received
                    received += chunk
                    ready, _, _ = select.select([s], [], [], 0.05)
        except OSError:  # reset: closed by the server while we wrote
            return time.monotonic() - t0, received
    return None, received


def _check_guard_flags(server: Server) -> None:
    """The CLI's allowed-host and CORS flags reach the app through Serve; 415 for a form post."""
    url = f"{server.url}/v1/completions"
    r = httpx.post(url, json=GOOD, headers={"Host": "rebound.evil.test"}, timeout=60)
    assert r.status_code == 400 and "Host" in r.json()["error"]["message"]
    r = httpx.post(url, content=json.dumps(GOOD), headers={"Content-Type": "text/plain"}, timeout=60)
    assert r.status_code == 415 and r.json()["error"]["code"] == "unsupported_media_type"
    preflight = {
        "Origin": "https://app.example",
        "Access-Control-Request-Method": "POST",
        "Access-Control-Request-Headers": "content-type",
    }
    r = httpx.options(url, headers=preflight, timeout=60)
    assert r.status_code == 200 and r.headers["access-control-allow-origin"] == "https://app.example"
    r = httpx.options(url, headers={**preflight, "Origin": "https://evil.test"}, timeout=60)
    assert "access-control-allow-origin" not in r.headers


def test_slow_clients_are_dropped_within_seconds_while_others_are_served():
    header_s, body_s, limit_s = 2.0, 2.0, 25.0
    flags = ["--header-timeout-s", f"{header_s:g}", "--body-timeout-s", f"{body_s:g}"]
    flags += ["--allowed-host", "127.0.0.1,localhost", "--cors-origin", "https://app.example"]
    with Server(*flags) as server:
        assert httpx.post(f"{server.url}/v1/completions", json=GOOD, timeout=60).status_code == 200
        _check_guard_flags(server)
        head = b"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
        body = json.dumps({**GOOD, "prompt": "x" * 200}).encode()
        body_head = head + f"Content-Length: {len(body)}\r\n\r\n".encode()
        with ThreadPoolExecutor(max_workers=50) as pool:
            heads = [pool.submit(_trickle, server.port, b"", head, limit_s) for _ in range(25)]
            bodies = [pool.submit(_trickle, server.port, body_head, body, limit_s) for _ in range(25)]
            time.sleep(1.0)  # every slow client is connected and trickling
            t0 = time.monotonic()
            r = httpx.post(f"{server.url}/v1/completions", json=GOOD, timeout=60)
            assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 4
            assert time.monotonic() - t0 < 20.0  # served meanwhile, not after the slow ones
            heads = [f.result() for f in heads]
            bodies = [f.result() for f in bodies]
        for took, received in heads:  # dropped by the head deadline, in Serve's proxy
            assert took is not None and took < header_s + 8.0, (took, received)
            assert received.startswith(b"HTTP/1.1 408") or not received, received
        for took, received in bodies:  # answered 408 by the ingress, then closed
            assert took is not None and took < body_s + 8.0, (took, received)
            assert received.startswith(b"HTTP/1.1 408"), received
            assert b"request_timeout" in received
        # still serving after all that
        assert httpx.post(f"{server.url}/v1/completions", json=GOOD, timeout=60).status_code == 200


def _stream(url: str, max_tokens: int, first: threading.Event) -> list[str]:
    """One streamed completion's `data:` payloads; sets `first` at its first event."""
    body = {**GOOD, "max_tokens": max_tokens, "ignore_eos": True, "stream": True}
    events = []
    with httpx.stream("POST", f"{url}/v1/completions", json=body, timeout=120) as r:
        assert r.status_code == 200
        for line in r.iter_lines():
            if line.startswith("data: "):
                events.append(line[6:])
                first.set()
    return events


def test_sigint_drains_refuses_new_requests_and_ends_every_stream_with_done():
    grace_s = 3.0
    with Server("--shutdown-grace-s", f"{grace_s:g}") as server:
        assert httpx.post(f"{server.url}/v1/completions", json=GOOD, timeout=60).status_code == 200
        lengths = [12] * 4 + [1800] * 8  # short ones end within the grace; long ones cannot
        started = [threading.Event() for _ in lengths]
        with ThreadPoolExecutor(max_workers=len(lengths)) as pool:
            streams = [pool.submit(_stream, server.url, n, e) for n, e in zip(lengths, started, strict=True)]
            for e in started:
                assert e.wait(120), "a stream did not start"
            server.proc.send_signal(signal.SIGINT)
            t0 = time.monotonic()
            refused = None
            while refused is None and time.monotonic() - t0 < grace_s + 5:
                r = httpx.post(f"{server.url}/v1/completions", json={**GOOD, "max_tokens": 1}, timeout=30)
                if r.status_code == 503:
                    refused = r
                else:
                    assert r.status_code == 200, r.text
                    time.sleep(0.1)
            assert refused is not None, "no 503 during the drain"
            err = refused.json()["error"]
            assert set(err) == {"message", "type", "param", "code"} and err["code"] == "server_shutting_down"
            results = [f.result(timeout=120) for f in streams]
        assert server.proc.wait(timeout=120) == 0
        out = "".join(_wait_for(server.lines, "stopped", timeout_s=10))
        assert "SIGINT" in out and "draining" in out and "raystate: drained" in out

    cut = 0
    for n, events in zip(lengths, results, strict=True):
        assert events[-1] == "[DONE]", (n, events[-3:])
        chunks = [json.loads(e) for e in events[:-1]]
        if "error" in chunks[-1]:  # cut at the end of the grace period
            assert chunks[-1]["error"]["code"] == "server_shutting_down", chunks[-1]
            assert all("error" not in c for c in chunks[:-1])
            cut += 1
        else:  # finished within the grace period: a normal end
            assert chunks[-1]["choices"][0]["finish_reason"] == "length"
        if n == 12:
            assert "error" not in chunks[-1], "a short stream was cut"
    assert cut >= 1  # 1800 tokens per stream cannot fit in the grace period on CPU
