from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class FinishReason(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    FINISH_REASON_UNSPECIFIED: _ClassVar[FinishReason]
    FINISH_REASON_LENGTH: _ClassVar[FinishReason]
    FINISH_REASON_STOP: _ClassVar[FinishReason]
    FINISH_REASON_EOS: _ClassVar[FinishReason]

class Residency(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    RESIDENCY_UNSPECIFIED: _ClassVar[Residency]
    RESIDENCY_GPU: _ClassVar[Residency]
    RESIDENCY_HOST: _ClassVar[Residency]
    RESIDENCY_LOADING: _ClassVar[Residency]
FINISH_REASON_UNSPECIFIED: FinishReason
FINISH_REASON_LENGTH: FinishReason
FINISH_REASON_STOP: FinishReason
FINISH_REASON_EOS: FinishReason
RESIDENCY_UNSPECIFIED: Residency
RESIDENCY_GPU: Residency
RESIDENCY_HOST: Residency
RESIDENCY_LOADING: Residency

class SamplingParams(_message.Message):
    __slots__ = ("max_new_tokens", "temperature", "top_p", "top_k", "seed", "stop", "stop_token_ids", "ignore_eos", "logprobs")
    MAX_NEW_TOKENS_FIELD_NUMBER: _ClassVar[int]
    TEMPERATURE_FIELD_NUMBER: _ClassVar[int]
    TOP_P_FIELD_NUMBER: _ClassVar[int]
    TOP_K_FIELD_NUMBER: _ClassVar[int]
    SEED_FIELD_NUMBER: _ClassVar[int]
    STOP_FIELD_NUMBER: _ClassVar[int]
    STOP_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    IGNORE_EOS_FIELD_NUMBER: _ClassVar[int]
    LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    max_new_tokens: int
    temperature: float
    top_p: float
    top_k: int
    seed: int
    stop: _containers.RepeatedScalarFieldContainer[str]
    stop_token_ids: _containers.RepeatedScalarFieldContainer[int]
    ignore_eos: bool
    logprobs: int
    def __init__(self, max_new_tokens: _Optional[int] = ..., temperature: _Optional[float] = ..., top_p: _Optional[float] = ..., top_k: _Optional[int] = ..., seed: _Optional[int] = ..., stop: _Optional[_Iterable[str]] = ..., stop_token_ids: _Optional[_Iterable[int]] = ..., ignore_eos: _Optional[bool] = ..., logprobs: _Optional[int] = ...) -> None: ...

class GenerateRequest(_message.Message):
    __slots__ = ("request_id", "adapter_id", "adapter_version", "prompt", "prompt_token_ids", "sampling")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    ADAPTER_ID_FIELD_NUMBER: _ClassVar[int]
    ADAPTER_VERSION_FIELD_NUMBER: _ClassVar[int]
    PROMPT_FIELD_NUMBER: _ClassVar[int]
    PROMPT_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    SAMPLING_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    adapter_id: str
    adapter_version: int
    prompt: str
    prompt_token_ids: _containers.RepeatedScalarFieldContainer[int]
    sampling: SamplingParams
    def __init__(self, request_id: _Optional[str] = ..., adapter_id: _Optional[str] = ..., adapter_version: _Optional[int] = ..., prompt: _Optional[str] = ..., prompt_token_ids: _Optional[_Iterable[int]] = ..., sampling: _Optional[_Union[SamplingParams, _Mapping]] = ...) -> None: ...

class Usage(_message.Message):
    __slots__ = ("prompt_tokens", "completion_tokens")
    PROMPT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    COMPLETION_TOKENS_FIELD_NUMBER: _ClassVar[int]
    prompt_tokens: int
    completion_tokens: int
    def __init__(self, prompt_tokens: _Optional[int] = ..., completion_tokens: _Optional[int] = ...) -> None: ...

class GenerateResponse(_message.Message):
    __slots__ = ("request_id", "token_ids", "text", "finish_reason", "usage", "adapter_version", "logprobs")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    TEXT_FIELD_NUMBER: _ClassVar[int]
    FINISH_REASON_FIELD_NUMBER: _ClassVar[int]
    USAGE_FIELD_NUMBER: _ClassVar[int]
    ADAPTER_VERSION_FIELD_NUMBER: _ClassVar[int]
    LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    text: str
    finish_reason: FinishReason
    usage: Usage
    adapter_version: int
    logprobs: _containers.RepeatedCompositeFieldContainer[TokenLogprob]
    def __init__(self, request_id: _Optional[str] = ..., token_ids: _Optional[_Iterable[int]] = ..., text: _Optional[str] = ..., finish_reason: _Optional[_Union[FinishReason, str]] = ..., usage: _Optional[_Union[Usage, _Mapping]] = ..., adapter_version: _Optional[int] = ..., logprobs: _Optional[_Iterable[_Union[TokenLogprob, _Mapping]]] = ...) -> None: ...

class TokenLogprob(_message.Message):
    __slots__ = ("token_id", "token", "logprob", "top")
    TOKEN_ID_FIELD_NUMBER: _ClassVar[int]
    TOKEN_FIELD_NUMBER: _ClassVar[int]
    LOGPROB_FIELD_NUMBER: _ClassVar[int]
    TOP_FIELD_NUMBER: _ClassVar[int]
    token_id: int
    token: str
    logprob: float
    top: _containers.RepeatedCompositeFieldContainer[TopLogprob]
    def __init__(self, token_id: _Optional[int] = ..., token: _Optional[str] = ..., logprob: _Optional[float] = ..., top: _Optional[_Iterable[_Union[TopLogprob, _Mapping]]] = ...) -> None: ...

class TopLogprob(_message.Message):
    __slots__ = ("token_id", "token", "logprob")
    TOKEN_ID_FIELD_NUMBER: _ClassVar[int]
    TOKEN_FIELD_NUMBER: _ClassVar[int]
    LOGPROB_FIELD_NUMBER: _ClassVar[int]
    token_id: int
    token: str
    logprob: float
    def __init__(self, token_id: _Optional[int] = ..., token: _Optional[str] = ..., logprob: _Optional[float] = ...) -> None: ...

class ResidentAdapter(_message.Message):
    __slots__ = ("adapter_id", "version", "residency", "pinned", "active_requests", "size_bytes", "retired")
    ADAPTER_ID_FIELD_NUMBER: _ClassVar[int]
    VERSION_FIELD_NUMBER: _ClassVar[int]
    RESIDENCY_FIELD_NUMBER: _ClassVar[int]
    PINNED_FIELD_NUMBER: _ClassVar[int]
    ACTIVE_REQUESTS_FIELD_NUMBER: _ClassVar[int]
    SIZE_BYTES_FIELD_NUMBER: _ClassVar[int]
    RETIRED_FIELD_NUMBER: _ClassVar[int]
    adapter_id: str
    version: int
    residency: Residency
    pinned: bool
    active_requests: int
    size_bytes: int
    retired: bool
    def __init__(self, adapter_id: _Optional[str] = ..., version: _Optional[int] = ..., residency: _Optional[_Union[Residency, str]] = ..., pinned: _Optional[bool] = ..., active_requests: _Optional[int] = ..., size_bytes: _Optional[int] = ..., retired: _Optional[bool] = ...) -> None: ...

class LoadAdapterRequest(_message.Message):
    __slots__ = ("adapter_id", "adapter_version", "pin")
    ADAPTER_ID_FIELD_NUMBER: _ClassVar[int]
    ADAPTER_VERSION_FIELD_NUMBER: _ClassVar[int]
    PIN_FIELD_NUMBER: _ClassVar[int]
    adapter_id: str
    adapter_version: int
    pin: bool
    def __init__(self, adapter_id: _Optional[str] = ..., adapter_version: _Optional[int] = ..., pin: _Optional[bool] = ...) -> None: ...

class LoadAdapterResponse(_message.Message):
    __slots__ = ("adapter", "load_seconds")
    ADAPTER_FIELD_NUMBER: _ClassVar[int]
    LOAD_SECONDS_FIELD_NUMBER: _ClassVar[int]
    adapter: ResidentAdapter
    load_seconds: float
    def __init__(self, adapter: _Optional[_Union[ResidentAdapter, _Mapping]] = ..., load_seconds: _Optional[float] = ...) -> None: ...

class UnloadAdapterRequest(_message.Message):
    __slots__ = ("adapter_id", "adapter_version")
    ADAPTER_ID_FIELD_NUMBER: _ClassVar[int]
    ADAPTER_VERSION_FIELD_NUMBER: _ClassVar[int]
    adapter_id: str
    adapter_version: int
    def __init__(self, adapter_id: _Optional[str] = ..., adapter_version: _Optional[int] = ...) -> None: ...

class UnloadAdapterResponse(_message.Message):
    __slots__ = ("adapters",)
    ADAPTERS_FIELD_NUMBER: _ClassVar[int]
    adapters: _containers.RepeatedCompositeFieldContainer[ResidentAdapter]
    def __init__(self, adapters: _Optional[_Iterable[_Union[ResidentAdapter, _Mapping]]] = ...) -> None: ...

class ListResidentAdaptersRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class ListResidentAdaptersResponse(_message.Message):
    __slots__ = ("adapters",)
    ADAPTERS_FIELD_NUMBER: _ClassVar[int]
    adapters: _containers.RepeatedCompositeFieldContainer[ResidentAdapter]
    def __init__(self, adapters: _Optional[_Iterable[_Union[ResidentAdapter, _Mapping]]] = ...) -> None: ...

class GetStatsRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class LatencySummary(_message.Message):
    __slots__ = ("count", "mean_seconds", "p50_seconds", "p99_seconds", "max_seconds")
    COUNT_FIELD_NUMBER: _ClassVar[int]
    MEAN_SECONDS_FIELD_NUMBER: _ClassVar[int]
    P50_SECONDS_FIELD_NUMBER: _ClassVar[int]
    P99_SECONDS_FIELD_NUMBER: _ClassVar[int]
    MAX_SECONDS_FIELD_NUMBER: _ClassVar[int]
    count: int
    mean_seconds: float
    p50_seconds: float
    p99_seconds: float
    max_seconds: float
    def __init__(self, count: _Optional[int] = ..., mean_seconds: _Optional[float] = ..., p50_seconds: _Optional[float] = ..., p99_seconds: _Optional[float] = ..., max_seconds: _Optional[float] = ...) -> None: ...

class PoolStats(_message.Message):
    __slots__ = ("total_pages", "free_pages", "kv_pages", "adapter_pages", "page_size")
    TOTAL_PAGES_FIELD_NUMBER: _ClassVar[int]
    FREE_PAGES_FIELD_NUMBER: _ClassVar[int]
    KV_PAGES_FIELD_NUMBER: _ClassVar[int]
    ADAPTER_PAGES_FIELD_NUMBER: _ClassVar[int]
    PAGE_SIZE_FIELD_NUMBER: _ClassVar[int]
    total_pages: int
    free_pages: int
    kv_pages: int
    adapter_pages: int
    page_size: int
    def __init__(self, total_pages: _Optional[int] = ..., free_pages: _Optional[int] = ..., kv_pages: _Optional[int] = ..., adapter_pages: _Optional[int] = ..., page_size: _Optional[int] = ...) -> None: ...

class HostCacheStats(_message.Message):
    __slots__ = ("capacity_bytes", "used_bytes", "entries", "pinned_memory")
    CAPACITY_BYTES_FIELD_NUMBER: _ClassVar[int]
    USED_BYTES_FIELD_NUMBER: _ClassVar[int]
    ENTRIES_FIELD_NUMBER: _ClassVar[int]
    PINNED_MEMORY_FIELD_NUMBER: _ClassVar[int]
    capacity_bytes: int
    used_bytes: int
    entries: int
    pinned_memory: bool
    def __init__(self, capacity_bytes: _Optional[int] = ..., used_bytes: _Optional[int] = ..., entries: _Optional[int] = ..., pinned_memory: _Optional[bool] = ...) -> None: ...

class DeviceMemory(_message.Message):
    __slots__ = ("total_bytes", "free_bytes", "peak_reserved_bytes")
    TOTAL_BYTES_FIELD_NUMBER: _ClassVar[int]
    FREE_BYTES_FIELD_NUMBER: _ClassVar[int]
    PEAK_RESERVED_BYTES_FIELD_NUMBER: _ClassVar[int]
    total_bytes: int
    free_bytes: int
    peak_reserved_bytes: int
    def __init__(self, total_bytes: _Optional[int] = ..., free_bytes: _Optional[int] = ..., peak_reserved_bytes: _Optional[int] = ...) -> None: ...

class GetStatsResponse(_message.Message):
    __slots__ = ("queued_requests", "running_requests", "waiting_for_adapter", "pool", "tokens_per_second", "generated_tokens", "resident_adapters", "host_cache", "adapter_fetch", "adapter_copy", "adapter_load", "adapter_evictions_gpu", "adapter_evictions_host", "model", "device", "device_memory", "adapter_evictions_gpu_queued")
    QUEUED_REQUESTS_FIELD_NUMBER: _ClassVar[int]
    RUNNING_REQUESTS_FIELD_NUMBER: _ClassVar[int]
    WAITING_FOR_ADAPTER_FIELD_NUMBER: _ClassVar[int]
    POOL_FIELD_NUMBER: _ClassVar[int]
    TOKENS_PER_SECOND_FIELD_NUMBER: _ClassVar[int]
    GENERATED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    RESIDENT_ADAPTERS_FIELD_NUMBER: _ClassVar[int]
    HOST_CACHE_FIELD_NUMBER: _ClassVar[int]
    ADAPTER_FETCH_FIELD_NUMBER: _ClassVar[int]
    ADAPTER_COPY_FIELD_NUMBER: _ClassVar[int]
    ADAPTER_LOAD_FIELD_NUMBER: _ClassVar[int]
    ADAPTER_EVICTIONS_GPU_FIELD_NUMBER: _ClassVar[int]
    ADAPTER_EVICTIONS_HOST_FIELD_NUMBER: _ClassVar[int]
    MODEL_FIELD_NUMBER: _ClassVar[int]
    DEVICE_FIELD_NUMBER: _ClassVar[int]
    DEVICE_MEMORY_FIELD_NUMBER: _ClassVar[int]
    ADAPTER_EVICTIONS_GPU_QUEUED_FIELD_NUMBER: _ClassVar[int]
    queued_requests: int
    running_requests: int
    waiting_for_adapter: int
    pool: PoolStats
    tokens_per_second: float
    generated_tokens: int
    resident_adapters: int
    host_cache: HostCacheStats
    adapter_fetch: LatencySummary
    adapter_copy: LatencySummary
    adapter_load: LatencySummary
    adapter_evictions_gpu: int
    adapter_evictions_host: int
    model: str
    device: str
    device_memory: DeviceMemory
    adapter_evictions_gpu_queued: int
    def __init__(self, queued_requests: _Optional[int] = ..., running_requests: _Optional[int] = ..., waiting_for_adapter: _Optional[int] = ..., pool: _Optional[_Union[PoolStats, _Mapping]] = ..., tokens_per_second: _Optional[float] = ..., generated_tokens: _Optional[int] = ..., resident_adapters: _Optional[int] = ..., host_cache: _Optional[_Union[HostCacheStats, _Mapping]] = ..., adapter_fetch: _Optional[_Union[LatencySummary, _Mapping]] = ..., adapter_copy: _Optional[_Union[LatencySummary, _Mapping]] = ..., adapter_load: _Optional[_Union[LatencySummary, _Mapping]] = ..., adapter_evictions_gpu: _Optional[int] = ..., adapter_evictions_host: _Optional[int] = ..., model: _Optional[str] = ..., device: _Optional[str] = ..., device_memory: _Optional[_Union[DeviceMemory, _Mapping]] = ..., adapter_evictions_gpu_queued: _Optional[int] = ...) -> None: ...

class GetModelInfoRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class ModelInfo(_message.Message):
    __slots__ = ("model_id", "context_window", "chat_template", "special_tokens", "adds_bos_token")
    class SpecialTokensEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: str
        def __init__(self, key: _Optional[str] = ..., value: _Optional[str] = ...) -> None: ...
    MODEL_ID_FIELD_NUMBER: _ClassVar[int]
    CONTEXT_WINDOW_FIELD_NUMBER: _ClassVar[int]
    CHAT_TEMPLATE_FIELD_NUMBER: _ClassVar[int]
    SPECIAL_TOKENS_FIELD_NUMBER: _ClassVar[int]
    ADDS_BOS_TOKEN_FIELD_NUMBER: _ClassVar[int]
    model_id: str
    context_window: int
    chat_template: str
    special_tokens: _containers.ScalarMap[str, str]
    adds_bos_token: bool
    def __init__(self, model_id: _Optional[str] = ..., context_window: _Optional[int] = ..., chat_template: _Optional[str] = ..., special_tokens: _Optional[_Mapping[str, str]] = ..., adds_bos_token: _Optional[bool] = ...) -> None: ...
