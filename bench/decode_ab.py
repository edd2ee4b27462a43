"""Decode steps of two engines side by side, one with an option on and one with it off (CUDA).

    --compare lora-side-stream  EngineConfig.lora_side_stream: the LoRA deltas of decode-sized
                                steps computed on a second stream beside the base GEMMs, then
                                added (models/llama.py LoraContext), against in place after them
    --compare pdl               programmatic dependent launches of the step's Triton kernels
                                (Hopper; kernels/tiles.py), against LORAFLEET_PDL=0
    --compare lora-pdl          the fused LoRA kernel a dependent launch too, its programs
                                looking up their adapter's rows while the kernel ahead runs
                                (LORAFLEET_LORA_PDL=1: kernels/tiles.py lora_pdl_launch)

Two engines on one GPU in one process, each with its own copy of the model (Llama-7B shape,
bf16), whose decode graphs are captured at the measured batch sizes only. For each batch size,
each engine in turn runs that many requests (``--context`` prompt tokens each) on the base model,
then on distinct q/k/v/o adapters (rank 8: S1's; ``--ranks 8 16 32 64``: S2's, one rank after
the other). Its decode steps run under the torch profiler, and each step's GPU span (its first
kernel's start to its last kernel's end, both streams; the host's work between steps excluded)
is reported, the median over ``--steps`` steps, with the ratio on / off; ``step_ms`` in the JSON
is the median of CUDA events around the runner's execute, which also holds the host's work
before the graph replay. The JSON is written after each row, so a run cut short keeps what it
measured. With ``--trace DIR``, the profiled steps at the ``--trace-batch`` rows are also
written as Chrome traces in DIR, and a kernel table goes in the JSON.

    python bench/decode_ab.py --compare lora-side-stream [--batches 1 16 32 64 128] [--steps 16]
    python bench/decode_ab.py --compare pdl --out bench/results/pdl.json
    python bench/decode_ab.py --compare lora-pdl --batches 16 64 256 512
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
from bench.step_profile import kernel_table, submit, timed_step, until_decoding  # noqa: E402
from kernels.tiles import LORA_PDL_ENV, PDL_ENV, lora_pdl_launch, pdl_launch  # noqa: E402
from services.inference.engine.api import AdapterKey  # noqa: E402
from services.inference.engine.config import EngineConfig  # noqa: E402
from services.inference.engine.core import EngineCore  # noqa: E402
from store.synthetic import synthetic_adapter  # noqa: E402

COMPARES = ("lora-side-stream", "pdl", "lora-pdl")


def set_pdl(on: bool) -> None:
    """Kernels launched from now on take PDL or not (graphs keep what they captured)."""
    os.environ[PDL_ENV] = "1" if on else "0"
    pdl_launch.cache_clear()


def set_lora_pdl(on: bool) -> None:
    """The fused LoRA kernel launched from now on is a dependent launch or not."""
    os.environ[LORA_PDL_ENV] = "1" if on else "0"
    lora_pdl_launch.cache_clear()


class Side:
    """One engine of the comparison: the option on or off."""

    def __init__(self, args, model_dir: Path, adapters: int, on: bool) -> None:
        self.args, self.on = args, on
        self.enter()
        b = max(args.batches)
        self.core = EngineCore(EngineConfig(
            model_dir=model_dir, device="cuda", max_num_seqs=b,
            max_num_batched_tokens=max(2048, b), max_loras=adapters + 8,
            max_lora_rank=max(args.ranks),
            pool_memory_bytes=int(args.pool_gib * 2**30), cuda_graphs=False,
            lora_side_stream=on and args.compare == "lora-side-stream",
        ))  # fmt: skip
        t = time.perf_counter()
        self.core.runner.capture_graphs(sorted(args.batches))
        print(f"{args.compare}={on}: {len(self.core.runner.graph_sizes)} decode sizes captured "
              f"in {time.perf_counter() - t:.0f} s", flush=True)  # fmt: skip

    def enter(self) -> None:
        """What launches from now on need (the eager prefill steps' kernels too)."""
        if self.args.compare == "pdl":
            set_pdl(self.on)
        if self.args.compare == "lora-pdl":
            set_lora_pdl(self.on)

    def decode(self, b: int, keys, gen, shape) -> dict:
        self.enter()
        core, args = self.core, self.args
        new = shape.max_positions - args.context - 8
        submit(core, f"b{b}", b, args.context, new, gen, shape.vocab, keys)
        until_decoding(core)
        timed_step(core)  # one step outside the profiler: its first replay of this graph
        out = self.profiled(args.steps, f"b{b}-{'lora' if keys else 'base'}",
                            args.trace is not None and b in args.trace_batch)  # fmt: skip
        out["path"] = core.runner.last_lora.value
        core.abort_all()
        core.check_integrity()
        return out

    def profiled(self, steps: int, label: str, keep: bool) -> dict:
        """``steps`` steps under the profiler: each step's GPU span (spans()); with ``keep`` the
        Chrome trace in --trace and the kernel table."""
        from torch.profiler import ProfilerActivity, profile

        torch.cuda.synchronize()
        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
            rows = [r for r in (timed_step(self.core) for _ in range(steps)) if r is not None]
            torch.cuda.synchronize()
        name = f"{self.args.compare}-{'on' if self.on else 'off'}-{label}.json"
        if keep:
            self.args.trace.mkdir(parents=True, exist_ok=True)
            path = self.args.trace / name
        else:
            path = Path(tempfile.mkdtemp()) / name
        prof.export_chrome_trace(str(path))
        span = spans(json.loads(path.read_text()), len(rows))
        if not keep:
            path.unlink()
        out = {"gpu_ms": statistics.median(span), "spans_ms": span,
               "step_ms": statistics.median(r["gpu_ms"] for r in rows),
               "graph_steps": sum(r["graph"] for r in rows), "steps": len(rows)}  # fmt: skip
        if keep:
            out["kernels"] = kernel_table(prof)
        return out


def kv_gib(shape, seqs: int, tokens: int) -> float:
    """GiB of K and V (bf16) that ``seqs`` sequences of ``tokens`` tokens hold: a batch the pool
    cannot hold would be preempted over and over instead of measured."""
    kv_dim = shape.kv_heads * (shape.hidden // shape.heads)
    return seqs * tokens * shape.layers * 2 * kv_dim * 2 / 2**30


def spans(trace: dict, steps: int) -> list[float]:
    """Each step's GPU span in ms, from a Chrome trace of ``steps`` steps: the kernels in time
    order, cut at the ``steps - 1`` widest gaps between one kernel's end and the next one's start
    (the host's work between steps, milliseconds, against microseconds within a step)."""
    ev = sorted((e["ts"], e["ts"] + e["dur"]) for e in trace["traceEvents"]
                if e.get("cat") == "kernel")  # fmt: skip
    if len(ev) < steps:
        raise RuntimeError(f"the profiler saw {len(ev)} kernels in {steps} steps")
    ends = [ev[0][1]]
    for _, end in ev[1:]:
        ends.append(max(ends[-1], end))
    by_gap = sorted(range(1, len(ev)), key=lambda i: ev[i][0] - ends[i - 1])
    cuts = [0, *sorted(by_gap[len(ev) - steps :]), len(ev)]
    return [(ends[j - 1] - ev[i][0]) / 1e3 for i, j in zip(cuts, cuts[1:], strict=False)]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--compare", choices=COMPARES, required=True)
    parser.add_argument("--shape", choices=sorted(SHAPES), default="llama-7b")
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 16, 32, 64, 128])
    parser.add_argument("--context", type=int, default=384, help="prompt tokens per sequence")
    parser.add_argument("--steps", type=int, default=16)
    parser.add_argument("--ranks", type=int, nargs="+", default=[8], help="adapter i: rank i%%n")
    parser.add_argument("--pool-gib", type=float, default=30.0, help="page pool per engine")
    parser.add_argument("--trace", type=Path, default=None, help="Chrome traces into this dir")
    parser.add_argument("--trace-batch", type=int, nargs="+", default=[16])
    parser.add_argument("--model-dir", type=Path, default=None)
    parser.add_argument("--out", type=Path, default=None,
                        help="default bench/results/decode_ab_<compare>.json")  # fmt: skip
    args = parser.parse_args()
    if not torch.cuda.is_available():
        sys.exit("decode_ab compares CUDA engines: no CUDA device here")
    if args.compare in ("pdl", "lora-pdl") and torch.cuda.get_device_capability()[0] < 9:
        sys.exit("PDL needs a Hopper (sm_90) or later GPU")
    stem = args.compare.replace("-", "_")
    args.out = args.out or REPO / "bench" / "results" / f"decode_ab_{stem}.json"
    shape = SHAPES[args.shape]
    n = max(args.batches)
    kv = kv_gib(shape, n, args.context + args.steps + 24)  # + the steps, a page of slack each
    if kv > args.pool_gib:
        sys.exit(f"batch {n} at context {args.context} needs {kv:.1f} GiB of KV cache alone, "
                 f"more than --pool-gib {args.pool_gib:g} (each engine's page pool): give a "
                 "shorter --context or a larger pool (both engines' pools and models share the "
                 "GPU)")  # fmt: skip
    model_dir = args.model_dir or Path(tempfile.gettempdir()) / f"lorafleet-bench-{args.shape}"
    make_model(model_dir, shape, torch.device("cuda"))
    sides = {on: Side(args, model_dir, n, on) for on in (True, False)}
    keys = [AdapterKey(f"p/a{i}", 1) for i in range(n)]
    base = shape.base()
    for i, key in enumerate(keys):
        rank = args.ranks[i % len(args.ranks)]
        files = synthetic_adapter(base, rank=rank, alpha=2.0 * rank, seed=i,
                                  modules=("q_proj", "k_proj", "v_proj", "o_proj"))  # fmt: skip
        for side in sides.values():
            side.core.add_adapter(key, files.config_json, files.safetensors)
    gen = torch.Generator().manual_seed(0)
    rows = []
    lora = "r" + "/".join(map(str, args.ranks))
    print(f"{'batch':>5} {'adapters':>8} {'on ms':>8} {'off ms':>8} {'ratio':>6}  path")
    for b in args.batches:
        for label, adapters in (("base", None), (lora, keys[:b])):
            ms = {on: side.decode(b, adapters, gen, shape) for on, side in sides.items()}
            row = {"batch": b, "adapters": label, "on": ms[True], "off": ms[False],
                   "ratio": ms[True]["gpu_ms"] / ms[False]["gpu_ms"]}  # fmt: skip
            rows.append(row)
            print(f"{b:>5} {label:>8} {ms[True]['gpu_ms']:8.3f} {ms[False]['gpu_ms']:8.3f} "
                  f"{row['ratio']:6.3f}  {ms[True]['path']}", flush=True)  # fmt: skip
            write(args, rows)
    print(f"wrote {args.out}")


def write(args, rows: list[dict]) -> None:
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps({
        "benchmark": f"decode step GPU time, {args.compare} on against off",
        "compare": args.compare, "shape": args.shape, "context": args.context,
        "gpu": torch.cuda.get_device_name(),
        "machine": {"python": platform.python_version(), "torch": torch.__version__},
        "command": "python bench/decode_ab.py " + " ".join(sys.argv[1:]), "rows": rows,
    }, indent=2) + "\n")  # fmt: skip


if __name__ == "__main__":
    main()
