"""lorafleet.v1.Inference over the engine and the adapter registry: thin translation only.

Every domain error becomes a status through errors.status_for, here and nowhere else.
A Generate call that the client cancels, or whose deadline passes, is cancelled by grpc.aio;
leaving the engine's stream aborts the request, whose pages are free at the next step.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import threading
import time
import uuid
from collections.abc import AsyncIterator
from concurrent.futures import ThreadPoolExecutor

import grpc

from lorafleet.v1 import inference_pb2 as pb
from lorafleet.v1 import inference_pb2_grpc as pb_grpc
from services.access import audited, check_inference, visible
from services.inference import convert
from services.inference.adapter_registry import AdapterRegistry, HeldAdapter
from services.inference.engine.adapter_manager import AdapterStatus
from services.inference.engine.api import AdapterKey, FinishReason, GenerationRequest
from services.inference.engine.engine import Engine
from services.inference.engine.sampling_params import SamplingParams
from services.inference.errors import BadArgument, QueueFull, ShuttingDown, status_for
from services.inference.metrics import ServiceMetrics, tenant_label
from services.inference.model_info import ModelInfo
from services.inference.service_stats import (
    LatencyWindow,
    RateWindow,
    StatsSnapshot,
    summarize,
)
from services.inference.tenancy import Tenancy
from services.inference.tokenizer import Tokenizer

log = logging.getLogger(__name__)

# Prompts are tokenized on these threads (tokenizers releases the GIL while it encodes): the event
# loop keeps streaming meanwhile, and long prompts take at most this many cores, at a lower CPU
# priority than the engine's step loop (on Linux, nice applies to the thread alone).
_TOKENIZER_THREADS = 2
_TOKENIZER_NICE = 10


def _lower_priority() -> None:
    with contextlib.suppress(AttributeError, OSError):
        os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), _TOKENIZER_NICE)


class InferenceServicer(pb_grpc.InferenceServicer):
    def __init__(
        self,
        engine: Engine,
        registry: AdapterRegistry,
        metrics: ServiceMetrics,
        device: str,
        tokenizer: Tokenizer,
        model_info: ModelInfo,
        tenancy: Tenancy,
    ) -> None:
        self.engine = engine
        # Who calls, what they may touch, their quotas (tenancy.py, services/access.py).
        self.tenancy = tenancy
        self.registry = registry
        # The per-request limits are the engine's own (EngineCore.prepare checks them again).
        self._tokenizer, self._limits = tokenizer, engine.config.limits
        self._tokenize = ThreadPoolExecutor(
            _TOKENIZER_THREADS, thread_name_prefix="tokenize", initializer=_lower_priority
        )
        self.metrics = metrics
        metrics.track(self.snapshot)
        # The engine admits max_queue requests, waiting and running together (--max-queue
        # waiting plus the running batch, each derived from the device when unset); calls
        # beyond it are refused here, early.
        self._max_calls = engine.limits.max_queue
        self._device = device
        self._model_info = model_info
        self._calls: set[str] = set()  # the engine ids of Generate calls in progress
        self._idle = asyncio.Event()
        self._idle.set()
        self._closing = False  # no new calls
        self._aborting = False  # calls in flight are being ended by the server
        self._rate = RateWindow()
        self.cold_ttft = LatencyWindow()  # arrival -> first token, adapter not in the pool

    # --- Generate ---------------------------------------------------------------------------

    async def Generate(
        self, request: pb.GenerateRequest, context: grpc.aio.ServicerContext
    ) -> AsyncIterator[pb.GenerateResponse]:
        start = time.perf_counter()
        rid = request.request_id or uuid.uuid4().hex
        code = grpc.StatusCode.OK
        engine_id = None  # the call's id in the engine, once admitted
        ticket, caller = None, None  # the tenant's quota ticket; who calls
        prompt_tokens = completion_tokens = 0  # of the call's latest output
        ended = False  # _ended() has run
        try:
            caller = self.tenancy.caller(context)
            self._limits.check_request_id(rid)  # before it is kept, and echoed
            check_inference(caller, request.adapter_id)
            ticket = self.tenancy.admit(caller, _estimate(request))
            engine_id = self._admit(rid)
            if request.adapter_version and not request.adapter_id:
                raise BadArgument(
                    f"adapter_version {request.adapter_version} is given without an adapter_id; "
                    "name the adapter, or leave both empty for the base model"
                )
            sampling = convert.sampling_params(request.sampling, self._limits)
            ids = await self._prompt_ids(request)
            key = None
            if request.adapter_id:
                key = await self.registry.acquire(request.adapter_id, request.adapter_version)
            try:
                if self._aborting:
                    raise ShuttingDown(f"request {rid} was ended: the server is shutting down")
                cold = key is not None and not self.engine.adapter_in_pool(key)
                gen = GenerationRequest(engine_id, None, ids, key, sampling, tenant=caller.tenant)
                last = None
                async for out in self.engine.generate(gen):
                    if out.finish_reason is FinishReason.ABORT:
                        raise ShuttingDown(f"request {rid} was ended: the server is shutting down")
                    now = time.perf_counter()
                    prompt_tokens, completion_tokens = out.prompt_tokens, out.completion_tokens
                    if last is None:
                        ticket.started()
                        self.metrics.ttft.observe(now - start)
                        if cold:
                            self.cold_ttft.add(now - start)
                    elif out.token_ids:
                        self.metrics.inter_token.observe(now - last)
                    last = now
                    yield convert.response(out, rid, key)
            finally:
                if key is not None:
                    self.registry.release(key)
        except asyncio.CancelledError:
            code = grpc.StatusCode.CANCELLED
            raise
        except Exception as exc:
            code = status_for(exc).code
            # The call's books first: its caller may call again, or scrape the metrics, as soon
            # as the status it is aborted with arrives.
            self._ended(ticket, engine_id, caller, code, prompt_tokens, completion_tokens)
            ended = True
            await _abort(context, exc)
        finally:
            if not ended:
                self._ended(ticket, engine_id, caller, code, prompt_tokens, completion_tokens)

    def _ended(self, ticket, engine_id, caller, code, prompt_tokens, completion_tokens) -> None:
        """A Generate call is over: its quota ticket closed, its engine id free, its metrics."""
        if ticket is not None:
            ticket.close(prompt_tokens + completion_tokens)
        if engine_id is not None:
            self._calls.discard(engine_id)
            if not self._calls:
                self._idle.set()
        self.metrics.observe_call(tenant_label(caller), code.name, prompt_tokens, completion_tokens)

    async def _prompt_ids(self, request: pb.GenerateRequest) -> list[int]:
        """The prompt's token ids, each size checked before the work it bounds."""
        if request.prompt_token_ids:
            self._limits.check_prompt_tokens(len(request.prompt_token_ids))
            return list(request.prompt_token_ids)
        prompt = request.prompt
        if not prompt:
            raise BadArgument("give a prompt or prompt_token_ids")
        self._limits.check_prompt_text(prompt)
        loop = asyncio.get_running_loop()
        ids = await loop.run_in_executor(self._tokenize, self._tokenizer.encode, prompt)
        self._limits.check_prompt_tokens(len(ids))
        return ids

    def _admit(self, rid: str) -> str:
        """Admits a call; returns its id in the engine: the caller's ``rid``, or a generated one
        while another call (or the engine) holds that id. A request_id only labels a caller's
        stream (it is echoed), so it need not be unique: two tenants, or two client processes,
        may pick the same one, and neither may refuse or even see the other's call."""
        if self._closing:
            raise ShuttingDown("the server is shutting down; retry on another replica")
        if len(self._calls) >= self._max_calls:
            raise QueueFull(
                f"{len(self._calls)} requests in flight (running batch + --max-queue); retry later"
            )
        engine_id = rid
        # a call that ended may leave its id in the engine until its abort is applied
        while engine_id in self._calls or self.engine.request_in_use(engine_id):
            engine_id = uuid.uuid4().hex
        if engine_id != rid:
            log.debug("request_id %r is in flight already: this call is %s", rid, engine_id)
        self._calls.add(engine_id)
        self._idle.clear()
        return engine_id

    # --- adapters ---------------------------------------------------------------------------

    async def LoadAdapter(self, request, context) -> pb.LoadAdapterResponse:
        start = time.perf_counter()
        try:
            caller = self.tenancy.caller(context)
            with audited("load", caller, request.adapter_id, request.adapter_version) as entry:
                check_inference(caller, request.adapter_id)
                key = await self.registry.acquire(request.adapter_id, request.adapter_version)
                entry.version = key.version
                try:
                    if request.pin:
                        self.registry.pin_for(key, caller)
                    await self.engine.load_adapter(key)
                finally:
                    self.registry.release(key)
            return pb.LoadAdapterResponse(
                adapter=self._resident(key, self.registry.get(key)),
                load_seconds=time.perf_counter() - start,
            )
        except Exception as exc:
            await _abort(context, exc)

    async def UnloadAdapter(self, request, context) -> pb.UnloadAdapterResponse:
        try:
            caller = self.tenancy.caller(context)
            with audited("unload", caller, request.adapter_id, request.adapter_version):
                check_inference(caller, request.adapter_id)
                if not request.adapter_id:
                    raise BadArgument("adapter_id is required")
                # Where each one is as it is unloaded: one no request uses leaves at once.
                before = {
                    h.key: self.engine.adapter_status(h.key)
                    for h in self.registry.held()
                    if h.key.adapter_id == request.adapter_id
                }
                unloaded = self.registry.unload(request.adapter_id, request.adapter_version)
            return pb.UnloadAdapterResponse(
                adapters=[self._resident(h.key, h, before.get(h.key)) for h in unloaded]
            )
        except Exception as exc:
            await _abort(context, exc)

    async def ListAdapters(self, request, context) -> pb.ListResidentAdaptersResponse:
        try:
            caller = self.tenancy.caller(context)
            check_inference(caller, "")
        except Exception as exc:
            await _abort(context, exc)
        # A tenant sees only its own adapters.
        out = [
            self._resident(h.key, h)
            for h in self.registry.held()
            if visible(caller, h.key.adapter_id)
        ]
        for key, waiting in self.registry.fetching().items():
            if not visible(caller, key.adapter_id):
                continue
            out.append(
                pb.ResidentAdapter(
                    adapter_id=key.adapter_id, version=key.version,
                    residency=pb.RESIDENCY_LOADING, active_requests=waiting,
                )
            )  # fmt: skip
        out.sort(key=lambda a: (a.adapter_id, a.version))
        return pb.ListResidentAdaptersResponse(adapters=out)

    def _resident(
        self, key: AdapterKey, held: HeldAdapter | None, status: AdapterStatus | None = None
    ) -> pb.ResidentAdapter:
        status = status or self.engine.adapter_status(key)
        return pb.ResidentAdapter(
            adapter_id=key.adapter_id,
            version=key.version,
            residency=convert.residency(status),
            pinned=held is not None and held.pinned,
            active_requests=0 if held is None else held.leases,
            size_bytes=0 if held is None else held.size_bytes,
            retired=held is not None and held.retired,
        )

    # --- stats ------------------------------------------------------------------------------

    async def GetStats(self, request, context) -> pb.GetStatsResponse:
        try:
            check_inference(self.tenancy.caller(context), "")  # totals only: any tenant
            await self.engine.sync_stats()
        except Exception as exc:
            await _abort(context, exc)
        return convert.stats_response(self.snapshot(), self._model_info.model_id, self._device)

    async def GetModelInfo(self, request, context) -> pb.ModelInfo:
        try:
            check_inference(self.tenancy.caller(context), "")  # the base model: any tenant
        except Exception as exc:
            await _abort(context, exc)
        return pb.ModelInfo(**self._model_info._asdict())

    def snapshot(self) -> StatsSnapshot:
        e = self.engine.stats()
        c = self.registry.cache.stats()
        store = self.registry.store
        return StatsSnapshot(
            queued=e.num_waiting,
            running=e.num_running,
            waiting_for_adapter=self.registry.fetch_waiters + e.adapters_loading,
            total_pages=e.num_pages,
            free_pages=e.free_pages,
            kv_pages=e.kv_pages,
            adapter_pages=e.adapter_pages,
            page_size=self.engine.config.page_size,
            tokens_per_second=self._rate.rate(e.generated_tokens),
            generated_tokens=e.generated_tokens,
            adapters_in_pool=e.adapters_in_pool,
            host_capacity_bytes=c.capacity_bytes,
            host_used_bytes=c.used_bytes,
            host_entries=c.entries,
            host_pinned=c.pinned_memory,
            host_waiting=c.waiting,
            adapter_fetch=self.registry.fetch_latency.summary(),
            adapter_copy=summarize(self.engine.adapter_copy_seconds(), e.adapter_loads),
            adapter_load=self.cold_ttft.summary(),
            evictions_gpu=e.adapter_evictions,
            evictions_host=c.evictions,
            evictions_gpu_queued=e.adapter_evictions_queued,
            fetch_worker_starts=store.fetch_worker_starts if store is not None else 0,
            memory=e.memory,
            engine_gc=e.gc,
        )

    # --- shutdown ---------------------------------------------------------------------------

    async def shutdown(self, grace: float) -> None:
        """Refuse new calls, let calls in flight finish within ``grace`` seconds, then end the
        rest with UNAVAILABLE."""
        self._closing = True
        try:
            await asyncio.wait_for(self._idle.wait(), timeout=grace)
        except TimeoutError:
            log.info("ending %d streams still in flight", len(self._calls))
            self._aborting = True
            for rid in list(self._calls):
                self.engine.abort(rid)
            try:
                await asyncio.wait_for(self._idle.wait(), timeout=5.0)
            except TimeoutError:
                log.warning("%d calls did not end after their abort", len(self._calls))
        self._tokenize.shutdown(wait=False, cancel_futures=True)


def _estimate(request: pb.GenerateRequest) -> int:
    """Tokens a call is charged at admission (tenancy.py settles it at its end)."""
    if request.sampling.HasField("max_new_tokens"):
        new = request.sampling.max_new_tokens
    else:
        new = SamplingParams.max_new_tokens  # the default
    return len(request.prompt_token_ids) + max(new, 0)


async def _abort(context: grpc.aio.ServicerContext, exc: Exception) -> None:
    """Ends the call with the status that status_for gives ``exc`` (logged if INTERNAL)."""
    status = status_for(exc)
    if status.code == grpc.StatusCode.INTERNAL:
        log.error("call failed", exc_info=exc)
    await context.abort(status.code, status.message)
