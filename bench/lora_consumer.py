"""Whether a decode step's LoRA expand belongs in the kernels that consume the projections (CUDA;
a question for the engine's next design, not what it does now).

Today each LoRA call of a decode step on one-token tiles writes its delta (q/k/v: T x 12288
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

The consumer kernels are those of kernels/layer_ops.py with the expand added, written out here
(were the design taken, the expand would be an option of those kernels, not copies of them).

Each row prints µs a layer and what LoRA adds to base; consumer's outputs (the rotated q, the
K/V written, the normed rows and the residual) are checked against today's first.

    python bench/lora_consumer.py [--cases 64:1000 256:1000 512:1000 512:100] \\
        [--out bench/results/lora_consumer.json]
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

from bench import kernels as kb  # noqa: E402
from bench.provenance import write_result  # noqa: E402
from kernels import layer_ops, lora  # noqa: E402
from kernels.lora_layout import K, O, Q, V  # noqa: E402
from kernels.lora_ref import make_lora_tokens  # noqa: E402

LAYERS = 4
RANK = 8
HALF = kb.HEAD_DIM // 2
MAX_LEN = 4096
EPS = 1e-5


@triton.jit
def _shrink_kernel(
    x_ptr, stride_x, h_ptr, pool_ptr, stride_slot, table_ptr, stride_table, ranks_ptr, a_off_ptr,
    stride_idx, rows_ptr, M0: tl.constexpr, M1: tl.constexpr, M2: tl.constexpr,
    SLICES: tl.constexpr, D_IN: tl.constexpr, R: tl.constexpr,
):  # fmt: skip
    """Program (t, s): h[t, s, :R] = A_s · x[t] for token t's adapter (zeros without one), every
    load issued at once (one pool chunk holds each A row)."""
    t = tl.program_id(0)
    s = tl.program_id(1)
    m = tl.where(s == 0, M0, tl.where(s == 1, M1, M2))
    a = tl.load(rows_ptr + t)
    a64 = tl.maximum(a, 0).to(tl.int64)
    rank = tl.where(a >= 0, tl.minimum(tl.load(ranks_ptr + a64 * stride_idx + m), R), 0)
    rows = tl.arange(0, R)
    ok = rows < rank
    a_off = tl.load(a_off_ptr + a64 * stride_idx + m)
    slot = tl.load(table_ptr + a64 * stride_table + a_off + rows, mask=ok, other=0).to(tl.int64)
    kk = tl.arange(0, D_IN)
    w = tl.load(pool_ptr + slot[:, None] * stride_slot + kk[None, :], mask=ok[:, None], other=0.0)
    x = tl.load(x_ptr + t.to(tl.int64) * stride_x + kk)
    h = tl.sum(w.to(tl.float32) * x.to(tl.float32)[None, :], axis=1)
    tl.store(h_ptr + (t * SLICES + s) * R + rows, h)


@triton.jit
def _delta(
    h_ptr, t, s, SLICES: tl.constexpr, pool_ptr, stride_half, stride_slot, table_ptr,
    stride_table, ranks_ptr, b_off_ptr, scales_ptr, stride_idx, stride_scale, rows_ptr, m,
    cols, act_ptr, R: tl.constexpr,
):  # fmt: skip
    """scale · h[t, s] · Bᵀ[:, cols] of token t's adapter for module m, fp32 (zeros without
    one); h rounded to act_ptr's dtype first, as the engine's kernels round it. ``cols``: any
    shape of column indices within one pool chunk. Every row's loads are masked, not branched
    on, so that they all go out at once."""
    a = tl.load(rows_ptr + t)
    a64 = tl.maximum(a, 0).to(tl.int64)
    rank = tl.where(a >= 0, tl.minimum(tl.load(ranks_ptr + a64 * stride_idx + m), R), 0)
    b_off = tl.load(b_off_ptr + a64 * stride_idx + m)
    scale = tl.load(scales_ptr + a64 * stride_scale + m)
    acc = tl.zeros(cols.shape, dtype=tl.float32)
    for r in tl.static_range(R):
        on = r < rank
        slot = tl.load(table_ptr + a64 * stride_table + b_off + r, mask=on, other=0).to(tl.int64)
        hr = tl.load(h_ptr + (t * SLICES + s) * R + r, mask=on, other=0.0)
        hr = hr.to(act_ptr.dtype.element_ty).to(tl.float32)
        b = tl.load(pool_ptr + stride_half + slot * stride_slot + cols, mask=on, other=0.0)
        acc += hr * b.to(tl.float32)
    return acc * scale


@triton.jit
def _rope_expand_kernel(
    qkv_ptr, stride_qkv, h_ptr, cos_ptr, sin_ptr, stride_cs, pos_ptr,
    kv_ptr, kv_half, kv_slot, slots_ptr,
    pool_ptr, stride_half, stride_slot, table_ptr, stride_table, ranks_ptr, b_off_ptr,
    scales_ptr, stride_idx, stride_scale, rows_ptr,
    M0: tl.constexpr, M1: tl.constexpr, M2: tl.constexpr,
    HEADS: tl.constexpr, HALF: tl.constexpr, R: tl.constexpr,
):  # fmt: skip
    """Program (t, s): slice s (q, k, v) of token t's fused projection plus its LoRA delta,
    rounded once; q rotated in place, k rotated into the KV pool, v copied there (MHA)."""
    t = tl.program_id(0)
    s = tl.program_id(1)
    m = tl.where(s == 0, M0, tl.where(s == 1, M1, M2))
    dt = qkv_ptr.dtype.element_ty
    hh = tl.arange(0, HEADS)[:, None]
    ii = tl.arange(0, HALF)[None, :]
    c1 = hh * (2 * HALF) + ii  # first halves' columns within the slice
    d1 = _delta(h_ptr, t, s, 3, pool_ptr, stride_half, stride_slot, table_ptr, stride_table,
                ranks_ptr, b_off_ptr, scales_ptr, stride_idx, stride_scale, rows_ptr, m, c1,
                qkv_ptr, R)  # fmt: skip
    d2 = _delta(h_ptr, t, s, 3, pool_ptr, stride_half, stride_slot, table_ptr, stride_table,
                ranks_ptr, b_off_ptr, scales_ptr, stride_idx, stride_scale, rows_ptr, m,
                c1 + HALF, qkv_ptr, R)  # fmt: skip
    row = qkv_ptr + t.to(tl.int64) * stride_qkv + s * (HEADS * 2 * HALF)
    x1 = (tl.load(row + c1).to(tl.float32) + d1).to(dt).to(tl.float32)
    x2 = (tl.load(row + c1 + HALF).to(tl.float32) + d2).to(dt).to(tl.float32)
    t64 = t.to(tl.int64)
    if s == 2:
        slot = tl.load(slots_ptr + t).to(tl.int64)
        dst = kv_ptr + kv_half + slot * kv_slot + c1
        tl.store(dst, x1.to(kv_ptr.dtype.element_ty))
        tl.store(dst + HALF, x2.to(kv_ptr.dtype.element_ty))
        return
    pos = tl.load(pos_ptr + t64).to(tl.int64)
    c = tl.load(cos_ptr + pos * stride_cs + ii).to(dt).to(tl.float32)
    sn = tl.load(sin_ptr + pos * stride_cs + ii).to(dt).to(tl.float32)
    r1 = (x1 * c - x2 * sn).to(dt)
    r2 = (x2 * c + x1 * sn).to(dt)
    if s == 0:
        tl.store(row + c1, r1)
        tl.store(row + c1 + HALF, r2)
    else:
        slot = tl.load(slots_ptr + t).to(tl.int64)
        dst = kv_ptr + slot * kv_slot + c1
        tl.store(dst, r1.to(kv_ptr.dtype.element_ty))
        tl.store(dst + HALF, r2.to(kv_ptr.dtype.element_ty))


@triton.jit
def _norm_expand_kernel(
    x_ptr, stride_x, d_ptr, stride_d, out_ptr, stride_o, w_ptr, eps, h_ptr,
    pool_ptr, stride_half, stride_slot, table_ptr, stride_table, ranks_ptr, b_off_ptr,
    scales_ptr, stride_idx, stride_scale, rows_ptr, M: tl.constexpr, D: tl.constexpr,
    R: tl.constexpr,
):  # fmt: skip
    """Row t: o = the o projection's row plus its LoRA delta (rounded once), x += o in place
    (rounded), out = RMSNorm(x) · w, as layer_ops.rmsnorm with its delta."""
    t = tl.program_id(0)
    dt = x_ptr.dtype.element_ty
    cols = tl.arange(0, D)
    delta = _delta(h_ptr, t, 0, 1, pool_ptr, stride_half, stride_slot, table_ptr, stride_table,
                   ranks_ptr, b_off_ptr, scales_ptr, stride_idx, stride_scale, rows_ptr, M, cols,
                   x_ptr, R)  # fmt: skip
    t64 = t.to(tl.int64)
    o = (tl.load(d_ptr + t64 * stride_d + cols).to(tl.float32) + delta).to(dt)
    x = tl.load(x_ptr + t64 * stride_x + cols)
    x = (x.to(tl.float32) + o.to(tl.float32)).to(dt)
    tl.store(x_ptr + t64 * stride_x + cols, x)
    h = x.to(tl.float32)
    inv = tl.rsqrt(tl.sum(h * h, 0) / D + eps)
    h = (h * inv).to(dt).to(tl.float32)
    w = tl.load(w_ptr + cols).to(tl.float32)
    tl.store(out_ptr + t64 * stride_o + cols, (w * h).to(dt))


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
        self.normed = torch.empty(t, kb.H, dtype=kb.DT, device=kb.DEV)  # base's and today's
        self.normed_c = torch.empty(t, kb.H, dtype=kb.DT, device=kb.DEV)  # consumer's
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
    index, rows, t = step["index"], step["rows"], ly.x.shape[0]
    pool = ly.pool
    idx = (pool[0], pool.stride(1), index.slot_table, index.slot_table.stride(0), index.ranks)

    def shrink(x, h, mods):
        if tiled:
            lora.lora_shrink(x, pool, index, step["shrink_tokens"], mods, RANK, out=h)
            return
        m = list(mods) + [mods[-1]] * (3 - len(mods))
        _shrink_kernel[(t, len(mods))](x, x.stride(0), h, *idx, index.a_offsets,
                                       index.ranks.stride(0), rows, M0=m[0], M1=m[1], M2=m[2],
                                       SLICES=len(mods), D_IN=kb.H, R=RANK,
                                       num_warps=8)  # fmt: skip

    shrink(ly.x, ly.h_qkv, (Q, K, V))
    torch.mm(ly.x, ly.w_qkv.t(), out=ly.qkv)
    b_args = (pool, pool.stride(0), pool.stride(1), index.slot_table, index.slot_table.stride(0),
              index.ranks, index.b_offsets, index.scales, index.ranks.stride(0),
              index.scales.stride(0), rows)  # fmt: skip
    _rope_expand_kernel[(t, 3)](
        ly.qkv, ly.qkv.stride(0), ly.h_qkv, step["cos"], step["sin"], step["cos"].stride(0),
        step["pos"], ly.kv, ly.kv.stride(0), ly.kv.stride(1), step["slots"], *b_args,
        M0=Q, M1=K, M2=V, HEADS=kb.HEADS, HALF=HALF, R=RANK, num_warps=8,
    )  # fmt: skip
    shrink(ly.attn, ly.h_o, (O,))
    torch.mm(ly.attn, ly.w_o.t(), out=ly.o)
    _norm_expand_kernel[(t,)](
        ly.resid, ly.resid.stride(0), ly.o, ly.o.stride(0), ly.normed_c, ly.normed_c.stride(0),
        ly.norm_w, EPS, ly.h_o, *b_args, M=O, D=kb.H, R=RANK, num_warps=16,
    )  # fmt: skip


def _rope(ly: Layer, step: dict) -> None:
    q, k, v = ly.qkv.view(-1, 3, kb.HEADS, kb.HEAD_DIM).unbind(1)
    layer_ops.rope_write_kv(q, k, v, step["cos"], step["sin"], step["pos"], ly.kv,
                            step["slots"])  # fmt: skip


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
        normed = ly.normed if fn is run_today else ly.normed_c
        outs.append([ly.qkv[:, : kb.H].clone(), ly.kv.clone(), normed.clone(), ly.resid.clone()])
    worst = 0.0
    for a, b in [pair for other in outs[1:] for pair in zip(outs[0], other, strict=True)]:
        err = (a.float() - b.float()).abs().max().item() / max(a.float().abs().max().item(), 1e-6)
        worst = max(worst, err)
    return worst


def time_case(t: int, n: int, gen: torch.Generator) -> dict:
    rows = torch.randint(0, n, (t,), generator=gen).sort().values.to(torch.int32)
    case = kb.build_lora(n, RANK, LAYERS, rows)
    tokens = make_lora_tokens(case.rows, capacity=min(n, t) + 2, one_token_tiles=True,
                              pair_tiles=True, zeros=True)  # fmt: skip
    inv = 1.0 / (10000 ** (torch.arange(0, HALF, dtype=torch.float32) / HALF))
    ang = torch.arange(MAX_LEN, dtype=torch.float32)[:, None] * inv[None, :]
    shrink_tokens = make_lora_tokens(case.rows, capacity=min(n, t) + 2, one_token_tiles=True,
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
    print(row, flush=True)
    return row


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--cases", nargs="+", default=["64:1000", "256:1000", "512:1000", "512:100"],
                    help="decode tokens:adapters they are drawn from")  # fmt: skip
    ap.add_argument("--out", type=Path, default=REPO / "bench/results/lora_consumer.json")
    args = ap.parse_args()
    gen = torch.Generator().manual_seed(0)
    rows = []
    for c in args.cases:
        t, n = (int(v) for v in c.split(":"))
        rows.append(time_case(t, n, gen))
    print(f"{'tokens':>6} {'adapters':>8} {'base':>8} {'today':>8} {'consumer':>9} "
          f"{'+today':>7} {'+consumer':>9} {'+tiled':>7}")  # fmt: skip
    for r in rows:
        print(f"{r['tokens']:>6} {r['used']:>8} {r['base_us']:>8} {r['today_us']:>8} "
              f"{r['consumer_us']:>9} {r['today_lora_us']:>7} "
              f"{r['consumer_lora_us']:>9} {r['consumer_tiled_lora_us']:>7}")  # fmt: skip
    write_result(args.out, "lora_consumer.py", {
        "benchmark": "one Llama-7B layer's decode projections and their consumers with S1's "
        "LoRA: the delta through memory (today) against the expand in the consumers",
        "gpu": torch.cuda.get_device_name(), "rows": rows,
    })  # fmt: skip


if __name__ == "__main__":
    main()
