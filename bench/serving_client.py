"""The serving benchmark's client process (bench/serving.py starts several): it replays its
share of a trace against the inference service over gRPC, or through the HTTP gateway's
streamed completions, and writes what each request saw.

    python bench/serving_client.py SPEC.json OUT.json
"""

from __future__ import annotations

import asyncio
import json
import random
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

import grpc  # noqa: E402

from lorafleet.v1 import inference_pb2 as pb  # noqa: E402
from lorafleet.v1 import inference_pb2_grpc as pb_grpc  # noqa: E402

_HTTP_STATUS = {400: "INVALID_ARGUMENT", 404: "NOT_FOUND", 429: "RESOURCE_EXHAUSTED",
                503: "UNAVAILABLE"}  # fmt: skip


class HttpClient:
    """Streamed completions from the gateway over HTTP/1.1, with connections kept alive and
    reused, as an OpenAI client does (the openai package's httpx pool), so that the gateway's
    TTFT holds no TCP connect, as gRPC's holds none on its long-lived channels. ``keep_alive``
    False opens a new connection per request (``Connection: close``)."""

    # Idle connections older than this are not reused: uvicorn closes them after 5 s.
    IDLE_S = 4.0

    def __init__(self, address: str, keep_alive: bool = True) -> None:
        host, _, port = address.rpartition(":")
        self._host, self._port, self._keep_alive = host, int(port), keep_alive
        self._idle: list[tuple[float, asyncio.StreamReader, asyncio.StreamWriter]] = []

    async def _connection(self) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
        while self._idle:
            since, reader, writer = self._idle.pop()
            if time.monotonic() - since < self.IDLE_S and not reader.at_eof():
                return reader, writer
            writer.close()
        return await asyncio.open_connection(self._host, self._port)

    async def completion(self, body: dict, timeout: float) -> tuple:
        """POST /v1/completions with stream true, reading the server-sent events as they come:
        (first token time, last token time, tokens, status)."""
        reader, writer = await self._connection()
        reusable = False
        try:
            *out, reusable = await self._exchange(reader, writer, body, timeout)
            return tuple(out)
        finally:
            if reusable and self._keep_alive:
                self._idle.append((time.monotonic(), reader, writer))
            else:
                writer.close()

    async def _exchange(self, reader, writer, body: dict, timeout: float) -> tuple:
        """(first, last, tokens, status, whether the connection can carry another request)."""
        raw = json.dumps(body).encode()
        close = b"" if self._keep_alive else b"Connection: close\r\n"
        writer.write(
            b"POST /v1/completions HTTP/1.1\r\nHost: %b\r\nContent-Type: application/json\r\n"
            b"Content-Length: %d\r\n%b\r\n%b" % (self._host.encode(), len(raw), close, raw)
        )
        first = last = None
        tokens, status = 0, "OK"
        code = int((await reader.readline()).split()[1])
        chunked = False
        while (line := await reader.readline()) not in (b"\r\n", b""):
            chunked |= line.lower().startswith(b"transfer-encoding: chunked")
        if code != 200:
            return None, None, 0, _HTTP_STATUS.get(code, f"HTTP_{code}"), False
        pending = b""
        while True:
            if chunked:
                size = int((await asyncio.wait_for(reader.readline(), timeout)).strip(), 16)
                data = await reader.readexactly(size + 2)
                if size == 0:  # the body's end: the connection is free for the next request
                    return first, last, tokens, status, True
                pending += data[:-2]
            else:
                data = await asyncio.wait_for(reader.read(65536), timeout)
                if not data:
                    return first, last, tokens, status, False
                pending += data
            *events, pending = pending.split(b"\n\n")
            for event in events:
                payload = event.removeprefix(b"data: ")
                if payload == b"[DONE]":
                    continue
                msg = json.loads(payload)
                if "error" in msg:
                    status = "STREAM_ERROR"
                elif msg.get("choices") and msg["choices"][0].get("text"):
                    last = time.perf_counter()
                    first = first or last
                if msg.get("usage"):
                    tokens = msg["usage"]["completion_tokens"]

    async def close(self) -> None:
        for _, _, writer in self._idle:
            writer.close()
        self._idle.clear()


async def grpc_completion(
    stub: pb_grpc.InferenceStub, req: pb.GenerateRequest, timeout: float
) -> tuple:
    """One Generate call, reading its stream: (first token time, last token time, tokens,
    status)."""
    first = last = None
    tokens, status = 0, "OK"
    try:
        async for msg in stub.Generate(req, timeout=timeout):
            if msg.token_ids:
                last = time.perf_counter()
                first = first or last
                tokens += len(msg.token_ids)
    except grpc.aio.AioRpcError as e:
        status = e.code().name
    return first, last, tokens, status


async def client(spec: dict) -> list[dict]:
    """Replay this client's share of the trace; per request: send, first token and last token
    times (perf_counter, comparable across processes), tokens, status. Over gRPC, or over the
    HTTP gateway's streamed completions when spec["http"] names it."""
    start, vocab, names = spec["start"], spec["vocab"], spec["adapters"]
    channels = [grpc.aio.insecure_channel(spec["address"]) for _ in range(spec["channels"])]
    stubs = [pb_grpc.InferenceStub(c) for c in channels]
    http = HttpClient(spec["http"]) if spec.get("http") else None
    rng = random.Random(spec["seed"])
    results: list[dict] = []

    async def one(i: int, r: dict) -> None:
        prompt = [rng.randrange(3, vocab) for _ in range(r["prompt_len"])]
        sampling = pb.SamplingParams(max_new_tokens=r["output_len"], ignore_eos=True)
        req = pb.GenerateRequest(
            request_id=f"{spec['tag']}-{r['index']}", prompt_token_ids=prompt, sampling=sampling,
            adapter_id="" if r["adapter"] is None else names[r["adapter"]],
        )  # fmt: skip
        await asyncio.sleep(max(0.0, start + r["arrival_s"] - time.perf_counter()))
        sent = time.perf_counter()
        if spec.get("http"):
            body = {
                "model": spec["base_model"] if r["adapter"] is None else names[r["adapter"]],
                "prompt": prompt, "max_tokens": r["output_len"], "temperature": 0,
                "ignore_eos": True, "stream": True, "stream_options": {"include_usage": True},
            }  # fmt: skip
            first, last, tokens, status = await http.completion(body, spec["timeout_s"])
            results.append({"index": r["index"], "sent": sent, "first": first, "last": last,
                            "tokens": tokens, "status": status})  # fmt: skip
            return
        first, last, tokens, status = await grpc_completion(
            stubs[i % len(stubs)], req, spec["timeout_s"]
        )
        results.append({"index": r["index"], "sent": sent, "first": first, "last": last,
                        "tokens": tokens, "status": status})  # fmt: skip

    await asyncio.gather(*(one(i, r) for i, r in enumerate(spec["requests"])))
    for c in channels:
        await c.close()
    if http is not None:
        await http.close()
    return results


if __name__ == "__main__":
    spec = json.loads(Path(sys.argv[1]).read_text())
    Path(sys.argv[2]).write_text(json.dumps(asyncio.run(client(spec))))
