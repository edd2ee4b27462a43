"""What GetModelInfo tells of the served model, read once from its directory at start-up.

The chat template is tokenizer_config.json's ``chat_template``: a string, or a list of named
templates of which the one named "default" serves (as Hugging Face picks it); when the file has
none, a ``chat_template.jinja`` beside it (where newer Hugging Face versions save it).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import NamedTuple

from services.inference.engine.pool_sizing import context_window
from services.inference.models.config import ModelConfig
from services.inference.tokenizer import TOKENIZER_CONFIG_FILE, Tokenizer, TokenizerError

CHAT_TEMPLATE_FILE = "chat_template.jinja"
# The special tokens a chat template may name, as tokenizer_config.json spells them.
SPECIAL_TOKENS = ("bos_token", "eos_token", "unk_token", "pad_token")


class ModelInfo(NamedTuple):
    model_id: str
    context_window: int
    chat_template: str  # "" = none
    special_tokens: dict[str, str]
    adds_bos_token: bool


def read_model_info(
    model_dir: Path, model_id: str, tokenizer: Tokenizer, max_model_len: int | None
) -> ModelInfo:
    """The served model's info; ``tokenizer`` the one the service encodes prompts with (read
    from ``model_dir``), ``max_model_len`` as the engine's config has it. Raises
    TokenizerError or ModelLoadError on broken files (the engine would refuse them too)."""
    tok_cfg = _tokenizer_config(model_dir)
    special = {}
    for name in SPECIAL_TOKENS:
        value = tok_cfg.get(name)
        if isinstance(value, dict):  # an AddedToken
            value = value.get("content")
        if isinstance(value, str):
            special[name] = value
    bos = tokenizer.bos_token_id
    adds_bos = bos is not None and tokenizer.encode("a")[:1] == [bos]
    return ModelInfo(
        model_id=model_id,
        context_window=context_window(ModelConfig.from_model_dir(model_dir), max_model_len),
        chat_template=_chat_template(model_dir, tok_cfg),
        special_tokens=special,
        adds_bos_token=adds_bos,
    )


def _tokenizer_config(model_dir: Path) -> dict:
    path = model_dir / TOKENIZER_CONFIG_FILE
    try:
        cfg = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, json.JSONDecodeError) as exc:
        raise TokenizerError(f"{TOKENIZER_CONFIG_FILE} cannot be read: {exc}") from None
    if not isinstance(cfg, dict):
        raise TokenizerError(f"{TOKENIZER_CONFIG_FILE} must hold a JSON object")
    return cfg


def _chat_template(model_dir: Path, tok_cfg: dict) -> str:
    template = tok_cfg.get("chat_template")
    if isinstance(template, list):  # [{"name": ..., "template": ...}, ...]
        named = {t.get("name"): t.get("template") for t in template if isinstance(t, dict)}
        template = named.get("default", False)
    if isinstance(template, str) and template:
        return template
    if template is not None:
        raise TokenizerError(
            f"{TOKENIZER_CONFIG_FILE}: chat_template must be a string or a list of named "
            "templates with one named 'default'"
        )
    path = model_dir / CHAT_TEMPLATE_FILE
    return path.read_text(encoding="utf-8") if path.is_file() else ""
