"""Every kind of bad upload is refused with the right status and a message that names the
problem, and leaves nothing behind: no version, no object, no multipart upload."""

from __future__ import annotations

import json
import struct
from functools import cache

import grpc
import numpy as np
import pytest

from lorafleet.v1 import adapter_store_pb2 as pb
from store.base_model import BaseModelShape
from store.synthetic import (
    AdapterFiles,
    lora_config_json,
    lora_tensors,
    safetensors_bytes,
    synthetic_adapter,
    tensor_name,
)
from tests.services.adapter_store.conftest import new_bucket
from tests.services.adapter_store.store_harness import (
    BASE,
    HF_CONFIG,
    StoreProcess,
    upload_requests,
)

GOOD = synthetic_adapter(BASE, rank=4, modules=("q_proj", "v_proj"))
INVALID = grpc.StatusCode.INVALID_ARGUMENT


@cache
def big() -> AdapterFiles:
    """~19 MB: its bytes reach storage in several parts before the upload ends."""
    wide = BaseModelShape(2, 4096, 11008, 32, 32, 128, 100)
    return synthetic_adapter(wide, rank=64, seed=5)


def header(adapter_id, config=GOOD.config_json, **fields):
    return pb.UploadAdapterRequest(
        header=pb.UploadAdapterHeader(
            adapter_id=adapter_id, adapter_config_json=config.decode(), **fields
        )
    )


def chunk(data: bytes) -> pb.UploadAdapterRequest:
    return pb.UploadAdapterRequest(chunk=data)


def with_files(config: bytes, body: bytes) -> AdapterFiles:
    return AdapterFiles(config, body)


def _missing_b() -> bytes:
    tensors = dict(lora_tensors(BASE, 4, ("q_proj", "v_proj")))
    del tensors[tensor_name(1, "v_proj", "B")]
    return safetensors_bytes(tensors)


def _poisoned(files: AdapterFiles, value: float, at_end: bool = False) -> AdapterFiles:
    """``files`` with one F16 value replaced (NaN or infinite): in the first tensor, or in the
    last value of the file, after every part but the last has reached storage."""
    body = bytearray(files.safetensors)
    start = 8 + struct.unpack("<Q", body[:8])[0]
    at = len(body) - 2 if at_end else start + 6
    body[at : at + 2] = np.array([value], dtype="<f2").tobytes()
    return AdapterFiles(files.config_json, bytes(body))


def _renamed_layer(layer: str) -> bytes:
    tensors = dict(lora_tensors(BASE, 4, ("q_proj", "v_proj")))
    for kind in ("A", "B"):
        name = tensor_name(1, "q_proj", kind)
        tensors[name.replace(".layers.1.", f".layers.{layer}.")] = tensors.pop(name)
    return safetensors_bytes(tensors)


def _f64_header() -> bytes:
    doc = {
        tensor_name(0, "q_proj", "A"): {"dtype": "F64", "shape": [4, 64], "data_offsets": [0, 2048]}
    }
    text = json.dumps(doc).encode()
    return struct.pack("<Q", len(text)) + text + bytes(2048)


CASES = {
    "bad id": (
        lambda i: upload_requests("Bad ID", GOOD),
        INVALID,
        "adapter_id 'Bad ID' is invalid",
    ),
    "dot-dot id": (lambda i: upload_requests(f"{i}/../x", GOOD), INVALID, "is invalid"),
    "absolute id": (lambda i: upload_requests(f"/{i}", GOOD), INVALID, "is invalid"),
    "long id": (lambda i: upload_requests(i + "x" * 128, GOOD), INVALID, "at most 128"),
    "chunk first": (lambda i: iter([chunk(GOOD.safetensors)]), INVALID, "must carry the header"),
    "empty stream": (lambda i: iter([]), INVALID, "must carry the header"),
    "two headers": (
        lambda i: iter([header(i), chunk(GOOD.safetensors[:100]), header(i)]),
        INVALID,
        "only the first",
    ),
    "config not json": (lambda i: iter([header(i, b"{oops")]), INVALID, "not valid JSON"),
    "dora": (
        lambda i: upload_requests(
            i,
            with_files(
                lora_config_json(4, 8, ["q_proj", "v_proj"], use_dora=True), GOOD.safetensors
            ),
        ),
        INVALID,
        "DoRA",
    ),
    "rank above max": (
        lambda i: upload_requests(
            i, with_files(lora_config_json(256, 8, ["q_proj"]), GOOD.safetensors)
        ),
        INVALID,
        "ranks up to 128",
    ),
    "rank disagrees": (
        lambda i: upload_requests(
            i, with_files(lora_config_json(8, 8, ["q_proj", "v_proj"]), GOOD.safetensors)
        ),
        INVALID,
        "rank from adapter_config.json is 8",
    ),
    "missing B": (
        lambda i: upload_requests(i, with_files(GOOD.config_json, _missing_b())),
        INVALID,
        "no lora_B",
    ),
    "f64": (
        lambda i: upload_requests(i, with_files(GOOD.config_json, _f64_header())),
        INVALID,
        "dtype 'F64'",
    ),
    "header too long": (
        lambda i: iter([header(i), chunk(struct.pack("<Q", 1 << 30) + b"{")]),
        INVALID,
        "header is 1073741824 bytes",
    ),
    "ends in header": (
        lambda i: iter([header(i), chunk(GOOD.safetensors[:20])]),
        INVALID,
        "inside the safetensors header",
    ),
    "truncated": (
        lambda i: upload_requests(
            i, with_files(GOOD.config_json, GOOD.safetensors[:-1]), sha256=""
        ),
        INVALID,
        "truncated",
    ),
    "extra bytes": (
        lambda i: upload_requests(
            i, with_files(GOOD.config_json, GOOD.safetensors + b"\0"), sha256=""
        ),
        INVALID,
        "more bytes than its header",
    ),
    "sha mismatch": (
        lambda i: upload_requests(i, GOOD, sha256="0" * 64),
        INVALID,
        "sha256 of the bytes",
    ),
    "bad sha syntax": (
        lambda i: upload_requests(i, GOOD, sha256="xyz"),
        INVALID,
        "64 lowercase hex",
    ),
    "size mismatch": (
        lambda i: upload_requests(i, GOOD, size_bytes=5),
        INVALID,
        "size_bytes says 5",
    ),
    "chunk over 4 MiB": (
        lambda i: iter(
            [header(i), chunk(GOOD.safetensors + bytes((4 << 20) + 1 - len(GOOD.safetensors)))]
        ),
        INVALID,
        "larger than 4194304",
    ),
    "big sha mismatch": (
        lambda i: upload_requests(i, big(), 1 << 20, sha256="f" * 64),
        INVALID,
        "sha256",
    ),
    "nan": (
        lambda i: upload_requests(i, _poisoned(GOOD, np.nan)),
        INVALID,
        "holds a value that is not finite",
    ),
    "inf": (
        lambda i: upload_requests(i, _poisoned(GOOD, -np.inf)),
        INVALID,
        "not finite (NaN or infinite: outside the range of F16)",
    ),
    "big nan in the last part": (
        lambda i: upload_requests(i, _poisoned(big(), np.nan, at_end=True), 1 << 20),
        INVALID,
        "down_proj.lora_B.weight holds a value that is not finite",
    ),
    "leading zeros": (
        lambda i: upload_requests(i, with_files(GOOD.config_json, _renamed_layer("0001"))),
        INVALID,
        "layer index '0001' is not written as PEFT writes",
    ),
    "arabic-indic digit": (
        lambda i: upload_requests(i, with_files(GOOD.config_json, _renamed_layer("\u0661"))),
        INVALID,
        "not written as PEFT writes layer indices",
    ),
    "alpha 0": (
        lambda i: upload_requests(
            i, with_files(lora_config_json(4, 0, ["q_proj", "v_proj"]), GOOD.safetensors)
        ),
        INVALID,
        "lora_alpha must be a finite number > 0, got 0",
    ),
    "big truncated": (
        lambda i: upload_requests(
            i, with_files(big().config_json, big().safetensors[:-4096]), 1 << 20, sha256=""
        ),
        INVALID,
        "truncated",
    ),
}


def assert_nothing_left(store, adapter_id):
    assert store.pending_uploads() == []
    assert store.blob_keys(adapter_id) == []
    with pytest.raises(grpc.RpcError) as info:
        store.stub.GetAdapter(pb.GetAdapterRequest(adapter_id=adapter_id))
    assert info.value.code() in (grpc.StatusCode.NOT_FOUND, grpc.StatusCode.INVALID_ARGUMENT)


@pytest.mark.parametrize("case", list(CASES))
def test_bad_upload_is_refused_and_leaves_nothing(store, adapter_id, case):
    requests, code, message = CASES[case]
    with pytest.raises(grpc.RpcError) as info:
        store.stub.UploadAdapter(requests(adapter_id), timeout=60)
    assert info.value.code() == code, info.value.details()
    assert message in info.value.details()
    assert_nothing_left(store, adapter_id)
    assert store.object_keys(f"manifests/{adapter_id}") == []


@pytest.fixture(scope="module", params=["local", "s3"])
def strict_store(request, tmp_path_factory):
    """A store with a size limit and a base model that adapters must fit."""
    workdir = tmp_path_factory.mktemp(f"strict-{request.param}")
    base_config = workdir / "config.json"
    base_config.write_text(json.dumps({**HF_CONFIG, "model_type": "llama"}))
    args = ("--max-adapter-bytes", "200000", "--base-model-config", str(base_config))
    if request.param == "local":
        process = StoreProcess(workdir, "local", extra_args=args)
    else:
        seaweed = request.getfixturevalue("seaweed")
        process = StoreProcess(workdir, "s3", seaweed, new_bucket(seaweed), extra_args=args)
    process.start()
    yield process
    assert process.stop() == 0, process.log()


def test_size_limit_and_base_model_fit(strict_store, adapter_id):
    fits = synthetic_adapter(BASE, rank=4)
    assert strict_store.stub.UploadAdapter(upload_requests(adapter_id, fits)).version == 1

    too_big = synthetic_adapter(BASE, rank=64)
    assert len(too_big.safetensors) > 200000
    with pytest.raises(grpc.RpcError) as info:
        strict_store.stub.UploadAdapter(upload_requests(f"{adapter_id}-big", too_big))
    assert info.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert "limit is 200000" in info.value.details()
    assert_nothing_left(strict_store, f"{adapter_id}-big")

    for name, shape, message in (
        ("deeper", BaseModelShape(3, 64, 96, 4, 2, 16, 128), "layer 2 but the base model has 2"),
        ("wider", BaseModelShape(2, 32, 96, 4, 2, 8, 128), "the base model's q_proj has d_in=64"),
        ("gqa", BaseModelShape(2, 64, 96, 4, 4, 16, 128), "the base model's k_proj has d_out=32"),
    ):
        other = synthetic_adapter(shape, rank=2, modules=("q_proj", "k_proj"))
        with pytest.raises(grpc.RpcError) as info:
            strict_store.stub.UploadAdapter(upload_requests(f"{adapter_id}-{name}", other))
        assert info.value.code() == grpc.StatusCode.FAILED_PRECONDITION, info.value.details()
        assert message in info.value.details()
        assert_nothing_left(strict_store, f"{adapter_id}-{name}")
