"""HFTokenizer equals transformers' AutoTokenizer on the same checkpoint folder: ids, text, specials, len."""

from __future__ import annotations

import json
import random
import shutil

import pytest
from hf_checkpoint import TEXTS

from raystate.errors import InvalidRequest
from raystate.hf import HFTokenizer


def _ids(out):
    return out["input_ids"] if isinstance(out, dict) or hasattr(out, "keys") else out


def test_len_vocab_and_special_ids_equal_transformers(pair):
    ours, hf = pair
    assert len(ours) == len(hf)
    assert ours.vocab_size == hf.vocab_size
    assert (ours.bos_token_id, ours.eos_token_id, ours.pad_token_id, ours.unk_token_id) == (
        hf.bos_token_id,
        hf.eos_token_id,
        hf.pad_token_id,
        hf.unk_token_id,
    )
    assert (ours.bos_token, ours.eos_token, ours.pad_token) == (hf.bos_token, hf.eos_token, hf.pad_token)
    assert sorted(ours.all_special_ids) == sorted(hf.all_special_ids)


@pytest.mark.parametrize("add_special_tokens", [True, False])
def test_encode_equals_transformers(pair, add_special_tokens):
    ours, hf = pair
    for text in TEXTS:
        assert ours.encode(text, add_special_tokens) == hf.encode(
            text, add_special_tokens=add_special_tokens
        ), text


def test_specials_written_in_text_encode_to_their_ids(pair):
    ours, hf = pair
    specials = ours.all_special_tokens
    text = f"a{specials[0]}b {specials[-1]} c"
    assert ours.encode(text, False) == hf.encode(text, add_special_tokens=False)
    assert ours.token_to_id(specials[0]) in ours.encode(text, False)


@pytest.mark.parametrize("skip", [True, False])
def test_decode_equals_transformers_and_round_trips(pair, skip):
    ours, hf = pair
    for text in TEXTS:
        ids = ours.encode(text)
        assert ours.decode(ids, skip_special_tokens=skip) == hf.decode(ids, skip_special_tokens=skip)
        assert ours.decode(ours.encode(text, False)) == hf.decode(
            hf.encode(text, add_special_tokens=False), skip_special_tokens=True
        )


def test_decode_of_arbitrary_ids_equals_transformers(pair):
    """Sampled ids need not make valid UTF-8 or sensible text; both decode them the same way."""
    ours, hf = pair
    rng = random.Random(0)
    for _ in range(200):
        ids = [rng.randrange(len(ours)) for _ in range(rng.randrange(1, 24))]
        for skip in (True, False):
            assert ours.decode(ids, skip_special_tokens=skip) == hf.decode(ids, skip_special_tokens=skip)


def test_convert_ids_to_tokens_equals_transformers(pair):
    ours, hf = pair
    ids = list(range(len(ours)))
    assert ours.convert_ids_to_tokens(ids) == hf.convert_ids_to_tokens(ids)
    assert ours.convert_ids_to_tokens(ids, skip_special_tokens=True) == hf.convert_ids_to_tokens(
        ids, skip_special_tokens=True
    )
    assert ours.convert_ids_to_tokens(5) == hf.convert_ids_to_tokens(5)


def test_bos_is_added_as_each_family_configures_it(checkpoints):
    chatml = HFTokenizer.from_pretrained(checkpoints["chatml"])
    assert chatml.bos_token_id is None and chatml.encode("Hi") == chatml.encode("Hi", False)
    llama3 = HFTokenizer.from_pretrained(checkpoints["llama3"])  # tokenizer.json's post-processor adds it
    assert llama3.encode("Hi") == [llama3.bos_token_id, *llama3.encode("Hi", False)]
    spm = HFTokenizer.from_pretrained(checkpoints["spm"])  # add_bos_token: true in tokenizer_config.json
    assert spm.encode("Hi") == [spm.bos_token_id, *spm.encode("Hi", False)]


@pytest.mark.parametrize(
    "flags",
    [{"add_bos_token": False}, {"add_eos_token": True}, {"add_bos_token": True, "add_eos_token": True}],
)
def test_config_bos_eos_flags_yield_to_tokenizer_json(checkpoints, tmp_path, flags):
    """transformers 5 drops the config's add_bos_token/add_eos_token when there is a tokenizer.json: its
    post-processor decides (here: BOS, no EOS)."""
    import transformers

    folder = tmp_path / "ckpt"
    shutil.copytree(checkpoints["llama3"], folder)
    cfg = json.loads((folder / "tokenizer_config.json").read_text())
    cfg.update(flags)
    (folder / "tokenizer_config.json").write_text(json.dumps(cfg))
    ours, hf = HFTokenizer.from_pretrained(folder), transformers.AutoTokenizer.from_pretrained(str(folder))
    for text in ("Hello world", "", "日本語"):
        assert ours.encode(text) == hf.encode(text) == [ours.bos_token_id, *ours.encode(text, False)]
    assert ours.add_bos_token and not ours.add_eos_token


@pytest.mark.parametrize(
    ("flags", "expect_bos", "expect_eos"),
    [
        ({"add_bos_token": False}, False, False),
        ({"add_eos_token": True}, False, True),  # a flag left out counts as false
        ({"add_bos_token": True, "add_eos_token": True}, True, True),
    ],
)
@pytest.mark.parametrize("name", ["llama3", "chatml"])
def test_bos_eos_flags_given_to_from_pretrained_match_transformers(
    checkpoints, name, flags, expect_bos, expect_eos
):
    import transformers

    ours = HFTokenizer.from_pretrained(checkpoints[name], **flags)
    hf = transformers.AutoTokenizer.from_pretrained(str(checkpoints[name]), **flags)
    expect_bos = expect_bos and ours.bos_token_id is not None  # chatml has no BOS token
    for text in ("Hello world", "", "日本語"):
        ids = ours.encode(text)
        assert ids == hf.encode(text), (flags, text)
        body = ours.encode(text, False)
        assert ids == [ours.bos_token_id] * expect_bos + body + [ours.eos_token_id] * expect_eos
    assert (ours.add_bos_token, ours.add_eos_token) == (expect_bos, expect_eos)


def test_lone_surrogate_is_an_invalid_request(checkpoints):
    tok = HFTokenizer.from_pretrained(checkpoints["chatml"])
    with pytest.raises(InvalidRequest, match="text"):
        tok.encode("a\ud800b")


def test_folder_without_tokenizer_json_is_refused(tmp_path):
    with pytest.raises(InvalidRequest, match="tokenizer.json"):
        HFTokenizer.from_pretrained(tmp_path)


def test_ids_beyond_the_tokenizer_carry_no_text(checkpoints):
    """A model's embedding may have more rows than the tokenizer has tokens; such a sampled id decodes
    to nothing, as in transformers, instead of failing the request."""
    tok = HFTokenizer.from_pretrained(checkpoints["chatml"])
    ids = tok.encode("Hello", False)
    assert tok.decode([*ids, len(tok) + 5]) == "Hello"


def test_legacy_special_tokens_map_and_model_specific_tokens(checkpoints, tmp_path):
    """Without added_tokens_decoder in the config, special_tokens_map.json is read and its values win;
    a config key like `boi_token` names one more special token (added when not in the vocabulary), which a
    chat template sees by name."""
    import transformers

    folder = tmp_path / "legacy"
    shutil.copytree(checkpoints["spm"], folder)
    cfg_file = folder / "tokenizer_config.json"
    cfg = json.loads(cfg_file.read_text())
    cfg.pop("added_tokens_decoder", None)
    cfg["boi_token"] = "<start_of_image>"
    cfg["chat_template"] = (
        "{{ bos_token }}{{ boi_token }}{% for m in messages %}{{ m.content }}{{ eos_token }}{% endfor %}"
    )
    cfg_file.write_text(json.dumps(cfg))
    special_map = {
        "bos_token": {
            "content": "<bos>",
            "lstrip": False,
            "normalized": False,
            "rstrip": False,
            "single_word": False,
        },
        "eos_token": "<end_of_turn>",
    }
    (folder / "special_tokens_map.json").write_text(json.dumps(special_map))
    ours, hf = HFTokenizer.from_pretrained(folder), transformers.AutoTokenizer.from_pretrained(str(folder))
    assert len(ours) == len(hf)
    assert ours.eos_token == hf.eos_token == "<end_of_turn>" and ours.eos_token_id == hf.eos_token_id
    assert ours.all_special_tokens == hf.all_special_tokens and ours.all_special_ids == hf.all_special_ids
    assert ours.special_tokens_map == hf.special_tokens_map
    text = "look <start_of_image> here<end_of_turn>"
    assert ours.encode(text) == hf.encode(text)
    assert ours.token_to_id("<start_of_image>") in ours.encode(text)
    ids = ours.encode(text)
    assert ours.decode(ids) == hf.decode(ids, skip_special_tokens=True)
    msgs = [{"role": "user", "content": "Hi"}]
    assert ours.apply_chat_template(msgs) == hf.apply_chat_template(
        msgs, tokenize=False, add_generation_prompt=True
    )


def test_bad_words_encode_each_word_at_the_start_and_after_a_space(pair):
    """vLLM's rule for bad_words on transformers' ids: the word (leading whitespace dropped) as it starts
    the text, and after a space where that gives another first token in as many tokens."""
    from raystate.serve.text import ModelText

    ours, hf = pair
    words = ["Hello", "  world", "Café naïve", "日本語", "can't"]
    got = ModelText(ours, is_hf=True).bad_words_token_ids(words)
    want = []
    for w in words:
        alone = hf.encode(w.lstrip(), add_special_tokens=False)
        spaced = hf.encode(" " + w.lstrip(), add_special_tokens=False)
        for ids in [alone, spaced] if spaced[0] != alone[0] and len(spaced) == len(alone) else [alone]:
            if ids not in want:
                want.append(ids)
    assert got == want
    assert len(got) > len(words)  # some word's mid-text form is its own sequence
    with pytest.raises(InvalidRequest, match="bad_words"):
        ModelText(ours, is_hf=True).bad_words_token_ids(["\ud800"])
