"""The reference the service's outputs are compared with: the engine running each request alone
(one request in the batch from its first step to its last), in this process."""

from __future__ import annotations

import random
from functools import cache
from pathlib import Path
from typing import NamedTuple

import grpc
import torch

from lorafleet.v1 import inference_pb2 as pb
from services.inference.convert import sampling_params
from services.inference.engine.api import AdapterKey, FinishReason, GenerationRequest
from services.inference.engine.config import EngineConfig
from services.inference.engine.core import EngineCore
from services.inference.engine.limits import RequestLimits

FINISH = {
    FinishReason.LENGTH: pb.FINISH_REASON_LENGTH,
    FinishReason.STOP: pb.FINISH_REASON_STOP,
    FinishReason.EOS: pb.FINISH_REASON_EOS,
}


PROMPTS = [
    "The quick brown fox",
    "def fibonacci(n):",
    "Héllo wörld, ça va? 日本語のテキスト",
    "Once upon a time, in a land far away, there lived a programmer who loved tiny models.",
    "a",
]


class Expected(NamedTuple):
    token_ids: tuple[int, ...]
    text: str
    finish_reason: int  # pb.FinishReason
    prompt_tokens: int


class Reference:
    def __init__(self, model_dir: Path, adapters: dict[AdapterKey, Path]) -> None:
        self.core = EngineCore(EngineConfig(model_dir=model_dir, device="cpu", max_loras=4))
        for key, path in adapters.items():
            self.core.add_adapter_dir(key, path)
        self.run = cache(self._run)

    def expect(self, request: pb.GenerateRequest, version: int | None = None) -> Expected:
        """What the engine alone produces for ``request`` (adapter version: the one given,
        else the request's own)."""
        key = None
        if request.adapter_id:
            key = AdapterKey(request.adapter_id, version or request.adapter_version)
        prompt = request.prompt or None
        ids = tuple(request.prompt_token_ids) or None
        return self.run(prompt, ids, key, request.sampling.SerializeToString())

    def _run(self, prompt, ids, key, sampling_bytes: bytes) -> Expected:
        sampling = sampling_params(pb.SamplingParams.FromString(sampling_bytes), RequestLimits())
        self.core.add_request(GenerationRequest("alone", prompt, ids, key, sampling))
        tokens: list[int] = []
        text = ""
        reason = None
        prompt_tokens = 0
        # One thread, as the service processes run (stack.py): on a busy machine, intra-op
        # threads of tiny matmuls mostly wait for each other.
        threads = torch.get_num_threads()
        torch.set_num_threads(1)
        try:
            while self.core.has_work:
                for out in self.core.step():
                    tokens += out.token_ids
                    text += out.text
                    reason, prompt_tokens = out.finish_reason, out.prompt_tokens
        finally:
            torch.set_num_threads(threads)
        return Expected(tuple(tokens), text, FINISH[reason], prompt_tokens)


def mixed_requests(n: int, seed: int = 0) -> list[pb.GenerateRequest]:
    rng = random.Random(seed)
    out = []
    for i in range(n):
        adapter = ["", "a", "b", "c"][i % 4]
        if i % 3 == 2:  # seeded sampling: independent of what else is in the batch
            params = pb.SamplingParams(
                max_new_tokens=rng.randint(4, 16), temperature=0.8, top_p=0.9, top_k=50,
                seed=1000 + i,
            )  # fmt: skip
        else:
            params = pb.SamplingParams(max_new_tokens=rng.randint(4, 16))
        request = pb.GenerateRequest(request_id=f"mix-{i}", adapter_id=adapter, sampling=params)
        if i % 5 == 4:
            request.prompt_token_ids.extend(
                rng.randrange(3, 500) for _ in range(rng.randint(1, 40))
            )
        else:
            request.prompt = PROMPTS[i % len(PROMPTS)]
        out.append(request)
    return out


def assert_matches(stream, expected, request):
    assert stream.code == grpc.StatusCode.OK, (request.request_id, stream.code, stream.details)
    assert tuple(stream.token_ids) == expected.token_ids, request.request_id
    assert stream.text == expected.text, request.request_id
    last = stream.last
    assert last.finish_reason == expected.finish_reason
    assert last.usage.completion_tokens == len(expected.token_ids)
    assert last.usage.prompt_tokens == expected.prompt_tokens
    assert all(m.finish_reason == pb.FINISH_REASON_UNSPECIFIED for m in stream.messages[:-1])
    ids = {m.request_id for m in stream.messages}
    assert len(ids) == 1 and ids.pop() == (request.request_id or stream.last.request_id)
