"""Tool calling on /v1/chat/completions, through the official `openai` client over the ASGI app (no Ray).

Forced calls (tool_choice "required" or a named function) run the real tiny model with the grammar
holding its output to the call's JSON: the arguments always satisfy the function's schema. Calls the
model writes on its own (tool_choice "auto") are read by the server's tool_call_parser; a random model
writes none, so a scripted client plays a model that writes Hermes `<tool_call>` blocks. Streams are
checked against the whole response of the same request.
"""

from __future__ import annotations

import asyncio
import json
from types import SimpleNamespace

import httpx
import jsonschema
import openai
import pytest
from asgi_app import reference_app

from raystate.client import Client
from raystate.config import EOS_ID
from raystate.messages import RequestUpdate, pack_logprobs
from raystate.serve.ingress import create_api
from raystate.serve.server import RaystateServer

WEATHER = {
    "type": "object",
    "properties": {
        "city": {"type": "string", "maxLength": 12},
        "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]},
    },
    "required": ["city", "unit"],
    "additionalProperties": False,
}
TIME = {
    "type": "object",
    "properties": {"zone": {"type": "string", "enum": ["UTC", "CET"]}},
    "required": ["zone"],
    "additionalProperties": False,
}
TOOLS = [
    {
        "type": "function",
        "function": {"name": "get_weather", "description": "Weather", "parameters": WEATHER},
    },
    {"type": "function", "function": {"name": "get_time", "parameters": TIME}},
]
SCHEMAS = {"get_weather": WEATHER, "get_time": TIME}
ASK = [{"role": "user", "content": "Weather in Paris?"}]


# -- the real model, calls forced through the grammar ---------------------------------------------------


@pytest.fixture(scope="module")
def tiny():
    with reference_app("tiny", max_model_len=2048) as app:
        yield app


def _stream_result(app, **kwargs) -> tuple[str | None, list[dict], str]:
    """A streamed chat put back together: (content, calls [{id, name, arguments}], finish_reason)."""

    async def go():
        stream = await app.openai.chat.completions.create(stream=True, **kwargs)
        content, calls, reason = None, {}, None
        async for chunk in stream:
            for choice in chunk.choices:
                delta = choice.delta
                if delta.content:
                    content = (content or "") + delta.content
                for d in delta.tool_calls or ():
                    call = calls.setdefault(d.index, {"id": None, "name": None, "arguments": ""})
                    if d.id is not None:
                        assert call["id"] is None, "a call's id comes once, on its first piece"
                        call["id"], call["name"] = d.id, d.function.name
                    call["arguments"] += d.function.arguments or ""
                reason = choice.finish_reason or reason
        return content, [calls[i] for i in sorted(calls)], reason

    return app.run(go())


def _calls(message) -> list[dict]:
    return [
        {"id": c.id, "name": c.function.name, "arguments": c.function.arguments}
        for c in message.tool_calls or ()
    ]


def test_a_named_function_is_called_with_arguments_its_schema_accepts(tiny):
    kwargs = dict(
        model=tiny.name, messages=ASK, tools=TOOLS, max_tokens=64, temperature=0,
        tool_choice={"type": "function", "function": {"name": "get_weather"}},
    )  # fmt: skip
    r = tiny.run(tiny.openai.chat.completions.create(**kwargs))
    choice = r.choices[0]
    assert choice.finish_reason == "stop"  # as OpenAI answers a forced function
    assert choice.message.content is None
    [call] = choice.message.tool_calls
    assert call.type == "function" and call.function.name == "get_weather"
    assert call.id.startswith("call_")
    jsonschema.validate(json.loads(call.function.arguments), WEATHER)
    content, calls, reason = _stream_result(tiny, **kwargs)
    assert content is None and reason == "stop"
    assert [(c["name"], c["arguments"]) for c in calls] == [("get_weather", call.function.arguments)]


@pytest.mark.parametrize("parallel", [True, False])
def test_required_calls_are_each_a_listed_function_with_valid_arguments(tiny, parallel):
    kwargs = dict(
        model=tiny.name, messages=ASK, tools=TOOLS, max_tokens=160, temperature=0,
        tool_choice="required", parallel_tool_calls=parallel, seed=3,
    )  # fmt: skip
    r = tiny.run(tiny.openai.chat.completions.create(**kwargs))
    choice = r.choices[0]
    calls = _calls(choice.message)
    if choice.finish_reason == "length":  # cut inside the array: the complete calls so far
        assert all(c["name"] in SCHEMAS for c in calls)
    else:
        assert choice.finish_reason == "tool_calls"
        assert len(calls) >= 1 and (parallel or len(calls) == 1)
        assert choice.message.content is None
    for c in calls:
        jsonschema.validate(json.loads(c["arguments"]), SCHEMAS[c["name"]])
    assert len({c["id"] for c in calls}) == len(calls)
    content, streamed, reason = _stream_result(tiny, **kwargs)
    assert reason == choice.finish_reason and content is None
    assert [(c["name"], c["arguments"]) for c in streamed] == [(c["name"], c["arguments"]) for c in calls]


def test_a_forced_call_cut_short_has_null_content_and_no_call(tiny):
    kwargs = dict(model=tiny.name, messages=ASK, tools=TOOLS, max_tokens=4, temperature=0)
    for choice in ("required", {"type": "function", "function": {"name": "get_time"}}):
        r = tiny.run(tiny.openai.chat.completions.create(**kwargs, tool_choice=choice))
        message = r.choices[0].message
        assert r.choices[0].finish_reason == "length" and message.content is None
        # a named call is streamed as it comes: its (cut) arguments are there; "required" has none whole
        assert (message.tool_calls is None) == (choice == "required")


def test_a_conversation_with_earlier_calls_and_their_results_is_taken(tiny):
    messages = [
        *ASK,
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [
                {
                    "id": "call_1",
                    "type": "function",
                    "function": {"name": "get_weather", "arguments": '{"city": "Paris", "unit": "celsius"}'},
                },
            ],
        },  # fmt: skip
        {"role": "tool", "tool_call_id": "call_1", "content": "18 degrees"},
    ]
    r = tiny.run(
        tiny.openai.chat.completions.create(
            model=tiny.name, messages=messages, tools=TOOLS, max_tokens=4, temperature=0, tool_choice="none"
        )
    )
    assert r.choices[0].message.tool_calls is None
    assert isinstance(r.choices[0].message.content, str)
    # The byte model's template writes the earlier call and the tool's answer into the prompt.
    body = {"model": tiny.name, "messages": messages}
    ids = tiny.post("/tokenize", body).json()["tokens"]
    text = bytes(i for i in ids if i < 256).decode()
    assert '{"name": "get_weather", "arguments": {"city": "Paris", "unit": "celsius"}}' in text
    assert "<|tool|>\n18 degrees" in text


def test_tool_choice_none_leaves_the_tools_out_of_the_prompt(tiny):
    def prompt(extra: dict) -> str:
        r = tiny.post("/v1/chat/completions", {"model": tiny.name, "messages": ASK, "max_tokens": 1} | extra)
        assert r.status_code == 200, r.text
        return r.json()["usage"]["prompt_tokens"]

    plain = prompt({})
    assert prompt({"tools": TOOLS, "tool_choice": "none"}) == plain
    named = {"type": "function", "function": {"name": "get_time"}}
    assert prompt({"tools": TOOLS, "tool_choice": named}) > plain + len(json.dumps(TOOLS)) // 2


@pytest.mark.parametrize(
    ("change", "field"),
    [
        ({"tools": TOOLS, "tool_choice": "auto"}, "tool_choice"),  # the byte model writes no call format
        ({"tools": TOOLS}, "tool_choice"),  # absent with tools: "auto"
        ({"tool_choice": "required"}, "tool_choice"),
        ({"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "nope"}}},
         "tool_choice.function.name"),
        ({"tools": TOOLS, "tool_choice": "sometimes"}, "tool_choice"),
        ({"tools": TOOLS, "tool_choice": {"type": "function"}}, "tool_choice"),
        ({"tools": [{"type": "function", "function": {"name": "bad name!"}}], "tool_choice": "required"},
         "tools[0].function.name"),
        ({"tools": [{"type": "retrieval"}], "tool_choice": "required"}, "tools[0].type"),
        ({"tools": TOOLS + TOOLS[:1], "tool_choice": "required"}, "tools"),
        ({"tools": TOOLS, "tool_choice": "required", "response_format": {"type": "json_object"}},
         "response_format"),
        ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "nonsense"}}}],
          "tool_choice": "required"}, "tools"),
    ],
)  # fmt: skip
def test_bad_tool_requests_are_400s_naming_the_field(tiny, change, field):
    assert tiny.refused_param("/v1/chat/completions", change) == field


# -- calls the model writes itself, read by the Hermes parser --------------------------------------------

HERMES_OUTPUT = (
    "Let me look.\n<tool_call>\n"
    '{"name": "get_weather", "arguments": {"city": "Paris", "unit": "celsius"}}\n</tool_call>\n'
    '<tool_call>\n{"name": "get_time", "arguments": {"zone": "CET"}}\n</tool_call>'
)


class ScriptedClient(Client):
    """A model that writes `script` (byte tokens, `step` a update) and stops on EOS, as the engine does
    (its last id is the EOS, whose text the output leaves out); remembers the prompts. Asked for
    logprobs, token i of the output has logprob -(i + 1) / 64 and its alternatives the
    byte ids after it."""

    def __init__(self, script: str, step: int = 3) -> None:
        self.script = [*script.encode(), EOS_ID]
        self.step = step
        self.prompts: list[list[int]] = []
        self._config = SimpleNamespace(
            model=SimpleNamespace(name="scripted", vocab_size=259), max_model_len=4096, num_blocks=64
        )

    @property
    def config(self):
        return self._config

    async def generate(self, prompt_token_ids, sampling, request_id=None):
        self.prompts.append(list(prompt_token_ids))
        out = self.script[: sampling.max_tokens]
        for i in range(0, len(out), self.step):
            await asyncio.sleep(0)
            last = i + self.step >= len(out)
            reason = ("stop" if len(out) == len(self.script) else "length") if last else None
            ids = out[i : i + self.step]
            records = b""
            if sampling.logprobs is not None:
                rows = [[t, *((t + a) % 256 for a in range(1, 1 + sampling.logprobs))] for t in ids]
                lps = [[-(i + j + 1) / 64 - a for a in range(1 + sampling.logprobs)] for j in range(len(ids))]
                records = pack_logprobs(rows, lps, [1] * len(ids))
            yield RequestUpdate(request_id, ids, last, reason, 0, 0, logprobs=records)

    async def generate_group(self, requests):
        return [self.generate(r.prompt_token_ids, r.sampling, r.req_id) for r in requests]

    async def abort(self, request_id: str) -> None:
        return None

    async def health(self) -> bool:
        return True

    async def check_alive(self) -> None:
        return None

    async def status(self) -> dict:
        return {}

    async def shutdown(self) -> None:
        return None


def _scripted(script: str, step: int = 3, parser: str | None = "hermes"):
    client = ScriptedClient(script, step)
    server = RaystateServer(client, "scripted", tool_call_parser=parser)
    transport = httpx.ASGITransport(app=create_api(server), raise_app_exceptions=False)
    http = httpx.AsyncClient(transport=transport, base_url="http://local", timeout=30)
    app = SimpleNamespace(
        name="scripted",
        client=client,
        http=http,
        openai=openai.AsyncOpenAI(base_url="http://local/v1", api_key="x", max_retries=0, http_client=http),
        run=_LOOP.run_until_complete,
    )
    return app


_LOOP = asyncio.new_event_loop()


@pytest.mark.parametrize("step", [1, 3, 1000])
def test_hermes_calls_written_by_the_model_become_tool_calls(step):
    app = _scripted(HERMES_OUTPUT, step)
    kwargs = dict(model="scripted", messages=ASK, tools=TOOLS, max_tokens=1000)
    r = app.run(app.openai.chat.completions.create(**kwargs))
    choice = r.choices[0]
    assert choice.finish_reason == "tool_calls"
    assert choice.message.content == "Let me look.\n"
    calls = _calls(choice.message)
    assert [(c["name"], json.loads(c["arguments"])) for c in calls] == [
        ("get_weather", {"city": "Paris", "unit": "celsius"}),
        ("get_time", {"zone": "CET"}),
    ]
    content, streamed, reason = _stream_result(app, **kwargs)
    assert (content, reason) == ("Let me look.\n", "tool_calls")
    assert [(c["name"], c["arguments"]) for c in streamed] == [(c["name"], c["arguments"]) for c in calls]
    # The tools reached the prompt (the byte template lists them first).
    assert b'"name": "get_weather"' in bytes(i for i in app.client.prompts[0] if i < 256)


def test_text_that_only_looks_like_a_call_stays_content():
    script = "a < b and <tool_call>not json</tool_call> end"
    app = _scripted(script, 2)
    kwargs = dict(model="scripted", messages=ASK, tools=TOOLS, max_tokens=1000)
    r = app.run(app.openai.chat.completions.create(**kwargs))
    assert r.choices[0].message.content == script and r.choices[0].message.tool_calls is None
    assert r.choices[0].finish_reason == "stop"
    content, streamed, reason = _stream_result(app, **kwargs)
    assert (content, streamed, reason) == (script, [], "stop")


def test_a_call_cut_by_max_tokens_is_content_and_the_reason_is_length():
    app = _scripted(HERMES_OUTPUT, 4)
    cut = HERMES_OUTPUT.index("get_weather") + 4
    r = app.run(
        app.openai.chat.completions.create(model="scripted", messages=ASK, tools=TOOLS, max_tokens=cut)
    )
    assert r.choices[0].finish_reason == "length"
    assert r.choices[0].message.tool_calls is None
    assert r.choices[0].message.content == HERMES_OUTPUT[:cut]


def test_without_a_parser_auto_is_refused_and_forced_calls_still_work():
    app = _scripted(HERMES_OUTPUT, parser=None)
    body = {"model": "scripted", "messages": ASK, "tools": TOOLS, "max_tokens": 100}
    r = app.run(app.http.post("/v1/chat/completions", json=body))
    assert r.status_code == 400 and r.json()["error"]["param"] == "tool_choice"
    assert "--tool-call-parser" in r.json()["error"]["message"]
    app = _scripted('{"zone": "UTC"}', parser=None)  # what the grammar would let through
    named = {"type": "function", "function": {"name": "get_time"}}
    r = app.run(app.openai.chat.completions.create(**(body | {"tool_choice": named})))
    assert _calls(r.choices[0].message)[0]["arguments"] == '{"zone": "UTC"}'


def test_llama3_json_calls_written_by_the_model_become_tool_calls():
    call = '{{"name": "get_time", "parameters": {{"zone": "{}"}}}}'
    script = f"{call.format('UTC')}; {call.format('CET')}"
    app = _scripted(script, 5, parser="llama3_json")
    kwargs = dict(model="scripted", messages=ASK, tools=TOOLS, max_tokens=1000)
    r = app.run(app.openai.chat.completions.create(**kwargs))
    choice = r.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.content is None
    assert [json.loads(c["arguments"]) for c in _calls(choice.message)] == [{"zone": "UTC"}, {"zone": "CET"}]
    content, streamed, reason = _stream_result(app, **kwargs)
    assert (content, reason) == (None, "tool_calls")
    assert [c["arguments"] for c in streamed] == [c["arguments"] for c in _calls(choice.message)]
