"""Chat templates rendered as transformers' ``apply_chat_template`` renders them."""

import json

import pytest

from tests.loading.gguf_models import GEMMA, SMOLLM, gguf_path, hf_tokenizer
from xinfer.text.chat_template import ChatTemplate, ChatTemplateError
from xinfer.text.tokenizer import Tokenizer

TURNS = [
    {"role": "user", "content": "Hi! Who are you?"},
    {"role": "assistant", "content": "  A helpful assistant.  "},
    {"role": "user", "content": "Écris « bonjour » en 日本語 🙂"},
]
CONVERSATIONS = {
    "system": [{"role": "system", "content": "You answer briefly."}, *TURNS],
    "no-system": TURNS,
    "single-turn": TURNS[:1],
}

# Gemma-3-270M is a base model without a template; this one is written in Gemma's turn
# format (system text folded into the first user turn, "model" role, BOS from the template)
GEMMA_STYLE_TEMPLATE = """{{ bos_token }}
{%- if messages[0]['role'] == 'system' -%}
    {%- set prefix = messages[0]['content'] + '\n\n' -%}
    {%- set turns = messages[1:] -%}
{%- else -%}
    {%- set prefix = '' -%}
    {%- set turns = messages -%}
{%- endif -%}
{%- for message in turns -%}
    {%- if (message['role'] == 'user') != loop.index0 is even -%}
        {{ raise_exception('roles must alternate user/assistant') }}
    {%- endif -%}
    {%- set role = 'model' if message['role'] == 'assistant' else message['role'] -%}
    {{ '<start_of_turn>' + role + '\n' + (prefix if loop.first else '') }}
    {{- message['content'] | trim }}<end_of_turn>
{% endfor -%}
{%- if add_generation_prompt -%}
    {{ '<start_of_turn>model\n' }}
{%- endif -%}
"""

# what HF templates lean on: tojson (no HTML escaping, kwargs), namespace, loop controls,
# tools, whitespace control by trim_blocks/lstrip_blocks
FEATURES_TEMPLATE = """
{%- set ns = namespace(count=0) %}
{% if tools %}
  Tools: {{ tools | tojson }}
  Indented: {{ tools[0] | tojson(indent=2) }}
{% endif %}
{% for m in messages %}
    {% if m.role == 'system' %}{% continue %}{% endif %}
    {% set ns.count = ns.count + 1 %}
    [{{ m.role }}] {{ m.content }}
    {% if ns.count > 2 %}{% break %}{% endif %}
{% endfor %}
{{ ns.count }} {{ 'gen' if add_generation_prompt else 'nogen' }} {{ eos_token }}
"""
# the assistant's text in a {% generation %} block (training masks), its reasoning under the name templates read
GENERATION_TEMPLATE = """{% for m in messages %}{% if m.role == 'assistant' %}{% generation %}
{% if m.reasoning_content is defined %}<think>{{ m.reasoning_content }}</think>{% endif %}
{% if m.thinking is defined %}({{ m.thinking }}){% endif %}{{ m.content }}{% endgeneration %}
{% else %}{{ m.role }}: {{ m.content }}{% endif %}|{% endfor %}"""
REASONING_TURNS = [
    {"role": "user", "content": "2+2?"},
    {"role": "assistant", "content": "4", "reasoning": "two and two"},  # vLLM's name
    {"role": "user", "content": "3+3?"},
    {"role": "assistant", "content": "6", "thinking": "three and three"},  # gpt-oss's name
]

TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "description": 'Météo <à> & "lieu"',
            "parameters": {"type": "object", "properties": {"city": {"type": "string"}}},
        },
    }
]


@pytest.fixture(scope="module")
def smollm():
    return Tokenizer.from_gguf(gguf_path(SMOLLM))


@pytest.fixture(scope="module")
def gemma_folder(tmp_path_factory):
    """An HF tokenizer folder (saved by transformers) whose config carries a chat template;
    with transformers' and our reading of it."""
    from transformers import AutoTokenizer

    folder = tmp_path_factory.mktemp("gemma-tokenizer")
    hf_tokenizer(GEMMA).save_pretrained(folder)
    config_file = folder / "tokenizer_config.json"
    config = json.loads(config_file.read_text())
    config["chat_template"] = GEMMA_STYLE_TEMPLATE
    config_file.write_text(json.dumps(config))
    (folder / "chat_template.jinja").unlink(missing_ok=True)
    return AutoTokenizer.from_pretrained(folder), Tokenizer.from_folder(folder)


@pytest.mark.parametrize("add_generation_prompt", [True, False])
@pytest.mark.parametrize("conversation", sorted(CONVERSATIONS))
def test_smollm_gguf_template_matches_transformers(smollm, conversation, add_generation_prompt):
    messages = CONVERSATIONS[conversation]
    expected = hf_tokenizer(SMOLLM).apply_chat_template(
        messages, tokenize=False, add_generation_prompt=add_generation_prompt
    )
    assert smollm.chat_template.render(messages, add_generation_prompt=add_generation_prompt) == expected


@pytest.mark.parametrize("conversation", sorted(CONVERSATIONS))
def test_smollm_chat_ids_match_transformers(smollm, conversation):
    messages = CONVERSATIONS[conversation]
    expected = hf_tokenizer(SMOLLM).apply_chat_template(messages, tokenize=True, add_generation_prompt=True)
    expected = expected["input_ids"] if isinstance(expected, dict) or hasattr(expected, "keys") else expected
    assert smollm.apply_chat_template(messages) == list(expected)


def test_gemma_gguf_has_no_template_like_transformers():
    assert Tokenizer.from_gguf(gguf_path(GEMMA)).chat_template is None
    assert hf_tokenizer(GEMMA).chat_template is None


@pytest.mark.parametrize("add_generation_prompt", [True, False])
@pytest.mark.parametrize("conversation", sorted(CONVERSATIONS))
def test_gemma_folder_template_matches_transformers(gemma_folder, conversation, add_generation_prompt):
    reference, ours = gemma_folder
    messages = CONVERSATIONS[conversation]
    expected = reference.apply_chat_template(messages, tokenize=False, add_generation_prompt=add_generation_prompt)
    rendered = ours.chat_template.render(messages, add_generation_prompt=add_generation_prompt)
    assert rendered == expected
    assert ours.encode(rendered, add_special_tokens=False) == reference.encode(rendered, add_special_tokens=False)
    assert ours.encode("hello") == reference.encode("hello")  # BOS rule of the folder
    assert (ours.bos_token, ours.eos_token) == (reference.bos_token, reference.eos_token)


@pytest.mark.parametrize("add_generation_prompt", [True, False])
def test_template_features_match_transformers(smollm, add_generation_prompt):
    messages = CONVERSATIONS["system"]
    expected = hf_tokenizer(SMOLLM).apply_chat_template(
        messages,
        tools=TOOLS,
        chat_template=FEATURES_TEMPLATE,
        tokenize=False,
        add_generation_prompt=add_generation_prompt,
    )
    ours = ChatTemplate(FEATURES_TEMPLATE, "test", smollm.special_tokens)
    assert ours.render(messages, add_generation_prompt=add_generation_prompt, tools=TOOLS) == expected


def test_generation_blocks_and_reasoning_names_like_transformers(smollm):
    expected = hf_tokenizer(SMOLLM).apply_chat_template(
        REASONING_TURNS, chat_template=GENERATION_TEMPLATE, tokenize=False
    )
    assert ChatTemplate(GENERATION_TEMPLATE, "test").render(REASONING_TURNS, add_generation_prompt=False) == expected


@pytest.mark.parametrize("final", ["1, 2, 3,", " Sure:  ", ""])
@pytest.mark.parametrize("template", ["smollm2", "gemma-style"])
def test_continue_final_message_like_transformers(smollm, template, final):
    """The prompt ends where the final message's text does; a template that trims the text trims the space after."""
    source = smollm.chat_template.source if template == "smollm2" else GEMMA_STYLE_TEMPLATE
    messages = [*TURNS[:1], {"role": "assistant", "content": final}]
    expected = hf_tokenizer(SMOLLM).apply_chat_template(
        messages, chat_template=source, tokenize=False, add_generation_prompt=False, continue_final_message=True
    )
    ours = ChatTemplate(source, "test", smollm.special_tokens)
    assert ours.render(messages, add_generation_prompt=False, continue_final_message=True) == expected


def test_template_drops_none_fields_like_transformers(smollm):
    messages = [{"role": "user", "content": "hi", "tool_calls": None}]
    template = "{% for m in messages %}{{ m.role }}:{{ 'tool_calls' in m }}{% endfor %}"
    expected = hf_tokenizer(SMOLLM).apply_chat_template(messages, chat_template=template, tokenize=False)
    assert ChatTemplate(template, "test").render(messages) == expected


def test_syntax_error_names_the_file(tmp_path):
    (tmp_path / "tokenizer.json").write_text(hf_tokenizer(SMOLLM).backend_tokenizer.to_str())
    (tmp_path / "chat_template.jinja").write_text("{% for m in messages %}{{ m.content }")
    with pytest.raises(ChatTemplateError, match=r"chat_template\.jinja"):
        Tokenizer.from_folder(tmp_path)


def test_raise_exception_names_the_gguf(smollm):
    gemma_style = ChatTemplate(GEMMA_STYLE_TEMPLATE, f"GGUF metadata of {gguf_path(SMOLLM)}", {"bos_token": "<bos>"})
    with pytest.raises(ChatTemplateError, match="roles must alternate") as error:
        gemma_style.render([{"role": "assistant", "content": "first"}])
    assert f"GGUF metadata of {gguf_path(SMOLLM)}" in str(error.value)


def test_undefined_is_an_error_naming_the_origin():
    template = ChatTemplate("{{ messages[0].content.missing.deeper }}", "somewhere/tokenizer_config.json")
    with pytest.raises(ChatTemplateError, match=r"somewhere/tokenizer_config\.json.*Undefined"):
        template.render([{"role": "user", "content": "x"}])


def test_sandbox_refuses_python_internals():
    template = ChatTemplate("{{ messages.__class__.__mro__[1].__subclasses__() }}", "evil.gguf")
    with pytest.raises(ChatTemplateError, match=r"evil\.gguf"):
        template.render([{"role": "user", "content": "x"}])


# a template that writes a message's content as a string or loops over its parts (Gemma 3's way), and one that
# writes it as it is (ChatML's): text parts reach the first as a list, the second joined by newlines (vLLM's "auto")
LOOPING_TEMPLATE = """{% for m in messages %}<{{ m.role }}>
{%- if m['content'] is string %}{{ m['content'] }}{% else %}{% for part in m['content'] %}{{ part.text }}{% endfor %}
{%- endif %}|{% endfor %}"""
PLAIN_TEMPLATE = "{% for m in messages %}<{{ m.role }}>{{ m.content }}|{% endfor %}"
PARTS = [{"role": "user", "content": [{"type": "text", "text": "part one"}, {"type": "text", "text": "part two"}]}]


def smollm_folder(folder, **config):
    """SmolLM2's tokenizer saved by transformers, its config's fields replaced by ``config``."""
    hf_tokenizer(SMOLLM).save_pretrained(folder)
    (folder / "chat_template.jinja").unlink(missing_ok=True)
    config_file = folder / "tokenizer_config.json"
    config_file.write_text(json.dumps({**json.loads(config_file.read_text()), **config}))
    return folder


@pytest.mark.parametrize("template, content_format", [(LOOPING_TEMPLATE, "openai"), (PLAIN_TEMPLATE, "string")])
def test_text_parts_reach_the_template_as_it_reads_content(tmp_path, template, content_format):
    from transformers import AutoTokenizer

    from xinfer.server.prompts import render_chat
    from xinfer.server.protocol import ChatMessage

    ours = Tokenizer.from_folder(smollm_folder(tmp_path, chat_template=template))
    assert ours.chat_template.content_format == content_format
    joined = [{"role": "user", "content": "part one\npart two"}]
    expected = AutoTokenizer.from_pretrained(tmp_path).apply_chat_template(
        PARTS if content_format == "openai" else joined, tokenize=False, add_generation_prompt=False
    )
    messages = [ChatMessage.model_validate(m) for m in PARTS]
    assert render_chat(ours, messages, add_generation_prompt=False) == expected


@pytest.mark.parametrize("layout", ["config list", "additional_chat_templates"])
def test_tools_choose_the_tool_use_template_like_transformers(tmp_path, layout):
    from transformers import AutoTokenizer

    tool_use = "{% for t in tools %}[{{ t.function.name }}]{% endfor %}" + PLAIN_TEMPLATE
    if layout == "config list":
        templates = [{"name": "default", "template": PLAIN_TEMPLATE}, {"name": "tool_use", "template": tool_use}]
        smollm_folder(tmp_path, chat_template=templates)
    else:
        smollm_folder(tmp_path)
        (tmp_path / "chat_template.jinja").write_text(PLAIN_TEMPLATE)
        (tmp_path / "additional_chat_templates").mkdir()
        (tmp_path / "additional_chat_templates" / "tool_use.jinja").write_text(tool_use)
    reference, ours = AutoTokenizer.from_pretrained(tmp_path), Tokenizer.from_folder(tmp_path)
    for tools in (TOOLS, None):
        expected = reference.apply_chat_template(TURNS, tools=tools, tokenize=False)
        assert ours.apply_chat_template(TURNS, tools=tools, tokenize=False) == expected
    assert "[get_weather]" in ours.apply_chat_template(TURNS, tools=TOOLS, tokenize=False)


def test_templates_get_every_special_token_like_transformers(tmp_path):
    template = "[{{ bos_token }}|{{ eos_token }}|{{ pad_token }}|{{ unk_token }}]" + PLAIN_TEMPLATE
    from transformers import AutoTokenizer

    smollm_folder(tmp_path, chat_template=template, pad_token="<|im_end|>", unk_token="<|endoftext|>")
    expected = AutoTokenizer.from_pretrained(tmp_path).apply_chat_template(TURNS, tokenize=False)
    assert Tokenizer.from_folder(tmp_path).apply_chat_template(TURNS, tokenize=False) == expected
    assert expected.startswith("[<|im_start|>|<|im_end|>|<|im_end|>|<|endoftext|>]")


def test_tokens_the_config_calls_special_are_skipped_like_transformers(tmp_path):
    """``<think>`` plain in tokenizer.json, special in tokenizer_config.json's added_tokens_decoder."""
    from transformers import AutoTokenizer

    smollm_folder(tmp_path)
    backend = json.loads((tmp_path / "tokenizer.json").read_text())
    think = len(backend["model"]["vocab"])
    backend["added_tokens"].append({"id": think, "content": "<think>", "single_word": False, "lstrip": False,
                                    "rstrip": False, "normalized": False, "special": False})  # fmt: skip
    (tmp_path / "tokenizer.json").write_text(json.dumps(backend))
    config = json.loads((tmp_path / "tokenizer_config.json").read_text())
    config.setdefault("added_tokens_decoder", {})[str(think)] = {
        "content": "<think>",
        "special": True,
        "normalized": False,
    }
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(config))
    reference, ours = AutoTokenizer.from_pretrained(tmp_path), Tokenizer.from_folder(tmp_path)
    text = "<think>\nhm</think> ok"
    assert ours.encode(text) == reference.encode(text) and think in ours.encode(text)
    for skip in (True, False):
        ids = ours.encode(text)
        assert ours.decode(ids, skip_special_tokens=skip) == reference.decode(ids, skip_special_tokens=skip)
