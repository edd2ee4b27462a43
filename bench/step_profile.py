"""Where a step's time goes: host phases, GPU time, and the kernels of eager steps.

Drives EngineCore directly (no services) through the phases of one step run synchronously (as
EngineCore.step does, not launched ahead as the engine's step loop runs them), each timed on the
host (schedule, fill + launch, the wait for the GPU, appending tokens), with CUDA events around
the forward for its GPU time, at several decode batch sizes and in mixed
prefill + decode steps; then the torch profiler's kernel table for an eager decode step and an
eager mixed step. Each step's bytes bound (weights once, KV read and written) at the copy
bandwidth measured in the same run, and its FLOPs at the measured matmul rate, give its share of
the roofline.

    python bench/step_profile.py                       # CUDA, Llama-7B shape
    python bench/step_profile.py --shape tiny --device cpu --batches 4 8 --steps 3
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

import torch  # noqa: E402

from bench.bench_models import SHAPES, make_model  # noqa: E402
from bench.roofline import Roofline, measure_ceilings  # noqa: E402
from services.inference.engine.api import AdapterKey, GenerationRequest  # noqa: E402
from services.inference.engine.batch import BatchEntry  # noqa: E402
from services.inference.engine.config import EngineConfig  # noqa: E402
from services.inference.engine.core import EngineCore  # noqa: E402
from services.inference.engine.sampling_params import SamplingParams  # noqa: E402
from store.synthetic import synthetic_adapter  # noqa: E402


def timed_step(core: EngineCore) -> dict | None:
    """The phases of one synchronous step (launch and finish in one, as core.step(), with the
    sampler's tokens read at once), each timed; None when nothing ran."""
    cuda = core.device.type == "cuda"
    t0 = time.perf_counter()
    scheduled = core.scheduler.schedule()
    if not scheduled:
        return None
    t1 = time.perf_counter()
    entries = [
        BatchEntry(s.seq.next_chunk(s.num_tokens)[0], s.seq.num_computed,
                   core.pool.kv_pages(s.seq.seq_id), s.lora_row, s.samples)
        for s in scheduled
    ]  # fmt: skip
    if cuda:
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
    graphs_before = core.runner.graph_steps
    logits = core.runner.execute(entries)
    if cuda:
        end.record()
    t2 = time.perf_counter()
    sampling = [s.seq for s in scheduled if s.samples]
    for s in scheduled:
        s.seq.num_computed += s.num_tokens
    tokens = core.sampler(logits, [q.sampling for q in sampling], [q.generator for q in sampling])
    tokens = tokens.tolist()
    t3 = time.perf_counter()
    for seq, tok in zip(sampling, tokens, strict=True):
        core._append(seq, tok)
    t4 = time.perf_counter()
    prefill = sum(s.num_tokens for s in scheduled if s.num_tokens > 1)
    kv_read = sum(s.seq.num_computed for s in scheduled)  # context incl. this step's tokens
    return {
        "seqs": len(scheduled),
        "tokens": sum(s.num_tokens for s in scheduled),
        "prefill_tokens": prefill,
        "kv_tokens_read": kv_read,
        "graph": core.runner.graph_steps > graphs_before,
        "schedule_ms": 1e3 * (t1 - t0),
        "fill_launch_ms": 1e3 * (t2 - t1),
        "sample_wait_ms": 1e3 * (t3 - t2),
        "append_ms": 1e3 * (t4 - t3),
        "wall_ms": 1e3 * (t4 - t0),
        "gpu_ms": start.elapsed_time(end) if cuda else None,
    }


def submit(core: EngineCore, tag: str, n: int, prompt_len: int, new: int, gen, vocab, adapters):
    sp = SamplingParams(max_new_tokens=new, ignore_eos=True)
    for i in range(n):
        ids = torch.randint(3, vocab, (prompt_len,), generator=gen).tolist()
        key = adapters[i % len(adapters)] if adapters else None
        core.add_request(GenerationRequest(f"{tag}-{i}", prompt_token_ids=ids, adapter=key,
                                           sampling=sp))  # fmt: skip


def until_decoding(core: EngineCore) -> None:
    while any(s.num_computed < s.num_tokens - 1 for s in core.scheduler.running) or (
        core.scheduler.waiting
    ):
        core.step()


def summarize(steps: list[dict], roof: Roofline) -> dict:
    keys = ("schedule_ms", "fill_launch_ms", "sample_wait_ms", "append_ms", "wall_ms", "gpu_ms")
    out = {k: statistics.median(s[k] for s in steps) for k in keys if steps[0][k] is not None}
    s0 = steps[len(steps) // 2]
    out.update({k: s0[k] for k in ("seqs", "tokens", "prefill_tokens", "kv_tokens_read", "graph")})
    bound = roof.step_bound_ms(s0["tokens"], s0["kv_tokens_read"], s0["tokens"])
    out["bound_ms"] = bound
    if "gpu_ms" in out:
        out["gpu_share_of_roofline"] = bound / out["gpu_ms"]
    out["wall_share_of_roofline"] = bound / out["wall_ms"]
    return out


def profile_table(core: EngineCore, rows: int = 25, before=None) -> str:
    """The kernel table of one eager step (graphs off for it); ``before`` runs after the
    warm-up step (it submits what the profiled step computes)."""
    from torch.profiler import ProfilerActivity, profile

    graphs, core.runner._graphs = core.runner._graphs, {}
    try:
        core.step()  # warm
        if before is not None:
            before()
        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
            core.step()
            torch.cuda.synchronize()
    finally:
        core.runner._graphs = graphs
    return kernel_table(prof, rows)


def kernel_table(prof, rows: int = 20) -> str:
    """The profiler's table of its ``rows`` most expensive kernels by GPU time (the key's name
    differs between torch versions)."""
    for key in ("self_cuda_time_total", "self_device_time_total"):
        try:
            return prof.key_averages().table(sort_by=key, row_limit=rows, max_name_column_width=60)
        except (AttributeError, KeyError, RuntimeError):
            continue
    return prof.key_averages().table(row_limit=rows)


def gemm_times(core: EngineCore, ceilings, sizes=(64, 256, 272, 288, 320, 512, 704)) -> dict:
    """Each projection's GEMM of layer 0 alone at several token counts: ms and share of the
    matmul rate (what the decode and mixed steps' GEMMs reach)."""
    import torch.nn.functional as F

    from bench.roofline import _time_ms

    layer = core.model.layers[0]
    weights = {"qkv": layer.attn.wqkv, "o": layer.attn.wo, "gate_up": layer.mlp.w_gate_up,
               "down": layer.mlp.w_down}  # fmt: skip
    out = {}
    for m in sizes:
        row = {}
        for name, w in weights.items():
            x = torch.randn(m, w.shape[1], device=w.device, dtype=w.dtype)
            ms = _time_ms(lambda x=x, w=w: F.linear(x, w), w.device, 50)
            row[name] = (round(ms * 1e3, 1), round(2 * m * w.numel() / (ms / 1e3)
                                                   / ceilings.matmul_flops_per_s, 3))  # fmt: skip
        out[m] = row
        print(f"gemm M={m}: " + ", ".join(f"{k} {v[0]} us ({v[1]:.2f})" for k, v in row.items()),
              flush=True)  # fmt: skip
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shape", choices=sorted(SHAPES), default="llama-7b")
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--batches", type=int, nargs="+", default=[32, 64, 128, 256])
    parser.add_argument("--context", type=int, default=384, help="prompt tokens per sequence")
    parser.add_argument("--steps", type=int, default=12)
    parser.add_argument("--mixed-prefill", type=int, nargs="+", default=[256, 1024])
    parser.add_argument("--adapters", type=int, default=64, help="distinct rank-8 adapters")
    parser.add_argument("--pool-gib", type=float, default=60.0)
    parser.add_argument("--model-dir", type=Path, default=None)
    parser.add_argument("--profile", action="store_true", help="torch profiler kernel tables")
    parser.add_argument("--gemms", action="store_true", help="time the layer's GEMMs alone")
    parser.add_argument(
        "--out", type=Path, default=REPO / "bench" / "results" / "step_profile.json"
    )
    args = parser.parse_args()

    device = torch.device(args.device)
    shape = SHAPES[args.shape]
    model_dir = args.model_dir or Path(tempfile.gettempdir()) / f"lorafleet-bench-{args.shape}"
    t = time.perf_counter()
    make_model(model_dir, shape, device)
    print(f"model ready in {time.perf_counter() - t:.0f} s", flush=True)
    ceilings = measure_ceilings(device)
    roof = Roofline.for_shape(shape, ceilings)
    print(f"ceilings: {ceilings}", flush=True)
    max_seqs = max(args.batches) + 16  # room for the mixed steps' new requests
    t = time.perf_counter()
    core = EngineCore(EngineConfig(
        model_dir=model_dir, device=device.type, max_num_seqs=max_seqs,
        max_num_batched_tokens=2048, max_loras=max(8, args.adapters), max_lora_rank=8,
        pool_memory_bytes=int(args.pool_gib * 2**30),
    ))  # fmt: skip
    print(f"engine ready in {time.perf_counter() - t:.0f} s", flush=True)
    base = shape.base()
    keys = [AdapterKey(f"p/a{i}", 1) for i in range(args.adapters)]
    for i, key in enumerate(keys):
        files = synthetic_adapter(base, rank=8, alpha=16.0, seed=i,
                                  modules=("q_proj", "k_proj", "v_proj", "o_proj"))  # fmt: skip
        core.add_adapter(key, files.config_json, files.safetensors)
    gen = torch.Generator().manual_seed(0)
    results: dict[str, dict] = {}
    tables: dict[str, str] = {}
    new = 4096 - args.context - 8
    new = min(new, shape.max_positions - args.context - 8)

    def measure(name: str, steps: int, before=None) -> None:
        rows = []
        for _ in range(steps):
            if before is not None:
                before()
            r = timed_step(core)
            if r is not None:
                rows.append(r)
        results[name] = summarize(rows, roof)
        r = results[name]
        print(f"{name:<34} seqs {r['seqs']:>4} tok {r['tokens']:>5} wall {r['wall_ms']:7.2f} "
              f"gpu {r.get('gpu_ms', float('nan')):7.2f} bound {r['bound_ms']:6.2f} | sched "
              f"{r['schedule_ms']:5.2f} fill+launch {r['fill_launch_ms']:6.2f} wait "
              f"{r['sample_wait_ms']:6.2f} append {r['append_ms']:5.2f}", flush=True)  # fmt: skip

    for b in args.batches:
        for label, adapters in (("base", None), (f"{len(keys)} adapters r8", keys)):
            if adapters is not None and not keys:
                continue
            submit(core, f"d{b}{label}", b, args.context, new, gen, shape.vocab, adapters)
            until_decoding(core)
            measure(f"decode b{b} {label}", args.steps)
            for pf in args.mixed_prefill:
                counter = iter(range(10**6))

                def add_prefill(pf=pf, counter=counter, adapters=adapters, b=b):
                    i = next(counter)
                    submit(core, f"m{b}-{pf}-{i}", 1, pf, 4, gen, shape.vocab, adapters)

                measure(f"mixed b{b} +{pf} {label}", max(3, args.steps // 3), add_prefill)
            profiled = b in (64, max(args.batches)) and not adapters
            if args.profile and device.type == "cuda" and profiled:
                tables[f"eager decode b{b}"] = profile_table(core)
                tables[f"eager mixed b{b} +400"] = profile_table(
                    core,
                    before=lambda b=b: submit(core, f"pm{b}", 1, 400, 4, gen, shape.vocab, None),
                )
            core.abort_all()
            core.check_integrity()
    if args.gemms and device.type == "cuda":
        results["gemms"] = gemm_times(core, ceilings)
    for name, table in tables.items():
        print(f"\n=== {name}\n{table}")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps({
        "benchmark": "step phases and roofline shares, EngineCore driven directly",
        "shape": args.shape, "context": args.context, "ceilings": ceilings._asdict(),
        "results": results, "kernel_tables": tables,
        "command": "python bench/step_profile.py " + " ".join(sys.argv[1:]),
    }, indent=2) + "\n")  # fmt: skip
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
