"""What GetModelInfo tells of a model directory: its chat template in each layout Hugging Face
writes, the special tokens, whether prompts get BOS, the context window; and its id flag."""

from __future__ import annotations

import json
import shutil

import grpc
import pytest

from lorafleet.v1 import inference_pb2 as pb
from lorafleet.v1 import inference_pb2_grpc as pb_grpc
from services.inference.config import ServiceConfig
from services.inference.model_info import ModelInfo, read_model_info
from services.inference.tiny_model import CHAT_TEMPLATE, make_model
from services.inference.tokenizer import Tokenizer, TokenizerError
from tests.services.inference.stack import inference_proc


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    return make_model(tmp_path_factory.mktemp("info") / "m", "tiny-mistral", seed=0)


def variant(model, tmp_path, **changes):
    out = tmp_path / "variant"
    shutil.copytree(model, out)
    cfg = json.loads((out / "tokenizer_config.json").read_text())
    for key, value in changes.items():
        if value is None:
            cfg.pop(key, None)
        else:
            cfg[key] = value
    (out / "tokenizer_config.json").write_text(json.dumps(cfg))
    return out


def info_of(model_dir, model_id: str, max_model_len: int | None = None) -> ModelInfo:
    """read_model_info with the directory's own tokenizer, as the service reads it."""
    return read_model_info(model_dir, model_id, Tokenizer.from_model_dir(model_dir), max_model_len)


def test_the_tiny_models_info(model):
    info = info_of(model, "served")
    assert info.model_id == "served" and info.context_window == 2048
    assert info.chat_template == CHAT_TEMPLATE
    assert info.special_tokens == {"bos_token": "<s>", "eos_token": "</s>", "pad_token": "<pad>"}
    assert info.adds_bos_token
    assert info_of(model, "x", 512).context_window == 512


def test_chat_template_layouts(model, tmp_path):
    named = [{"name": "tool_use", "template": "T"}, {"name": "default", "template": "D"}]
    assert info_of(variant(model, tmp_path, chat_template=named), "m") == (
        info_of(model, "m")._replace(chat_template="D")
    )
    shutil.rmtree(tmp_path / "variant")
    none = variant(model, tmp_path, chat_template=None)
    assert info_of(none, "m").chat_template == ""
    (none / "chat_template.jinja").write_text("J{{ messages }}")
    assert info_of(none, "m").chat_template == "J{{ messages }}"
    shutil.rmtree(none)
    bad = variant(model, tmp_path, chat_template=[{"name": "tool_use", "template": "T"}])
    with pytest.raises(TokenizerError, match="named 'default'"):
        info_of(bad, "m")


def test_added_token_dicts_and_no_bos(model, tmp_path):
    out = variant(
        model, tmp_path, add_bos_token=False, unk_token={"content": "<pad>", "special": True}
    )
    info = info_of(out, "m")
    assert not info.adds_bos_token and info.special_tokens["unk_token"] == "<pad>"


def test_served_model_name_flag(capsys):
    assert ServiceConfig.from_args(["--model", "models/llama-3/"], environ={}).model_id == (
        "llama-3"
    )
    named = ServiceConfig.from_args(["--model", "m", "--served-model-name", "base"], environ={})
    assert named.model_id == "base"
    with pytest.raises(SystemExit):
        ServiceConfig.from_args(["--model", "m", "--served-model-name", " x"], environ={})
    assert "--served-model-name" in capsys.readouterr().err


def test_get_model_info_over_grpc(model, tmp_path):
    proc = inference_proc(model, None, tmp_path, "--served-model-name", "tiny").start()
    try:
        proc.wait_serving()
        with grpc.insecure_channel(proc.address) as channel:
            client = pb_grpc.InferenceStub(channel)
            info = client.GetModelInfo(pb.GetModelInfoRequest(), timeout=10)
            stats = client.GetStats(pb.GetStatsRequest(), timeout=10)
        assert info.model_id == "tiny" == stats.model and info.context_window == 2048
        assert info.chat_template == CHAT_TEMPLATE and info.adds_bos_token
        assert dict(info.special_tokens)["eos_token"] == "</s>"
    finally:
        proc.stop()
