"""The REST adapter registry over the adapter store: upload, list, get, delete.

POST /v1/adapters takes a multipart form: ``adapter_id``, then the file fields
``adapter_config.json`` and ``adapter_model.safetensors`` (optionally ``sha256`` and
``description`` before the weights). The weights stream into UploadAdapter as they arrive, so
the fields the header needs must come before them. Ids are written raw in paths, slashes
included (/v1/adapters/acme/support); ``?version=N`` picks one version (0 or none: the latest,
or for DELETE every version).
"""

from __future__ import annotations

import json

from fastapi import APIRouter, Query, Request
from fastapi.responses import JSONResponse

from lorafleet.cli.adapters import CONFIG_FILE, WEIGHTS_FILE
from lorafleet.v1 import adapter_store_pb2 as store_pb
from services.gateway.backends import call_metadata
from services.gateway.errors import BadRequest
from services.gateway.models import all_adapters
from services.gateway.multipart_stream import PartData, PartEnd, PartStart, multipart_events
from services.gateway.store_upload import StoreUpload

router = APIRouter()

# Form fields other than the weights, with the most bytes each may hold.
_FIELD_LIMITS = {"adapter_id": 1024, CONFIG_FILE: 1 << 20, "sha256": 128, "description": 4096}
_VERSION = Query(None, ge=0, le=2**32 - 1, description="0 or none: the latest")


def adapter_json(a: store_pb.AdapterInfo) -> dict:
    try:
        config = json.loads(a.adapter_config_json)
    except json.JSONDecodeError:
        config = a.adapter_config_json
    return {
        "id": a.adapter_id,
        "object": "adapter",
        "version": a.version,
        "rank": a.rank,
        "lora_alpha": a.lora_alpha,
        "target_modules": list(a.target_modules),
        "size_bytes": a.size_bytes,
        "sha256": a.sha256,
        "dtype": a.dtype,
        "num_layers": a.num_layers,
        "description": a.description,
        "created": a.created_at.seconds,
        "adapter_config": config,
    }


@router.post("/v1/adapters", status_code=201)
async def upload_adapter(request: Request) -> JSONResponse:
    gw = request.app.state.gateway
    store = gw.backends.store
    fields: dict[str, str] = {}
    upload: StoreUpload | None = None
    current: str | None = None
    value = bytearray()
    gw.metrics.uploads.inc()
    try:
        async for event in multipart_events(request):
            if isinstance(event, PartStart):
                current = event.name
                if current in fields or (current == WEIGHTS_FILE and upload is not None):
                    raise BadRequest(f"form field {current!r} is given twice")
                if current == WEIGHTS_FILE:
                    upload = StoreUpload(store, call_metadata(request), _header(fields))
                elif upload is not None:  # it would go unused: the header has gone
                    raise BadRequest(f"form field {current!r} must come before {WEIGHTS_FILE}")
                elif current not in _FIELD_LIMITS:
                    raise BadRequest(
                        f"unknown form field {current!r}; the fields are "
                        f"{', '.join([*_FIELD_LIMITS, WEIGHTS_FILE])}"
                    )
            elif isinstance(event, PartData):
                if current == WEIGHTS_FILE:
                    await upload.write(event.data)
                else:
                    value += event.data
                    if len(value) > _FIELD_LIMITS[current]:
                        raise BadRequest(
                            f"form field {current!r} exceeds {_FIELD_LIMITS[current]} bytes"
                        )
            elif isinstance(event, PartEnd) and current != WEIGHTS_FILE:
                try:
                    fields[current] = value.decode("utf-8")
                except UnicodeDecodeError:
                    raise BadRequest(f"form field {current!r} is not UTF-8 text") from None
                value.clear()
        if upload is None:
            raise BadRequest(f"the form has no {WEIGHTS_FILE} file")
        info = await upload.finish()
    except BaseException:
        if upload is not None:
            upload.cancel()
        raise
    finally:
        gw.metrics.uploads.dec()
    return JSONResponse(adapter_json(info), status_code=201)


def _header(fields: dict[str, str]) -> store_pb.UploadAdapterHeader:
    for name in ("adapter_id", CONFIG_FILE):
        if not fields.get(name):
            raise BadRequest(
                f"form field {name!r} must come before {WEIGHTS_FILE} (the weights stream to "
                "the store as they arrive, after the header that names them)"
            )
    return store_pb.UploadAdapterHeader(
        adapter_id=fields["adapter_id"],
        adapter_config_json=fields[CONFIG_FILE],
        sha256=fields.get("sha256", ""),
        description=fields.get("description", ""),
    )


@router.get("/v1/adapters")
async def list_adapters(
    request: Request,
    prefix: str = "",
    page_size: int = Query(0, ge=0, le=1000, description="0: every adapter, all pages"),
    page_token: str = "",
) -> dict:
    gw = request.app.state.gateway
    metadata = call_metadata(request)
    if page_size == 0:
        data = [adapter_json(a) async for a in all_adapters(gw, metadata, prefix)]
        return {"object": "list", "data": data, "next_page_token": ""}
    page = await gw.backends.store.ListAdapters(
        store_pb.ListAdaptersRequest(page_size=page_size, page_token=page_token, prefix=prefix),
        metadata=metadata,
        timeout=gw.config.rpc_timeout_s,
    )
    return {
        "object": "list",
        "data": [adapter_json(a) for a in page.adapters],
        "next_page_token": page.next_page_token,
    }


@router.get("/v1/adapters/{adapter_id:path}")
async def get_adapter(adapter_id: str, request: Request, version: int | None = _VERSION) -> dict:
    gw = request.app.state.gateway
    info = await gw.backends.store.GetAdapter(
        store_pb.GetAdapterRequest(adapter_id=adapter_id, version=version or 0),
        metadata=call_metadata(request),
        timeout=gw.config.rpc_timeout_s,
    )
    return adapter_json(info)


@router.delete("/v1/adapters/{adapter_id:path}")
async def delete_adapter(adapter_id: str, request: Request, version: int | None = _VERSION) -> dict:
    gw = request.app.state.gateway
    reply = await gw.backends.store.DeleteAdapter(
        store_pb.DeleteAdapterRequest(
            adapter_id=adapter_id, version=version or 0, all_versions=version is None
        ),
        metadata=call_metadata(request),
        timeout=gw.config.rpc_timeout_s,
    )
    return {
        "id": adapter_id,
        "object": "adapter.deleted",
        "deleted": True,
        "versions": list(reply.deleted_versions),
    }
