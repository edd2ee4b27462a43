"""Parity with transformers + peft: one engine run mixes the base model and four adapters, prompts
of different lengths, and requests that arrive while others decode; every greedy token equals
what HF produces for that request alone and the logits agree within 1e-4 relative (float32)."""

from __future__ import annotations

import pytest
import torch

from kernels import lora_paths
from services.inference.engine import model_runner
from services.inference.engine.api import AdapterKey, GenerationRequest
from services.inference.engine.model_runner import ADDEND_MODES, SIDE_STREAM_MAX_TOKENS, LoraMode
from services.inference.engine.sampling_params import SamplingParams
from tests.inference.engine_harness import Recorder, hf_greedy, make_core, relative_error, run
from tests.inference.models import PARITY_ADAPTERS

LOGITS_RTOL = 1e-4
# (adapter name or None, prompt length, max_new_tokens, step it arrives before)
PLAN = [
    (None, 3, 8, 0),
    ("r4", 12, 7, 0),
    ("r8", 7, 9, 0),
    ("r16", 17, 6, 0),
    ("r32", 25, 8, 2),
    (None, 40, 6, 2),  # longer than the step's token budget left: prefilled in chunks
    ("r4", 5, 10, 4),
    ("r8", 30, 6, 4),
    ("r16", 9, 8, 7),
    ("r32", 14, 7, 7),
]


def _requests(vocab: int) -> list[tuple[GenerationRequest, str | None]]:
    gen = torch.Generator().manual_seed(1234)
    out = []
    for i, (name, length, new, _) in enumerate(PLAN):
        prompt = torch.randint(3, vocab, (length,), generator=gen).tolist()
        req = GenerationRequest(
            request_id=f"req{i}-{name or 'base'}",
            prompt_token_ids=prompt,
            adapter=None if name is None else AdapterKey(name, 1),
            sampling=SamplingParams(max_new_tokens=new, ignore_eos=True),
        )
        out.append((req, name))
    return out


def plan_arrivals(requests) -> dict[int, list[GenerationRequest]]:
    """PLAN's arrival step of each of _requests(): the harness's arrivals."""
    arrivals: dict[int, list[GenerationRequest]] = {}
    for (req, _), (*_, at) in zip(requests, PLAN, strict=True):
        arrivals.setdefault(at, []).append(req)
    return arrivals


def assert_matches_hf(tiny_models, preset, model_dir, requests, results) -> None:
    """Every request's tokens equal transformers + peft's alone, its logits within LOGITS_RTOL
    at every step (a logit row per generated token)."""
    for req, name in requests:
        adapter_dir = None if name is None else tiny_models.adapter(preset, name)
        n = req.sampling.max_new_tokens
        want_tokens, want_logits = hf_greedy(model_dir, adapter_dir, req.prompt_token_ids, n)
        got = results[req.request_id]
        assert got.token_ids == want_tokens, req.request_id
        for step, (g, w) in enumerate(zip(got.logits, want_logits, strict=True)):
            err = relative_error(g.cpu(), w)
            assert err <= LOGITS_RTOL, f"{req.request_id} step {step}: relative error {err:.2e}"


@pytest.mark.parametrize(
    "preset, overlap, side_stream",
    [
        ("tiny-llama", False, False),
        ("tiny-qwen2", False, False),
        ("tiny-llama", True, False),
        ("tiny-qwen2", False, True),
    ],
    ids=["tiny-llama", "tiny-qwen2", "tiny-llama-overlapped", "tiny-qwen2-lora-beside"],
)
def test_mixed_batch_matches_hf_peft(tiny_models, preset, overlap, side_stream):
    """``side_stream``: the LoRA deltas of every step of up to SIDE_STREAM_MAX_TOKENS tokens go
    through the engine's delta buffer (LoraContext.beside: on the CPU, computed before each
    GEMM), q/k/v biases included; larger steps add theirs in place."""
    model_dir = tiny_models.model(preset)
    recorder = Recorder()
    core = make_core(model_dir, recorder, max_num_batched_tokens=48, lora_side_stream=side_stream)
    beside = []  # per step with LoRA calls: its tokens, whether its deltas went through the buffer
    lora_for = core.runner._lora_for

    def spy_lora(mode, modules):
        lora = lora_for(mode, modules)
        if lora is not None:
            beside.append((core.runner.batch.num_tokens, lora.beside))
        return lora

    core.runner._lora_for = spy_lora
    for name in PARITY_ADAPTERS:
        core.add_adapter_dir(AdapterKey(name, 1), tiny_models.adapter(preset, name))

    steps = []  # (number of tokens, LoRA row, samples) per sequence, per step
    execute = core.runner.execute

    def spy(entries):
        steps.append([(len(e.token_ids), e.lora_row, e.sample) for e in entries])
        return execute(entries)

    core.runner.execute = spy
    requests = _requests(core.model_config.vocab_size)
    arrivals = plan_arrivals(requests)
    results = run(core, arrivals, recorder, overlap=overlap)

    # The run really mixed things: one step holds prefill and decode tokens of the base model
    # and several adapters, and the long prompt was prefilled over more than one step.
    assert any(
        len({row for _, row, _ in s}) >= 3
        and None in {row for _, row, _ in s}
        and any(n > 1 for n, _, _ in s)
        and any(n == 1 for n, _, _ in s)
        for s in steps
    )
    assert any(not samples for s in steps for _, _, samples in s)
    # Segments are contiguous: rows are sorted within every step.
    for s in steps:
        rows = [-1 if row is None else row for _, row, _ in s]
        assert rows == sorted(rows)

    assert_matches_hf(tiny_models, preset, model_dir, requests, results)
    assert all(b == (side_stream and n <= SIDE_STREAM_MAX_TOKENS) for n, b in beside)
    assert any(n <= SIDE_STREAM_MAX_TOKENS for n, _ in beside)  # both kinds of step ran
    assert any(n > SIDE_STREAM_MAX_TOKENS for n, _ in beside)
    core.check_integrity()
    assert core.stats().kv_pages == 0


@pytest.mark.parametrize("preset", ["tiny-llama", "tiny-qwen2"])
def test_addend_steps_match_hf_peft(tiny_models, monkeypatch, preset):
    """With lora_addend, the steps whose calls are all fused (NARROW: every adapter within 16
    rank rows; WIDE_FUSED: the rank-32 adapter among several; the decode steps' FUSED and
    ONE_TOKEN) write their LoRA deltas first and the base GEMMs add onto them, q/k/v biases
    after the deltas; the thresholds lowered so that the parity run's mixed steps count as
    prefill-sized, its decode steps of a few distinct adapters fuse, and steps of 4 tokens or
    more take the addend. Every request against HF + PEFT, and only those steps take it."""
    monkeypatch.setattr(lora_paths, "FUSED_MAX_TOKENS", 16)
    monkeypatch.setattr(lora_paths, "FUSED_SINGLE_SLICE_MIN_ROWS", 16)
    monkeypatch.setattr(lora_paths, "WIDE_FUSED_MIN_ADAPTERS", 2)
    monkeypatch.setattr(lora_paths, "FUSED_DECODE_MIN_ROWS", 32)
    monkeypatch.setattr(model_runner, "ADDEND_MIN_TOKENS", 4)
    model_dir = tiny_models.model(preset)
    recorder = Recorder()
    core = make_core(model_dir, recorder, max_num_batched_tokens=48, max_lora_rank=64,
                     lora_addend=True)  # fmt: skip
    seen = []  # per step with LoRA calls: its mode, tokens, whether they took the addend
    lora_for = core.runner._lora_for

    def spy(mode, modules):
        lora = lora_for(mode, modules)
        if lora is not None:
            seen.append((mode, core.runner.batch.num_tokens, lora.addend, lora.beside))
        return lora

    core.runner._lora_for = spy
    for name in PARITY_ADAPTERS:
        core.add_adapter_dir(AdapterKey(name, 1), tiny_models.adapter(preset, name))
    requests = _requests(core.model_config.vocab_size)
    results = run(core, plan_arrivals(requests), recorder)
    assert_matches_hf(tiny_models, preset, model_dir, requests, results)
    assert all(addend == (mode in ADDEND_MODES and n >= 4) for mode, n, addend, _ in seen)
    took = {mode for mode, _, addend, _ in seen if addend}
    assert {LoraMode.NARROW, LoraMode.WIDE_FUSED} <= took
    assert took & {LoraMode.FUSED, LoraMode.ONE_TOKEN}  # decode steps too
    assert any(not addend for *_, addend, _ in seen)  # the others kept the in-place add
    assert not any(addend and beside for *_, addend, beside in seen)
    core.check_integrity()
    assert core.stats().kv_pages == 0


def test_adapters_change_outputs(tiny_models):
    """Guards the parity test: with these adapters the outputs differ from the base model's."""
    model_dir = tiny_models.model("tiny-llama")
    prompt = list(range(10, 22))
    base, _ = hf_greedy(model_dir, None, prompt, 8)
    for name in PARITY_ADAPTERS:
        tuned, _ = hf_greedy(model_dir, tiny_models.adapter("tiny-llama", name), prompt, 8)
        assert tuned != base, name


def test_mistral_and_sharded_checkpoints(tiny_models):
    """MistralForCausalLM, and a Qwen2 checkpoint split into shards with an index."""
    for preset, shards in (("tiny-mistral", 1), ("tiny-qwen2", 3)):
        model_dir = tiny_models.model(preset, shards=shards)
        assert (shards > 1) == (model_dir / "model.safetensors.index.json").is_file()
        core = make_core(model_dir, Recorder())
        prompt = list(range(5, 20))
        req = GenerationRequest(
            "r", prompt_token_ids=prompt, sampling=SamplingParams(8, ignore_eos=True)
        )
        results = run(core, {0: [req]})
        want, _ = hf_greedy(model_dir, None, prompt, 8)
        assert results["r"].token_ids == want, preset
