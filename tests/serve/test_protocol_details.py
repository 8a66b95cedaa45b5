"""vLLM-compatible protocol details on the byte model: unknown fields ignored (with a warning), a wrong
model a 404, /tokenize, /detokenize and /version, the chat template controls, and vLLM's metric names.

The app is the real FastAPI app over `RaystateServer` over `InProcessClient`, driven through httpx's ASGI
transport, by the official `openai` client where it has a method for the call.
"""

from __future__ import annotations

import json
import logging
import re
from pathlib import Path

import openai
import pytest
from asgi_app import reference_app

from raystate.tokenizer import ByteTokenizer

MODEL = "tiny"
DASHBOARD = Path(__file__).resolve().parents[2] / "deploy" / "grafana" / "raystate-vllm-dashboard.json"


@pytest.fixture(scope="module")
def app():
    with reference_app(MODEL) as a:
        yield a


# -- unknown and unsupported fields -----------------------------------------------------------------------

SDK_EXTRAS = {
    "store": False,
    "metadata": {"k": "v"},
    "service_tier": "auto",
    "modalities": ["text"],
    "prediction": None,
}


def test_unknown_fields_are_ignored_with_one_warning(app, caplog):
    with caplog.at_level(logging.WARNING, logger="raystate.serve.ingress"):
        r = app.run(
            app.openai.chat.completions.create(
                model=MODEL,
                messages=[{"role": "user", "content": "P1 hi", "junk_field": 1}],
                max_tokens=3,
                temperature=0,
                user="someone",
                extra_body={**SDK_EXTRAS, "max_token": 3},
            )
        )
    assert r.choices[0].finish_reason in ("stop", "length")
    warnings = [rec.getMessage() for rec in caplog.records if "ignored" in rec.getMessage()]
    assert len(warnings) == 1, warnings
    for name in [*SDK_EXTRAS, "max_token", "messages[0].junk_field"]:
        assert name in warnings[0]
    assert "user" not in warnings[0].split(":", 1)[1].split(", ")  # a known field


def test_unknown_completion_fields_are_ignored(app, caplog):
    with caplog.at_level(logging.WARNING, logger="raystate.serve.ingress"):
        r = app.run(
            app.openai.completions.create(
                model=MODEL, prompt="P2", max_tokens=2, extra_body={"store": True, "foo": {"bar": [1]}}
            )
        )
    assert r.usage.completion_tokens <= 2
    assert sum("store, foo" in rec.getMessage() or "foo, store" in rec.getMessage() for rec in caplog.records)


def test_request_without_unknown_fields_logs_no_warning(app, caplog):
    with caplog.at_level(logging.WARNING, logger="raystate.serve.ingress"):
        app.run(app.openai.completions.create(model=MODEL, prompt="P3", max_tokens=1))
    assert not [rec for rec in caplog.records if "ignored" in rec.getMessage()]


@pytest.mark.parametrize(
    ("path", "change", "param"),
    [
        ("/v1/completions", {"n": 0}, "n"),
        ("/v1/completions", {"best_of": 2}, "best_of"),
        ("/v1/completions", {"logprobs": 21}, "logprobs"),  # supported, up to 20
        ("/v1/chat/completions", {"logprobs": True, "top_logprobs": 21}, "top_logprobs"),
        ("/v1/chat/completions", {"response_format": {"type": "xml"}}, "response_format.type"),
        ("/v1/chat/completions", {"tools": [{"type": "function"}]}, "tools[0].function"),
        ("/v1/chat/completions", {"chat_template_kwargs": {"messages": []}}, "chat_template_kwargs"),
    ],
)
def test_known_unsupported_fields_stay_400s(app, path, change, param):
    assert app.refused_param(path, change) == param


# -- wrong model ------------------------------------------------------------------------------------------


def test_wrong_model_is_a_404_not_found_error(app):
    with pytest.raises(openai.NotFoundError) as e:
        app.run(app.openai.completions.create(model="gpt-4", prompt="x", max_tokens=1))
    assert e.value.status_code == 404
    with pytest.raises(openai.NotFoundError):
        app.run(
            app.openai.chat.completions.create(model="gpt-4", messages=[{"role": "user", "content": "x"}])
        )
    for path, body in [
        ("/v1/completions", {"model": "gpt-4", "prompt": "x"}),
        ("/tokenize", {"model": "gpt-4", "prompt": "x"}),
        ("/detokenize", {"model": "gpt-4", "tokens": [1]}),
    ]:
        r = app.post(path, body)
        assert r.status_code == 404, r.text
        err = r.json()["error"]
        assert set(err) == {"message", "type", "param", "code"}
        assert (err["type"], err["code"], err["param"]) == ("NotFoundError", 404, "model")
        assert "gpt-4" in err["message"]
    r = app.get("/v1/models/gpt-4")
    assert r.status_code == 404 and r.json()["error"]["type"] == "NotFoundError"


# -- tokenize, detokenize, version ------------------------------------------------------------------------


def test_tokenize_prompt_and_detokenize_round_trip(app):
    text = "héllo, 日本"
    r = app.post("/tokenize", {"model": MODEL, "prompt": text})
    assert r.status_code == 200, r.text
    out = r.json()
    assert set(out) == {"count", "max_model_len", "tokens"}
    assert out["tokens"] == ByteTokenizer().encode(text)  # BOS + bytes: what /v1/completions runs
    assert out["count"] == len(out["tokens"]) and out["max_model_len"] == app.server.max_model_len
    bare = app.post("/tokenize", {"prompt": text, "add_special_tokens": False}).json()["tokens"]
    assert bare == out["tokens"][1:]
    assert app.post("/detokenize", {"model": MODEL, "tokens": bare}).json() == {"prompt": text}
    assert app.post("/detokenize", {"tokens": out["tokens"]}).json()["prompt"] == "<|bos|>" + text


def test_tokenize_chat_equals_the_chat_prompt(app):
    messages = [{"role": "developer", "content": "Be brief."}, {"role": "user", "content": "Hi"}]
    out = app.post("/tokenize", {"messages": messages}).json()
    plain = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}]
    expected = ByteTokenizer().encode(ByteTokenizer().apply_chat_template(plain))
    assert out["tokens"] == expected and out["count"] == len(expected)
    # the chat route runs exactly these ids
    r = app.run(app.openai.chat.completions.create(model=MODEL, messages=messages, max_tokens=1))
    assert r.usage.prompt_tokens == len(expected)
    no_gen = app.post("/tokenize", {"messages": messages, "add_generation_prompt": False}).json()["tokens"]
    assert no_gen == ByteTokenizer().encode(ByteTokenizer().apply_chat_template(plain, False))


def test_continue_final_message_leaves_the_last_message_open(app):
    messages = [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Sure, the answer is"}]
    body = {"messages": messages, "add_generation_prompt": False, "continue_final_message": True}
    ids = app.post("/tokenize", body).json()["tokens"]
    assert ByteTokenizer().decode(ids) == "<|user|>\nHi\n<|assistant|>\nSure, the answer is"
    r = app.post("/v1/chat/completions", {**body, "max_tokens": 2})
    assert r.status_code == 200 and r.json()["usage"]["prompt_tokens"] == len(ids)
    both = app.post("/tokenize", {"messages": messages, "continue_final_message": True})
    assert both.status_code == 400 and both.json()["error"]["param"] == "continue_final_message"


def test_detokenize_refuses_ids_out_of_the_vocabulary(app):
    r = app.post("/detokenize", {"tokens": [1, 10**6]})
    assert r.status_code == 400 and r.json()["error"]["param"] == "tokens"
    r = app.post("/detokenize", {"tokens": "abc"})
    assert r.status_code == 400 and r.json()["error"]["param"] == "tokens"
    r = app.post("/tokenize", {"prompt": 5})
    assert r.status_code == 400 and r.json()["error"]["param"] == "prompt"


def test_version(app):
    import raystate

    r = app.get("/version")
    assert r.status_code == 200 and r.json() == {"version": raystate.__version__}


# -- metrics ----------------------------------------------------------------------------------------------

VLLM_SERIES = [
    "vllm:time_to_first_token_seconds_bucket",
    "vllm:inter_token_latency_seconds_bucket",
    "vllm:time_per_output_token_seconds_bucket",
    "vllm:e2e_request_latency_seconds_bucket",
    "vllm:e2e_request_latency_seconds_count",
    "vllm:num_requests_running",
    "vllm:num_requests_waiting",
    "vllm:kv_cache_usage_perc",
    "vllm:gpu_cache_usage_perc",
    "vllm:prefix_cache_queries_total",
    "vllm:prefix_cache_hits_total",
    "vllm:prompt_tokens_total",
    "vllm:generation_tokens_total",
    "vllm:request_success_total",
]


def _samples(text: str) -> dict[str, list[tuple[dict, float]]]:
    out: dict[str, list[tuple[dict, float]]] = {}
    for line in text.splitlines():
        if not line or line.startswith("#"):
            continue
        m = re.match(r"^([a-zA-Z_:][a-zA-Z0-9_:]*)(\{(.*)\})?\s+(\S+)$", line)
        assert m, line
        labels = dict(re.findall(r'([a-zA-Z_][a-zA-Z0-9_]*)="((?:[^"\\]|\\.)*)"', m.group(3) or ""))
        out.setdefault(m.group(1), []).append((labels, float(m.group(4))))
    return out


def _metrics_after_a_request(app) -> dict[str, list[tuple[dict, float]]]:
    before = _samples(app.get("/metrics").text)
    app.run(app.openai.completions.create(model=MODEL, prompt="M1 metrics", max_tokens=4, temperature=0))
    after = _samples(app.get("/metrics").text)
    return before, after


def test_vllm_series_are_exported_from_our_own(app):
    before, after = _metrics_after_a_request(app)
    for name in VLLM_SERIES:
        assert name in after, name
        assert all(labels.get("model_name") == MODEL for labels, _ in after[name]), name

    # the same measurements as our own series
    def total(samples, name):
        return sum(v for _, v in samples.get(name, []))

    for ours, theirs in [
        ("raystate_prompt_tokens_total", "vllm:prompt_tokens_total"),
        ("raystate_generation_tokens_total", "vllm:generation_tokens_total"),
        ("raystate_prompt_tokens_total", "vllm:prefix_cache_queries_total"),
        ("raystate_cached_prompt_tokens_total", "vllm:prefix_cache_hits_total"),
        ("raystate_time_to_first_token_seconds_count", "vllm:time_to_first_token_seconds_count"),
        ("raystate_request_latency_seconds_sum", "vllm:e2e_request_latency_seconds_sum"),
        ("raystate_requests_total", "vllm:request_success_total"),
    ]:
        assert total(after, ours) == total(after, theirs), (ours, theirs)
    assert total(after, "vllm:prompt_tokens_total") - total(before, "vllm:prompt_tokens_total") == 11
    reasons = {labels["finished_reason"] for labels, _ in after["vllm:request_success_total"]}
    assert reasons <= {"stop", "length", "abort", "error"} and reasons
    (usage,) = after["vllm:kv_cache_usage_perc"]
    assert 0.0 <= usage[1] <= 1.0


def test_every_dashboard_metric_is_exported(app):
    dashboard = json.loads(DASHBOARD.read_text())
    exprs = [t["expr"] for p in dashboard["panels"] for t in p.get("targets", [])]
    assert len(exprs) >= 9
    used = {n for e in exprs for n in re.findall(r"vllm:[a-zA-Z0-9_:]+", e)}
    assert used
    _, after = _metrics_after_a_request(app)
    missing = sorted(n for n in used if n not in after)
    assert not missing, missing
    titles = " ".join(p["title"] for p in dashboard["panels"]).lower()
    for word in ("ttft", "inter-token", "e2e", "running", "kv", "prefix", "tokens/s"):
        assert word in titles, word


def test_truncate_prompt_tokens_keeps_the_prompt_s_last_tokens(app):
    """vLLM's truncate_prompt_tokens: the prompt's last k tokens run (usage counts them), exactly as a
    request that sent those tokens; on the chat route too; 0 or more than max_model_len is a 400."""
    ids = ByteTokenizer().encode("The quick brown fox jumps over the lazy dog")
    body = {"model": MODEL, "max_tokens": 6, "temperature": 0, "return_token_ids": True}
    cut = app.post("/v1/completions", body | {"prompt": ids, "truncate_prompt_tokens": 9}).json()
    same = app.post("/v1/completions", body | {"prompt": ids[-9:]}).json()
    assert cut["usage"]["prompt_tokens"] == 9
    assert cut["choices"][0]["token_ids"] == same["choices"][0]["token_ids"]
    text = app.post("/v1/completions", body | {"prompt": "A long prompt", "truncate_prompt_tokens": 4}).json()
    assert text["usage"]["prompt_tokens"] == 4
    echo = body | {"prompt": "A long prompt", "truncate_prompt_tokens": 4, "echo": True}
    assert app.post("/v1/completions", echo).json()["choices"][0]["text"].startswith("ompt")
    untouched = app.post("/v1/completions", body | {"prompt": ids, "truncate_prompt_tokens": -1}).json()
    assert untouched["usage"]["prompt_tokens"] == len(ids)  # -1: up to max_model_len, which it is under
    messages = [{"role": "user", "content": "Tell me a long story about a fox"}]
    chat = app.post("/v1/chat/completions", body | {"messages": messages, "truncate_prompt_tokens": 7}).json()
    assert chat["usage"]["prompt_tokens"] == 7
    for bad in (0, -2, 10**6):
        r = app.post("/v1/completions", body | {"prompt": ids, "truncate_prompt_tokens": bad})
        assert r.status_code == 400 and r.json()["error"]["param"] == "truncate_prompt_tokens", r.text


def test_allowed_token_ids_hold_the_output_to_the_list(app):
    """vLLM's allowed_token_ids (was refused): every output token is one of them; an empty list or an id
    past the vocabulary is a 400 naming the field."""
    body = {"model": MODEL, "prompt": "Go", "max_tokens": 8, "return_token_ids": True}
    allowed = [ord(c) for c in "xyz"]
    for extra in ({"temperature": 0}, {"temperature": 1.0, "seed": 2}):
        r = app.post("/v1/completions", body | extra | {"allowed_token_ids": allowed})
        choice = r.json()["choices"][0]
        assert set(choice["token_ids"]) <= set(allowed) and len(choice["token_ids"]) == 8, choice
        assert set(choice["text"]) <= set("xyz")
    for bad in ([], [10**6]):
        r = app.post("/v1/completions", body | {"allowed_token_ids": bad})
        assert r.status_code == 400 and r.json()["error"]["param"] == "allowed_token_ids", r.text


def test_bad_words_keep_their_tokens_out_of_the_output(app):
    """vLLM's bad_words (was refused): a word is never written on either route; a blank word, one past 16
    tokens, more than 128 words, or a string in place of the list is a 400 naming the field."""
    body = {"model": MODEL, "prompt": "Go", "max_tokens": 12, "ignore_eos": True, "return_token_ids": True}
    plain = app.post("/v1/completions", body).json()["choices"][0]["token_ids"]
    printable = [t for t in plain if 33 <= t < 127]
    assert printable  # the byte model's greedy answer to "Go" writes some ASCII character
    r = app.post("/v1/completions", body | {"bad_words": [chr(printable[0]), "zz"]})
    got = r.json()["choices"][0]["token_ids"]
    assert printable[0] not in got and got != plain, (plain, got)
    chat = {"model": MODEL, "messages": [{"role": "user", "content": "Go"}], "max_tokens": 6}
    r = app.post("/v1/chat/completions", chat | {"bad_words": ["a", "e"]})
    assert r.status_code == 200 and not {"a", "e"} & set(r.json()["choices"][0]["message"]["content"]), r.text
    for bad in (["  "], [""], ["x" * 17], ["w"] * 129, "x"):
        r = app.post("/v1/completions", body | {"bad_words": bad})
        assert r.status_code == 400 and r.json()["error"]["param"] == "bad_words", r.text


def test_beam_search_answers_the_n_best_beams(app, monkeypatch):
    """vLLM's use_beam_search (was refused): n choices, the beams LLM.beam_search finds for the same
    prompt ids and length_penalty, on both routes; what a beam cannot honour is a 400 naming it."""
    from raystate import LLM, BeamSearchParams

    monkeypatch.setenv("RAYSTATE_KERNELS", "reference")
    monkeypatch.setattr("raystate.kernels._common._reference_forced", True)
    llm = LLM(model=MODEL, backend="inprocess", device="cpu")

    body = {"model": MODEL, "prompt": "Hello", "max_tokens": 5, "n": 3, "use_beam_search": True}
    r = app.post("/v1/completions", body | {"length_penalty": 0.5, "return_token_ids": True})
    choices = r.json()["choices"]
    assert [c["index"] for c in choices] == [0, 1, 2], r.text
    ids = ByteTokenizer().encode("Hello")
    [want] = llm.beam_search([ids], BeamSearchParams(beam_width=3, max_tokens=5, length_penalty=0.5))
    assert [c["token_ids"] for c in choices] == [s.tokens[len(ids) :] for s in want.sequences]
    assert [c["text"] for c in choices] == [s.text for s in want.sequences]
    assert r.json()["usage"]["completion_tokens"] == sum(len(c["token_ids"]) for c in choices)
    chat = {"model": MODEL, "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 4, "n": 2}
    r = app.post("/v1/chat/completions", chat | {"use_beam_search": True})
    assert r.status_code == 200 and len(r.json()["choices"]) == 2, r.text
    for extra, param in [
        ({"stream": True}, "stream"),
        ({"stop": ["x"]}, "stop"),
        ({"frequency_penalty": 1.0}, "frequency_penalty"),
        ({"logprobs": 2}, "logprobs"),
        ({"n": 11}, "n"),
        ({"response_format": {"type": "json_object"}}, "response_format"),
    ]:
        r = app.post("/v1/completions", body | extra)
        assert r.status_code == 400 and r.json()["error"]["param"] == param, (extra, r.text)
