"""store.peft: every kind of bad adapter is refused with a message naming the problem."""

from __future__ import annotations

import json
import math
import struct

import numpy as np
import pytest

from store.peft import (
    AdapterFormatError,
    BaseModelMismatch,
    BaseModelShape,
    SafetensorsHeaderReader,
    parse_adapter_config,
    parse_safetensors_header,
    validate_adapter,
)
from store.synthetic import (
    lora_config_json,
    lora_tensors,
    safetensors_bytes,
    synthetic_adapter,
    tensor_name,
)

BASE = BaseModelShape(
    num_layers=2,
    hidden_size=16,
    intermediate_size=24,
    num_heads=4,
    num_kv_heads=2,
    head_dim=4,
    vocab_size=32,
)


def config(**extra) -> bytes:
    modules = extra.pop("target_modules", ["q_proj", "v_proj"])
    config = json.loads(lora_config_json(extra.pop("r", 4), extra.pop("lora_alpha", 8), []))
    return json.dumps({**config, "target_modules": modules, **extra}).encode()


def raw_header(doc: dict, declared: int | None = None) -> bytes:
    text = json.dumps(doc).encode()
    return struct.pack("<Q", len(text) if declared is None else declared) + text


def entry(dtype="F16", shape=(4, 16), offsets=(0, 128)) -> dict:
    return {"dtype": dtype, "shape": list(shape), "data_offsets": list(offsets)}


A0 = tensor_name(0, "q_proj", "A")
B0 = tensor_name(0, "q_proj", "B")


@pytest.mark.parametrize(
    ("raw", "message"),
    [
        (b"{not json", "not valid JSON"),
        (b"[1, 2]", "JSON object"),
        (config(peft_type="PREFIX_TUNING"), "only LORA"),
        (json.dumps({"r": 4, "target_modules": ["q_proj"]}).encode(), "peft_type is None"),
        (config(use_dora=True), "DoRA"),
        (config(modules_to_save=["lm_head"]), "modules_to_save"),
        (config(bias="all"), "bias"),
        (config(lora_bias=True), "lora_bias"),
        (config(target_modules=["q_proj", "embed_tokens"]), "LoRA on embed_tokens"),
        (config(target_modules=["lm_head"]), "LoRA on lm_head"),
        (config(target_modules=["q_proj", "fc1"]), "'fc1' is not one of the supported"),
        (config(target_modules=[]), "non-empty list"),
        (config(target_modules=None), "non-empty list"),
        (config(target_modules=".*"), "LoRA on embed_tokens"),
        (config(target_modules=r"lm_head|.*q_proj"), "LoRA on lm_head"),
        (config(target_modules=r".*\.fc1"), "selects none"),
        (config(target_modules="(unclosed"), "not a valid regex"),
        (config(r=0), "r must be a positive integer"),
        (config(r=2.5), "r must be a positive integer"),
        (config(r=256), "ranks up to 128"),
        (config(rank_pattern={"q_proj": 200}), r"rank_pattern\['q_proj'\] is 200"),
        (config(rank_pattern={"q_proj[": 2}), "not a valid regex"),
        (config(alpha_pattern={"q_proj": "big"}), "finite number"),
        (config(lora_alpha=math.inf), "finite number"),
        (config(target_modules=r".*q_proj", layers_to_transform=[0]), "regex"),
        (config(layers_to_transform=[-1]), "layers_to_transform"),
        (config(layers_to_transform=[0], layers_pattern="blocks"), "layers_pattern"),
        (config(init_lora_weights="pissa_niter_4"), "changes the base weights"),
        (config(alora_invocation_tokens=[1, 2]), "alora"),
        (config(target_parameters=["mlp.experts.down_proj"]), "target_parameters"),
        (config(trainable_token_indices=[3]), "trainable_token_indices"),
        (config(use_rslora="yes"), "use_rslora"),
        (b" " * (2 << 20), "at most"),
    ],
)
def test_bad_config_is_rejected(raw, message):
    with pytest.raises(AdapterFormatError, match=message):
        parse_adapter_config(raw)


def test_config_semantics_follow_peft():
    cfg = parse_adapter_config(
        config(
            target_modules=["k_proj", "self_attn.q_proj", "layers.1.mlp.down_proj"],
            r=8,
            lora_alpha=16,
            # First matching key wins, in file order.
            rank_pattern={r"layers\.1\.self_attn\.q_proj": 2, "q_proj": 4},
            alpha_pattern={"k_proj": 2},
            exclude_modules=["model.layers.0.self_attn.k_proj"],
        )
    )
    assert cfg.target_modules == ("q_proj", "k_proj", "down_proj")
    assert [cfg.rank(i, "q_proj") for i in range(3)] == [4, 2, 4]
    assert cfg.rank(0, "down_proj") == 8
    assert cfg.scale(1, "q_proj") == 16 / 2
    assert cfg.scale(0, "k_proj") == 2 / 8
    assert not cfg.targets(0, "k_proj") and cfg.targets(1, "k_proj")
    assert cfg.targets(1, "down_proj") and not cfg.targets(0, "down_proj")
    assert not cfg.targets(0, "o_proj")
    assert cfg.max_rank == 8

    rs = parse_adapter_config(config(r=16, lora_alpha=8, use_rslora=True, layers_to_transform=3))
    assert rs.layers_to_transform == (3,)
    assert rs.scale(3, "v_proj") == pytest.approx(8 / 4)
    assert rs.targets(3, "q_proj") and not rs.targets(2, "q_proj")
    assert parse_adapter_config(config(target_modules="all-linear")).target_modules == (
        "q_proj",
        "k_proj",
        "v_proj",
        "o_proj",
        "gate_proj",
        "up_proj",
        "down_proj",
    )


def test_base_shape_from_hf_configs():
    mistral = BaseModelShape.from_hf_config(
        dict(
            num_hidden_layers=32,
            hidden_size=4096,
            intermediate_size=14336,
            num_attention_heads=32,
            num_key_value_heads=8,
            vocab_size=32000,
        )
    )
    assert mistral.head_dim == 128
    assert mistral.module_dims("k_proj") == (4096, 1024)
    assert mistral.module_dims("o_proj") == (4096, 4096)
    assert mistral.module_dims("down_proj") == (14336, 4096)
    llama = BaseModelShape.from_hf_config(
        dict(
            num_hidden_layers=2,
            hidden_size=64,
            intermediate_size=96,
            num_attention_heads=4,
            num_key_value_heads=None,
            head_dim=None,
            vocab_size=100,
        )
    )
    assert (llama.num_kv_heads, llama.head_dim) == (4, 16)
    with pytest.raises(ValueError, match="intermediate_size"):
        BaseModelShape.from_hf_config(dict(num_hidden_layers=2, hidden_size=64))
    with pytest.raises(ValueError, match="multiple of"):
        BaseModelShape(2, 64, 96, 4, 3, 16, 100)


@pytest.mark.parametrize(
    ("data", "message"),
    [
        (b"\x01\x00", "shorter than its 8-byte prefix"),
        (struct.pack("<Q", 1 << 40), "at most"),
        (struct.pack("<Q", 1), "too short"),
        (struct.pack("<Q", 100) + b"{}", "ends inside"),
        (raw_header({}, declared=None)[:8] + b"{\xff}", "not valid JSON"),
        (raw_header({}), "no tensors"),
        (b"%s" % struct.pack("<Q", 2) + b"[]", "JSON object"),
        (struct.pack("<Q", 23) + b'{"a": {}, "a": {}}     ', "'a' twice"),
        (raw_header({A0: entry(dtype="F64", offsets=(0, 512))}), "dtype 'F64'"),
        (raw_header({A0: entry(dtype="I8", offsets=(0, 64))}), "dtype 'I8'"),
        (raw_header({A0: entry(shape=(4, 4, 4))}), "two positive dims"),
        (raw_header({A0: entry(shape=(0, 16), offsets=(0, 0))}), "two positive dims"),
        (raw_header({A0: entry(offsets=(0, 100))}), "needs 128"),
        (raw_header({A0: entry(offsets=(128, 0))}), "bad data_offsets"),
        (raw_header({A0: entry(offsets=(8, 136))}), "gap of 8 bytes"),
        (raw_header({A0: entry(), B0: entry(offsets=(64, 192))}), "overlaps"),
        (raw_header({A0: entry(), B0: entry(offsets=(136, 264))}), "gap of 8 bytes"),
        (raw_header({A0: entry(), "__metadata__": {"format": 1}}), "__metadata__"),
        (raw_header({"model.layers.0.self_attn.q_proj.weight": entry()}), "expected names"),
        (
            raw_header({"base_model.model.model.embed_tokens.lora_embedding_A": entry()}),
            "LoRA on embed_tokens",
        ),
        (raw_header({A0.replace("self_attn", "mlp"): entry()}), "belongs under self_attn"),
        (raw_header({A0.replace("q_proj", "qkv_proj"): entry()}), "not a supported module"),
        (
            raw_header({A0.replace("lora_A.weight", "lora_magnitude_vector"): entry()}),
            "DoRA",
        ),
    ],
)
def test_bad_safetensors_header_is_rejected(data, message):
    with pytest.raises(AdapterFormatError, match=message):
        parse_safetensors_header(data)
    if len(data) >= 8 and struct.unpack("<Q", data[:8])[0] <= len(data) - 8:
        # The incremental reader reaches the same verdict, byte by byte.
        reader = SafetensorsHeaderReader()
        with pytest.raises(AdapterFormatError, match=message):
            for i in range(len(data)):
                reader.feed(data[i : i + 1])


def test_reader_refuses_long_header_before_buffering_it():
    reader = SafetensorsHeaderReader(max_header_bytes=1000)
    with pytest.raises(AdapterFormatError, match="at most 1000"):
        reader.feed(struct.pack("<Q", 1001))
    assert (
        parse_safetensors_header(
            synthetic_adapter(BASE, 2).safetensors, max_header_bytes=10_000
        ).total_size
        > 0
    )


def _tensors(rank=4, modules=("q_proj", "v_proj"), base=BASE, dtype="F16"):
    return dict(lora_tensors(base, rank, modules, dtype))


def _check(cfg: bytes, tensors: dict, base: BaseModelShape | None = BASE) -> None:
    header = parse_safetensors_header(safetensors_bytes(tensors))
    validate_adapter(parse_adapter_config(cfg), header, base)


def test_valid_synthetic_adapters_pass():
    for dtype in ("F16", "BF16", "F32"):
        _check(config(), _tensors(dtype=dtype))
        _check(config(), _tensors(dtype=dtype), base=None)
    files = synthetic_adapter(BASE, rank=3)
    validate_adapter(
        parse_adapter_config(files.config_json), parse_safetensors_header(files.safetensors), BASE
    )


def _drop(tensors, layer, module, kind):
    tensors = dict(tensors)
    del tensors[tensor_name(layer, module, kind)]
    return tensors


def _reshape(tensors, layer, module, kind, shape):
    tensors = dict(tensors)
    tensors[tensor_name(layer, module, kind)] = ("F16", np.zeros(shape, np.float32))
    return tensors


@pytest.mark.parametrize(
    ("cfg", "tensors", "message"),
    [
        (config(), _drop(_tensors(), 1, "v_proj", "B"), "layer 1 v_proj has lora_A but no lora_B"),
        (config(), _drop(_tensors(), 0, "q_proj", "A"), "layer 0 q_proj has lora_B but no lora_A"),
        (config(), _reshape(_tensors(), 0, "q_proj", "A", (5, 16)), "rank from adapter_config"),
        (config(), _reshape(_tensors(), 1, "v_proj", "B", (8, 5)), "rank from adapter_config"),
        (config(r=2), _tensors(), "rank from adapter_config.json is 2"),
        (
            config(rank_pattern={"v_proj": 2}),
            _tensors(),
            "layer 0 v_proj: .* the rank from adapter_config.json is 2",
        ),
        (config(), _reshape(_tensors(), 1, "q_proj", "A", (4, 12)), "d_in=12 but"),
        (config(), _reshape(_tensors(), 1, "v_proj", "B", (6, 4)), "d_out=6 but"),
        (
            config(target_modules=["q_proj", "gate_proj"]),
            {
                **_tensors(modules=("q_proj",)),
                **_tensors(modules=("gate_proj",), base=BaseModelShape(2, 20, 24, 4, 2, 4, 32)),
            },
            "hidden size differs",
        ),
        (config(target_modules=["q_proj"]), _tensors(), "does not target.*layer 0 v_proj"),
        (config(), _drop(_drop(_tensors(), 0, "v_proj", "A"), 0, "v_proj", "B"), "no weights"),
        (
            config(),
            {
                k: v
                for k, v in _tensors(base=BaseModelShape(3, 16, 24, 4, 2, 4, 32)).items()
                if ".layers.1." not in k
            },
            "no weights for: layer 1 q_proj, layer 1 v_proj",
        ),
        (config(layers_to_transform=[1]), _tensors(), "does not target.*layer 0"),
    ],
)
def test_inconsistent_adapter_is_rejected(cfg, tensors, message):
    for base in (BASE, None):
        with pytest.raises(AdapterFormatError, match=message) as info:
            _check(cfg, tensors, base)
        assert not isinstance(info.value, BaseModelMismatch)


@pytest.mark.parametrize(
    ("cfg", "tensors", "message"),
    [
        (
            config(),
            _tensors(base=BaseModelShape(3, 16, 24, 4, 2, 4, 32)),
            "weights for layer 2 but the base model has 2 layers",
        ),
        (
            config(layers_to_transform=[0, 5]),
            _tensors(base=BaseModelShape(1, 16, 24, 4, 2, 4, 32)),
            r"layers_to_transform names layers \[5\]",
        ),
        (
            config(),
            _tensors(base=BaseModelShape(1, 16, 24, 4, 2, 4, 32)),
            "no weights for: layer 1 q_proj",
        ),
        (config(), _tensors(base=BaseModelShape(2, 32, 24, 4, 2, 8, 32)), "d_in=32 but the base"),
        (
            config(target_modules=["k_proj"]),
            _tensors(modules=("k_proj",), base=BaseModelShape(2, 16, 24, 4, 4, 4, 32)),
            "k_proj.lora_B.weight has d_out=16 but the base model's k_proj has d_out=8",
        ),
    ],
)
def test_adapter_that_does_not_fit_the_base_is_a_mismatch(cfg, tensors, message):
    _check(cfg, tensors, base=None)  # fine on its own
    with pytest.raises(BaseModelMismatch, match=message):
        _check(cfg, tensors, BASE)
