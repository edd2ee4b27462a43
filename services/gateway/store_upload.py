"""One AdapterStore.UploadAdapter call fed as bytes arrive: the header, then the weights in
chunks. Each write waits for gRPC's flow control, so a slow store slows the reader instead of
filling memory; at most one chunk is buffered here. Cancelling the call makes the store abort
the upload: no version becomes visible."""

from __future__ import annotations

import asyncio
from pathlib import Path

import grpc

from lorafleet.cli.adapters import DEFAULT_CHUNK_BYTES, CliError, adapter_files
from lorafleet.v1 import adapter_store_pb2 as store_pb
from lorafleet.v1 import adapter_store_pb2_grpc as store_grpc
from services.gateway.backends import Metadata
from services.gateway.errors import BadRequest, Unavailable


class StoreUpload:
    def __init__(
        self,
        store: store_grpc.AdapterStoreStub,
        metadata: Metadata,
        header: store_pb.UploadAdapterHeader,
    ) -> None:
        self._call = store.UploadAdapter(metadata=metadata)
        self._header = header
        self._buffer = bytearray()
        self._started = False

    async def write(self, data: bytes) -> None:
        if not self._started:
            self._started = True
            await self._send(store_pb.UploadAdapterRequest(header=self._header))
        self._buffer += data
        while len(self._buffer) >= DEFAULT_CHUNK_BYTES:
            chunk = bytes(self._buffer[:DEFAULT_CHUNK_BYTES])
            del self._buffer[:DEFAULT_CHUNK_BYTES]
            await self._send(store_pb.UploadAdapterRequest(chunk=chunk))

    async def finish(self) -> store_pb.AdapterInfo:
        """The new version's info, once the store has checked and committed it."""
        await self.write(b"")
        if self._buffer:
            await self._send(store_pb.UploadAdapterRequest(chunk=bytes(self._buffer)))
            self._buffer.clear()
        await self._call.done_writing()
        return await self._call

    def cancel(self) -> None:
        self._call.cancel()

    async def _send(self, message: store_pb.UploadAdapterRequest) -> None:
        try:
            await self._call.write(message)
        except (asyncio.InvalidStateError, grpc.aio.AioRpcError):
            # The store already answered (it refuses a bad header at once) or the stream broke:
            # a write that meets the closed stream reports INTERNAL, so the call's own end,
            # awaited here, is what gives the store's status and message.
            await self._call
            raise Unavailable("the adapter store ended the upload early") from None


async def upload_directory(
    store: store_grpc.AdapterStoreStub, metadata: Metadata, adapter_id: str, directory: Path
) -> store_pb.AdapterInfo:
    """Uploads a PEFT adapter directory on this host, reading the weights chunk by chunk."""
    try:
        config_json, weights = adapter_files(directory)
    except CliError as exc:
        raise BadRequest(str(exc), param="lora_path") from None
    header = store_pb.UploadAdapterHeader(
        adapter_id=adapter_id, adapter_config_json=config_json, size_bytes=weights.stat().st_size
    )
    upload = StoreUpload(store, metadata, header)
    try:
        with open(weights, "rb") as f:
            while chunk := await asyncio.to_thread(f.read, DEFAULT_CHUNK_BYTES):
                await upload.write(chunk)
        return await upload.finish()
    except BaseException:
        upload.cancel()
        raise
