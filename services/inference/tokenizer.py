"""The model's tokenizer: tokenizer.json through `tokenizers`, special tokens from the configs.

No transformers at runtime. What transformers' fast tokenizers do that matters for serving is
reproduced here: BOS handling (tokenizer_config.json's add_bos_token when it is given, otherwise
whatever tokenizer.json's post-processor adds) and the set of ids that end generation (the union
of generation_config.json's eos_token_id, which may be a list, and tokenizer_config.json's
eos_token).
"""

from __future__ import annotations

import json
import logging
from collections.abc import Iterable
from pathlib import Path

import tokenizers

logger = logging.getLogger(__name__)

TOKENIZER_FILE = "tokenizer.json"
TOKENIZER_CONFIG_FILE = "tokenizer_config.json"
GENERATION_CONFIG_FILE = "generation_config.json"


class TokenizerError(ValueError):
    """A model directory's tokenizer files are missing or inconsistent."""


def _token_content(value: object) -> str | None:
    """A special token from tokenizer_config.json: a string or an AddedToken dict."""
    if isinstance(value, dict):
        value = value.get("content")
    return value if isinstance(value, str) else None


def _read_json(path: Path) -> dict:
    try:
        obj = json.loads(path.read_text(encoding="utf-8"))
    except json.JSONDecodeError as e:
        raise TokenizerError(f"{path.name} is not valid JSON: {e}") from None
    if not isinstance(obj, dict):
        raise TokenizerError(f"{path.name} must hold a JSON object")
    return obj


class Tokenizer:
    """Encodes prompts and decodes generated ids; immutable after construction."""

    def __init__(
        self,
        inner: tokenizers.Tokenizer,
        *,
        bos_token_id: int | None,
        eos_token_ids: Iterable[int],
        add_bos_token: bool | None,
    ) -> None:
        self.inner = inner
        self.bos_token_id = bos_token_id
        self.eos_token_ids = frozenset(eos_token_ids)
        # None: tokenizer.json's post-processor decides (Llama 3 style); True/False: we do.
        self._add_bos = add_bos_token
        self.vocab_size = inner.get_vocab_size(with_added_tokens=True)
        if add_bos_token and bos_token_id is None:
            raise TokenizerError("add_bos_token is set but the tokenizer has no BOS token")
        if not self.eos_token_ids:
            raise TokenizerError(
                f"no EOS token: set eos_token_id in {GENERATION_CONFIG_FILE} "
                f"or eos_token in {TOKENIZER_CONFIG_FILE}"
            )

    @classmethod
    def from_model_dir(cls, path: str | Path) -> Tokenizer:
        """Load tokenizer.json, tokenizer_config.json and (if present) generation_config.json."""
        root = Path(path)
        for name in (TOKENIZER_FILE, TOKENIZER_CONFIG_FILE):
            if not (root / name).is_file():
                raise TokenizerError(f"model directory {root} has no {name}")
        try:
            inner = tokenizers.Tokenizer.from_file(str(root / TOKENIZER_FILE))
        except Exception as e:  # tokenizers raises a bare Exception on malformed files
            raise TokenizerError(f"{TOKENIZER_FILE} cannot be loaded: {e}") from None
        tok_cfg = _read_json(root / TOKENIZER_CONFIG_FILE)
        gen_path = root / GENERATION_CONFIG_FILE
        gen_cfg = _read_json(gen_path) if gen_path.is_file() else {}

        def token_id(field: str) -> int | None:
            content = _token_content(tok_cfg.get(field))
            if content is None:
                return None
            tid = inner.token_to_id(content)
            if tid is None:
                raise TokenizerError(
                    f"{TOKENIZER_CONFIG_FILE}: {field} {content!r} is not in {TOKENIZER_FILE}"
                )
            return tid

        eos: set[int] = set()
        gen_eos = gen_cfg.get("eos_token_id")
        for tid in gen_eos if isinstance(gen_eos, list) else [gen_eos]:
            if tid is None:
                continue
            if not isinstance(tid, int) or isinstance(tid, bool) or tid < 0:
                raise TokenizerError(f"{GENERATION_CONFIG_FILE}: bad eos_token_id {tid!r}")
            eos.add(tid)
        if (tid := token_id("eos_token")) is not None:
            eos.add(tid)
        bos = token_id("bos_token")
        if bos is None and isinstance(gen_cfg.get("bos_token_id"), int):
            bos = gen_cfg["bos_token_id"]
        add_bos = tok_cfg.get("add_bos_token")
        if add_bos is not None and not isinstance(add_bos, bool):
            raise TokenizerError(f"{TOKENIZER_CONFIG_FILE}: add_bos_token must be true or false")
        tok = cls(inner, bos_token_id=bos, eos_token_ids=eos, add_bos_token=add_bos)
        logger.info(
            "tokenizer from %s: vocab %d, bos %s, eos %s",
            root,
            tok.vocab_size,
            bos,
            sorted(tok.eos_token_ids),
        )
        return tok

    def encode(self, text: str) -> list[int]:
        """Token ids of text, with BOS first when the model's configs ask for it."""
        if not isinstance(text, str):
            raise TypeError(f"text must be str, got {type(text).__name__}")
        if self._add_bos is None:
            return self._encode(text, add_special_tokens=True)
        ids = self._encode(text, add_special_tokens=False)
        if self._add_bos:
            assert self.bos_token_id is not None  # checked in __init__
            ids = [self.bos_token_id, *ids]
        return ids

    def _encode(self, text: str, add_special_tokens: bool) -> list[int]:
        # encode_batch releases the GIL while it works (encode holds it throughout: a 1 MB
        # prompt stalled every other thread for 0.55 s on a 2-core machine); same encoding.
        return self.inner.encode_batch([text], add_special_tokens=add_special_tokens)[0].ids

    def decode(self, ids: Iterable[int], skip_special_tokens: bool = True) -> str:
        """Text of ids; ids that end mid-character decode to U+FFFD for the broken bytes."""
        try:
            return self.inner.decode(list(ids), skip_special_tokens=skip_special_tokens)
        except (OverflowError, TypeError) as e:  # negative or non-integer ids
            raise ValueError(f"token ids must be non-negative integers: {e}") from None
