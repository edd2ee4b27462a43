"""Helpers for the engine tests: drive EngineCore step by step, and the HF + PEFT reference.

Driving the synchronous core directly makes arrival times exact ("request C arrives after step
3, while A and B decode"), so the tests are deterministic.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from functools import cache
from pathlib import Path

import torch

from services.inference.engine.api import FinishReason, GenerationRequest
from services.inference.engine.config import EngineConfig
from services.inference.engine.core import EngineCore


@dataclass
class Result:
    token_ids: list[int] = field(default_factory=list)
    text: str = ""
    finish_reason: FinishReason | None = None
    logits: list[torch.Tensor] = field(default_factory=list)  # one row per sampled token
    logprobs: list = field(default_factory=list)  # TokenLogprob per token, when asked
    updates: int = 0


class Recorder:
    """The core's logits hook plus the outputs, per request."""

    def __init__(self) -> None:
        self.results: dict[str, Result] = {}

    def hook(self, request_id: str, logits: torch.Tensor) -> None:
        self.results.setdefault(request_id, Result()).logits.append(logits.clone())

    def take(self, outputs) -> None:
        for out in outputs:
            r = self.results.setdefault(out.request_id, Result())
            assert r.finish_reason is None, f"{out.request_id} got an update after finishing"
            r.token_ids.extend(out.token_ids)
            r.logprobs.extend(out.logprobs)
            r.text += out.text
            r.finish_reason = out.finish_reason
            r.updates += 1


def make_core(model_dir: Path, recorder: Recorder | None = None, **overrides) -> EngineCore:
    cfg = dict(device="cpu", page_size=4, num_pages=1024, max_num_seqs=16, max_loras=8)
    cfg.update(overrides)
    return EngineCore(
        EngineConfig(model_dir=model_dir, **cfg), None if recorder is None else recorder.hook
    )


def run(
    core: EngineCore,
    arrivals: Mapping[int, Sequence[GenerationRequest]],
    recorder: Recorder | None = None,
    after_step: Callable[[EngineCore, int], None] | None = None,
    max_steps: int = 10_000,
    overlap: bool = False,
) -> dict[str, Result]:
    """Add arrivals[k] before step k, then step until everything finished. ``overlap`` drives
    the core as the engine's step loop does: step k + 1 is launched before step k is finished,
    so step k + 1 reads step k's tokens on the device."""
    recorder = recorder or Recorder()
    step = 0
    inflight = None
    while step <= max(arrivals, default=0) or core.has_work or inflight is not None:
        for req in arrivals.get(step, ()):
            core.add_request(req)
        if overlap:
            launched = core.launch()
            if inflight is not None:
                recorder.take(core.finish(inflight))
            inflight = launched
        else:
            recorder.take(core.step())
        if after_step is not None:
            after_step(core, step)
        step += 1
        assert step < max_steps, "the engine did not finish"
    return recorder.results


@cache
def _hf_model(model_dir: str, adapter_dir: str | None):
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    if adapter_dir is not None:
        model = PeftModel.from_pretrained(model, adapter_dir)
    return model.eval()


@torch.no_grad()
def hf_greedy(
    model_dir: Path, adapter_dir: Path | None, prompt: Sequence[int], n: int
) -> tuple[list[int], list[torch.Tensor]]:
    """Greedy tokens and the logits of each step from transformers (+ peft), request alone."""
    model = _hf_model(str(model_dir), None if adapter_dir is None else str(adapter_dir))
    ids = list(prompt)
    logits = []
    for _ in range(n):
        row = model(torch.tensor([ids])).logits[0, -1].float()
        logits.append(row)
        ids.append(int(row.argmax()))
    return ids[len(prompt) :], logits


def relative_error(got: torch.Tensor, want: torch.Tensor) -> float:
    """max |got - want| / max |want|: the logits' relative disagreement."""
    return float((got - want).abs().max() / want.abs().max())
