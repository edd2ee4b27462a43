"""Decode time per output token with the model sharded over N GPUs, against one GPU.

The tensor-parallel issue's comparison (Llama-7B shape, bf16: TP = 2 against TP = 1, decode
TPOT at batch 64). Each tensor-parallel size runs an engine in a process of its own, so that
each starts on empty GPUs with its workers beside it, with the engine's default CUDA graphs
and random weights (--load-format random). For each batch size, that many requests of
``--context`` prompt tokens on the base model, then on as many distinct rank ``--rank`` q/k/v/o
adapters (S1r16's; ``--adapter-files`` distinct weight files, cycled over the adapters, which
are distinct to the engine all the same); once all of them decode, ``--steps`` decode steps are
driven as the engine's step loop drives them (step t + 1 launched before step t's tokens are
read). TPOT is the median time between two steps' tokens reaching the host. On CUDA, the rows
of ``--profile-batch`` (64) run as many steps again under the torch profiler, which gives rank
0's kernel time per step and the NCCL kernels' part of it (all-reduces, sampled tokens).

Each row's bound is the step's bytes (every weight, the KV cache read and written, each distinct
adapter's A and B) over N times one GPU's copy bandwidth, measured in the same run: each rank
moves 1/N of them (embeddings and lm_head, replicated, are counted once: the bound is a little
low for N > 1). share = bound / TPOT; ratio = TPOT at N / TPOT at 1.

    python bench/tp_decode.py                        # CUDA, Llama-7B shape, TP 1 and 2
    python bench/tp_decode.py --shape tiny --device cpu --batches 2 4 --context 16 --steps 4
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

import torch  # noqa: E402

from bench.bench_models import SHAPES, make_model  # noqa: E402
from bench.provenance import write_result  # noqa: E402
from bench.roofline import Ceilings, Roofline, measure_ceilings_subprocess  # noqa: E402
from bench.step_profile import kernel_table, submit, until_decoding  # noqa: E402
from services.inference.engine.api import AdapterKey  # noqa: E402
from services.inference.engine.config import EngineConfig  # noqa: E402
from services.inference.engine.core import EngineCore  # noqa: E402
from store.synthetic import synthetic_adapter  # noqa: E402

MODULES = ("q_proj", "k_proj", "v_proj", "o_proj")


def device_ms(prof, name_part: str) -> float:
    """GPU time in ms of the profiled kernels whose name holds ``name_part`` (the attribute's
    name differs between torch versions)."""
    total = 0.0
    for evt in prof.key_averages():
        if name_part in evt.key.lower():
            us = getattr(evt, "self_device_time_total", None)
            total += getattr(evt, "self_cuda_time_total", 0.0) if us is None else us
    return total / 1e3


def overlapped(core: EngineCore, launched, steps: int, done: list[float] | None = None):
    """``steps`` steps as the engine's step loop runs them: step t + 1 launched before step t
    is finished; ``done`` gets the time each finish returned. The step still in flight."""
    for _ in range(steps):
        following = core.launch()
        core.finish(launched)
        if done is not None:
            done.append(time.perf_counter())
        launched = following
    return launched


def decode_tpot(core: EngineCore, args, batch: int, adapters, gen, vocab: int) -> dict:
    """``batch`` requests decoding together; the overlapped loop's time per step, and on CUDA at
    --profile-batch the kernels of as many more steps under the profiler: the NCCL kernels'
    share (the all-reduces and the sampled tokens' broadcast) beside all kernels'."""
    label = "lora" if adapters else "base"
    profiled = core.device.type == "cuda" and batch == args.profile_batch
    new = args.steps * (2 if profiled else 1) + 8
    submit(core, f"b{batch}-{label}", batch, args.context, new, gen, vocab, adapters)
    until_decoding(core)
    if len(core.scheduler.running) != batch:
        raise RuntimeError(f"{len(core.scheduler.running)} of {batch} requests run: a larger "
                           "--pool-gib or a shorter --context")  # fmt: skip
    graphs = core.runner.graph_steps
    done: list[float] = []
    launched = overlapped(core, core.launch(), args.steps, done)
    kernels = {}
    if profiled:
        from torch.profiler import ProfilerActivity, profile

        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
            launched = overlapped(core, launched, args.steps)
            torch.cuda.synchronize()
        kernels = {
            "kernel_ms_per_step": device_ms(prof, "") / args.steps,
            "nccl_ms_per_step": device_ms(prof, "nccl") / args.steps,
            "kernels": kernel_table(prof, 15),
        }
    if launched is not None:
        core.finish(launched)
    path = core.runner.last_lora.value
    core.abort_all()
    core.check_integrity()  # every rank's pool, index and graph replays
    gaps = [1e3 * (b - a) for a, b in zip(done, done[1:], strict=False)]
    return {
        "tpot_ms": statistics.median(gaps),
        "gaps_ms": gaps,
        "graph_steps": core.runner.graph_steps - graphs,
        "lora_path": path,
        **kernels,
    }


def child(args) -> None:
    """One tensor-parallel size: every batch, base and adapters; JSON rows to --part."""
    cuda = args.device == "cuda"
    shape = SHAPES[args.shape]
    batch = max(args.batches)
    core = EngineCore(EngineConfig(
        model_dir=args.model_dir, device=args.device, dtype="bfloat16" if cuda else "float32",
        load_format="random", tensor_parallel_size=args.child, max_num_seqs=batch,
        max_num_batched_tokens=max(args.step_tokens, batch), max_loras=batch,
        max_lora_rank=args.rank,
        pool_memory_bytes=None if args.pool_gib is None else int(args.pool_gib * 2**30),
    ))  # fmt: skip
    try:
        files = [
            synthetic_adapter(
                shape.base(), rank=args.rank, alpha=2.0 * args.rank, modules=MODULES, seed=i
            )  # fmt: skip
            for i in range(min(args.adapter_files, batch))
        ]
        keys = [AdapterKey(f"tp/a{i}", 1) for i in range(batch)]
        for i, key in enumerate(keys):
            f = files[i % len(files)]
            core.add_adapter(key, f.config_json, f.safetensors)
        gen = torch.Generator().manual_seed(0)
        rows = []
        for b in args.batches:
            for adapters in (None, keys[:b]):
                row = {"batch": b, "adapters": len(adapters or ())}
                row.update(decode_tpot(core, args, b, adapters, gen, shape.vocab))
                rows.append(row)
                nccl = ""
                if "nccl_ms_per_step" in row:
                    nccl = (f"; kernels {row['kernel_ms_per_step']:.3f} ms a step, NCCL's "
                            f"{row['nccl_ms_per_step']:.3f}")  # fmt: skip
                print(f"tp {args.child} batch {b:>4} adapters {row['adapters']:>4}: "
                      f"{row['tpot_ms']:.3f} ms ({row['graph_steps']} graph steps{nccl})",
                      flush=True)  # fmt: skip
    finally:
        core.close()
    args.part.write_text(json.dumps({"rows": rows, "graphs": core.runner.graph_sizes}) + "\n")


def adapter_bytes(shape, rank: int, distinct: int) -> int:
    """A and B of ``distinct`` rank-``rank`` q/k/v/o adapters, bf16, every layer."""
    kv = shape.kv_heads * (shape.hidden // shape.heads)
    dims = 3 * shape.hidden + shape.hidden + 2 * (shape.hidden + kv)  # in + out of q, o, k, v
    return distinct * shape.layers * rank * dims * 2


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shape", choices=sorted(SHAPES), default="llama-7b")
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--tensor-parallel", type=int, nargs="+", default=[1, 2])
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 16, 64, 128])
    parser.add_argument("--context", type=int, default=384, help="prompt tokens per request")
    parser.add_argument("--steps", type=int, default=32, help="decode steps timed per row")
    parser.add_argument("--rank", type=int, default=16)
    parser.add_argument("--adapter-files", type=int, default=8)
    parser.add_argument(
        "--profile-batch",
        type=int,
        default=64,
        help="CUDA: this batch's steps also run under the profiler",
    )
    parser.add_argument(
        "--step-tokens",
        type=int,
        default=1024,
        help="max_num_batched_tokens (the mixed graphs' largest step)",
    )
    parser.add_argument(
        "--pool-gib",
        type=float,
        default=None,
        help="page pool per rank (default: 40 on CUDA, the engine's on the CPU)",
    )
    parser.add_argument("--model-dir", type=Path, default=None)
    parser.add_argument("--child", type=int, default=None, help=argparse.SUPPRESS)
    parser.add_argument("--part", type=Path, default=None, help=argparse.SUPPRESS)
    parser.add_argument("--out", type=Path, default=REPO / "bench" / "results" / "tp_decode.json")
    args = parser.parse_args()
    if args.child is not None:
        return child(args)
    if args.device == "cuda" and torch.cuda.device_count() < max(args.tensor_parallel):
        sys.exit(f"--tensor-parallel {max(args.tensor_parallel)} needs as many GPUs; "
                 f"torch sees {torch.cuda.device_count()}")  # fmt: skip
    if args.pool_gib is None and args.device == "cuda":
        args.pool_gib = 40.0
    shape = SHAPES[args.shape]
    model_dir = args.model_dir or Path(tempfile.gettempdir()) / f"lorafleet-tp-{args.shape}"
    make_model(model_dir, shape, torch.device(args.device), weights=False)
    one = measure_ceilings_subprocess(args.device)  # this process keeps off the GPUs
    results = {}
    for n in args.tensor_parallel:
        part = Path(tempfile.mkdtemp()) / f"tp{n}.json"
        command = [sys.executable, __file__, "--child", str(n), "--part", str(part),
                   "--model-dir", str(model_dir)]  # fmt: skip
        for flag in ("shape", "device", "context", "steps", "rank", "adapter_files",
                     "step_tokens", "pool_gib", "profile_batch"):  # fmt: skip
            value = getattr(args, flag)
            if value is not None:
                command += [f"--{flag.replace('_', '-')}", str(value)]
        command += ["--batches", *map(str, args.batches)]
        start = time.perf_counter()
        subprocess.run(command, check=True)
        results[n] = json.loads(part.read_text())
        print(f"tp {n}: {time.perf_counter() - start:.0f} s with start-up", flush=True)
    rows = table(args, shape, one, results)
    write_result(args.out, "tp_decode.py", {
        "benchmark": "decode TPOT, the model over N GPUs against one",
        "shape": args.shape, "context": args.context, "rank": args.rank,
        "device": torch.cuda.get_device_name() if args.device == "cuda" else platform.processor(),
        "machine": {"python": platform.python_version(), "torch": torch.__version__},
        "ceilings_one_gpu": one._asdict(), "rows": rows,
        "graph_sizes": {n: r["graphs"] for n, r in results.items()},
    })  # fmt: skip


def table(args, shape, one: Ceilings, results: dict) -> list[dict]:
    sizes = sorted(results)
    first = sizes[0]
    head = "".join(f" {'TP ' + str(n) + ' ms':>9} {'share':>6}" for n in sizes)
    head += "".join(f" {f'{n}/{first}':>6}" for n in sizes[1:])
    print(f"{'batch':>5} {'adapters':>8}{head}")
    out = []
    dtype_bytes = 2 if args.device == "cuda" else 4
    for i, base in enumerate(results[first]["rows"]):
        b, n_adapters = base["batch"], base["adapters"]
        kv_read = b * (args.context + args.steps // 2 + 1)  # the middle timed step's context
        lora = adapter_bytes(shape, args.rank, min(n_adapters, b))
        row = {"batch": b, "adapters": n_adapters, "by_tp": {}}
        line = f"{b:>5} {n_adapters:>8}"
        for n in sizes:
            got = results[n]["rows"][i]
            ceil = Ceilings(one.copy_bytes_per_s * n, one.matmul_flops_per_s * n)
            roof = Roofline.for_shape(shape, ceil, dtype_bytes=dtype_bytes)
            bound = roof.step_bound_ms(b, kv_read, b, adapter_bytes=lora)
            got = {**got, "bound_ms": bound, "share": bound / got["tpot_ms"]}
            row["by_tp"][n] = got
            line += f" {got['tpot_ms']:9.3f} {got['share']:6.2f}"
        for n in sizes[1:]:
            ratio = row["by_tp"][n]["tpot_ms"] / row["by_tp"][first]["tpot_ms"]
            row[f"ratio_{n}_{first}"] = ratio
            line += f" {ratio:6.3f}"
        print(line, flush=True)
        out.append(row)
    return out


if __name__ == "__main__":
    main()
