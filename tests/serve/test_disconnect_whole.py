"""A client that disconnects before its whole (not streamed) answer is ready: the work behind it is
cancelled and its engine requests aborted, on each route, as a stream's are; the ASGI app is called
directly with a `receive` that says the client left once generation is under way (uvicorn, which direct
HTTP and `raystate serve` run, does not cancel such a route by itself)."""

from __future__ import annotations

import asyncio
import json

import pytest
from test_tool_calling import ScriptedClient

from raystate.messages import RequestUpdate
from raystate.serve.ingress import create_api
from raystate.serve.server import RaystateServer


class EndlessClient(ScriptedClient):
    """A model that writes "A" until its request is aborted; remembers which were aborted."""

    def __init__(self) -> None:
        super().__init__("A")
        self.started = asyncio.Event()
        self.aborted: list[str] = []

    async def generate(self, prompt_token_ids, sampling, request_id=None):
        self.started.set()
        while request_id not in self.aborted:
            await asyncio.sleep(0.001)
            yield RequestUpdate(request_id, [65], False, None, 0, 0)

    async def abort(self, request_id: str) -> None:
        self.aborted.append(request_id)


BODIES = {
    "/v1/completions": {"prompt": "Go", "max_tokens": 4000},
    "/v1/chat/completions": {"messages": [{"role": "user", "content": "Go"}], "max_tokens": 4000},
    "/v1/responses": {"input": "Go", "max_output_tokens": 4000},
    "/v1/completions#beam": {"prompt": "Go", "max_tokens": 4000, "n": 2, "use_beam_search": True},
}


@pytest.mark.parametrize("route", list(BODIES))
def test_a_client_that_leaves_cancels_its_requests(route):
    async def go():
        client = EndlessClient()
        app = create_api(RaystateServer(client, "scripted"))
        body = json.dumps({"model": "scripted", **BODIES[route]}).encode()
        delivered = False

        async def receive():
            nonlocal delivered
            if not delivered:
                delivered = True
                return {"type": "http.request", "body": body, "more_body": False}
            await client.started.wait()  # the engine is generating for this request
            return {"type": "http.disconnect"}

        sent = []

        async def send(message):
            sent.append(message)

        scope = {
            "type": "http", "asgi": {"version": "3.0"}, "http_version": "1.1", "method": "POST",
            "scheme": "http", "path": route.split("#")[0], "raw_path": route.split("#")[0].encode(),
            "query_string": b"", "root_path": "", "server": ("x", 80), "client": ("c", 1),
            "headers": [(b"content-type", b"application/json"), (b"host", b"x")],
        }  # fmt: skip
        await asyncio.wait_for(app(scope, receive, send), 30)  # the request never ends by itself
        for _ in range(500):  # the aborts run in tasks of their own
            if client.aborted:
                break
            await asyncio.sleep(0.01)
        return sent[0]["status"], client.aborted

    status, aborted = asyncio.run(go())
    assert status == 499 and aborted
