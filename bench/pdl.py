"""Programmatic dependent launch (PDL) on the engine's decode steps (CUDA, Hopper and later).

The layer's pointwise kernels and paged attention are launched PDL by default on Hopper: the GPU
dispatches their programs as the kernel before them in the stream finishes, and each waits at
its entry (kernels/tiles.py launch_gate); the LoRA kernels keep plain launches (their shrink ->
expand pair aside), since with them PDL too the one-token decode steps ran slower
(bench/results/pdl.txt).
This times what that saves, side by side in one process: two engines on one GPU, each with its
own copy of the model (Llama-7B shape, bf16), whose decode graphs are captured at the measured
batch sizes only, one with PDL and one with LORAFLEET_PDL=0. For each batch size, each engine in
turn runs that many requests (``--context`` prompt tokens each) on the base model, then on
distinct rank-8 q/k/v/o adapters (S1's), and the median GPU time of its decode steps (CUDA events
around the graph replay) is reported with the ratio PDL / plain.

    python bench/pdl.py [--batches 1 16 64 256] [--steps 16] [--out bench/results/pdl.json]
"""

from __future__ import annotations

import argparse
import json
import os
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
from bench.step_profile import submit, timed_step, until_decoding  # noqa: E402
from kernels.tiles import PDL_ENV, pdl_launch  # noqa: E402
from services.inference.engine.api import AdapterKey  # noqa: E402
from services.inference.engine.config import EngineConfig  # noqa: E402
from services.inference.engine.core import EngineCore  # noqa: E402
from store.synthetic import synthetic_adapter  # noqa: E402


def set_pdl(on: bool) -> None:
    """Kernels launched from now on take PDL or not (graphs keep what they captured)."""
    os.environ[PDL_ENV] = "1" if on else "0"
    pdl_launch.cache_clear()


def engine(model_dir: Path, batches: list[int], adapters: int, pool_gib: float, on: bool):
    set_pdl(on)
    core = EngineCore(EngineConfig(
        model_dir=model_dir, device="cuda", max_num_seqs=max(batches),
        max_num_batched_tokens=max(2048, max(batches)), max_loras=adapters + 8, max_lora_rank=8,
        pool_memory_bytes=int(pool_gib * 2**30), cuda_graphs=False,
    ))  # fmt: skip
    t = time.perf_counter()
    core.runner.capture_graphs(sorted(batches))
    print(f"pdl={on}: {len(core.runner._graphs)} graphs in {time.perf_counter() - t:.0f} s",
          flush=True)  # fmt: skip
    return core


def decode_ms(core, on: bool, b: int, keys, args, gen, shape) -> dict:
    set_pdl(on)  # the eager prefill steps too
    vocab, new = shape.vocab, shape.max_positions - args.context - 8
    submit(core, f"b{b}", b, args.context, new, gen, vocab, keys)
    until_decoding(core)
    rows = [r for r in (timed_step(core) for _ in range(args.steps)) if r is not None]
    core.abort_all()
    core.check_integrity()
    graphs = sum(r["graph"] for r in rows)
    return {"gpu_ms": statistics.median(r["gpu_ms"] for r in rows), "graph_steps": graphs,
            "steps": len(rows), "path": core.runner.last_lora.value}  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shape", choices=sorted(SHAPES), default="llama-7b")
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 16, 64, 256])
    parser.add_argument("--context", type=int, default=384, help="prompt tokens per sequence")
    parser.add_argument("--steps", type=int, default=16)
    parser.add_argument("--pool-gib", type=float, default=30.0, help="page pool per engine")
    parser.add_argument("--model-dir", type=Path, default=None)
    parser.add_argument("--out", type=Path, default=REPO / "bench" / "results" / "pdl.json")
    args = parser.parse_args()
    if not torch.cuda.is_available() or torch.cuda.get_device_capability()[0] < 9:
        sys.exit("PDL needs a Hopper (sm_90) or later GPU")
    shape = SHAPES[args.shape]
    model_dir = args.model_dir or Path(tempfile.gettempdir()) / f"lorafleet-bench-{args.shape}"
    make_model(model_dir, shape, torch.device("cuda"))
    n = max(args.batches)
    cores = {on: engine(model_dir, args.batches, n, args.pool_gib, on) for on in (True, False)}
    keys = [AdapterKey(f"p/a{i}", 1) for i in range(n)]
    base = shape.base()
    for i, key in enumerate(keys):
        files = synthetic_adapter(base, rank=8, alpha=16.0, seed=i,
                                  modules=("q_proj", "k_proj", "v_proj", "o_proj"))  # fmt: skip
        for core in cores.values():
            core.add_adapter(key, files.config_json, files.safetensors)
    gen = torch.Generator().manual_seed(0)
    rows = []
    print(f"{'batch':>5} {'adapters':>8} {'PDL ms':>8} {'plain ms':>8} {'ratio':>6}  path")
    for b in args.batches:
        for label, adapters in (("base", None), ("S1 r8", keys[:b])):
            ms = {on: decode_ms(cores[on], on, b, adapters, args, gen, shape)
                  for on in (True, False)}  # fmt: skip
            row = {"batch": b, "adapters": label, "pdl": ms[True], "plain": ms[False],
                   "ratio": ms[True]["gpu_ms"] / ms[False]["gpu_ms"]}  # fmt: skip
            rows.append(row)
            print(f"{b:>5} {label:>8} {ms[True]['gpu_ms']:8.3f} {ms[False]['gpu_ms']:8.3f} "
                  f"{row['ratio']:6.3f}  {ms[True]['path']}", flush=True)  # fmt: skip
            write(args, rows)  # after each row: a run cut short keeps what it measured
    print(f"wrote {args.out}")


def write(args, rows: list[dict]) -> None:
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps({
        "benchmark": "decode step GPU time, the step's Triton kernels PDL-launched against plain",
        "shape": args.shape, "context": args.context, "gpu": torch.cuda.get_device_name(),
        "machine": {"python": platform.python_version(), "torch": torch.__version__},
        "command": "python bench/pdl.py " + " ".join(sys.argv[1:]), "rows": rows,
    }, indent=2) + "\n")  # fmt: skip


if __name__ == "__main__":
    main()
