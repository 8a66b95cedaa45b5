"""A fuzzer over the OpenAI routes (completions, chat, responses): thousands of generated bodies, mostly
valid or one step from valid.

Hypothesis builds each body from a valid request (small max_tokens, so that generating is cheap) and
then, for most of them, breaks it: wrong types, integers past 64 bits, NaN and Infinity, lone surrogates,
deep nesting, oversize strings and lists, unknown fields, a body that is not an object or not JSON.
Whatever the body, the answer must never be a 5xx or carry a traceback or a source path; a 4xx must have
OpenAI's error shape, naming the field that was broken; an unbroken body must succeed; and afterwards
the engine must still step (/health) and every KV block must be free again (/status).

Most bodies go to an in-process app (the FastAPI app over `InProcessClient`, through httpx's ASGI transport:
no sockets, no Ray), which is what lets thousands fit the time; a few hundred more go to the real Serve
app on loopback (tests/serve/conftest.py). Runs are deterministic (derandomize) and have no timing
assertions; the examples per run are set below.
"""

from __future__ import annotations

import asyncio
import json
import re
import time
from dataclasses import dataclass, field

import httpx
import pytest
from hypothesis import HealthCheck, Phase, given, settings
from hypothesis import strategies as st

from raystate.serve.protocol import field_path

IN_PROCESS_EXAMPLES = 1500  # per route
SERVE_EXAMPLES = 250  # per route, over Ray Serve on loopback
MAX_TOKENS = 3  # of a valid body: a fuzz run is mostly engine steps

LEAK = re.compile(r'Traceback|File "|\.py\b|site-packages|/raystate/')
ERROR_KEYS = {"message", "type", "param", "code"}
LIMIT_FIELDS = ("max_tokens", "max_completion_tokens", "max_output_tokens")


# -- bodies -----------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Raw:
    """JSON text put into a body as is: literals json.dumps will not write (NaN, 5000-digit integers,
    nesting past the recursion limit)."""

    text: str


@dataclass
class Case:
    """One body to send, and what its answer may be."""

    path: str
    body: object  # a dict with Raw values, or Raw / bytes for a whole body
    broken: set[str] = field(default_factory=set)  # the top-level fields a mutation touched
    whole: bool = False  # the body itself was replaced (no field to name)

    def encode(self) -> bytes:
        if isinstance(self.body, bytes):
            return self.body
        raws: list[str] = []

        def swap(v):
            if isinstance(v, Raw):
                raws.append(v.text)
                return f"__raw_{len(raws) - 1}__"
            if isinstance(v, dict):
                return {k: swap(x) for k, x in v.items()}
            if isinstance(v, list):
                return [swap(x) for x in v]
            return v

        text = json.dumps(swap(self.body))  # ensure_ascii: lone surrogates become \\udxxx escapes
        for i, raw in enumerate(raws):
            text = text.replace(f'"__raw_{i}__"', raw, 1)
        return text.encode()

    def allowed_params(self) -> set[str]:
        """Fields a 400 may name: the broken ones, and those whose check a broken one can trip (a longer
        prompt leaves less room for max_tokens; chat compares max_tokens with max_completion_tokens; best_of
        must equal n; more prompts or choices leave fewer of the other within the per-request cap)."""
        names = set(self.broken)
        if names & {"prompt", "messages", "input", "instructions", *LIMIT_FIELDS}:
            names |= set(LIMIT_FIELDS)
        if "instructions" in names:  # the prompt is the instructions and the input: too long names input
            names.add("input")
        if names & {"n", "best_of", "prompt"}:
            names |= {"n", "best_of"}
        return {field_path((n,)) for n in names}


def _deep(depth: int, kind: str) -> Raw:
    if kind == "list":
        return Raw("[" * depth + "]" * depth)
    return Raw('{"k": ' * depth + "0" + "}" * depth)


SURROGATES = ["\ud800", "a\udfffb", "\udc00\udc00", "ok \ud83d", "\udbff"]
HUGE_INTS = [2**31, 2**32 + 1, 2**53 + 1, 2**63 - 1, 2**63, -(2**63) - 1, 2**64, 10**30, -(10**30)]
RAW_NUMBERS = ["NaN", "Infinity", "-Infinity", "1e999", "-1e999", "9" * 5000, "-" + "8" * 400]

scalars = st.one_of(
    st.sampled_from([None, True, False, "", "x", "many", "7", "1e3", 0, -1, 1.5, -0.0, 0.5, 3.0]),
    st.integers(),
    st.floats(allow_nan=False, allow_infinity=False),
    st.text(max_size=8),
)
hostile = st.one_of(
    scalars,
    st.sampled_from(HUGE_INTS),
    st.sampled_from(SURROGATES),
    st.sampled_from(RAW_NUMBERS).map(Raw),
    st.builds(_deep, st.sampled_from([33, 40, 200, 1500, 20_000]), st.sampled_from(["list", "dict"])),
    st.sampled_from([300, 5000]).map(lambda n: "y" * n),
    st.sampled_from([20, 300, 3000]).flatmap(
        lambda n: st.sampled_from([[1] * n, ["s"] * n, [{"type": "text", "text": "t"}] * n])
    ),
    st.lists(st.one_of(scalars, st.sampled_from(SURROGATES), st.sampled_from(HUGE_INTS)), max_size=4),
    st.dictionaries(st.text(max_size=4), scalars, max_size=3),
    st.sampled_from(SURROGATES).map(lambda s: [s]),
    st.sampled_from(SURROGATES).map(lambda s: {"type": s, "text": s}),
)
# A broken max_tokens must not turn into a valid large one: a valid body has to stay cheap to run.
bad_limit = st.sampled_from(
    [0, -1, -(2**31), 2048, 10**6, 2**31, 2**63 - 1, 2**63, 10**30, 1.5, "many", "", [], {}, [2], True, "-3"]
    + [Raw(r) for r in RAW_NUMBERS]
    + [_deep(50, "list"), "\ud800"]
)
unknown_names = st.sampled_from(["max_token", "foo", "", "prompt ", "Temperature", "\ud800", "z" * 100])

text = st.text(max_size=24)
sampling = {
    "model": st.sampled_from(["tiny", "", None]),
    "temperature": st.one_of(st.just(0), st.floats(0, 2)),
    "top_p": st.floats(0, 1, exclude_min=True),
    "top_k": st.integers(-1, 2**31 - 1),
    "seed": st.integers(0, 2**63 - 1),
    "stop": st.one_of(
        st.none(), st.text(min_size=1, max_size=4), st.lists(st.text(min_size=1, max_size=4), max_size=4)
    ),
    "stream": st.booleans(),
    "stream_options": st.fixed_dictionaries({}, optional={"include_usage": st.booleans()}),
    "n": st.just(1),
    "presence_penalty": st.just(0),
    "frequency_penalty": st.just(0.0),
    "logit_bias": st.just({}),
    "user": text,
    "ignore_eos": st.booleans(),
    "stop_token_ids": st.lists(st.integers(0, 258), max_size=4),
    "return_token_ids": st.booleans(),
}
valid_completion = st.fixed_dictionaries(
    {
        "prompt": st.one_of(
            text, st.lists(st.integers(0, 258), min_size=1, max_size=24), text.map(lambda s: [s])
        ),
        "max_tokens": st.integers(1, MAX_TOKENS),
    },
    optional={
        **sampling,
        "echo": st.just(False),
        "best_of": st.just(1),
        "suffix": st.just(""),
        "logprobs": st.just(0),
    },
)
content = st.one_of(
    text, st.lists(st.fixed_dictionaries({"type": st.just("text"), "text": text}), max_size=3)
)
message = st.fixed_dictionaries(
    {"role": st.sampled_from(["system", "user", "assistant", "tool"]), "content": content},
    optional={"name": st.text(max_size=8)},
)
chat_limit = st.integers(1, MAX_TOKENS).flatmap(
    lambda n: st.sampled_from(
        [{"max_tokens": n}, {"max_completion_tokens": n}, {"max_tokens": n, "max_completion_tokens": n}]
    )
)
valid_chat = st.tuples(
    st.fixed_dictionaries(
        {"messages": st.lists(message, min_size=1, max_size=4)},
        optional={
            **sampling,
            "logprobs": st.just(False),
            "top_logprobs": st.just(0),
            "tools": st.just([]),
            "tool_choice": st.sampled_from(["none", "auto"]),
            "response_format": st.just({"type": "text"}),
        },
    ),
    chat_limit,
).map(lambda t: {**t[0], **t[1]})

input_item = st.one_of(
    message.filter(lambda m: m["role"] != "tool"),
    st.fixed_dictionaries(
        {
            "type": st.just("message"),
            "role": st.sampled_from(["user", "developer", "assistant"]),
            "content": st.lists(
                st.fixed_dictionaries({"type": st.sampled_from(["input_text", "output_text"]), "text": text}),
                max_size=3,
            ),
        }
    ),
    st.fixed_dictionaries(
        {
            "type": st.just("function_call"),
            "call_id": st.just("call_1"),
            "name": st.just("f"),
            "arguments": text,
        }
    ),
    st.fixed_dictionaries(
        {"type": st.just("function_call_output"), "call_id": st.just("call_1"), "output": text}
    ),
)
valid_responses = st.fixed_dictionaries(
    {
        "input": st.one_of(text, st.lists(input_item, min_size=1, max_size=4)),
        "max_output_tokens": st.integers(1, MAX_TOKENS),
    },
    optional={
        "model": st.sampled_from(["tiny", None]),
        "instructions": st.one_of(st.none(), text),
        "temperature": st.one_of(st.just(0), st.floats(0, 2)),
        "top_p": st.floats(0, 1, exclude_min=True),
        "stream": st.booleans(),
        "user": text,
        "metadata": st.dictionaries(st.text(max_size=4), text, max_size=3),
        "store": st.booleans(),
        "parallel_tool_calls": st.booleans(),
        "tools": st.just([]),
        "tool_choice": st.sampled_from(["none", "auto"]),
        "text": st.just({"format": {"type": "text"}}),
        "truncation": st.just("disabled"),
        "include": st.sampled_from([[], ["message.output_text.logprobs"]]),
        "top_logprobs": st.integers(0, 20),
        "previous_response_id": st.none(),
    },
)
RESPONSES_FIELDS = ["input", "max_output_tokens", "model", "instructions", "temperature", "top_p", "stream"]
RESPONSES_FIELDS += ["user", "metadata", "store", "tools", "tool_choice", "text", "truncation", "include"]
RESPONSES_FIELDS += ["reasoning", "previous_response_id", "background", "top_logprobs"]

COMPLETION_FIELDS = ["prompt", "max_tokens", *sampling, "echo", "best_of", "suffix", "logprobs"]
CHAT_FIELDS = ["messages", *LIMIT_FIELDS, *sampling, "logprobs", "top_logprobs", "tools", "tool_choice"]
CHAT_FIELDS += ["response_format"]

whole_bodies = st.sampled_from(
    [
        b"",
        b"null",
        b"[]",
        b'"prompt"',
        b"42",
        b"NaN",
        b"{",
        b'{"prompt": "a",}',
        b"\xff\xfe\x00{",
        b'{"prompt": "\xed\xa0\x80"}',
        ("[" * 5000 + "]" * 5000).encode(),
        b'{"a": ' * 2000 + b"1" + b"}" * 2000,
    ]
)


@st.composite
def broken(draw, base: st.SearchStrategy, route_fields: list[str], path: str) -> Case:
    body = dict(draw(base))
    case = Case(path, body)
    chat = path.endswith(("chat/completions", "responses"))
    listed = "input" if path.endswith("responses") else "messages"
    for _ in range(draw(st.integers(1, 3))):
        how = draw(st.sampled_from(["set", "set", "set", "unknown", "delete", "message", "whole"]))
        if how == "whole":
            return Case(path, draw(whole_bodies), whole=True)
        if how == "unknown":
            key = draw(unknown_names)
            body[key] = draw(hostile)
        elif how == "delete":
            keep = set(LIMIT_FIELDS) if chat else set()  # without one, chat generates to max_model_len
            keys = sorted(k for k in body if k not in keep)
            if not keys:
                continue
            key = draw(st.sampled_from(keys))
            del body[key]
        elif how == "message" and chat and isinstance(body.get(listed), list) and body[listed]:
            key = listed
            msgs = [dict(m) if isinstance(m, dict) else m for m in body[listed]]
            i = draw(st.integers(0, len(msgs) - 1))
            if isinstance(msgs[i], dict):
                parts = ["role", "content", "name", "tool_calls", "type", "call_id", "arguments", "output"]
                msgs[i][draw(st.sampled_from(parts))] = draw(hostile)
            else:
                msgs[i] = draw(hostile)
            body[listed] = msgs
        else:
            key = draw(st.sampled_from(route_fields))
            body[key] = draw(bad_limit if key in LIMIT_FIELDS else hostile)
        case.broken.add(key)
    return case


def cases(path: str) -> st.SearchStrategy[Case]:
    if path.endswith("responses"):
        base, fields = valid_responses, RESPONSES_FIELDS
    elif path.endswith("chat/completions"):
        base, fields = valid_chat, CHAT_FIELDS
    else:
        base, fields = valid_completion, COMPLETION_FIELDS
    return st.one_of(
        base.map(lambda b: Case(path, b)),  # about a quarter valid
        broken(base, fields, path),
        broken(base, fields, path),
        broken(base, fields, path),
    )


# -- checks -----------------------------------------------------------------------------------------------


def check(case: Case, status: int, headers: httpx.Headers, text: str, stats: dict) -> None:
    stats[status] = stats.get(status, 0) + 1
    desc = f"{case.path} {case.encode()[:300]!r} -> {status} {text[:400]}"
    assert status < 500, desc
    assert "Traceback" not in text, desc
    if status >= 400:
        assert not LEAK.search(text), desc
        err = json.loads(text)["error"]
        assert set(err) == ERROR_KEYS, desc
        assert isinstance(err["message"], str) and err["message"], desc
        if status != 400:
            return
        if case.whole:
            return
        assert case.broken, f"a valid body was refused: {desc}"
        param = err["param"]
        assert param is not None, f"no param: {desc}"
        allowed = case.allowed_params()
        assert any(param == a or param.startswith((f"{a}.", f"{a}[")) for a in allowed), (allowed, desc)
        return
    assert status == 200, desc
    assert not case.whole, desc
    if case.path.endswith("responses"):
        _check_response(headers, text, desc)
        return
    if headers.get("content-type", "").startswith("text/event-stream"):
        events = [line[6:] for line in text.split("\n") if line.startswith("data: ")]
        assert events and events[-1] == "[DONE]", desc
        for e in events[:-1]:
            chunk = json.loads(e)
            assert "error" not in chunk, desc
    else:
        out = json.loads(text)
        # at most MAX_TOKENS per choice, or completions' default of 16 where a mutation removed max_tokens
        n = len(out["choices"])
        assert n and out["usage"]["completion_tokens"] <= 16 * n, desc


def fuzz_settings(n: int) -> settings:
    return settings(
        max_examples=n,
        deadline=None,
        derandomize=True,
        database=None,
        phases=(Phase.explicit, Phase.generate, Phase.shrink),
        suppress_health_check=list(HealthCheck),
    )


def assert_idle(status: dict, timeout_s: float, get_status) -> dict:
    """Polls until nothing runs or waits and every KV block of every group and shard is free again."""
    deadline = time.monotonic() + timeout_s
    while True:
        free = [g for shard in status["num_free_blocks"] for g in shard]
        busy = sum(status["num_running"]) + sum(status["num_waiting"])
        if busy == 0 and all(f == status["num_blocks"] for f in free):
            return status
        assert time.monotonic() < deadline, f"not idle after the fuzz run: {status}"
        time.sleep(0.05)
        status = get_status()


# -- in process -------------------------------------------------------------------------------------------


class InProcessApp:
    """The FastAPI app over an InProcessClient, driven from one event loop of its own."""

    def __init__(self) -> None:
        from raystate.client import InProcessClient
        from raystate.serve.app import AppArgs
        from raystate.serve.ingress import create_api
        from raystate.serve.server import RaystateServer

        self.loop = asyncio.new_event_loop()
        self.client = InProcessClient(AppArgs(model="tiny", backend="inprocess").engine_config())
        self.server = RaystateServer(self.client)
        transport = httpx.ASGITransport(app=create_api(self.server), raise_app_exceptions=False)
        self.http = httpx.AsyncClient(transport=transport, base_url="http://fuzz", timeout=60)

    def post(self, path: str, body: bytes) -> httpx.Response:
        headers = {"Content-Type": "application/json"}
        return self.loop.run_until_complete(self.http.post(path, content=body, headers=headers))

    def get(self, path: str) -> httpx.Response:
        return self.loop.run_until_complete(self.http.get(path))

    def close(self) -> None:
        self.loop.run_until_complete(self.http.aclose())
        self.loop.run_until_complete(self.server.shutdown())
        self.loop.close()


@pytest.fixture(scope="module")
def in_process():
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("RAYSTATE_KERNELS", "reference")  # read at every launch, by the engine's own thread
        mp.setattr("raystate.kernels._common._reference_forced", True)
        app = InProcessApp()
        try:
            yield app
        finally:
            app.close()


def _check_response(headers: httpx.Headers, text: str, desc: str) -> None:
    """A Responses answer that succeeded: a completed or incomplete response of at most MAX_TOKENS
    output tokens, whole or as numbered events ending with it."""
    if headers.get("content-type", "").startswith("text/event-stream"):
        events = [json.loads(line[6:]) for line in text.split("\n") if line.startswith("data: ")]
        assert [e["sequence_number"] for e in events] == list(range(len(events))), desc
        assert events[0]["type"] == "response.created", desc
        assert events[-1]["type"] in ("response.completed", "response.incomplete"), desc
        out = events[-1]["response"]
    else:
        out = json.loads(text)
    assert out["status"] in ("completed", "incomplete") and out["output"], desc
    assert out["usage"]["output_tokens"] <= MAX_TOKENS, desc
    entries = [e for o in out["output"] if o["type"] == "message" for e in o["content"][0]["logprobs"]]
    assert len(entries) <= out["usage"]["output_tokens"], desc  # (with include's logprobs, a token each)
    tops = out["top_logprobs"] or 0
    assert all(e["logprob"] <= 1e-5 and len(e["top_logprobs"]) == tops for e in entries), desc


@pytest.mark.slow
@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions", "/v1/responses"])
def test_fuzz_in_process(in_process, path):
    stats: dict[int, int] = {}

    @fuzz_settings(IN_PROCESS_EXAMPLES)
    @given(cases(path))
    def run(case: Case) -> None:
        r = in_process.post(path, case.encode())
        check(case, r.status_code, r.headers, r.text, stats)

    run()
    assert sum(stats.values()) >= IN_PROCESS_EXAMPLES and stats.get(200, 0) > IN_PROCESS_EXAMPLES // 10, stats
    assert in_process.get("/health").status_code == 200
    assert_idle(in_process.get("/status").json(), 30, lambda: in_process.get("/status").json())
    with in_process.client._lock:  # the pools' own bookkeeping agrees (no leaked or doubly freed block)
        in_process.client._engine.scheduler.check_integrity()


# -- over Ray Serve ---------------------------------------------------------------------------------------


@pytest.mark.slow
@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions", "/v1/responses"])
def test_fuzz_over_serve(open_app, path):
    stats: dict[int, int] = {}
    headers = {**open_app.headers(), "Content-Type": "application/json"}
    with httpx.Client(base_url=open_app.url, headers=headers, timeout=60) as http:

        @fuzz_settings(SERVE_EXAMPLES)
        @given(cases(path))
        def run(case: Case) -> None:
            r = http.post(path, content=case.encode())
            check(case, r.status_code, r.headers, r.text, stats)

        run()
    assert sum(stats.values()) >= SERVE_EXAMPLES and stats.get(200, 0) > 0, stats
    assert httpx.get(f"{open_app.url}/health", timeout=60).status_code == 200
    assert_idle(open_app.status(), 30, open_app.status)
