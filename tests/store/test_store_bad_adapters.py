"""Adapters that are well-formed on the surface but would make lorafleet serve something else
than PEFT loads, or cost the validator unbounded work: refused, quickly, with a clear message."""

from __future__ import annotations

import json
import random
import struct
import time

import numpy as np
import pytest

from store.errors import AdapterTooLarge, InvalidRequest
from store.peft import (
    AdapterFormatError,
    BaseModelShape,
    check_adapter_file,
    parse_adapter_config,
    parse_safetensors_header,
    validate_adapter,
)
from store.synthetic import lora_config_json, lora_tensors, safetensors_bytes, tensor_name
from store.upload_check import UploadCheck

BASE = BaseModelShape(2, 16, 24, 4, 2, 4, 32)
CONFIG = lora_config_json(4, 8, ["q_proj", "v_proj"])


def _tensors(dtype="F16", base=BASE) -> dict:
    return dict(lora_tensors(base, 4, ("q_proj", "v_proj"), dtype))


def _renamed(tensors: dict, old: str, new: str) -> dict:
    return {new if name == old else name: value for name, value in tensors.items()}


def _validate(tensors: dict, cfg: bytes = CONFIG, base=BASE) -> None:
    data = safetensors_bytes(tensors)
    validate_adapter(parse_adapter_config(cfg), parse_safetensors_header(data), base)


A1 = tensor_name(1, "q_proj", "A")


@pytest.mark.parametrize(
    "layer",
    ["01", "0001", "\u0661", "\u0967", "\uff11", "1\u0660"],  # leading zeros; Arabic-Indic,
)  # Devanagari and fullwidth digits
def test_layer_indices_must_be_written_as_peft_writes_them(layer):
    renamed = _renamed(_tensors(), A1, A1.replace(".layers.1.", f".layers.{layer}."))
    with pytest.raises(AdapterFormatError, match="not written as PEFT writes layer indices"):
        _validate(renamed)


def test_two_names_for_one_tensor_are_refused():
    """layers.1 and layers.01 both: one would silently replace the other."""
    tensors = _tensors()
    tensors[A1.replace(".layers.1.", ".layers.01.")] = tensors[A1]
    with pytest.raises(AdapterFormatError, match="layers.01"):
        _validate(tensors)


def test_layer_index_beyond_any_model_is_refused_before_any_work_on_it():
    big = A1.replace(".layers.1.", ".layers." + "9" * 5000 + ".")
    start = time.perf_counter()
    with pytest.raises(AdapterFormatError, match="beyond the largest layer index"):
        _validate(_renamed(_tensors(), A1, big), base=None)
    with pytest.raises(AdapterFormatError, match="layers_to_transform must be a layer index"):
        parse_adapter_config(lora_config_json(4, 8, ["q_proj"], layers_to_transform=[10**18]))
    assert time.perf_counter() - start < 1.0


@pytest.mark.parametrize(
    ("extra", "message"),
    [
        (dict(lora_alpha=0), "lora_alpha must be a finite number > 0, got 0"),
        (dict(lora_alpha=-16), "lora_alpha must be a finite number > 0, got -16"),
        (dict(alpha_pattern={"v_proj": 0.0}), r"alpha_pattern\['v_proj'\] must be .* > 0"),
        (dict(alpha_pattern={"q_proj": -2}), r"alpha_pattern\['q_proj'\] must be .* > 0"),
    ],
)
def test_alpha_must_be_positive(extra, message):
    with pytest.raises(AdapterFormatError, match=message):
        parse_adapter_config(json.dumps({**json.loads(CONFIG), **extra}))


@pytest.mark.parametrize(
    ("pattern", "message"),
    [(r"(q)_proj\1", "backreferences, lookarounds"), (r"(?!k).*_proj", "backreferences")],
)
def test_regexes_that_cannot_be_matched_in_linear_time_are_refused(pattern, message):
    with pytest.raises(AdapterFormatError, match=message):
        parse_adapter_config(lora_config_json(4, 8, [], target_modules=pattern))


def test_catastrophic_regexes_cost_no_more_than_plain_ones():
    """(.*)*q_proj takes Python's backtracking matcher exponential time on every module name it
    does not match; matched in linear time it resolves as fast as a plain pattern."""
    start = time.perf_counter()
    config = parse_adapter_config(
        lora_config_json(
            4,
            8,
            [],
            target_modules=r"(.*)*q_proj",
            exclude_modules=r"(a|aa)*(b|bb)*(.*.*.*.*.*.*)*z",
            rank_pattern={r"(.*.*.*.*.*.*.*.*)*v_proj": 2},
        )
    )
    assert time.perf_counter() - start < 1.0
    assert config.target_modules == ("q_proj",)
    assert config.rank(0, "v_proj") == 2 and config.rank(0, "q_proj") == 4


def test_pattern_order_and_tails_match_peft():
    """The first matching rank_pattern key in the file's order wins, matched on the key's tail."""
    config = parse_adapter_config(
        lora_config_json(
            4,
            8,
            ["q_proj", "v_proj"],
            rank_pattern={r"layers\.1\.self_attn\.q_proj": 2, "q_proj": 6, r".*_proj": 8},
        )
    )
    assert [config.rank(0, "q_proj"), config.rank(1, "q_proj"), config.rank(1, "v_proj")] == [
        6,
        2,
        8,
    ]
    assert config.rank(1, "o_proj") == 8  # "o_proj" is a tail of the key, "_proj" is not


def _with_value(dtype: str, value: float) -> bytes:
    tensors = _tensors(dtype)
    name = tensor_name(1, "v_proj", "B")
    values = tensors[name][1].copy()
    values[3, 2] = value
    tensors[name] = (dtype, values)
    return safetensors_bytes(tensors)


@pytest.mark.parametrize("dtype", ["F16", "BF16", "F32"])
@pytest.mark.parametrize("value", [np.nan, np.inf, -np.inf])
def test_non_finite_values_are_refused_however_the_bytes_are_cut(dtype, value):
    data = _with_value(dtype, value)
    config = parse_adapter_config(CONFIG)
    message = (
        rf"layers\.1\.self_attn\.v_proj\.lora_B\.weight holds a value .* {dtype}\) at \[3, 2\]"
    )
    with pytest.raises(AdapterFormatError, match=message):
        check_adapter_file(config, data, BASE)
    rng = random.Random(7)
    for _ in range(20):
        check = UploadCheck(config, 1 << 20, BASE)
        with pytest.raises(AdapterFormatError, match=message):
            position = 0
            while position < len(data):
                size = rng.choice([1, 2, 3, 5, 64, 1000])
                check.feed(data[position : position + size])
                position += size


@pytest.mark.parametrize("dtype", ["F16", "BF16", "F32"])
def test_finite_extremes_pass(dtype):
    """The largest finite value of each dtype (and subnormals) is a value, not an overflow."""
    largest = {"F16": 65504.0, "BF16": 3.3895313892515355e38, "F32": 3.4028234663852886e38}
    for value in (largest[dtype], -largest[dtype], 1e-40 if dtype != "F16" else 6e-8):
        data = _with_value(dtype, value)
        check_adapter_file(parse_adapter_config(CONFIG), data, BASE)


def test_upload_check_bounds_and_order():
    config = parse_adapter_config(CONFIG)
    data = safetensors_bytes(_tensors())
    check = UploadCheck(config, len(data) - 1, BASE)
    with pytest.raises(AdapterTooLarge, match="limit"):
        check.feed(data)
    check = UploadCheck(config, 1 << 20, BASE, announced_size=len(data) + 1)
    with pytest.raises(InvalidRequest, match="size_bytes says"):
        check.feed(data)
    check = UploadCheck(config, 1 << 20, BASE)
    check.feed(data[:100])
    with pytest.raises(InvalidRequest, match="inside the safetensors header"):
        check.finish()
    check.feed(data[100:-1])
    with pytest.raises(InvalidRequest, match="truncated"):
        check.finish()
    check.feed(data[-1:])
    assert check.finish().total_size == len(data)
    with pytest.raises(InvalidRequest, match="more bytes than its header"):
        check.feed(b"\0")
    assert struct.unpack("<Q", data[:8])[0] > 0


def test_found_by_the_fuzzer():
    """A dtype that is not a string was a TypeError (INTERNAL); PEFT refuses
    layers_to_transform with target_modules "all-linear", and so does the store now."""
    name = tensor_name(0, "q_proj", "A")
    text = json.dumps({name: {"dtype": {}, "shape": [4, 16], "data_offsets": [0, 128]}})
    with pytest.raises(AdapterFormatError, match="has dtype {}"):
        parse_safetensors_header(struct.pack("<Q", len(text)) + text.encode())
    with pytest.raises(AdapterFormatError, match="layers_to_transform cannot be used"):
        parse_adapter_config(lora_config_json(4, 8, [], target_modules="all-linear",
                                              layers_to_transform=[0]))  # fmt: skip
