"""POST /v1/completions and POST /v1/chat/completions over Inference.Generate.

``model`` names an adapter (its latest version) or, when it equals the model id of
GetModelInfo, the base model. Each prompt x choice is one Generate call, all started together.
Before anything is sent, every call's first message is awaited, so a refusal (an unknown
adapter, a prompt beyond the context window, a full queue) answers with its own status code; a
failure after that ends a stream with an error event. A client that disconnects cancels its
calls, and the engine aborts them.

The two endpoints are plain ASGI apps, not FastAPI endpoints, and their POSTs are taken ahead
of FastAPI's middleware and router (``serve``, called by app.GatewayApp): they are on every
request's path to its first token, where FastAPI's and Starlette's per-request layers (the
middleware stack, routing, Request objects, dependency solving, response classes, the streaming
task group) cost more than all the endpoints' own work. Their errors are answered as the other
routes' are.
"""

from __future__ import annotations

import asyncio
import os
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import TYPE_CHECKING

import grpc
from fastapi import APIRouter, Request
from starlette.responses import JSONResponse, Response
from starlette.types import Receive, Scope, Send

from lorafleet.v1 import inference_pb2 as pb
from services.gateway.backends import Metadata, call_metadata
from services.gateway.errors import (
    BadRequest,
    ClientGone,
    GatewayError,
    error_body,
    error_of,
    response_for,
)
from services.gateway.generation import ChoiceResult, Generations
from services.gateway.http_io import DisconnectWatch, read_body
from services.gateway.openai_format import (
    DONE,
    ChatFormat,
    CompletionFormat,
    Format,
    event,
)
from services.gateway.sampling import COMPLETIONS_MAX_TOKENS, sampling_params
from services.gateway.schemas import ChatRequest, CompletionRequest, GenerationFields, parse

if TYPE_CHECKING:
    from services.gateway.app import Gateway

# Streamed answers must reach the client as produced: no proxy buffering, no caching.
_STREAM_HEAD = {
    "type": "http.response.start",
    "status": 200,
    "headers": [
        (b"cache-control", b"no-cache"),
        (b"x-accel-buffering", b"no"),
        (b"content-type", b"text/event-stream; charset=utf-8"),
    ],
}
_STREAM_END = {"type": "http.response.body", "body": b"", "more_body": False}

# What a request becomes: its fields and its Generate calls, whose ids extend the request's.
Prepared = tuple[GenerationFields, list[pb.GenerateRequest]]
Prepare = Callable[["Gateway", bytes, Metadata, str], Awaitable[Prepared]]


async def _completions(gw: Gateway, raw: bytes, metadata: Metadata, rid: str) -> Prepared:
    req = parse(CompletionRequest, raw)
    adapter_id = gw.adapter_for(req.model, await gw.model_info.get(metadata))
    max_tokens = req.max_tokens or COMPLETIONS_MAX_TOKENS
    prompts = req.prompts()
    _check_count(len(prompts) * req.n, gw.config.max_n)
    calls = []
    for p, prompt in enumerate(prompts):
        for j in range(req.n):
            msg = pb.GenerateRequest(
                request_id=f"{rid}-{p * req.n + j}",
                adapter_id=adapter_id,
                sampling=sampling_params(req, max_tokens, j),
            )
            if isinstance(prompt, str):
                msg.prompt = prompt
            else:
                msg.prompt_token_ids.extend(prompt)
            calls.append(msg)
    return req, calls


async def _chat_completions(gw: Gateway, raw: bytes, metadata: Metadata, rid: str) -> Prepared:
    req = parse(ChatRequest, raw)
    adapter_id = gw.adapter_for(req.model, await gw.model_info.get(metadata))
    template = await gw.model_info.chat_template(metadata)
    prompt = template.render(req.template_messages(), req.add_generation_prompt)
    max_tokens = req.completion_limit or gw.config.chat_max_tokens
    _check_count(req.n, gw.config.max_n)
    calls = [
        pb.GenerateRequest(
            request_id=f"{rid}-{j}",
            adapter_id=adapter_id,
            prompt=prompt,
            sampling=sampling_params(req, max_tokens, j),
        )
        for j in range(req.n)
    ]
    return req, calls


def _check_count(count: int, limit: int) -> None:
    if count > limit:
        raise BadRequest(
            f"this request asks for {count} generations (prompts x n); at most {limit} "
            "(the gateway's --max-n)",
            param="n",
        )


class GenerationEndpoint:
    """One generation endpoint as an ASGI app: the body read and checked, the Generate calls
    started, their first messages awaited, then the answer, streamed or whole. Failures before
    the answer starts are raised, as from FastAPI's routes.

    A stream's head and first chunk leave in the event-loop turn in which the first messages
    arrive: they are awaited in the request's own task, and one plain task (DisconnectWatch)
    watches the connection for the whole request, cancelling it if the client goes away.
    Uvicorn's HTTP/1.1 protocols speak ASGI 2.3, where a send to a client that went away does
    nothing rather than fail."""

    def __init__(self, kind: str, prepare: Prepare, format_class: type[Format]) -> None:
        self.kind = kind  # the time-to-first-token metric's endpoint label
        self._prepare = prepare
        self._format = format_class

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        gw = scope["app"].state.gateway
        metadata = call_metadata(scope)
        raw = await read_body(scope, receive, gw.config.max_request_bytes)
        rid = os.urandom(16).hex()
        req, calls = await self._prepare(gw, raw, metadata, rid)
        start = time.perf_counter()
        gens = Generations(gw.backends.inference, calls, metadata)
        close = _Closer(gens, gw.metrics)
        watch = None
        started = False  # the response's head has left
        try:
            # grpc.aio sends each call's request from a task of its own: it goes first, and
            # what is left to set up is done while the requests travel.
            await asyncio.sleep(0)
            watch = DisconnectWatch(receive)
            logprobs = req.wanted_logprobs is not None
            fmt = self._format(rid, req.model, req.n, req.include_usage, logprobs)
            await gens.first()
            ttft = time.perf_counter() - start
            if req.stream:
                body = _stream(gens, fmt, gw.metrics)
                first = await anext(body)  # made before the head, so both leave back to back
                started = True
                await send(_STREAM_HEAD)
                await send(_chunk(first))
                gw.metrics.ttft.labels(self.kind).observe(ttft)  # after the first token left
                async for chunk in body:
                    await send(_chunk(chunk))
                watch.stop()  # the response's end is no disconnect
                await send(_STREAM_END)
                return
            gw.metrics.ttft.labels(self.kind).observe(ttft)
            results = await gens.collect()
        except asyncio.CancelledError:
            if watch is None or not watch.gone:  # from elsewhere (a shutdown): not ours
                raise
            asyncio.current_task().uncancel()
            if not started:
                raise ClientGone() from None
            return  # a stream cut off: nothing more to send
        finally:
            if watch is not None:
                watch.stop()
            close()
        gw.metrics.tokens.inc(sum(r.completion_tokens for r in results))
        await JSONResponse(fmt.response(results))(scope, receive, send)


def _chunk(text: str) -> dict:
    return {"type": "http.response.body", "body": text.encode(), "more_body": True}


class _Closer:
    """Cancels a request's calls once (those still running) and counts them out."""

    def __init__(self, gens: Generations, metrics) -> None:
        self._gens, self._metrics = gens, metrics
        metrics.generations.inc(len(gens))
        self._closed = False

    def __call__(self) -> None:
        if not self._closed:
            self._closed = True
            self._gens.cancel()
            self._metrics.generations.dec(len(self._gens))


async def _stream(gens: Generations, fmt: Format, metrics) -> AsyncIterator[str]:
    """The SSE body, the events of each message together; cancelled when the client
    disconnects."""
    results = [ChoiceResult() for _ in range(len(gens))]  # finish reasons and token counts
    try:
        opened = set()
        async for i, msg in gens.messages():
            events = []
            if i not in opened:
                opened.add(i)
                if (opening := fmt.opening(i)) is not None:
                    events.append(fmt.chunk([opening]))
            if msg.text or (fmt.logprobs and msg.logprobs):
                events.append(fmt.chunk([fmt.delta(i, msg.text, None, list(msg.logprobs))]))
            if msg.finish_reason:
                results[i].finish(msg)
                events.append(fmt.chunk([fmt.delta(i, "", results[i].finish_reason)]))
            if events:
                yield "".join(events)
        if fmt.include_usage:
            yield fmt.usage_chunk(results)
    except Exception as exc:  # after the 200: the error travels as an event
        yield event(error_body(*error_of(exc)))
    finally:
        metrics.tokens.inc(sum(r.completion_tokens for r in results))
    yield DONE


ENDPOINTS = {
    "/v1/completions": GenerationEndpoint("completions", _completions, CompletionFormat),
    "/v1/chat/completions": GenerationEndpoint("chat", _chat_completions, ChatFormat),
}

# FastAPI's routes of the endpoints: they answer their other methods (405), a trailing slash (a
# redirect) and /openapi.json as any route does, and name the route for the request metrics;
# their POSTs, taken by GatewayApp, reach them only through FastAPI's own stack (none do when
# the gateway serves).
router = APIRouter()


class _Run(Response):
    """A response that is the endpoint itself, run on the request's connection."""

    def __init__(self, endpoint: GenerationEndpoint) -> None:
        super().__init__()
        self._endpoint = endpoint

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        await self._endpoint(scope, receive, send)


@router.post("/v1/completions")
async def completions(request: Request) -> Response:
    return _Run(ENDPOINTS["/v1/completions"])


@router.post("/v1/chat/completions")
async def chat_completions(request: Request) -> Response:
    return _Run(ENDPOINTS["/v1/chat/completions"])


_ROUTES = {route.path: route for route in router.routes}


async def serve(scope: Scope, receive: Receive, send: Send) -> None:
    """A POST to one of ENDPOINTS' paths, taken ahead of FastAPI's middleware and router
    (app.GatewayApp): what its endpoint raises before answering is answered as the app's
    exception handlers answer it (errors.response_for)."""
    path = scope["path"]
    scope["route"] = _ROUTES[path]  # the request metrics' label, as FastAPI's router sets it
    try:
        await ENDPOINTS[path](scope, receive, send)
    except (GatewayError, grpc.RpcError, ClientGone) as exc:
        await response_for(exc)(scope, receive, send)
