"""EngineCore.prepare bounds every per-request input before work proportional to it (the second
line behind the service's own checks), and checks a long prompt's ids at C speed."""

from __future__ import annotations

import time

import pytest

from services.inference.engine.api import GenerationRequest
from services.inference.engine.errors import InvalidRequest
from services.inference.engine.limits import RequestLimits
from services.inference.engine.sampling_params import SamplingParams
from tests.inference.engine_harness import make_core

LIMITS = RequestLimits(
    max_request_id_chars=8, max_prompt_bytes=64, max_prompt_tokens=32, max_stop_strings=2,
    max_stop_string_chars=5, max_stop_token_ids=3,
)  # fmt: skip


@pytest.fixture(scope="module")
def core(tiny_models):
    return make_core(tiny_models.model("tiny-llama"), limits=LIMITS)


@pytest.mark.parametrize(
    ("request_", "message"),
    [
        (GenerationRequest("r" * 9, prompt="hi"), "request_id is 9 characters; at most 8"),
        (GenerationRequest("r", prompt="x" * 65), "over 64 bytes of UTF-8"),
        (GenerationRequest("r", prompt="é" * 33), "over 64 bytes of UTF-8"),  # 66 bytes
        (GenerationRequest("r", prompt_token_ids=[5] * 33), "33 tokens; at most 32"),
        (GenerationRequest("r", prompt="q7z!" * 15), "tokens; at most 32"),  # 60 bytes
        (GenerationRequest("r", prompt="hi", sampling=SamplingParams(stop=("a", "b", "c"))),
         "3 stop strings; at most 2"),
        (GenerationRequest("r", prompt="hi", sampling=SamplingParams(stop=("abcdef",))),
         "stop string of 6 characters"),
        (GenerationRequest("r", prompt="hi", sampling=SamplingParams(stop_token_ids=(1,) * 4)),
         "4 stop_token_ids; at most 3"),
    ],
)  # fmt: skip
def test_prepare_refuses_inputs_over_their_limits(core, request_, message):
    with pytest.raises(InvalidRequest, match=message):
        core.prepare(request_)


def test_the_context_window_is_checked_before_the_ids(tiny_models):
    core = make_core(tiny_models.model("tiny-llama"))
    ids = [1] * 100_000 + [10**9]  # over the window, and one id outside the vocabulary
    with pytest.raises(InvalidRequest, match="exceed the context window"):
        core.prepare(GenerationRequest("long", prompt_token_ids=ids))
    ids = [3] * (core.max_len - 16)
    start = time.perf_counter()
    core.prepare(GenerationRequest("fits", prompt_token_ids=ids))
    assert time.perf_counter() - start < 0.5
    with pytest.raises(InvalidRequest, match="prompt token 5 is True, outside the vocabulary"):
        core.prepare(GenerationRequest("bool", prompt_token_ids=[3] * 5 + [True]))
