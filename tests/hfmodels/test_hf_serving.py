"""The OpenAI server on Hugging Face checkpoints: the checkpoint's tokenizer, chat template and generation
defaults, end to end.

Most tests drive the real FastAPI app (`create_api` over `RaystateServer` over `InProcessClient`) through
httpx's ASGI transport, with transformers' tokenizer as the oracle for prompt ids and text; the last ones
run one real Serve application on loopback (`serve_port`, so they are `slow`), built from the `model` word
as `serve run` and `raystate serve` build it. The engine runs the kernels' PyTorch references.
"""

from __future__ import annotations

import json
import shutil
import socket
from pathlib import Path

import asgi_app
import httpx
import pytest
import transformers
from hf_families import make_family_checkpoint

from raystate.engine_args import resolve_model
from raystate.serve.protocol import ChatCompletionRequest, CompletionRequest
from raystate.serve.text import load_model_text

SYSTEM_CHAT = [
    {"role": "system", "content": "You are terse."},
    {"role": "user", "content": "Hello world, café naïve 日本語?"},
]
USER_CHAT = [{"role": "user", "content": "The quick brown fox jumps over the lazy dog."}]


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory) -> dict[str, Path]:
    """qwen3 (ChatML, no BOS), llama (Llama 3 template writing its BOS), gemma3 (SentencePiece BOS,
    a template that refuses roles that do not alternate), and two variants of qwen3: without a chat
    template, and with an extra EOS id in generation_config.json only."""
    root = tmp_path_factory.mktemp("hf_serving")
    out = {f: make_family_checkpoint(f, root / f) for f in ("qwen3", "llama", "gemma3")}
    bare = root / "qwen3_no_template"
    shutil.copytree(out["qwen3"], bare)
    (bare / "chat_template.jinja").unlink(missing_ok=True)
    cfg = json.loads((bare / "tokenizer_config.json").read_text())
    cfg.pop("chat_template", None)
    (bare / "tokenizer_config.json").write_text(json.dumps(cfg))
    out["qwen3_no_template"] = bare
    return out


def hf_tokenizer(folder: Path):
    return transformers.AutoTokenizer.from_pretrained(str(folder))


def hf_chat_ids(folder: Path, messages: list[dict]) -> list[int]:
    ids = hf_tokenizer(folder).apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
    if not isinstance(ids, list):  # a BatchEncoding in transformers 5
        ids = ids["input_ids"]
    return list(ids)


class AsgiApp(asgi_app.AsgiApp):
    """One checkpoint's app, served under its folder's path unless named. No prefix cache: with bounded
    replay a repeated prompt's hit may change the output (DESIGN section 4), and these tests compare
    repeated requests."""

    def __init__(self, folder: Path, served_name: str | None = None, **engine) -> None:
        engine.setdefault("enable_prefix_caching", False)
        super().__init__(str(folder), served_name or str(folder), **engine)


def sse_events(text: str) -> list[dict]:
    lines = [ln.removeprefix("data: ") for ln in text.split("\n\n") if ln.startswith("data: ")]
    assert lines[-1] == "[DONE]", lines[-3:]
    return [json.loads(ln) for ln in lines[:-1]]


def streamed_chat_text(events: list[dict]) -> tuple[str, str | None]:
    text, reason = "", None
    for e in events:
        assert "error" not in e, e
        for c in e["choices"]:
            text += c["delta"].get("content") or ""
            reason = c["finish_reason"] or reason
    return text, reason


@pytest.fixture(scope="module")
def qwen3_app(checkpoints):
    app = AsgiApp(checkpoints["qwen3"], served_name="tiny-qwen3")
    yield app
    app.close()


# -- chat template and prompt ids -------------------------------------------------------------------------


@pytest.mark.parametrize("family", ["qwen3", "llama", "gemma3"])
def test_chat_prompt_ids_equal_transformers_apply_chat_template(checkpoints, family):
    folder = checkpoints[family]
    messages = USER_CHAT if family == "gemma3" else SYSTEM_CHAT
    if family == "gemma3":  # its template folds a system message into the first user turn
        messages = [{"role": "system", "content": "Be brief."}, *USER_CHAT]
    expected = hf_chat_ids(folder, messages)
    text = load_model_text(resolve_model(str(folder)))
    rendered, ids = text.chat_prompt(messages)
    assert ids == expected
    tok = hf_tokenizer(folder)
    assert rendered == tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    if tok.bos_token_id is not None and family != "qwen3":
        assert ids.count(tok.bos_token_id) == 1  # the template's own BOS, not a second one from encode


def test_chat_over_http_prompt_is_the_template(qwen3_app, checkpoints):
    expected = hf_chat_ids(checkpoints["qwen3"], SYSTEM_CHAT)
    r = qwen3_app.post(
        "/v1/chat/completions",
        {"model": "tiny-qwen3", "messages": SYSTEM_CHAT, "max_tokens": 4, "temperature": 0},
    )
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["model"] == "tiny-qwen3"
    assert body["usage"]["prompt_tokens"] == len(expected)
    prepared = qwen3_app.server._prepare_chat(ChatCompletionRequest(messages=SYSTEM_CHAT))
    assert prepared.prompt_ids == expected


def test_completion_prompt_encoded_with_special_tokens(checkpoints):
    folder = checkpoints["llama"]  # its post-processor adds <|begin_of_text|>
    app = AsgiApp(folder)
    try:
        tok = hf_tokenizer(folder)
        prompt = "Hello world, this is"
        r = app.post("/v1/completions", {"prompt": prompt, "max_tokens": 3, "temperature": 0})
        assert r.status_code == 200, r.text
        assert r.json()["usage"]["prompt_tokens"] == len(tok(prompt)["input_ids"])
        assert r.json()["model"] == str(folder)  # the served name defaults to the model word
    finally:
        app.close()


# -- text: streamed == whole == transformers' decode; stop strings ---------------------------------------


def test_streamed_text_equals_whole_text_equals_decode(qwen3_app, checkpoints):
    tok = hf_tokenizer(checkpoints["qwen3"])
    body = {
        "messages": USER_CHAT,
        "max_tokens": 40,
        "temperature": 0,
        "ignore_eos": True,
        "return_token_ids": True,
    }
    r = qwen3_app.post("/v1/chat/completions", body)
    assert r.status_code == 200, r.text
    choice = r.json()["choices"][0]
    ids, text = choice["token_ids"], choice["message"]["content"]
    assert len(ids) == 40 and choice["finish_reason"] == "length"
    assert text == tok.decode(ids, skip_special_tokens=True)
    s = qwen3_app.post("/v1/chat/completions", {**body, "stream": True})
    assert s.status_code == 200, s.text
    events = sse_events(s.text)
    streamed, reason = streamed_chat_text(events)
    assert (streamed, reason) == (text, "length")
    assert all(e["model"] == "tiny-qwen3" for e in events)
    streamed_ids = [t for e in events for c in e["choices"] for t in c.get("token_ids") or []]
    assert streamed_ids == ids

    # completions: the same rule, on a prompt string
    c = qwen3_app.post(
        "/v1/completions",
        {
            "prompt": "Café, naïve",
            "max_tokens": 30,
            "temperature": 0,
            "ignore_eos": True,
            "return_token_ids": True,
        },
    ).json()["choices"][0]
    assert c["text"] == tok.decode(c["token_ids"], skip_special_tokens=True)


def test_stop_string_cuts_the_text(qwen3_app):
    body = {"prompt": "The quick brown fox", "max_tokens": 40, "temperature": 0, "ignore_eos": True}
    whole = qwen3_app.post("/v1/completions", body).json()["choices"][0]["text"]
    assert len(whole) >= 8, whole
    stop = whole[len(whole) // 2 : len(whole) // 2 + 2]
    expected = whole[: whole.find(stop)]
    r = qwen3_app.post("/v1/completions", {**body, "stop": [stop]}).json()["choices"][0]
    assert (r["text"], r["finish_reason"]) == (expected, "stop")
    s = qwen3_app.post("/v1/completions", {**body, "stop": [stop], "stream": True})
    events = sse_events(s.text)
    assert "".join(c["text"] for e in events for c in e["choices"]) == expected
    assert events[-1]["choices"][0]["finish_reason"] == "stop"


# -- generation defaults -----------------------------------------------------------------------------------


def test_generation_defaults_fill_omitted_fields_and_requests_win(qwen3_app):
    server = qwen3_app.server
    # qwen3's generation_config.json: temperature 0.7, top_p 0.9, top_k 20
    omitted = server._prepare_chat(ChatCompletionRequest(messages=USER_CHAT)).sampling
    assert (omitted.temperature, omitted.top_p, omitted.top_k) == (0.7, 0.9, 20)
    sent = server._prepare_completion(
        CompletionRequest(prompt="Hi", temperature=0.0, top_p=0.5, top_k=-1, max_tokens=4)
    ).sampling
    assert (sent.temperature, sent.top_p, sent.top_k) == (0.0, 0.5, 0)
    partly = server._prepare_chat(ChatCompletionRequest(messages=USER_CHAT, top_k=3)).sampling
    assert (partly.temperature, partly.top_p, partly.top_k) == (0.7, 0.9, 3)

    # and they reach the sampler: a seeded request that omits them samples as one that sends them
    base = {"messages": USER_CHAT, "max_tokens": 24, "seed": 7, "ignore_eos": True, "return_token_ids": True}
    explicit = {**base, "temperature": 0.7, "top_p": 0.9, "top_k": 20}
    ids = [
        qwen3_app.post("/v1/chat/completions", b).json()["choices"][0]["token_ids"] for b in (base, explicit)
    ]
    assert ids[0] == ids[1]
    greedy = qwen3_app.post("/v1/chat/completions", {**base, "temperature": 0}).json()["choices"][0]
    assert greedy["token_ids"] != ids[0]  # at temperature 0.7 a 24-token sample leaves the greedy path


def test_byte_model_defaults_unchanged():
    text = load_model_text(resolve_model("tiny"))
    assert not text.is_hf and text.sampling_defaults() == {}


# -- EOS, errors, model card ------------------------------------------------------------------------------


def test_generation_config_eos_ends_the_request(checkpoints, tmp_path):
    """An id that only generation_config.json lists as EOS ends the request with finish_reason "stop"."""
    first = None
    greedy = {"prompt": "Hello world", "max_tokens": 8, "temperature": 0, "return_token_ids": True}
    app = AsgiApp(checkpoints["qwen3"])
    try:
        out = app.post("/v1/completions", greedy).json()["choices"][0]
        first = out["token_ids"][2]
    finally:
        app.close()
    folder = tmp_path / "qwen3_extra_eos"
    shutil.copytree(checkpoints["qwen3"], folder)
    gen_file = folder / "generation_config.json"
    gen = json.loads(gen_file.read_text())
    assert first not in gen["eos_token_id"] and first not in out["token_ids"][:2]
    gen["eos_token_id"] = [*gen["eos_token_id"], first]
    gen_file.write_text(json.dumps(gen))
    app = AsgiApp(folder)
    try:
        r = app.post("/v1/completions", greedy).json()
        choice = r["choices"][0]
        assert choice["finish_reason"] == "stop"
        assert choice["token_ids"] == out["token_ids"][:3]
        assert r["usage"]["completion_tokens"] == 3
    finally:
        app.close()


def test_template_error_is_a_400_naming_it(checkpoints):
    app = AsgiApp(checkpoints["gemma3"])
    try:
        twice = [{"role": "user", "content": "a"}, {"role": "user", "content": "b"}]
        r = app.post("/v1/chat/completions", {"messages": twice, "max_tokens": 2})
        assert r.status_code == 400, r.text
        err = r.json()["error"]
        assert err["param"] == "messages"
        assert "Conversation roles must alternate" in err["message"]
        ok = app.post("/v1/chat/completions", {"messages": USER_CHAT, "max_tokens": 2})
        assert ok.status_code == 200, ok.text
    finally:
        app.close()


def test_model_without_chat_template_refuses_chat_with_a_400(checkpoints):
    app = AsgiApp(checkpoints["qwen3_no_template"], served_name="bare")
    try:
        r = app.post("/v1/chat/completions", {"messages": USER_CHAT, "max_tokens": 2})
        assert r.status_code == 400, r.text
        err = r.json()["error"]
        assert err["param"] == "messages" and "no chat template" in err["message"]
        assert app.post("/v1/completions", {"prompt": "Hi", "max_tokens": 2}).status_code == 200
    finally:
        app.close()


PLAIN_TEMPLATE = (
    "{% for m in messages %}[{{ m['role'] }}] {{ m['content'] }}\n{% endfor %}"
    "{% if add_generation_prompt %}[assistant] {% endif %}"
)


def test_a_chat_template_file_lets_a_checkpoint_without_one_chat(checkpoints, tmp_path):
    """vLLM's --chat-template: the bare checkpoint given the original's template as a file renders
    exactly what the original renders with its own."""
    template_file = tmp_path / "chatml.jinja"
    template_file.write_text(hf_tokenizer(checkpoints["qwen3"]).chat_template)
    app = AsgiApp(checkpoints["qwen3_no_template"], served_name="bare", chat_template=str(template_file))
    try:
        expected = hf_chat_ids(checkpoints["qwen3"], SYSTEM_CHAT)
        r = app.post("/v1/chat/completions", {"messages": SYSTEM_CHAT, "max_tokens": 2, "temperature": 0})
        assert r.status_code == 200, r.text
        assert r.json()["usage"]["prompt_tokens"] == len(expected)
        assert app.server._prepare_chat(ChatCompletionRequest(messages=SYSTEM_CHAT)).prompt_ids == expected
    finally:
        app.close()


def test_a_chat_template_text_replaces_the_checkpoint_s(checkpoints):
    app = AsgiApp(checkpoints["llama"], chat_template=PLAIN_TEMPLATE)
    try:
        tok = hf_tokenizer(checkpoints["llama"])
        rendered = tok.apply_chat_template(
            SYSTEM_CHAT, chat_template=PLAIN_TEMPLATE, add_generation_prompt=True, tokenize=False
        )
        assert rendered.startswith("[system] You are terse.\n[user] ")
        prepared = app.server._prepare_chat(ChatCompletionRequest(messages=SYSTEM_CHAT))
        assert prepared.prompt_ids == tok.encode(rendered, add_special_tokens=False)
        # the tool-call format is read from the template in use, which writes none
        assert app.server.tool_call_parser is None
    finally:
        app.close()


@pytest.mark.parametrize(
    ("value", "says"),
    [
        (
            "/no/such/template.jinja",
            "a template file or Jinja template text, got '/no/such/template.jinja (no",
        ),
        ("{% for m in messages %}{{ m }}", 'a Jinja template, got "line 1: Unexpected end of template'),
    ],
)
def test_a_bad_chat_template_is_refused_where_it_is_given(value, says):
    from raystate.serve.app import AppArgs

    with pytest.raises(ValueError, match="chat_template") as err:
        AppArgs(chat_template=value)
    assert says in str(err.value)


def test_a_bad_chat_template_file_names_the_file_and_line(tmp_path):
    from raystate.errors import InvalidRequest
    from raystate.hf.chat_template import read_chat_template

    bad = tmp_path / "bad.jinja"
    bad.write_text("{{ bos_token }}\n{% if messages %}\n{{ messages[0] }\n")
    with pytest.raises(InvalidRequest) as err:
        read_chat_template(str(bad))
    assert err.value.field == "chat_template" and f"{bad}, line 3" in str(err.value)


def test_a_byte_model_takes_no_chat_template():
    """The byte models render chats in a plain format of their own: a template would go unused."""
    from raystate.serve.app import AppArgs

    args = AppArgs(model="tiny", chat_template=PLAIN_TEMPLATE)  # read and compiled: it is a template
    with pytest.raises(ValueError, match="chat_template: must be given only for a Hugging Face checkpoint"):
        AsgiApp("tiny", chat_template=args.chat_template)


def test_a_request_chat_template_needs_the_server_s_trust(qwen3_app, checkpoints):
    """vLLM's request `chat_template`: refused (400 naming it) unless the server trusts request templates;
    nothing is run for a refused request, and the next request is served."""
    body = {"messages": SYSTEM_CHAT, "max_tokens": 2, "chat_template": PLAIN_TEMPLATE}
    for path in ("/v1/chat/completions", "/tokenize"):
        r = qwen3_app.post(path, body)
        assert r.status_code == 400, r.text
        assert r.json()["error"]["param"] == "chat_template"
        assert "--trust-request-chat-template" in r.json()["error"]["message"]
    r = qwen3_app.post("/v1/chat/completions", {"messages": SYSTEM_CHAT, "max_tokens": 2})
    assert r.status_code == 200, r.text
    assert r.json()["usage"]["prompt_tokens"] == len(hf_chat_ids(checkpoints["qwen3"], SYSTEM_CHAT))


def test_a_trusted_request_chat_template_renders_for_that_request_only(checkpoints):
    app = AsgiApp(checkpoints["qwen3"], trust_request_chat_template=True)
    try:
        tok = hf_tokenizer(checkpoints["qwen3"])
        rendered = tok.apply_chat_template(
            SYSTEM_CHAT, chat_template=PLAIN_TEMPLATE, add_generation_prompt=True, tokenize=False
        )
        want = tok.encode(rendered, add_special_tokens=False)
        body = {"messages": SYSTEM_CHAT, "max_tokens": 2, "chat_template": PLAIN_TEMPLATE}
        r = app.post("/v1/chat/completions", body)
        assert r.status_code == 200, r.text
        assert r.json()["usage"]["prompt_tokens"] == len(want)
        r = app.post("/tokenize", {"messages": SYSTEM_CHAT, "chat_template": PLAIN_TEMPLATE})
        assert r.status_code == 200, r.text
        assert r.json()["tokens"] == want
        # the next request without one renders the checkpoint's
        r = app.post("/tokenize", {"messages": SYSTEM_CHAT})
        assert r.json()["tokens"] == hf_chat_ids(checkpoints["qwen3"], SYSTEM_CHAT)
        # a template that does not compile: a 400 naming it, with the line
        bad = {"messages": SYSTEM_CHAT, "chat_template": "{% for m in messages %}\n{{ m }"}
        r = app.post("/v1/chat/completions", bad)
        assert r.status_code == 400, r.text
        error = r.json()["error"]
        assert error["param"] == "chat_template" and "line 2" in error["message"]
    finally:
        app.close()


def test_a_request_chat_template_is_refused_for_a_byte_model():
    app = AsgiApp("tiny", trust_request_chat_template=True)
    try:
        assert app.refused_param("/v1/chat/completions", {"chat_template": PLAIN_TEMPLATE}) == "chat_template"
    finally:
        app.close()


def test_models_lists_the_served_name_and_the_checkpoint_max_model_len(qwen3_app, checkpoints):
    cfg = json.loads((checkpoints["qwen3"] / "config.json").read_text())
    cards = qwen3_app.get("/v1/models").json()["data"]
    assert [(c["id"], c["max_model_len"]) for c in cards] == [("tiny-qwen3", cfg["max_position_embeddings"])]
    assert cards[0]["root"] == str(checkpoints["qwen3"]) and cards[0]["parent"] is None  # as vLLM's
    r = qwen3_app.post("/v1/completions", {"prompt": "Hi", "max_tokens": 10**6})
    assert r.status_code == 400
    assert f"max_model_len={cfg['max_position_embeddings']}" in r.json()["error"]["message"]


def test_health_probe_works_for_a_checkpoint_without_bos(qwen3_app, checkpoints):
    """Qwen's configs set no BOS id (-1 here): /health's one-token step sends a valid id instead."""
    cfg = json.loads((checkpoints["qwen3"] / "config.json").read_text())
    assert cfg.get("bos_token_id") is None
    r = qwen3_app.get("/health")
    assert r.status_code == 200, r.text


# -- one real Serve app ------------------------------------------------------------------------------------


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def serve_port():
    import ray
    from ray import serve

    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("RAYSTATE_KERNELS", "reference")  # inherited by every Ray process started below
        if ray.is_initialized():
            ray.shutdown()
        ray.init(address="local", include_dashboard=False)
        port = _free_port()
        serve.start(http_options={"host": "127.0.0.1", "port": port})
        try:
            yield port
        finally:
            serve.shutdown()
            ray.shutdown()


@pytest.fixture(scope="module")
def serve_app(serve_port, checkpoints) -> tuple[str, str]:
    """(url, model word) of the Serve app of the gemma3 checkpoint, built from its folder as `model`."""
    from ray import serve

    from raystate.serve.app import build_app

    word = str(checkpoints["gemma3"])
    serve.run(
        build_app({"model": word, "backend": "inprocess", "enable_prefix_caching": False}),
        name="hf",
        route_prefix="/hf",
    )
    return f"http://127.0.0.1:{serve_port}/hf", word


def test_serve_app_chats_with_the_checkpoint(serve_app, checkpoints):
    url, word = serve_app
    tok = hf_tokenizer(checkpoints["gemma3"])
    models = httpx.get(f"{url}/v1/models", timeout=30).json()["data"]
    assert [m["id"] for m in models] == [word]
    body = {
        "model": word,
        "messages": SYSTEM_CHAT,
        "max_tokens": 20,
        "temperature": 0,
        "ignore_eos": True,
        "return_token_ids": True,
    }
    r = httpx.post(f"{url}/v1/chat/completions", json=body, timeout=120)
    assert r.status_code == 200, r.text
    data = r.json()
    assert data["model"] == word
    assert data["usage"]["prompt_tokens"] == len(hf_chat_ids(checkpoints["gemma3"], SYSTEM_CHAT))
    choice = data["choices"][0]
    text, whole = choice["message"]["content"], tok.decode(choice["token_ids"], skip_special_tokens=True)
    # Equal, but for raystate.hf.detokenize's one documented exception: a SentencePiece byte-fallback run
    # that turns invalid UTF-8 decodes all-U+FFFD in one decode, while the stream kept its whole characters.
    assert len(text) == len(whole)
    assert all(a == b or b == "\ufffd" for a, b in zip(text, whole, strict=True)), (text, whole)
    s = httpx.post(f"{url}/v1/chat/completions", json={**body, "stream": True}, timeout=120)
    assert streamed_chat_text(sse_events(s.text)) == (choice["message"]["content"], "length")


def test_serve_app_template_error_is_a_400(serve_app):
    url, word = serve_app
    twice = [{"role": "user", "content": "a"}, {"role": "user", "content": "b"}]
    r = httpx.post(f"{url}/v1/chat/completions", json={"model": word, "messages": twice}, timeout=60)
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["param"] == "messages" and "Conversation roles must alternate" in err["message"]


def test_skip_special_tokens_false_writes_their_text(qwen3_app, checkpoints):
    """vLLM's skip_special_tokens: false writes special tokens' text (a logit_bias makes the tiny model
    write <|im_start|>), with no space between them whatever spaces_between_special_tokens says; the
    token that ends the request (EOS) writes none unless include_stop_str_in_output keeps it, and a
    stop_token_ids id likewise."""
    tok = hf_tokenizer(checkpoints["qwen3"])
    start, end = tok.convert_tokens_to_ids(["<|im_start|>", "<|im_end|>"])
    body = {"prompt": "Hi", "max_tokens": 3, "temperature": 0, "return_token_ids": True}
    forced = body | {"logit_bias": {str(start): 100}, "ignore_eos": True}
    plain = qwen3_app.post("/v1/completions", forced).json()["choices"][0]
    assert plain["token_ids"] == [start] * 3 and plain["text"] == ""
    shown = qwen3_app.post("/v1/completions", forced | {"skip_special_tokens": False}).json()["choices"][0]
    assert shown["text"] == "<|im_start|>" * 3
    streamed = qwen3_app.post("/v1/completions", forced | {"skip_special_tokens": False, "stream": True})
    deltas = [json.loads(line[6:]) for line in streamed.text.splitlines() if line.startswith("data: {")]
    assert "".join(d["choices"][0]["text"] for d in deltas) == "<|im_start|>" * 3
    for spaces in (True, False):  # vLLM's: read by transformers' slow tokenizers only, so no space either way
        again = forced | {"skip_special_tokens": False, "spaces_between_special_tokens": spaces}
        c = qwen3_app.post("/v1/completions", again).json()["choices"][0]
        assert c["text"] == tok.decode(c["token_ids"], skip_special_tokens=False) == "<|im_start|>" * 3

    ending = body | {"logit_bias": {str(end): 100}, "skip_special_tokens": False}
    stopped = qwen3_app.post("/v1/completions", ending).json()["choices"][0]
    assert stopped["finish_reason"] == "stop" and stopped["token_ids"] == [end] and stopped["text"] == ""
    kept = qwen3_app.post("/v1/completions", ending | {"include_stop_str_in_output": True}).json()
    assert kept["choices"][0]["text"] == "<|im_end|>"

    first = qwen3_app.post("/v1/completions", body | {"max_tokens": 1}).json()["choices"][0]
    (word,) = first["token_ids"]
    cut = qwen3_app.post("/v1/completions", body | {"stop_token_ids": [word]}).json()["choices"][0]
    assert cut["finish_reason"] == "stop" and cut["token_ids"] == [word] and cut["text"] == ""


def test_skip_special_tokens_false_on_a_byte_model():
    from raystate.config import PAD_ID

    app = AsgiApp("tiny")
    try:
        body = {"prompt": "é", "max_tokens": 2, "temperature": 0, "ignore_eos": True}
        body |= {"logit_bias": {str(PAD_ID): 100}, "skip_special_tokens": False}
        assert app.post("/v1/completions", body).json()["choices"][0]["text"] == "<|pad|><|pad|>"
    finally:
        app.close()
