"""lorafleet.v1.AdapterStore over grpc.aio: translation only; the work is store.AdapterStore's."""

from __future__ import annotations

import asyncio

import grpc

from lorafleet.v1 import adapter_store_pb2 as pb
from lorafleet.v1 import adapter_store_pb2_grpc as pb_grpc
from services.access import audited, check_store_read, check_store_write, scope_prefix
from services.adapter_store import messages
from services.adapter_store.errors import map_errors, map_stream_errors, within_deadline
from services.adapter_store.metrics import StoreMetrics
from services.adapter_store.wire import encode_chunk
from services.auth import Authenticator
from store.adapter_store import AdapterStore
from store.errors import InvalidRequest


class AdapterStoreServicer(pb_grpc.AdapterStoreServicer):
    """Every call is authorized against the adapter ids it touches (services/access.py) before
    the store does any work for it."""

    def __init__(
        self,
        store: AdapterStore,
        auth: Authenticator | None = None,
        metrics: StoreMetrics | None = None,
    ) -> None:
        self._store = store
        self._auth = auth or Authenticator(None)
        self.metrics = metrics  # calls counted by errors.py's wrappers

    @map_errors
    async def UploadAdapter(self, request_iterator, context) -> pb.AdapterInfo:
        caller = self._auth.caller(context)
        first = await anext(request_iterator, None)
        if first is None or first.WhichOneof("payload") != "header":
            raise InvalidRequest("the first UploadAdapterRequest must carry the header")
        header = messages.upload_header(first.header)
        with audited("upload", caller, header.adapter_id) as entry:
            check_store_write(caller, header.adapter_id)
            record = await self._upload(header, request_iterator, context, caller.tenant)
            entry.version = record.version
        if self.metrics is not None:
            self.metrics.adapter_bytes.labels("upload").inc(record.size_bytes)
        return messages.adapter_info(record)

    async def _upload(self, header, request_iterator, context, tenant: str | None):
        async def chunks():
            async for message in request_iterator:
                if message.WhichOneof("payload") != "chunk":
                    raise InvalidRequest("only the first UploadAdapterRequest may be a header")
                yield message.chunk

        try:
            return await self._store.upload(header, chunks(), tenant)
        except asyncio.CancelledError:
            if not self._store.closing:
                raise  # the client went away
            await context.abort(
                grpc.StatusCode.UNAVAILABLE, "the adapter store is shutting down; upload again"
            )

    @map_stream_errors
    async def FetchAdapter(self, request, context):
        check_store_read(self._auth.caller(context), request.adapter_id)
        record = await within_deadline(
            context, self._store.get(request.adapter_id, request.version)
        )
        yield pb.FetchAdapterResponse(info=messages.adapter_info(record))
        async for chunk in self._store.fetch(record):
            yield encode_chunk(chunk)  # a FetchAdapterResponse{chunk}, serialized (wire.py)
            if self.metrics is not None:
                self.metrics.adapter_bytes.labels("fetch").inc(len(chunk))

    @map_errors
    async def GetAdapter(self, request, context) -> pb.AdapterInfo:
        check_store_read(self._auth.caller(context), request.adapter_id)
        record = await within_deadline(
            context, self._store.get(request.adapter_id, request.version)
        )
        return messages.adapter_info(record)

    @map_errors
    async def ListAdapters(self, request, context) -> pb.ListAdaptersResponse:
        # A tenant's listing is confined to its namespace; the page token is issued for the
        # scoped prefix, which the same request prefix scopes to again on the next page.
        prefix = scope_prefix(self._auth.caller(context), request.prefix)
        page = await within_deadline(
            context, self._store.list(prefix, request.page_size, request.page_token)
        )
        return pb.ListAdaptersResponse(
            adapters=[messages.adapter_info(r) for r in page.records],
            next_page_token=page.next_page_token,
        )

    @map_errors
    async def DeleteAdapter(self, request, context) -> pb.DeleteAdapterResponse:
        caller = self._auth.caller(context)
        which = "all" if request.all_versions else request.version
        with audited("delete", caller, request.adapter_id, which) as entry:
            check_store_write(caller, request.adapter_id)
            deleted = await within_deadline(
                context,
                self._store.delete(request.adapter_id, request.version, request.all_versions),
            )
            entry.version = ",".join(str(r.version) for r in deleted)
        return pb.DeleteAdapterResponse(deleted_versions=[r.version for r in deleted])

    @map_stream_errors
    async def WatchAdapters(self, request, context):
        prefix = scope_prefix(self._auth.caller(context), request.prefix)
        # Headers first: a watcher learns that the store answered (and that its replay starts)
        # even when there is nothing to replay.
        await context.send_initial_metadata(())
        async for event in self._store.watch(prefix, request.include_existing):
            yield messages.adapter_event(event)
