"""Generations: which of a request's Generate calls cancel() ends (services/gateway/generation.py).

The calls are stand-ins that replay scripted messages, as grpc.aio's UnaryStreamCall hands them
out (read(), done(), cancel()); the real calls are exercised through the services in
test_gateway_openai.py and test_gateway_lifecycle.py."""

from __future__ import annotations

from lorafleet.v1 import inference_pb2 as pb
from services.gateway.generation import Generations


class _Call:
    def __init__(self, messages: list[pb.GenerateResponse]) -> None:
        self._messages = list(messages)
        self.cancelled = False

    async def read(self):
        return self._messages.pop(0)

    def done(self) -> bool:
        return False  # the status has not arrived yet, as right after the last message

    def cancel(self) -> bool:
        self.cancelled = True
        return True


class _Stub:
    def __init__(self, scripts: list[list[pb.GenerateResponse]]) -> None:
        self.calls = [_Call(s) for s in scripts]

    def Generate(self, request, metadata=None):  # noqa: N802 (the gRPC method's name)
        return self.calls[int(request.request_id)]


def _msg(text: str, finish: int = 0) -> pb.GenerateResponse:
    return pb.GenerateResponse(text=text, finish_reason=finish)


async def test_cancel_ends_only_the_calls_still_generating():
    done = pb.FINISH_REASON_LENGTH
    stub = _Stub([[_msg("a"), _msg("b", done)], [_msg("c", done)], [_msg("d"), _msg("e")]])
    gens = Generations(stub, [pb.GenerateRequest(request_id=str(i)) for i in range(3)], [])
    seen = []
    async for i, msg in gens.messages():
        seen.append((i, msg.text))
        if len(seen) == 4:  # calls 0 and 1 have finished, call 2 has sent one message
            break
    assert (0, "b") in seen and (1, "c") in seen and (2, "d") in seen
    gens.cancel()
    assert [c.cancelled for c in stub.calls] == [False, False, True]


async def test_a_single_finished_call_is_not_cancelled():
    stub = _Stub([[_msg("x"), _msg("y", pb.FINISH_REASON_STOP)]])
    gens = Generations(stub, [pb.GenerateRequest(request_id="0")], [])
    results = await gens.collect()
    assert results[0].text == "xy" and results[0].finish_reason == "stop"
    gens.cancel()
    assert not stub.calls[0].cancelled
    unfinished = _Stub([[_msg("x"), _msg("y")]])
    gens = Generations(unfinished, [pb.GenerateRequest(request_id="0")], [])
    await gens.first()
    gens.cancel()  # a client that left before the end: its call is ended
    assert unfinished.calls[0].cancelled
