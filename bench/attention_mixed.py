"""Paged attention in mixed steps (decode rows and prefill chunks in one call) as the engine
runs it: the prefill tiles from a host-built table (kernels/tile_table.py), the prefill kernel
on its own stream beside the decode kernel. Each scenario times the mixed call, its decode rows
alone and its prompts alone: a mixed call near the longer of its two parts runs them side by
side, one near their sum runs them one after the other. Llama-7B attention (32 heads of 128,
MHA), bf16, random K/V on shuffled pages, triton.testing.do_bench (median); scenarios marked
"graph" pad the call as a CUDA graph of the engine pads a mixed step (2048 tokens, 512
sequences).

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
from kernels.tile_table import ATTENTION_BLOCK, EMPTY, max_tiles, query_tiles  # noqa: E402

# name: (decode sequences, their context), [(prefill context, prefill queries)], graph padding
SCENARIOS = {
    "272 decodes + one 400-token prompt": ((272, 390), [(400, 400)], None),
    "25 decodes + one 260-token prompt": ((25, 390), [(260, 260)], None),
    "128 decodes + four 480-token prompts": ((128, 390), [(480, 480)] * 4, None),
    "64 decodes + a 1000-token chunk at 3000": ((64, 390), [(3000, 1000)], None),
    "450 decodes + six 256-token prompts, graph": ((450, 400), [(256, 256)] * 6, (2048, 512)),
    "300 decodes + a 1700-token chunk at 1900, graph": ((300, 400), [(1900, 1700)], (2048, 512)),
}


def build(decode, prefills, pad, page=16, heads=32, hd=128, device="cuda"):
    """The call's arguments: decode sequences first, then the prompts, then (graph) empty
    sequences and padding tokens; and the K/V bytes its decode rows read."""
    lens = [decode[1]] * decode[0] + [c for c, _ in prefills]
    queries = [1] * decode[0] + [q for _, q in prefills]
    t = sum(queries)
    if pad is not None:
        t = pad[0]
        lens += [0] * (pad[1] - len(lens))
        queries += [0] * (pad[1] - len(queries))
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
    starts = [0, *torch.tensor(queries).cumsum(0).tolist()]
    bound = max_tiles(t, ATTENTION_BLOCK, len(lens))
    flat = query_tiles(starts, ATTENTION_BLOCK)
    tiles = torch.tensor(flat + list(EMPTY) * (bound - len(flat) // 3), dtype=torch.int32)
    q = torch.randn(t, heads, hd, device=device, dtype=torch.bfloat16)
    args = (q, pool, tables, torch.tensor(lens, dtype=torch.int32, device=device),
            torch.tensor(starts, dtype=torch.int32, device=device), page, hd**-0.5)  # fmt: skip
    return args, tiles.view(-1, 3).to(device), decode[0] * decode[1] * 2 * w * 2


def time_us(args, tiles) -> float:
    out = torch.empty_like(args[0])

    def call() -> None:
        attention.paged_attention(*args, out=out, prefill_tiles=tiles)

    return 1e3 * triton.testing.do_bench(call, warmup=25, rep=200, return_mode="median")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=REPO / "bench/results/attention_mixed.json")
    args = parser.parse_args()
    from bench.adapter_load import machine

    rows = {}
    print(f"{'scenario':<50} {'mixed':>8} {'decodes':>8} {'prompts':>8}  mixed/max  mixed/sum")
    for name, (decode, prefills, pad) in SCENARIOS.items():
        mixed = time_us(*build(decode, prefills, pad)[:2])
        alone = time_us(*build(decode, [], None)[:2])  # a decode-only call
        prompts = time_us(*build((0, 0), prefills, pad)[:2])
        kv_mb = build(decode, [], None)[2] / 1e6
        rows[name] = {
            "mixed_us": round(mixed, 1),
            "decodes_alone_us": round(alone, 1),
            "prompts_alone_us": round(prompts, 1),
            "decode_kv_mb": round(kv_mb, 1),
        }
        print(
            f"{name:<50} {mixed:8.1f} {alone:8.1f} {prompts:8.1f}  "
            f"{mixed / max(alone, prompts):9.2f}  {mixed / (alone + prompts):9.2f}",
            flush=True,
        )
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps({
        "benchmark": "paged attention, mixed steps as the engine calls it (us, median)",
        "machine": machine(), "results": rows,
        "command": "python bench/attention_mixed.py " + " ".join(sys.argv[1:]),
    }, indent=2) + "\n")  # fmt: skip


if __name__ == "__main__":
    main()
