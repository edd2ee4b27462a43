"""Whether a decode step's LoRA expand belongs in the kernels that consume the projections (CUDA;
the engine's --lora-consumer-expand, LoraContext.consume, off by default).

By default each LoRA call of a decode step on one-token tiles writes its delta (q/k/v: T x 12288
elements; o: T x 4096) and the base GEMM reads it back as its addend (models/llama.py,
LoraContext.addend): per token and layer 64 KB of the 80 KB the calls move besides the adapters'
weights, which bench/capacity_bound.py counts at about 1.1 points of S1 n = 1000's throughput on
the H200 (bound 0.969 without the activations, 0.958 with them). Here instead a shrink kernel
writes each token's h = A · x (8 floats a slice), the GEMMs run plain, and the kernels that read
their outputs next add scale · h · Bᵀ as they read them: the rotary/KV-write kernel for q/k/v
(kernels/layer_ops.py rope_write_kv) and the residual add + RMSNorm for o (rmsnorm with delta).
The adapters' bytes are the same; the delta never goes to memory.

One Llama-7B layer's decode work around its projections, in a CUDA graph, per layer (4 layers
with their own weights), rank-8 q/k/v/o adapters drawn uniformly from n, the tokens sorted by
adapter as a step's are:

- base: qkv GEMM, rope_write_kv, o GEMM, residual add + RMSNorm;
- today: the same with the engine's LoRA calls before each GEMM (the fused launch on one-token
  pair tiles writing the delta; each GEMM adds onto it);
- consumer: the shrinks, the plain GEMMs, and the two consumer kernels with the expand inside;
  its shrink a program per token and slice (A read per token: from L2 where tokens share it);
- consumer_tiled: the same with the engine's two-launch shrink (kernels/lora.py lora_shrink, on
  the step's tile table: A read once per tile of up to two tokens).

The consumer kernels are the engine's: kernels/lora_consumer.py's shrink, kernels/layer_ops.py's
rope_write_kv and rmsnorm with their LoRA expand (LoraContext.consume).

Each row prints µs a layer and what LoRA adds to base; consumer's outputs (the rotated q, the
K/V written, the normed rows and the residual) are checked against today's first.

    python bench/lora_consumer.py [--cases 64:1000 256:1000 512:1000 512:100] \\
        [--shrink-blocks 1024 2048] [--out bench/results/lora_consumer.json]
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

import torch  # noqa: E402

from bench import kernels as kb  # noqa: E402
from bench.provenance import write_result  # noqa: E402
from kernels import layer_ops, lora, lora_consumer  # noqa: E402
from kernels.lora_layout import K, O, Q, V  # noqa: E402
from kernels.lora_ref import LoraExpand, make_lora_tokens  # noqa: E402

LAYERS = 4
RANK = 8
HALF = kb.HEAD_DIM // 2
MAX_LEN = 4096
EPS = 1e-5


class Layer:
    """One layer's weights, inputs and outputs for a decode step of T tokens."""

    def __init__(self, t: int, pool: torch.Tensor, gen: torch.Generator) -> None:
        def rand(*shape, scale=1.0):
            return (torch.randn(*shape, generator=gen) * scale).to(kb.DT).to(kb.DEV)

        self.pool = pool  # the adapters' pool layer [2, slots, W]
        self.w_qkv = rand(3 * kb.H, kb.H, scale=kb.H**-0.5)
        self.w_o = rand(kb.H, kb.H, scale=kb.H**-0.5)
        self.norm_w = rand(kb.H)
        self.x = rand(t, kb.H)  # the attention norm's output, the qkv GEMM's input
        self.attn = rand(t, kb.H)  # attention's output, the o GEMM's input
        self.resid0 = rand(t, kb.H)
        self.resid = self.resid0.clone()
        self.kv = torch.zeros(2, t, kb.H, dtype=kb.DT, device=kb.DEV)  # one slot a token
        self.qkv = torch.empty(t, 3 * kb.H, dtype=kb.DT, device=kb.DEV)
        self.o = torch.empty(t, kb.H, dtype=kb.DT, device=kb.DEV)
        self.normed: torch.Tensor | None = None  # the residual norm's output, the last run's
        self.h_qkv = torch.empty(t, 3, RANK, dtype=torch.float32, device=kb.DEV)
        self.h_o = torch.empty(t, 1, RANK, dtype=torch.float32, device=kb.DEV)


def run_base(ly: Layer, step: dict) -> None:
    torch.mm(ly.x, ly.w_qkv.t(), out=ly.qkv)
    _rope(ly, step)
    torch.mm(ly.attn, ly.w_o.t(), out=ly.o)
    ly.normed = layer_ops.rmsnorm(ly.resid, ly.norm_w, EPS, delta=ly.o)


def run_today(ly: Layer, step: dict) -> None:
    """As models/llama.py's linear_lora with the addend: the delta first, the GEMM onto it."""
    index, tokens = step["index"], step["tokens"]
    for y, x, w, mods in ((ly.qkv, ly.x, ly.w_qkv, (Q, K, V)), (ly.o, ly.attn, ly.w_o, (O,))):
        lora.lora_apply(y, x, ly.pool, index, tokens, mods, (kb.H,) * len(mods), RANK,
                        fused=True, delta=True)  # fmt: skip
        y.addmm_(x, w.t())
        if y is ly.qkv:
            _rope(ly, step)
    ly.normed = layer_ops.rmsnorm(ly.resid, ly.norm_w, EPS, delta=ly.o)


def run_consumer(ly: Layer, step: dict, tiled: bool = False) -> None:
    index, tokens, pool = step["index"], step["tokens"], ly.pool

    def shrink(x, h, mods):
        if tiled:
            lora.lora_shrink(x, pool, index, step["shrink_tokens"], mods, RANK, out=h)
        else:
            lora_consumer.lora_shrink_tokens(x, pool, index, tokens.token_lora, mods, RANK, h)
        return LoraExpand(h, pool, index, tokens, mods, (kb.H,) * len(mods))

    expand = shrink(ly.x, ly.h_qkv, (Q, K, V))
    torch.mm(ly.x, ly.w_qkv.t(), out=ly.qkv)
    _rope(ly, step, expand)
    expand = shrink(ly.attn, ly.h_o, (O,))
    torch.mm(ly.attn, ly.w_o.t(), out=ly.o)
    ly.normed = layer_ops.rmsnorm(ly.resid, ly.norm_w, EPS, delta=ly.o, lora=expand)


def _rope(ly: Layer, step: dict, expand: LoraExpand | None = None) -> None:
    q, k, v = ly.qkv.view(-1, 3, kb.HEADS, kb.HEAD_DIM).unbind(1)
    layer_ops.rope_write_kv(q, k, v, step["cos"], step["sin"], step["pos"], ly.kv,
                            step["slots"], lora=expand)  # fmt: skip


def run_consumer_tiled(ly: Layer, step: dict) -> None:
    run_consumer(ly, step, tiled=True)


def check(layers: list[Layer], step: dict) -> float:
    """Largest relative difference between today's outputs and each consumer's, layer 0."""
    ly = layers[0]
    outs = []
    for fn in (run_today, run_consumer, run_consumer_tiled):
        ly.resid.copy_(ly.resid0)
        ly.kv.zero_()
        fn(ly, step)
        outs.append([ly.qkv[:, : kb.H].clone(), ly.kv.clone(), ly.normed.clone(), ly.resid.clone()])
    worst = 0.0
    for a, b in [pair for other in outs[1:] for pair in zip(outs[0], other, strict=True)]:
        err = (a.float() - b.float()).abs().max().item() / max(a.float().abs().max().item(), 1e-6)
        worst = max(worst, err)
    return worst


def time_case(t: int, n: int, gen: torch.Generator, shrink_blocks: list[int]) -> dict:
    rows = torch.randint(0, n, (t,), generator=gen).sort().values.to(torch.int32)
    case = kb.build_lora(n, RANK, LAYERS, rows)
    tokens = make_lora_tokens(case.rows, capacity=t + 2, one_token_tiles=True,
                              pair_tiles=True, zeros=True)  # fmt: skip
    inv = 1.0 / (10000 ** (torch.arange(0, HALF, dtype=torch.float32) / HALF))
    ang = torch.arange(MAX_LEN, dtype=torch.float32)[:, None] * inv[None, :]
    shrink_tokens = make_lora_tokens(case.rows, capacity=t + 2, one_token_tiles=True,
                                     pair_tiles=True)  # fmt: skip
    step = dict(index=case.index, tokens=tokens, rows=case.rows, shrink_tokens=shrink_tokens,
                cos=ang.cos().to(kb.DEV), sin=ang.sin().to(kb.DEV),
                pos=torch.randint(0, MAX_LEN, (t,), generator=gen).to(kb.DEV),
                slots=torch.arange(t, dtype=torch.int64, device=kb.DEV))  # fmt: skip
    layers = [Layer(t, case.pool[i], gen) for i in range(LAYERS)]
    err = check(layers, step)
    row = dict(tokens=t, adapters=n, used=int(torch.unique(rows).numel()), max_rel_err=err)
    runs = (("base", run_base), ("today", run_today), ("consumer", run_consumer),
            ("consumer_tiled", run_consumer_tiled))  # fmt: skip
    for name, fn in runs:
        row[f"{name}_us"] = kb.timed(lambda fn=fn: [fn(ly, step) for ly in layers], LAYERS,
                                     eager=False).graph_us  # fmt: skip
    row["today_lora_us"] = round(row["today_us"] - row["base_us"], 2)
    row["consumer_lora_us"] = round(row["consumer_us"] - row["base_us"], 2)
    row["consumer_tiled_lora_us"] = round(row["consumer_tiled_us"] - row["base_us"], 2)
    default = lora_consumer._SHRINK_MAX_BLOCK
    try:
        for block in shrink_blocks:  # the per-token shrink's d_in blocks capped at ``block``
            lora_consumer._SHRINK_MAX_BLOCK = block
            us = kb.timed(lambda: [run_consumer(ly, step) for ly in layers], LAYERS,
                          eager=False).graph_us  # fmt: skip
            row[f"consumer_k{block}_lora_us"] = round(us - row["base_us"], 2)
    finally:
        lora_consumer._SHRINK_MAX_BLOCK = default
    print(row, flush=True)
    return row


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--cases", nargs="+", default=["64:1000", "256:1000", "512:1000", "512:100"],
                    help="decode tokens:adapters they are drawn from")  # fmt: skip
    ap.add_argument("--shrink-blocks", type=int, nargs="*", default=[],
                    help="also time the consumer path with the per-token shrink's d_in blocks "
                    "capped at each of these (powers of two; the default cap: "
                    f"{lora_consumer._SHRINK_MAX_BLOCK})")  # fmt: skip
    ap.add_argument("--out", type=Path, default=REPO / "bench/results/lora_consumer.json")
    args = ap.parse_args()
    gen = torch.Generator().manual_seed(0)
    rows = []
    for c in args.cases:
        t, n = (int(v) for v in c.split(":"))
        rows.append(time_case(t, n, gen, args.shrink_blocks))
    print(f"{'tokens':>6} {'adapters':>8} {'base':>8} {'today':>8} {'consumer':>9} "
          f"{'+today':>7} {'+consumer':>9} {'+tiled':>7}")  # fmt: skip
    for r in rows:
        print(f"{r['tokens']:>6} {r['used']:>8} {r['base_us']:>8} {r['today_us']:>8} "
              f"{r['consumer_us']:>9} {r['today_lora_us']:>7} "
              f"{r['consumer_lora_us']:>9} {r['consumer_tiled_lora_us']:>7}")  # fmt: skip
        for block in args.shrink_blocks:
            print(f"{'':>6} {'':>8} shrink blocks of {block}: +{r[f'consumer_k{block}_lora_us']}")
    write_result(args.out, "lora_consumer.py", {
        "benchmark": "one Llama-7B layer's decode projections and their consumers with S1's "
        "LoRA: the delta through memory (today) against the expand in the consumers",
        "gpu": torch.cuda.get_device_name(), "rows": rows,
    })  # fmt: skip


if __name__ == "__main__":
    main()
