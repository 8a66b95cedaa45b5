"""Penalties, logit_bias, min_p and min_tokens over the OpenAI API of a real Serve app: the fields reach
the engine (a +100 logit_bias forces its token, in both endpoints) and out-of-range values are 400s naming
the field."""

from __future__ import annotations

import httpx
import pytest
from serve_harness import App

FORCED = ord("*")  # the byte model's token id of "*"


def _post(app: App, path: str, body: dict) -> httpx.Response:
    return httpx.post(f"{app.url}{path}", json=body, headers=app.headers(), timeout=60)


def test_logit_bias_changes_the_completion(open_app, reference):
    prompt = "L1 logit bias"
    plain, _, _ = reference([prompt], 6, ignore_eos=True)[0]
    body = {
        "model": "tiny",
        "prompt": prompt,
        "max_tokens": 6,
        "temperature": 0,
        "ignore_eos": True,
        "return_token_ids": True,
        "logit_bias": {str(FORCED): 100},
    }
    r = _post(open_app, "/v1/completions", body)
    assert r.status_code == 200, r.text
    choice = r.json()["choices"][0]
    assert choice["token_ids"] == [FORCED] * 6 != plain
    assert choice["text"] == "*" * 6
    # The other controls are taken too (and leave a greedy request's forced token alone).
    body |= {"presence_penalty": 0.5, "frequency_penalty": -0.5, "repetition_penalty": 1.2, "min_p": 0.1}
    body |= {"min_tokens": 2}
    r = _post(open_app, "/v1/completions", body)
    assert r.status_code == 200, r.text
    assert r.json()["choices"][0]["token_ids"] == [FORCED] * 6


def test_logit_bias_changes_the_chat_completion(open_app):
    body = {
        "model": "tiny",
        "messages": [{"role": "user", "content": "L2 chat bias"}],
        "max_tokens": 5,
        "temperature": 0,
        "ignore_eos": True,
        "logit_bias": {str(FORCED): 100.0},
    }
    r = _post(open_app, "/v1/chat/completions", body)
    assert r.status_code == 200, r.text
    assert r.json()["choices"][0]["message"]["content"] == "*" * 5


@pytest.mark.parametrize(
    ("extra", "param"),
    [
        ({"presence_penalty": 2.5}, "presence_penalty"),
        ({"frequency_penalty": -3}, "frequency_penalty"),
        ({"repetition_penalty": 0}, "repetition_penalty"),
        ({"logit_bias": {"x1": 1}}, "logit_bias"),
        ({"logit_bias": {"99999": 1}}, "logit_bias"),
        ({"logit_bias": {"5": 101}}, "logit_bias"),
        ({"min_p": 1.5}, "min_p"),
        ({"min_tokens": 50}, "min_tokens"),  # > max_tokens
    ],
)
def test_out_of_range_controls_are_400s(open_app, extra, param):
    r = _post(open_app, "/v1/completions", {"model": "tiny", "prompt": "L3", "max_tokens": 4, **extra})
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == param
