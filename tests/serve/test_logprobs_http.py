"""logprobs over the OpenAI API of a real Serve app, through the official `openai` client: completions
`logprobs` (+ `echo`, + `max_tokens: 0`) and chat `logprobs` / `top_logprobs`, streamed and not, equal to
in-process `LLM.generate` logprobs."""

from __future__ import annotations

import httpx
import openai
import pytest
from serve_harness import App

from raystate.tokenizer import ByteTokenizer

MODEL = "tiny"
TOL = 1e-4


def _client(app: App) -> openai.OpenAI:
    return openai.OpenAI(base_url=app.v1, api_key=app.api_key or "unused", max_retries=0, timeout=60)


@pytest.fixture(scope="module")
def local(serve_port):
    """fn(prompt_ids, max_tokens, logprobs, prompt_logprobs) -> RequestOutput, greedy, in-process."""
    from raystate import LLM, SamplingParams

    llm = LLM(model="tiny", max_model_len=512, backend="inprocess", enable_prefix_caching=False)

    def run(ids, max_tokens, logprobs=None, prompt_logprobs=None):
        sp = SamplingParams(max_tokens=max_tokens, logprobs=logprobs, prompt_logprobs=prompt_logprobs)
        with pytest.MonkeyPatch.context() as mp:
            mp.setenv("RAYSTATE_KERNELS", "reference")
            mp.setattr("raystate.kernels._common._reference_forced", True)
            return llm.generate(prompt_token_ids=[ids], sampling_params=sp, use_tqdm=False)[0]

    return run


def _tok(t: int) -> str:
    return ByteTokenizer().decode([t], skip_special_tokens=False)


def _ids(text: str) -> list[int]:
    return ByteTokenizer().encode(text, add_bos=True)


def test_completion_logprobs(open_app, local):
    prompt = "P1 logprobs"
    r = _client(open_app).completions.create(
        model=MODEL, prompt=prompt, max_tokens=5, temperature=0, logprobs=3
    )
    want = local(_ids(prompt), 5, logprobs=3)
    lp = r.choices[0].logprobs
    assert lp.tokens == [_tok(t) for t in want.token_ids]
    for got, tok, d in zip(lp.token_logprobs, want.token_ids, want.logprobs, strict=True):
        assert abs(got - d[tok].logprob) < TOL
    for top, d in zip(lp.top_logprobs, want.logprobs, strict=True):
        # Keyed by token text: byte tokens that are not UTF-8 on their own all read as U+FFFD.
        names = [_tok(t) for t in d]
        assert set(top) == set(names)
        for t, v in d.items():
            if names.count(_tok(t)) == 1:
                assert abs(top[_tok(t)] - v.logprob) < TOL
    assert lp.text_offset[0] == 0


def test_completion_echo_with_logprobs_and_max_tokens_0(open_app, local):
    prompt = "P2 echo loglikelihood"
    ids = _ids(prompt)
    want = local(ids, 1, logprobs=2, prompt_logprobs=2)
    client = _client(open_app)
    r = client.completions.create(model=MODEL, prompt=prompt, max_tokens=0, echo=True, logprobs=2)
    c = r.choices[0]
    assert c.text == prompt and c.finish_reason == "length"
    assert r.usage.completion_tokens == 0
    assert c.logprobs.tokens == [_tok(t) for t in ids]
    assert c.logprobs.token_logprobs[0] is None and c.logprobs.top_logprobs[0] is None
    for i in range(1, len(ids)):
        assert abs(c.logprobs.token_logprobs[i] - want.prompt_logprobs[i][ids[i]].logprob) < TOL
    # echo with output: the prompt's tokens, then the output's.
    r = client.completions.create(
        model=MODEL, prompt=prompt, max_tokens=3, echo=True, logprobs=1, temperature=0
    )
    c = r.choices[0]
    out = local(ids, 3, logprobs=1)
    assert c.text == prompt + out.text
    assert len(c.logprobs.tokens) == len(ids) + 3
    for got, tok, d in zip(c.logprobs.token_logprobs[len(ids) :], out.token_ids, out.logprobs, strict=True):
        assert abs(got - d[tok].logprob) < TOL
    # Streamed: the first chunk carries the prompt and its logprobs.
    chunks = list(
        client.completions.create(
            model=MODEL, prompt=prompt, max_tokens=3, echo=True, logprobs=1, stream=True, temperature=0
        )
    )
    texts = "".join(ch.choices[0].text for ch in chunks if ch.choices)
    assert texts == prompt + out.text
    streamed = [
        v
        for ch in chunks
        if ch.choices and ch.choices[0].logprobs
        for v in ch.choices[0].logprobs.token_logprobs
    ]
    assert streamed[0] is None and len(streamed) == len(ids) + 3
    for a, b in zip(streamed[1:], c.logprobs.token_logprobs[1:], strict=True):
        assert abs(a - b) < TOL


def test_max_tokens_0_needs_echo(open_app):
    body = {"model": MODEL, "prompt": "P3", "max_tokens": 0}
    r = httpx.post(f"{open_app.url}/v1/completions", json=body, headers=open_app.headers(), timeout=60)
    assert r.status_code == 400 and r.json()["error"]["param"] == "max_tokens"
    body = {"model": MODEL, "prompt": "P3", "logprobs": 21}
    r = httpx.post(f"{open_app.url}/v1/completions", json=body, headers=open_app.headers(), timeout=60)
    assert r.status_code == 400 and r.json()["error"]["param"] == "logprobs"


@pytest.mark.parametrize("stream", [False, True])
def test_chat_logprobs(open_app, local, stream):
    content = f"P4 chat logprobs {stream}"
    ids = ByteTokenizer().encode(
        ByteTokenizer().apply_chat_template([{"role": "user", "content": content}]), add_bos=True
    )
    want = local(ids, 4, logprobs=2)
    kw = dict(
        model=MODEL,
        messages=[{"role": "user", "content": content}],
        max_tokens=4,
        temperature=0,
        logprobs=True,
        top_logprobs=2,
    )
    client = _client(open_app)
    if stream:
        items = [
            t
            for ch in client.chat.completions.create(stream=True, **kw)
            if ch.choices and ch.choices[0].logprobs
            for t in ch.choices[0].logprobs.content
        ]
    else:
        items = client.chat.completions.create(**kw).choices[0].logprobs.content
    assert [t.token for t in items] == [_tok(t) for t in want.token_ids]
    for item, tok, d in zip(items, want.token_ids, want.logprobs, strict=True):
        assert abs(item.logprob - d[tok].logprob) < TOL
        assert item.bytes == list(item.token.encode())
        assert len(item.top_logprobs) == 2
        for top in item.top_logprobs:
            assert any(abs(top.logprob - v.logprob) < TOL for v in d.values())
    r = httpx.post(
        f"{open_app.url}/v1/chat/completions",
        json={"model": MODEL, "messages": [{"role": "user", "content": "x"}], "top_logprobs": 2},
        headers=open_app.headers(),
        timeout=60,
    )
    assert r.status_code == 400 and r.json()["error"]["param"] == "top_logprobs"
