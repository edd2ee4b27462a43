"""store.peft against adapters saved by the real peft library on a tiny Llama."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import torch
from peft import LoraConfig, get_peft_model
from safetensors.torch import load_file
from transformers import LlamaConfig, LlamaForCausalLM

from store.peft import (
    SUPPORTED_MODULES,
    AdapterFormatError,
    BaseModelMismatch,
    BaseModelShape,
    SafetensorsHeaderReader,
    parse_adapter_config,
    parse_safetensors_header,
    validate_adapter,
)

HF_CONFIG = dict(
    hidden_size=32,
    intermediate_size=48,
    num_hidden_layers=3,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=8,
    vocab_size=64,
)
BASE = BaseModelShape.from_hf_config(HF_CONFIG)

CASES = {
    "all_seven_f32": (dict(r=4, lora_alpha=8, target_modules=list(SUPPORTED_MODULES)), None),
    "patterns_bf16": (
        dict(
            r=4,
            lora_alpha=8,
            target_modules=["q_proj", "v_proj", "down_proj"],
            rank_pattern={"model.layers.1.self_attn.q_proj": 2, "down_proj": 6},
            alpha_pattern={"v_proj": 3, r"layers\.2\.mlp\.down_proj": 5},
        ),
        torch.bfloat16,
    ),
    "regex_rslora_f16": (
        dict(
            r=8,
            lora_alpha=4,
            target_modules=r"model\.layers\.[02]\.(self_attn\.(k|o)_proj|mlp\.up_proj)",
            use_rslora=True,
        ),
        torch.float16,
    ),
    "layers_to_transform": (
        dict(
            r=3, lora_alpha=6, target_modules=["gate_proj", "up_proj"], layers_to_transform=[0, 2]
        ),
        None,
    ),
    "all_linear_excluded": (
        dict(
            r=2,
            lora_alpha=2,
            target_modules="all-linear",
            exclude_modules=["model.layers.1.mlp.down_proj"],
        ),
        None,
    ),
}


def _save(path: Path, dtype: torch.dtype | None, **lora_kwargs) -> Path:
    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(**HF_CONFIG))
    if dtype is not None:
        model = model.to(dtype)
    peft_model = get_peft_model(model, LoraConfig(**lora_kwargs))
    # Non-zero B so that the byte comparison below means something.
    for name, param in peft_model.named_parameters():
        if "lora_B" in name:
            torch.nn.init.normal_(param)
    peft_model.save_pretrained(path)
    return peft_model


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    root = tmp_path_factory.mktemp("peft")
    out = {}
    for name, (kwargs, dtype) in CASES.items():
        model = _save(root / name, dtype, **kwargs)
        adapted = {}
        for module_name, module in model.named_modules():
            match = re.search(r"layers\.(\d+)\.\w+\.(\w+)$", module_name)
            if match and hasattr(module, "lora_A"):
                adapted[(int(match[1]), match[2])] = (
                    module.r["default"],
                    module.scaling["default"],
                )
        out[name] = (root / name, adapted)
    return out


@pytest.mark.parametrize("case", list(CASES))
def test_real_adapter_round_trip(saved, case):
    path, adapted = saved[case]
    config = parse_adapter_config((path / "adapter_config.json").read_bytes())
    data = (path / "adapter_model.safetensors").read_bytes()
    header = parse_safetensors_header(data)
    validate_adapter(config, header, BASE)

    assert header.total_size == len(data)
    assert config.target_modules == tuple(
        m for m in SUPPORTED_MODULES if any(module == m for _, module in adapted)
    )
    for layer in range(BASE.num_layers):
        for module in SUPPORTED_MODULES:
            assert config.targets(layer, module) == ((layer, module) in adapted), (layer, module)
    for (layer, module), (rank, scaling) in adapted.items():
        assert config.rank(layer, module) == rank
        assert config.scale(layer, module) == pytest.approx(scaling, rel=1e-12)

    reference = load_file(path / "adapter_model.safetensors")
    assert {t.name for t in header.tensors} == set(reference)
    for entry in header.tensors:
        tensor = reference[entry.name]
        assert entry.shape == tuple(tensor.shape)
        assert (
            entry.dtype
            == {torch.float32: "F32", torch.float16: "F16", torch.bfloat16: "BF16"}[tensor.dtype]
        )
        raw = data[header.data_offset + entry.begin : header.data_offset + entry.end]
        assert raw == tensor.contiguous().view(torch.uint8).numpy().tobytes()
        r = adapted[(entry.layer, entry.module)][0]
        d_in, d_out = BASE.module_dims(entry.module)
        assert entry.shape == ((r, d_in) if entry.kind == "A" else (d_out, r))


@pytest.mark.parametrize("chunk", [1, 7, 8, 9, 4096])
def test_incremental_reader_matches_whole_parse(saved, chunk):
    data = (saved["patterns_bf16"][0] / "adapter_model.safetensors").read_bytes()
    reader = SafetensorsHeaderReader()
    results = [reader.feed(data[i : i + chunk]) for i in range(0, len(data), chunk)]
    first = next(i for i, r in enumerate(results) if r is not None)
    assert all(r is None for r in results[:first])
    assert (first + 1) * chunk >= results[first].data_offset > first * chunk
    assert results[-1] == parse_safetensors_header(data)


def test_real_adapter_on_wrong_base_is_mismatch(saved):
    path, _ = saved["all_seven_f32"]
    config = parse_adapter_config((path / "adapter_config.json").read_bytes())
    header = parse_safetensors_header((path / "adapter_model.safetensors").read_bytes())
    for change in (
        {"num_hidden_layers": 2},
        {"num_hidden_layers": 4},
        {"intermediate_size": 40},
        {"num_key_value_heads": 4},
        {"hidden_size": 64},
    ):
        base = BaseModelShape.from_hf_config({**HF_CONFIG, **change})
        with pytest.raises(BaseModelMismatch):
            validate_adapter(config, header, base)


@pytest.mark.parametrize(
    ("kwargs", "message", "weights_message"),
    [
        (dict(target_modules=["q_proj", "v_proj"], use_dora=True), "DoRA", "DoRA"),
        (
            dict(target_modules=["q_proj"], modules_to_save=["lm_head"]),
            "modules_to_save",
            "lm_head",
        ),
        (dict(target_modules=["q_proj", "embed_tokens"]), "embed_tokens", "embed_tokens"),
        (dict(target_modules=["q_proj", "lm_head"]), "lm_head", "lm_head"),
        (dict(target_modules=["q_proj"], bias="lora_only"), "bias", None),
    ],
)
def test_real_unsupported_adapters_are_rejected(tmp_path, kwargs, message, weights_message):
    _save(tmp_path, None, r=2, lora_alpha=4, **kwargs)
    with pytest.raises(AdapterFormatError, match=message):
        parse_adapter_config((tmp_path / "adapter_config.json").read_bytes())
    data = (tmp_path / "adapter_model.safetensors").read_bytes()
    if weights_message is None:
        parse_safetensors_header(data)
    else:
        # The weights alone are refused too, whatever the config says.
        with pytest.raises(AdapterFormatError, match=weights_message):
            parse_safetensors_header(data)
