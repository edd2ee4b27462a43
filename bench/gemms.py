"""The decoder layer's four GEMMs (x · Wᵀ of q/k/v, o, gate/up, down) at a step's token counts,
through each BLAS library PyTorch offers (cuBLAS, cuBLASLt), replayed in CUDA graphs as the
engine runs them; four copies of each weight rotate so that no call finds its weight in the L2.

    python bench/gemms.py --out bench/results/gemms.json
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

import torch  # noqa: E402

from bench.bench_models import SHAPES  # noqa: E402

COPIES = 4  # weight copies a graph cycles through
CALLS = 8  # calls per graph replay


def projections(shape) -> dict[str, tuple[int, int]]:
    """(out, in) of each projection of one layer."""
    head_dim = shape.hidden // shape.heads
    qkv = (shape.heads + 2 * shape.kv_heads) * head_dim
    return {
        "qkv": (qkv, shape.hidden),
        "o": (shape.hidden, shape.heads * head_dim),
        "gate_up": (2 * shape.intermediate, shape.hidden),
        "down": (shape.hidden, shape.intermediate),
    }


def time_us(m: int, n: int, k: int, dtype) -> float:
    """One F.linear of [m, k] x [n, k]ᵀ, median over graph replays of CALLS calls."""
    ws = [torch.randn(n, k, device="cuda", dtype=dtype) for _ in range(COPIES)]
    xs = [torch.randn(m, k, device="cuda", dtype=dtype) for _ in range(COPIES)]
    ys = [torch.empty(m, n, device="cuda", dtype=dtype) for _ in range(COPIES)]

    def calls() -> None:
        for i in range(CALLS):
            # F.linear(x, w) of the engine: x @ wᵀ, one GEMM
            torch.matmul(xs[i % COPIES], ws[i % COPIES].t(), out=ys[i % COPIES])

    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        calls()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        calls()
    times = []
    for _ in range(25):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) * 1e3 / CALLS)
    assert torch.isfinite(ys[0]).all()
    return sorted(times)[len(times) // 2]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shape", choices=sorted(SHAPES), default="llama-7b")
    sizes = [64, 128, 192, 256, 288, 320, 384, 448, 512, 1024, 2048]
    parser.add_argument("--tokens", type=int, nargs="+", default=sizes)
    parser.add_argument("--out", type=Path, default=REPO / "bench" / "results" / "gemms.json")
    args = parser.parse_args()
    from bench.adapter_load import machine
    from bench.roofline import measure_ceilings

    shape = SHAPES[args.shape]
    ceilings = measure_ceilings(torch.device("cuda"))
    libraries = ["cublas", "cublaslt"]
    rows = []
    print(f"{'M':>5} {'proj':>8} " + " ".join(f"{lib + ' us':>12}" for lib in libraries)
          + "   share of bound", flush=True)  # fmt: skip
    for m in args.tokens:
        for name, (n, k) in projections(shape).items():
            row = {"tokens": m, "proj": name}
            for lib in libraries:
                torch.backends.cuda.preferred_blas_library(lib)
                row[lib] = round(time_us(m, n, k, torch.bfloat16), 2)
            bound_us = 1e6 * max(2 * (n * k + m * k + m * n) / ceilings.copy_bytes_per_s,
                                 2 * m * n * k / ceilings.matmul_flops_per_s)  # fmt: skip
            row["bound_us"] = round(bound_us, 2)
            rows.append(row)
            print(f"{m:>5} {name:>8} " + " ".join(f"{row[lib]:>12.1f}" for lib in libraries)
                  + "   " + " ".join(f"{bound_us / row[lib]:.2f}" for lib in libraries),
                  flush=True)  # fmt: skip
    torch.backends.cuda.preferred_blas_library("cublas")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps({
        "benchmark": "decoder layer GEMMs in CUDA graphs, by BLAS library (us per call, median)",
        "shape": args.shape, "ceilings": ceilings._asdict(), "machine": machine(),
        "results": rows, "command": "python bench/gemms.py " + " ".join(sys.argv[1:]),
    }, indent=2) + "\n")  # fmt: skip
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
