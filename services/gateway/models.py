"""GET /v1/models and GET /v1/models/{id}: the base model first, then the adapters the caller
may use (the store lists them with the caller's credentials, so a tenant sees its own)."""

from __future__ import annotations

from collections.abc import AsyncIterator

from fastapi import APIRouter, Request

from lorafleet.v1 import adapter_store_pb2 as store_pb
from lorafleet.v1 import inference_pb2 as pb
from services.gateway.backends import Metadata, call_metadata

router = APIRouter()

_PAGE = 1000  # the store's largest page


@router.get("/v1/models")
async def list_models(request: Request) -> dict:
    gw = request.app.state.gateway
    metadata = call_metadata(request)
    info = await gw.model_info.get(metadata)
    data = [base_card(info, gw.started)]
    if gw.backends.has_store:
        async for adapter in all_adapters(gw, metadata):
            data.append(adapter_card(adapter, info.model_id))
    return {"object": "list", "data": data}


@router.get("/v1/models/{model_id:path}")
async def get_model(model_id: str, request: Request) -> dict:
    gw = request.app.state.gateway
    metadata = call_metadata(request)
    info = await gw.model_info.get(metadata)
    if model_id == info.model_id:
        return base_card(info, gw.started)
    adapter = await gw.backends.store.GetAdapter(
        store_pb.GetAdapterRequest(adapter_id=model_id),
        metadata=metadata,
        timeout=gw.config.rpc_timeout_s,
    )
    return adapter_card(adapter, info.model_id)


def base_card(info: pb.ModelInfo, created: int) -> dict:
    return {
        "id": info.model_id,
        "object": "model",
        "created": created,
        "owned_by": "lorafleet",
        "max_model_len": info.context_window,
    }


def adapter_card(adapter: store_pb.AdapterInfo, base_id: str) -> dict:
    return {
        "id": adapter.adapter_id,
        "object": "model",
        "created": adapter.created_at.seconds,
        "owned_by": "lorafleet",
        "parent": base_id,
        "version": adapter.version,
    }


async def all_adapters(gw, metadata: Metadata, prefix: str = "") -> AsyncIterator:
    """The latest version of every adapter the caller may see, page after page."""
    token = ""
    while True:
        page = await gw.backends.store.ListAdapters(
            store_pb.ListAdaptersRequest(page_size=_PAGE, page_token=token, prefix=prefix),
            metadata=metadata,
            timeout=gw.config.rpc_timeout_s,
        )
        for adapter in page.adapters:
            yield adapter
        token = page.next_page_token
        if not token:
            return
