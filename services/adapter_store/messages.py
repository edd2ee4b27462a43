"""Translation between the store's types and lorafleet.v1 protobuf messages."""

from __future__ import annotations

from google.protobuf.timestamp_pb2 import Timestamp

from lorafleet.v1 import adapter_store_pb2 as pb
from store.events import AdapterEvent, EventKind
from store.manifest import AdapterRecord
from store.upload import UploadHeader

_EVENT_TYPES = {
    EventKind.CREATED: pb.ADAPTER_EVENT_TYPE_CREATED,
    EventKind.DELETED: pb.ADAPTER_EVENT_TYPE_DELETED,
}


def timestamp(seconds: float) -> Timestamp:
    stamp = Timestamp()
    stamp.FromNanoseconds(int(seconds * 1e9))
    return stamp


def adapter_info(record: AdapterRecord) -> pb.AdapterInfo:
    return pb.AdapterInfo(
        adapter_id=record.adapter_id,
        version=record.version,
        rank=record.rank,
        lora_alpha=record.lora_alpha,
        target_modules=list(record.target_modules),
        size_bytes=record.size_bytes,
        sha256=record.sha256,
        adapter_config_json=record.adapter_config_json,
        description=record.description,
        created_at=timestamp(record.created_at),
        dtype=record.dtype,
        num_layers=record.num_layers,
    )


def adapter_event(event: AdapterEvent) -> pb.AdapterEvent:
    return pb.AdapterEvent(
        type=_EVENT_TYPES[event.kind],
        adapter=adapter_info(event.record),
        event_time=timestamp(event.time),
    )


def upload_header(header: pb.UploadAdapterHeader) -> UploadHeader:
    return UploadHeader(
        adapter_id=header.adapter_id,
        adapter_config_json=header.adapter_config_json,
        sha256=header.sha256,
        description=header.description,
        size_bytes=header.size_bytes,
    )
