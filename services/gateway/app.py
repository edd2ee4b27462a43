"""The gateway's ASGI app: its state, its routes, health and metrics, errors as OpenAI's body.

The gateway is stateless: every answer comes from the two gRPC services, with the caller's
credentials. Its gRPC channels are made when the app starts serving (grpc.aio binds them to the
serving event loop) and closed when it stops.
"""

from __future__ import annotations

import asyncio
import contextlib
import time

from fastapi import FastAPI, Request, Response
from starlette.middleware.errors import ServerErrorMiddleware
from starlette.types import ASGIApp, Receive, Scope, Send

from lorafleet.v1 import inference_pb2 as pb
from services.gateway import adapters, completions, errors, lora_compat, models
from services.gateway.backends import Backends, call_metadata
from services.gateway.config import GatewayConfig
from services.gateway.errors import CLIENT_CLOSED
from services.gateway.metrics import GatewayMetrics
from services.gateway.model_info import ModelInfoCache


class Gateway:
    """What every route reaches through ``request.app.state.gateway``."""

    def __init__(self, config: GatewayConfig, metrics: GatewayMetrics) -> None:
        self.config = config
        self.metrics = metrics
        self.backends = Backends(config)
        self.model_info = ModelInfoCache(self.backends.inference, config.rpc_timeout_s)
        self.started = int(time.time())

    @staticmethod
    def adapter_for(model: str, info: pb.ModelInfo) -> str:
        """The Generate adapter_id that ``model`` names: "" for the base model's id."""
        return "" if model == info.model_id else model


class GatewayApp(FastAPI):
    """FastAPI, with the generation endpoints' POSTs taken ahead of it (completions.py says
    why) into ``generation``: the request metrics and Starlette's server-error middleware, as
    around every route, then completions.serve. Everything else, those paths' other methods
    included, goes through FastAPI."""

    generation: ASGIApp

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if (
            scope["type"] == "http"
            and scope["method"] == "POST"
            and scope["path"] in completions.ENDPOINTS
        ):
            scope["app"] = self  # as Starlette sets it: the endpoints find the state here
            await self.generation(scope, receive, send)
            return
        await super().__call__(scope, receive, send)


def create_app(config: GatewayConfig) -> GatewayApp:
    metrics = GatewayMetrics()

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI):
        gateway = Gateway(config, metrics)
        app.state.gateway = gateway
        prefetch = asyncio.create_task(gateway.model_info.prefetch())
        try:
            yield
        finally:
            prefetch.cancel()
            await gateway.backends.close()

    app = GatewayApp(
        title="lorafleet gateway",
        description="OpenAI-compatible API and REST adapter registry over lorafleet's services",
        lifespan=lifespan,
    )
    errors.install(app)
    for module in (completions, models, adapters, lora_compat):
        app.include_router(module.router)

    @app.get("/health")
    async def health(request: Request):
        gateway = request.app.state.gateway
        services = await gateway.backends.health()
        if services["inference"] != "SERVING":
            return errors.error_response(
                503, f"the inference service is {services['inference']}: {services}"
            )
        known = gateway.model_info.known
        if known is None:  # serving now: ask at once rather than wait for the next retry
            with contextlib.suppress(Exception):
                known = await gateway.model_info.get(call_metadata(request))
        return {"status": "ok", "model": known.model_id if known else None, **services}

    @app.get("/metrics")
    async def metrics_endpoint() -> Response:
        return Response(metrics.render(), media_type=metrics.content_type)

    app.add_middleware(_RequestMetrics, metrics=metrics)
    app.generation = ServerErrorMiddleware(
        _RequestMetrics(completions.serve, metrics), handler=errors.handle, debug=app.debug
    )
    return app


class _RequestMetrics:
    """Counts every request by route and status and times it to its last byte (a stream's
    too). Routes are the matched path templates, so ids in paths do not make new series."""

    def __init__(self, app, metrics: GatewayMetrics) -> None:
        self.app = app
        self.metrics = metrics

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        start = time.perf_counter()
        status = [CLIENT_CLOSED]

        async def send_and_note(message) -> None:
            if message["type"] == "http.response.start":
                status[0] = message["status"]
            await send(message)

        try:
            await self.app(scope, receive, send_and_note)
        except Exception:
            # Unhandled: ServerErrorMiddleware, outside this one, answers it with a 500.
            if status[0] == CLIENT_CLOSED:
                status[0] = 500
            raise
        finally:
            route = scope.get("route")
            name = getattr(route, "path", "unmatched")
            self.metrics.requests.labels(name, str(status[0])).inc()
            self.metrics.latency.labels(name).observe(time.perf_counter() - start)
