"""vLLM's protocol details on a Hugging Face checkpoint (a tiny qwen3 with a ChatML template that reads
`enable_thinking`): /tokenize and /detokenize with the checkpoint's tokenizer, `chat_template_kwargs`
reaching the template, `continue_final_message` rendered as transformers renders it, the `developer` role.

The real FastAPI app over `RaystateServer` over `InProcessClient`, through httpx's ASGI transport;
transformers 5's tokenizer is the oracle.
"""

from __future__ import annotations

from pathlib import Path

import openai
import pytest
import transformers
from asgi_app import AsgiApp
from hf_families import make_family_checkpoint

NAME = "tiny-qwen3"
CHAT = [{"role": "system", "content": "Be terse."}, {"role": "user", "content": "Hello, café 日本?"}]


@pytest.fixture(scope="module")
def folder(tmp_path_factory) -> Path:
    return make_family_checkpoint("qwen3", tmp_path_factory.mktemp("hf_protocol") / "qwen3")


@pytest.fixture(scope="module")
def hf(folder):
    return transformers.AutoTokenizer.from_pretrained(str(folder))


@pytest.fixture(scope="module")
def app(folder):
    a = AsgiApp(str(folder), NAME, enable_prefix_caching=False)  # the kernels' references (conftest.py)
    try:
        yield a
    finally:
        a.close()


def _ids(x) -> list[int]:
    return list(x if isinstance(x, list) else x["input_ids"])  # a BatchEncoding in transformers 5


def test_tokenize_prompt_equals_transformers_and_detokenize_round_trips(app, hf):
    text = "The quick brown fox, café 日本語."
    out = app.post("/tokenize", {"model": NAME, "prompt": text}).json()
    assert out["tokens"] == hf(text)["input_ids"]
    assert out["count"] == len(out["tokens"]) and out["max_model_len"] == app.server.max_model_len
    bare = app.post("/tokenize", {"prompt": text, "add_special_tokens": False}).json()["tokens"]
    assert bare == hf(text, add_special_tokens=False)["input_ids"]
    assert app.post("/detokenize", {"model": NAME, "tokens": bare}).json() == {"prompt": text}
    assert app.post("/detokenize", {"tokens": out["tokens"]}).json()["prompt"] == hf.decode(out["tokens"])


def test_tokenize_chat_equals_transformers_and_the_chat_route(app, hf):
    out = app.post("/tokenize", {"model": NAME, "messages": CHAT}).json()
    assert out["tokens"] == _ids(hf.apply_chat_template(CHAT, add_generation_prompt=True, tokenize=True))
    r = app.run(app.openai.chat.completions.create(model=NAME, messages=CHAT, max_tokens=1))
    assert r.usage.prompt_tokens == out["count"]
    text = app.post("/detokenize", {"tokens": out["tokens"]}).json()["prompt"]
    assert text == hf.apply_chat_template(CHAT, add_generation_prompt=True, tokenize=False)


def test_chat_template_kwargs_reach_the_template(app, hf):
    body = {"messages": CHAT, "chat_template_kwargs": {"enable_thinking": False}}
    ids = app.post("/tokenize", body).json()["tokens"]
    want = hf.apply_chat_template(CHAT, add_generation_prompt=True, tokenize=False, enable_thinking=False)
    assert "<think>" in want
    assert app.post("/detokenize", {"tokens": ids}).json()["prompt"] == want
    plain = app.post("/tokenize", {"messages": CHAT}).json()["tokens"]
    assert len(ids) > len(plain)
    r = app.run(
        app.openai.chat.completions.create(
            model=NAME,
            messages=CHAT,
            max_tokens=1,
            extra_body={"chat_template_kwargs": {"enable_thinking": False}},
        )
    )
    assert r.usage.prompt_tokens == len(ids)


def test_continue_final_message_equals_transformers(app, hf):
    chat = [*CHAT, {"role": "assistant", "content": "Sure: the answer is"}]
    want = hf.apply_chat_template(
        chat, add_generation_prompt=False, continue_final_message=True, tokenize=False
    )
    assert want.endswith("Sure: the answer is")
    body = {"messages": chat, "add_generation_prompt": False, "continue_final_message": True}
    ids = app.post("/tokenize", body).json()["tokens"]
    assert app.post("/detokenize", {"tokens": ids}).json()["prompt"] == want
    assert ids == hf(want, add_special_tokens=False)["input_ids"]
    r = app.post("/v1/chat/completions", {**body, "model": NAME, "max_tokens": 2})
    assert r.status_code == 200, r.text
    assert r.json()["usage"]["prompt_tokens"] == len(ids)


def test_developer_role_goes_to_the_template(app, hf):
    chat = [{"role": "developer", "content": "Be terse."}, CHAT[1]]
    ids = app.post("/tokenize", {"messages": chat}).json()["tokens"]
    assert ids == _ids(hf.apply_chat_template(chat, add_generation_prompt=True, tokenize=True))
    r = app.run(app.openai.chat.completions.create(model=NAME, messages=chat, max_tokens=1))
    assert r.usage.prompt_tokens == len(ids)


def test_wrong_model_is_not_found(app):
    with pytest.raises(openai.NotFoundError):
        app.run(app.openai.chat.completions.create(model="other", messages=CHAT, max_tokens=1))
