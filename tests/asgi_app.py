"""One served model's FastAPI app over an `InProcessClient`, driven from an event loop of its own: the
in-process HTTP harness of the serve, structured-output and Hugging Face tests (no Ray, no sockets).

`post` / `get` send plain HTTP; `openai` is the official client over the same transport; `run` drives a
coroutine (e.g. an `openai` call) to completion. Importable from every test folder: tests/conftest.py puts
tests/ on sys.path.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Iterator

import httpx
import openai
import pytest


class AsgiApp:
    def __init__(
        self,
        model: str,
        served_name: str | None = None,
        chat_template: str | None = None,
        trust_request_chat_template: bool = False,
        **engine,
    ) -> None:
        """`model`: a model word (`AppArgs.model`); `served_name`: the name clients send (default: the
        model's); `chat_template`: `AppArgs.chat_template` (a file or template text);
        `trust_request_chat_template`: the app takes a request's own template; `engine`: EngineArgs knobs."""
        from raystate.client import InProcessClient
        from raystate.serve.app import AppArgs
        from raystate.serve.ingress import create_api
        from raystate.serve.server import RaystateServer

        self.loop = asyncio.new_event_loop()
        args = AppArgs(model=model, backend="inprocess", chat_template=chat_template, **engine)
        self.server = RaystateServer(
            InProcessClient(args.engine_config()),
            served_name,
            chat_template=args.chat_template,
            trust_request_chat_template=trust_request_chat_template,
        )
        self.name = self.server.model_name
        transport = httpx.ASGITransport(app=create_api(self.server), raise_app_exceptions=False)
        self.http = httpx.AsyncClient(transport=transport, base_url="http://local", timeout=120)
        self.openai = openai.AsyncOpenAI(
            base_url="http://local/v1", api_key="unused", max_retries=0, http_client=self.http
        )

    def run(self, coro):
        return self.loop.run_until_complete(coro)

    def post(self, path: str, body: dict) -> httpx.Response:
        return self.run(self.http.post(path, json=body))

    def get(self, path: str) -> httpx.Response:
        return self.run(self.http.get(path))

    def refused_param(self, path: str, change: dict) -> str:
        """POSTs a minimal valid body of `path` (a completion or a chat of 2 tokens) with `change` merged
        in; asserts a 400 and returns the field its error names (`error.param`)."""
        body = {"model": self.name, "max_tokens": 2}
        body |= {"messages": [{"role": "user", "content": "x"}]} if "chat" in path else {"prompt": "x"}
        r = self.post(path, body | change)
        assert r.status_code == 400, r.text
        return r.json()["error"]["param"]

    def close(self) -> None:
        self.run(self.http.aclose())
        self.run(self.server.shutdown())
        self.loop.close()


@contextlib.contextmanager
def reference_app(model: str, served_name: str | None = None, **engine) -> Iterator[AsgiApp]:
    """An `AsgiApp` on the kernels' PyTorch references (a step under Triton's CPU interpreter takes
    seconds), closed on exit: the body of a module-scoped `app` fixture."""
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("RAYSTATE_KERNELS", "reference")
        mp.setattr("raystate.kernels._common._reference_forced", True)
        app = AsgiApp(model, served_name, **engine)
        try:
            yield app
        finally:
            app.close()
