"""POST /v1/completions and POST /v1/chat/completions over Inference.Generate.

``model`` names an adapter (its latest version) or, when it equals the model id of
GetModelInfo, the base model. Each prompt x choice is one Generate call, all started together.
Before anything is sent, every call's first message is awaited, so a refusal (an unknown
adapter, a prompt beyond the context window, a full queue) answers with its own status code; a
failure after that ends a stream with an error event. A client that disconnects cancels its
calls, and the engine aborts them.
"""

from __future__ import annotations

import asyncio
import time
import uuid
from collections.abc import AsyncIterator

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, StreamingResponse

from lorafleet.v1 import inference_pb2 as pb
from services.gateway.backends import call_metadata
from services.gateway.errors import BadRequest, error_body, error_of
from services.gateway.generation import ChoiceResult, Generations
from services.gateway.http_io import read_body, until_disconnect
from services.gateway.openai_format import (
    DONE,
    ChatFormat,
    CompletionFormat,
    Format,
    event,
)
from services.gateway.sampling import COMPLETIONS_MAX_TOKENS, sampling_params
from services.gateway.schemas import ChatRequest, CompletionRequest, GenerationFields, parse

router = APIRouter()

# Streamed answers must reach the client as produced: no proxy buffering, no caching.
_STREAM_HEADERS = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}


@router.post("/v1/completions")
async def completions(request: Request):
    gw = request.app.state.gateway
    req = parse(CompletionRequest, await read_body(request, gw.config.max_request_bytes))
    metadata = call_metadata(request)
    adapter_id = gw.adapter_for(req.model, await gw.model_info.get(metadata))
    max_tokens = req.max_tokens or COMPLETIONS_MAX_TOKENS
    prompts = req.prompts()
    _check_count(len(prompts) * req.n, gw.config.max_n)
    rid = uuid.uuid4().hex
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
    fmt = CompletionFormat(req.model, req.n, req.include_usage, req.wanted_logprobs is not None)
    return await _serve(request, req, calls, fmt, "completions")


@router.post("/v1/chat/completions")
async def chat_completions(request: Request):
    gw = request.app.state.gateway
    req = parse(ChatRequest, await read_body(request, gw.config.max_request_bytes))
    metadata = call_metadata(request)
    adapter_id = gw.adapter_for(req.model, await gw.model_info.get(metadata))
    template = await gw.model_info.chat_template(metadata)
    prompt = template.render(req.template_messages(), req.add_generation_prompt)
    max_tokens = req.completion_limit or gw.config.chat_max_tokens
    _check_count(req.n, gw.config.max_n)
    rid = uuid.uuid4().hex
    calls = [
        pb.GenerateRequest(
            request_id=f"{rid}-{j}",
            adapter_id=adapter_id,
            prompt=prompt,
            sampling=sampling_params(req, max_tokens, j),
        )
        for j in range(req.n)
    ]
    fmt = ChatFormat(req.model, req.n, req.include_usage, req.wanted_logprobs is not None)
    return await _serve(request, req, calls, fmt, "chat")


def _check_count(count: int, limit: int) -> None:
    if count > limit:
        raise BadRequest(
            f"this request asks for {count} generations (prompts x n); at most {limit} "
            "(the gateway's --max-n)",
            param="n",
        )


async def _serve(
    request: Request, req: GenerationFields, calls: list[pb.GenerateRequest], fmt: Format, kind: str
):
    gw = request.app.state.gateway
    start = time.perf_counter()
    gens = Generations(gw.backends.inference, calls, call_metadata(request))
    close = _Closer(gens, gw.metrics)
    try:
        await until_disconnect(request, gens.first())
        gw.metrics.ttft.labels(kind).observe(time.perf_counter() - start)
        if req.stream:
            return _GenerationStream(_stream(gens, fmt, gw.metrics), close)
        results = await until_disconnect(request, gens.collect())
    except BaseException:
        close()
        raise
    close()
    gw.metrics.tokens.inc(sum(r.completion_tokens for r in results))
    return JSONResponse(fmt.response(results))


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


class _GenerationStream(StreamingResponse):
    """A streamed answer whose calls are cancelled however it ends: finished, failed, or cut
    off by a client that went away (even before the body's first chunk, when its generator
    never ran).

    The head and the first chunk leave in the same event-loop turn as the response is called
    (the first messages are already in): Starlette's own streaming starts a task group and a
    task for the body first, which cost turns before the first token. Uvicorn's HTTP/1.1
    protocols speak ASGI 2.3, where a send to a client that went away does nothing rather than
    fail, so one plain task watches for the disconnect and cancels the stream, as Starlette's
    task group does."""

    def __init__(self, body: AsyncIterator[str], close: _Closer) -> None:
        super().__init__(body, media_type="text/event-stream", headers=_STREAM_HEADERS)
        self._close = close

    async def __call__(self, scope, receive, send) -> None:
        stream = asyncio.current_task()
        state = {"streaming": True, "gone": False}

        async def watch() -> None:
            while (await receive())["type"] != "http.disconnect":
                pass
            if state["streaming"]:  # the stream waits inside the try below: it ends there
                state["gone"] = True
                stream.cancel()

        watcher = asyncio.ensure_future(watch())
        try:
            await send({"type": "http.response.start", "status": 200, "headers": self.raw_headers})
            async for chunk in self.body_iterator:
                await send(
                    {"type": "http.response.body", "body": chunk.encode(), "more_body": True}
                )
            state["streaming"] = False
            await send({"type": "http.response.body", "body": b"", "more_body": False})
        except asyncio.CancelledError:
            if not state["gone"]:  # cancelled from elsewhere (a shutdown): not ours to absorb
                raise
            stream.uncancel()
        finally:
            state["streaming"] = False
            watcher.cancel()
            self._close()


async def _stream(gens: Generations, fmt: Format, metrics) -> AsyncIterator[str]:
    """The SSE body; cancelled when the client disconnects."""
    results = [ChoiceResult() for _ in range(len(gens))]  # finish reasons and token counts
    try:
        opened = set()
        async for i, msg in gens.messages():
            if i not in opened:
                opened.add(i)
                if (opening := fmt.opening(i)) is not None:
                    yield fmt.chunk([opening])
            if msg.text or (fmt.logprobs and msg.logprobs):
                yield fmt.chunk([fmt.delta(i, msg.text, None, list(msg.logprobs))])
            if msg.finish_reason:
                results[i].finish(msg)
                yield fmt.chunk([fmt.delta(i, "", results[i].finish_reason)])
        if fmt.include_usage:
            yield fmt.usage_chunk(results)
    except Exception as exc:  # after the 200: the error travels as an event
        yield event(error_body(*error_of(exc)))
    finally:
        metrics.tokens.inc(sum(r.completion_tokens for r in results))
    yield DONE
