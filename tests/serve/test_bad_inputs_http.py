"""Hostile bodies over the real Serve app on loopback: every one is a 400 naming the field, none a 500.

What Python's json lets through and pydantic alone would not stop: lone surrogates (valid JSON, but no
UTF-8 encoder takes them: the tokenizer's encode failed with a 500), integers past 64 bits (a top_k of
10**30 reached the engine's msgpack encoder and stopped the engine), NaN and Infinity, nesting deep
enough for a RecursionError, and strings and lists far larger than any use. Each case is raw JSON text,
so that literals json.dumps would refuse to write (NaN, 5000-digit integers, 100000 levels) can be sent.
The error paths that do not come from bad input (engine gone, an internal error, a failing stream) are
checked over an in-process app with a client that fails on purpose: their bodies must not carry the
traceback or file paths the failure had.
"""

from __future__ import annotations

import asyncio
import json
import re
from collections.abc import AsyncIterator

import httpx
import pytest

from raystate.errors import EngineDead
from raystate.messages import RequestUpdate
from raystate.serve.protocol import (
    MAX_CONTENT_PARTS,
    MAX_JSON_DEPTH,
    MAX_MESSAGES,
    MAX_NAME_CHARS,
    MAX_STOP_CHARS,
    MAX_STOP_STRINGS,
    MAX_STOP_TOKEN_IDS,
    MAX_USER_CHARS,
)

# A traceback, or a source path, anywhere in a body (what a leaked exception would show).
LEAK = re.compile(r'Traceback|File "|\.py\b|site-packages|/raystate/')

CMPL = '"model": "tiny", "max_tokens": 2, "temperature": 0'
CHAT = '"model": "tiny", "max_tokens": 2'
USER = '{"role": "user", "content": "hi"}'


def _deep_list(depth: int) -> str:
    return "[" * depth + "]" * depth


def _deep_dict(depth: int) -> str:
    return '{"a": ' * depth + "1" + "}" * depth


def _j(value) -> str:
    return json.dumps(value)  # ensure_ascii: a lone surrogate is written as its \\udxxx escape


# (raw fields after the common ones, the param the 400 must name)
BAD_COMPLETIONS = [
    # lone surrogates, in every string that is tokenized, matched or echoed
    ('"prompt": "\\ud800"', "prompt"),
    ('"prompt": "ok \\udfff ok"', "prompt"),
    ('"prompt": ["\\ud800"]', "prompt[0]"),
    ('"prompt": "a", "stop": "\\ud83d"', "stop"),
    ('"prompt": "a", "stop": ["ok", "\\udc00"]', "stop[1]"),
    ('"prompt": "a", "user": "\\ud800"', "user"),
    ('"prompt": "a", "model": "\\ud800"', "model"),
    ('"prompt": "a", "suffix": "\\ud800"', "suffix"),
    # integers past 64 bits, or past the field's own limit
    (f'"prompt": "a", "top_k": {10**30}', "top_k"),
    (f'"prompt": "a", "top_k": {2**40}', "top_k"),
    (f'"prompt": "a", "top_k": {-(10**30)}', "top_k"),
    (f'"prompt": "a", "max_tokens": {10**30}', "max_tokens"),
    (f'"prompt": "a", "max_tokens": {2**62}', "max_tokens"),
    ('"prompt": "a", "max_tokens": ' + "9" * 5000, "max_tokens"),  # past int()'s 4300 digits
    (f'"prompt": "a", "seed": {2**63}', "seed"),
    (f'"prompt": "a", "seed": {10**30}', "seed"),
    (f'"prompt": "a", "n": {10**30}', "n"),
    (f'"prompt": "a", "best_of": {10**30}', "best_of"),
    (f'"prompt": "a", "logprobs": {10**30}', "logprobs"),
    (f'"prompt": [1, {10**30}]', "prompt[1]"),
    (f'"prompt": [1, {2**40}]', "prompt"),
    (f'"prompt": "a", "stop_token_ids": [{10**30}]', "stop_token_ids[0]"),
    (f'"prompt": "a", "stop_token_ids": [{2**40}]', "stop_token_ids"),
    # NaN and Infinity (Python's json takes them), and a float that overflows to inf
    ('"prompt": "a", "temperature": NaN', "temperature"),
    ('"prompt": "a", "temperature": Infinity', "temperature"),
    ('"prompt": "a", "temperature": 1e999', "temperature"),
    ('"prompt": "a", "top_p": NaN', "top_p"),
    ('"prompt": "a", "top_p": -Infinity', "top_p"),
    ('"prompt": "a", "presence_penalty": NaN', "presence_penalty"),
    ('"prompt": "a", "frequency_penalty": -1e999', "frequency_penalty"),
    ('"prompt": "a", "logit_bias": {"5": NaN}', "logit_bias.5"),
    ('"prompt": "a", "seed": Infinity', "seed"),
    # nesting past MAX_JSON_DEPTH, shallow and far past the recursion limit
    (f'"prompt": "a", "stop": {_deep_list(MAX_JSON_DEPTH)}', "stop"),
    (f'"prompt": "a", "stop": {_deep_list(100_000)}', "stop"),
    (f'"prompt": "a", "logit_bias": {_deep_dict(5000)}', "logit_bias"),
    (f'"prompt": {_deep_list(2000)}', "prompt"),
    (f'"prompt": "a", "stream_options": {_deep_dict(40)}', "stream_options"),
    # oversize strings and lists
    (f'"prompt": "a", "stop": {_j(["s"] * (MAX_STOP_STRINGS + 1))}', "stop"),
    (f'"prompt": "a", "stop": {_j("s" * (MAX_STOP_CHARS + 1))}', "stop"),
    (f'"prompt": "a", "stop_token_ids": {_j([1] * (MAX_STOP_TOKEN_IDS + 1))}', "stop_token_ids"),
    (f'"prompt": "a", "user": {_j("u" * (MAX_USER_CHARS + 1))}', "user"),
    (f'"prompt": "a", "model": {_j("m" * 300)}', "model"),
    # unknown fields are ignored, but one whose name no encoder takes is a 400 (the name escaped)
    ('"prompt": "a", "\\ud800": 3', "\\ud800"),
]

BAD_CHATS = [
    ('"messages": [{"role": "user", "content": "\\ud800"}]', "messages[0].content"),
    (f'"messages": [{USER}, {{"role": "user", "content": "x", "name": "\\udc00"}}]', "messages[1].name"),
    (
        '"messages": [{"role": "user", "content": [{"type": "text", "text": "a\\udbffb"}]}]',
        "messages[0].content[0].text",
    ),
    (f'"messages": [{USER}], "stop": "\\ud800"', "stop"),
    (f'"messages": [{USER}], "user": "\\udfff"', "user"),
    (f'"messages": [{USER}], "top_k": {10**30}', "top_k"),
    (f'"messages": [{USER}], "max_completion_tokens": {10**30}', "max_completion_tokens"),
    (f'"messages": [{USER}], "max_completion_tokens": {2**62}', "max_completion_tokens"),
    (f'"messages": [{USER}], "top_logprobs": {10**30}', "top_logprobs"),
    (f'"messages": [{USER}], "seed": -{10**30}', "seed"),
    (f'"messages": [{USER}], "temperature": NaN', "temperature"),
    (f'"messages": [{USER}], "logit_bias": {{"1": Infinity}}', "logit_bias.1"),
    (f'"messages": [{USER}], "tools": {_deep_list(3000)}', "tools"),
    (f'"messages": [{USER}], "response_format": {_deep_dict(3000)}', "response_format"),
    (f'"messages": [{USER}], "tool_choice": {_deep_dict(50)}', "tool_choice"),
    (f'"messages": [{USER}], "tool_choice": 5', "tool_choice"),
    (f'"messages": [{{"role": "user", "content": {_deep_list(1000)}}}]', "messages"),
    (f'"messages": {_j([{"role": "user", "content": "m"}] * (MAX_MESSAGES + 1))}', "messages"),
    (
        f'"messages": [{{"role": "user", "content": "x", "name": {_j("n" * (MAX_NAME_CHARS + 1))}}}]',
        "messages[0].name",
    ),
    (
        f'"messages": [{{"role": "user", "content": {_j([{"type": "text", "text": "t"}] * (MAX_CONTENT_PARTS + 1))}}}]',  # noqa: E501
        "messages[0].content",
    ),
]


def _post_raw(app, path: str, fields: str) -> httpx.Response:
    headers = {**app.headers(), "Content-Type": "application/json"}
    return httpx.post(f"{app.url}{path}", content=f"{{{fields}}}".encode(), headers=headers, timeout=60)


def _assert_400(r: httpx.Response, param: str | None) -> None:
    assert r.status_code == 400, r.text[:500]
    assert not LEAK.search(r.text), r.text[:500]
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"}
    assert err["type"] == "invalid_request_error"
    assert err["param"] == param, err
    assert isinstance(err["message"], str) and 0 < len(err["message"]) <= 1024
    if param is not None:
        assert err["message"].startswith(param.split("[")[0].split(".")[0]), err


@pytest.mark.parametrize(("fields", "param"), BAD_COMPLETIONS, ids=lambda x: x[:60])
def test_hostile_completion_field_is_a_400_naming_it(open_app, fields, param):
    _assert_400(_post_raw(open_app, "/v1/completions", f"{CMPL}, {fields}"), param)


@pytest.mark.parametrize(("fields", "param"), BAD_CHATS, ids=lambda x: x[:60])
def test_hostile_chat_field_is_a_400_naming_it(open_app, fields, param):
    _assert_400(_post_raw(open_app, "/v1/chat/completions", f"{CHAT}, {fields}"), param)


@pytest.mark.parametrize(
    "body",
    [
        b"\xff\xfe{}",  # not UTF-8
        b'{"prompt": "\xed\xa0\x80"}',  # a surrogate encoded as UTF-8 bytes: not UTF-8 either
        _deep_list(50_000).encode(),  # deep, and not an object
        b"NaN",
        b"",
    ],
    ids=["latin", "utf8-surrogate", "deep-array", "nan", "empty"],
)
def test_hostile_body_is_a_400(open_app, body):
    headers = {**open_app.headers(), "Content-Type": "application/json"}
    r = httpx.post(f"{open_app.url}/v1/completions", content=body, headers=headers, timeout=60)
    _assert_400(r, None)


# Fields raystate knows but does not implement: a 400 naming the field where a value would change the
# answer, accepted at the neutral value
def test_unsupported_field_is_refused_not_ignored(open_app):
    prompt = '"prompt": "F1 ext"'
    _assert_400(_post_raw(open_app, "/v1/completions", f'{CMPL}, {prompt}, "suffix": "x"'), "suffix")
    assert _post_raw(open_app, "/v1/completions", f'{CMPL}, {prompt}, "suffix": null').status_code == 200


def test_engine_healthy_after_hostile_bodies(open_app):
    """The cases above end at validation: the engine still steps, and a good request still works."""
    assert httpx.get(f"{open_app.url}/health", timeout=60).status_code == 200
    r = _post_raw(open_app, "/v1/completions", f'{CMPL}, "prompt": "F1 still fine", "top_k": 2147483647')
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 2


# -- error paths that are not bad input ----------------------------------------------------------------

SECRET = 'Traceback (most recent call last):\n  File "/srv/raystate/scheduler/actor.py", line 1, in step'


class _FailingClient:
    """A Client whose generate fails the way a dying backend does: at once, or after the first update,
    with an exception whose text carries a traceback and a file path."""

    def __init__(self, config, exc: BaseException, after_first: bool) -> None:
        self.config = config
        self._exc = exc
        self._after_first = after_first

    async def generate(self, prompt_token_ids, sampling, request_id=None) -> AsyncIterator[RequestUpdate]:
        if self._after_first:
            yield RequestUpdate(request_id, [65], False, None, 0, 0)
        raise self._exc

    async def generate_group(self, requests):
        return [self.generate(r.prompt_token_ids, r.sampling, r.req_id) for r in requests]

    async def abort(self, request_id: str) -> None:
        pass

    async def health(self) -> bool:
        raise self._exc

    async def status(self) -> dict:
        raise self._exc


def _failing_app(exc: BaseException, after_first: bool):
    from raystate.serve.app import AppArgs
    from raystate.serve.ingress import create_api
    from raystate.serve.server import RaystateServer

    client = _FailingClient(AppArgs(model="tiny", backend="inprocess").engine_config(), exc, after_first)
    return create_api(RaystateServer(client))  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("exc", "status"),
    [(EngineDead(SECRET), 503), (RuntimeError(SECRET), 500), (KeyError(SECRET), 500)],
    ids=["engine-dead", "runtime-error", "key-error"],
)
@pytest.mark.parametrize("stream", [False, True])
@pytest.mark.parametrize("after_first", [False, True])
def test_failures_do_not_leak_tracebacks(exc, status, stream, after_first, caplog):
    app = _failing_app(exc, after_first)
    transport = httpx.ASGITransport(app=app, raise_app_exceptions=False)
    body = {"prompt": "a", "max_tokens": 2, "stream": stream}

    async def calls() -> tuple[httpx.Response, ...]:
        async with httpx.AsyncClient(transport=transport, base_url="http://t") as http:
            return (
                await http.post("/v1/completions", json=body),
                await http.get("/health"),
                await http.get("/metrics"),
            )

    r, health, metrics = asyncio.run(calls())
    assert not LEAK.search(r.text), r.text
    if stream and after_first:  # the headers went out with the first chunk: the error is an event
        assert r.status_code == 200
        events = [line[6:] for line in r.text.splitlines() if line.startswith("data: ")]
        assert events[-1] == "[DONE]"  # an error event, then [DONE], as vLLM ends a failed stream
        err = json.loads(events[-2])["error"]
        assert err["type"] == "internal_error" and err["param"] is None
    else:
        assert r.status_code == status, r.text
        assert set(r.json()["error"]) == {"message", "type", "param", "code"}
    assert health.status_code in (503, 500) and not LEAK.search(health.text)
    assert metrics.status_code == 200 and not LEAK.search(metrics.text)
    assert SECRET.splitlines()[-1].strip() in caplog.text  # the details went to the log
