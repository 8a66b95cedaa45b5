"""OpenAI's Responses API (POST /v1/responses) through the official `openai` client: the request runs as the
chat it describes (the same prompt, tokens and grammar), the answer's output items and the streamed
events agree with each other and with the chat route's message, and what raystate cannot do (stored
responses, non-text input, non-function tools) is a 400 naming the field.

Two servers: the tiny byte model on the kernels' references (real tokens, real grammar), and a scripted
model (tests/serve/test_tool_calling.py's) that thinks, writes text and calls tools in Hermes' format."""

from __future__ import annotations

import asyncio
import json
from types import SimpleNamespace

import httpx
import jsonschema
import openai
import pytest
from asgi_app import reference_app
from test_tool_calling import ASK, HERMES_OUTPUT, TOOLS, WEATHER, ScriptedClient

from raystate.serve.ingress import create_api
from raystate.serve.server import RaystateServer

FLAT_TOOLS = [{"type": "function", **t["function"]} for t in TOOLS]  # the Responses API's tool form
THINK_AND_CALL = "<think>I need the weather.</think>\n\n" + HERMES_OUTPUT
_LOOP = asyncio.new_event_loop()


def _scripted(script: str):
    client = ScriptedClient(script, 3)
    server = RaystateServer(client, "scripted", tool_call_parser="hermes", reasoning_parser="qwen3")
    transport = httpx.ASGITransport(app=create_api(server), raise_app_exceptions=False)
    http = httpx.AsyncClient(transport=transport, base_url="http://x", timeout=30)
    return SimpleNamespace(
        name="scripted",
        client=client,
        http=http,
        openai=openai.AsyncOpenAI(base_url="http://x/v1", api_key="x", max_retries=0, http_client=http),
        run=_LOOP.run_until_complete,
    )


@pytest.fixture(scope="module")
def tiny():
    with reference_app("tiny", max_model_len=2048) as app:
        yield app


def _both(app, **kwargs) -> tuple[dict, list[dict]]:
    """(the whole response, the events of the same request streamed), as JSON-ready dicts."""

    async def go():
        whole = await app.openai.responses.create(**kwargs)
        stream = await app.openai.responses.create(stream=True, **kwargs)
        return whole.model_dump(exclude_none=True), [e.model_dump(exclude_none=True) async for e in stream]

    return app.run(go())


def _without_ids(items: list[dict]) -> list[dict]:
    return [{k: v for k, v in item.items() if k not in ("id", "call_id")} for item in items]


def _replayed(events: list[dict]) -> list[dict]:
    """The output items a client builds from the events alone (the deltas joined), checking on the way
    that every event is numbered in order and that each item's .done carries the text its deltas built."""
    assert [e["sequence_number"] for e in events] == list(range(len(events)))
    assert [e["type"] for e in events[:2]] == ["response.created", "response.in_progress"]
    items: list[dict] = []
    for e in events[2:-1]:
        kind = e["type"]
        if kind == "response.output_item.added":
            assert e["output_index"] == len(items) and e["item"]["status"] == "in_progress"
            items.append(dict(e["item"], text=""))
            continue
        item = items[e["output_index"]]
        if kind in ("response.output_text.delta", "response.reasoning_text.delta"):
            item["text"] += e["delta"]
        elif kind == "response.function_call_arguments.delta":
            item["arguments"] += e["delta"]
        elif kind in ("response.output_text.done", "response.reasoning_text.done"):
            assert e["text"] == item["text"]
        elif kind == "response.function_call_arguments.done":
            assert e["arguments"] == item["arguments"] and e["name"] == item["name"]
        elif kind == "response.output_item.done":
            done = e["item"]
            if done["type"] in ("message", "reasoning"):
                assert done["content"][0]["text"] == item["text"]
            else:
                assert done["arguments"] == item["arguments"]
            items[e["output_index"]] = done
        else:
            assert kind in ("response.content_part.added", "response.content_part.done"), kind
    return items


def test_thinking_text_and_calls_are_output_items_in_order():
    app = _scripted(THINK_AND_CALL)
    whole, events = _both(app, model="scripted", input="Weather in Paris?", tools=FLAT_TOOLS)
    assert whole["status"] == "completed" and whole["object"] == "response" and whole["store"] is False
    output = whole["output"]
    assert [o["type"] for o in output] == ["reasoning", "message", "function_call", "function_call"]
    assert output[0]["content"] == [{"type": "reasoning_text", "text": "I need the weather."}]
    assert output[1]["role"] == "assistant" and output[1]["content"][0]["text"] == "Let me look.\n"
    calls = [(o["name"], json.loads(o["arguments"])) for o in output[2:]]
    assert calls == [("get_weather", {"city": "Paris", "unit": "celsius"}), ("get_time", {"zone": "CET"})]
    assert all(o["call_id"].startswith("call_") and o["id"].startswith("fc_") for o in output[2:])
    assert (
        whole["id"].startswith("resp_")
        and whole["usage"]["output_tokens"] == len(THINK_AND_CALL.encode()) + 1
    )
    # the stream: the same items, built from its deltas; its last event is the whole response
    assert events[-1]["type"] == "response.completed"
    assert _without_ids(_replayed(events)) == _without_ids(output)
    assert _without_ids(events[-1]["response"]["output"]) == _without_ids(output)
    # the chat route's answer to the same conversation: the same reasoning, content and calls
    chat = app.run(app.openai.chat.completions.create(model="scripted", messages=ASK, tools=TOOLS))
    message = chat.choices[0].message.model_dump()
    assert message["reasoning_content"] == "I need the weather." and message["content"] == "Let me look.\n"
    assert [(c["function"]["name"], c["function"]["arguments"]) for c in message["tool_calls"]] == [
        (o["name"], o["arguments"]) for o in output[2:]
    ]


def test_max_output_tokens_ends_incomplete():
    app = _scripted("A long answer that does not fit.")
    whole, events = _both(app, model="scripted", input="Go", max_output_tokens=7)
    assert whole["status"] == "incomplete" and whole["incomplete_details"] == {"reason": "max_output_tokens"}
    [message] = whole["output"]
    assert message["content"][0]["text"] == "A long " and message["status"] == "incomplete"
    assert events[-1]["type"] == "response.incomplete" and _replayed(events)[0]["status"] == "incomplete"
    assert whole["usage"]["output_tokens"] == 7 and whole["max_output_tokens"] == 7


def test_a_conversation_of_items_is_the_prompt_of_the_same_chat():
    """instructions, a developer message, input_text parts, an earlier turn's reasoning, text and call,
    and the call's output: the model gets the prompt the chat route makes of the same messages."""
    app = _scripted("It is sunny.")
    items = [
        {"role": "developer", "content": "Be brief."},
        {
            "type": "message",
            "role": "user",
            "content": [
                {"type": "input_text", "text": "Weather in "},
                {"type": "input_text", "text": "Paris?"},
            ],
        },
        {
            "type": "reasoning",
            "id": "rs_1",
            "summary": [],
            "content": [{"type": "reasoning_text", "text": "Look it up."}],
        },
        {
            "type": "message",
            "role": "assistant",
            "content": [{"type": "output_text", "text": "Let me look."}],
        },
        {
            "type": "function_call",
            "call_id": "call_1",
            "name": "get_weather",
            "arguments": '{"city": "Paris"}',
        },
        {"type": "function_call_output", "call_id": "call_1", "output": "sunny, 21 C"},
    ]
    r = app.run(
        app.openai.responses.create(
            model="scripted", instructions="You are a bot.", input=items, tools=FLAT_TOOLS
        )
    )
    assert r.output_text == "It is sunny." and r.instructions == "You are a bot."
    messages = [
        {"role": "system", "content": "You are a bot."},
        {"role": "developer", "content": "Be brief."},
        {"role": "user", "content": "Weather in Paris?"},
        {
            "role": "assistant",
            "content": "Let me look.",
            "reasoning_content": "Look it up.",
            "tool_calls": [
                {
                    "id": "call_1",
                    "type": "function",
                    "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'},
                }
            ],
        },
        {"role": "tool", "tool_call_id": "call_1", "content": "sunny, 21 C"},
    ]
    app.run(app.openai.chat.completions.create(model="scripted", messages=messages, tools=TOOLS))
    assert app.client.prompts[0] == app.client.prompts[1]
    assert r.usage.input_tokens == len(app.client.prompts[0])


def test_greedy_output_equals_the_chat_routes(tiny):
    kwargs = dict(model=tiny.name, temperature=0, max_output_tokens=12)
    whole, events = _both(tiny, input="Hello there", instructions="Answer.", **kwargs)
    chat = tiny.run(
        tiny.openai.chat.completions.create(
            model=tiny.name,
            temperature=0,
            max_completion_tokens=12,
            messages=[{"role": "system", "content": "Answer."}, {"role": "user", "content": "Hello there"}],
        )
    )
    [message] = whole["output"]
    assert message["content"][0]["text"] == chat.choices[0].message.content
    assert whole["status"] == ("incomplete" if chat.choices[0].finish_reason == "length" else "completed")
    assert whole["usage"]["input_tokens"] == chat.usage.prompt_tokens
    assert whole["usage"]["output_tokens"] == chat.usage.completion_tokens
    assert whole["temperature"] == 0 and whole["text"] == {"format": {"type": "text"}}
    assert _without_ids(_replayed(events)) == _without_ids(whole["output"])


def test_text_format_and_a_forced_call_go_through_the_grammar(tiny):
    fmt = {"type": "json_schema", "name": "weather", "schema": WEATHER, "strict": True}
    r = tiny.run(
        tiny.openai.responses.create(
            model=tiny.name, input="Weather?", temperature=0, max_output_tokens=200, text={"format": fmt}
        )
    )
    assert r.status == "completed", r.output_text
    jsonschema.validate(json.loads(r.output_text), WEATHER)
    assert r.text.format.type == "json_schema"
    forced = dict(
        model=tiny.name, input="Weather?", temperature=0, max_output_tokens=64, tools=FLAT_TOOLS,
        tool_choice={"type": "function", "name": "get_weather"},
    )  # fmt: skip
    whole, events = _both(tiny, **forced)
    [call] = whole["output"]
    assert call["type"] == "function_call" and call["name"] == "get_weather"
    jsonschema.validate(json.loads(call["arguments"]), WEATHER)
    assert _without_ids(_replayed(events)) == _without_ids(whole["output"])


LOGPROBS = ["message.output_text.logprobs"]


def _streamed_logprobs(events: list[dict]) -> tuple[list, list]:
    """(the message's output_text.delta logprobs joined, its output_text.done logprobs)."""
    deltas = [e for e in events if e["type"] == "response.output_text.delta"]
    [done] = [e for e in events if e["type"] == "response.output_text.done"]
    return [lp for e in deltas for lp in e["logprobs"]], done["logprobs"]


def test_message_logprobs_equal_the_chat_routes(tiny):
    """include's message.output_text.logprobs: the message text carries each token's logprob and its
    top_logprobs alternatives, equal to the chat route's for the same greedy request, in the whole
    answer and in the stream's delta and done events alike; without the include, none."""
    kwargs = dict(model=tiny.name, input="Hello there", temperature=0, max_output_tokens=12)
    whole, events = _both(tiny, include=LOGPROBS, top_logprobs=3, **kwargs)
    chat = tiny.run(
        tiny.openai.chat.completions.create(
            model=tiny.name,
            messages=[{"role": "user", "content": "Hello there"}],
            temperature=0,
            max_completion_tokens=12,
            logprobs=True,
            top_logprobs=3,
        )
    )
    expected = [e.model_dump() for e in chat.choices[0].logprobs.content]
    [message] = whole["output"]
    part = message["content"][0]
    assert part["text"] == chat.choices[0].message.content and len(expected) == 12
    assert part["logprobs"] == expected and whole["top_logprobs"] == 3
    assert all(len(e["top_logprobs"]) == 3 for e in expected)
    joined, done = _streamed_logprobs(events)
    assert joined == expected and done == expected
    assert events[-1]["response"]["output"][0]["content"][0]["logprobs"] == expected
    # top_logprobs alone adds nothing (OpenAI's and vLLM's rule); include alone: no alternatives
    plain = tiny.run(tiny.openai.responses.create(top_logprobs=3, **kwargs)).model_dump()
    assert plain["output"][0]["content"][0]["logprobs"] == []
    bare = tiny.run(tiny.openai.responses.create(include=LOGPROBS, **kwargs)).model_dump()
    entries = bare["output"][0]["content"][0]["logprobs"]
    assert [(e["token"], e["logprob"]) for e in entries] == [(e["token"], e["logprob"]) for e in expected]
    assert all(e["top_logprobs"] == [] for e in entries)


def test_message_logprobs_leave_out_the_thinking_and_the_calls():
    """With a reasoning parser and tools, the message item's logprobs are the run of tokens around its
    text: none of the thinking's tokens, none of the calls' after the text's tail. The scripted model's
    token i has logprob -(i + 1) / 64, so an entry says which token it is."""
    app = _scripted(THINK_AND_CALL)
    whole, events = _both(
        app, model="scripted", input="Weather in Paris?", tools=FLAT_TOOLS, include=LOGPROBS, top_logprobs=1
    )
    output = whole["output"]
    assert [o["type"] for o in output] == ["reasoning", "message", "function_call", "function_call"]
    part = output[1]["content"][0]
    positions = [round(-e["logprob"] * 64) - 1 for e in part["logprobs"]]
    assert positions == list(range(positions[0], positions[-1] + 1))  # one run of tokens, in order
    script = THINK_AND_CALL.encode()
    thinking_end = script.index(b"</think>")  # the thinking's tokens are before it
    text_at = script.index(part["text"].encode())
    assert thinking_end <= positions[0] and positions[-1] < script.index(b"<tool_call>") + 3  # (3 a delta)
    assert set(range(text_at, text_at + len(part["text"]))) <= set(positions)  # the text's own tokens
    assert bytes(b for e in part["logprobs"] for b in e["bytes"]) == script[positions[0] : positions[-1] + 1]
    assert all(len(e["top_logprobs"]) == 1 for e in part["logprobs"])
    joined, done = _streamed_logprobs(events)
    assert joined == part["logprobs"] and done == part["logprobs"]


@pytest.mark.parametrize(
    ("extra", "param"),
    [
        ({"previous_response_id": "resp_1"}, "previous_response_id"),
        ({"background": True}, "background"),
        (
            {"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "x"}]}]},
            "input[0].content[0].type",
        ),
        ({"input": [{"type": "item_reference", "id": "msg_1"}]}, "input[0].type"),
        ({"input": [{"type": "function_call", "name": "f", "arguments": "{}"}]}, "input[0].call_id"),
        ({"input": [{"role": "tool", "content": "x"}]}, "input[0].role"),
        ({"input": []}, "input"),
        ({"tools": [{"type": "web_search"}]}, "tools[0].type"),
        ({"tools": FLAT_TOOLS, "tool_choice": {"type": "function", "name": "nope"}}, "tool_choice.name"),
        ({"tool_choice": "sometimes"}, "tool_choice"),
        ({"max_output_tokens": 10**6}, "max_output_tokens"),
        ({"text": {"format": {"type": "json_schema", "name": "x"}}}, "text.format"),
        ({"include": ["file_search_call.results"]}, "include"),
        ({"truncation": "auto"}, "truncation"),
        ({"top_logprobs": 21}, "top_logprobs"),
        ({"model": "other"}, "model"),
    ],
    ids=lambda x: x if isinstance(x, str) else None,
)
def test_what_raystate_cannot_do_is_a_400_naming_the_field(extra, param):
    app = _scripted("ok")
    r = app.run(app.http.post("/v1/responses", json={"model": "scripted", "input": "Hi"} | extra))
    assert r.status_code in (400, 404) and r.json()["error"]["param"].startswith(param), r.text
    ok = app.run(app.http.post("/v1/responses", json={"model": "scripted", "input": "Hi", "store": True}))
    assert ok.status_code == 200 and ok.json()["output"][0]["content"][0]["text"] == "ok"


def test_the_sdks_stream_helper_builds_the_same_response():
    """openai's `responses.stream` accumulates the events itself (and checks their order as it goes): its
    final response is the whole one."""
    app = _scripted(THINK_AND_CALL)
    kwargs = dict(model="scripted", input="Weather in Paris?", tools=FLAT_TOOLS)

    async def go():
        async with app.openai.responses.stream(**kwargs) as stream:
            async for _ in stream:
                pass
            return await stream.get_final_response()

    final = app.run(go()).model_dump(exclude_none=True)
    whole = app.run(app.openai.responses.create(**kwargs)).model_dump(exclude_none=True)
    assert [o["type"] for o in final["output"]] == ["reasoning", "message", "function_call", "function_call"]
    assert _without_ids(final["output"]) == _without_ids(whole["output"])
