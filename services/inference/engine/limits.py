"""RequestLimits: how large each per-request input may be, checked before work proportional to it.

The service checks a request against these first (servicer.py, on the protobuf message, before
copying or tokenizing anything); EngineCore.prepare checks again, for callers of the engine
itself. Each check costs time independent of the input's size, or proportional to an input
already bounded by an earlier check.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from services.inference.engine.errors import InvalidRequest


@dataclass(frozen=True)
class RequestLimits:
    max_request_id_chars: int = 256  # echoed in every response message
    max_prompt_bytes: int = 1 << 20  # UTF-8 bytes of a text prompt, before tokenizing it
    max_prompt_tokens: int = 131072  # the context window bounds it too
    max_stop_strings: int = 16
    max_stop_string_chars: int = 1024  # each
    max_stop_token_ids: int = 128

    def __post_init__(self) -> None:
        for name, value in vars(self).items():
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be a positive integer, got {value!r}")

    def check_request_id(self, request_id: str) -> None:
        if len(request_id) > self.max_request_id_chars:
            raise InvalidRequest(
                f"request_id is {len(request_id)} characters; at most "
                f"{self.max_request_id_chars} allowed (--max-request-id-chars)"
            )

    def check_prompt_text(self, prompt: str) -> None:
        """A str of n characters takes n to 4n bytes in UTF-8: only the ones in between are
        encoded to count them."""
        limit = self.max_prompt_bytes
        if len(prompt) > limit or (len(prompt) * 4 > limit and len(prompt.encode()) > limit):
            raise InvalidRequest(
                f"the prompt is over {limit} bytes of UTF-8 (--max-prompt-bytes); "
                "send a shorter prompt"
            )

    def check_prompt_tokens(self, count: int) -> None:
        if count > self.max_prompt_tokens:
            raise InvalidRequest(
                f"the prompt has {count} tokens; at most {self.max_prompt_tokens} allowed "
                "(--max-prompt-tokens)"
            )

    def check_stops(self, stop: Sequence[str], stop_token_ids_count: int) -> None:
        if len(stop) > self.max_stop_strings:
            raise InvalidRequest(
                f"sampling: {len(stop)} stop strings; at most {self.max_stop_strings} allowed "
                "(--max-stop-strings)"
            )
        longest = max((len(s) for s in stop), default=0)
        if longest > self.max_stop_string_chars:
            raise InvalidRequest(
                f"sampling: a stop string of {longest} characters; at most "
                f"{self.max_stop_string_chars} allowed (--max-stop-string-chars)"
            )
        if stop_token_ids_count > self.max_stop_token_ids:
            raise InvalidRequest(
                f"sampling: {stop_token_ids_count} stop_token_ids; at most "
                f"{self.max_stop_token_ids} allowed (--max-stop-token-ids)"
            )
