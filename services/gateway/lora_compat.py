"""vLLM's runtime LoRA endpoints, for tools that use them.

POST /v1/load_lora_adapter ``{"lora_name": ID, "lora_path": DIR}``: with a path, the PEFT
directory on the gateway's host is uploaded to the store under ``lora_name`` (a new version);
then that adapter (its latest version) is loaded onto the inference service's accelerator.
POST /v1/unload_lora_adapter ``{"lora_name": ID}`` drops every version of it from the inference
service (the store keeps it). With --lora-path-root, lora_path and the two files read in it
must lie under that directory, symlinks resolved.
"""

from __future__ import annotations

import os
from pathlib import Path

from fastapi import APIRouter, Request
from pydantic import BaseModel, ConfigDict, Field

from lorafleet.cli.adapters import CONFIG_FILE, WEIGHTS_FILE
from lorafleet.v1 import inference_pb2 as pb
from services.gateway.backends import call_metadata
from services.gateway.errors import BadRequest, NotFound
from services.gateway.http_io import read_body
from services.gateway.schemas import parse_json
from services.gateway.store_upload import upload_directory

router = APIRouter()

_RESIDENCY = {
    pb.RESIDENCY_GPU: "gpu",
    pb.RESIDENCY_HOST: "host",
    pb.RESIDENCY_LOADING: "loading",
}


class LoadLoraRequest(BaseModel):
    model_config = ConfigDict(extra="ignore", strict=True)
    lora_name: str = Field(min_length=1)
    lora_path: str | None = None


class UnloadLoraRequest(BaseModel):
    model_config = ConfigDict(extra="ignore", strict=True)
    lora_name: str = Field(min_length=1)


@router.post("/v1/load_lora_adapter")
async def load_lora_adapter(request: Request) -> dict:
    gw = request.app.state.gateway
    raw = await read_body(request, request.receive, gw.config.max_request_bytes)
    req = parse_json(LoadLoraRequest, raw)
    metadata = call_metadata(request)
    version = 0
    if req.lora_path:
        directory = _allowed(Path(req.lora_path), gw.config.lora_path_root)
        info = await upload_directory(gw.backends.store, metadata, req.lora_name, directory)
        version = info.version
    reply = await gw.backends.inference.LoadAdapter(
        pb.LoadAdapterRequest(adapter_id=req.lora_name, adapter_version=version),
        metadata=metadata,
        timeout=gw.config.rpc_timeout_s,
    )
    a = reply.adapter
    return {
        "id": a.adapter_id,
        "object": "adapter",
        "version": a.version,
        "residency": _RESIDENCY.get(a.residency, "unknown"),
        "load_seconds": reply.load_seconds,
        "message": f"Success: LoRA adapter '{a.adapter_id}' version {a.version} is loaded.",
    }


@router.post("/v1/unload_lora_adapter")
async def unload_lora_adapter(request: Request) -> dict:
    gw = request.app.state.gateway
    raw = await read_body(request, request.receive, gw.config.max_request_bytes)
    req = parse_json(UnloadLoraRequest, raw)
    reply = await gw.backends.inference.UnloadAdapter(
        pb.UnloadAdapterRequest(adapter_id=req.lora_name),
        metadata=call_metadata(request),
        timeout=gw.config.rpc_timeout_s,
    )
    if not reply.adapters:
        raise NotFound(f"LoRA adapter {req.lora_name!r} is not loaded", param="lora_name")
    return {
        "id": req.lora_name,
        "object": "adapter",
        "versions": [a.version for a in reply.adapters],
        "message": f"Success: LoRA adapter '{req.lora_name}' is unloaded.",
    }


def _allowed(path: Path, root: Path | None) -> Path:
    """``path`` as an absolute directory; with ``root``, it and the adapter files in it must
    lie under ``root``, symlinks resolved."""
    resolved = Path(os.path.realpath(path))
    if root is not None:
        top = Path(os.path.realpath(root))
        for name in ("", CONFIG_FILE, WEIGHTS_FILE):
            target = Path(os.path.realpath(resolved / name))  # resolved itself for ""
            if target != top and top not in target.parents:
                where = f"{name} in it" if name else "it"
                raise BadRequest(
                    f"lora_path {str(path)!r}: {where} is outside this gateway's --lora-path-root",
                    param="lora_path",
                )
    if not resolved.is_dir():
        raise BadRequest(f"lora_path {str(path)!r} is not a directory here", param="lora_path")
    return resolved
