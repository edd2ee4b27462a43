"""Failures inside a step stay with their request: non-finite logits (an adapter whose finite
weights overflow), a detokenizer that fails; every other request in the batch goes on with the
output it would have had alone, and the engine keeps serving."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from services.inference.engine.api import AdapterKey, FinishReason, GenerationRequest
from services.inference.engine.errors import RequestFailed
from services.inference.engine.sampler import Sampler, make_generator
from services.inference.engine.sampling_params import SamplingParams
from tests.inference.engine_harness import Recorder, make_core, run

GOOD, HUGE = AdapterKey("good", 1), AdapterKey("huge", 1)


def overflowing_adapter(source: Path, out: Path, factor: float = 1e30) -> Path:
    """``source``'s adapter with every weight times ``factor``, in float32: each value finite
    (the store and the fetch worker accept it), their products far beyond float32's range."""
    out.mkdir(parents=True, exist_ok=True)
    shutil.copy(source / "adapter_config.json", out / "adapter_config.json")
    tensors = load_file(source / "adapter_model.safetensors")
    save_file(
        {name: t.float() * factor for name, t in tensors.items()},
        out / "adapter_model.safetensors",
    )
    return out


def _request(rid, adapter=None, n=12, **sampling):
    params = SamplingParams(max_new_tokens=n, ignore_eos=True, **sampling)
    return GenerationRequest(rid, prompt_token_ids=list(range(20, 36)), adapter=adapter,
                             sampling=params)  # fmt: skip


@pytest.fixture
def core(tiny_models, tmp_path):
    core = make_core(tiny_models.model("tiny-llama"))
    good = tiny_models.adapter("tiny-llama", "r8")
    core.add_adapter_dir(GOOD, good)
    core.add_adapter_dir(HUGE, overflowing_adapter(good, tmp_path / "huge"))
    return core


def test_sampler_never_raises_on_non_finite_logits():
    logits = torch.randn(6, 40)
    logits[1] = float("nan")
    logits[2, 5] = float("inf")
    logits[3] = float("-inf")
    logits[4, :3] = float("nan")
    params = [SamplingParams(temperature=t, top_p=0.9, seed=i) for i, t in enumerate([0.7] * 5)]
    params.append(SamplingParams())  # greedy
    tokens = Sampler()(logits, params, [make_generator(p, "cpu") for p in params])
    assert tokens.shape == (6,) and bool(((tokens >= 0) & (tokens < 40)).all())
    # A finite row next to them samples as it would alone.
    alone = Sampler()(logits[:1], params[:1], [make_generator(params[0], "cpu")])
    assert int(tokens[0]) == int(alone[0])


def test_a_tiny_temperature_does_not_overflow_finite_logits():
    logits = torch.randn(4, 40) * 50
    params = [SamplingParams(temperature=1e-38, seed=i) for i in range(4)]
    tokens = Sampler()(logits, params, [make_generator(p, "cpu") for p in params])
    assert torch.equal(tokens, logits.argmax(-1))


@pytest.mark.parametrize("temperature", [0.0, 0.8])
def test_non_finite_logits_fail_only_their_request(core, temperature):
    sampled = dict(temperature=temperature, seed=3) if temperature else {}
    healthy = [_request("base", **sampled), _request("good", GOOD, **sampled)]
    alone = {}
    for request in healthy:
        alone.update(run(core, {0: [request]}))
    recorder = Recorder()
    results = run(core, {0: healthy[:1], 2: [_request("bad", HUGE, **sampled)], 3: healthy[1:]},
                  recorder)  # fmt: skip
    failures = dict(core.take_step_failures())
    assert set(failures) == {"bad"}
    assert isinstance(failures["bad"], RequestFailed)
    assert "its adapter produced logits that are not finite" in str(failures["bad"])
    for request in healthy:
        got, want = results[request.request_id], alone[request.request_id]
        assert got.token_ids == want.token_ids and got.finish_reason is FinishReason.LENGTH
    assert "bad" not in results  # no output reached it: only the error
    core.check_integrity()
    assert not core.has_work and core.stats().kv_pages == 0
    # The engine serves the adapter's neighbours, and the bad adapter fails the same way again.
    again = run(core, {0: [_request("again", GOOD, **sampled)]})["again"]
    assert again.token_ids == alone["good"].token_ids
    run(core, {0: [_request("bad2", HUGE, **sampled)]})
    assert [rid for rid, _ in core.take_step_failures()] == ["bad2"]


class _FailingDetokenizer:
    """Stands in for a detokenizer that raises on its third token (a bug, or bad input)."""

    def __init__(self, inner) -> None:
        self.inner, self.calls = inner, 0

    def add(self, token_id: int) -> str:
        self.calls += 1
        if self.calls == 3:
            raise UnicodeDecodeError("utf-8", b"\xff", 0, 1, "invalid start byte")
        return self.inner.add(token_id)

    def flush(self) -> str:
        return self.inner.flush()


def test_a_failing_detokenizer_fails_only_its_request(core):
    alone = run(core, {0: [_request("ok")]})
    core.add_request(_request("ok"))
    seq = core.prepare(_request("broken"))
    seq.detokenizer = _FailingDetokenizer(seq.detokenizer)
    core.enqueue(seq)
    results = run(core, {})
    failures = dict(core.take_step_failures())
    assert list(failures) == ["broken"]
    assert "UnicodeDecodeError" in str(failures["broken"])
    assert results["ok"].token_ids == alone["ok"].token_ids
    assert len(results["broken"].token_ids) == 2  # the tokens before the failure streamed
    core.check_integrity()
    assert core.stats().kv_pages == 0


def test_a_forward_pass_that_fails_on_one_request_fails_only_that_request(core):
    """A token id the embedding cannot look up (it passed prepare's checks and was damaged
    after them): the step's forward pass raises; run one by one, only that request fails."""
    healthy = [_request("base"), _request("good", GOOD)]
    alone = {}
    for request in healthy:
        alone.update(run(core, {0: [request]}))
    for request in healthy:
        core.add_request(request)
    seq = core.prepare(_request("damaged"))
    seq.prompt_ids[3] = core.model_config.vocab_size + 7
    core.enqueue(seq)
    results = run(core, {})
    failures = dict(core.take_step_failures())
    assert list(failures) == ["damaged"]
    assert "the model failed on its data (IndexError" in str(failures["damaged"])
    for request in healthy:
        assert results[request.request_id].token_ids == alone[request.request_id].token_ids
    core.check_integrity()
    assert core.stats().kv_pages == 0


def test_a_step_that_fails_for_every_request_again_and_again_is_the_engines_fault(core):
    """Steps in a row in which every request fails alone: the first two fail their requests,
    the third raises (the engine stops, and the service with it, for a supervisor to restart);
    a step that runs in between resets the count."""

    def damaged(rid: str) -> None:
        seq = core.prepare(_request(rid))
        seq.prompt_ids[0] = -1
        core.enqueue(seq)

    damaged("d0")
    damaged("d1")
    core.step()
    assert [rid for rid, _ in core.take_step_failures()] == ["d0", "d1"]
    run(core, {0: [_request("fine", n=2)]})
    for rid in ("d2", "d3"):
        damaged(rid)
        core.step()
    assert [rid for rid, _ in core.take_step_failures()] == ["d2", "d3"]
    damaged("d4")
    with pytest.raises(IndexError):
        core.step()
