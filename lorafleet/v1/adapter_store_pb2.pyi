import datetime

from google.protobuf import timestamp_pb2 as _timestamp_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class AdapterEventType(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    ADAPTER_EVENT_TYPE_UNSPECIFIED: _ClassVar[AdapterEventType]
    ADAPTER_EVENT_TYPE_CREATED: _ClassVar[AdapterEventType]
    ADAPTER_EVENT_TYPE_DELETED: _ClassVar[AdapterEventType]
ADAPTER_EVENT_TYPE_UNSPECIFIED: AdapterEventType
ADAPTER_EVENT_TYPE_CREATED: AdapterEventType
ADAPTER_EVENT_TYPE_DELETED: AdapterEventType

class UploadAdapterHeader(_message.Message):
    __slots__ = ("adapter_id", "adapter_config_json", "sha256", "description", "size_bytes")
    ADAPTER_ID_FIELD_NUMBER: _ClassVar[int]
    ADAPTER_CONFIG_JSON_FIELD_NUMBER: _ClassVar[int]
    SHA256_FIELD_NUMBER: _ClassVar[int]
    DESCRIPTION_FIELD_NUMBER: _ClassVar[int]
    SIZE_BYTES_FIELD_NUMBER: _ClassVar[int]
    adapter_id: str
    adapter_config_json: str
    sha256: str
    description: str
    size_bytes: int
    def __init__(self, adapter_id: _Optional[str] = ..., adapter_config_json: _Optional[str] = ..., sha256: _Optional[str] = ..., description: _Optional[str] = ..., size_bytes: _Optional[int] = ...) -> None: ...

class UploadAdapterRequest(_message.Message):
    __slots__ = ("header", "chunk")
    HEADER_FIELD_NUMBER: _ClassVar[int]
    CHUNK_FIELD_NUMBER: _ClassVar[int]
    header: UploadAdapterHeader
    chunk: bytes
    def __init__(self, header: _Optional[_Union[UploadAdapterHeader, _Mapping]] = ..., chunk: _Optional[bytes] = ...) -> None: ...

class AdapterInfo(_message.Message):
    __slots__ = ("adapter_id", "version", "rank", "lora_alpha", "target_modules", "size_bytes", "sha256", "adapter_config_json", "description", "created_at", "dtype", "num_layers")
    ADAPTER_ID_FIELD_NUMBER: _ClassVar[int]
    VERSION_FIELD_NUMBER: _ClassVar[int]
    RANK_FIELD_NUMBER: _ClassVar[int]
    LORA_ALPHA_FIELD_NUMBER: _ClassVar[int]
    TARGET_MODULES_FIELD_NUMBER: _ClassVar[int]
    SIZE_BYTES_FIELD_NUMBER: _ClassVar[int]
    SHA256_FIELD_NUMBER: _ClassVar[int]
    ADAPTER_CONFIG_JSON_FIELD_NUMBER: _ClassVar[int]
    DESCRIPTION_FIELD_NUMBER: _ClassVar[int]
    CREATED_AT_FIELD_NUMBER: _ClassVar[int]
    DTYPE_FIELD_NUMBER: _ClassVar[int]
    NUM_LAYERS_FIELD_NUMBER: _ClassVar[int]
    adapter_id: str
    version: int
    rank: int
    lora_alpha: float
    target_modules: _containers.RepeatedScalarFieldContainer[str]
    size_bytes: int
    sha256: str
    adapter_config_json: str
    description: str
    created_at: _timestamp_pb2.Timestamp
    dtype: str
    num_layers: int
    def __init__(self, adapter_id: _Optional[str] = ..., version: _Optional[int] = ..., rank: _Optional[int] = ..., lora_alpha: _Optional[float] = ..., target_modules: _Optional[_Iterable[str]] = ..., size_bytes: _Optional[int] = ..., sha256: _Optional[str] = ..., adapter_config_json: _Optional[str] = ..., description: _Optional[str] = ..., created_at: _Optional[_Union[datetime.datetime, _timestamp_pb2.Timestamp, _Mapping]] = ..., dtype: _Optional[str] = ..., num_layers: _Optional[int] = ...) -> None: ...

class FetchAdapterRequest(_message.Message):
    __slots__ = ("adapter_id", "version")
    ADAPTER_ID_FIELD_NUMBER: _ClassVar[int]
    VERSION_FIELD_NUMBER: _ClassVar[int]
    adapter_id: str
    version: int
    def __init__(self, adapter_id: _Optional[str] = ..., version: _Optional[int] = ...) -> None: ...

class FetchAdapterResponse(_message.Message):
    __slots__ = ("info", "chunk")
    INFO_FIELD_NUMBER: _ClassVar[int]
    CHUNK_FIELD_NUMBER: _ClassVar[int]
    info: AdapterInfo
    chunk: bytes
    def __init__(self, info: _Optional[_Union[AdapterInfo, _Mapping]] = ..., chunk: _Optional[bytes] = ...) -> None: ...

class GetAdapterRequest(_message.Message):
    __slots__ = ("adapter_id", "version")
    ADAPTER_ID_FIELD_NUMBER: _ClassVar[int]
    VERSION_FIELD_NUMBER: _ClassVar[int]
    adapter_id: str
    version: int
    def __init__(self, adapter_id: _Optional[str] = ..., version: _Optional[int] = ...) -> None: ...

class ListAdaptersRequest(_message.Message):
    __slots__ = ("page_size", "page_token", "prefix")
    PAGE_SIZE_FIELD_NUMBER: _ClassVar[int]
    PAGE_TOKEN_FIELD_NUMBER: _ClassVar[int]
    PREFIX_FIELD_NUMBER: _ClassVar[int]
    page_size: int
    page_token: str
    prefix: str
    def __init__(self, page_size: _Optional[int] = ..., page_token: _Optional[str] = ..., prefix: _Optional[str] = ...) -> None: ...

class ListAdaptersResponse(_message.Message):
    __slots__ = ("adapters", "next_page_token")
    ADAPTERS_FIELD_NUMBER: _ClassVar[int]
    NEXT_PAGE_TOKEN_FIELD_NUMBER: _ClassVar[int]
    adapters: _containers.RepeatedCompositeFieldContainer[AdapterInfo]
    next_page_token: str
    def __init__(self, adapters: _Optional[_Iterable[_Union[AdapterInfo, _Mapping]]] = ..., next_page_token: _Optional[str] = ...) -> None: ...

class DeleteAdapterRequest(_message.Message):
    __slots__ = ("adapter_id", "version", "all_versions")
    ADAPTER_ID_FIELD_NUMBER: _ClassVar[int]
    VERSION_FIELD_NUMBER: _ClassVar[int]
    ALL_VERSIONS_FIELD_NUMBER: _ClassVar[int]
    adapter_id: str
    version: int
    all_versions: bool
    def __init__(self, adapter_id: _Optional[str] = ..., version: _Optional[int] = ..., all_versions: _Optional[bool] = ...) -> None: ...

class DeleteAdapterResponse(_message.Message):
    __slots__ = ("deleted_versions",)
    DELETED_VERSIONS_FIELD_NUMBER: _ClassVar[int]
    deleted_versions: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, deleted_versions: _Optional[_Iterable[int]] = ...) -> None: ...

class WatchAdaptersRequest(_message.Message):
    __slots__ = ("prefix", "include_existing")
    PREFIX_FIELD_NUMBER: _ClassVar[int]
    INCLUDE_EXISTING_FIELD_NUMBER: _ClassVar[int]
    prefix: str
    include_existing: bool
    def __init__(self, prefix: _Optional[str] = ..., include_existing: _Optional[bool] = ...) -> None: ...

class AdapterEvent(_message.Message):
    __slots__ = ("type", "adapter", "event_time")
    TYPE_FIELD_NUMBER: _ClassVar[int]
    ADAPTER_FIELD_NUMBER: _ClassVar[int]
    EVENT_TIME_FIELD_NUMBER: _ClassVar[int]
    type: AdapterEventType
    adapter: AdapterInfo
    event_time: _timestamp_pb2.Timestamp
    def __init__(self, type: _Optional[_Union[AdapterEventType, str]] = ..., adapter: _Optional[_Union[AdapterInfo, _Mapping]] = ..., event_time: _Optional[_Union[datetime.datetime, _timestamp_pb2.Timestamp, _Mapping]] = ...) -> None: ...
