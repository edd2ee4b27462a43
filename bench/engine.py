"""Serving throughput with many adapters in one batch: base model, one adapter, N distinct ones.

The workload of the reference figures in DESIGN.md (HF transformers + PEFT on the H200, Llama-7B
shape, bf16, batch 32, 128 prompt + 128 generated tokens: base 715 tok/s, one adapter 466, 32
different adapters 23): the same batch through lorafleet's engine, side by side in one run.
Adapters are rank 16 on all seven projections and resident before timing starts (adapter loading
is bench/adapter_load.py's subject). Generated tokens per second count the 128 new tokens of each
request over the wall time from submission to the last token.

    python bench/engine.py                               # CUDA, Llama-7B shape
    python bench/engine.py --shape tiny --device cpu --new-tokens 16
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

import torch  # noqa: E402

from bench.bench_models import SHAPES, make_model  # noqa: E402
from services.inference.engine.api import AdapterKey, GenerationRequest  # noqa: E402
from services.inference.engine.config import EngineConfig  # noqa: E402
from services.inference.engine.core import EngineCore  # noqa: E402
from services.inference.engine.sampling_params import SamplingParams  # noqa: E402
from store.synthetic import synthetic_adapter  # noqa: E402


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize()


def run_batch(core: EngineCore, prompts, adapters, new_tokens: int, tag: str) -> dict:
    """Submit one batch, step until it is done; wall time, step times, generated tokens."""
    sampling = SamplingParams(max_new_tokens=new_tokens, ignore_eos=True)
    for i, (ids, key) in enumerate(zip(prompts, adapters, strict=True)):
        core.add_request(GenerationRequest(f"{tag}-{i}", prompt_token_ids=ids, adapter=key,
                                           sampling=sampling))  # fmt: skip
    step_s: list[float] = []
    generated = 0
    sync(core.device)
    start = time.perf_counter()
    while core.has_work:
        t0 = time.perf_counter()
        outputs = core.step()
        sync(core.device)
        if core.last_step_ran:
            step_s.append(time.perf_counter() - t0)
        generated += sum(len(o.token_ids) for o in outputs)
    wall = time.perf_counter() - start
    # Decode steps: every step after the first (which prefills the whole batch).
    decode = step_s[1:] if len(step_s) > 1 else step_s
    return {
        "wall_s": wall,
        "generated_tokens": generated,
        "tokens_per_s": generated / wall,
        "steps": len(step_s),
        "decode_step_ms_median": 1e3 * statistics.median(decode),
        "prefill_step_ms": 1e3 * step_s[0],
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shape", choices=sorted(SHAPES), default="llama-7b")
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--prompt-len", type=int, default=128)
    parser.add_argument("--new-tokens", type=int, default=128)
    parser.add_argument("--rank", type=int, default=16)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--pool-gib", type=float, default=24.0, help="page pool per engine")
    parser.add_argument("--model-dir", type=Path, default=None, help="cache for the model")
    parser.add_argument("--out", type=Path, default=REPO / "bench" / "results" / "engine.json")
    args = parser.parse_args()

    device = torch.device(args.device)
    shape = SHAPES[args.shape]
    model_dir = args.model_dir or Path(tempfile.gettempdir()) / f"lorafleet-bench-{args.shape}"
    make_model(model_dir, shape, device)
    base = shape.base()
    adapters = [
        synthetic_adapter(base, rank=args.rank, alpha=2.0 * args.rank, seed=100 + i)
        for i in range(args.batch)
    ]
    keys = [AdapterKey(f"bench/a{i}", 1) for i in range(args.batch)]

    def engine(cuda_graphs: bool) -> EngineCore:
        core = EngineCore(EngineConfig(
            model_dir=model_dir, device=device.type, max_num_seqs=max(64, args.batch),
            max_num_batched_tokens=max(4096, args.batch * args.prompt_len),
            max_loras=max(32, args.batch), max_lora_rank=max(64, args.rank),
            pool_memory_bytes=int(args.pool_gib * 2**30), cuda_graphs=cuda_graphs,
        ))  # fmt: skip
        for key, files in zip(keys, adapters, strict=True):
            core.add_adapter(key, files.config_json, files.safetensors)
        return core

    gen = torch.Generator().manual_seed(0)
    prompts = [
        tuple(torch.randint(3, shape.vocab, (args.prompt_len,), generator=gen).tolist())
        for _ in range(args.batch)
    ]
    scenarios = {
        "base model": [None] * args.batch,
        "one adapter": [keys[0]] * args.batch,
        f"{args.batch} distinct adapters": keys,
    }
    modes = {"cuda graphs": True, "eager": False} if device.type == "cuda" else {"eager": False}
    results: dict[str, dict] = {}
    for mode, graphs in modes.items():
        core = engine(graphs)
        # Warm up: compile kernels and bring every adapter into the pool before timing.
        run_batch(core, prompts, keys, 4, "warm-lora")
        run_batch(core, prompts, [None] * args.batch, 4, "warm-base")
        for name, chosen in scenarios.items():
            runs = [
                run_batch(core, prompts, chosen, args.new_tokens, f"{name}-{r}")
                for r in range(args.repeats)
            ]
            best = max(runs, key=lambda r: r["tokens_per_s"])
            results[f"{name}, {mode}"] = {
                **best, "tokens_per_s_runs": [r["tokens_per_s"] for r in runs],
            }  # fmt: skip
        core.check_integrity()
        dtype = core.dtype
        del core
        if device.type == "cuda":
            torch.cuda.empty_cache()

    print(f"\n{args.shape}, {device}, {dtype}, batch {args.batch}, "
          f"{args.prompt_len}+{args.new_tokens} tokens, adapters rank {args.rank} on all "
          f"seven projections")  # fmt: skip
    print(f"{'scenario':<38}{'tok/s':>8}{'vs base':>9}{'decode step ms':>16}{'prefill ms':>12}")
    for mode in modes:
        base_tps = results[f"base model, {mode}"]["tokens_per_s"]
        for name in scenarios:
            r = results[f"{name}, {mode}"]
            print(f"{name + ', ' + mode:<38}{r['tokens_per_s']:>8.0f}"
                  f"{r['tokens_per_s'] / base_tps:>9.2f}{r['decode_step_ms_median']:>16.2f}"
                  f"{r['prefill_step_ms']:>12.1f}")  # fmt: skip

    machine = {"platform": platform.platform(), "python": platform.python_version(),
               "torch": torch.__version__}  # fmt: skip
    if device.type == "cuda":
        machine["gpu"] = torch.cuda.get_device_name(device)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps({
        "benchmark": "engine throughput: base vs one adapter vs distinct adapters in one batch",
        "shape": args.shape, "batch": args.batch, "prompt_len": args.prompt_len,
        "new_tokens": args.new_tokens, "rank": args.rank, "dtype": str(dtype),
        "results": results, "machine": machine,
        "command": "python bench/engine.py " + " ".join(sys.argv[1:]),
    }, indent=2) + "\n")  # fmt: skip
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
