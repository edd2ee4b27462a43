"""The CPU serving path's batched kernels against the per-item references they replaced, side
by side: the LoRA hook batched over the step's adapters (kernels/lora_cpu.py) against one
adapter at a time (kernels/lora_ref.py), and paged attention with the decode rows batched over
their sequences (kernels/attention_cpu.py) against one sequence at a time
(kernels/attention_ref.py).

LoRA: one decoder layer's four LoRA calls (q/k/v, o, gate/up, down) on a step's tokens,
adapters of rank 16 on all seven projections, or S2's ranks (8, 16, 32, 64 cycled) with
--ranks s2; the batched path plans a step once (its groups and their pool slots) for all its
layers: timed on a layer of a step planned already, and on the layer that plans it.
Attention: one layer's decode rows, contexts drawn from [16, 512). float32, one thread.
Shapes: the tiny model of the tests and the CPU demo, and a 1B-class one (hidden 2048, GQA
32/8, intermediate 5632). Each case is timed over REPEATS runs after one warm-up; the tables
give ms a layer and the batched path's speedup.

    python bench/cpu_path.py [--ranks 16|s2] [--out bench/results/cpu_path.json]
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

import torch  # noqa: E402

from bench.provenance import write_result  # noqa: E402
from kernels import attention_cpu, attention_ref, lora_cpu, lora_ref  # noqa: E402
from kernels.lora_layout import DOWN, GATE, UP, K, O, Q, V  # noqa: E402
from tests.kernels.pools import build_adapters, build_kv, lora_tokens, token_rows  # noqa: E402

# name: (hidden, kv width = the pool's W, intermediate, heads, head_dim)
SHAPES = {"tiny": (256, 128, 688, 8, 32), "1b": (2048, 512, 5632, 32, 64)}
# decode rows of one attention call
ATTENTION_BATCHES = (8, 32, 128)
# (adapters, decode tokens, prefill tokens on one adapter of their own)
CASES = ((1, 32, 0), (8, 32, 0), (32, 32, 0), (64, 64, 0), (32, 32, 256))
REPEATS = 10


def time_case(shape: str, adapters: int, decode: int, prefill: int, rank_mode: str,
              gen: torch.Generator) -> dict:  # fmt: skip
    hidden, kv, inter, _, _ = SHAPES[shape]
    dims = {Q: (hidden, hidden), K: (hidden, kv), V: (hidden, kv), O: (hidden, hidden),
            GATE: (hidden, inter), UP: (hidden, inter), DOWN: (inter, hidden)}  # fmt: skip
    s2 = (8, 16, 32, 64)
    ranks = [
        {m: (16 if rank_mode == "16" else s2[i % 4]) for m in dims}
        for i in range(adapters + (prefill > 0))
    ]
    setup = build_adapters(ranks, dims, kv, torch.float32, torch.device("cpu"), gen)
    pool = setup.pool[0].nan_to_num(0.0)  # the builder's NaN marks unowned slots
    kind = "distinct" if adapters >= decode else "uniform"
    rows = token_rows(kind, decode, adapters, gen, grouped=True)
    if prefill:
        rows = torch.cat([rows, torch.full((prefill,), adapters, dtype=torch.int32)])
    tokens = lora_tokens(rows, torch.device("cpu"))
    t = rows.numel()
    max_rank = max(max(r.values()) for r in ranks)
    calls = (((Q, K, V), (hidden, kv, kv), hidden), ((O,), (hidden,), hidden),
             ((GATE, UP), (inter, inter), hidden), ((DOWN,), (hidden,), inter))  # fmt: skip
    xs = {d: torch.randn(t, d, generator=gen) for d in (hidden, inter)}
    out = {"shape": shape, "ranks": rank_mode, "adapters": adapters, "decode_tokens": decode,
           "prefill_tokens": prefill}  # fmt: skip
    # The batched path plans a step once (groups, pool slots) for all its layers: "batched" is
    # a layer of a step planned already, "batched_first_layer" one that plans it.
    paths = (("one_at_a_time", lora_ref.lora_apply, False), ("batched", lora_cpu.lora_apply, False),
             ("batched_first_layer", lora_cpu.lora_apply, True))  # fmt: skip
    for name, apply, plans in paths:

        def layer(apply=apply, plans=plans):
            if plans:
                lora_cpu._last = None
            for modules, widths, d_in in calls:
                y = torch.zeros(t, sum(widths))
                apply(y, xs[d_in], pool, setup.index, tokens, modules, widths, max_rank)

        layer()
        start = time.perf_counter()
        for _ in range(REPEATS):
            layer()
        out[f"{name}_ms"] = (time.perf_counter() - start) / REPEATS * 1e3
    out["speedup"] = out["one_at_a_time_ms"] / out["batched_ms"]
    return out


def time_attention(shape: str, batch: int, gen: torch.Generator) -> dict:
    _, kv, _, heads, head_dim = SHAPES[shape]
    lens = torch.randint(16, 512, (batch,), generator=gen).tolist()
    setup = build_kv(lens, [1] * batch, 16, kv, torch.float32, torch.device("cpu"), gen)
    pool = setup.pool_layer.nan_to_num(0.0)  # the builder's NaN marks free pages
    q = torch.randn(batch, heads, head_dim, generator=gen)
    args = (pool, setup.block_tables, setup.seq_lens, setup.query_starts, 16, head_dim**-0.5)
    out = {"shape": shape, "decode_rows": batch, "mean_context": sum(lens) / batch}
    paths = (("one_at_a_time", attention_ref.paged_attention),
             ("batched", attention_cpu.paged_attention))  # fmt: skip
    for name, attend in paths:
        attend(q, *args)
        start = time.perf_counter()
        for _ in range(REPEATS):
            attend(q, *args)
        out[f"{name}_ms"] = (time.perf_counter() - start) / REPEATS * 1e3
    out["speedup"] = out["one_at_a_time_ms"] / out["batched_ms"]
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ranks", choices=("16", "s2"), default="16")
    parser.add_argument("--out", type=Path, default=REPO / "bench" / "results" / "cpu_path.json")
    args = parser.parse_args()
    torch.set_num_threads(1)
    gen = torch.Generator().manual_seed(0)
    rows = [time_case(s, *case, args.ranks, gen) for s in SHAPES for case in CASES]
    print(f"ms a layer (four LoRA calls), float32, one thread, ranks {args.ranks}")
    print(f"{'shape':6} {'adapters':>8} {'decode':>6} {'prefill':>7} {'one at a time':>13} "
          f"{'batched':>8} {'speedup':>7} {'planning layer':>14}")  # fmt: skip
    for r in rows:
        print(f"{r['shape']:6} {r['adapters']:8d} {r['decode_tokens']:6d} "
              f"{r['prefill_tokens']:7d} {r['one_at_a_time_ms']:13.2f} {r['batched_ms']:8.2f} "
              f"{r['speedup']:6.2f}x {r['batched_first_layer_ms']:14.2f}")  # fmt: skip
    attention = [time_attention(s, b, gen) for s in SHAPES for b in ATTENTION_BATCHES]
    print("\nms a layer (decode rows' paged attention), float32, one thread")
    print(f"{'shape':6} {'rows':>5} {'mean context':>12} {'one at a time':>13} {'batched':>8} "
          f"{'speedup':>7}")  # fmt: skip
    for r in attention:
        times = f"{r['one_at_a_time_ms']:13.2f} {r['batched_ms']:8.2f} {r['speedup']:6.2f}x"
        print(f"{r['shape']:6} {r['decode_rows']:5d} {r['mean_context']:12.0f} {times}")
    write_result(args.out, "cpu_path.py",
                 {"benchmark": "cpu_path", "lora": rows, "attention": attention})  # fmt: skip


if __name__ == "__main__":
    main()
