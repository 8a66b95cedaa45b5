"""Bad input, the API key, the body size limit and client disconnects, over a real Serve app on loopback.

Every invalid field must give a 400 in OpenAI's error shape naming the field; a client that goes away
mid-stream must have its request aborted and its KV blocks returned (seen through `Client.status()`,
served at /status), and the server must keep serving.
"""

from __future__ import annotations

import time

import httpx
import openai
import pytest
from serve_harness import wait_idle

GOOD = {"model": "tiny", "prompt": "D0 fine", "max_tokens": 2, "temperature": 0}
GOOD_CHAT = {"model": "tiny", "messages": [{"role": "user", "content": "D0"}], "max_tokens": 2}

BAD_COMPLETIONS = [
    ({"max_tokens": 0}, "max_tokens"),
    ({"max_tokens": "many"}, "max_tokens"),
    ({"max_tokens": 5000}, "max_tokens"),  # prompt + max_tokens over max_model_len
    ({"temperature": -0.5}, "temperature"),
    ({"top_p": 0.0}, "top_p"),
    ({"top_p": 1.5}, "top_p"),
    ({"top_k": -3}, "top_k"),
    ({"seed": -1}, "seed"),
    ({"n": 0}, "n"),
    ({"stop": 7}, "stop"),
    ({"stop": [""]}, "stop"),
    ({"stream": "sometimes"}, "stream"),
    ({"logprobs": 21}, "logprobs"),
    ({"logprobs": -1}, "logprobs"),
    ({"presence_penalty": 2.5}, "presence_penalty"),
    ({"stop_token_ids": [9999]}, "stop_token_ids"),
    ({"prompt": []}, "prompt"),
    ({"prompt": [1, 2, 999]}, "prompt"),
    ({"prompt": [1, "two"]}, "prompt"),
    ({"prompt": ["one", [1, 2]]}, "prompt"),
    ({"prompt": 12}, "prompt"),
    ({"prompt": "x" * 3000}, "prompt"),  # longer than max_model_len
]

BAD_CHATS = [
    ({"messages": []}, "messages"),
    ({"messages": "hello"}, "messages"),
    ({"messages": [{"role": "robot", "content": "x"}]}, "messages[0].role"),
    ({"messages": [{"role": "user", "content": "x"}, {"content": "no role"}]}, "messages[1].role"),
    ({"messages": [{"role": "user", "content": [{"type": "image_url"}]}]}, "messages[0].content"),
    ({"messages": [{"role": "user"}]}, "messages[0].content"),
    ({"max_completion_tokens": 0}, "max_completion_tokens"),
    ({"top_logprobs": 21}, "top_logprobs"),
    ({"top_logprobs": 2}, "top_logprobs"),  # without logprobs: true
    ({"tools": [{"type": "function"}]}, "tools[0].function"),
    ({"temperature": "hot"}, "temperature"),
]


def _post(app, path: str, body: dict) -> httpx.Response:
    return httpx.post(f"{app.url}{path}", json=body, headers=app.headers(), timeout=60)


def _assert_openai_error(r: httpx.Response, status: int, param: str | None) -> None:
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"}
    assert err["param"] == param
    assert isinstance(err["message"], str) and err["message"]
    if param is not None:
        assert param.split("[")[0] in err["message"]


def test_wrong_model_is_a_404_and_unknown_fields_are_ignored(open_app):
    r = _post(open_app, "/v1/completions", {**GOOD, "model": "gpt-4"})
    assert r.status_code == 404, r.text
    assert r.json()["error"]["type"] == "NotFoundError" and r.json()["error"]["param"] == "model"
    r = _post(open_app, "/v1/completions", {**GOOD, "max_token": 3, "store": True})  # as vLLM: ignored
    assert r.status_code == 200, r.text


@pytest.mark.parametrize(("change", "param"), BAD_COMPLETIONS)
def test_bad_completion_field_is_a_400_naming_it(open_app, change, param):
    _assert_openai_error(_post(open_app, "/v1/completions", {**GOOD, **change}), 400, param)


@pytest.mark.parametrize(("change", "param"), BAD_CHATS)
def test_bad_chat_field_is_a_400_naming_it(open_app, change, param):
    _assert_openai_error(_post(open_app, "/v1/chat/completions", {**GOOD_CHAT, **change}), 400, param)


def test_openai_client_sees_the_param(open_app):
    client = openai.OpenAI(base_url=open_app.v1, api_key="unused", max_retries=0)
    with pytest.raises(openai.BadRequestError) as e:
        client.completions.create(model="tiny", prompt="D1", max_tokens=4, top_p=7.0)
    assert e.value.param == "top_p"
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "x"}], n=129)
    assert e.value.param == "n"


def test_malformed_bodies_are_400s(open_app):
    url = f"{open_app.url}/v1/completions"
    r = httpx.post(url, content=b"{not json", headers={"Content-Type": "application/json"})
    _assert_openai_error(r, 400, None)
    _assert_openai_error(httpx.post(url, json=[1, 2, 3]), 400, None)


def test_body_over_the_limit_is_a_413(open_app):
    big = {**GOOD, "prompt": "x" * (1 << 20)}
    _assert_openai_error(_post(open_app, "/v1/completions", big), 413, None)

    def chunks():  # no Content-Length: the limit holds while the body streams in
        for _ in range(1 << 5):
            yield b" " * (1 << 16)

    json_type = {"Content-Type": "application/json"}
    r = httpx.post(f"{open_app.url}/v1/completions", content=chunks(), headers=json_type, timeout=60)
    _assert_openai_error(r, 413, None)


def test_unknown_route_is_an_openai_style_404(open_app):
    r = httpx.get(f"{open_app.url}/v1/engines")
    _assert_openai_error(r, 404, None)


def test_api_key_is_checked_on_every_route_but_health(keyed_app):
    base = keyed_app.url
    for path in ("/v1/models", "/metrics", "/status", "/v1/nothing-here"):
        r = httpx.get(f"{base}{path}")
        _assert_openai_error(r, 401, None)
        assert r.json()["error"]["code"] == "invalid_api_key"
        r = httpx.get(f"{base}{path}", headers={"Authorization": "Bearer wrong"})
        assert r.status_code == 401
    assert httpx.get(f"{base}/health", timeout=60).status_code == 200
    assert httpx.get(f"{base}/v1/models", headers=keyed_app.headers()).status_code == 200

    bad = openai.OpenAI(base_url=keyed_app.v1, api_key="wrong", max_retries=0)
    with pytest.raises(openai.AuthenticationError):
        bad.completions.create(model="tiny", prompt="D2", max_tokens=2)
    good = openai.OpenAI(base_url=keyed_app.v1, api_key=keyed_app.api_key, max_retries=0)
    out = good.completions.create(model="tiny", prompt="D2", max_tokens=2, temperature=0)
    assert out.usage.completion_tokens == 2


def test_without_a_key_any_or_no_bearer_is_accepted(open_app):
    for headers in ({}, {"Authorization": "Bearer anything"}):
        r = httpx.post(f"{open_app.url}/v1/completions", json=GOOD, headers=headers, timeout=60)
        assert r.status_code == 200, r.text


def test_health_runs_a_step(open_app):
    r = httpx.get(f"{open_app.url}/health", timeout=60)
    assert r.status_code == 200 and r.json() == {"status": "ok"}


@pytest.mark.parametrize("endpoint", ["completions", "chat"])
def test_disconnect_mid_stream_aborts_and_frees_blocks(open_app, endpoint):
    free = wait_idle(open_app, open_app.status()["num_free_blocks"])["num_free_blocks"]
    max_tokens = 2000
    if endpoint == "completions":
        path, body = "/v1/completions", {"model": "tiny", "prompt": "E1"}
    else:
        path, body = (
            "/v1/chat/completions",
            {"model": "tiny", "messages": [{"role": "user", "content": "E2"}]},
        )
    body |= {"stream": True, "temperature": 0, "ignore_eos": True, "max_tokens": max_tokens}
    with httpx.Client(timeout=60) as http, http.stream("POST", f"{open_app.url}{path}", json=body) as r:
        assert r.status_code == 200
        lines = r.iter_lines()  # held: dropping a half-read iterator would close the connection here
        arrivals = []
        while len(arrivals) < 8:
            if next(lines).startswith("data: "):
                arrivals.append(time.perf_counter())
        busy = open_app.status()
        assert sum(busy["num_running"]) + sum(busy["num_waiting"]) == 1
        assert busy["num_free_blocks"] != free  # the stream holds blocks
    closed = time.perf_counter()
    # Left alone, the request would run for about this long still.
    remaining_s = (arrivals[-1] - arrivals[1]) / 6 * (max_tokens - 8)
    wait_idle(open_app, free, timeout_s=30)
    assert time.perf_counter() - closed < remaining_s / 2  # aborted, not run to the end
    after = _post(open_app, "/v1/completions", GOOD)
    assert after.status_code == 200 and after.json()["usage"]["completion_tokens"] == 2
