"""Chat prompts equal transformers' `apply_chat_template(..., tokenize=False)` on the same checkpoint."""

from __future__ import annotations

import json
import shutil

import pytest
import transformers
from hf_checkpoint import CHATML_TEMPLATE, GEMMA_TEMPLATE

from raystate.hf import ChatTemplateError, HFTokenizer
from raystate.hf.chat_template import render_chat_template

WEATHER_TOOL = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Weather in a city <b>now</b> — e.g. Zürich",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string", "description": "The city's name"}},
            "required": ["city"],
        },
    },
}

CONVERSATIONS = {
    "user": [{"role": "user", "content": "Hello!"}],
    "system": [
        {"role": "system", "content": "You are terse. "},
        {"role": "user", "content": "What is 2+2?"},
    ],
    "multi_turn": [
        {"role": "system", "content": "Be kind."},
        {"role": "user", "content": "Hi there"},
        {"role": "assistant", "content": "Hello! How can I help?"},
        {"role": "user", "content": "Say café, 日本語 and 🎉 please.  "},
    ],
    "no_system_multi": [
        {"role": "user", "content": "One"},
        {"role": "assistant", "content": "Two"},
        {"role": "user", "content": "Three"},
        {"role": "assistant", "content": "Four"},
    ],
}


def _hf_ids(out):
    return list(out["input_ids"]) if hasattr(out, "keys") else list(out)


@pytest.mark.parametrize("conversation", sorted(CONVERSATIONS))
@pytest.mark.parametrize("add_generation_prompt", [True, False])
def test_prompt_equals_transformers(pair, conversation, add_generation_prompt):
    ours, hf = pair
    messages = CONVERSATIONS[conversation]
    want = hf.apply_chat_template(messages, tokenize=False, add_generation_prompt=add_generation_prompt)
    got = ours.apply_chat_template(messages, add_generation_prompt=add_generation_prompt)
    assert got == want
    ids = ours.apply_chat_template(messages, add_generation_prompt=add_generation_prompt, tokenize=True)
    hf_ids = hf.apply_chat_template(messages, tokenize=True, add_generation_prompt=add_generation_prompt)
    assert ids == _hf_ids(hf_ids)


@pytest.mark.parametrize("conversation", ["user", "system"])
def test_prompt_with_tools_equals_transformers(pair, conversation):
    ours, hf = pair
    messages = CONVERSATIONS[conversation]
    want = hf.apply_chat_template(messages, tools=[WEATHER_TOOL], tokenize=False, add_generation_prompt=True)
    assert ours.apply_chat_template(messages, tools=[WEATHER_TOOL]) == want


def test_extra_template_kwargs_and_continue_final_message(checkpoints):
    ours = HFTokenizer.from_pretrained(checkpoints["chatml"])
    hf = transformers.AutoTokenizer.from_pretrained(str(checkpoints["chatml"]))
    msgs = CONVERSATIONS["user"]
    want = hf.apply_chat_template(msgs, tokenize=False, add_generation_prompt=True, enable_thinking=False)
    assert ours.apply_chat_template(msgs, enable_thinking=False) == want
    assert "<think>" in want
    prefill = [*msgs, {"role": "assistant", "content": "Sure, the answer is"}]
    want = hf.apply_chat_template(
        prefill, tokenize=False, add_generation_prompt=False, continue_final_message=True
    )
    got = ours.apply_chat_template(prefill, add_generation_prompt=False, continue_final_message=True)
    assert got == want and got.endswith("the answer is")


def test_template_refusal_is_a_chat_template_error(checkpoints):
    ours = HFTokenizer.from_pretrained(checkpoints["spm"])  # Gemma-style: roles must alternate
    bad = [{"role": "user", "content": "a"}, {"role": "user", "content": "b"}]
    with pytest.raises(ChatTemplateError, match="alternate"):
        ours.apply_chat_template(bad)
    hf = transformers.AutoTokenizer.from_pretrained(str(checkpoints["spm"]))
    with pytest.raises(Exception, match="alternate"):
        hf.apply_chat_template(bad, tokenize=False)


def test_template_locations(checkpoints, tmp_path):
    """chat_template.jinja wins over tokenizer_config.json; a list in the config gives named templates,
    "tool_use" chosen when tools are given, "default" otherwise; both as transformers picks them."""
    folder = tmp_path / "named"
    shutil.copytree(checkpoints["spm"], folder)
    cfg_file = folder / "tokenizer_config.json"
    cfg = json.loads(cfg_file.read_text())
    tool_template = (
        "{{ bos_token }}TOOLS {{ tools | tojson }}{% for m in messages %}[{{ m.content }}]{% endfor %}"
    )
    cfg["chat_template"] = [
        {"name": "default", "template": GEMMA_TEMPLATE},
        {"name": "tool_use", "template": tool_template},
    ]
    cfg_file.write_text(json.dumps(cfg))
    ours = HFTokenizer.from_pretrained(folder)
    hf = transformers.AutoTokenizer.from_pretrained(str(folder))
    msgs = CONVERSATIONS["multi_turn"]
    for tools in (None, [WEATHER_TOOL]):
        want = hf.apply_chat_template(msgs, tools=tools, tokenize=False, add_generation_prompt=True)
        assert ours.apply_chat_template(msgs, tools=tools) == want
    assert ours.apply_chat_template(msgs, tools=[WEATHER_TOOL]).startswith("<bos>TOOLS")

    (folder / "chat_template.jinja").write_text(CHATML_TEMPLATE)
    cfg["chat_template"] = GEMMA_TEMPLATE
    cfg_file.write_text(json.dumps(cfg))
    ours = HFTokenizer.from_pretrained(folder)
    hf = transformers.AutoTokenizer.from_pretrained(str(folder))
    want = hf.apply_chat_template(msgs, tokenize=False, add_generation_prompt=True)
    assert ours.apply_chat_template(msgs) == want
    assert want.startswith("<|im_start|>system")


def test_environment_features():
    """The environment transformers renders in: trim_blocks/lstrip_blocks, loop controls, the generation
    block, tojson without HTML escaping, raise_exception, strftime_now, sandboxing."""
    src = (
        "{% for m in messages %}\n"
        "  {% if loop.index0 == 2 %}{% break %}{% endif %}\n"
        "{% generation %}{{ m.content | tojson }}{% endgeneration %}\n"
        "{% endfor %}"
        "{{ strftime_now('%Y') | length }}"
    )
    msgs = [{"content": "<b>é</b>"}, {"content": 'q"'}, {"content": "never"}]
    assert render_chat_template(src, msgs) == '"<b>é</b>""q\\""4'
    with pytest.raises(ChatTemplateError, match="nope"):
        render_chat_template("{{ raise_exception('nope') }}", msgs)
    with pytest.raises(ChatTemplateError):  # the sandbox refuses attribute tricks
        render_chat_template("{{ messages.__class__.__mro__ }}", msgs)
    with pytest.raises(ChatTemplateError):  # immutable: no in-place list changes
        render_chat_template("{{ messages.append(1) }}", msgs)


# A Qwen-style template: tools in the system turn, calls as <tool_call> blocks, tool answers as user turns.
HERMES_TEMPLATE = """\
{%- if tools %}<|im_start|>system
# Tools
<tools>
{%- for tool in tools %}
{{ tool | tojson }}
{%- endfor %}
</tools><|im_end|>
{% endif %}
{%- for message in messages %}
{%- if message.role == "assistant" %}<|im_start|>assistant
{%- if message.content %}
{{ message.content }}
{%- endif %}
{%- for tool_call in message.tool_calls or [] %}
{%- set call = tool_call.function if tool_call.function else tool_call %}
{%- set args = call.arguments | tojson if call.arguments is not string else call.arguments %}
<tool_call>
{"name": "{{ call.name }}", "arguments": {{ args }}}
</tool_call>
{%- endfor %}<|im_end|>
{% elif message.role == "tool" %}<|im_start|>user
<tool_response>
{{ message.content }}
</tool_response><|im_end|>
{% else %}<|im_start|>{{ message.role }}
{{ message.content }}<|im_end|>
{% endif %}
{%- endfor %}
{%- if add_generation_prompt %}<|im_start|>assistant
{% endif %}"""


def test_a_tool_conversation_from_the_api_renders_as_transformers_renders_it(checkpoints, tmp_path):
    """The chat route's messages (arguments as the JSON text OpenAI clients send) reach the template as
    transformers expects them (arguments as an object), and the template's <tool_call> format is
    recognised for tool_choice "auto"."""
    from raystate.serve.protocol import ChatCompletionRequest, template_tools
    from raystate.serve.text import ModelText
    from raystate.serve.tool_calls import parser_for_template

    folder = tmp_path / "hermes"
    shutil.copytree(checkpoints["chatml"], folder)
    (folder / "chat_template.jinja").write_text(HERMES_TEMPLATE)
    call = {"id": "call_1", "type": "function", "function": {"name": "get_weather"}}
    request = ChatCompletionRequest(
        messages=[
            {"role": "user", "content": "Weather in Zürich?"},
            {
                "role": "assistant",
                "content": None,
                "tool_calls": [call | {"function": call["function"] | {"arguments": '{"city": "Zürich"}'}}],
            },
            {"role": "tool", "tool_call_id": "call_1", "content": "18 C"},
        ],  # fmt: skip
        tools=[WEATHER_TOOL],
    )
    text = ModelText(HFTokenizer.from_pretrained(folder), is_hf=True, name="hermes")
    got, _ = text.chat_prompt(
        [m.template_fields() for m in request.messages], tools=template_tools(request.tools)
    )
    hf = transformers.AutoTokenizer.from_pretrained(str(folder))
    messages = [
        {"role": "user", "content": "Weather in Zürich?"},
        {
            "role": "assistant",
            "tool_calls": [call | {"function": call["function"] | {"arguments": {"city": "Zürich"}}}],
        },
        {"role": "tool", "tool_call_id": "call_1", "content": "18 C"},
    ]
    want = hf.apply_chat_template(messages, tools=[WEATHER_TOOL], tokenize=False, add_generation_prompt=True)
    assert got == want
    assert '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Zürich"}}\n</tool_call>' in got
    assert parser_for_template(text.chat_template_source()) == "hermes"
