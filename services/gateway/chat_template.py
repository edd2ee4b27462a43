"""Chat prompts rendered from the model's Jinja chat template, the way Hugging Face renders them.

Hugging Face's conventions, which published templates rely on: a sandboxed, immutable Jinja
environment with ``trim_blocks`` and ``lstrip_blocks``, the loop-control extension (``break``,
``continue``), ``{% generation %}`` blocks (rendered as their body), a ``tojson`` filter that
keeps non-ASCII text as it is, the globals ``raise_exception(message)`` and
``strftime_now(format)``, and the variables ``messages``, ``add_generation_prompt``, ``tools``
and ``documents`` (None: the gateway passes neither) and the tokenizer's special tokens
(``bos_token``, ``eos_token``, ...).

The engine's tokenizer puts BOS before every text prompt when the model's configs say so; a
template that starts with ``bos_token`` too would then give the model two, so when the tokenizer
adds one the rendered prompt's leading ``bos_token`` is dropped (the tokens are then those of
Hugging Face's ``apply_chat_template(..., tokenize=True)``).
"""

from __future__ import annotations

import json
from datetime import datetime
from typing import Any

import jinja2
import jinja2.ext
import jinja2.nodes
from jinja2.sandbox import ImmutableSandboxedEnvironment

from services.gateway.errors import BadRequest


class ChatTemplateError(BadRequest):
    """The template cannot render these messages (its own raise_exception, or a Jinja error)."""


class _GenerationBlock(jinja2.ext.Extension):
    """``{% generation %}...{% endgeneration %}``: Hugging Face marks assistant text with it for
    training masks; rendering a prompt, it is its body."""

    tags = {"generation"}

    def parse(self, parser):
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        return jinja2.nodes.Scope(body).set_lineno(lineno)


def _raise_exception(message: str):
    raise jinja2.TemplateError(message)


def _tojson(value: Any, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
    return json.dumps(
        value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys
    )


def _strftime_now(fmt: str) -> str:
    return datetime.now().strftime(fmt)


def _environment() -> ImmutableSandboxedEnvironment:
    env = ImmutableSandboxedEnvironment(
        trim_blocks=True,
        lstrip_blocks=True,
        extensions=[jinja2.ext.loopcontrols, _GenerationBlock],
    )
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    return env


class ChatTemplate:
    """One model's compiled template; immutable, shared by every request."""

    def __init__(self, source: str, special_tokens: dict[str, str], adds_bos_token: bool) -> None:
        try:
            self._template = _environment().from_string(source)
        except jinja2.TemplateSyntaxError as exc:
            raise ValueError(f"the model's chat template does not compile: {exc}") from None
        self._special = dict(special_tokens)
        bos = self._special.get("bos_token")
        self._strip = bos if adds_bos_token and bos else None

    def render(self, messages: list[dict[str, Any]], add_generation_prompt: bool = True) -> str:
        """The prompt text for ``messages``; ChatTemplateError (400) names what the template
        refused."""
        try:
            text = self._template.render(
                messages=messages,
                add_generation_prompt=add_generation_prompt,
                tools=None,
                documents=None,
                **self._special,
            )
        except jinja2.TemplateError as exc:
            raise ChatTemplateError(f"the chat template refused these messages: {exc}") from None
        except (TypeError, ValueError, KeyError, AttributeError) as exc:
            raise ChatTemplateError(
                f"the chat template failed on these messages: {type(exc).__name__}: {exc}"
            ) from None
        if self._strip is not None and text.startswith(self._strip):
            text = text[len(self._strip) :]
        return text
