"""The adapter store process: gRPC server, health, reflection, storage probe, clean stop."""

from __future__ import annotations

import asyncio
import logging
import signal

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from services import tls
from services.adapter_store.errors import status_for
from services.adapter_store.metrics import StoreMetrics
from services.adapter_store.servicer import AdapterStoreServicer
from services.adapter_store.wire import SERVICE, add_servicer
from services.auth import Authenticator, AuthInterceptor
from services.outage import Outage
from store.adapter_store import AdapterStore
from store.backends import open_backend
from store.config import MAX_UPLOAD_CHUNK_BYTES, MIB, StoreConfig
from store.errors import StorageError, StorageUnavailable, StoreError

log = logging.getLogger(__name__)
SERVING = health_pb2.HealthCheckResponse.SERVING
NOT_SERVING = health_pb2.HealthCheckResponse.NOT_SERVING
# A request carries a chunk of up to 4 MiB, or a header with adapter_config.json (<= 1 MiB).
MAX_MESSAGE_BYTES = MAX_UPLOAD_CHUNK_BYTES + 2 * MIB
STOP_GRACE_S = 3.0


async def _probe_storage(
    store: AdapterStore, status: health.aio.HealthServicer, every: float, swept: bool
):
    """Keep the AdapterStore service's health in step with the storage, retry clean-up that
    failed while the storage was down, and sweep uploads that a store process that died left
    unfinished (one listing of unfinished uploads per probe; ``swept``: serve() has just done
    the first). The server itself ("") stays SERVING."""
    while True:
        try:
            await store.probe()
            await status.set(SERVICE, SERVING)
            if store.leftovers:
                await store.retry_cleanup()
            if not swept:
                await _sweep(store)
            swept = False
        except (StorageUnavailable, StorageError) as exc:
            log.warning("storage check failed: %s", exc)
            await status.set(SERVICE, NOT_SERVING)
        await asyncio.sleep(every)


async def _rescan_storage(store: AdapterStore, every: float) -> None:
    """Announce other store processes' changes to this one's watchers (store/rescan.py): the
    first rescan at once learns the storage's state, then one every ``every`` seconds."""
    outage = Outage(log, "rescanning the storage for other stores' changes")
    while True:
        try:
            await store.rescan.run()
            outage.succeeded()
        except StoreError as exc:  # storage down, an unreadable manifest: the next one retries
            outage.failed(str(exc), f"rescanning every {every:g} s")
        except Exception:  # a bug: said, and the rescans go on rather than stop unseen
            log.exception("rescanning the storage failed unexpectedly")
        await asyncio.sleep(every)


async def _sweep(store: AdapterStore) -> None:
    try:
        await store.sweep_uploads()
    except (StorageUnavailable, StorageError) as exc:  # the next sweep tries again
        log.warning("could not sweep unfinished uploads: %s", exc)


async def serve(config: StoreConfig, auth: Authenticator) -> None:
    """``auth``: the token table read from --auth-tokens (the entry point reads it, so that a
    bad file stops the start with a clear message)."""
    store = AdapterStore(open_backend(config), config)
    swept = False
    try:
        await store.probe()
    except StorageUnavailable as exc:
        # Not fatal: calls fail UNAVAILABLE until the storage answers, then work again.
        log.warning("storage does not answer yet: %s", exc)
    except StorageError:
        await store.close()
        raise
    else:
        await _sweep(store)  # uploads that a killed store left unfinished are gone once it serves
        swept = True
    server = grpc.aio.server(
        interceptors=[AuthInterceptor(auth, status_for)],
        options=[
            ("grpc.max_receive_message_length", MAX_MESSAGE_BYTES),
            ("grpc.max_send_message_length", MAX_MESSAGE_BYTES),
            # A second store on a taken port must fail, not share the port.
            ("grpc.so_reuseport", 0),
        ],
    )
    metrics = None
    if config.metrics_port is not None:
        metrics = StoreMetrics(store)
        metrics.serve(config.metrics_port, config.host)
    add_servicer(AdapterStoreServicer(store, auth, metrics), server)
    status = health.aio.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(status, server)
    reflection.enable_server_reflection(
        (SERVICE, health.SERVICE_NAME, reflection.SERVICE_NAME), server
    )
    address = f"{config.host}:{config.port}"
    credentials = None
    if config.tls_cert is not None:
        credentials = tls.server_credentials(config.tls_cert, config.tls_key, config.tls_client_ca)
    port = tls.bind(server, address, credentials)
    await server.start()
    await status.set("", SERVING)
    tls.warn_if_exposed(
        "the adapter store", config.host, auth.enabled, credentials is not None,
        anyone_may="read, change and delete every adapter", in_clear="adapter weights",
    )  # fmt: skip
    log.info(
        "adapter store on %s:%d, backend %s, %s, %s",
        config.host, port, config.backend.value,
        "TLS" + (" with client certificates" if config.tls_client_ca else "")
        if credentials else "plain TCP",
        "authentication on" if auth.enabled else "no authentication",
    )  # fmt: skip

    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for signum in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(signum, stop.set)
    prober = asyncio.create_task(_probe_storage(store, status, config.probe_interval_s, swept))
    rescanner = None
    if config.watch_rescan_s > 0:
        rescanner = asyncio.create_task(_rescan_storage(store, config.watch_rescan_s))
    await stop.wait()

    log.info("stopping: aborting %d upload(s) in flight", store.abort_uploads())
    await status.enter_graceful_shutdown()
    await server.stop(STOP_GRACE_S)
    prober.cancel()
    if rescanner is not None:
        rescanner.cancel()
    await asyncio.gather(*(t for t in (prober, rescanner) if t), return_exceptions=True)
    if metrics is not None:
        metrics.close()
    await store.close()
    log.info("stopped")
