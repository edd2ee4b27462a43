"""FetchAdapter responses decoded without copying the chunks.

A chunk message is ``FetchAdapterResponse{chunk}``: the byte 0x12 (field 2, wire type 2), the
length as a varint, then the bytes. Decoding it by hand yields a memoryview of the received
buffer, so the only copy of an adapter's bytes on this side is the one into the pinned host
arena; through the generated code a chunk would be copied twice more (into the message, then
out of it). The inference service's fetch worker process (fetch_worker.py) and bench/store.py
decode with it. Any other message (AdapterInfo) goes through protobuf.
"""

from __future__ import annotations

from lorafleet.v1 import adapter_store_pb2 as pb

FETCH_METHOD = "/lorafleet.v1.AdapterStore/FetchAdapter"
# The service's channels to the store: reconnect quickly when it returns, fail fast while away.
RECONNECT_OPTIONS = [
    ("grpc.initial_reconnect_backoff_ms", 200),
    ("grpc.max_reconnect_backoff_ms", 2000),
]
_CHUNK_TAG = 0x12  # (field 2 << 3) | wire type 2 (length-delimited)


def decode_fetch_response(data: bytes) -> memoryview | pb.FetchAdapterResponse:
    """A chunk's bytes (a view of ``data``), or the parsed message for anything else."""
    if not data or data[0] != _CHUNK_TAG:
        return pb.FetchAdapterResponse.FromString(data)
    length = shift = 0
    pos = 1
    while True:
        if pos >= len(data) or shift > 63:
            raise ValueError("truncated FetchAdapterResponse: bad chunk length")
        byte = data[pos]
        pos += 1
        length |= (byte & 0x7F) << shift
        shift += 7
        if not byte & 0x80:
            break
    if pos + length != len(data):
        # Not a lone chunk field (or more fields follow): let protobuf handle it.
        return pb.FetchAdapterResponse.FromString(data)
    return memoryview(data)[pos:]
