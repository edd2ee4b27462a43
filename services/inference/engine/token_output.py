"""What one sampled token does to its sequence: the text it releases and whether it ends it."""

from __future__ import annotations

from typing import NamedTuple

from services.inference.engine.api import FinishReason
from services.inference.engine.request import Sequence


class TokenResult(NamedTuple):
    text: str  # newly complete text, stop strings excluded
    finish_reason: FinishReason | None  # None: the sequence goes on


def append_token(seq: Sequence, token: int, max_len: int) -> TokenResult:
    """Append ``token`` to ``seq``; check EOS, stop token ids, stop strings and length."""
    seq.output_ids.append(token)
    reason: FinishReason | None = None
    text = ""
    if token in seq.finish_ids:
        # The finishing token's id is reported; its text (a special token) is not.
        reason = FinishReason.EOS if token in seq.eos_ids else FinishReason.STOP
    else:
        match = seq.stops.add(seq.detokenizer.add(token))
        text = match.emit
        if match.stopped:
            reason = FinishReason.STOP
    if reason is None and (
        len(seq.output_ids) >= seq.sampling.max_new_tokens or seq.num_known >= max_len
    ):
        reason = FinishReason.LENGTH
    if reason is None or seq.stops.stopped:
        return TokenResult(text, reason)
    # Release what the detokenizer and the stop matcher still hold; a stop string may still
    # complete in the detokenizer's held-back tail.
    match = seq.stops.add(seq.detokenizer.flush())
    text += match.emit
    if match.stopped:
        return TokenResult(text, FinishReason.STOP)
    return TokenResult(text + seq.stops.flush(), reason)
