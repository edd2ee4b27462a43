"""lorafleet.v1.AdapterStore over grpc.aio: translation only; the work is store.AdapterStore's."""

from __future__ import annotations

import asyncio

import grpc

from lorafleet.v1 import adapter_store_pb2 as pb
from lorafleet.v1 import adapter_store_pb2_grpc as pb_grpc
from services.adapter_store import messages
from services.adapter_store.errors import map_errors, map_stream_errors, within_deadline
from services.adapter_store.wire import encode_chunk
from store.adapter_store import AdapterStore
from store.errors import InvalidRequest


class AdapterStoreServicer(pb_grpc.AdapterStoreServicer):
    def __init__(self, store: AdapterStore) -> None:
        self._store = store

    @map_errors
    async def UploadAdapter(self, request_iterator, context) -> pb.AdapterInfo:
        first = await anext(request_iterator, None)
        if first is None or first.WhichOneof("payload") != "header":
            raise InvalidRequest("the first UploadAdapterRequest must carry the header")
        header = messages.upload_header(first.header)

        async def chunks():
            async for message in request_iterator:
                if message.WhichOneof("payload") != "chunk":
                    raise InvalidRequest("only the first UploadAdapterRequest may be a header")
                yield message.chunk

        try:
            record = await self._store.upload(header, chunks())
        except asyncio.CancelledError:
            if not self._store.closing:
                raise  # the client went away
            await context.abort(
                grpc.StatusCode.UNAVAILABLE, "the adapter store is shutting down; upload again"
            )
        return messages.adapter_info(record)

    @map_stream_errors
    async def FetchAdapter(self, request, context):
        record = await within_deadline(
            context, self._store.get(request.adapter_id, request.version)
        )
        yield pb.FetchAdapterResponse(info=messages.adapter_info(record))
        async for chunk in self._store.fetch(record):
            yield encode_chunk(chunk)  # a FetchAdapterResponse{chunk}, serialized (wire.py)

    @map_errors
    async def GetAdapter(self, request, context) -> pb.AdapterInfo:
        record = await within_deadline(
            context, self._store.get(request.adapter_id, request.version)
        )
        return messages.adapter_info(record)

    @map_errors
    async def ListAdapters(self, request, context) -> pb.ListAdaptersResponse:
        page = await within_deadline(
            context, self._store.list(request.prefix, request.page_size, request.page_token)
        )
        return pb.ListAdaptersResponse(
            adapters=[messages.adapter_info(r) for r in page.records],
            next_page_token=page.next_page_token,
        )

    @map_errors
    async def DeleteAdapter(self, request, context) -> pb.DeleteAdapterResponse:
        deleted = await within_deadline(
            context,
            self._store.delete(request.adapter_id, request.version, request.all_versions),
        )
        return pb.DeleteAdapterResponse(deleted_versions=[r.version for r in deleted])

    @map_stream_errors
    async def WatchAdapters(self, request, context):
        # Headers first: a watcher learns that the store answered (and that its replay starts)
        # even when there is nothing to replay.
        await context.send_initial_metadata(())
        async for event in self._store.watch(request.prefix, request.include_existing):
            yield messages.adapter_event(event)
