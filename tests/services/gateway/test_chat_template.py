"""Chat templates render exactly as Hugging Face's apply_chat_template renders them (the
reference: transformers, on the tiny model's tokenizer), for templates that lean on its
conventions: whitespace control, loop controls, namespaces, tojson, generation blocks, tools and
special-token variables."""

from __future__ import annotations

import jinja2
import pytest
from transformers import AutoTokenizer

from services.gateway.chat_template import ChatTemplate, ChatTemplateError
from services.inference.tiny_model import CHAT_TEMPLATE

LLAMA3_LIKE = (
    "{{- bos_token }}{% for message in messages %}{{ '<|start_header_id|>' + message['role'] + "
    "'<|end_header_id|>\\n\\n' + message['content'] | trim + '<|eot_id|>' }}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|start_header_id|>assistant<|end_header_id|>\\n\\n' }}"
    "{% endif %}"
)
CHATML_LIKE = """{%- set ns = namespace(system=none) %}
{%- for message in messages %}
  {%- if message.role == 'system' %}{% set ns.system = message.content %}{% continue %}{% endif %}
  <|im_start|>{{ message.role }}
  {{ message.content }}<|im_end|>
  {% if loop.index > 8 %}{% break %}{% endif %}
{% endfor %}
{%- if tools is not none %}{{ raise_exception('no tools here') }}{% endif %}
{%- if documents is not none %}{{ raise_exception('no documents here') }}{% endif %}
{%- if ns.system %}[system: {{ ns.system | tojson }}] {{ eos_token }}{% endif %}
{%- if add_generation_prompt %}<|im_start|>assistant
{% endif %}"""
GENERATION_BLOCKS = (
    "{% for m in messages %}{% if m.role == 'assistant' %}{% generation %}{{ m.content }}"
    "{% endgeneration %}{% else %}{{ m.role }}: {{ m.content }}\n{% endif %}{% endfor %}"
    "{% if add_generation_prompt %}{{ pad_token }}{% endif %}"
)
CONVERSATIONS = [
    [{"role": "user", "content": "Hello"}],
    [
        {"role": "system", "content": "Réponds «brièvement» 日本語"},
        {"role": "user", "content": "  Where is the harbour?  "},
        {"role": "assistant", "content": "By the pier."},
        {"role": "user", "content": 'And the "baker"?'},
    ],
]


@pytest.fixture(scope="module")
def hf(gw_models):
    return AutoTokenizer.from_pretrained(gw_models.model)


def specials(hf) -> dict[str, str]:
    return {k: v for k, v in hf.special_tokens_map.items() if isinstance(v, str)}


@pytest.mark.parametrize("source", [CHAT_TEMPLATE, LLAMA3_LIKE, CHATML_LIKE, GENERATION_BLOCKS])
@pytest.mark.parametrize("messages", CONVERSATIONS)
@pytest.mark.parametrize("add_generation_prompt", [True, False])
def test_renders_as_hugging_face(hf, source, messages, add_generation_prompt):
    expected = hf.apply_chat_template(
        messages, chat_template=source, tokenize=False, add_generation_prompt=add_generation_prompt
    )
    ours = ChatTemplate(source, specials(hf), adds_bos_token=False)
    assert ours.render(messages, add_generation_prompt) == expected


def test_a_leading_bos_is_dropped_only_when_the_tokenizer_adds_one(hf):
    messages = CONVERSATIONS[0]
    expected = hf.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    assert expected.startswith("<s>")
    assert ChatTemplate(CHAT_TEMPLATE, specials(hf), True).render(messages) == expected[3:]
    assert ChatTemplate(CHAT_TEMPLATE, specials(hf), False).render(messages) == expected
    no_bos = GENERATION_BLOCKS
    assert ChatTemplate(no_bos, specials(hf), True).render(messages) == hf.apply_chat_template(
        messages, chat_template=no_bos, tokenize=False, add_generation_prompt=True
    )


def test_refusals_are_bad_requests_naming_the_reason(hf):
    template = ChatTemplate(CHAT_TEMPLATE, specials(hf), True)
    with pytest.raises(ChatTemplateError, match="roles must be system, user or assistant"):
        template.render([{"role": "tool", "content": "x"}])
    with pytest.raises(jinja2.TemplateError):  # the reference refuses the same way
        hf.apply_chat_template([{"role": "tool", "content": "x"}], tokenize=False)
    with pytest.raises(ChatTemplateError, match="failed on these messages"):
        template.render([{"role": "user", "content": None}])  # str + None in the template
    with pytest.raises(ValueError, match="does not compile"):
        ChatTemplate("{% for m in messages %}", {}, False)


def test_the_sandbox_refuses_unsafe_attribute_access(hf):
    sneaky = "{{ messages.__class__.__mro__ }}"
    with pytest.raises(ChatTemplateError, match="refused"):
        ChatTemplate(sneaky, {}, False).render(CONVERSATIONS[0])
