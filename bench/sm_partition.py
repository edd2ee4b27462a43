"""Whether a mixed step's two kinds of work could share the GPU by SMs (CUDA; a question for the
engine's next design, not what it does now).

bench/mixed_split.py found that a mixed step run as two passes on two streams overlaps nothing:
every kernel of either pass fills the whole GPU, and telling the GEMMs to leave SMs free only
slows them. NanoFlow-style overlap needs each kind of work on its own share of the SMs: the
prompts' GEMMs (tensor cores) on most of them, the decode rows' KV reads (bandwidth) on the
rest, at nearly full bandwidth. This measures the two halves of that question:

- how much read bandwidth ``k`` SMs' worth of programs of one streaming kernel reach (one large
  program an SM, or ``--per-sm`` smaller ones:
  a persistent read of a 3 GB buffer, the KV bytes one layer's attention reads for 450 decode
  rows at 400 tokens of context);
- a prefill-sized GEMM (1536 x 12288 x 4096, bf16: q/k/v of six 256-token prompts; ``--gemms``
  of them one after the other, to weigh GEMMs against the read as a mixed step's layer does:
  five take about its GEMMs' time) on cuBLASLt told to leave ``k`` SMs free, alone and beside
  that read on a second stream.

If the read reaches most of the copy bandwidth on a third of the SMs and the GEMM on the rest
loses about its share of SMs, a partitioned mixed step takes the longer of the two, not their
sum.

    python bench/sm_partition.py [--sms 16 33 48 66] [--block 32768] [--warps 16] [--gemms 5] \
        [--per-sm 1] [--out bench/results/sm_partition.json]

Measured (H200, 2026-12-03, sm_partition*.json): with 64 KB read a step the read reaches 3.70
TB/s on 48 SMs and 4.23 on 66 (1.58 on 48 with 16 KB a step); five GEMMs (993 µs on every SM)
beside it take 1406 µs with 33 SMs given to the read, against 1657 one after the other and 1825
on two streams without a partition.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

import torch  # noqa: E402
import triton  # noqa: E402
import triton.language as tl  # noqa: E402
from triton.testing import do_bench  # noqa: E402

from bench import kernels as kb  # noqa: E402
from bench.provenance import write_result  # noqa: E402

READ_BYTES = 450 * 400 * 2 * 4096 * 2  # K and V of 450 rows at 400 tokens, one layer, bf16
GEMM = (1536, 12288, 4096)


@triton.jit
def _read(src, out, n_blocks, BLOCK: tl.constexpr):
    """Each program sums every num_programs-th block of src (a persistent streaming read)."""
    pid = tl.program_id(0)
    acc = tl.zeros((BLOCK,), dtype=tl.float32)
    for b in range(pid, n_blocks, tl.num_programs(0)):
        offs = b.to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
        acc += tl.load(src + offs).to(tl.float32)
    tl.store(out + pid * BLOCK + tl.arange(0, BLOCK), acc)


def median_us(fn) -> float:
    return 1000.0 * do_bench(fn, warmup=5, rep=50, return_mode="median")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--sms", type=int, nargs="+", default=[16, 33, 48, 66, 99])
    ap.add_argument("--block", type=int, default=8192)
    ap.add_argument("--warps", type=int, default=16)
    ap.add_argument("--gemms", type=int, default=1, help="GEMMs one after the other")
    ap.add_argument("--per-sm", type=int, default=1, help="read programs per SM of its share")
    ap.add_argument("--out", type=Path, default=REPO / "bench/results/sm_partition.json")
    args = ap.parse_args()
    dev = torch.device("cuda")
    sms = torch.cuda.get_device_properties(dev).multi_processor_count
    n = READ_BYTES // 2 // args.block * args.block
    src = torch.randn(n, dtype=torch.bfloat16, device=dev)
    n_blocks = n // args.block
    sink = torch.empty(sms * args.per_sm * args.block, dtype=torch.float32, device=dev)
    m, nn, k = GEMM
    a = torch.randn(m, k, dtype=torch.bfloat16, device=dev)
    w = torch.randn(nn, k, dtype=torch.bfloat16, device=dev)
    y = torch.empty(m, nn, dtype=torch.bfloat16, device=dev)
    side = torch.cuda.Stream(dev)

    def read(k_sms: int):
        programs = k_sms * args.per_sm
        _read[(programs,)](src, sink, n_blocks, BLOCK=args.block, num_warps=args.warps)

    def gemm():
        for _ in range(args.gemms):
            torch.mm(a, w.t(), out=y)

    def both(k_sms: int):
        main = torch.cuda.current_stream(dev)
        side.wait_stream(main)
        with torch.cuda.stream(side):
            read(k_sms)
        gemm()
        main.wait_stream(side)

    copy_dst = torch.empty_like(src)
    copy_us = median_us(lambda: copy_dst.copy_(src))
    copy_tbs = 2 * src.numel() * 2 / copy_us / 1e6
    with kb.gemm_carveout(None):  # cuBLASLt for every GEMM here, on every SM
        gemm_all = median_us(gemm)
    flops = 2 * m * nn * k * args.gemms
    rows = []
    print(f"copy bandwidth {copy_tbs:.2f} TB/s; GEMM on every SM {gemm_all:.1f} µs "
          f"({flops / gemm_all / 1e6:.0f} TFLOP/s)")  # fmt: skip
    print(f"{'SMs':>4} {'read µs':>8} {'TB/s':>6} {'GEMM µs':>8} {'both µs':>8} {'sum':>8} "
          f"{'max':>8}")  # fmt: skip
    for k_sms in [*args.sms, sms]:
        read(k_sms)
        r = median_us(lambda k_sms=k_sms: read(k_sms))
        with kb.gemm_carveout(k_sms if k_sms < sms else None):
            g = median_us(gemm)
            b = median_us(lambda k_sms=k_sms: both(k_sms))
        tbs = READ_BYTES / r / 1e6
        rows.append({"sms": k_sms, "read_us": round(r, 1), "read_tb_per_s": round(tbs, 2),
                     "gemm_us": round(g, 1), "both_us": round(b, 1)})  # fmt: skip
        print(f"{k_sms:>4} {r:>8.1f} {tbs:>6.2f} {g:>8.1f} {b:>8.1f} {r + gemm_all:>8.1f} "
              f"{max(r, g):>8.1f}", flush=True)  # fmt: skip
    write_result(args.out, "sm_partition.py", {
        "benchmark": "a streaming read on k SMs and a prefill GEMM on the rest, alone and together",
        "gpu": torch.cuda.get_device_name(), "copy_tb_per_s": round(copy_tbs, 2),
        "gemm": list(GEMM), "gemms": args.gemms, "gemm_all_sms_us": round(gemm_all, 1),
        "read_bytes": READ_BYTES, "block": args.block, "warps": args.warps,
        "programs_per_sm": args.per_sm, "rows": rows,
    })  # fmt: skip


if __name__ == "__main__":
    main()
