"""Parts of the gateway tested in-process, without services: request metrics for failures the
app's handlers answer, and the model info's start-up asking against a service without
GetModelInfo."""

from __future__ import annotations

import asyncio

import grpc
from starlette.testclient import TestClient

from services.gateway.app import create_app
from services.gateway.config import GatewayConfig
from services.gateway.errors import ClientGone
from services.gateway.model_info import ModelInfoCache


def test_request_metrics_count_server_errors_as_500_and_clients_gone_as_499():
    app = create_app(GatewayConfig(inference="127.0.0.1:1"))

    @app.get("/boom")
    async def boom():
        raise RuntimeError("a bug")

    @app.get("/gone")
    async def gone():
        raise ClientGone()

    # No lifespan (no `with`): these routes need no gRPC channels.
    client = TestClient(app, raise_server_exceptions=False)
    reply = client.get("/boom")
    assert reply.status_code == 500 and reply.json()["error"]["code"] == 500
    assert client.get("/gone").status_code == 499
    text = client.get("/metrics").text
    assert 'lorafleet_gateway_requests_total{route="/boom",status="500"} 1.0' in text
    assert 'lorafleet_gateway_requests_total{route="/gone",status="499"} 1.0' in text


class _NoModelInfo:
    """An inference stub whose server has no GetModelInfo."""

    def __init__(self) -> None:
        self.calls = 0

    async def GetModelInfo(self, request, metadata, timeout):
        self.calls += 1
        raise grpc.aio.AioRpcError(
            grpc.StatusCode.UNIMPLEMENTED, grpc.aio.Metadata(), grpc.aio.Metadata(), "no method"
        )


def test_prefetch_stops_on_a_service_without_get_model_info():
    stub = _NoModelInfo()
    cache = ModelInfoCache(stub, timeout=1.0)
    asyncio.run(asyncio.wait_for(cache.prefetch(), timeout=3.0))  # no retry every second
    assert stub.calls == 1 and cache.known is None
