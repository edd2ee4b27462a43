"""Seeded fuzzing of the upload validator (store.upload_check.UploadCheck, in process): thousands
of mutated safetensors headers and adapter configs, each fed in random pieces. The validator
never fails other than with a refusal naming the problem, and every file it accepts passes an
independent oracle: the safetensors library opens it, and its tensor names and shapes are
exactly those real PEFT saves (get_peft_model_state_dict) for its config on the base model."""

from __future__ import annotations

import contextlib
import json
import random
import struct
from functools import cache

import numpy as np
import pytest
from peft import LoraConfig, get_peft_model, get_peft_model_state_dict
from safetensors.torch import load as load_safetensors
from transformers import LlamaConfig, LlamaForCausalLM

from store.base_model import BaseModelShape
from store.errors import StoreError
from store.peft import AdapterFormatError, parse_adapter_config
from store.synthetic import lora_config_json
from store.upload_check import UploadCheck

BASE = BaseModelShape(2, 16, 24, 4, 2, 4, 32)
HF = dict(
    hidden_size=16, intermediate_size=24, num_hidden_layers=2, num_attention_heads=4,
    num_key_value_heads=2, head_dim=4, vocab_size=32,
)  # fmt: skip
CASES = 3000
_BYTES = {"F16": 2, "BF16": 2, "F32": 4}

# Seeds the mutations start from: valid adapters in several PEFT styles.
SEEDS = [
    dict(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"]),
    dict(r=2, lora_alpha=4, target_modules="all-linear"),
    dict(r=4, lora_alpha=16, target_modules=["k_proj", "down_proj"], rank_pattern={"down_proj": 2}),
    dict(r=3, lora_alpha=6, target_modules=["gate_proj", "up_proj"], layers_to_transform=[1]),
    dict(r=2, lora_alpha=2, target_modules=r"model\.layers\.0\.self_attn\.(q|o)_proj"),
    dict(r=4, lora_alpha=8, target_modules=["o_proj"],
         alpha_pattern={"layers.1.self_attn.o_proj": 3}),
]  # fmt: skip


@cache
def peft_expectation(config_json: str) -> dict[str, tuple[int, ...]] | None:
    """Tensor names and shapes real PEFT saves for this config on the base model; None when
    PEFT itself cannot build the adapter from it."""
    raw = json.loads(config_json)
    kwargs = {k: v for k, v in raw.items() if k in LoraConfig.__dataclass_fields__}
    kwargs.pop("peft_type", None)
    try:
        model = get_peft_model(LlamaForCausalLM(LlamaConfig(**HF)), LoraConfig(**kwargs))
    except Exception:  # noqa: BLE001 (any refusal of PEFT's)
        return None
    return {name: tuple(t.shape) for name, t in get_peft_model_state_dict(model).items()}


def _header(config: dict, dtype: str, rng: random.Random) -> dict:
    """The header PEFT would write for ``config`` (names, shapes, offsets), as a dict."""
    expected = peft_expectation(json.dumps(config))
    assert expected is not None
    names = sorted(expected)
    rng.shuffle(names)  # writers order tensors differently; offsets follow the order given
    doc, offset = {"__metadata__": {"format": "pt"}}, 0
    for name in names:
        shape = expected[name]
        size = shape[0] * shape[1] * _BYTES[dtype]
        doc[name] = {"dtype": dtype, "shape": list(shape), "data_offsets": [offset, offset + size]}
        offset += size
    return doc


def _rename(name: str, rng: random.Random) -> str:
    choices = [
        lambda n: n.replace(".layers.0.", ".layers.00."),
        lambda n: n.replace(".layers.1.", ".layers.01."),
        lambda n: n.replace(".layers.1.", ".layers.\u0661."),
        lambda n: n.replace(".layers.0.", ".layers.\uff10."),
        lambda n: n.replace(".layers.1.", ".layers.7."),
        lambda n: n.replace(".layers.0.", ".layers." + "9" * rng.randint(3, 40) + "."),
        lambda n: n.replace("lora_A", "lora_B"),
        lambda n: n.replace("lora_B", "lora_A"),
        lambda n: n.replace("self_attn", "mlp"),
        lambda n: n.replace("q_proj", "k_proj").replace("gate_proj", "up_proj"),
        lambda n: n.replace("base_model.model.", ""),
        lambda n: n.replace(".weight", ".default.weight"),
        lambda n: n + " ",
        lambda n: n.upper(),
    ]
    return rng.choice(choices)(name)


def _mutate_header(doc: dict, rng: random.Random) -> None:
    names = [n for n in doc if n != "__metadata__"]
    name = rng.choice(names)
    entry = doc[name]
    kind = rng.randrange(9)
    if kind == 0:
        doc[_rename(name, rng)] = doc.pop(name)
    elif kind == 1:
        doc[_rename(name, rng)] = dict(entry)  # a second name for a tensor's bytes
    elif kind == 2:
        del doc[name]
    elif kind == 3:
        entry["dtype"] = rng.choice(["F16", "BF16", "F32", "F64", "I8", "f16", None])
    elif kind == 4:
        entry["shape"] = rng.choice(
            [
                [entry["shape"][1], entry["shape"][0]],
                [0, 4],
                entry["shape"] + [1],
                [entry["shape"][0] + 1, 4],
                "4x4",
            ]
        )
    elif kind == 5:
        a, b = entry["data_offsets"]
        entry["data_offsets"] = rng.choice([[a + 1, b + 1], [a, b + 2], [b, a], [-2, b], [a]])
    elif kind == 6:
        doc["__metadata__"] = rng.choice([{"format": 1}, [], "pt", {"x": "y" * 100}])
    elif kind == 7:
        entry[rng.choice(["dtype", "shape", "data_offsets"])] = rng.choice([None, {}, 1e300])
    else:
        other = rng.choice(names)
        if other in doc and other != name:
            doc[name]["data_offsets"], doc[other]["data_offsets"] = (
                doc[other]["data_offsets"], doc[name]["data_offsets"],
            )  # fmt: skip


def _mutate_config(config: dict, rng: random.Random) -> None:
    key, values = rng.choice([
        ("r", [1, 2, 3, 4, 8, 0, -1, 2.5, "4", True, 10**9]),
        ("lora_alpha", [8, 16.0, 0, -8, float("nan"), "8", 1e308]),
        ("target_modules", [["q_proj"], ["q_proj", "v_proj"], "all-linear", [], ["lm_head"],
                            r"(.*)*q_proj", r".*\.(q|v)_proj", r"(q)\1", "q_proj"]),
        ("rank_pattern", [{}, {"v_proj": 2}, {"q_proj": 0}, {"(": 2}, {"layers.1.*": 3}]),
        ("alpha_pattern", [{}, {"q_proj": 0}, {"v_proj": 4.5}, {".*": -1}]),
        ("layers_to_transform", [None, [0], [1], [0, 1], [5], [-1], 10**18, [True]]),
        ("use_rslora", [True, False, "yes"]),
        ("use_dora", [True, False]),
        ("bias", ["none", "all", "lora_only"]),
        ("peft_type", ["LORA", "IA3", None]),
        ("exclude_modules", [None, ["v_proj"], r".*layers\.1.*", [""]]),
    ])  # fmt: skip
    config[key] = rng.choice(values)


def _file(doc: dict, rng: random.Random, damage: bool = True) -> bytes:
    text = json.dumps(doc).encode()
    if damage and rng.random() < 0.1:  # raw damage to the header bytes
        at = rng.randrange(len(text))
        text = text[:at] + bytes([rng.randrange(256)]) + text[at + 1 :]
    length = len(text)
    if damage and rng.random() < 0.05:
        length = rng.choice([0, 1, len(text) + 9, 2**40])
    offsets = [e.get("data_offsets") for e in doc.values() if isinstance(e, dict)]
    ends = [o for pair in offsets if isinstance(pair, list) for o in pair
            if isinstance(o, int) and 0 <= o < 1 << 20]  # fmt: skip
    body = np.random.default_rng(rng.randrange(1 << 30)).standard_normal(
        (max(ends, default=0) + 1) // 2, dtype=np.float32
    ).astype(np.float16).tobytes()[: max(ends, default=0)]  # fmt: skip
    if damage and body and rng.random() < 0.05:  # a NaN (bytes 2-3 of a 4-byte word)
        at = rng.randrange(len(body) // 4) * 4 + 2
        body = body[:at] + b"\xff\xff" + body[at + 2 :]
    data = struct.pack("<Q", length) + text + body
    if damage and rng.random() < 0.05:
        data = data[: rng.randrange(len(data))] if rng.random() < 0.5 else data + b"\0" * 3
    return data


def _feed(config_json: str, data: bytes, rng: random.Random):
    """The validator's verdict: the accepted header, or the refusal."""
    try:
        check = UploadCheck(parse_adapter_config(config_json), 1 << 20, BASE)
        position = 0
        while position < len(data):
            size = rng.choice([1, 7, 64, 333, 4096, 1 << 20])
            check.feed(data[position : position + size])
            position += size
        return check.finish()
    except (AdapterFormatError, StoreError) as exc:
        assert str(exc), type(exc)
        return exc


def _oracle(config_json: str, data: bytes, header) -> None:
    tensors = load_safetensors(data)  # the safetensors library opens it
    assert {t.name for t in header.tensors} == set(tensors)
    for entry in header.tensors:
        assert tuple(tensors[entry.name].shape) == entry.shape
        assert bool(tensors[entry.name].float().isfinite().all()), entry.name
    expected = peft_expectation(config_json)
    assert expected is not None, f"PEFT cannot build {config_json}, the store accepted it"
    assert {name: tuple(t.shape) for name, t in tensors.items()} == expected


@pytest.mark.parametrize("seed", [0, 1])
def test_fuzzed_uploads_are_refused_or_are_what_peft_loads(seed):
    rng = random.Random(seed)
    accepted = refused = 0
    for _ in range(CASES // 2):
        base = json.loads(lora_config_json(1, 1, []))
        config = {**base, **rng.choice(SEEDS)}
        doc = _header(config, rng.choice(["F16", "BF16", "F32"]), rng)
        for _ in range(rng.choice([0, 1, 1, 1, 2, 3])):
            with contextlib.suppress(TypeError, ValueError, KeyError, IndexError):
                _mutate_header(doc, rng)  # (an earlier mutation may leave nothing to mutate)
        if rng.random() < 0.3:
            _mutate_config(config, rng)
        config_json = json.dumps(config)
        data = _file(doc, rng)
        verdict = _feed(config_json, data, rng)
        if isinstance(verdict, Exception):
            refused += 1
        else:
            _oracle(config_json, data, verdict)
            accepted += 1
    # Both outcomes are well represented: the mutations are neither all fatal nor all harmless.
    assert accepted > CASES // 20 and refused > CASES // 5, (accepted, refused)


def test_the_oracle_agrees_with_the_synthetic_writer():
    """The unmutated files of every seed are accepted (and pass the oracle)."""
    rng = random.Random(5)
    for seed in SEEDS:
        config_json = json.dumps({**json.loads(lora_config_json(1, 1, [])), **seed})
        data = _file(_header(json.loads(config_json), "F16", rng), rng, damage=False)
        header = _feed(config_json, data, rng)
        assert not isinstance(header, Exception), header
        _oracle(config_json, data, header)
