"""Translation between lorafleet.v1 messages and the engine's own types (no logic beyond it)."""

from __future__ import annotations

from lorafleet.v1 import inference_pb2 as pb
from services.inference.engine.adapter_manager import AdapterState, AdapterStatus
from services.inference.engine.api import AdapterKey, FinishReason, GenerationOutput
from services.inference.engine.limits import RequestLimits
from services.inference.engine.sampling_params import SamplingParams
from services.inference.errors import BadArgument
from services.inference.service_stats import LatencySummary, StatsSnapshot

_FINISH = {
    FinishReason.LENGTH: pb.FINISH_REASON_LENGTH,
    FinishReason.STOP: pb.FINISH_REASON_STOP,
    FinishReason.EOS: pb.FINISH_REASON_EOS,
}

_RESIDENCY = {
    AdapterState.IN_POOL: pb.RESIDENCY_GPU,
    AdapterState.HOST: pb.RESIDENCY_HOST,
    AdapterState.LOADING: pb.RESIDENCY_LOADING,
}


def residency(status: AdapterStatus | None) -> int:
    """Where an adapter is; not in the engine yet means its bytes are still being fetched."""
    return pb.RESIDENCY_LOADING if status is None else _RESIDENCY[status.state]


def sampling_params(msg: pb.SamplingParams, limits: RequestLimits) -> SamplingParams:
    """SamplingParams from the message; proto defaults mean the engine's defaults. Raises
    BadArgument naming the field, or InvalidRequest for lists over ``limits`` (checked before
    they are copied)."""
    limits.check_stops(msg.stop, len(msg.stop_token_ids))
    kwargs: dict = {
        "temperature": msg.temperature,
        "top_k": msg.top_k,
        "stop": tuple(msg.stop),
        "stop_token_ids": tuple(msg.stop_token_ids),
        "ignore_eos": msg.ignore_eos,
    }
    if msg.HasField("max_new_tokens"):
        kwargs["max_new_tokens"] = msg.max_new_tokens
    if msg.HasField("top_p"):
        kwargs["top_p"] = msg.top_p
    if msg.HasField("seed"):
        kwargs["seed"] = msg.seed
    if msg.HasField("logprobs"):
        kwargs["logprobs"] = msg.logprobs
    try:
        return SamplingParams(**kwargs)
    except ValueError as exc:
        raise BadArgument(f"sampling: {exc}") from None


def response(out: GenerationOutput, request_id: str, key: AdapterKey | None) -> pb.GenerateResponse:
    msg = pb.GenerateResponse(
        request_id=request_id,
        token_ids=out.token_ids,
        text=out.text,
        adapter_version=0 if key is None else key.version,
    )
    for lp in out.logprobs:
        msg.logprobs.append(
            pb.TokenLogprob(
                token_id=lp.token_id, token=lp.token, logprob=lp.logprob,
                top=[pb.TopLogprob(token_id=t.token_id, token=t.token, logprob=t.logprob)
                     for t in lp.top],
            )
        )  # fmt: skip
    if out.finish_reason is not None:
        msg.finish_reason = _FINISH[out.finish_reason]
        msg.usage.prompt_tokens = out.prompt_tokens
        msg.usage.completion_tokens = out.completion_tokens
    return msg


def _latency(s: LatencySummary) -> pb.LatencySummary:
    return pb.LatencySummary(
        count=s.count, mean_seconds=s.mean, p50_seconds=s.p50, p99_seconds=s.p99,
        max_seconds=s.max,
    )  # fmt: skip


def stats_response(s: StatsSnapshot, model: str, device: str) -> pb.GetStatsResponse:
    return pb.GetStatsResponse(
        queued_requests=s.queued,
        running_requests=s.running,
        waiting_for_adapter=s.waiting_for_adapter,
        pool=pb.PoolStats(
            total_pages=s.total_pages,
            free_pages=s.free_pages,
            kv_pages=s.kv_pages,
            adapter_pages=s.adapter_pages,
            page_size=s.page_size,
        ),  # fmt: skip
        tokens_per_second=s.tokens_per_second,
        generated_tokens=s.generated_tokens,
        resident_adapters=s.adapters_in_pool,
        host_cache=pb.HostCacheStats(
            capacity_bytes=s.host_capacity_bytes,
            used_bytes=s.host_used_bytes,
            entries=s.host_entries,
            pinned_memory=s.host_pinned,
        ),  # fmt: skip
        adapter_fetch=_latency(s.adapter_fetch),
        adapter_copy=_latency(s.adapter_copy),
        adapter_load=_latency(s.adapter_load),
        adapter_evictions_gpu=s.evictions_gpu,
        adapter_evictions_host=s.evictions_host,
        adapter_evictions_gpu_queued=s.evictions_gpu_queued,
        model=model,
        device=device,
        device_memory=pb.DeviceMemory(
            total_bytes=s.memory.total,
            free_bytes=s.memory.free,
            peak_reserved_bytes=s.memory.peak_reserved,
        ),  # fmt: skip
    )
