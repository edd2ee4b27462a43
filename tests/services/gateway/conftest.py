"""Fixtures of the gateway tests: the tiny model and adapters, and one stack for the whole
package (adapter store, inference service and gateway, all real processes)."""

from __future__ import annotations

import json
import shutil
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import grpc
import pytest

from services.inference.tiny_model import make_adapter, make_model
from tests.services.gateway.stack import gateway_proc, url, wait_http
from tests.services.inference.conftest import ADAPTERS
from tests.services.inference.stack import Proc, inference_proc, inference_stub, store_proc, upload


@dataclass(frozen=True)
class GatewayModels:
    model: Path
    plain: Path  # the same model without a chat template
    adapters: dict[str, Path]


@pytest.fixture(scope="session")
def gw_models(tmp_path_factory) -> GatewayModels:
    root = tmp_path_factory.mktemp("gw-models")
    model = make_model(root / "tiny-llama", "tiny-llama", seed=0)
    adapters = {n: make_adapter(model, root / n, **ADAPTERS[n]) for n in ("a", "b", "a2")}
    plain = root / "plain-llama"
    shutil.copytree(model, plain)
    cfg_path = plain / "tokenizer_config.json"
    cfg = json.loads(cfg_path.read_text())
    del cfg["chat_template"]
    cfg_path.write_text(json.dumps(cfg))
    return GatewayModels(model, plain, adapters)


@dataclass
class GatewayStack:
    store: Proc
    inference: Proc
    gateway: Proc
    channel: grpc.Channel

    @property
    def stub(self):
        return inference_stub(self.channel)

    def url(self, path: str = "") -> str:
        return url(self.gateway, path)

    @property
    def base_url(self) -> str:
        return self.url("/v1")


@pytest.fixture(scope="package")
def stack(gw_models, tmp_path_factory) -> Iterator[GatewayStack]:
    """Adapters "a" and "b" uploaded (version 1 each); the base model's id is "tiny-llama"."""
    tmp = tmp_path_factory.mktemp("gateway-stack")
    procs: list[Proc] = []
    try:
        store = store_proc(tmp / "store", tmp).start()
        procs.append(store)
        inference = inference_proc(gw_models.model, store.address, tmp).start()
        procs.append(inference)
        gateway = gateway_proc(inference.address, store.address, tmp).start()
        procs.append(gateway)
        store.wait_serving()
        for name in ("a", "b"):
            upload(store.address, name, gw_models.adapters[name])
        inference.wait_serving()
        wait_http(gateway)
        channel = grpc.insecure_channel(inference.address)
        yield GatewayStack(store, inference, gateway, channel)
        channel.close()
    finally:
        for proc in reversed(procs):
            proc.stop()
