"""OpenAI's sampling fields as the inference service's SamplingParams, one per choice.

OpenAI's defaults hold where the engine's differ: temperature 1 (the engine's is greedy),
max_tokens 16 for completions. With a seed, choice i of a prompt (the i-th of its n) gets
seed + i (mod 2**63), so that n choices differ from each other and the same request gives the
same choices again; choice 0 gets the seed itself, as a gRPC request with that seed would.
"""

from __future__ import annotations

from lorafleet.v1 import inference_pb2 as pb
from services.gateway.schemas import MAX_SEED, GenerationFields

DEFAULT_TEMPERATURE = 1.0
COMPLETIONS_MAX_TOKENS = 16


def choice_seed(seed: int | None, index: int) -> int | None:
    return None if seed is None else (seed + index) % (MAX_SEED + 1)


def sampling_params(req: GenerationFields, max_tokens: int, index: int) -> pb.SamplingParams:
    """The SamplingParams of choice ``index`` (within its prompt's n) of ``req``."""
    params = pb.SamplingParams(
        max_new_tokens=max_tokens,
        temperature=DEFAULT_TEMPERATURE if req.temperature is None else req.temperature,
        top_k=req.top_k or 0,
        stop=req.stop_list,
        stop_token_ids=req.stop_token_ids or [],
        ignore_eos=req.ignore_eos,
    )
    if req.top_p is not None:
        params.top_p = req.top_p
    if (alternatives := req.wanted_logprobs) is not None:
        params.logprobs = alternatives
    seed = choice_seed(req.seed, index)
    if seed is not None:
        params.seed = seed
    return params
