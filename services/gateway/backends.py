"""The gateway's gRPC clients (grpc.aio) to the inference service and the adapter store, and the
metadata every call carries: the caller's ``Authorization`` header, as gRPC ``authorization``,
so that the services' tenancy rules hold over HTTP as they do over gRPC."""

from __future__ import annotations

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc
from starlette.types import Scope

from lorafleet.v1 import adapter_store_pb2_grpc as store_grpc
from lorafleet.v1 import inference_pb2_grpc as pb_grpc
from services.gateway.config import GatewayConfig
from services.gateway.errors import BadRequest
from services.gateway.http_io import header

Metadata = tuple[tuple[str, str], ...]

_OPTIONS = [
    ("grpc.max_receive_message_length", 16 << 20),
    ("grpc.max_send_message_length", 16 << 20),
]


def call_metadata(scope: Scope) -> Metadata:
    """The caller's credentials for the gRPC call made on its behalf (none without a header).
    ``scope`` is the request's ASGI scope, or its Starlette Request (which reads as one)."""
    value = header(scope, b"authorization")
    return (("authorization", value),) if value else ()


class Backends:
    """One channel per service, made on the serving event loop (grpc.aio binds to it)."""

    def __init__(self, config: GatewayConfig) -> None:
        self._inference_channel = grpc.aio.insecure_channel(config.inference, options=_OPTIONS)
        self.inference = pb_grpc.InferenceStub(self._inference_channel)
        self._inference_health = health_pb2_grpc.HealthStub(self._inference_channel)
        self._store_channel = None
        self._store = None
        self._store_health = None
        if config.adapter_store is not None:
            self._store_channel = grpc.aio.insecure_channel(config.adapter_store, options=_OPTIONS)
            self._store = store_grpc.AdapterStoreStub(self._store_channel)
            self._store_health = health_pb2_grpc.HealthStub(self._store_channel)

    @property
    def has_store(self) -> bool:
        return self._store is not None

    @property
    def store(self) -> store_grpc.AdapterStoreStub:
        if self._store is None:
            raise BadRequest(
                "this gateway has no adapter registry: start it with --adapter-store HOST:PORT"
            )
        return self._store

    async def health(self) -> dict[str, str]:
        """grpc.health.v1 status of each service: SERVING, NOT_SERVING or UNREACHABLE."""
        out = {"inference": await _check(self._inference_health)}
        if self._store_health is not None:
            out["adapter_store"] = await _check(self._store_health)
        return out

    async def close(self) -> None:
        await self._inference_channel.close()
        if self._store_channel is not None:
            await self._store_channel.close()


async def _check(stub: health_pb2_grpc.HealthStub) -> str:
    try:
        reply = await stub.Check(health_pb2.HealthCheckRequest(), timeout=2.0)
    except grpc.RpcError:
        return "UNREACHABLE"
    return health_pb2.HealthCheckResponse.ServingStatus.Name(reply.status)
