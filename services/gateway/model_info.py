"""The served base model as the inference service's GetModelInfo describes it, asked once.

The gateway holds no model files: the model's id (what ``model`` names to mean the base model),
its context window and its chat template come from the inference service. They are asked for
at start-up, again every second while the service is not ready, and otherwise by the first
request (with that caller's credentials, for a service that asks for them); once known they are
kept for the gateway's lifetime.
"""

from __future__ import annotations

import asyncio
import logging

import grpc

from lorafleet.v1 import inference_pb2 as pb
from lorafleet.v1 import inference_pb2_grpc as pb_grpc
from services.gateway.backends import Metadata
from services.gateway.chat_template import ChatTemplate
from services.gateway.errors import BadRequest, Unavailable

log = logging.getLogger(__name__)

_RETRY_S = 1.0


class ModelInfoCache:
    def __init__(self, stub: pb_grpc.InferenceStub, timeout: float) -> None:
        self._stub = stub
        self._timeout = timeout
        self._info: pb.ModelInfo | None = None
        self._template: ChatTemplate | None = None
        self._template_error = ""  # why there is no template
        self._lock = asyncio.Lock()

    @property
    def known(self) -> pb.ModelInfo | None:
        return self._info

    async def get(self, metadata: Metadata) -> pb.ModelInfo:
        if self._info is not None:
            return self._info
        async with self._lock:
            if self._info is None:
                try:
                    info = await self._stub.GetModelInfo(
                        pb.GetModelInfoRequest(), metadata=metadata, timeout=self._timeout
                    )
                except grpc.RpcError as exc:
                    if exc.code() == grpc.StatusCode.UNAVAILABLE:
                        raise Unavailable(
                            f"the inference service is not ready: {exc.details()}"
                        ) from None
                    raise
                self._template, self._template_error = _compile(info)
                self._info = info
                log.info(
                    "serving model %s (context window %d, %s chat template)", info.model_id,
                    info.context_window, "a" if info.chat_template else "no",
                )  # fmt: skip
        return self._info

    async def chat_template(self, metadata: Metadata) -> ChatTemplate:
        info = await self.get(metadata)
        if self._template is None:
            raise BadRequest(
                f"the model {info.model_id!r} {self._template_error}, so it cannot serve chat "
                "completions: use /v1/completions"
            )
        return self._template

    async def prefetch(self) -> None:
        """Asks until the service answers; stops on any other refusal than UNAVAILABLE (one
        that only a caller's credentials can lift, or a service without GetModelInfo): each
        request then asks with its own credentials, and gets that refusal's status."""
        while self._info is None:
            try:
                await self.get(())
            except Unavailable:
                await asyncio.sleep(_RETRY_S)
            except grpc.RpcError as exc:
                log.info("model info waits for the first request (%s)", exc.code().name)
                return


def _compile(info: pb.ModelInfo) -> tuple[ChatTemplate | None, str]:
    """The compiled template, or None and why there is none."""
    if not info.chat_template:
        return None, "has no chat template (its tokenizer_config.json has no chat_template)"
    try:
        template = ChatTemplate(info.chat_template, dict(info.special_tokens), info.adds_bos_token)
    except ValueError as exc:
        log.error("%s; chat completions are refused", exc)
        return None, f"has a chat template that does not compile ({exc})"
    return template, ""
