"""A mixed step's prompt LoRA inside the base GEMM's reduction, against the engine's path (CUDA).

The engine's prefill-sized mixed steps run every LoRA call on the fused kernel, which writes
each token's delta (zeros without one) for the base GEMM to add onto (LoraContext.addend): the
prompts' tokens, most of the step, send their deltas through memory and back, and their 16-token
tiles run a shrink and an expand one after the other. This times another mechanism for the
prompts: their LoRA rides the base GEMM. The projection's input gets KX columns more, holding
each prompt token's shrunk activation h = A · x (a block of columns per prompt adapter and slice,
zeros outside the token's own blocks), and the weight KX columns more, holding each prompt
adapter's scale · B (block-diagonal over the slices), so that one GEMM over d_in + KX columns
gives x · Wᵀ + scale · h · Bᵀ in its fp32 accumulator: no delta goes through memory, and the
LoRA kernel then adds the decode tokens' deltas alone, in place. KX is 3 x rank a prompt adapter
for q/k/v and rank for o, padded to ``--pads``.

Per step the weights' extra columns are written (one copy over all the layers: the engine would
write every layer's in one launch); per layer the shrink (a skinny GEMM of x against the
prompts' stacked A rows, masked to each token's own blocks and written into the input's extra
columns), the extended GEMM, and the decode tokens' fused call in place: on one-token tiles at
ONE_TOKEN_ROWS rank rows (``in_gemm_one_token``) or on the segments' tiles at 16 (``in_gemm``).
Beside it the base GEMMs alone, the engine's addend path and in place, the extended GEMMs alone
(``gemm_ext``: what the KX columns cost the GEMM), and the base GEMMs on weights stored with the
KX columns but reading d_in of them (``base_padded``: what that layout would cost every step).
The cases are bench/lora_addend.py's S1 mixed steps, then its S1 decode steps (no prompts:
there the figure is ``base_padded`` against ``base``), Llama-2-7B shapes, bf16, µs a layer in a
CUDA graph over LAYERS copies; every variant's output is checked against the in-place path's.

    python bench/lora_in_gemm.py [--pads 16 64] [--out bench/results/lora_in_gemm.json]

``--check`` runs the operands' construction on the CPU (float32, a few adapters, one layer)
against the reference LoRA (kernels/lora_ref.py) and exits: no GPU needed.

Measured on an H100 (bench/results/lora_in_gemm_b1d91ea_h100.json) and not built into the
engine: docs/inference_service.md says why.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from types import SimpleNamespace

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

from bench import kernels as kb  # noqa: E402
from bench.lora_addend import (  # noqa: E402
    CAPACITY,
    CASES,
    LAYERS,
    case_entries,
    check_same,
    engine_variant,
    make_layers,
    time_projections,
)
from bench.provenance import write_result  # noqa: E402
from kernels import lora_paths  # noqa: E402
from kernels.lora_layout import K, O, Q, V  # noqa: E402
from kernels.lora_ref import LoraIndex, gather_matrix, lora_apply, make_lora_tokens  # noqa: E402
from services.inference.models.llama import LoraContext, add_lora  # noqa: E402

H = kb.H
QKV, OUT = ((Q, K, V), (H, H, H)), ((O,), (H,))


def prompt_chunks(rows: torch.Tensor, starts: list[int]) -> list[tuple[int, int, int]]:
    """(adapter, first token, end) of each prompt chunk of a case: its entries of more than one
    token on an adapter (decode entries are one token; base-model tokens have none)."""
    out = []
    for a, b in zip(starts[:-1], starts[1:], strict=True):
        if b - a > 1 and int(rows[a]) >= 0:
            out.append((int(rows[a]), a, b))
    return out


def operands(
    pool_layer: torch.Tensor,
    index: LoraIndex,
    chunks: list[tuple[int, int, int]],
    modules: tuple[int, ...],
    widths: tuple[int, ...],
    d_in: int,
    t: int,
    pad: int,
) -> SimpleNamespace:
    """One call's extra operands for the chunks' adapters: ``a`` [KX, d_in], their A rows stacked
    (chunk j's slices one after the other); ``b`` [sum(widths), KX], scale · B block-diagonal (a
    slice's output rows against that slice's columns); ``mask`` [T, KX], 1 where a token is in
    the chunk whose columns these are. x · aᵀ * mask is the input's extra columns, b the
    weight's. KX: the columns used, rounded up to ``pad``."""
    blocks = []  # (chunk j, slice s, adapter, rank, first column)
    col = 0
    for j, (adapter, _, _) in enumerate(chunks):
        for s, m in enumerate(modules):
            r = int(index.ranks[adapter, m])
            if r:
                blocks.append((j, s, adapter, m, r, col))
                col += r
    kx = max(pad, -(-col // pad) * pad)
    dev, dt = pool_layer.device, pool_layer.dtype
    a = torch.zeros(kx, d_in, dtype=dt, device=dev)
    b = torch.zeros(sum(widths), kx, dtype=dt, device=dev)
    mask = torch.zeros(t, kx, dtype=dt, device=dev)
    out_starts = [sum(widths[:s]) for s in range(len(widths))]
    for j, s, adapter, m, r, c in blocks:
        table = index.slot_table[adapter]
        a_at, b_at = int(index.a_offsets[adapter, m]), int(index.b_offsets[adapter, m])
        a[c : c + r] = gather_matrix(pool_layer, 0, table, a_at, r, d_in)
        bt = gather_matrix(pool_layer, 1, table, b_at, r, widths[s])
        scale = index.scales[adapter, m].to(torch.float32)
        o0 = out_starts[s]
        b[o0 : o0 + widths[s], c : c + r] = (bt.float().t() * scale).to(dt)
        _, first, end = chunks[j]
        mask[first:end, c : c + r] = 1
    return SimpleNamespace(a=a, b=b, mask=mask, kx=kx, used=col)


def extend(w: torch.Tensor, x: torch.Tensor, ops: SimpleNamespace):
    """The weight and the input stored with KX extra columns (x and w in the first d_in)."""
    d_in = w.shape[1]
    w_ext = torch.zeros(w.shape[0], d_in + ops.kx, dtype=w.dtype, device=w.device)
    w_ext[:, :d_in] = w
    x_ext = torch.zeros(x.shape[0], d_in + ops.kx, dtype=x.dtype, device=x.device)
    x_ext[:, :d_in] = x
    return w_ext, x_ext


def in_gemm(x_ext: torch.Tensor, w_ext: torch.Tensor, ops: SimpleNamespace) -> torch.Tensor:
    """The shrink into the input's extra columns, then one GEMM over d_in + KX columns."""
    d_in = w_ext.shape[1] - ops.kx
    h = torch.mm(x_ext[:, :d_in], ops.a.t())  # [T, KX], every chunk's A on every token
    torch.mul(h, ops.mask, out=x_ext[:, d_in:])  # each token keeps its own chunk's columns
    return F.linear(x_ext, w_ext)


def reference_errors(pad: int = 16) -> list[tuple[tuple[int, ...], float, float]]:
    """The operands against kernels/lora_ref.py's lora_apply, on kb.DEV in kb.DT (the CPU in
    float32 for --check): for q/k/v and o of one layer, y = x · Wᵀ + the prompt tokens' LoRA
    (decode tokens' rows get x · Wᵀ alone here), three prompts on adapters of ranks 8 and 16
    beside decode and base-model tokens. Each call's (modules, max |error|, max |LoRA delta|)."""
    gen = torch.Generator().manual_seed(1)
    rows, starts = case_entries(6, 5, (9, 7, 12), 3, gen)
    t = rows.numel()
    case = kb.build_lora(5, (8, 16), 1, rows)
    chunks = prompt_chunks(rows, starts)
    prompt_rows = torch.full_like(rows, -1)
    for adapter, first, end in chunks:
        prompt_rows[first:end] = adapter
    tokens = make_lora_tokens(prompt_rows.to(kb.DEV))
    out = []
    for modules, widths in (QKV, OUT):
        x = torch.randn(t, H, generator=gen).to(kb.DEV, kb.DT)
        w = (torch.randn(sum(widths), H, generator=gen) * 0.02).to(kb.DEV, kb.DT)
        ops = operands(case.pool[0], case.index, chunks, modules, widths, H, t, pad)
        w_ext, x_ext = extend(w, x, ops)
        w_ext[:, H:] = ops.b
        got = in_gemm(x_ext, w_ext, ops)
        want = F.linear(x, w)
        lora_apply(want, x, case.pool[0], case.index, tokens, modules, widths, 16)
        err = (got - want).abs().max().item()
        out.append((modules, err, (F.linear(x, w) - want).abs().max().item()))
    return out


def cpu_check() -> None:
    kb.DEV, kb.DT = torch.device("cpu"), torch.float32
    for modules, err, delta in reference_errors():
        print(f"modules {modules}: max |error| {err:.2e}, max |LoRA delta| {delta:.2e}")
        if not (err <= 1e-4 and delta > 1e-2):
            raise AssertionError(f"in-GEMM LoRA differs from the reference by {err}")
    print("ok")


def time_case(workload: str, decode: int, n: int, prefill: tuple[int, ...], base: int,
              padded: int, gen, pads: tuple[int, ...]) -> dict:  # fmt: skip
    rows, starts = case_entries(decode, n, prefill, base, gen)
    real = rows.numel()
    rows = torch.cat([rows, torch.full((max(padded, real) - real,), -1, dtype=torch.int32)])
    t = rows.numel()
    layers = make_layers(n, (8,), rows)
    case = layers.case
    out: dict[str, float] = {}
    results: dict = {}
    for variant in ("base", "in_place", "addend"):  # the engine's paths (lora_addend's)
        batch, lora = engine_variant(workload, case, (8,), variant)
        out[variant] = time_projections(layers, batch, lora, results, variant)
    check_same(results, "in_place", "addend")

    chunks = prompt_chunks(rows, starts)
    decode_rows = rows.clone()
    for _, first, end in chunks:
        decode_rows[first:end] = -1
    decode_rows = decode_rows.to(kb.DEV)
    contexts = {}
    for name, one_token in (("in_gemm", False), ("in_gemm_one_token", True)):
        lora = LoraContext(case.index, 8)
        lora.fused, lora.modules, lora.one_token = True, None, one_token
        lora.rows = lora_paths.ONE_TOKEN_ROWS if one_token else lora_paths.FUSED_PREFILL_MAX_ROWS
        tokens = make_lora_tokens(decode_rows, capacity=CAPACITY, one_token_tiles=one_token)
        contexts[name] = (lora, SimpleNamespace(lora_tokens=tokens))
    row = dict(
        workload=workload, tokens=t, real_tokens=real, decode_tokens=decode, adapters=n,
        used=int(torch.unique(rows[rows >= 0]).numel()), prefill=list(prefill), base_tokens=base,
        base_us=round(out["base"], 2), in_place_us=round(out["in_place"], 2),
        addend_us=round(out["addend"], 2), pads={},
    )  # fmt: skip
    for pad in pads:
        row["pads"][pad] = time_pad(layers, chunks, contexts, results, t, pad)
    return row


def time_pad(layers, chunks, contexts: dict, results: dict, t: int, pad: int) -> dict:
    """The in-GEMM variants of a case at one padding of KX, each checked against the in-place
    path's outputs (results), and the GEMMs alone."""
    case = layers.case
    calls = []  # per layer: (modules, widths, operands, extended weight, extended input) x 2
    for i in range(LAYERS):
        layer = []
        for (modules, widths), w, x in ((QKV, layers.wqkv[i], layers.xs[i]),
                                        (OUT, layers.wo[i], layers.os_[i])):  # fmt: skip
            ops = operands(case.pool[i], case.index, chunks, modules, widths, H, t, pad)
            layer.append([modules, widths, ops, *extend(w, x, ops)])
        calls.append(layer)
    # every layer's extended weights in one tensor a call (q/k/v, o), whose extra columns a step
    # writes in one copy: the engine's per-step write of its prompts' scale · B columns
    kxq, kxo = calls[0][0][2].kx, calls[0][1][2].kx
    stores = [torch.empty(LAYERS, 3 * H, H + kxq, dtype=kb.DT, device=kb.DEV),
              torch.empty(LAYERS, H, H + kxo, dtype=kb.DT, device=kb.DEV)]  # fmt: skip
    srcs = [torch.stack([calls[i][c][2].b for i in range(LAYERS)]) for c in (0, 1)]
    for i in range(LAYERS):
        for c in (0, 1):
            stores[c][i].copy_(calls[i][c][3])
            calls[i][c][3] = stores[c][i]

    def write_columns():
        for c in (0, 1):
            stores[c][:, :, H:].copy_(srcs[c])

    def variant(name: str, lora, batch):
        def fn():
            write_columns()
            for i in range(LAYERS):
                outs = []
                for modules, widths, ops, w_ext, x_ext in calls[i]:
                    y = in_gemm(x_ext, w_ext, ops)
                    add_lora(y, x_ext[:, :H], batch, case.pool[i], lora, modules, widths)
                    outs.append(y)
                results[(name, i)] = tuple(outs)

        return fn

    def gemm_ext():
        for i in range(LAYERS):
            for _, _, _, w_ext, x_ext in calls[i]:
                F.linear(x_ext, w_ext)

    def base_padded():
        for i in range(LAYERS):
            for _, _, _, w_ext, x_ext in calls[i]:
                F.linear(x_ext[:, :H], w_ext[:, :H])

    timings = {}
    for name, (lora, batch) in contexts.items():
        timings[name] = kb.timed(variant(name, lora, batch), LAYERS, eager=False).graph_us
        check_same(results, "in_place", name)
    timings["gemm_ext"] = kb.timed(gemm_ext, LAYERS, eager=False).graph_us
    timings["base_padded"] = kb.timed(base_padded, LAYERS, eager=False).graph_us
    timings["columns"] = kb.timed(write_columns, LAYERS, eager=False).graph_us
    return dict(kx_qkv=kxq, kx_o=kxo, **{f"{k}_us": round(v, 2) for k, v in timings.items()})


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--pads", type=int, nargs="+", default=[16, 64])
    p.add_argument("--check", action="store_true", help="the CPU check of the operands only")
    p.add_argument("--out", type=Path, default=REPO / "bench" / "results" / "lora_in_gemm.json")
    args = p.parse_args()
    if args.check:
        cpu_check()
        return
    if not torch.cuda.is_available():
        sys.exit("lora_in_gemm times CUDA graphs: it needs a GPU (--check runs on the CPU)")
    gen = torch.Generator().manual_seed(0)
    rows = []
    print(f"{'case':<44} {'base':>7} {'addend':>7} {'in place':>8} | pad "
          f"{'in GEMM':>8} {'1-token':>8} {'GEMM+KX':>8} {'padded':>7} {'cols':>5}")  # fmt: skip
    for workload, decode, n, prefill, base, padded in CASES:
        if workload not in ("S1", "S1 decode"):  # decode steps: what the padded layout costs
            continue
        row = time_case(workload, decode, n, prefill, base, padded, gen, tuple(args.pads))
        rows.append(row)
        name = f"{decode} dec/{n} + {'+'.join(map(str, prefill))} + {base} base ({padded})"
        for pad, r in row["pads"].items():
            print(f"{name:<44} {row['base_us']:>7.1f} {row['addend_us']:>7.1f} "
                  f"{row['in_place_us']:>8.1f} | {pad:>3} {r['in_gemm_us']:>8.1f} "
                  f"{r['in_gemm_one_token_us']:>8.1f} {r['gemm_ext_us']:>8.1f} "
                  f"{r['base_padded_us']:>7.1f} {r['columns_us']:>5.1f}")  # fmt: skip
            name = ""
        write_result(args.out, "lora_in_gemm.py", dict(
            benchmark="prompt LoRA in the base GEMM's reduction against the engine's paths, "
                      "µs a layer (q/k/v and o) in a CUDA graph",
            gpu=torch.cuda.get_device_name(), layers=LAYERS,
            results=rows,
        ))  # fmt: skip


if __name__ == "__main__":
    main()
