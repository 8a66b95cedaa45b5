"""Byte-level tokenizer of the reference model: every UTF-8 byte is a token, then BOS, EOS and PAD.

No vocabulary file and no merges, so any text round-trips exactly and the tokenizer needs no I/O. Token
ids match `raystate.config` (bytes 0..255, BOS 256, EOS 257, PAD 258).
"""

from __future__ import annotations

import json
from collections.abc import Iterable

from raystate.config import BOS_ID, BYTE_VOCAB_SIZE, EOS_ID, NUM_BYTES, PAD_ID
from raystate.errors import InvalidRequest

_SPECIAL_TEXT = {BOS_ID: "<|bos|>", EOS_ID: "<|eos|>", PAD_ID: "<|pad|>"}


class ByteTokenizer:
    """Text <-> byte ids; specials are skipped on decode unless asked for."""

    bos_token_id = BOS_ID
    eos_token_id = EOS_ID
    pad_token_id = PAD_ID

    @property
    def vocab_size(self) -> int:
        return BYTE_VOCAB_SIZE

    def encode(self, text: str, add_bos: bool = True) -> list[int]:
        """UTF-8 bytes, after BOS. Text that is not valid Unicode (a lone surrogate, which JSON's "\\ud800"
        escape can carry) raises InvalidRequest, a ValueError naming it, rather than UnicodeEncodeError."""
        try:
            ids = list(text.encode("utf-8"))
        except UnicodeEncodeError as e:
            raise InvalidRequest("text", "valid Unicode (no lone surrogates)", text[e.start]) from None
        return [BOS_ID, *ids] if add_bos else ids

    def decode(self, ids: Iterable[int], skip_special_tokens: bool = True) -> str:
        """Bytes are decoded together, so a multi-byte character split across tokens comes back whole.

        Invalid UTF-8 (a sampled byte sequence need not be valid) becomes U+FFFD instead of raising.
        """
        parts: list[str] = []
        pending = bytearray()
        for tok in ids:
            tok = int(tok)
            if 0 <= tok < NUM_BYTES:
                pending.append(tok)
                continue
            if tok not in _SPECIAL_TEXT:
                raise InvalidRequest("token id", f"in [0, {BYTE_VOCAB_SIZE})", tok)
            if skip_special_tokens:
                continue
            parts.append(pending.decode("utf-8", errors="replace"))
            pending.clear()
            parts.append(_SPECIAL_TEXT[tok])
        parts.append(pending.decode("utf-8", errors="replace"))
        return "".join(parts)

    def __len__(self) -> int:
        """Every id, specials included, as Hugging Face's `len(tokenizer)` counts them."""
        return BYTE_VOCAB_SIZE

    def convert_ids_to_tokens(self, ids: int | Iterable[int]) -> str | list[str]:
        """Raw token strings, as Hugging Face's method of that name: "<0x41>" for byte 0x41 (any byte, so a
        lone continuation byte has one too), the special's text for BOS, EOS and PAD."""
        if isinstance(ids, Iterable):
            return [self.convert_ids_to_tokens(i) for i in ids]
        tok = int(ids)
        if 0 <= tok < NUM_BYTES:
            return f"<0x{tok:02X}>"
        if tok not in _SPECIAL_TEXT:
            raise InvalidRequest("token id", f"in [0, {BYTE_VOCAB_SIZE})", tok)
        return _SPECIAL_TEXT[tok]

    def apply_chat_template(
        self, messages: list[dict], add_generation_prompt: bool = True, tools: list[dict] | None = None
    ) -> str:
        """Plain text: "<|tools|>\\n" and the tools as one JSON line first when there are any, then
        "<|role|>\\ncontent\\n" per message (an assistant turn's tool calls after its content, one JSON
        object a line), then "<|assistant|>\\n" to prompt a reply."""
        out = [f"<|tools|>\n{json.dumps(tools, ensure_ascii=False)}\n"] if tools else []
        for i, msg in enumerate(messages):
            role, content = msg.get("role"), msg.get("content")
            if isinstance(content, list):  # OpenAI content parts: keep the text ones
                content = "".join(p.get("text", "") for p in content if p.get("type") == "text")
            if role not in ("system", "user", "assistant", "tool"):
                raise InvalidRequest(f"messages[{i}].role", "one of system, user, assistant, tool", role)
            calls = msg.get("tool_calls") or []
            if content is None and calls:
                content = ""
            if not isinstance(content, str):
                raise InvalidRequest(f"messages[{i}].content", "a string", content)
            out.append(f"<|{role}|>\n{content}\n")
            out += [f"{json.dumps(c.get('function', c), ensure_ascii=False)}\n" for c in calls]
        if add_generation_prompt:
            out.append("<|assistant|>\n")
        return "".join(out)
