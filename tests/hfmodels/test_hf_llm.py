"""`LLM` on Hugging Face checkpoints (in-process): prompt strings through the checkpoint's tokenizer, `chat`
through its chat template, and its generation_config.json as the default sampling params. transformers'
tokenizer is the oracle for prompt ids and text."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import transformers
from hf_families import make_family_checkpoint

from raystate import LLM, SamplingParams
from raystate.errors import InvalidRequest

CHAT = [
    {"role": "system", "content": "You are terse."},
    {"role": "user", "content": "Hello world, café naïve 日本語?"},
]


@pytest.fixture(scope="module")
def llama(tmp_path_factory) -> Path:
    """The llama checkpoint (its tokenizer adds <|begin_of_text|>, its template writes it too), with
    max_new_tokens 5 added to its generation_config.json (temperature 0.6, top_p 0.9)."""
    folder = make_family_checkpoint("llama", tmp_path_factory.mktemp("hf_llm") / "llama")
    gen_file = folder / "generation_config.json"
    gen = json.loads(gen_file.read_text())
    gen_file.write_text(json.dumps({**gen, "max_new_tokens": 5}))
    return folder


@pytest.fixture(scope="module")
def llm(llama) -> LLM:
    return LLM(str(llama), backend="inprocess", enable_prefix_caching=False)


def _chat_ids(tok, messages) -> list[int]:
    ids = tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
    return list(ids if isinstance(ids, list) else ids["input_ids"])


def test_generate_strings_through_the_checkpoint_tokenizer(llm, llama):
    tok = transformers.AutoTokenizer.from_pretrained(str(llama))
    prompts = ["Hello world, this is", "Café, naïve, façade"]
    params = SamplingParams(max_tokens=12, ignore_eos=True)
    outs = llm.generate(prompts, params, use_tqdm=False)
    for prompt, out in zip(prompts, outs, strict=True):
        assert out.prompt == prompt
        assert out.prompt_token_ids == tok(prompt)["input_ids"]  # with its BOS, as vLLM encodes
        assert out.prompt_token_ids[0] == tok.bos_token_id
        assert len(out.token_ids) == 12
        assert out.text == tok.decode(out.token_ids, skip_special_tokens=True)


def test_chat_renders_the_template_like_transformers(llm, llama):
    tok = transformers.AutoTokenizer.from_pretrained(str(llama))
    params = SamplingParams(max_tokens=6, ignore_eos=True)
    (out,) = llm.chat(CHAT, params, use_tqdm=False)
    assert out.prompt_token_ids == _chat_ids(tok, CHAT)
    assert out.prompt_token_ids.count(tok.bos_token_id) == 1
    assert out.prompt == tok.apply_chat_template(CHAT, add_generation_prompt=True, tokenize=False)
    assert out.text == tok.decode(out.token_ids, skip_special_tokens=True)

    other = [{"role": "user", "content": "The quick brown fox"}]
    outs = llm.chat([CHAT, other], params, use_tqdm=False)
    assert [o.prompt_token_ids for o in outs] == [_chat_ids(tok, CHAT), _chat_ids(tok, other)]
    assert outs[0].token_ids == out.token_ids  # greedy: the same conversation, the same reply

    (bare,) = llm.chat(other, params, use_tqdm=False, add_generation_prompt=False)
    expected = tok.apply_chat_template(other, add_generation_prompt=False, tokenize=False)
    assert bare.prompt == expected


def test_chat_takes_tools_and_a_continued_message_like_transformers(llm, llama):
    tok = transformers.AutoTokenizer.from_pretrained(str(llama))
    params = SamplingParams(max_tokens=2, ignore_eos=True)
    tool = {
        "type": "function",
        "function": {"name": "get_weather", "parameters": {"type": "object", "properties": {}}},
    }
    (out,) = llm.chat(CHAT, params, use_tqdm=False, tools=[tool])
    want = tok.apply_chat_template(CHAT, tools=[tool], add_generation_prompt=True, tokenize=False)
    assert out.prompt == want and '"get_weather"' in want
    started = [*CHAT, {"role": "assistant", "content": "Bonjour, "}]
    (cont,) = llm.chat(started, params, use_tqdm=False, continue_final_message=True)
    assert cont.prompt == tok.apply_chat_template(started, continue_final_message=True, tokenize=False)
    assert cont.prompt.endswith("Bonjour,")


def test_chat_takes_a_template_in_place_of_the_checkpoint_s(llm, llama, tmp_path):
    """vLLM's `LLM.chat(chat_template=...)`: the text, or (as the server's --chat-template) a file."""
    tok = transformers.AutoTokenizer.from_pretrained(str(llama))
    template = "{% for m in messages %}<{{ m['role'] }}>{{ m['content'] }}{% endfor %}<assistant>"
    template_file = tmp_path / "plain.jinja"
    template_file.write_text(template)
    params = SamplingParams(max_tokens=2, ignore_eos=True)
    want = tok.apply_chat_template(CHAT, chat_template=template, add_generation_prompt=True, tokenize=False)
    assert want.startswith("<system>")
    for given in (template, str(template_file)):
        (out,) = llm.chat(CHAT, params, use_tqdm=False, chat_template=given)
        assert out.prompt == want
        assert out.prompt_token_ids == tok.encode(want, add_special_tokens=False)
    (own,) = llm.chat(CHAT, params, use_tqdm=False)  # the next call renders the checkpoint's again
    assert own.prompt == tok.apply_chat_template(CHAT, add_generation_prompt=True, tokenize=False)


def test_default_sampling_params_are_the_checkpoint_s(llm):
    defaults = llm.get_default_sampling_params()
    assert (defaults.temperature, defaults.top_p, defaults.top_k, defaults.max_tokens) == (0.6, 0.9, 0, 5)
    # generate without params uses them: max_new_tokens 5 ends every prompt at 5 tokens
    outs = llm.generate(["Hello world", "The quick brown"], use_tqdm=False)
    assert all(len(o.token_ids) <= 5 for o in outs)
    assert any(o.finish_reason == "length" and len(o.token_ids) == 5 for o in outs)
    (out,) = llm.chat(CHAT, use_tqdm=False)
    assert len(out.token_ids) <= 5


def test_chat_errors_name_messages(llm, llama, tmp_path):
    with pytest.raises(InvalidRequest, match="messages"):
        llm.chat([], use_tqdm=False)
    bare = tmp_path / "no_template"
    shutil.copytree(llama, bare)
    (bare / "chat_template.jinja").unlink(missing_ok=True)
    cfg = json.loads((bare / "tokenizer_config.json").read_text())
    cfg.pop("chat_template", None)
    (bare / "tokenizer_config.json").write_text(json.dumps(cfg))
    plain = LLM(str(bare), backend="inprocess", enable_prefix_caching=False)
    with pytest.raises(InvalidRequest, match="no chat template") as e:
        plain.chat(CHAT, use_tqdm=False)
    assert e.value.field == "messages"


def test_byte_model_unchanged():
    llm = LLM("tiny", backend="inprocess")
    assert llm.get_default_sampling_params() == SamplingParams()
    (out,) = llm.chat([{"role": "user", "content": "hi"}], SamplingParams(max_tokens=3), use_tqdm=False)
    text = llm.tokenizer.apply_chat_template([{"role": "user", "content": "hi"}], add_generation_prompt=True)
    assert out.prompt == text and out.prompt_token_ids == llm.tokenizer.encode(text)


def test_repetition_penalty_default_comes_from_generation_config(family_checkpoints):
    """qwen2's generation_config.json sets repetition_penalty 1.05: a request that leaves it out gets it."""
    qwen2 = LLM(str(family_checkpoints["qwen2"]), backend="inprocess", device="cpu", max_model_len=256)
    defaults = qwen2.get_default_sampling_params()
    assert defaults.repetition_penalty == 1.05 and defaults.min_p == 0.0


def test_the_token_that_ends_a_request_writes_no_text(llm):
    """As vLLM (and the server): the stop_token_ids id (or EOS) that ends a request is in token_ids, but
    its text is not in the output."""
    params = SamplingParams(max_tokens=1, temperature=0)
    (first,) = llm.generate(["Hello world"], params, use_tqdm=False)
    (word,) = first.token_ids
    assert first.text != ""  # a word: the random model's first greedy token writes text
    stop = SamplingParams(max_tokens=8, temperature=0, stop_token_ids=[word])
    (out,) = llm.generate(["Hello world"], stop, use_tqdm=False)
    assert out.finish_reason == "stop" and out.token_ids == [word] and out.text == ""
