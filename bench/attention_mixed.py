"""Paged attention in mixed steps (decode rows and prefill chunks in one call), per prefill
launch: which block sizes the prefill kernel should take beside a decode batch. Llama-7B
attention (32 heads of 128, MHA), bf16, random K/V on shuffled pages, timed with
triton.testing.do_bench (median).

    python bench/attention_mixed.py --out bench/results/attention_mixed.json
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

import torch  # noqa: E402
import triton  # noqa: E402

from kernels import attention  # noqa: E402

SCENARIOS = {  # (decode sequences, their context), [(prefill context, prefill queries)]
    "272 decodes + one 400-token prompt": ((272, 390), [(400, 400)]),
    "25 decodes + one 260-token prompt": ((25, 390), [(260, 260)]),
    "128 decodes + four 480-token prompts": ((128, 390), [(480, 480)] * 4),
    "64 decodes + a 1000-token chunk at 3000": ((64, 390), [(3000, 1000)]),
}
LAUNCHES = [(16, 64), (32, 64), (64, 64), (32, 32), (128, 64)]


def build(decode, prefills, page=16, heads=32, hd=128, device="cuda"):
    lens = [decode[1]] * decode[0] + [c for c, _ in prefills]
    queries = [1] * decode[0] + [q for _, q in prefills]
    pages = [-(-n // page) for n in lens]
    total = sum(pages) + 8
    w = heads * hd
    pool = torch.randn(2, total * page, w, device=device, dtype=torch.bfloat16)
    perm = torch.randperm(total, device=device).to(torch.int32)
    tables = torch.zeros(len(lens), max(pages), dtype=torch.int32, device=device)
    used = 0
    for b, n in enumerate(pages):
        tables[b, :n] = perm[used : used + n]
        used += n
    starts = torch.tensor([0] + queries, device=device).cumsum(0).to(torch.int32)
    seq_lens = torch.tensor(lens, dtype=torch.int32, device=device)
    q = torch.randn(sum(queries), heads, hd, device=device, dtype=torch.bfloat16)
    kv_bytes = sum(lens) * 2 * w * 2
    return q, pool, tables, seq_lens, starts, kv_bytes


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=REPO / "bench/results/attention_mixed.json")
    args = parser.parse_args()
    rows = {}
    for name, (decode, prefills) in SCENARIOS.items():
        q, pool, tables, seq_lens, starts, kv_bytes = build(decode, prefills)
        args_ = (q, pool, tables, seq_lens, starts, 16, 0.088)
        out = torch.empty_like(q)
        row = {}
        for bq, bn in LAUNCHES:
            cfg = attention.PrefillLaunch(block_q=bq, block_n=bn)

            def call(cfg=cfg, args_=args_, out=out):
                attention.paged_attention(*args_, out=out, prefill=cfg)

            ms = triton.testing.do_bench(call, warmup=25, rep=200, return_mode="median")
            row[f"{bq}x{bn}"] = round(1e3 * ms, 1)
        rows[name] = {"us": row, "kv_mb": kv_bytes / 1e6}
        best = min(row, key=row.get)
        print(f"{name:<44}" + "  ".join(f"{k} {v:7.1f}" for k, v in row.items())
              + f"   best {best}", flush=True)  # fmt: skip
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps({
        "benchmark": "paged attention, mixed steps, per prefill launch (us, median)",
        "gpu": torch.cuda.get_device_name(), "results": rows,
        "command": "python bench/attention_mixed.py " + " ".join(sys.argv[1:]),
    }, indent=2) + "\n")  # fmt: skip


if __name__ == "__main__":
    main()
