"""Tokenizer: round trips, BOS and EOS from the model's configs, clear errors."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
from transformers import AutoTokenizer

from services.inference.tokenizer import Tokenizer, TokenizerError
from tests.inference.models import TinyModels

TEXTS = [
    "Hello, world!",
    "  leading and trailing spaces  ",
    "def f(x):\n    return x * 2\n",
    "naïve façade, São Paulo, Ångström",
    "東京の朝はとても静かです。今天天气很好",
    "emoji 🙂🚀 👍🏽 ❤️ and ZWJ 👩‍💻",
    "mixed\ttabs\r\nand newlines\n\n",
    "",
]


@pytest.fixture
def model_copy(tiny_models: TinyModels, tmp_path: Path) -> Path:
    """A private copy of the tiny llama's tokenizer files that a test may edit."""
    src = tiny_models.model("tiny-llama")
    for name in ("tokenizer.json", "tokenizer_config.json", "generation_config.json"):
        shutil.copy(src / name, tmp_path / name)
    return tmp_path


def _edit(path: Path, **changes: object) -> None:
    cfg = json.loads(path.read_text())
    for key, value in changes.items():
        if value is None:
            cfg.pop(key, None)
        else:
            cfg[key] = value
    path.write_text(json.dumps(cfg))


@pytest.mark.parametrize("text", TEXTS)
def test_round_trip_and_agreement_with_transformers(tiny_models: TinyModels, text: str):
    model_dir = tiny_models.model("tiny-llama")
    tok = Tokenizer.from_model_dir(model_dir)
    ids = tok.encode(text)
    assert ids[0] == tok.bos_token_id and tok.bos_token_id not in ids[1:]
    assert tok.decode(ids) == text
    assert tok.decode(ids, skip_special_tokens=False) == "<s>" + text
    assert all(0 <= i < tok.vocab_size for i in ids)
    assert ids == AutoTokenizer.from_pretrained(model_dir)(text)["input_ids"]


def test_special_tokens_from_configs(tiny_models: TinyModels):
    tok = Tokenizer.from_model_dir(tiny_models.model("demo"))
    inner = tok.inner
    assert tok.bos_token_id == inner.token_to_id("<s>")
    assert tok.eos_token_ids == frozenset({inner.token_to_id("</s>")})
    assert tok.vocab_size == inner.get_vocab_size() > 512  # the demo's larger vocabulary
    assert len(tok.encode("The harbour was quiet")) < len("The harbour was quiet")  # merges


def test_eos_union_and_bos_switches(model_copy: Path):
    _edit(model_copy / "generation_config.json", eos_token_id=[2, 7])
    tok = Tokenizer.from_model_dir(model_copy)
    assert tok.eos_token_ids == frozenset({1, 2, 7})  # </s> from tokenizer_config, 2 and 7
    _edit(model_copy / "tokenizer_config.json", add_bos_token=False)
    assert Tokenizer.from_model_dir(model_copy).encode("hi")[0] != tok.bos_token_id
    # Without add_bos_token, tokenizer.json's post-processor decides (it adds <s>).
    _edit(model_copy / "tokenizer_config.json", add_bos_token=None)
    assert Tokenizer.from_model_dir(model_copy).encode("hi") == tok.encode("hi")
    # generation_config.json is optional: EOS then comes from tokenizer_config.json alone.
    (model_copy / "generation_config.json").unlink()
    assert Tokenizer.from_model_dir(model_copy).eos_token_ids == frozenset({1})


@pytest.mark.parametrize("missing", ["tokenizer.json", "tokenizer_config.json"])
def test_missing_file_is_named(model_copy: Path, missing: str):
    (model_copy / missing).unlink()
    with pytest.raises(TokenizerError, match=missing):
        Tokenizer.from_model_dir(model_copy)


def test_bad_configs_are_named(model_copy: Path):
    _edit(model_copy / "tokenizer_config.json", eos_token="<|end|>")
    with pytest.raises(TokenizerError, match=r"eos_token '<\|end\|>' is not in tokenizer.json"):
        Tokenizer.from_model_dir(model_copy)
    _edit(model_copy / "tokenizer_config.json", eos_token=None)
    _edit(model_copy / "generation_config.json", eos_token_id=None)
    with pytest.raises(TokenizerError, match="no EOS token"):
        Tokenizer.from_model_dir(model_copy)
    _edit(model_copy / "generation_config.json", eos_token_id="two")
    with pytest.raises(TokenizerError, match="bad eos_token_id"):
        Tokenizer.from_model_dir(model_copy)
    (model_copy / "tokenizer_config.json").write_text("{not json")
    with pytest.raises(TokenizerError, match="tokenizer_config.json is not valid JSON"):
        Tokenizer.from_model_dir(model_copy)


def test_bad_input(tiny_models: TinyModels):
    tok = Tokenizer.from_model_dir(tiny_models.model("tiny-llama"))
    with pytest.raises(TypeError, match="text must be str"):
        tok.encode(b"bytes")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="non-negative"):
        tok.decode([5, -1])
