"""Tiny Hugging Face checkpoint folders (tokenizer + chat template + generation config), made in the test.

Three tokenizers, each a BPE trained by `tokenizers` on a small corpus with accented, Greek, CJK, Hangul
and emoji text (so characters split over several tokens), saved through transformers'
`PreTrainedTokenizerFast.save_pretrained`:

- "chatml" (Qwen-like): byte-level BPE, no BOS, `<|im_start|>`/`<|im_end|>`, a ChatML template with a
  default system message and tools.
- "llama3": byte-level BPE whose `tokenizer.json` post-processor adds `<|begin_of_text|>` (no add_bos flag
  in the config), a Llama-3-style template (`bos_token`, `strftime_now`, `tojson(indent=4)`).
- "spm": SentencePiece-style BPE (`▁` for spaces, a prepended `▁`, byte-fallback tokens `<0x00>`..`<0xFF>`
  for characters out of its small alphabet, the Strip decoder), a post-processor adding `<bos>` and
  `add_bos_token: true` in the config, and a Gemma-style template (`raise_exception` on roles that do not
  alternate), kept in tokenizer_config.json.
"""

from __future__ import annotations

import json
from pathlib import Path

import transformers
from tokenizers import Tokenizer, decoders, models, normalizers, pre_tokenizers, processors, trainers

CORPUS = [
    "Hello world, this is a tiny corpus for a tiny tokenizer.",
    "The quick brown fox jumps over the lazy dog. Hello again!",
    "Café, naïve, façade, résumé, São Paulo, Zürich, Straße, smörgåsbord.",
    "Ελληνικά γράμματα και ρωσικий язык тоже.",
    "日本語のテキストと中文文本，还有한국어 문장.",
    "Emoji: 😀 🎉 👍🏽 👨‍👩‍👧 🇫🇷 and ❤️ hearts.",
    "def f(x):\n    return x * 2  # code with    spaces\n\tand tabs",
    "Numbers 12345 and 3.14159, dates 2026-12-03, money $100 €50 ¥300.",
    "I can't, you won't, they're, we've, it's, I'm here .",
    "<b>markup</b> & \"quotes\" 'single' `ticks`",
] * 3

TEXTS = [
    "",
    " ",
    "Hello world",
    " Hello  world ",
    "Café naïve façade",
    "日本語のテキスト",
    "한국어 문장",
    "😀🎉👍🏽 👨‍👩‍👧🇫🇷",
    "e\u0301 combining accent, and \u00e9 precomposed",
    "line one\nline two\n\n\ttabbed   spaced",
    "I can't , you won't .",
    "Unseen: ǅ ꙮ 𝔘𝔫𝔦𝔠𝔬𝔡𝔢 \U0001f9ec",
    "mixed Ελληνικά 中文 emoji 🎉 end.",
    "$100 €50 ¥300",
]

CHATML_TEMPLATE = """\
{%- if messages[0]['role'] == 'system' %}
    {%- set system_message = messages[0]['content'] %}
    {%- set loop_messages = messages[1:] %}
{%- else %}
    {%- set system_message = 'You are a helpful assistant.' %}
    {%- set loop_messages = messages %}
{%- endif %}
{{- '<|im_start|>system\\n' + system_message }}
{%- if tools %}
    {{- '\\n\\n# Tools\\n<tools>' }}
    {%- for tool in tools %}
        {{- '\\n' + tool | tojson }}
    {%- endfor %}
    {{- '\\n</tools>' }}
{%- endif %}
{{- '<|im_end|>\\n' }}
{%- for message in loop_messages %}
    {%- if message['role'] == 'assistant' %}
        {{- '<|im_start|>assistant\\n' }}
        {%- generation %}
        {{- message['content'] + '<|im_end|>' }}
        {%- endgeneration %}
        {{- '\\n' }}
    {%- else %}
        {{- '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>\\n' }}
    {%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}
    {{- '<|im_start|>assistant\\n' }}
    {%- if enable_thinking is defined and enable_thinking is false %}
        {{- '<think>\\n\\n</think>\\n\\n' }}
    {%- endif %}
{%- endif %}
"""

LLAMA3_TEMPLATE = """\
{{- bos_token }}
{%- set date_string = strftime_now("%d %b %Y") %}
{%- if messages[0]['role'] == 'system' %}
    {%- set system_message = messages[0]['content'] | trim %}
    {%- set messages = messages[1:] %}
{%- else %}
    {%- set system_message = "" %}
{%- endif %}
{{- "<|start_header_id|>system<|end_header_id|>\\n\\n" }}
{{- "Cutting Knowledge Date: December 2023\\nToday Date: " + date_string + "\\n\\n" }}
{%- if tools is not none %}
    {{- "You have these functions:\\n\\n" }}
    {%- for t in tools %}
        {{- t | tojson(indent=4) }}
        {{- "\\n\\n" }}
    {%- endfor %}
{%- endif %}
{{- system_message }}
{{- "<|eot_id|>" }}
{%- for message in messages %}
    {%- if loop.index0 > 6 %}{% break %}{% endif %}
    {{- '<|start_header_id|>' + message['role'] + '<|end_header_id|>\\n\\n' }}
    {{- message['content'] | trim + '<|eot_id|>' }}
{%- endfor %}
{%- if add_generation_prompt %}
    {{- '<|start_header_id|>assistant<|end_header_id|>\\n\\n' }}
{%- endif %}
"""

GEMMA_TEMPLATE = """{{ bos_token }}
{%- if messages[0]['role'] == 'system' -%}
    {%- set first_user_prefix = messages[0]['content'] + '\\n\\n' -%}
    {%- set loop_messages = messages[1:] -%}
{%- else -%}
    {%- set first_user_prefix = "" -%}
    {%- set loop_messages = messages -%}
{%- endif -%}
{%- for message in loop_messages -%}
    {%- if (message['role'] == 'user') != (loop.index0 % 2 == 0) -%}
        {{ raise_exception("Conversation roles must alternate user/assistant/user/assistant/...") }}
    {%- endif -%}
    {%- set role = "model" if message['role'] == 'assistant' else message['role'] -%}
{{ '<start_of_turn>' + role + '\\n' + (first_user_prefix if loop.first else "") }}
{{ message['content'] | trim }}<end_of_turn>
{% endfor -%}
{%- if add_generation_prompt -%}
{{ '<start_of_turn>model\\n' }}
{%- endif -%}
"""

GENERATION_CONFIG = {
    "bos_token_id": 1,
    "do_sample": True,
    "eos_token_id": [2, 7],
    "pad_token_id": 0,
    "temperature": 0.6,
    "top_k": 20,
    "top_p": 0.95,
    "transformers_version": "5.0.0",
}


def _byte_level_bpe(specials: list[str], vocab_size: int = 420) -> Tokenizer:
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        min_frequency=2,
        special_tokens=specials,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(CORPUS, trainer)
    return tok


def _spm_bpe(specials: list[str]) -> Tokenizer:
    """SentencePiece-style BPE with byte fallback: characters outside the trained alphabet become
    <0xNN> tokens."""
    tok = Tokenizer(models.BPE(byte_fallback=True, fuse_unk=True))
    tok.normalizer = normalizers.Sequence([normalizers.Prepend("▁"), normalizers.Replace(" ", "▁")])
    tok.pre_tokenizer = None
    tok.decoder = decoders.Sequence(
        [decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse(), decoders.Strip(" ", 1, 0)]
    )
    trainer = trainers.BpeTrainer(
        vocab_size=300, min_frequency=2, special_tokens=specials, limit_alphabet=70, show_progress=False
    )
    tok.train_from_iterator(CORPUS, trainer)
    data = json.loads(tok.to_str())
    vocab = data["model"]["vocab"]
    next_id = max(vocab.values()) + 1
    for b in range(256):
        name = f"<0x{b:02X}>"
        if name not in vocab:
            vocab[name] = next_id
            next_id += 1
    return Tokenizer.from_str(json.dumps(data))


def _save(tok: Tokenizer, folder: Path, **kwargs) -> Path:
    fast = transformers.PreTrainedTokenizerFast(tokenizer_object=tok, **kwargs)
    fast.save_pretrained(str(folder))
    (folder / "generation_config.json").write_text(json.dumps(GENERATION_CONFIG))
    return folder


def _make_chatml(folder: Path) -> Path:
    tok = _byte_level_bpe(["<|endoftext|>", "<|im_start|>", "<|im_end|>"])
    return _save(
        tok,
        folder,
        eos_token="<|im_end|>",
        pad_token="<|endoftext|>",
        chat_template=CHATML_TEMPLATE,
    )


def _make_llama3(folder: Path) -> Path:
    specials = [
        "<|begin_of_text|>",
        "<|end_of_text|>",
        "<|start_header_id|>",
        "<|end_header_id|>",
        "<|eot_id|>",
    ]
    tok = _byte_level_bpe(specials)
    bos = tok.token_to_id("<|begin_of_text|>")
    tok.post_processor = processors.TemplateProcessing(
        single="<|begin_of_text|> $A",
        pair="<|begin_of_text|> $A <|begin_of_text|> $B:1",
        special_tokens=[("<|begin_of_text|>", bos)],
    )
    return _save(
        tok,
        folder,
        bos_token="<|begin_of_text|>",
        eos_token="<|eot_id|>",
        chat_template=LLAMA3_TEMPLATE,
    )


def _make_spm(folder: Path) -> Path:
    specials = ["<pad>", "<eos>", "<bos>", "<unk>", "<start_of_turn>", "<end_of_turn>"]
    tok = _spm_bpe(specials)
    _save(
        tok,
        folder,  # add_bos_token here makes transformers write a post-processor adding <bos>
        bos_token="<bos>",
        eos_token="<eos>",
        pad_token="<pad>",
        unk_token="<unk>",
        add_bos_token=True,
        add_eos_token=False,
        extra_special_tokens=["<start_of_turn>", "<end_of_turn>"],
        chat_template=GEMMA_TEMPLATE,
    )
    # Keep the template in tokenizer_config.json (older checkpoints), not in chat_template.jinja.
    jinja = folder / "chat_template.jinja"
    if jinja.exists():
        jinja.unlink()
    cfg_file = folder / "tokenizer_config.json"
    cfg = json.loads(cfg_file.read_text())
    cfg["chat_template"] = GEMMA_TEMPLATE
    cfg.update(add_bos_token=True, add_eos_token=False)  # as Gemma configs write them
    cfg_file.write_text(json.dumps(cfg, indent=2))
    return folder


MAKERS = {"chatml": _make_chatml, "llama3": _make_llama3, "spm": _make_spm}
