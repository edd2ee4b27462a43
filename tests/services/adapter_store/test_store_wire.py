"""Hand-encoded FetchAdapter chunks decode, with the generated code, to the same message."""

from __future__ import annotations

import pytest

from lorafleet.v1 import adapter_store_pb2 as pb
from services.adapter_store.wire import encode_chunk


@pytest.mark.parametrize("size", [0, 1, 127, 128, 300, 16383, 16384, (4 << 20) - 4096])
def test_encoded_chunk_matches_protobuf(size):
    chunk = bytes(i % 251 for i in range(size))
    encoded = encode_chunk(chunk)
    assert pb.FetchAdapterResponse.FromString(encoded).chunk == chunk
    if size:  # proto3 leaves an empty bytes field out; ours is still a valid encoding
        assert encoded == pb.FetchAdapterResponse(chunk=chunk).SerializeToString()
