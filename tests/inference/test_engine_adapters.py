"""Adding and removing adapters: bytes or a directory, store.peft's validation, per-layer ranks and
scales, layers_to_transform, removal while requests still use the adapter."""

from __future__ import annotations

import json

import pytest

from services.inference.engine.adapter_manager import AdapterState
from services.inference.engine.api import AdapterKey, FinishReason, GenerationRequest
from services.inference.engine.errors import InvalidRequest, UnknownAdapter
from services.inference.engine.sampling_params import SamplingParams
from store.peft import AdapterFormatError, BaseModelMismatch
from tests.inference.engine_harness import Recorder, hf_greedy, make_core, relative_error, run
from tests.inference.models import AdapterSpec

PROMPT = list(range(20, 36))
# Scales differ between layers of one module (folded into B), ranks too; some layers untouched.
PER_LAYER = AdapterSpec(
    rank=8,
    lora_alpha=16,
    target_modules=("q_proj", "o_proj", "up_proj"),
    rank_pattern=(("model.layers.2.self_attn.o_proj", 2),),
    alpha_pattern=(("model.layers.1.self_attn.q_proj", 4.0),),
    seed=6,
)
SOME_LAYERS = AdapterSpec(
    rank=4, target_modules=("v_proj", "down_proj"), layers_to_transform=(0, 2), seed=5
)


def _req(rid, adapter, new=8):
    return GenerationRequest(
        rid, prompt_token_ids=PROMPT, adapter=adapter, sampling=SamplingParams(new, ignore_eos=True)
    )


def _files(path):
    return (path / "adapter_config.json").read_bytes(), (
        path / "adapter_model.safetensors"
    ).read_bytes()


@pytest.mark.parametrize("spec", [PER_LAYER, SOME_LAYERS], ids=["per-layer", "some-layers"])
def test_per_layer_adapters_match_peft(tiny_models, spec):
    model_dir = tiny_models.model("tiny-llama")
    adapter_dir = tiny_models.adapter("tiny-llama", spec)
    recorder = Recorder()
    core = make_core(model_dir, recorder)
    key = AdapterKey("a", 1)
    core.add_adapter_dir(key, adapter_dir)
    got = run(core, {0: [_req("x", key), _req("base", None)]}, recorder)["x"]
    want, logits = hf_greedy(model_dir, adapter_dir, PROMPT, 8)
    assert got.token_ids == want
    assert max(relative_error(g, w) for g, w in zip(got.logits, logits, strict=True)) <= 1e-4


def test_bytes_memoryview_and_directory_give_the_same_adapter(tiny_models):
    adapter_dir = tiny_models.adapter("tiny-llama", "r16")
    config, weights = _files(adapter_dir)
    core = make_core(tiny_models.model("tiny-llama"))
    keys = [
        AdapterKey("dir", 1),
        AdapterKey("bytes", 1),
        AdapterKey("view", 1),
        AdapterKey("dict", 1),
    ]
    core.add_adapter_dir(keys[0], adapter_dir)
    core.add_adapter(keys[1], config, weights)
    core.add_adapter(keys[2], config.decode(), memoryview(bytearray(weights)))
    core.add_adapter(keys[3], json.loads(config), weights)
    results = run(core, {0: [_req(k.adapter_id, k) for k in keys]})
    tokens = {tuple(r.token_ids) for r in results.values()}
    assert len(tokens) == 1


def test_invalid_adapters_are_rejected_with_the_reason(tiny_models):
    core = make_core(tiny_models.model("tiny-llama"), max_lora_rank=16)
    config, weights = _files(tiny_models.adapter("tiny-llama", "r8"))
    cfg = json.loads(config)

    def add(c, w=weights):
        core.add_adapter(AdapterKey("bad", 1), json.dumps(c), w)

    with pytest.raises(BaseModelMismatch, match="no weights for: layer 2"):
        core.add_adapter_dir(AdapterKey("qwen", 1), tiny_models.adapter("tiny-qwen2", "r8"))
    with pytest.raises(AdapterFormatError, match="DoRA"):
        add(cfg | {"use_dora": True})
    with pytest.raises(AdapterFormatError, match="modules_to_save"):
        add(cfg | {"modules_to_save": ["lm_head"]})
    with pytest.raises(AdapterFormatError, match="lm_head"):
        add(cfg | {"target_modules": ["q_proj", "lm_head"]})
    with pytest.raises(AdapterFormatError, match="bias"):
        add(cfg | {"bias": "all"})
    with pytest.raises(AdapterFormatError, match="accepts ranks up to 16"):
        core.add_adapter_dir(AdapterKey("r32", 1), tiny_models.adapter("tiny-llama", "r32"))
    with pytest.raises(AdapterFormatError, match="rank"):
        add(cfg | {"r": 4})  # the tensors are rank 8
    with pytest.raises(AdapterFormatError):
        add(cfg, weights[: len(weights) // 2])  # truncated file
    with pytest.raises(AdapterFormatError, match="bytes; its header describes"):
        add(cfg, weights + b"\0" * 8)
    with pytest.raises(InvalidRequest, match="adapter_config.json is missing"):
        core.add_adapter_dir(AdapterKey("none", 1), tiny_models.root)
    assert core.stats().adapters_host == 0  # nothing half-registered


def test_adapter_too_big_for_the_pool(tiny_models):
    core = make_core(tiny_models.model("tiny-llama"), num_pages=64)
    with pytest.raises(InvalidRequest, match="needs 144 pool pages; the pool has 64"):
        core.add_adapter_dir(AdapterKey("r32", 1), tiny_models.adapter("tiny-llama", "r32"))


def test_status_changes_are_reported_once_and_not_for_a_refused_add(tiny_models):
    """take_changes (what an engine in its own process reports) names an added, loaded or
    removed adapter once, and nothing for an add refused as a duplicate."""
    core = make_core(tiny_models.model("tiny-llama"))
    core.adapters.track_changes()
    key = AdapterKey("r4", 1)
    core.add_adapter_dir(key, tiny_models.adapter("tiny-llama", "r4"))
    assert list(core.adapters.take_changes()) == [key]
    assert core.adapters.take_changes() == {}
    with pytest.raises(InvalidRequest, match="already loaded"):
        core.add_adapter_dir(key, tiny_models.adapter("tiny-llama", "r4"))
    assert core.adapters.take_changes() == {}
    core.remove_adapter(key)
    assert core.adapters.take_changes() == {key: None}


def test_remove_adapter_lets_running_requests_finish(tiny_models):
    core = make_core(tiny_models.model("tiny-llama"))
    key = AdapterKey("r4", 1)
    core.add_adapter_dir(key, tiny_models.adapter("tiny-llama", "r4"))
    with pytest.raises(InvalidRequest, match="already loaded"):
        core.add_adapter_dir(key, tiny_models.adapter("tiny-llama", "r4"))
    core.add_request(_req("a", key, new=6))
    core.step()
    assert core.adapters.state(key) is AdapterState.IN_POOL
    core.remove_adapter(key)
    with pytest.raises(UnknownAdapter, match="r4"):
        core.add_request(_req("b", key))
    with pytest.raises(UnknownAdapter):
        core.remove_adapter(key)
    recorder = Recorder()
    while core.has_work:
        recorder.take(core.step())
    assert recorder.results["a"].finish_reason is FinishReason.LENGTH
    assert len(recorder.results["a"].token_ids) == 5  # and one from the first step
    core.step()  # reaps the removed adapter
    stats = core.stats()
    assert stats.free_pages == stats.num_pages and stats.adapters_in_pool == 0
    core.add_adapter_dir(key, tiny_models.adapter("tiny-llama", "r4"))  # the key is free again
    core.check_integrity()


def test_index_row_limit_cycles_adapters(tiny_models):
    """More adapters than LoRA index rows: idle ones give their row to the next."""
    core = make_core(tiny_models.model("tiny-llama"), max_loras=2)
    names = ["r4", "r8", "r16"]
    for name in names:
        core.add_adapter_dir(AdapterKey(name, 1), tiny_models.adapter("tiny-llama", name))
    results = run(core, {0: [_req(n, AdapterKey(n, 1), new=4) for n in names]})
    assert core.stats().adapter_evictions >= 1
    for name in names:
        want, _ = hf_greedy(
            tiny_models.model("tiny-llama"), tiny_models.adapter("tiny-llama", name), PROMPT, 4
        )
        assert results[name].token_ids == want


def test_step_log_counts_each_steps_adapters_and_their_bytes(tiny_models):
    """Every step record names its distinct adapters and their weight bytes (the serving
    benchmark's roofline counts them), once however many of the step's sequences share one."""
    model_dir = tiny_models.model("tiny-llama")
    recorder = Recorder()
    core = make_core(model_dir, recorder)
    a, b = AdapterKey("a", 1), AdapterKey("b", 1)
    ha = core.add_adapter_dir(a, tiny_models.adapter("tiny-llama", PER_LAYER))
    hb = core.add_adapter_dir(b, tiny_models.adapter("tiny-llama", SOME_LAYERS))
    reqs = [_req("a1", a), _req("a2", a), _req("b1", b), _req("base", None)]
    run(core, {0: reqs}, recorder)
    records = list(core.step_log.recent)
    assert records and all(r.seqs == 4 for r in records)  # the four run together throughout
    assert {(r.adapters, r.adapter_bytes) for r in records} == {(2, ha.nbytes + hb.nbytes)}
    assert ha.nbytes > 0 and hb.nbytes > 0
