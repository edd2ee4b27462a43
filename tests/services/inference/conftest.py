"""Fixtures of the inference service tests: a tiny model and adapters (once per session), the
engine-alone reference, and a running stack (adapter store + inference service processes)."""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import grpc
import pytest

from services.inference.engine.api import AdapterKey
from services.inference.tiny_model import make_adapter, make_model
from store.peft import BaseModelShape
from store.synthetic import synthetic_adapter
from tests.services.inference.reference import Reference
from tests.services.inference.stack import Proc, inference_proc, inference_stub, store_proc, upload

# name -> (make_adapter keyword arguments); "a2" is the second version of "a" (hot reload).
ADAPTERS = {
    "a": dict(rank=8, lora_alpha=16, target_modules=("q_proj", "v_proj"), seed=1),
    "b": dict(
        rank=16,
        lora_alpha=32,
        target_modules=(
            "q_proj",
            "k_proj",
            "v_proj",
            "o_proj",
            "gate_proj",
            "up_proj",
            "down_proj",
        ),
        seed=2,
    ),  # fmt: skip
    "c": dict(
        rank=4,
        lora_alpha=8,
        target_modules=("o_proj", "gate_proj", "up_proj", "down_proj"),
        use_rslora=True,
        seed=3,
    ),
    "a2": dict(rank=8, lora_alpha=16, target_modules=("q_proj", "v_proj"), seed=11),
}


@dataclass(frozen=True)
class Models:
    model: Path
    adapters: dict[str, Path]
    mismatched: Path  # an adapter made for another base model (different hidden size)


@pytest.fixture(scope="session")
def svc_models(tmp_path_factory) -> Models:
    root = tmp_path_factory.mktemp("svc-models")
    model = make_model(root / "tiny-llama", "tiny-llama", seed=0)
    adapters = {name: make_adapter(model, root / name, **kw) for name, kw in ADAPTERS.items()}
    # Same layer count, twice the hidden size: a valid adapter that does not fit tiny-llama.
    shape = BaseModelShape.from_hf_config(json.loads((model / "config.json").read_text()))
    wider = dataclasses.replace(shape, hidden_size=2 * shape.hidden_size)
    files = synthetic_adapter(wider, rank=8, modules=("q_proj", "v_proj"))
    mismatched = root / "mismatched"
    mismatched.mkdir()
    (mismatched / "adapter_config.json").write_bytes(files.config_json)
    (mismatched / "adapter_model.safetensors").write_bytes(files.safetensors)
    return Models(model, adapters, mismatched)


@pytest.fixture(scope="session")
def reference(svc_models) -> Reference:
    """Adapter ids in the tests: 'a' (versions 1 and 2), 'b', 'c'."""
    a = svc_models.adapters
    return Reference(
        svc_models.model,
        {
            AdapterKey("a", 1): a["a"],
            AdapterKey("a", 2): a["a2"],
            AdapterKey("b", 1): a["b"],
            AdapterKey("c", 1): a["c"],
        },
    )


@dataclass
class Stack:
    store: Proc
    inference: Proc
    channel: grpc.Channel

    @property
    def stub(self):
        return inference_stub(self.channel)


def start_stack(
    svc_models: Models, tmp: Path, uploads=("a", "b", "c"), store: Proc | None = None, flags=()
) -> Stack:
    if store is None:
        store = store_proc(tmp / "store", tmp).start().wait_serving()
    for name in uploads:
        upload(store.address, name, svc_models.adapters[name])
    inference = inference_proc(svc_models.model, store.address, tmp, *flags).start()
    inference.wait_serving()
    return Stack(store, inference, grpc.insecure_channel(inference.address))


def stop_stack(stack: Stack) -> None:
    stack.channel.close()
    stack.inference.stop()
    stack.store.stop()


@pytest.fixture
def stack_factory(svc_models, tmp_path) -> Iterator:
    """Starts stacks that the test may break; stops whatever is left at the end."""
    started: list[Stack] = []

    def start(**kwargs) -> Stack:
        stack = start_stack(svc_models, tmp_path, **kwargs)
        started.append(stack)
        return stack

    yield start
    for stack in started:
        stop_stack(stack)
