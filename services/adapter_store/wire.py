"""Registration of the AdapterStore servicer, with FetchAdapter's chunks encoded by hand.

A chunk message is ``FetchAdapterResponse{chunk}``: field 2, wire type 2, so its encoding is
the byte 0x12, the length as a varint, then the bytes. Building that directly costs one copy
of the chunk where constructing and serializing a protobuf message costs two, and the fetch
path is bound by memory copies (see bench/store.py). Every other message goes through
protobuf as usual. Clients may decode chunks with the generated code (the inference service
decodes them by hand as well, services/inference/fetch_wire.py).
"""

from __future__ import annotations

import grpc

from lorafleet.v1 import adapter_store_pb2 as pb

SERVICE = pb.DESCRIPTOR.services_by_name["AdapterStore"].full_name  # lorafleet.v1.AdapterStore
_CHUNK_TAG = b"\x12"  # (field 2 << 3) | wire type 2 (length-delimited)


def _varint(value: int) -> bytes:
    out = bytearray()
    while True:
        low, value = value & 0x7F, value >> 7
        if value:
            out.append(low | 0x80)
        else:
            out.append(low)
            return bytes(out)


def encode_chunk(chunk: bytes | memoryview) -> bytes:
    """The serialized FetchAdapterResponse carrying ``chunk``."""
    return b"".join((_CHUNK_TAG, _varint(len(chunk)), chunk))


def _serialize_fetch_response(message: pb.FetchAdapterResponse | bytes) -> bytes:
    return message if isinstance(message, bytes) else message.SerializeToString()


def add_servicer(servicer, server: grpc.aio.Server) -> None:
    """Like the generated add_AdapterStoreServicer_to_server, except that FetchAdapter may
    yield pre-encoded chunk messages (bytes) as well as FetchAdapterResponse messages."""
    handlers = {
        "UploadAdapter": grpc.stream_unary_rpc_method_handler(
            servicer.UploadAdapter,
            request_deserializer=pb.UploadAdapterRequest.FromString,
            response_serializer=pb.AdapterInfo.SerializeToString,
        ),
        "FetchAdapter": grpc.unary_stream_rpc_method_handler(
            servicer.FetchAdapter,
            request_deserializer=pb.FetchAdapterRequest.FromString,
            response_serializer=_serialize_fetch_response,
        ),
        "GetAdapter": grpc.unary_unary_rpc_method_handler(
            servicer.GetAdapter,
            request_deserializer=pb.GetAdapterRequest.FromString,
            response_serializer=pb.AdapterInfo.SerializeToString,
        ),
        "ListAdapters": grpc.unary_unary_rpc_method_handler(
            servicer.ListAdapters,
            request_deserializer=pb.ListAdaptersRequest.FromString,
            response_serializer=pb.ListAdaptersResponse.SerializeToString,
        ),
        "DeleteAdapter": grpc.unary_unary_rpc_method_handler(
            servicer.DeleteAdapter,
            request_deserializer=pb.DeleteAdapterRequest.FromString,
            response_serializer=pb.DeleteAdapterResponse.SerializeToString,
        ),
        "WatchAdapters": grpc.unary_stream_rpc_method_handler(
            servicer.WatchAdapters,
            request_deserializer=pb.WatchAdaptersRequest.FromString,
            response_serializer=pb.AdapterEvent.SerializeToString,
        ),
    }
    server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(SERVICE, handlers),))
    server.add_registered_method_handlers(SERVICE, handlers)
