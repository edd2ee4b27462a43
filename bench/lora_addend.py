"""One decoder layer's attention projections with their LoRA calls, the LoRA delta added after
the base GEMM (in place: the kernel reads the GEMM's output and writes it back) against the
delta written first and the GEMM adding onto it (LoraContext.addend: cuBLAS's beta = 1), on the
serving trace's prefill-sized mixed steps and its decode steps of 256 tokens or more (CUDA).

Each case is a step's composition: decode tokens on adapters drawn uniformly from n, beside
prompts' prefill chunks each on an adapter of its own, optionally base-model tokens among them
and padding after (a mixed CUDA graph's). Both variants run the engine's own hook
(models/llama.py linear_lora) for q/k/v and o on Llama-2-7B shapes, bf16, every call fused as
the engine's steps make them: S1 (rank 8) at 16 rank rows (LoraMode.NARROW), S2 (ranks 8, 16,
32, 64 cycled) at 64 (LoraMode.WIDE_FUSED), S1's decode steps at 8 rows with every token its own
tile (LoraMode.ONE_TOKEN); and the base GEMMs alone. Times are µs a layer in a CUDA graph, over
LAYERS copies of the layer so that one layer's weights do not stay in L2; the table gives each
variant's LoRA time beyond the base GEMMs. With ``--parts`` each case also times the addend's
two halves apart, the GEMMs adding onto an output already written (cuBLAS's beta = 1) and the
delta calls alone, beside what their activations move at the copy bandwidth (x read and the
delta written by the calls, the delta read back by the GEMMs): how much of the addend's cost a
GEMM that computed the delta in its epilogue would save; and the delta calls on a side stream
while the base GEMMs run, the delta left unadded: what the LoRA calls could cost if they ran
beside the GEMMs and the op after each projection (rotary and the cache write, the residual
add) added the delta as it reads the output. With ``--delta-sweep`` the mixed cases' delta calls
are also timed by the fused kernel's launch (DELTA_POINTS: tile tokens, weight blocks, warps,
parts, stages), both calls and each apart, every launch's delta checked against the default's.

With ``--small-mixed`` the cases are S1's decode-sized mixed steps instead (SMALL_CASES: a
prompt's chunk beside a batch of decode tokens, up to FUSED_MAX_TOKENS tokens, padded to the
mixed graph's size), on the two paths the engine chooses between for them by their distinct
adapters (lora_paths.NARROW_MIN_ADAPTERS, which these figures set): LoraMode.SHAPES (in place,
each call's shapes at the engine's max_lora_rank of 128, which picks the two launches) and
LoraMode.NARROW (every call fused at 16 rank rows, the decode tokens apart by
lora_paths.mixed_decodes_apart, the GEMMs adding onto the delta from ADDEND_MIN_TOKENS tokens),
and NARROW in place; the last column names the engine's choice.

    python bench/lora_addend.py [--parts] [--delta-sweep | --small-mixed] \
        [--out bench/results/lora_addend.json]
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
from bench.provenance import write_result  # noqa: E402
from kernels import lora_paths  # noqa: E402
from kernels.lora_layout import K, O, Q, V  # noqa: E402
from kernels.lora_ref import make_lora_tokens  # noqa: E402
from services.inference.models.llama import LoraContext, add_lora, linear_lora  # noqa: E402

LAYERS = 4
H = kb.H
# (workload, decode tokens, adapters they are drawn from, prefill chunks, base tokens, padded to
# the engine's graph size: every 32 tokens to 1024, then every 64)
CASES = (
    ("S1", 400, 1000, (400, 400, 400, 400), 0, 2048),
    ("S1", 400, 1000, (200, 200, 200), 0, 1024),
    ("S1", 300, 1000, (512, 512, 512), 0, 1856),
    ("S1", 300, 100, (512, 512, 512), 0, 1856),
    ("S1", 300, 5, (512, 512, 512), 0, 1856),
    ("S1", 0, 5, (1024, 1024), 0, 2048),
    ("S1", 200, 100, (400,), 0, 608),
    ("S1", 200, 100, (512, 512), 300, 1536),  # a fifth on the base model
    ("S1", 200, 100, (300,), 1200, 1728),  # mostly base-model tokens: their zeros cost
    ("S2", 400, 1000, (400, 400, 400, 400), 0, 2048),
    ("S2", 300, 100, (512, 512, 512), 0, 1856),
    ("S2", 400, 100, (200, 200, 200), 0, 1024),
    # decode steps from ADDEND_MIN_TOKENS (the saturating trace's, of 256 sequences or more)
    ("S1 decode", 256, 1000, (), 0, 256),
    ("S1 decode", 512, 1000, (), 0, 512),
    ("S1 decode", 384, 100, (), 0, 384),
    ("S1 decode", 512, 100, (), 0, 512),
)
# --small-mixed: S1's decode-sized mixed steps (decode tokens, adapters drawn from, prompt chunks,
# padded to the mixed graph's size: every 32 tokens): a saturating trace's batch of about 290
# sequences beside a chunk (S1 n = 1000 on an H100: 57 steps of 305-508 tokens), and 10
# requests/s's steps of about 16 sequences beside a prompt
SMALL_CASES = (
    (287, 1000, (220,), 512),
    (287, 1000, (48,), 352),
    (287, 100, (220,), 512),
    (287, 100, (48,), 352),
    (287, 5, (120,), 416),
    (16, 100, (260,), 288),
    (16, 100, (100,), 128),
)
SMALL_MAX_RANK = 128  # the engine's default max_lora_rank: the rows LoraMode.SHAPES calls with
RANKS = {"S1": (8,), "S2": (8, 16, 32, 64), "S1 decode": (8,)}
# The rank rows of the engine's calls: NARROW, WIDE_FUSED, ONE_TOKEN (one-token tiles)
ROWS = {
    "S1": lora_paths.FUSED_PREFILL_MAX_ROWS,
    "S2": lora_paths.WIDE_FUSED_ROWS,
    "S1 decode": lora_paths.ONE_TOKEN_ROWS,
}
ONE_TOKEN = {"S1 decode"}  # workloads whose calls take one-token tiles (LoraMode.ONE_TOKEN)
# --delta-sweep: the fused kernel's launches tried for the mixed cases' delta calls (its dot body,
# which prompts' tiles take): (tile tokens, d_in block, column block, warps, parts, stages);
# None: fused_config's own
DELTA_POINTS = (
    None,
    (16, 256, 512, 4, 1, 3),
    (16, 256, 256, 8, 1, 3),
    (16, 128, 256, 4, 1, 4),
    (16, 256, 256, 4, 2, 3),
    (16, 256, 256, 4, 4, 3),
    (32, 256, 256, 4, 1, 3),
    (32, 256, 256, 8, 1, 3),
    (32, 256, 512, 8, 1, 3),
    (64, 256, 256, 8, 1, 3),
)


def case_entries(
    decode: int, n: int, prefill: tuple[int, ...], base: int, gen
) -> tuple[torch.Tensor, list[int]]:
    """Each token's adapter row (-1: base model), grouped by adapter as the engine's steps are:
    base tokens first, then decode tokens and prompts' chunks by adapter; and the entries'
    first tokens and the end (a step's query starts; the base tokens one entry)."""
    rows = torch.randint(0, n, (decode,), generator=gen)
    prompts = torch.randperm(n, generator=gen)[: len(prefill)]
    entries = [(int(r), 1) for r in rows]
    entries += [(int(p), k) for p, k in zip(prompts, prefill, strict=True)]
    entries.sort(key=lambda e: e[0])
    out = [-1] * base + [r for r, k in entries for _ in range(k)]
    starts = [0, base] if base else [0]
    for _, k in entries:
        starts.append(starts[-1] + k)
    return torch.tensor(out, dtype=torch.int32), starts


def case_rows(decode: int, n: int, prefill: tuple[int, ...], base: int, gen) -> torch.Tensor:
    """case_entries' rows."""
    return case_entries(decode, n, prefill, base, gen)[0]


# The engine's segment capacity at its defaults on the H200: min(max_loras, max_num_seqs) + 2,
# max_loras sized from memory (thousands) and max_num_seqs 512.
CAPACITY = 512 + 2


def case_tokens(workload: str, rows: torch.Tensor, addend: bool):
    """The step's LoraTokens as the engine writes them for the case's mode: one-token tiles for
    decode steps, every token listed (zero tiles) for the addend."""
    one_token = workload in ONE_TOKEN
    return make_lora_tokens(rows, capacity=CAPACITY, one_token_tiles=one_token, zeros=addend)


def padded_rows(decode, n, prefill, base, padded, gen) -> torch.Tensor:
    rows = case_rows(decode, n, prefill, base, gen)
    real = rows.numel()
    return torch.cat([rows, torch.full((max(padded, real) - real,), -1, dtype=torch.int32)])


def make_layers(n: int, ranks: tuple[int, ...], rows: torch.Tensor) -> SimpleNamespace:
    """LAYERS layers of a case: its adapters (kb.build_lora over ``rows``), each layer's q/k/v
    and o weights, and their inputs."""
    t = rows.numel()
    return SimpleNamespace(
        case=kb.build_lora(n, ranks, LAYERS, rows),
        wqkv=[torch.randn(3 * H, H, dtype=kb.DT, device=kb.DEV) * 0.02 for _ in range(LAYERS)],
        wo=[torch.randn(H, H, dtype=kb.DT, device=kb.DEV) * 0.02 for _ in range(LAYERS)],
        xs=[torch.randn(t, H, dtype=kb.DT, device=kb.DEV) for _ in range(LAYERS)],
        os_=[torch.randn(t, H, dtype=kb.DT, device=kb.DEV) for _ in range(LAYERS)],
    )


def engine_variant(workload: str, case, ranks: tuple[int, ...], variant: str):
    """A variant's step batch (its LoraTokens) and LoRA context as the engine makes them for the
    workload's steps: "base" (no context), "in_place" or "addend"."""
    batch = SimpleNamespace(lora_tokens=case_tokens(workload, case.rows, variant == "addend"))
    if variant == "base":
        return batch, None
    lora = LoraContext(case.index, max(ranks))
    lora.fused, lora.rows, lora.modules = True, ROWS[workload], None
    lora.one_token, lora.addend = workload in ONE_TOKEN, variant == "addend"
    return batch, lora


def time_projections(layers, batch, lora, results: dict, name: str) -> float:
    """µs a layer of the layers' q/k/v and o projections with their LoRA calls through the
    engine's hook (models/llama.py linear_lora; ``lora`` None: the GEMMs alone) in a CUDA
    graph; each layer's outputs kept as results[(name, layer)]."""
    case = layers.case

    def fn():
        for i in range(LAYERS):
            qkv = linear_lora(
                layers.xs[i], layers.wqkv[i], None, batch, case.pool[i], lora, (Q, K, V),
                (H, H, H),
            )  # fmt: skip
            o = linear_lora(layers.os_[i], layers.wo[i], None, batch, case.pool[i], lora, (O,),
                            (H,))  # fmt: skip
            results[(name, i)] = (qkv, o)

    return kb.timed(fn, LAYERS, eager=False).graph_us


def check_same(results: dict, ref: str, name: str) -> None:
    """Two variants computed the same projections (within the roundings' difference)."""
    for i in range(LAYERS):
        for a, b in zip(results[(ref, i)], results[(name, i)], strict=True):
            err = (a.float() - b.float()).abs().max().item()
            scale = a.float().abs().max().item()
            if not err <= 0.02 * scale:
                raise AssertionError(f"{name} differs from {ref} by {err} (max |y| {scale})")


def time_case(
    workload, decode, n, prefill, base, padded, gen, parts=False, delta_sweep=False
) -> dict:
    rows = padded_rows(decode, n, prefill, base, padded, gen)
    t = rows.numel()
    real = decode + sum(prefill) + base
    ranks = RANKS[workload]
    layers = make_layers(n, ranks, rows)
    case, wqkv, wo, xs, os_ = layers.case, layers.wqkv, layers.wo, layers.xs, layers.os_
    out: dict[str, float] = {}
    results: dict[tuple[str, int], tuple[torch.Tensor, torch.Tensor]] = {}
    for variant in ("base", "in_place", "addend"):  # the addend's context stays for --parts
        batch, lora = engine_variant(workload, case, ranks, variant)
        out[variant] = time_projections(layers, batch, lora, results, variant)
    if parts:  # the addend's two halves apart: its GEMMs onto a written output, its delta calls
        ys = [(torch.randn(t, 3 * H, dtype=kb.DT, device=kb.DEV),
               torch.randn(t, H, dtype=kb.DT, device=kb.DEV)) for _ in range(LAYERS)]  # fmt: skip

        def gemms():  # cuBLAS's beta = 1 (the GEMM reads the output it adds onto)
            for i in range(LAYERS):
                ys[i][0].addmm_(xs[i], wqkv[i].t())
                ys[i][1].addmm_(os_[i], wo[i].t())

        def deltas():  # the delta calls alone, as the addend makes them (every row written)
            for i in range(LAYERS):
                for y, x, mods in ((ys[i][0], xs[i], (Q, K, V)), (ys[i][1], os_[i], (O,))):
                    add_lora(y, x, batch, case.pool[i], lora, mods, (H,) * len(mods), delta=True)

        side = torch.cuda.Stream()

        def beside():  # the delta calls on a side stream while the base GEMMs run, not added
            for i in range(LAYERS):
                for y, x, w, mods in ((ys[i][0], xs[i], wqkv[i], (Q, K, V)),
                                      (ys[i][1], os_[i], wo[i], (O,))):  # fmt: skip
                    side.wait_stream(torch.cuda.current_stream())
                    with torch.cuda.stream(side):
                        add_lora(y, x, batch, case.pool[i], lora, mods, (H,) * len(mods),
                                 delta=True)  # fmt: skip
                    F.linear(x, w)
                    torch.cuda.current_stream().wait_stream(side)

        out["addmm"] = kb.timed(gemms, LAYERS, eager=False).graph_us
        out["delta"] = kb.timed(deltas, LAYERS, eager=False).graph_us
        out["beside"] = kb.timed(beside, LAYERS, eager=False).graph_us
    if delta_sweep and prefill:
        out["delta_sweep"] = sweep_delta(workload, case, batch.lora_tokens, xs, os_)
    check_same(results, "in_place", "addend")
    used = int(torch.unique(rows[rows >= 0]).numel())
    row = dict(
        workload=workload, tokens=t, real_tokens=real, decode_tokens=decode, adapters=n,
        used=used, prefill=list(prefill), base_tokens=base, rows=ROWS[workload],
        base_us=round(out["base"], 2), in_place_us=round(out["in_place"], 2),
        addend_us=round(out["addend"], 2),
        in_place_extra_us=round(out["in_place"] - out["base"], 2),
        addend_extra_us=round(out["addend"] - out["base"], 2),
    )  # fmt: skip
    if "delta_sweep" in out:
        row["delta_sweep"] = out["delta_sweep"]
    if parts:
        # what the halves move: x read and the delta written by the calls, the delta read back
        # by the GEMMs (bf16; each adapter's weights come on top, kb.lora_bytes)
        row.update(addmm_us=round(out["addmm"], 2), delta_us=round(out["delta"], 2),
                   beside_us=round(out["beside"], 2),
                   delta_io_bytes=2 * t * (2 * H + 4 * H + 4 * H))  # fmt: skip
    return row


def small_paths(decode: int, n: int, prefill: tuple[int, ...], padded: int, gen):
    """A SMALL_CASES step, padded as its mixed graph is: (rows, entries' starts, the paths'
    settings): the shapes' path and NARROW, with the addend where the engine would add it and
    in place."""
    from services.inference.engine.model_runner import ADDEND_MIN_TOKENS

    rows, starts = case_entries(decode, n, prefill, 0, gen)
    real = rows.numel()
    if padded > real:  # the graph's padding: one entry of no adapter
        rows = torch.cat([rows, torch.full((padded - real,), -1, dtype=torch.int32)])
        starts = [*starts, padded]
    decode_rows = {int(rows[a]) for a, b in zip(starts[:-1], starts[1:], strict=True)
                   if b - a == 1 and rows[a] >= 0}  # fmt: skip
    apart = lora_paths.mixed_decodes_apart(decode, len(decode_rows), 8)
    narrow_rows = lora_paths.FUSED_PREFILL_MAX_ROWS
    paths = {
        "shapes": dict(fused=None, rows=SMALL_MAX_RANK, addend=False, apart=False),
        "narrow": dict(fused=True, rows=narrow_rows, addend=padded >= ADDEND_MIN_TOKENS,
                       apart=apart),
        "narrow_in_place": dict(fused=True, rows=narrow_rows, addend=False, apart=apart),
    }  # fmt: skip
    return rows, starts, paths


def time_small(decode: int, n: int, prefill: tuple[int, ...], padded: int, gen) -> dict:
    """One SMALL_CASES step: µs a layer of the q/k/v and o GEMMs alone, and with their LoRA
    calls on each of small_paths' paths, every path's projections checked against the shapes'
    path's."""
    rows, starts, paths = small_paths(decode, n, prefill, padded, gen)
    t = rows.numel()
    layers = make_layers(n, (8,), rows)
    out: dict[str, float] = {}
    results: dict[tuple[str, int], tuple[torch.Tensor, torch.Tensor]] = {}
    for name, path in (("base", None), *paths.items()):
        batch = lora = None
        if path is not None:
            tokens = make_lora_tokens(layers.case.rows, capacity=CAPACITY,
                                      one_token_tiles=path["apart"],
                                      entries=starts if path["apart"] else None,
                                      zeros=path["addend"])  # fmt: skip
            batch = SimpleNamespace(lora_tokens=tokens)
            lora = LoraContext(layers.case.index, SMALL_MAX_RANK)
            lora.fused, lora.rows, lora.addend = path["fused"], path["rows"], path["addend"]
        out[name] = time_projections(layers, batch, lora, results, name)
    for name in paths:
        check_same(results, "shapes", name)
    return dict(
        workload="S1 small mixed", tokens=t, real_tokens=decode + sum(prefill),
        decode_tokens=decode, adapters=n, used=int(torch.unique(rows[rows >= 0]).numel()),
        prefill=list(prefill), paths=paths, base_us=round(out["base"], 2),
        **{f"{name}_us": round(out[name], 2) for name in paths},
    )  # fmt: skip


def sweep_delta(workload, case, tokens, xs, os_) -> list[list]:
    """The addend's delta calls alone (every row written), by DELTA_POINTS: [point..., µs of
    both calls, of q/k/v's, of o's]."""
    from kernels import lora as triton_lora

    t = tokens.token_lora.numel()
    rank_rows = ROWS[workload]
    ys = [(torch.empty(t, 3 * H, dtype=kb.DT, device=kb.DEV),
           torch.empty(t, H, dtype=kb.DT, device=kb.DEV)) for _ in range(LAYERS)]  # fmt: skip
    out = []
    for point in DELTA_POINTS:

        def config(mods, point=point):
            cfg = triton_lora.fused_config(t, H, rank_rows, len(mods), H, d_in=H)
            if point is None:
                return cfg
            block_m, block_k, block_n, warps, parts, stages = point
            return cfg._replace(block_m=block_m, shrink_k=block_k, expand_n=block_n,
                                shrink_warps=warps, parts=parts, stages=stages)  # fmt: skip

        cfgs = {mods: config(mods) for mods in ((Q, K, V), (O,))}

        def deltas(calls, cfgs=cfgs):
            for i in range(LAYERS):
                for y, x, mods in ((ys[i][0], xs[i], (Q, K, V)), (ys[i][1], os_[i], (O,))):
                    if mods in calls:
                        triton_lora.lora_apply(y, x, case.pool[i], case.index, tokens, mods,
                                               (H,) * len(mods), rank_rows, config=cfgs[mods],
                                               delta=True)  # fmt: skip

        us = [kb.timed(lambda c=c: deltas(c), LAYERS, eager=False).graph_us
              for c in (((Q, K, V), (O,)), ((Q, K, V),), ((O,),))]  # fmt: skip
        out.append([*(point or ("default",)), *us])
        got = [y.clone() for i in range(LAYERS) for y in ys[i]]
        if point is None:
            want = got
        for a, b in zip(want, got, strict=True):  # every launch writes the same delta
            err = (a.float() - b.float()).abs().max().item()
            if not err <= 0.02 * a.float().abs().max().item():
                raise AssertionError(f"launch {point}'s delta differs by {err}")
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--parts", action="store_true",
                    help="also time the addend's GEMMs (onto a written output) and its delta "
                    "calls apart")  # fmt: skip
    ap.add_argument("--delta-sweep", action="store_true",
                    help="also time the mixed cases' delta calls by the fused kernel's launch "
                    "(DELTA_POINTS)")  # fmt: skip
    ap.add_argument("--small-mixed", action="store_true",
                    help="time S1's decode-sized mixed steps (SMALL_CASES) on the shapes' path "
                    "and on NARROW")  # fmt: skip
    ap.add_argument("--out", type=Path, default=REPO / "bench/results/lora_addend.json")
    args = ap.parse_args()
    gen = torch.Generator().manual_seed(0)
    if args.small_mixed:
        small_mixed(args.out, gen)
        return
    bandwidth = kb.copy_bandwidth() if args.parts else None
    rows = []
    head = (
        f"{'case':<44} {'tokens':>6} {'used':>5} {'base':>8} {'in place':>9} {'addend':>8} "
        f"{'+in pl':>7} {'+addnd':>7} {'ratio':>6}"
    )
    print("µs a layer (q/k/v and o GEMMs with their LoRA calls), CUDA graph; +: beyond the base")
    print(head)
    for c in CASES:
        r = time_case(*c, gen, parts=args.parts, delta_sweep=args.delta_sweep)
        rows.append(r)
        name = f"{r['workload']} {r['decode_tokens']} on {r['adapters']} + {r['prefill']}"
        name += f" + {r['base_tokens']} base" if r["base_tokens"] else ""
        ratio = r["addend_extra_us"] / r["in_place_extra_us"] if r["in_place_extra_us"] else 0
        print(
            f"{name:<44} {r['tokens']:>6} {r['used']:>5} {r['base_us']:>8.1f} "
            f"{r['in_place_us']:>9.1f} {r['addend_us']:>8.1f} {r['in_place_extra_us']:>7.1f} "
            f"{r['addend_extra_us']:>7.1f} {ratio:>6.2f}",
            flush=True,
        )
        if "delta_sweep" in r:
            best = min(r["delta_sweep"], key=lambda p: p[-3])
            print(f"{'':<44} delta calls by launch (both, q/k/v, o): " + ", ".join(
                f"{'/'.join(map(str, p[:-3]))} {p[-3]:.1f} {p[-2]:.1f} {p[-1]:.1f}"
                for p in r["delta_sweep"]
            ) + f"; best {best}", flush=True)  # fmt: skip
        if args.parts:
            io_us = r["delta_io_bytes"] / bandwidth * 1e6
            print(f"{'':<44} addend's GEMMs alone {r['addmm_us']:.1f} (base {r['base_us']:.1f}), "
                  f"its delta calls alone {r['delta_us']:.1f} (their x and delta, and the "
                  f"GEMMs' read of it, {io_us:.1f} at the copy bandwidth); the delta calls "
                  f"on a side stream beside the base GEMMs, the delta not added, "
                  f"{r['beside_us']:.1f}", flush=True)  # fmt: skip
    write_result(
        args.out,
        "lora_addend.py",
        {
            "benchmark": "lora_addend",
            "gpu": torch.cuda.get_device_name(),
            "rows": rows,
            **({"copy_bytes_per_s": bandwidth} if bandwidth else {}),
        },
    )


def small_mixed(out_path: Path, gen: torch.Generator) -> None:
    print("µs a layer (q/k/v and o GEMMs with their LoRA calls), CUDA graph; +: beyond the base")
    print(f"{'case':<36} {'tokens':>6} {'used':>5} {'base':>8} {'+shapes':>8} {'+narrow':>8} "
          f"{'+n in pl':>8} {'ratio':>6} {'engine':>7}")  # fmt: skip
    rows = []
    for c in SMALL_CASES:
        r = time_small(*c, gen)
        rows.append(r)
        extra = {k: r[f"{k}_us"] - r["base_us"] for k in r["paths"]}
        name = f"{r['decode_tokens']} on {r['adapters']} + {r['prefill']}"
        name += " (apart)" if r["paths"]["narrow"]["apart"] else ""
        name += " (addend)" if r["paths"]["narrow"]["addend"] else ""
        ratio = extra["narrow"] / extra["shapes"] if extra["shapes"] > 0 else 0
        r["engine"] = (
            "narrow" if lora_paths.mixed_step_narrows(r["tokens"], r["used"]) else "shapes"
        )
        print(f"{name:<36} {r['tokens']:>6} {r['used']:>5} {r['base_us']:>8.1f} "
              f"{extra['shapes']:>8.1f} {extra['narrow']:>8.1f} "
              f"{extra['narrow_in_place']:>8.1f} {ratio:>6.2f} {r['engine']:>7}",
              flush=True)  # fmt: skip
    write_result(out_path, "lora_addend.py", {
        "benchmark": "lora_addend --small-mixed", "gpu": torch.cuda.get_device_name(),
        "rows": rows,
    })  # fmt: skip


if __name__ == "__main__":
    main()
