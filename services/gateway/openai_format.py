"""OpenAI's response shapes: whole responses and streamed chunks, for completions and for chat.

A stream sends, per choice, text deltas as the tokens come and then one chunk with empty text
and the finish reason; chat streams first send each choice's role. With
``stream_options.include_usage`` every chunk has ``"usage": null`` and one last chunk with no
choices carries the usage. Prompt tokens count each prompt once, however many choices it has
(OpenAI's rule); completion tokens count every choice.
"""

from __future__ import annotations

import abc
import json
import time

from services.gateway.generation import ChoiceResult

# json.dumps makes an encoder per call when given options; this one is made once.
_JSON = json.JSONEncoder(ensure_ascii=False, separators=(",", ":"))


class Format(abc.ABC):
    """What completions and chat share: an id, the envelope, usage, SSE encoding."""

    object_name = ""
    chunk_object_name = ""
    id_prefix = ""

    def __init__(
        self, rid: str, model: str, n: int, include_usage: bool = False, logprobs: bool = False
    ) -> None:
        self.id = self.id_prefix + rid  # the request's id, which its Generate calls' ids extend
        self.created = int(time.time())
        self.model = model
        self.n = n  # choices per prompt
        self.include_usage = include_usage
        self.logprobs = logprobs  # the request asked for them: choices carry them
        self._offsets: dict[int, int] = {}  # choice -> characters of its tokens so far
        # A chunk's envelope is the same in every chunk: encoded once, around its choices
        # ("choices" is its last key, so the encoding ends in "[]}").
        envelope = _JSON.encode(self._envelope(self.chunk_object_name, []))
        self._chunk_head = "data: " + envelope[:-2]
        self._chunk_tail = "]" + (',"usage":null' if include_usage else "") + "}\n\n"

    # --- whole responses ----------------------------------------------------------------------

    def response(self, results: list[ChoiceResult]) -> dict:
        choices = [
            self.choice(i, r.text, r.finish_reason, r.logprobs) for i, r in enumerate(results)
        ]
        return {**self._envelope(self.object_name, choices), "usage": self._usage(results)}

    @abc.abstractmethod
    def choice(self, index: int, text: str, finish_reason: str | None, logprobs=()) -> dict:
        """One choice of a whole response."""

    def logprobs_body(self, index: int, entries) -> dict | None:
        """The choice's ``logprobs`` for these tokens (pb.TokenLogprob), or None when the
        request did not ask."""
        if not self.logprobs:
            return None
        return self._logprobs(index, list(entries))

    @abc.abstractmethod
    def _logprobs(self, index: int, entries: list) -> dict:
        """The format's ``logprobs`` body for these tokens."""

    # --- streams ------------------------------------------------------------------------------

    def opening(self, index: int) -> dict | None:
        """The chunk that starts choice ``index``, if the format has one."""
        return None

    @abc.abstractmethod
    def delta(self, index: int, text: str, finish_reason: str | None, logprobs=()) -> dict:
        """One choice of a stream chunk."""

    def chunk(self, choices: list[dict]) -> str:
        """The event of a chunk with these choices (and ``"usage": null`` when the usage comes
        last), as ``event`` would encode it."""
        return self._chunk_head + ",".join(map(_JSON.encode, choices)) + self._chunk_tail

    def usage_chunk(self, results: list[ChoiceResult]) -> str:
        return event({**self._envelope(self.chunk_object_name, []), "usage": self._usage(results)})

    # --- shared -------------------------------------------------------------------------------

    def _envelope(self, object_name: str, choices: list[dict]) -> dict:
        return {
            "id": self.id,
            "object": object_name,
            "created": self.created,
            "model": self.model,
            "choices": choices,
        }

    def _usage(self, results: list[ChoiceResult]) -> dict:
        """Each prompt's tokens once (choices i * n ... i * n + n - 1 share one prompt), every
        choice's completion tokens."""
        prompt = sum(r.prompt_tokens for i, r in enumerate(results) if i % self.n == 0)
        completion = sum(r.completion_tokens for r in results)
        return {
            "prompt_tokens": prompt,
            "completion_tokens": completion,
            "total_tokens": prompt + completion,
        }


class CompletionFormat(Format):
    object_name = "text_completion"
    chunk_object_name = "text_completion"
    id_prefix = "cmpl-"

    def choice(self, index: int, text: str, finish_reason: str | None, logprobs=()) -> dict:
        return {
            "index": index,
            "text": text,
            "logprobs": self.logprobs_body(index, logprobs),
            "finish_reason": finish_reason,
        }

    delta = choice

    def _logprobs(self, index: int, entries: list) -> dict:
        """OpenAI's legacy shape: parallel lists, offsets of each token in the choice's text."""
        offsets = []
        at = self._offsets.get(index, 0)
        for e in entries:
            offsets.append(at)
            at += len(e.token)
        self._offsets[index] = at
        return {
            "tokens": [e.token for e in entries],
            "token_logprobs": [e.logprob for e in entries],
            "top_logprobs": [{t.token: t.logprob for t in e.top} for e in entries],
            "text_offset": offsets,
        }


class ChatFormat(Format):
    object_name = "chat.completion"
    chunk_object_name = "chat.completion.chunk"
    id_prefix = "chatcmpl-"

    def choice(self, index: int, text: str, finish_reason: str | None, logprobs=()) -> dict:
        return {
            "index": index,
            "message": {"role": "assistant", "content": text},
            "logprobs": self.logprobs_body(index, logprobs),
            "finish_reason": finish_reason,
        }

    def _logprobs(self, index: int, entries: list) -> dict:
        def one(token: str, logprob: float) -> dict:
            return {"token": token, "logprob": logprob, "bytes": list(token.encode())}

        return {
            "content": [
                {
                    **one(e.token, e.logprob),
                    "top_logprobs": [one(t.token, t.logprob) for t in e.top],
                }
                for e in entries
            ]
        }

    def opening(self, index: int) -> dict:
        return {
            "index": index,
            "delta": {"role": "assistant", "content": ""},
            "logprobs": None,
            "finish_reason": None,
        }

    def delta(self, index: int, text: str, finish_reason: str | None, logprobs=()) -> dict:
        return {
            "index": index,
            "delta": {"content": text} if text else {},
            "logprobs": self.logprobs_body(index, logprobs) if logprobs else None,
            "finish_reason": finish_reason,
        }


def event(body: dict) -> str:
    """One server-sent event."""
    return f"data: {_JSON.encode(body)}\n\n"


DONE = "data: [DONE]\n\n"
