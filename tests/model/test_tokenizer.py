"""ByteTokenizer: exact round trips, specials, invalid bytes, chat template."""

import pytest

from raystate.config import BOS_ID, BYTE_VOCAB_SIZE, EOS_ID, PAD_ID
from raystate.errors import InvalidRequest
from raystate.tokenizer import ByteTokenizer

TEXTS = ["", "Hello, world!", "naïve café — 東京 🚀", "tabs\tand\nnewlines\r\n", "\x00\x7f"]


@pytest.mark.parametrize("text", TEXTS)
def test_round_trip(text):
    tok = ByteTokenizer()
    ids = tok.encode(text)
    assert ids[0] == BOS_ID and ids[1:] == list(text.encode("utf-8"))
    assert all(0 <= i < tok.vocab_size for i in ids)
    assert tok.decode(ids) == text
    assert tok.encode(text, add_bos=False) == ids[1:]


def test_specials():
    tok = ByteTokenizer()
    assert (tok.bos_token_id, tok.eos_token_id, tok.pad_token_id, tok.vocab_size) == (
        BOS_ID,
        EOS_ID,
        PAD_ID,
        BYTE_VOCAB_SIZE,
    )
    ids = [BOS_ID, *"é".encode(), EOS_ID, PAD_ID]
    assert tok.decode(ids) == "é"
    assert tok.decode(ids, skip_special_tokens=False) == "<|bos|>é<|eos|><|pad|>"
    with pytest.raises(InvalidRequest):
        tok.decode([BYTE_VOCAB_SIZE])


def test_multibyte_character_split_by_a_special_is_replaced_not_raised():
    tok = ByteTokenizer()
    e_acute = list("é".encode())
    assert tok.decode([e_acute[0], EOS_ID, e_acute[1]]) == "é"  # skipped specials don't split bytes
    assert tok.decode([e_acute[0], EOS_ID, e_acute[1]], skip_special_tokens=False) == "\ufffd<|eos|>\ufffd"
    assert tok.decode([0xFF, ord("a")]) == "\ufffda"


def test_chat_template():
    tok = ByteTokenizer()
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}]
    prompt = tok.apply_chat_template(messages)
    assert prompt == "<|system|>\nBe brief.\n<|user|>\nHi\n<|assistant|>\n"
    assert tok.apply_chat_template(messages, add_generation_prompt=False) == prompt.removesuffix(
        "<|assistant|>\n"
    )
    parts = [{"role": "user", "content": [{"type": "text", "text": "Hi"}]}]
    assert tok.apply_chat_template(parts) == "<|user|>\nHi\n<|assistant|>\n"
    with pytest.raises(InvalidRequest, match="role"):
        tok.apply_chat_template([{"role": "robot", "content": "x"}])
