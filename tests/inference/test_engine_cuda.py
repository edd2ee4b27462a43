"""The engine on a CUDA GPU: the Triton kernels, the side-stream adapter copies and the pool on
the device, against HF transformers + PEFT on the CPU. Collected only where CUDA is available
(tests/inference/conftest.py); its output on the H200 is kept in bench/results/.

float32 must meet the CPU path's 1e-4 bound (the kernels' float32 dots run in IEEE precision).
bfloat16 is checked with teacher forcing: HF in float32 is fed the engine's own tokens, and the
logits must agree within 4e-2 relative (about ten bf16 unit roundoffs over the model's layers).
"""

from __future__ import annotations

import gc

import pytest
import torch

from kernels import lora_paths
from services.inference.engine.adapter_manager import AdapterState
from services.inference.engine.api import AdapterKey, GenerationRequest
from services.inference.engine.model_runner import ATTENTION
from services.inference.engine.sampling_params import SamplingParams
from tests.inference.engine_harness import Recorder, make_core, relative_error, run
from tests.inference.models import PARITY_ADAPTERS
from tests.inference.test_engine_parity import _requests, assert_matches_hf, plan_arrivals

BF16_RTOL = 4e-2


@pytest.fixture(autouse=True)
def _free_the_last_engine():
    """Each test builds an engine and captures hundreds of graphs. On an H100 (80 GB) the 16th
    test of this file failed its capture with CUBLAS_STATUS_INTERNAL_ERROR in three of five runs
    of the whole file, and passed alone and after either half of the tests before it: something
    the earlier tests leave behind accumulates. cuBLAS reports that status when it cannot
    allocate, and blocks in the allocator's cache are memory it cannot use, so between tests
    collect and give the cached blocks back; what the device and the allocator held as each test
    began is printed, so that a failing test's captured output shows whether memory ran short."""
    free, total = torch.cuda.mem_get_info()
    reserved = torch.cuda.memory_reserved()
    print(f"at the test's start: {free / 2**30:.1f} of {total / 2**30:.1f} GiB free on the "
          f"device, {reserved / 2**30:.2f} GiB reserved by the allocator")  # fmt: skip
    yield
    gc.collect()
    torch.cuda.synchronize()
    torch.cuda.empty_cache()


def _mixed_run(tiny_models, preset: str, dtype: str, overlap: bool = False, **overrides):
    model_dir = tiny_models.model(preset)
    recorder = Recorder()
    config = dict(device="cuda", dtype=dtype, max_num_batched_tokens=48, **overrides)
    core = make_core(model_dir, recorder, **config)
    for name in PARITY_ADAPTERS:
        core.add_adapter_dir(AdapterKey(name, 1), tiny_models.adapter(preset, name))
    requests = _requests(core.model_config.vocab_size)
    results = run(core, plan_arrivals(requests), recorder, overlap=overlap)
    # Decode-only and mixed steps replayed captured graphs (padded).
    assert core.runner.graph_sizes and core.runner.mixed_graph_sizes
    records = list(core.step_log.recent)
    assert any(r.graph and r.prefill_tokens == 0 for r in records)
    assert any(r.graph and r.prefill_tokens > 0 and r.tokens > r.prefill_tokens for r in records)
    core.check_integrity()
    stats = core.stats()
    assert stats.kv_pages == 0
    # the device's memory, as GetStats and the metrics report it
    assert 0 < stats.memory.free < stats.memory.total
    assert core.pool.tensor.nbytes < stats.memory.peak_reserved < stats.memory.total
    return model_dir, requests, results, core


# (preset, overlapped scheduling, LoRA deltas on the side stream: EngineConfig.lora_side_stream)
MIXED_RUNS = [
    ("tiny-llama", False, False),
    ("tiny-qwen2", False, False),
    ("tiny-llama", True, False),
    ("tiny-qwen2", True, True),
]
MIXED_IDS = ["tiny-llama", "tiny-qwen2", "tiny-llama-overlapped", "tiny-qwen2-lora-beside"]


@pytest.mark.parametrize("preset, overlap, side_stream", MIXED_RUNS, ids=MIXED_IDS)
def test_cuda_float32_mixed_batch_matches_hf_peft(tiny_models, preset, overlap, side_stream):
    run = _mixed_run(tiny_models, preset, "float32", overlap=overlap, lora_side_stream=side_stream)
    # the rank-32 adapter's steps replayed the graphs of two launches of 32-row programs
    assert any(r.graph and r.lora == "two launches, wide" for r in run[3].step_log.recent)
    assert_matches_hf(tiny_models, preset, *run[:3])


def test_cuda_graphs_match_eager_steps(tiny_models):
    """The same run with CUDA graphs (decode and mixed steps padded) and without: float32
    tokens and logits agree exactly up to rounding of the padded GEMMs."""
    graphs = _mixed_run(tiny_models, "tiny-llama", "float32", overlap=True)[2]
    model_dir = tiny_models.model("tiny-llama")
    recorder = Recorder()
    core = make_core(model_dir, recorder, device="cuda", dtype="float32",
                     max_num_batched_tokens=48, cuda_graphs=False)  # fmt: skip
    for name in PARITY_ADAPTERS:
        core.add_adapter_dir(AdapterKey(name, 1), tiny_models.adapter("tiny-llama", name))
    requests = _requests(core.model_config.vocab_size)
    eager = run(core, plan_arrivals(requests), recorder, overlap=True)
    assert core.runner.graph_steps == 0
    for req, _ in requests:
        g, e = graphs[req.request_id], eager[req.request_id]
        assert g.token_ids == e.token_ids, req.request_id
        for a, b in zip(g.logits, e.logits, strict=True):
            assert relative_error(a.cpu(), b.cpu().double()) <= 1e-5


@pytest.mark.parametrize(
    "single_slice_rows, addend",
    [(32, False), (1 << 20, False), (32, True), (1 << 20, True)],
    ids=["all-fused", "mixed", "all-fused-addend", "mixed-addend"],
)
def test_cuda_fused_decode_path_matches_hf_peft(
    tiny_models, monkeypatch, single_slice_rows, addend
):
    """Decode steps on the fused LoRA kernel (the per-step choice, with the threshold lowered
    so that the parity run's small batches of distinct adapters take it), graphs included;
    "mixed": q/k/v and gate/up fused while o and down keep the two launches. The fused steps'
    calls are sized for 32 rank rows (the parity set's largest rank) in an engine sized for 64.
    ``addend`` (ADDEND_MIN_TOKENS lowered to 2): all-fused steps' GEMMs add onto the deltas;
    "mixed" ones, whose o and down would take the two launches, keep the in-place add."""
    from services.inference.engine import model_runner

    monkeypatch.setattr(lora_paths, "FUSED_DECODE_ROWS", 32)
    monkeypatch.setattr(lora_paths, "FUSED_DECODE_MIN_ROWS", 32)  # one adapter token suffices
    monkeypatch.setattr(lora_paths, "FUSED_SINGLE_SLICE_MIN_ROWS", single_slice_rows)
    monkeypatch.setattr(model_runner, "ADDEND_MIN_TOKENS", 2)
    run = _mixed_run(tiny_models, "tiny-llama", "float32", max_lora_rank=64, lora_addend=addend)
    core = run[3]
    assert core.runner.fused_graph_sizes and core.runner.fused_steps > 0
    assert core.runner.fused_steps < core.steps  # the others took the two launches
    assert_matches_hf(tiny_models, "tiny-llama", *run[:3])


@pytest.mark.parametrize(
    "preset, addend, lora_pdl",
    [("tiny-llama", False, False), ("tiny-llama", True, False), ("tiny-qwen2", True, False),
     ("tiny-llama", True, True)],
)  # fmt: skip
def test_cuda_narrow_mixed_steps_match_hf_peft(tiny_models, monkeypatch, preset, addend, lora_pdl):
    """Mixed steps sized for FUSED_PREFILL_MAX_ROWS rank rows (NARROW: every adapter of the step
    fits them; every call fused), with the prefill-sized threshold lowered so that the parity
    run's mixed steps count as prefill-sized and the single-slice threshold so that their o and
    down calls fuse at these sizes too, in an engine sized for rank 64; steps of the rank-32
    adapter keep the engine's rows, on two launches of 32-row programs (WIDE). ``addend``
    (EngineConfig.lora_addend): the NARROW steps' calls write their deltas, every token's (the
    base model's and the graphs' padding as zeros), and the GEMMs add onto them, q/k/v biases
    included. ``lora_pdl``: the fused LoRA kernel a programmatic dependent launch where the GPU
    takes one (LORAFLEET_LORA_PDL=1). Every step against HF + PEFT."""
    from kernels.tiles import LORA_PDL_ENV, lora_pdl_launch

    monkeypatch.setattr(lora_paths, "FUSED_MAX_TOKENS", 16)
    monkeypatch.setattr(lora_paths, "FUSED_SINGLE_SLICE_MIN_ROWS", 16)
    monkeypatch.setenv(LORA_PDL_ENV, "1" if lora_pdl else "0")
    lora_pdl_launch.cache_clear()
    try:
        run = _mixed_run(tiny_models, preset, "float32", max_lora_rank=64, lora_addend=addend)
    finally:
        monkeypatch.delenv(LORA_PDL_ENV)
        lora_pdl_launch.cache_clear()
    core = run[3]
    assert core.runner.narrow_graph_sizes
    paths = {(r.graph, r.lora) for r in core.step_log.recent}
    assert (True, "fused, narrow") in paths and (True, "two launches, wide") in paths
    assert_matches_hf(tiny_models, preset, *run[:3])


@pytest.mark.parametrize("addend", [False, True])
def test_cuda_wide_fused_mixed_steps_match_hf_peft(tiny_models, monkeypatch, addend):
    """Mixed steps with the rank-32 adapter among several (WIDE_FUSED_MIN_ADAPTERS lowered to
    2, the prefill-sized threshold to 16 tokens) run every call fused at WIDE_FUSED_ROWS rank
    rows in an engine sized for rank 64 (kernels.lora_paths.prefill_step_fuses_wide; the
    single-slice threshold lowered so that o and down fuse too), graphs included; ``addend``:
    their GEMMs add onto the deltas (EngineConfig.lora_addend). Every step against HF + PEFT."""
    monkeypatch.setattr(lora_paths, "FUSED_MAX_TOKENS", 16)
    monkeypatch.setattr(lora_paths, "FUSED_SINGLE_SLICE_MIN_ROWS", 16)
    monkeypatch.setattr(lora_paths, "WIDE_FUSED_MIN_ADAPTERS", 2)
    run = _mixed_run(tiny_models, "tiny-llama", "float32", max_lora_rank=64, lora_addend=addend)
    core = run[3]
    assert core.runner.wide_fused_graph_sizes == core.runner.narrow_graph_sizes
    paths = {(r.graph, r.lora) for r in core.step_log.recent}
    assert (True, "fused, wide") in paths and (True, "fused, narrow") in paths
    assert_matches_hf(tiny_models, "tiny-llama", *run[:3])


@pytest.mark.parametrize("path", ["two launches", "fused", "fused, one-token tiles"])
def test_cuda_attention_only_graphs_match_hf_peft(tiny_models, monkeypatch, path):
    """Steps whose adapters adapt attention only (r4: q and v; r8: q/k/v/o), beside the base
    model, replay the graphs without MLP LoRA calls: mixed steps on their path's, decode steps
    on those of two launches (the one-token tiles' rule switched off), of the fused kernel
    ("fused", that rule off and the fused rule's threshold lowered so that the parity run's
    distinct adapters take it), or, the default for these steps of rank <= 8 adapters, of the
    fused kernel on one-token tiles (ONE_TOKEN); every token against HF + PEFT."""
    fused = path == "fused"
    if path != "fused, one-token tiles":  # no ONE_TOKEN steps
        monkeypatch.setattr(lora_paths, "one_token_step_fuses", lambda *_: False)
    if fused:
        monkeypatch.setattr(lora_paths, "FUSED_DECODE_MIN_ROWS", 16)  # one adapter token
    model_dir = tiny_models.model("tiny-llama")
    recorder = Recorder()
    core = make_core(model_dir, recorder, device="cuda", dtype="float32",
                     max_num_batched_tokens=48)  # fmt: skip
    for name in ("r4", "r8"):
        core.add_adapter_dir(AdapterKey(name, 1), tiny_models.adapter("tiny-llama", name))
    requests = [(r, n) for r, n in _requests(core.model_config.vocab_size)
                if n in (None, "r4", "r8")]  # fmt: skip
    picked = []
    pick = core.runner._graph_for

    def spy(entries, step):
        picked.append(pick(entries, step))
        return picked[-1]

    core.runner._graph_for = spy
    results = run(core, {0: [r for r, _ in requests]}, recorder)
    assert core.runner.attention_graph_sizes and core.runner.attention_steps > 0
    twins = [k for k in picked if k is not None and k.modules == ATTENTION]
    assert any(k.tokens == k.seqs for k in twins)  # decode
    assert any(k.tokens > k.seqs for k in twins)  # mixed
    assert (core.runner.fused_steps > 0) == fused
    graph_paths = {r.lora for r in core.step_log.recent if r.graph and r.prefill_tokens == 0}
    assert path in graph_paths
    if path == "fused, one-token tiles":
        assert core.runner.one_token_graph_sizes
    core.check_integrity()
    assert_matches_hf(tiny_models, "tiny-llama", model_dir, requests, results)


def _place_in_pool(core, keys) -> None:
    """Copy the adapters into the pool before any request arrives, so that every request is
    admitted in the first step, not in waves as each copy completes (which would leave the
    test's large decode steps to the copies' timing)."""
    for key in keys:
        assert core.adapters.begin_load(key)
    core.adapters.issue_loads()
    torch.cuda.synchronize()
    core.adapters.poll_loads()
    assert {core.adapters.state(key) for key in keys} == {AdapterState.IN_POOL}


def _small_adapter_requests(
    tiny_models, core, keys, prompt_lens, max_new_tokens, seed, preset="tiny-llama"
):
    """Requests of random prompts (``prompt_lens``), request i on adapter key a{keys[i]} (None:
    the base model), each key added to ``core`` over r4's weights (even keys) or r8's (odd), of
    ``preset``'s model: [(request, its parity adapter's name or None)]."""
    names = {k: ("r4", "r8")[k % 2] for k in keys if k is not None}
    for k, name in sorted(names.items()):
        core.add_adapter_dir(AdapterKey(f"a{k}", 1), tiny_models.adapter(preset, name))
    gen = torch.Generator().manual_seed(seed)
    requests = []
    for i, (k, n) in enumerate(zip(keys, prompt_lens, strict=True)):
        prompt = torch.randint(3, core.model_config.vocab_size, (n,), generator=gen)
        req = GenerationRequest(
            request_id=f"req{i}", prompt_token_ids=prompt.tolist(),
            adapter=None if k is None else AdapterKey(f"a{k}", 1),
            sampling=SamplingParams(max_new_tokens=max_new_tokens, ignore_eos=True),
        )  # fmt: skip
        requests.append((req, None if k is None else names[k]))
    return requests


def _large_decode_steps(tiny_models, monkeypatch, preset, addend, seed, steps=None, adapters=10):
    """Decode steps of 64 sequences and more whose rank-4 and rank-8 adapters are shared at most
    ONE_TOKEN_MAX_SHARING tokens to one (ten adapter keys over r4's and r8's weights, seven
    sequences each, beside the base model; ``adapters`` keys: 70 sequences over fewer of them
    share more) on ``preset``'s model, in float32: they replay the
    ONE_TOKEN graphs of their size (every call fused, a tile a token, 8 rank rows, every load
    issued first), and every token matches HF + PEFT, the pool intact. (max_loras 80: the
    batch's segment capacity, max_loras + 2, bounds the one-token tiles a step's table holds.)
    Steps this large add their deltas in place (the side stream takes steps of up to
    SIDE_STREAM_MAX_TOKENS tokens); ``addend``: from 64 tokens (ADDEND_MIN_TOKENS lowered) their
    GEMMs add onto the deltas instead, the base-model sequences and the graphs' padding as zero
    tiles. ``steps``: a list that gets each step's StepLora. Returns the engine."""
    from services.inference.engine import model_runner

    monkeypatch.setattr(model_runner, "ADDEND_MIN_TOKENS", 64)
    model_dir = tiny_models.model(preset)
    recorder = Recorder()
    core = make_core(model_dir, recorder, device="cuda", dtype="float32", max_num_seqs=80,
                     max_num_batched_tokens=640, max_loras=80, num_pages=2048,
                     lora_addend=addend)  # fmt: skip
    if steps is not None:
        step_lora = core.runner.step_lora

        def spy(entries):
            steps.append(step_lora(entries))
            return steps[-1]

        core.runner.step_lora = spy
    # 70 on ten adapters, 6 on the base model
    keys = [i % adapters if i < 70 else None for i in range(76)]
    requests = _small_adapter_requests(tiny_models, core, keys, [5 + i % 4 for i in range(76)],
                                       max_new_tokens=5, seed=seed, preset=preset)  # fmt: skip
    _place_in_pool(core, {r.adapter for r, _ in requests} - {None})
    results = run(core, {0: [r for r, _ in requests]}, recorder)
    big = [r for r in core.step_log.recent
           if r.graph and r.prefill_tokens == 0 and r.seqs >= 64]  # fmt: skip
    assert big and all(r.lora == "fused, one-token tiles" for r in big)
    assert max(core.runner.one_token_graph_sizes) == 80
    core.check_integrity()
    assert core.stats().kv_pages == 0
    assert_matches_hf(tiny_models, preset, model_dir, requests, results)
    return core


@pytest.mark.parametrize("addend", [False, True])
def test_cuda_large_decode_steps_on_one_token_tiles_match_hf_peft(tiny_models, monkeypatch, addend):
    """_large_decode_steps on tiny-llama, whose grouped-query q/k/v and o calls do not hoist
    (their d_in or width is above the pool's width): one token a tile, pairs or not."""
    core = _large_decode_steps(tiny_models, monkeypatch, "tiny-llama", addend, seed=77)
    assert core.runner.pair_modules == 0


@pytest.mark.parametrize(
    "pairs, addend, lora_pdl",
    [(False, False, False), (True, False, False), (True, True, False), (True, True, True),
     (True, False, True)],
)  # fmt: skip
def test_cuda_one_token_tiles_of_hoisted_calls_match_hf_peft(
    tiny_models, monkeypatch, pairs, addend, lora_pdl
):
    """_large_decode_steps on a model with multi-head attention (tiny-mha), whose q/k/v and o
    calls hoist the GEMV body's loads (lora.gemv_hoists), as Llama-7B's do. ``pairs``: with
    lora_paths.ONE_TOKEN_PAIRS on, every module the adapters touch takes two-token tiles
    (ModelRunner.pair_modules), so the tokens that share an adapter go two to a tile (the
    kernel's pair body). ``lora_pdl``: the fused LoRA kernel a programmatic dependent launch
    where the GPU takes one (LORAFLEET_LORA_PDL=1: it reads x and y only past its gate)."""
    from kernels.tiles import LORA_PDL_ENV, lora_pdl_launch
    from services.inference.engine import model_runner

    monkeypatch.setattr(lora_paths, "ONE_TOKEN_PAIRS", pairs)
    monkeypatch.setenv(LORA_PDL_ENV, "1" if lora_pdl else "0")
    lora_pdl_launch.cache_clear()
    steps = []
    try:
        core = _large_decode_steps(tiny_models, monkeypatch, "tiny-mha", addend, seed=78,
                                   steps=steps)  # fmt: skip
    finally:
        monkeypatch.delenv(LORA_PDL_ENV)
        lora_pdl_launch.cache_clear()
    qkvo = sum(1 << m for m in (model_runner.Q, model_runner.K, model_runner.V, model_runner.O))
    assert core.runner.pair_modules == (qkvo if pairs else 0)
    one_token = [s for s in steps if s.mode is model_runner.LoraMode.ONE_TOKEN]
    assert one_token and all(s.pair_tiles == pairs for s in one_token)


def test_cuda_one_token_pairs_of_tokens_shared_many_to_one_match_hf_peft(tiny_models, monkeypatch):
    """_large_decode_steps on tiny-mha whose 70 adapter sequences share 3 adapter keys (23-24
    tokens to one, beyond ONE_TOKEN_MAX_SHARING): with every call taking two-token tiles
    (lora_paths.ONE_TOKEN_PAIRS), such steps stay ONE_TOKEN at any sharing
    (lora_paths.one_token_step_fuses), a tile for each pair, and match HF + PEFT."""
    from services.inference.engine import model_runner

    monkeypatch.setattr(lora_paths, "ONE_TOKEN_PAIRS", True)
    steps = []
    core = _large_decode_steps(tiny_models, monkeypatch, "tiny-mha", False, seed=79, steps=steps,
                               adapters=3)  # fmt: skip
    assert core.runner.pair_modules
    shared = [s for s in steps if s.mode is model_runner.LoraMode.ONE_TOKEN]
    assert shared and all(s.pair_tiles for s in shared)


@pytest.mark.parametrize("addend", [False, True])
def test_cuda_narrow_mixed_steps_with_decode_tokens_apart_match_hf_peft(
    tiny_models, monkeypatch, addend
):
    """Mixed steps of rank-4 and rank-8 adapters in an engine sized for rank 64 (NARROW, with
    the prefill-sized threshold lowered so that these steps count), whose decode tokens share
    adapters a few to one beside new prompts on the same adapters: each decode token takes a
    one-token tile (lora_paths.mixed_decodes_apart) in graphs and eagerly; every token against
    HF + PEFT, the pool intact. (max_loras 32: the batch's segment capacity, max_loras + 2,
    bounds the tiles a step's table holds; with the default 8 most steps keep the segments'.)
    ``addend``: the deltas written first, the base-model entries and the padding as zero
    tiles among the one-token ones."""
    monkeypatch.setattr(lora_paths, "FUSED_MAX_TOKENS", 16)
    monkeypatch.setattr(lora_paths, "FUSED_SINGLE_SLICE_MIN_ROWS", 16)
    model_dir = tiny_models.model("tiny-llama")
    recorder = Recorder()
    core = make_core(model_dir, recorder, device="cuda", dtype="float32", max_num_seqs=32,
                     max_num_batched_tokens=96, max_lora_rank=64, max_loras=32,
                     lora_addend=addend)  # fmt: skip
    # 27 on six adapters, 3 on the base model; ten arrive every 3 steps
    keys = [i % 6 if i % 10 != 9 else None for i in range(30)]
    lens = [5 + 3 * (i % 5) for i in range(30)]
    requests = _small_adapter_requests(tiny_models, core, keys, lens, max_new_tokens=8, seed=78)
    arrivals: dict[int, list] = {}
    for i, (req, _) in enumerate(requests):
        arrivals.setdefault(3 * (i // 10), []).append(req)
    results = run(core, arrivals, recorder)
    narrow = [r for r in core.step_log.recent if r.lora == "fused, narrow"]
    assert any(r.graph for r in narrow) and core.runner.apart_steps > 0
    core.check_integrity()
    assert core.stats().kv_pages == 0
    assert_matches_hf(tiny_models, "tiny-llama", model_dir, requests, results)


@pytest.mark.parametrize("preset, overlap, side_stream", MIXED_RUNS, ids=MIXED_IDS)
def test_cuda_bfloat16_mixed_batch_tracks_hf_peft(tiny_models, preset, overlap, side_stream):
    run = _mixed_run(tiny_models, preset, "bfloat16", overlap=overlap, lora_side_stream=side_stream)
    _assert_tracks_hf(tiny_models, preset, *run[:3])


def test_cuda_bfloat16_addend_steps_track_hf_peft(tiny_models, monkeypatch):
    """bfloat16 with lora_addend: the NARROW steps' GEMMs add onto deltas rounded to bf16 (one
    rounding of the sum, where in place rounds the GEMM's output and then the sum)."""
    monkeypatch.setattr(lora_paths, "FUSED_MAX_TOKENS", 16)
    monkeypatch.setattr(lora_paths, "FUSED_SINGLE_SLICE_MIN_ROWS", 16)
    run = _mixed_run(tiny_models, "tiny-qwen2", "bfloat16", max_lora_rank=64, lora_addend=True)
    assert any(r.graph and r.lora == "fused, narrow" for r in run[3].step_log.recent)
    _assert_tracks_hf(tiny_models, "tiny-qwen2", *run[:3])


def _assert_tracks_hf(tiny_models, preset, model_dir, requests, results) -> None:
    """Teacher forcing: HF in float32 fed each request's own tokens, logits within BF16_RTOL."""
    from tests.inference.engine_harness import _hf_model

    for req, name in requests:
        adapter_dir = None if name is None else tiny_models.adapter(preset, name)
        got = results[req.request_id]
        assert len(got.token_ids) == req.sampling.max_new_tokens
        model = _hf_model(str(model_dir), None if adapter_dir is None else str(adapter_dir))
        ids = list(req.prompt_token_ids) + got.token_ids
        with torch.no_grad():
            want = model(torch.tensor([ids])).logits[0].float()  # [len, vocab]
        first = len(req.prompt_token_ids) - 1
        for step, g in enumerate(got.logits):
            assert torch.isfinite(g).all()
            err = relative_error(g.float().cpu(), want[first + step])
            assert err <= BF16_RTOL, f"{req.request_id} step {step}: relative error {err:.2e}"


def test_cuda_an_adapter_copied_in_parts_lands_as_a_whole_copy(tiny_models, monkeypatch):
    """AdapterCopier.issue with a byte budget (the engine's per-launch budget, core.DMA_SHARE)
    queues the file's transfer in parts over several calls, the write kernel and the end event
    after the last: the pool then holds what one whole transfer writes, and the engine measured
    a host -> device bandwidth to size the budgets with."""
    from services.inference.engine import adapter_copy

    monkeypatch.setattr(adapter_copy, "MIN_PART_BYTES", 1000)
    key = AdapterKey("r16", 1)
    written = []
    for part in (None, 1000):
        core = make_core(tiny_models.model("tiny-llama"), device="cuda", max_lora_rank=32,
                         max_loras=4)  # fmt: skip
        adapters = core.adapters
        assert adapters.copier.h2d_bytes_per_s > 1e8
        core.add_adapter_dir(key, tiny_models.adapter("tiny-llama", "r16"))
        assert adapters.begin_load(key)
        [ticket] = adapters._unissued
        host = adapters._entries[key].host
        n = host.raw.numel()
        calls = 0
        while not ticket.issued:
            queued = adapters.copier.issue(ticket, part)
            assert queued == (n if part is None else min(part, n - calls * part))
            calls += 1
            assert ticket.issued or not ticket.done()  # no end event before the last part
        assert calls == (1 if part is None else -(-n // part)) and ticket.error is None
        adapters._unissued.clear()
        torch.cuda.synchronize()
        adapters.poll_loads()
        assert adapters.state(key) is AdapterState.IN_POOL
        slots = adapters.index.slot_table[adapters.row(key), : host.plan.num_slots].long()
        written.append(adapters.copier.pool[:, :, slots].cpu())
        del core, adapters, ticket
        gc.collect()
    assert calls > 4  # the parts' case did cut the file
    assert torch.equal(written[0], written[1])


def test_cuda_step_batch_device_views_hold_each_step_after_one_copy():
    """StepBatch copies a step's prefix of its packed staging (wire()) to the device in one
    copy: after steps of more and fewer sequences, tokens and tiles, padded for graphs or not,
    every device view of the step equals the host's (the block tables' rows of the step's
    sequences), and the device tensors keep their addresses."""
    from services.inference.engine.batch import BatchEntry, StepBatch

    b = StepBatch(max_tokens=64, max_seqs=8, max_pages_per_seq=6, max_segments=6, page_size=4,
                  device=torch.device("cuda"))  # fmt: skip
    ptrs = {name: t.data_ptr() for name, t in b._dev.items()}
    steps = [
        ([BatchEntry([1] * 9, 0, [0, 1, 2], 0, True), BatchEntry([2], 20, [3, 4, 5, 6, 7, 8], 1,
          True)] + [BatchEntry([3], 5, [9 + k, 20 + k], None, True) for k in range(5)],
         {"pad_tokens": 24, "pad_seqs": 8}),
        ([BatchEntry([4], 7, [5, 6], 2, True)], {}),
        ([BatchEntry([5] * 22, 0, list(range(6)), 0, False), BatchEntry([6], 3, [9], 0, True)],
         {"one_token_tiles": True, "zero_tiles": True}),
        ([BatchEntry([7], 9, [1, 2, 3], k // 2, True) for k in range(6)],
         {"one_token_tiles": True, "pair_tiles": True}),
    ]  # fmt: skip
    for entries, kw in steps:
        b.fill(entries, **kw)
        torch.cuda.synchronize()
        for name, host in b._host.items():
            dev = b._dev[name]
            if name == "block_tables":
                host, dev = host[: b.num_seqs], dev[: b.num_seqs]
            assert torch.equal(dev.cpu(), host), name
        assert b.block_tables.cpu().tolist()[0][: len(entries[0].pages)] == list(entries[0].pages)
    assert {name: t.data_ptr() for name, t in b._dev.items()} == ptrs
    assert all(t.data_ptr() % 16 == 0 for t in b._dev.values())
