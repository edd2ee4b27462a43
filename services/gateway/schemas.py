"""OpenAI's request bodies for /v1/completions and /v1/chat/completions, validated on the way in.

Fields OpenAI defines that change what is generated and that the engine cannot honour
(penalties, logit_bias, tools, echo, suffix, best_of beyond n, a response format other than
text) are refused with a 400 that names them, never silently ignored; fields that do not change
the output (user, metadata, store, ...) and unknown fields are ignored, as OpenAI's servers and
vLLM do. Extensions that vLLM also takes: top_k, ignore_eos, stop_token_ids, and
add_generation_prompt for chat.
"""

from __future__ import annotations

import contextlib
import functools
import json
from abc import abstractmethod
from typing import Annotated, Any

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    TypeAdapter,
    ValidationError,
    field_validator,
)

from services.gateway.config import INT32_MAX
from services.gateway.errors import BadRequest, validation_message
from services.inference.engine.sampling_params import MAX_LOGPROBS

MAX_SEED = 2**63 - 1  # SamplingParams.seed is an int64
Int32 = Annotated[int, Field(ge=0, le=INT32_MAX)]
_TOKEN_IDS = TypeAdapter(list[Int32], config=ConfigDict(strict=True))


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="ignore", strict=True)
    include_usage: bool = False


class GenerationFields(BaseModel):
    """What completions and chat share."""

    model_config = ConfigDict(extra="ignore", strict=True)

    model: str = Field(min_length=1)
    n: int = Field(default=1, ge=1)
    stream: bool = False
    stream_options: StreamOptions | None = None
    stop: str | list[str] | None = None
    seed: int | None = Field(default=None, ge=0, le=MAX_SEED)
    temperature: float | None = Field(default=None, ge=0)
    top_p: float | None = Field(default=None, gt=0, le=1)
    max_tokens: int | None = Field(default=None, ge=1, le=INT32_MAX)
    top_k: int | None = Field(default=None, ge=0, le=INT32_MAX)
    ignore_eos: bool = False
    stop_token_ids: list[Int32] | None = None
    # completions: logprobs = alternatives per token (0-20); chat: logprobs true, top_logprobs
    # alternatives (checked once, by each request's _read_logprobs)
    logprobs: Any = None
    top_logprobs: Any = None
    # Refused when set to anything that would change the output (see _refuse_unsupported).
    presence_penalty: Any = None
    frequency_penalty: Any = None
    logit_bias: Any = None
    best_of: Any = None
    response_format: Any = None

    @field_validator("stop")
    @classmethod
    def _stop_strings(cls, value):
        if isinstance(value, list) and any(not s for s in value):
            raise ValueError("stop strings must be non-empty")
        return value

    @property
    def stop_list(self) -> list[str]:
        if self.stop is None:
            return []
        return [self.stop] if isinstance(self.stop, str) else list(self.stop)

    @property
    def include_usage(self) -> bool:
        return self.stream_options is not None and self.stream_options.include_usage

    @functools.cached_property
    def wanted_logprobs(self) -> int | None:
        """Alternatives per token the engine reports (SamplingParams.logprobs); None: no
        logprobs. Read once, first by check(), which so refuses a bad value. (Cached rather
        than kept in a private attribute: those cost every validation a Python call.)"""
        return self._read_logprobs()

    @abstractmethod
    def _read_logprobs(self) -> int | None:
        """wanted_logprobs from this request's fields; BadRequest for a bad value."""

    def _refuse_unsupported(self) -> None:
        _ = self.wanted_logprobs  # a bad value is refused here, with the other checks
        for name in ("presence_penalty", "frequency_penalty"):
            if getattr(self, name) not in (None, 0, 0.0):
                raise BadRequest(f"{name} is not supported: leave it out or 0", param=name)
        if self.logit_bias:
            raise BadRequest("logit_bias is not supported", param="logit_bias")
        if self.best_of is not None and self.best_of != self.n:
            raise BadRequest("best_of is not supported (use n)", param="best_of")
        fmt = self.response_format
        if fmt is not None and not (isinstance(fmt, dict) and fmt.get("type") == "text"):
            raise BadRequest(
                "response_format other than {'type': 'text'} is not supported",
                param="response_format",
            )
        if self.stream_options is not None and not self.stream:
            raise BadRequest("stream_options is only allowed with stream: true", "stream_options")


class CompletionRequest(GenerationFields):
    prompt: str | list[str] | list[Int32] | list[list[Int32]]
    echo: Any = None
    suffix: Any = None

    @field_validator("prompt", mode="wrap")
    @classmethod
    def _token_ids_first(cls, value, handler):
        """Token ids, the prompt of benchmarks and of tools that tokenize, checked as such
        first: the union tries every member, and the two that do not fit each collect an error
        per element (three times the work). Anything else, and ids that fail, go through the
        union, which words the errors."""
        if type(value) is list and value and type(value[0]) is int:
            with contextlib.suppress(ValidationError):
                return _TOKEN_IDS.validate_python(value)
        return handler(value)

    def _read_logprobs(self) -> int | None:
        if self.top_logprobs is not None:
            raise BadRequest(
                "top_logprobs is for chat; completions take logprobs (the number of "
                "alternatives per token)", param="top_logprobs",
            )  # fmt: skip
        return _alternatives(self.logprobs, "logprobs", none_if=(None,))

    def check(self) -> CompletionRequest:
        self._refuse_unsupported()
        if self.echo:
            raise BadRequest("echo is not supported", param="echo")
        if self.suffix:
            raise BadRequest("suffix is not supported", param="suffix")
        return self

    def prompts(self) -> list[str | list[int]]:
        """Each prompt: text, or token ids."""
        p = self.prompt
        if isinstance(p, str):
            out: list = [p]
        elif p and isinstance(p[0], int):  # validated: a list's elements are of one kind
            out = [list(p)]
        else:
            out = list(p)
        if not out or any(len(x) == 0 for x in out):
            raise BadRequest("prompt must be non-empty (text, token ids, or a list of either)")
        return out


class ChatRequest(GenerationFields):
    messages: list[dict[str, Any]] = Field(min_length=1)
    max_completion_tokens: int | None = Field(default=None, ge=1, le=INT32_MAX)
    add_generation_prompt: bool = True
    tools: Any = None
    tool_choice: Any = None
    functions: Any = None

    def _read_logprobs(self) -> int | None:
        if self.logprobs not in (None, True, False):
            raise BadRequest("logprobs must be true or false", param="logprobs")
        if not self.logprobs:
            if self.top_logprobs not in (None, 0):
                raise BadRequest("top_logprobs needs logprobs: true", param="top_logprobs")
            return None
        return _alternatives(self.top_logprobs, "top_logprobs", none_if=()) or 0

    def check(self) -> ChatRequest:
        self._refuse_unsupported()
        if self.tools or self.functions:
            raise BadRequest("tools and functions are not supported", param="tools")
        if self.tool_choice not in (None, "none"):
            raise BadRequest("tool_choice is not supported", param="tool_choice")
        return self

    @property
    def completion_limit(self) -> int | None:
        """max_completion_tokens, or the older max_tokens."""
        return self.max_completion_tokens or self.max_tokens

    def template_messages(self) -> list[dict[str, Any]]:
        """The messages as a chat template sees them: content parts of type text joined into
        one string (the gateway serves text models)."""
        out = []
        for i, message in enumerate(self.messages):
            role = message.get("role")
            if not isinstance(role, str) or not role:
                raise BadRequest(f"messages[{i}].role must be a non-empty string")
            content = message.get("content")
            if isinstance(content, list):
                texts = []
                for part in content:
                    if not isinstance(part, dict) or part.get("type") != "text":
                        kind = part.get("type") if isinstance(part, dict) else type(part).__name__
                        raise BadRequest(
                            f"messages[{i}].content: parts of type {kind!r} are not supported "
                            "(text only)"
                        )
                    texts.append(str(part.get("text", "")))
                content = "".join(texts)
            elif content is not None and not isinstance(content, str):
                raise BadRequest(f"messages[{i}].content must be a string or a list of parts")
            out.append({**message, "content": content})
        return out


def _alternatives(value: Any, name: str, none_if: tuple) -> int | None:
    """A logprobs count: None when ``value`` is in ``none_if`` (or is None), else an integer
    in [0, MAX_LOGPROBS]."""
    if value is None or value in none_if:
        return None
    if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value <= MAX_LOGPROBS:
        raise BadRequest(f"{name} must be an integer from 0 to {MAX_LOGPROBS}", param=name)
    return value


def parse_json(model: type[BaseModel], raw: bytes) -> Any:
    """A ``model`` from a JSON body; BadRequest names what is wrong."""
    try:
        body = json.loads(raw)
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise BadRequest(f"the request body is not valid JSON: {exc}") from None
    if not isinstance(body, dict):
        raise BadRequest("the request body must be a JSON object")
    try:
        return model.model_validate(body)
    except ValidationError as exc:
        raise BadRequest(validation_message(exc.errors())) from None


def parse(model: type[GenerationFields], raw: bytes) -> Any:
    """A completion or chat request, with what the engine cannot honour refused."""
    return parse_json(model, raw).check()
