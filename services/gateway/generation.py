"""Several Generate calls run concurrently for one HTTP request (its prompts x n choices).

The calls start together, so the inference service batches them. Their messages are merged in
the order they arrive, each tagged with its choice index. ``cancel()`` ends every call still
running: the inference service aborts each (its pages are free at the next step); it is what
a client that goes away, or a failure of one choice, leads to. A call whose last message (the
one with its finish reason) has arrived is left to close by itself: there is nothing left to
abort.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from dataclasses import dataclass, field

import grpc

from lorafleet.v1 import inference_pb2 as pb
from lorafleet.v1 import inference_pb2_grpc as pb_grpc
from services.gateway.backends import Metadata
from services.gateway.errors import Unavailable

FINISH_REASONS = {
    pb.FINISH_REASON_LENGTH: "length",
    pb.FINISH_REASON_STOP: "stop",
    pb.FINISH_REASON_EOS: "stop",
}


@dataclass
class ChoiceResult:
    """One choice, gathered from its messages."""

    parts: list[str] = field(default_factory=list)
    logprobs: list = field(default_factory=list)  # pb.TokenLogprob, one per token (if asked)
    finish_reason: str | None = None
    prompt_tokens: int = 0
    completion_tokens: int = 0

    @property
    def text(self) -> str:
        return "".join(self.parts)

    def add(self, msg: pb.GenerateResponse) -> None:
        if msg.text:
            self.parts.append(msg.text)
        self.logprobs.extend(msg.logprobs)
        if msg.finish_reason:
            self.finish(msg)

    def finish(self, msg: pb.GenerateResponse) -> None:
        self.finish_reason = FINISH_REASONS.get(msg.finish_reason, "stop")
        self.prompt_tokens = msg.usage.prompt_tokens
        self.completion_tokens = msg.usage.completion_tokens


class Generations:
    def __init__(
        self, stub: pb_grpc.InferenceStub, requests: list[pb.GenerateRequest], metadata: Metadata
    ) -> None:
        self._calls = [stub.Generate(r, metadata=metadata) for r in requests]
        self._firsts: list[pb.GenerateResponse] | None = None
        self._finished: set[int] = set()  # calls whose finish reason has arrived

    def __len__(self) -> int:
        return len(self._calls)

    def cancel(self) -> None:
        """End the calls still generating (those whose finish reason has not arrived)."""
        for i, call in enumerate(self._calls):
            if i not in self._finished and not call.done():
                call.cancel()

    async def first(self) -> list[pb.GenerateResponse]:
        """Every call's first message. A call that fails raises its grpc.RpcError here, before
        anything is sent to the client, so that its status becomes the HTTP status."""
        if self._firsts is None:
            if len(self._calls) == 1:  # the common case: awaited here, no task per call
                self._firsts = [await self._read(0)]
            else:
                self._firsts = list(
                    await asyncio.gather(*(self._read(i) for i in range(len(self._calls))))
                )
        return self._firsts

    async def messages(self) -> AsyncIterator[tuple[int, pb.GenerateResponse]]:
        """(choice index, message) of every call as they arrive, first messages included."""
        firsts = await self.first()
        for i, msg in enumerate(firsts):
            yield i, msg
        live = [i for i, msg in enumerate(firsts) if not msg.finish_reason]
        if len(live) == 1:  # the common case: no task per message
            i = live[0]
            while True:
                msg = await self._read(i)
                yield i, msg
                if msg.finish_reason:
                    return
        reads = {asyncio.ensure_future(self._read(i)): i for i in live}
        try:
            while reads:
                done, _ = await asyncio.wait(reads, return_when=asyncio.FIRST_COMPLETED)
                for task in sorted(done, key=reads.get):
                    i = reads.pop(task)
                    msg = task.result()
                    yield i, msg
                    if not msg.finish_reason:
                        reads[asyncio.ensure_future(self._read(i))] = i
        finally:
            for task in reads:
                task.cancel()

    async def _read(self, i: int) -> pb.GenerateResponse:
        """Call i's next message; a call whose finish reason it carries is done generating."""
        msg = await self._calls[i].read()
        if msg is grpc.aio.EOF:  # the service ends every stream with a finish reason or a status
            raise Unavailable("the inference service ended a generation without finishing it")
        if msg.finish_reason:
            self._finished.add(i)
        return msg

    async def collect(self) -> list[ChoiceResult]:
        results = [ChoiceResult() for _ in self._calls]
        async for i, msg in self.messages():
            results[i].add(msg)
        return results
