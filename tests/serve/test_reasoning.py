"""A reasoning model's <think> text as `reasoning_content` (--reasoning-parser): the stream splitter on
its own, split at every point, then over HTTP through the official `openai` client, with a scripted
model (tests/serve/test_tool_calling.py's) that thinks before it answers or calls a tool."""

from __future__ import annotations

import asyncio
import json
from types import SimpleNamespace

import httpx
import openai
import pytest
from test_tool_calling import ASK, HERMES_OUTPUT, TOOLS, ScriptedClient

from raystate.serve.ingress import create_api
from raystate.serve.reasoning import ThinkStream, prompt_opens_thinking
from raystate.serve.server import RaystateServer


def split_result(text: str, starts_inside: bool = False) -> tuple[str, str]:
    """(reasoning, answer) of `text`, the same however it is split (checked at every point and one
    character at a time)."""
    ways = [[text]] + [[text[:i], text[i:]] for i in range(len(text) + 1)] + [list(text)]
    results = set()
    for pieces in ways:
        stream = ThinkStream(starts_inside)
        parts = [stream.feed(piece) for piece in pieces] + [stream.finish()]
        assert "".join(r for r, _ in parts) == stream.reasoning
        assert "".join(a for _, a in parts) == stream.answer
        results.add((stream.reasoning, stream.answer))
    assert len(results) == 1, results
    return results.pop()


@pytest.mark.parametrize(
    ("text", "inside", "want"),
    [
        ("<think>\nI should add.\n</think>\n\n4", False, ("\nI should add.\n", "4")),
        ("  <think>a < b</think>ok </think>", False, ("a < b", "ok </think>")),
        ("no thinking here <think>x</think>", False, ("", "no thinking here <think>x</think>")),
        ("<think>cut short", False, ("cut short", "")),
        ("<thi", False, ("", "<thi")),
        ("", False, ("", "")),
        ("\n\n", False, ("", "\n\n")),
        ("still thinking</think>\n\nanswer", True, ("still thinking", "answer")),
        ("</think>answer", True, ("", "answer")),
        ("<think></think>\n\n", False, ("", "")),
    ],
)
def test_think_stream_splits_reasoning_from_the_answer(text, inside, want):
    assert split_result(text, inside) == want


def test_a_prompt_that_opens_the_block_starts_inside_it():
    assert prompt_opens_thinking("<|im_start|>assistant\n<think>\n")
    assert not prompt_opens_thinking("<|im_start|>assistant\n<think>\n\n</think>\n\n")  # thinking off
    assert not prompt_opens_thinking("<|im_start|>assistant\n")


_LOOP = asyncio.new_event_loop()


def _app(script: str, reasoning_parser: str | None = "qwen3"):
    client = ScriptedClient(script, 3)
    server = RaystateServer(client, "scripted", tool_call_parser="hermes", reasoning_parser=reasoning_parser)
    http = httpx.AsyncClient(
        transport=httpx.ASGITransport(app=create_api(server), raise_app_exceptions=False), base_url="http://x"
    )
    return SimpleNamespace(
        openai=openai.AsyncOpenAI(base_url="http://x/v1", api_key="x", max_retries=0, http_client=http),
        http=http,
    )


def _both(app, **kwargs):
    """(the whole response's message and finish_reason, the stream's (reasoning, content, calls, reason))."""

    async def go():
        whole = await app.openai.chat.completions.create(**kwargs)
        stream = await app.openai.chat.completions.create(stream=True, **kwargs)
        reasoning, content, calls, reason = "", "", {}, None
        async for chunk in stream:
            for choice in chunk.choices:
                delta = choice.delta.model_dump()
                reasoning += delta.get("reasoning_content") or ""
                content += delta.get("content") or ""
                for d in delta.get("tool_calls") or ():
                    calls.setdefault(d["index"], "")
                    calls[d["index"]] += d["function"]["arguments"]
                reason = choice.finish_reason or reason
        return whole.choices[0], (reasoning, content, [calls[i] for i in sorted(calls)], reason)

    return _LOOP.run_until_complete(go())


def test_the_thinking_is_reasoning_content_and_the_rest_is_the_answer():
    app = _app("<think>\nParis is in France.\n</think>\n\nParis.")
    choice, streamed = _both(app, model="scripted", messages=ASK, max_tokens=500)
    message = choice.message.model_dump()
    assert message["reasoning_content"] == "\nParis is in France.\n"
    assert message["content"] == "Paris." and choice.finish_reason == "stop"
    assert streamed == ("\nParis is in France.\n", "Paris.", [], "stop")


def test_a_model_that_thinks_then_calls_a_tool():
    app = _app("<think>I need the weather.</think>\n\n" + HERMES_OUTPUT.split("\n", 1)[1])
    choice, streamed = _both(app, model="scripted", messages=ASK, tools=TOOLS, max_tokens=1000)
    message = choice.message.model_dump()
    assert message["reasoning_content"] == "I need the weather."
    assert message["content"] is None and choice.finish_reason == "tool_calls"
    args = [json.loads(c["function"]["arguments"]) for c in message["tool_calls"]]
    assert args == [{"city": "Paris", "unit": "celsius"}, {"zone": "CET"}]
    assert streamed[0] == "I need the weather." and streamed[1] == "" and streamed[3] == "tool_calls"
    assert [json.loads(a) for a in streamed[2]] == args


def test_without_a_reasoning_parser_the_thinking_stays_in_the_content():
    script = "<think>hmm</think>\n\nParis."
    app = _app(script, reasoning_parser=None)
    choice, streamed = _both(app, model="scripted", messages=ASK, max_tokens=500)
    assert "reasoning_content" not in choice.message.model_dump(exclude_none=True)
    assert choice.message.content == script and streamed[:2] == ("", script)
    body = _LOOP.run_until_complete(
        app.http.post("/v1/chat/completions", json={"model": "scripted", "messages": ASK, "max_tokens": 5})
    ).json()
    assert "reasoning_content" not in body["choices"][0]["message"]  # absent, not null


def test_an_unknown_reasoning_parser_is_refused():
    with pytest.raises(ValueError, match="reasoning_parser"):
        RaystateServer(ScriptedClient(""), "scripted", reasoning_parser="o1")
