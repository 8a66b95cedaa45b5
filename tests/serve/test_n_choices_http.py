"""n > 1 choices and completions prompt lists over the OpenAI API, through the official `openai` client on
the in-process app (tests/asgi_app.py): choice indices as OpenAI numbers them (prompt_index * n +
choice_index), streamed choices interleaved and each ended on its own, usage summed, the n choices of a
prompt forked from its first (they share its prompt KV), and the limits as 400s naming the field.

Prefix caching is off: a repeated prompt would otherwise hit the cache and replay its sliding-window KV
(an approximation by design), which the comparisons with separate requests must not see.
"""

from __future__ import annotations

import json

import pytest
from asgi_app import AsgiApp, reference_app

from raystate.messages import MAX_N
from raystate.serve.protocol import MAX_CHOICES
from raystate.tokenizer import ByteTokenizer

MODEL = "tiny"
# Longer than a few KV blocks (16 tokens each), so that the later choices have blocks to fork.
LONG = "N1 a prompt long enough to span several KV blocks, so that forking shares some of them: " * 2


@pytest.fixture(scope="module")
def app():
    with reference_app(MODEL, enable_prefix_caching=False) as a:
        yield a


def _complete(app: AsgiApp, **kw):
    return app.run(app.openai.completions.create(model=MODEL, **kw))


def _ids(text: str) -> list[int]:
    return ByteTokenizer().encode(text, add_bos=True)


def _stream_events(app: AsgiApp, path: str, body: dict) -> list:
    """The parsed `data:` payloads of a streamed response, `[DONE]` as the string."""
    r = app.post(path, {**body, "stream": True})
    assert r.status_code == 200, r.text
    events = []
    for line in r.text.splitlines():
        if line.startswith("data: "):
            data = line.removeprefix("data: ")
            events.append(data if data == "[DONE]" else json.loads(data))
    return events


def test_greedy_n3_gives_three_equal_choices_forked_from_the_first(app):
    before = app.run(app.server.status())["forked_tokens"]
    r = _complete(app, prompt=LONG, n=3, max_tokens=8, temperature=0, extra_body={"return_token_ids": True})
    assert [c.index for c in r.choices] == [0, 1, 2]
    assert len({c.text for c in r.choices}) == 1
    assert len({tuple(c.token_ids) for c in r.choices}) == 1
    one = _complete(app, prompt=LONG, max_tokens=8, temperature=0)
    assert r.choices[0].text == one.choices[0].text
    # usage: the prompt once, every choice's tokens
    assert r.usage.prompt_tokens == len(_ids(LONG))
    assert r.usage.completion_tokens == sum(len(c.token_ids) for c in r.choices)
    assert r.usage.total_tokens == r.usage.prompt_tokens + r.usage.completion_tokens
    # the two later choices were forked from the first: they took its prompt's full blocks
    forked = app.run(app.server.status())["forked_tokens"] - before
    assert forked == 2 * ((len(_ids(LONG)) - 1) // 16 * 16) > 0


def test_seeded_choices_differ_and_each_equals_a_request_of_seed_plus_index(app):
    kw = dict(prompt="N2 seeded", max_tokens=12, temperature=1.0, extra_body={"ignore_eos": True})
    r = _complete(app, n=3, seed=1234, **kw)
    texts = [c.text for c in r.choices]
    assert [c.index for c in r.choices] == [0, 1, 2]
    assert len(set(texts)) > 1
    for i, text in enumerate(texts):
        assert _complete(app, n=1, seed=1234 + i, **kw).choices[0].text == text


def test_prompt_list_of_strings_times_n(app):
    prompts = ["N3 first prompt", "N3 the second one"]
    r = _complete(app, prompt=prompts, n=2, max_tokens=6, temperature=0)
    assert [c.index for c in r.choices] == [0, 1, 2, 3]
    want = [_complete(app, prompt=p, max_tokens=6, temperature=0).choices[0].text for p in prompts]
    assert [c.text for c in r.choices] == [want[0], want[0], want[1], want[1]]
    assert r.usage.prompt_tokens == sum(len(_ids(p)) for p in prompts)  # each prompt once, not n times
    # echo: each choice starts with its own prompt
    r = _complete(app, prompt=prompts, n=2, max_tokens=6, temperature=0, echo=True)
    assert [c.text for c in r.choices] == [prompts[0] + want[0]] * 2 + [prompts[1] + want[1]] * 2


def test_prompt_as_token_id_lists(app):
    a, b = _ids("N4 ids one"), _ids("N4 ids two!")
    r = _complete(app, prompt=[a, b], max_tokens=5, temperature=0, extra_body={"return_token_ids": True})
    assert [c.index for c in r.choices] == [0, 1]
    for c, ids in zip(r.choices, (a, b), strict=True):
        one = _complete(app, prompt=ids, max_tokens=5, temperature=0, extra_body={"return_token_ids": True})
        assert c.token_ids == one.choices[0].token_ids
    assert r.usage.prompt_tokens == len(a) + len(b)
    # a single id list, wrapped or not, is one prompt
    r = _complete(app, prompt=[a], n=2, max_tokens=5, temperature=0)
    assert [c.index for c in r.choices] == [0, 1] and r.usage.prompt_tokens == len(a)


def test_streamed_n2_with_a_prompt_list_rebuilds_the_same_texts(app):
    body = {
        "model": MODEL,
        "prompt": ["N5 stream a", "N5 stream bb"],
        "n": 2,
        "max_tokens": 10,
        "temperature": 0,
        "stream_options": {"include_usage": True},
    }
    whole = app.post("/v1/completions", body).json()
    events = _stream_events(app, "/v1/completions", body)
    assert events[-1] == "[DONE]" and events.count("[DONE]") == 1
    usage = events[-2]
    assert (
        usage["choices"] == [] and usage["usage"]["completion_tokens"] == whole["usage"]["completion_tokens"]
    )
    assert usage["usage"]["prompt_tokens"] == whole["usage"]["prompt_tokens"]
    texts, reasons = {}, {}
    for e in events[:-2]:
        assert len(e["choices"]) == 1
        c = e["choices"][0]
        assert c["index"] not in reasons  # nothing after a choice's finish_reason
        texts[c["index"]] = texts.get(c["index"], "") + c["text"]
        if c["finish_reason"] is not None:
            reasons[c["index"]] = c["finish_reason"]
    assert texts == {c["index"]: c["text"] for c in whole["choices"]}
    assert reasons == {c["index"]: c["finish_reason"] for c in whole["choices"]}
    assert sorted(reasons) == [0, 1, 2, 3]


def test_streamed_through_the_openai_client(app):
    async def collect():
        stream = await app.openai.completions.create(
            model=MODEL, prompt="N6 client stream", n=2, max_tokens=6, temperature=0, stream=True
        )
        texts: dict[int, str] = {}
        async for chunk in stream:
            for c in chunk.choices:
                texts[c.index] = texts.get(c.index, "") + c.text
        return texts

    texts = app.run(collect())
    want = _complete(app, prompt="N6 client stream", max_tokens=6, temperature=0).choices[0].text
    assert texts == {0: want, 1: want}


def test_chat_n2(app):
    messages = [{"role": "user", "content": "N7 chat"}]
    r = app.run(
        app.openai.chat.completions.create(model=MODEL, messages=messages, n=2, max_tokens=6, temperature=0)
    )
    assert [c.index for c in r.choices] == [0, 1]
    assert r.choices[0].message.content == r.choices[1].message.content
    one = app.run(
        app.openai.chat.completions.create(model=MODEL, messages=messages, max_tokens=6, temperature=0)
    )
    assert r.choices[0].message.content == one.choices[0].message.content
    assert r.usage.prompt_tokens == one.usage.prompt_tokens
    assert r.usage.completion_tokens == 2 * one.usage.completion_tokens
    # streamed: one role chunk per choice first, then the contents
    body = {"model": MODEL, "messages": messages, "n": 2, "max_tokens": 6, "temperature": 0}
    events = _stream_events(app, "/v1/chat/completions", body)
    assert events[-1] == "[DONE]"
    assert [e["choices"][0]["index"] for e in events[:2]] == [0, 1]
    assert all(e["choices"][0]["delta"]["role"] == "assistant" for e in events[:2])
    texts: dict[int, str] = {}
    for e in events[2:-1]:
        c = e["choices"][0]
        texts[c["index"]] = texts.get(c["index"], "") + (c["delta"].get("content") or "")
    assert texts == {0: one.choices[0].message.content, 1: one.choices[0].message.content}


def test_logprobs_and_max_tokens_0_per_choice(app):
    prompt = "N8 echo"
    r = _complete(app, prompt=[prompt, prompt + "!"], n=2, max_tokens=0, echo=True, logprobs=1)
    assert [c.text for c in r.choices] == [prompt, prompt, prompt + "!", prompt + "!"]
    assert all(c.finish_reason == "length" for c in r.choices)
    assert r.usage.completion_tokens == 0
    assert [len(c.logprobs.tokens) for c in r.choices] == [len(_ids(prompt))] * 2 + [
        len(_ids(prompt)) + 1
    ] * 2
    assert r.choices[0].logprobs.token_logprobs == r.choices[1].logprobs.token_logprobs


@pytest.mark.parametrize(
    ("path", "change", "param"),
    [
        ("/v1/completions", {"n": 0}, "n"),
        ("/v1/completions", {"n": MAX_N + 1}, "n"),
        ("/v1/chat/completions", {"n": 0}, "n"),
        ("/v1/chat/completions", {"n": MAX_N + 1}, "n"),
        ("/v1/completions", {"n": 2, "best_of": 3}, "best_of"),
        ("/v1/completions", {"best_of": 2}, "best_of"),
        ("/v1/completions", {"n": 3, "best_of": 2}, "best_of"),
        ("/v1/completions", {"prompt": ["x"] * (MAX_CHOICES // 8 + 1), "n": 8}, "n"),
        ("/v1/completions", {"prompt": ["x"] * (MAX_CHOICES + 1)}, "prompt"),
        ("/v1/completions", {"prompt": ["x", [1, 2]]}, "prompt"),
        ("/v1/completions", {"prompt": [[1, 2], []]}, "prompt"),
        ("/v1/completions", {"prompt": [[1, 2], [3, 99999]]}, "prompt[1]"),
    ],
)
def test_bad_n_best_of_and_prompt_lists_are_400s(app, path, change, param):
    assert app.refused_param(path, change) == param


def test_best_of_equal_to_n_is_accepted(app):
    r = app.post("/v1/completions", {"model": MODEL, "prompt": "N9", "max_tokens": 2, "n": 2, "best_of": 2})
    assert r.status_code == 200, r.text
    assert [c["index"] for c in r.json()["choices"]] == [0, 1]


def test_structured_output_and_stop_strings_hold_per_choice(app):
    schema = {
        "type": "object",
        "properties": {"city": {"enum": ["Paris", "Oslo"]}, "rank": {"type": "integer", "minimum": 1}},
        "required": ["city", "rank"],
        "additionalProperties": False,
    }
    fmt = {"type": "json_schema", "json_schema": {"name": "place", "schema": schema}}
    r = app.run(
        app.openai.chat.completions.create(
            model=MODEL,
            messages=[{"role": "user", "content": "N10 where?"}],
            n=3,
            max_tokens=48,
            temperature=1.0,
            seed=3,
            response_format=fmt,
        )
    )
    for c in r.choices:
        assert c.finish_reason == "stop", c
        out = json.loads(c.message.content)
        assert out["city"] in ("Paris", "Oslo") and isinstance(out["rank"], int)
    # a stop string cuts each choice at its own match
    kw = dict(prompt="N11 stop", max_tokens=24, temperature=1.0, extra_body={"ignore_eos": True})
    full = _complete(app, n=3, seed=5, **kw)
    stop = full.choices[0].text[3:5]
    cut = _complete(app, n=3, seed=5, stop=[stop], **kw)
    for a, b in zip(full.choices, cut.choices, strict=True):
        assert b.text == a.text[: a.text.index(stop)] if stop in a.text else b.text == a.text
    assert cut.choices[0].finish_reason == "stop"
    # ... and ends after it with vLLM's include_stop_str_in_output, streamed or not
    extra = {**kw.pop("extra_body"), "include_stop_str_in_output": True}
    kept = _complete(app, n=3, seed=5, stop=[stop], extra_body=extra, **kw)
    for a, b in zip(full.choices, kept.choices, strict=True):
        end = a.text.index(stop) + len(stop) if stop in a.text else len(a.text)
        assert b.text == a.text[:end]
    body = {"model": MODEL, "n": 3, "seed": 5, "stop": [stop], **kw, **extra}
    streamed = ["", "", ""]
    for event in _stream_events(app, "/v1/completions", body)[:-1]:
        for choice in event["choices"]:
            streamed[choice["index"]] += choice["text"]
    assert streamed == [c.text for c in kept.choices]


def test_a_closed_stream_aborts_every_choice(app):
    from raystate.serve.protocol import CompletionRequest

    server = app.server
    free = app.run(server.status())["num_free_blocks"]

    async def read_one_then_close(read: int) -> None:
        req = CompletionRequest(
            model=MODEL, prompt=["N12 a", "N12 b"], n=3, max_tokens=400, ignore_eos=True, stream=True
        )
        events = await server.completion(req)
        if read:
            async for _ in events:
                read -= 1
                if not read:
                    break
        await events.aclose()

    async def idle() -> dict:
        import asyncio

        for _ in range(400):
            status = await server.status()
            busy = sum(status["num_running"]) + sum(status["num_waiting"])
            if not busy and status["num_free_blocks"] == free:
                return status
            await asyncio.sleep(0.01)
        raise AssertionError(f"not idle: {status}")

    for read in (0, 3):  # closed before its first event, and after a few
        app.run(read_one_then_close(read))
        app.run(idle())
    assert server.metrics.in_flight._value.get() == 0


def test_nothing_left_running(app):
    status = app.run(app.server.status())
    assert sum(status["num_running"]) == 0 and sum(status["num_waiting"]) == 0
