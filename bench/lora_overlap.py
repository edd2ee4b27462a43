"""Whether a small decode step's LoRA calls can hide behind the base GEMMs (CUDA; a question
for the engine's next design, not what it does now).

At 10 requests/s a decode step holds about 15 sequences, and each layer's S1 LoRA calls (q/k/v
and o, two launches each) cost their latency, not their bytes: 19.6 µs a layer at 16 tokens
(bench/results/lora_engine_calls_steps.json), about 1 ms of a 6.4 ms step. They depend only on
the projection's input, as the base GEMM does, so they could run on a second stream beside the
GEMM, into a zeroed buffer that is then added to the GEMM's output (by an add here; by the next
kernel, rope or the residual norm, in an engine that adopted it). This times one Llama-7B
layer's q/k/v and o projections in a CUDA graph, per layer (4 layers with their own weights),
for decode batches of rank-8 adapters on distinct rows:

- base: the two GEMMs alone;
- serial: the GEMMs, each followed by its LoRA call (the engine today);
- side: each call's LoRA on a second stream (zero, shrink, expand into a buffer) beside its
  GEMM, joined, then one add;
- side, no add: the same without the add (what fusing the add into the next kernel could
  reach);
- shrink aside: only the shrink on the second stream; the expand adds into the GEMM's output
  after the join (no buffer, no add: one launch a call off the critical path);
- side fused, no add: the side stream's calls on the fused kernel (one launch a call, 16 rank
  rows, as the engine sizes fused steps), without the add.

With ``--carveouts`` each row is timed again with the base GEMMs told to leave that many SMs to
other work (cuBLASLt's SM count target, torch's experimental carve-out; the GEMMs go through
cuBLASLt for every row then, carve-out 0 included): whether a side stream can run beside GEMMs
that no longer hold every SM, and what the carve-out costs the GEMMs themselves.

    python bench/lora_overlap.py [--batches 1 8 16 32 64] [--carveouts 0 8 16 32] \
        [--out bench/results/lora_overlap.json]

Measured (H200, 2026-12-03, bench/results/lora_overlap.json and lora_overlap_carveout.json), µs
a layer, base / serial / side / side without the add / shrink aside / side fused without the
add: batch 16 44.1 / 69.1 / 66.0 / 63.2 / 70.3 / 60.0; batch 64 43.0 / 91.5 / 94.2 / 90.0 / 90.1
/ 80.6 (the run of c7d24b0 gave the first five within 2.1 µs). The GEMM keeps every SM busy from a
few tokens on, so a side stream hides at most 6 of the 25 µs LoRA adds at batch 16, and the
shrink alone aside hides nothing. Leaving the GEMMs 8 to 32 SMs fewer (cuBLASLt) hides 3-4 µs
more at batch 16 and 32 (the side stream without the add), nothing at 64, and at 256 the side
runs gain 4-8 µs as the serial one does (192-197 against 205), while the base GEMMs alone slow
by up to 12% there: the engine keeps its calls serial.
"""

from __future__ import annotations

import argparse
import contextlib
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

import torch  # noqa: E402

from bench import kernels as kb  # noqa: E402
from bench.provenance import write_result  # noqa: E402
from kernels import lora  # noqa: E402
from kernels.lora_layout import K, O, Q, V  # noqa: E402
from kernels.lora_ref import make_lora_tokens  # noqa: E402

H = kb.H
CALLS = (((Q, K, V), (H, H, H)), ((O,), (H,)))  # (modules, output widths), input width H
LAYERS = 4
MAX_RANK = 128  # the engine's default max_lora_rank: its two-launch calls are sized for it
SEGMENTS = 514  # the engine's segment capacity at 512 sequences
FUSED_ROWS = 16  # the rank rows of the engine's fused steps (kernels.lora_paths)


def case(batch: int, gen: torch.Generator):
    rows = torch.randperm(4 * batch, generator=gen)[:batch].sort().values.int()
    lc = kb.build_lora(4 * batch, 8, LAYERS, rows)
    tokens = make_lora_tokens(lc.rows, capacity=SEGMENTS, modules=(Q, K, V, O))
    weights = [[torch.randn(sum(w), H, dtype=kb.DT, device=kb.DEV) * 0.02 for _, w in CALLS]
               for _ in range(LAYERS)]  # fmt: skip
    xs = [[torch.randn(batch, H, dtype=kb.DT, device=kb.DEV) for _ in CALLS]
          for _ in range(LAYERS)]  # fmt: skip
    ys = [[torch.empty(batch, sum(w), dtype=kb.DT, device=kb.DEV) for _, w in CALLS]
          for _ in range(LAYERS)]  # fmt: skip
    zs = [[torch.empty_like(y) for y in layer] for layer in ys]
    ws = torch.empty(lora.workspace_size(batch, 3, MAX_RANK), device=kb.DEV)
    ws2 = torch.empty_like(ws)  # the side stream's own: the two calls may overlap there
    return lc, tokens, weights, xs, ys, zs, (ws, ws2)


def variants(batch: int, gen: torch.Generator) -> dict:
    lc, tokens, weights, xs, ys, zs, (ws, ws2) = case(batch, gen)
    side = torch.cuda.Stream()

    def apply(y, x, layer, c, workspace):
        mods, widths = CALLS[c]
        lora.lora_apply(y, x, lc.pool[layer], lc.index, tokens, mods, widths, MAX_RANK,
                        workspace=workspace, fused=False)  # fmt: skip

    def base():
        for layer in range(LAYERS):
            for c in range(len(CALLS)):
                torch.mm(xs[layer][c], weights[layer][c].t(), out=ys[layer][c])

    def serial():
        for layer in range(LAYERS):
            for c in range(len(CALLS)):
                torch.mm(xs[layer][c], weights[layer][c].t(), out=ys[layer][c])
                apply(ys[layer][c], xs[layer][c], layer, c, ws)

    def overlapped(add: bool, fused: bool = False):
        def fn():
            main = torch.cuda.current_stream()
            for layer in range(LAYERS):
                for c in range(len(CALLS)):
                    side.wait_stream(main)  # x is ready
                    with torch.cuda.stream(side):
                        zs[layer][c].zero_()
                        if fused:
                            mods, widths = CALLS[c]
                            z, x = zs[layer][c], xs[layer][c]
                            lora.lora_apply(z, x, lc.pool[layer], lc.index, tokens, mods,
                                            widths, FUSED_ROWS, fused=True)  # fmt: skip
                        else:
                            apply(zs[layer][c], xs[layer][c], layer, c, ws2)
                    torch.mm(xs[layer][c], weights[layer][c].t(), out=ys[layer][c])
                    main.wait_stream(side)
                    if add:
                        ys[layer][c].add_(zs[layer][c])

        return fn

    def shrink_aside():
        """Only the shrink on the side stream (it needs x alone); the expand adds into the
        GEMM's output after the join, as today: no buffer, no add, one launch off the path."""
        main = torch.cuda.current_stream()
        for layer in range(LAYERS):
            for c in range(len(CALLS)):
                mods, widths = CALLS[c]
                x, y = xs[layer][c], ys[layer][c]
                call = lora.check_call(x, lc.pool[layer], lc.index, tokens, mods, MAX_RANK, H)
                cfg = lora._path_config(batch, H, call.width, MAX_RANK, len(mods), widths, False)
                h = ws2[: cfg.split_k * batch * len(mods) * MAX_RANK].view(
                    cfg.split_k, batch, len(mods), MAX_RANK)  # fmt: skip
                side.wait_stream(main)
                with torch.cuda.stream(side):
                    lora._shrink(x, h, lc.pool[layer], lc.index, tokens, mods, MAX_RANK, cfg,
                                 call, False)  # fmt: skip
                torch.mm(x, weights[layer][c].t(), out=y)
                main.wait_stream(side)
                lora._expand(y, h, lc.pool[layer], lc.index, tokens, mods, widths, MAX_RANK,
                             cfg, call, False)  # fmt: skip

    fns = {"base": base, "serial": serial, "side": overlapped(True),
           "side, no add": overlapped(False), "shrink aside": shrink_aside,
           "side fused, no add": overlapped(False, fused=True)}  # fmt: skip
    # The overlapped result equals the serial one (up to the rounding of one add).
    serial()
    want = [y.clone() for layer in ys for y in layer]
    for fn in (overlapped(True), shrink_aside):
        fn()
        torch.cuda.synchronize()
        for got, w in zip((y for layer in ys for y in layer), want, strict=True):
            torch.testing.assert_close(got, w, rtol=2e-2, atol=2e-2)
    return {name: kb.timed(fn, LAYERS, eager=False).graph_us for name, fn in fns.items()}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--batches", type=int, nargs="+", default=[1, 8, 16, 32, 64])
    ap.add_argument(
        "--carveouts",
        type=int,
        nargs="*",
        default=[],
        help="SMs the GEMMs leave free (cuBLASLt for every row then)",
    )
    ap.add_argument("--out", type=Path, default=REPO / "bench/results/lora_overlap.json")
    args = ap.parse_args()
    rows = []
    print(f"{'SMs out':>7} {'batch':>5} {'base':>7} {'serial':>7} {'side':>7} {'no add':>7} "
          f"{'shrink':>7} {'fused':>7}  (µs a layer)")  # fmt: skip
    for carveout in args.carveouts or [None]:
        gen = torch.Generator().manual_seed(0)
        for batch in args.batches:
            with kb.gemm_carveout(carveout) if carveout is not None else contextlib.nullcontext():
                t = variants(batch, gen)
            rows.append({"carveout": carveout, "batch": batch,
                         **{k: round(v, 2) for k, v in t.items()}})  # fmt: skip
            out = "-" if carveout is None else carveout
            print(f"{out:>7} {batch:>5} {t['base']:>7.1f} {t['serial']:>7.1f} {t['side']:>7.1f} "
                  f"{t['side, no add']:>7.1f} {t['shrink aside']:>7.1f} "
                  f"{t['side fused, no add']:>7.1f}", flush=True)  # fmt: skip
    write_result(args.out, "lora_overlap.py", {
        "benchmark": "one layer's q/k/v and o GEMMs with S1 LoRA calls: serial or on a side stream",
        "gpu": torch.cuda.get_device_name(),
        "blas": "cublaslt" if args.carveouts else "default", "rows": rows,
    })  # fmt: skip


if __name__ == "__main__":
    main()
