"""The decoder layer's four GEMMs (x · Wᵀ of q/k/v, o, gate/up, down) at a step's token counts,
through each BLAS library PyTorch offers (cuBLAS, cuBLASLt), replayed in CUDA graphs as the
engine runs them; four copies of each weight rotate so that no call finds its weight in the L2.

With ``--pads P ...`` (cuBLAS), each GEMM also runs on operands of P more columns: x and W stored
[T, d_in + P] and [d_out, d_in + P], once as views of their first d_in columns (the base GEMM on
a padded layout) and once whole (the GEMM that would also add [T, P] · [d_out, P]ᵀ, a LoRA
delta carried in the padding: h = x · Aᵀ beside x, scale · B beside W); and ``add`` times
y += delta of the output's shape, what any delta added after the GEMM costs at least.

    python bench/gemms.py --out bench/results/gemms.json
    python bench/gemms.py --tokens 1024 2048 --pads 32 64 128 --out bench/results/gemms_pads.json
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


def time_us(m: int, n: int, k: int, dtype, pad: int = 0, whole: bool = False) -> float:
    """One F.linear of [m, k] x [n, k]ᵀ, median over graph replays of CALLS calls; with ``pad``
    the operands are stored with ``pad`` more columns, and the GEMM takes their first k columns
    (views) or, ``whole``, all k + pad."""
    width = k + pad
    ws = [torch.randn(n, width, device="cuda", dtype=dtype) for _ in range(COPIES)]
    xs = [torch.randn(m, width, device="cuda", dtype=dtype) for _ in range(COPIES)]
    if not whole:
        ws, xs = [w[:, :k] for w in ws], [x[:, :k] for x in xs]
    ys = [torch.empty(m, n, device="cuda", dtype=dtype) for _ in range(COPIES)]

    def calls() -> None:
        for i in range(CALLS):
            # F.linear(x, w) of the engine: x @ wᵀ, one GEMM
            torch.matmul(xs[i % COPIES], ws[i % COPIES].t(), out=ys[i % COPIES])

    return _replayed_us(calls, ys[0])


def add_us(m: int, n: int, dtype) -> float:
    """y += delta of [m, n], median over graph replays of CALLS calls."""
    ys = [torch.randn(m, n, device="cuda", dtype=dtype) for _ in range(COPIES)]
    ds = [torch.randn(m, n, device="cuda", dtype=dtype) * 1e-3 for _ in range(COPIES)]

    def calls() -> None:
        for i in range(CALLS):
            ys[i % COPIES].add_(ds[i % COPIES])

    return _replayed_us(calls, ys[0])


def _replayed_us(calls, check: torch.Tensor) -> float:
    """``calls`` captured in a CUDA graph (after one eager run): µs a call, median of 25."""
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
    assert torch.isfinite(check).all()
    return sorted(times)[len(times) // 2]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shape", choices=sorted(SHAPES), default="llama-7b")
    sizes = [64, 128, 192, 256, 288, 320, 384, 448, 512, 1024, 2048]
    parser.add_argument("--tokens", type=int, nargs="+", default=sizes)
    parser.add_argument("--pads", type=int, nargs="*", default=[],
                        help="also time operands of these many more columns (cuBLAS)")  # fmt: skip
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
            torch.backends.cuda.preferred_blas_library("cublas")
            if args.pads:
                row["add_us"] = round(add_us(m, n, torch.bfloat16), 2)
                row["pads"] = {
                    p: {"views": round(time_us(m, n, k, torch.bfloat16, pad=p), 2),
                        "whole": round(time_us(m, n, k, torch.bfloat16, pad=p, whole=True), 2)}
                    for p in args.pads
                }  # fmt: skip
            rows.append(row)
            pads = "".join(f"  +{p}: {v['views']:.1f} / {v['whole']:.1f}"
                           for p, v in row.get("pads", {}).items())  # fmt: skip
            add = f"  add {row['add_us']:.1f}" if "add_us" in row else ""
            print(f"{m:>5} {name:>8} " + " ".join(f"{row[lib]:>12.1f}" for lib in libraries)
                  + "   " + " ".join(f"{bound_us / row[lib]:.2f}" for lib in libraries)
                  + add + pads, flush=True)  # fmt: skip
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps({
        "benchmark": "decoder layer GEMMs in CUDA graphs, by BLAS library (us per call, median); "
        "pads: cuBLAS on operands of P more columns, as views of the first d_in (views) or "
        "whole; add_us: y += delta of the output's shape",
        "shape": args.shape, "ceilings": ceilings._asdict(), "machine": machine(),
        "results": rows, "command": "python bench/gemms.py " + " ".join(sys.argv[1:]),
    }, indent=2) + "\n")  # fmt: skip
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
