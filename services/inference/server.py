"""InferenceServer: the gRPC server, its health and reflection services, and the lifecycle.

Start-up order: the port is bound and health answers NOT_SERVING at once; the engine starts:
with --engine process the host arena first (the engine process maps it) and the model loads in
that process, with --engine thread on a worker thread, the arena after; then the store client
and its watch follower, the metrics endpoint; health turns SERVING last. Until then Inference
calls get UNAVAILABLE.
Stop (SIGTERM): health NOT_SERVING, new calls refused, calls in flight may finish within the
grace period and are then ended with UNAVAILABLE, then the engine stops.
"""

from __future__ import annotations

import asyncio
import logging

import grpc

from lorafleet.v1 import inference_pb2 as pb
from lorafleet.v1 import inference_pb2_grpc as pb_grpc
from services import tls
from services.auth import Authenticator, AuthInterceptor
from services.inference.adapter_registry import AdapterRegistry
from services.inference.arena import HostArena
from services.inference.config import (
    HOST_CACHE_MAX,
    HOST_CACHE_MIN,
    HOST_CACHE_SHARE,
    ServiceConfig,
    host_memory_bytes,
)
from services.inference.engine import gc_pacing
from services.inference.engine.config import EngineConfig
from services.inference.engine.engine import Engine
from services.inference.engine_client import RemoteEngine
from services.inference.errors import status_for
from services.inference.host_cache import HostCache
from services.inference.metrics import ServiceMetrics
from services.inference.model_info import read_model_info
from services.inference.preload import Preloader
from services.inference.servicer import InferenceServicer
from services.inference.store_access import StoreAccess
from services.inference.store_client import StoreClient
from services.inference.tenancy import Quotas, Tenancy
from services.inference.tokenizer import Tokenizer

log = logging.getLogger(__name__)

SERVICE_NAME = pb.DESCRIPTOR.services_by_name["Inference"].full_name


def engine_config(config: ServiceConfig) -> EngineConfig:
    return EngineConfig(
        model_dir=config.model,
        gpu_memory_utilization=config.gpu_memory_utilization,
        device=config.device,
        num_pages=config.num_pages,
        pool_memory_bytes=None if config.pool_memory_mb is None else config.pool_memory_mb << 20,
        max_num_seqs=config.max_num_seqs,
        max_num_batched_tokens=config.max_num_batched_tokens or max(2048, config.max_num_seqs or 0),
        max_lora_rank=config.max_lora_rank,
        max_loras=config.max_loras,
        max_waiting=config.max_queue,
        step_log=config.step_log,
        limits=config.limits,
        scheduling=config.scheduling,
        fair_prefill_tokens=config.fair_prefill_tokens,
        adapter_affinity=config.adapter_affinity,
        tensor_parallel_size=config.tensor_parallel_size,
        lora_side_stream=config.lora_side_stream == "on",
        lora_addend=config.lora_addend == "on",
        load_format=config.load_format,
        cuda_graphs=config.cuda_graphs == "on",
    )


class _Gate(pb_grpc.InferenceServicer):
    """Registered before the server starts (grpc.aio takes no services later); answers
    UNAVAILABLE until the model is loaded, then hands every call to the real servicer."""

    def __init__(self) -> None:
        self.target: InferenceServicer | None = None

    async def _ready(self, context) -> InferenceServicer:
        if self.target is None:
            await context.abort(grpc.StatusCode.UNAVAILABLE, "the model is still loading")
        return self.target

    async def Generate(self, request, context):
        target = await self._ready(context)
        async for msg in target.Generate(request, context):
            yield msg

    async def LoadAdapter(self, request, context):
        return await (await self._ready(context)).LoadAdapter(request, context)

    async def UnloadAdapter(self, request, context):
        return await (await self._ready(context)).UnloadAdapter(request, context)

    async def ListAdapters(self, request, context):
        return await (await self._ready(context)).ListAdapters(request, context)

    async def GetStats(self, request, context):
        return await (await self._ready(context)).GetStats(request, context)

    async def GetModelInfo(self, request, context):
        return await (await self._ready(context)).GetModelInfo(request, context)


class InferenceServer:
    def __init__(self, config: ServiceConfig) -> None:
        self.config = config
        # Read now: a token file that does not parse stops the start before anything runs.
        self.auth = Authenticator.from_file(config.auth_tokens)
        self.server = grpc.aio.server(
            interceptors=[AuthInterceptor(self.auth, lambda exc: status_for(exc).code)],
            options=[("grpc.so_reuseport", 0), ("grpc.max_receive_message_length", 16 << 20)],
        )
        self._gate = _Gate()
        pb_grpc.add_InferenceServicer_to_server(self._gate, self.server)
        self._health = _add_health_and_reflection(self.server)
        self.port: int | None = None
        self.metrics_port: int | None = None
        self.engine: Engine | RemoteEngine | None = None
        self.servicer: InferenceServicer | None = None
        self._store: StoreClient | None = None
        self._follower: asyncio.Task | None = None
        self._preloader: asyncio.Task | None = None
        self._stopped = asyncio.Event()
        # Set when the server cannot serve any more (the engine process died): the entry point
        # then stops it and exits non-zero, so that a supervisor starts a fresh one.
        self.failed = asyncio.Event()

    async def start(self) -> None:
        cfg = self.config
        credentials = None
        if cfg.tls_cert is not None:
            credentials = tls.server_credentials(cfg.tls_cert, cfg.tls_key, cfg.tls_client_ca)
        self.port = tls.bind(self.server, cfg.address, credentials)
        if self.port == 0:
            raise OSError(f"cannot listen on {cfg.address}")
        await self.server.start()
        await self._set_serving(False)
        tls.warn_if_exposed(
            "the inference service", cfg.host, self.auth.enabled, bool(credentials),
            anyone_may="generate with the model and every adapter, and load and unload adapters",
            in_clear="prompts and completions",
        )  # fmt: skip
        log.info("listening on %s:%d; loading %s", cfg.host, self.port, cfg.model)
        if cfg.host_cache_mb is None:
            log.info(
                "host cache: %d MiB, %d%% of this host's %.1f GiB of memory (%d to %d GiB; "
                "--host-cache-mb sets it)",
                cfg.host_cache_bytes >> 20, HOST_CACHE_SHARE * 100, host_memory_bytes() / 2**30,
                HOST_CACHE_MIN >> 30, HOST_CACHE_MAX >> 30,
            )  # fmt: skip
        if cfg.engine == "process":
            arena = HostArena(cfg.host_cache_bytes, pin=False)  # the engine process pins it
            self.engine = RemoteEngine(
                engine_config(cfg), arena, cfg.log_level, on_exit=self._engine_exited
            )
            await self.engine.start()
        else:
            config = engine_config(cfg)
            arena = HostArena(cfg.host_cache_bytes, pin=config.torch_device.type == "cuda")
            # tensor-parallel workers map it too
            self.engine = await asyncio.to_thread(Engine, config, arena=arena.shared)
            await self.engine.start()
            gc_pacing.pace_collections()  # the step thread collects from now on
        device = self.engine.device
        cache = HostCache(arena)
        if cfg.adapter_store is not None:
            access = StoreAccess(
                cfg.adapter_store, cfg.adapter_store_token_file,
                cfg.adapter_store_ca, cfg.adapter_store_cert, cfg.adapter_store_key,
            )  # fmt: skip
            self._store = StoreClient(
                access, cache, cfg.store_timeout_s, cfg.fetch_timeout_s, cfg.max_fetches
            )
        metrics = ServiceMetrics()
        self.engine.add_load_listener(lambda _key, seconds: metrics.observe_load("copy", seconds))
        quotas = Quotas(
            cfg.tenant_max_in_flight, cfg.tenant_max_queued, cfg.tenant_tokens_per_second,
            cfg.tenant_pinned_bytes,
        )  # fmt: skip
        tenancy = Tenancy(self.auth, quotas)
        registry = AdapterRegistry(
            self.engine, self._store, cache, lambda s: metrics.observe_load("fetch", s),
            tenancy.check_pin,
        )  # fmt: skip
        if self._store is not None:
            on_event = registry.on_event
            if cfg.preload_adapters != "off":
                pool = cfg.preload_adapters == "pool"
                preloader = Preloader(
                    self._store, cache, registry.place if pool else None,
                    self.engine.adapter_in_pool if pool else None,
                )  # fmt: skip
                self._store.on_preloaded = lambda s: metrics.observe_load("preload", s)
                self._preloader = asyncio.create_task(preloader.run())

                def on_event(event, registry_event=registry.on_event):
                    registry_event(event)
                    preloader.on_event(event)

            self._follower = asyncio.create_task(
                self._store.follow(on_event, registry.forget_latest)
            )
        # The service tokenizes prompts itself (servicer.py), never the engine's step thread.
        tokenizer = getattr(self.engine, "tokenizer", None) or await asyncio.to_thread(
            Tokenizer.from_model_dir, cfg.model
        )
        info = await asyncio.to_thread(
            read_model_info, cfg.model, cfg.model_id, tokenizer, self.engine.config.max_model_len
        )
        self.servicer = InferenceServicer(
            self.engine, registry, metrics, str(device), tokenizer, info, tenancy
        )
        if cfg.metrics_port is not None:
            self.metrics_port = self.servicer.metrics.serve(cfg.metrics_port, cfg.host)
        self._gate.target = self.servicer
        if cfg.engine == "process":
            # No step thread here: collection stays automatic, but over what start-up left no
            # longer (about 180,000 objects, 34 ms a full collection on a 2-core CPU).
            gc_pacing.freeze_start_up("the service's garbage collection automatic")
        await self._set_serving(True)
        log.info("serving %s on %s:%d (%s)", cfg.model, cfg.host, self.port, device)

    async def stop(self) -> None:
        """Idempotent; see the module docstring for the order."""
        if self._stopped.is_set():
            return
        self._stopped.set()
        log.info("stopping")
        await self._set_serving(False)
        if self.servicer is not None:
            await self.servicer.shutdown(self.config.shutdown_grace_s)
        await self.server.stop(grace=1.0)
        for task in (self._follower, self._preloader):
            if task is not None:
                task.cancel()
        if self._store is not None:
            await self._store.close()
        if self.engine is not None:
            await self.engine.stop()
        gc_pacing.release()  # no step thread collects any more
        if self.servicer is not None:
            self.servicer.metrics.close()
        log.info("stopped")

    def _engine_exited(self, reason: str) -> None:
        log.error("the engine process ended unexpectedly (%s); stopping the service", reason)
        self.failed.set()

    async def _set_serving(self, serving: bool) -> None:
        if self._health is None:
            return
        from grpc_health.v1 import health_pb2

        status = (
            health_pb2.HealthCheckResponse.SERVING
            if serving
            else health_pb2.HealthCheckResponse.NOT_SERVING
        )
        for name in ("", SERVICE_NAME):
            await self._health.set(name, status)


def _add_health_and_reflection(server: grpc.aio.Server):
    """grpc.health.v1 and server reflection; optional packages, so a bare install (a benchmark
    machine) still serves without them."""
    try:
        from grpc_health.v1 import health, health_pb2, health_pb2_grpc
        from grpc_reflection.v1alpha import reflection
    except ImportError as exc:
        log.warning("health checking or reflection unavailable (%s); serving without", exc)
        return None
    servicer = health.aio.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(servicer, server)
    names = (SERVICE_NAME, health_pb2.DESCRIPTOR.services_by_name["Health"].full_name)
    reflection.enable_server_reflection((*names, reflection.SERVICE_NAME), server)
    return servicer
