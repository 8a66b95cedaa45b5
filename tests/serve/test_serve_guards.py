"""The ingress's HTTP guards and the shutdown drain, in process: the ASGI app over a fake client, no Ray.

The content-type check (415), the Host allow-list (400), CORS (off by default), the body read timeout
(408) and the drain (503 for new requests; streams that outlive the grace period end with an error event
and `data: [DONE]`) are each driven through a small ASGI caller that can trickle a request body and read a
response's chunks as they come. The head-read deadline of Serve's proxy runs in a real uvicorn on loopback.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import socket
import subprocess
import sys
import time
from types import SimpleNamespace

import pytest

from raystate.client import Client
from raystate.messages import RequestUpdate
from raystate.serve.ingress import create_api
from raystate.serve.server import RaystateServer

pytestmark = pytest.mark.anyio  # async tests run on asyncio, through anyio's pytest plugin

BODY = {"prompt": "hi", "max_tokens": 3, "temperature": 0}
CHAT = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 3}


@pytest.fixture
def anyio_backend():
    return "asyncio"


class FakeClient(Client):
    """One token per `delay_s`, `max_tokens` of them; remembers aborts."""

    def __init__(self, delay_s: float = 0.005) -> None:
        self.delay_s = delay_s
        self.aborted: list[str] = []
        self._config = SimpleNamespace(
            model=SimpleNamespace(name="fake", vocab_size=512), max_model_len=4096, num_blocks=64
        )

    @property
    def config(self):
        return self._config

    async def generate(self, prompt_token_ids, sampling, request_id=None):
        for i in range(sampling.max_tokens):
            await asyncio.sleep(self.delay_s)
            last = i == sampling.max_tokens - 1
            yield RequestUpdate(request_id, [97 + i % 26], last, "length" if last else None, 0, 0)

    async def generate_group(self, requests):
        return [self.generate(r.prompt_token_ids, r.sampling, r.req_id) for r in requests]

    async def abort(self, request_id: str) -> None:
        self.aborted.append(request_id)

    async def health(self) -> bool:
        return True

    async def check_alive(self) -> None:
        return None

    async def status(self) -> dict:
        return {"backend": "fake", "num_running": [0], "num_waiting": [0], "num_free_blocks": [[63]]}

    async def shutdown(self) -> None:
        return None


class Call:
    """One request through an ASGI app: the body goes in as `chunks` (a pause of `gap_s` before each),
    the response's status, headers and body chunks come out as they are sent."""

    def __init__(
        self,
        app,
        method: str,
        path: str,
        chunks: list[bytes] = (),
        headers: dict[str, str] | None = None,
        gap_s: float = 0.0,
    ) -> None:
        headers = {"host": "127.0.0.1:8000", **{k.lower(): v for k, v in (headers or {}).items()}}
        self.scope = {
            "type": "http",
            "asgi": {"version": "3.0", "spec_version": "2.3"},
            "http_version": "1.1",
            "method": method,
            "scheme": "http",
            "path": path,
            "raw_path": path.encode(),
            "root_path": "",
            "query_string": b"",
            "headers": [(k.encode(), v.encode()) for k, v in headers.items() if v is not None],
            "client": ("127.0.0.1", 50000),
            "server": ("127.0.0.1", 8000),
        }
        self._chunks = list(chunks) or [b""]
        self._gap_s = gap_s
        self._never = asyncio.get_running_loop().create_future()  # the client stays connected
        self.status: int | None = None
        self.headers: dict[str, str] = {}
        self.body = bytearray()
        self.chunk_added = asyncio.Event()
        self.task = asyncio.create_task(app(self.scope, self._receive, self._send))

    async def _receive(self):
        if not self._chunks:
            await self._never
        if self._gap_s:
            await asyncio.sleep(self._gap_s)
        chunk = self._chunks.pop(0)
        return {"type": "http.request", "body": chunk, "more_body": bool(self._chunks)}

    async def _send(self, message) -> None:
        if message["type"] == "http.response.start":
            self.status = message["status"]
            self.headers = {k.decode().lower(): v.decode() for k, v in message.get("headers", [])}
        elif message["type"] == "http.response.body":
            self.body += message.get("body", b"")
            self.chunk_added.set()

    async def done(self, timeout_s: float = 30.0) -> Call:
        await asyncio.wait_for(self.task, timeout_s)
        return self

    def json(self) -> dict:
        return json.loads(self.body)

    def events(self) -> list[str]:
        """The `data:` payloads of a server-sent-event body."""
        return [line[6:] for line in self.body.decode().split("\n") if line.startswith("data: ")]


async def post(app, path: str, body: dict, content_type: str | None = "application/json", **kw) -> Call:
    headers = {"content-type": content_type, **kw.pop("headers", {})}
    return await Call(app, "POST", path, [json.dumps(body).encode()], headers, **kw).done()


def make_app(delay_s: float = 0.005, **kw):
    server = RaystateServer(FakeClient(delay_s))
    return server, create_api(server, **kw)


def assert_error(call: Call, status: int, code: str | None = None) -> dict:
    assert call.status == status, bytes(call.body)
    err = call.json()["error"]
    assert set(err) == {"message", "type", "param", "code"} and err["message"]
    if code is not None:
        assert err["code"] == code
    return err


# -- 415: only JSON bodies --------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "content_type",
    [None, "text/plain", "application/x-www-form-urlencoded", "multipart/form-data; boundary=x", "json"],
)
@pytest.mark.parametrize(("path", "body"), [("/v1/completions", BODY), ("/v1/chat/completions", CHAT)])
async def test_post_without_json_content_type_is_a_415_naming_the_header(content_type, path, body):
    _, app = make_app()
    err = assert_error(await post(app, path, body, content_type), 415, "unsupported_media_type")
    assert "Content-Type" in err["message"] and err["type"] == "invalid_request_error"


@pytest.mark.parametrize(
    "content_type", ["application/json", "application/json; charset=utf-8", "Application/JSON"]
)
async def test_json_content_type_with_parameters_is_accepted(content_type):
    _, app = make_app()
    r = await post(app, "/v1/completions", BODY, content_type)
    assert r.status == 200 and r.json()["usage"]["completion_tokens"] == 3


# -- allowed hosts --------------------------------------------------------------------------------------


async def test_any_host_by_default():
    _, app = make_app()
    assert (await post(app, "/v1/completions", BODY, headers={"host": "rebound.evil.test"})).status == 200


@pytest.mark.parametrize(
    ("host", "ok"),
    [
        ("localhost:8000", True),
        ("LOCALHOST", True),
        ("api.example.com", True),
        ("a.b.example.com:443", True),
        ("[::1]:8000", True),
        ("example.com", False),  # *.example.com is its subdomains only
        ("evil.test", False),
        ("localhost.evil.test", False),
        (None, False),
    ],
)
async def test_allowed_hosts(host, ok):
    _, app = make_app(allowed_hosts=["localhost", "*.example.com", "[::1]"])
    r = await Call(app, "GET", "/v1/models", headers={"host": host}).done()
    if ok:
        assert r.status == 200
    else:
        assert "Host" in assert_error(r, 400)["message"]


# -- CORS -----------------------------------------------------------------------------------------------

PREFLIGHT = {
    "origin": "https://app.example",
    "access-control-request-method": "POST",
    "access-control-request-headers": "authorization, content-type",
}


async def test_no_cors_headers_by_default():
    _, app = make_app()
    r = await post(app, "/v1/completions", BODY, headers={"origin": "https://app.example"})
    assert r.status == 200 and "access-control-allow-origin" not in r.headers
    pre = await Call(app, "OPTIONS", "/v1/completions", headers=PREFLIGHT).done()
    assert pre.status != 200 and "access-control-allow-origin" not in pre.headers


async def test_cors_preflight_and_request_from_an_allowed_origin():
    _, app = make_app(api_key="k", cors_allow_origins=["https://app.example"])
    pre = await Call(app, "OPTIONS", "/v1/completions", headers=PREFLIGHT).done()
    assert pre.status == 200  # answered before the key check: browsers send preflights without it
    assert pre.headers["access-control-allow-origin"] == "https://app.example"
    assert "POST" in pre.headers["access-control-allow-methods"]
    assert "authorization" in pre.headers["access-control-allow-headers"].lower()
    r = await post(
        app, "/v1/completions", BODY, headers={"origin": "https://app.example", "authorization": "Bearer k"}
    )
    assert r.status == 200 and r.headers["access-control-allow-origin"] == "https://app.example"
    other = await Call(
        app, "OPTIONS", "/v1/completions", headers={**PREFLIGHT, "origin": "https://evil"}
    ).done()
    assert other.status == 400 and "access-control-allow-origin" not in other.headers


# -- 408: body read timeout -----------------------------------------------------------------------------


async def test_a_trickled_body_gets_a_408_and_the_connection_closed():
    _, app = make_app(body_timeout_s=0.5)
    raw = json.dumps(BODY).encode()
    t0 = time.monotonic()
    call = Call(
        app,
        "POST",
        "/v1/completions",
        [raw[i : i + 1] for i in range(len(raw))],
        {"content-type": "application/json", "content-length": str(len(raw))},
        gap_s=0.1,
    )
    await call.done()
    assert time.monotonic() - t0 < 5.0
    assert_error(call, 408, "request_timeout")
    assert call.headers["connection"] == "close"


async def test_a_body_in_pieces_within_the_timeout_is_fine():
    _, app = make_app(body_timeout_s=2.0)
    raw = json.dumps(BODY).encode()
    call = Call(
        app, "POST", "/v1/completions", [raw[:5], raw[5:]], {"content-type": "application/json"}, gap_s=0.05
    )
    assert (await call.done()).status == 200


async def test_a_stream_may_outlast_the_body_timeout():
    """Once the body is in, the app waits on `receive` for the client's disconnect: never timed."""
    _, app = make_app(delay_s=0.02, body_timeout_s=0.3)
    r = await post(app, "/v1/completions", {**BODY, "max_tokens": 40, "stream": True})
    assert r.status == 200 and r.events()[-1] == "[DONE]"
    assert not any("error" in e for e in r.events())


# -- drain ------------------------------------------------------------------------------------------------


async def test_drain_refuses_new_requests_lets_short_streams_finish_and_cuts_the_rest():
    server, app = make_app(delay_s=0.02)
    stream = {**BODY, "stream": True}
    short = [
        Call(
            app,
            "POST",
            "/v1/completions",
            [json.dumps({**stream, "max_tokens": 30}).encode()],
            {"content-type": "application/json"},
        )
        for _ in range(3)
    ]
    long = [
        Call(
            app,
            "POST",
            "/v1/chat/completions",
            [json.dumps({**CHAT, "stream": True, "max_tokens": 2000}).encode()],
            {"content-type": "application/json"},
        )
        for _ in range(3)
    ]
    blocking = Call(
        app,
        "POST",
        "/v1/completions",
        [json.dumps({**BODY, "max_tokens": 2000}).encode()],
        {"content-type": "application/json"},
    )
    for call in short + long:
        await asyncio.wait_for(call.chunk_added.wait(), 10)
    assert server.in_flight == 7

    t0 = time.monotonic()
    server.begin_drain(3.0)
    drained = asyncio.create_task(server.wait_drained())
    refused = await post(app, "/v1/completions", BODY)
    assert "shutting down" in assert_error(refused, 503, "server_shutting_down")["message"]
    assert_error(await Call(app, "GET", "/health").done(), 503)
    assert (await Call(app, "GET", "/metrics").done()).status == 200  # a scrape still sees the drain

    for call in short:  # done within the grace: a normal end
        events = (await call.done()).events()
        assert events[-1] == "[DONE]" and not any('"error"' in e for e in events)
    for call in long:  # cut: an error event, then [DONE]
        events = (await call.done()).events()
        assert events[-1] == "[DONE]", events[-3:]
        assert json.loads(events[-2])["error"]["code"] == "server_shutting_down"
        assert all("error" not in json.loads(e) for e in events[:-2])
    assert "grace period" in assert_error(await blocking.done(), 503, "server_shutting_down")["message"]
    assert await asyncio.wait_for(drained, 10) is True
    assert 2.5 < time.monotonic() - t0 < 12.0  # the grace period, then the cut
    assert server.in_flight == 0
    assert len(server.client.aborted) == 4  # the cut requests were aborted, the finished ones not


async def test_a_second_drain_moves_the_cut_earlier():
    server, app = make_app(delay_s=0.02)
    call = Call(
        app,
        "POST",
        "/v1/completions",
        [json.dumps({**BODY, "stream": True, "max_tokens": 4000}).encode()],
        {"content-type": "application/json"},
    )
    await asyncio.wait_for(call.chunk_added.wait(), 10)
    t0 = time.monotonic()
    server.begin_drain(60.0)
    server.begin_drain(0.0)
    server.begin_drain(30.0)  # never later again
    assert await asyncio.wait_for(server.wait_drained(), 10) is True
    assert time.monotonic() - t0 < 3.0
    assert call.events()[-1] == "[DONE]" and "error" in json.loads(call.events()[-2])


# -- the request head deadline (proxy_guard), in a real uvicorn on loopback ------------------------------


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


async def _hello(scope, receive, send):
    await send({"type": "http.response.start", "status": 200, "headers": [(b"content-length", b"2")]})
    await send({"type": "http.response.body", "body": b"ok"})


async def _closed_after(reader: asyncio.StreamReader, limit_s: float) -> tuple[bytes, float]:
    """Everything the server sends until it closes the connection, and how long that took."""
    t0 = time.monotonic()
    try:
        data = await asyncio.wait_for(reader.read(), limit_s)
    except ConnectionError:  # the client wrote after the close: the reset drops what was read
        data = b""
    return data, time.monotonic() - t0


@contextlib.asynccontextmanager
async def _uvicorn(http):
    """A uvicorn on a free loopback port with the HTTP protocol class `http`; yields the port."""
    import uvicorn

    port = _free_port()
    config = uvicorn.Config(
        _hello,
        host="127.0.0.1",
        port=port,
        http=http,
        lifespan="off",
        log_level="critical",
        timeout_keep_alive=30,
    )
    server = uvicorn.Server(config)
    serving = asyncio.create_task(server.serve())
    try:
        while not server.started:
            await asyncio.sleep(0.01)
        yield port
    finally:
        server.should_exit = True
        await asyncio.wait_for(serving, 10)


def _protocol(name: str):
    import uvicorn
    from uvicorn.importer import import_from_string

    return import_from_string(uvicorn.config.HTTP_PROTOCOLS[name])


async def test_plain_uvicorn_never_closes_a_silent_connection():
    """The problem proxy_guard solves: without it, a connection that sends nothing stays open."""
    async with _uvicorn(_protocol("auto")) as port:
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        with pytest.raises(TimeoutError):
            await asyncio.wait_for(reader.read(), 1.5)
        writer.close()


@pytest.mark.parametrize("protocol", ["httptools", "h11"])
async def test_header_deadline_closes_slow_heads_and_spares_others(protocol):
    from raystate.serve.proxy_guard import header_deadline_protocol

    async with _uvicorn(header_deadline_protocol(_protocol(protocol), 0.5)) as port:
        request = b"GET / HTTP/1.1\r\nhost: x\r\n\r\n"

        # silent: never sends a byte
        silent_r, _ = await asyncio.open_connection("127.0.0.1", port)
        # trickling: one byte every 0.1 s, a head it never finishes
        trickle_r, trickle_w = await asyncio.open_connection("127.0.0.1", port)

        async def trickle():
            for b in request[:-2]:
                trickle_w.write(bytes([b]))
                await asyncio.sleep(0.1)

        trickling = asyncio.create_task(trickle())
        # kept alive: a request, an idle time longer than the deadline, a request, then half a head
        ka_r, ka_w = await asyncio.open_connection("127.0.0.1", port)
        ka_w.write(request)
        assert (await ka_r.readuntil(b"ok")).startswith(b"HTTP/1.1 200")
        await asyncio.sleep(0.8)  # idle: the keep-alive timeout's business, not the head deadline's
        ka_w.write(request)
        assert (await ka_r.readuntil(b"ok")).startswith(b"HTTP/1.1 200")  # still open, still served
        ka_w.write(request[:10])

        # meanwhile a normal client is served at once, on a new connection each time
        for _ in range(5):
            r, w = await asyncio.open_connection("127.0.0.1", port)
            w.write(request)
            assert (await asyncio.wait_for(r.readuntil(b"ok"), 2)).startswith(b"HTTP/1.1 200")
            w.close()

        for reader in (silent_r, trickle_r, ka_r):
            data, took = await _closed_after(reader, 5.0)
            assert took < 3.0
            assert data.startswith(b"HTTP/1.1 408") or (reader is trickle_r and not data), data
        trickling.cancel()


def test_install_swaps_uvicorns_auto_protocol():
    """What Serve's proxy runs (RAY_SERVE_HTTP_PROXY_CALLBACK_IMPORT_PATH), in a fresh interpreter."""
    code = (
        "import os, uvicorn\n"
        "os.environ['RAYSTATE_HEADER_TIMEOUT_S'] = '2.5'\n"
        "from raystate.serve import proxy_guard\n"
        "assert proxy_guard.install() == []\n"
        "c = uvicorn.Config(app=lambda: None, factory=True)\n"
        "c.load()\n"
        "print(c.http_protocol_class.__name__)\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip().startswith("HeaderDeadline")
