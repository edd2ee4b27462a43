"""Whether a mixed step runs faster as two independent passes on two streams (CUDA; a question
for the engine's next design, not what it does now).

A mixed step of the saturating trace holds a few hundred decode tokens beside one or more
prompts' prefill chunks. The engine runs them as one pass: one GEMM per projection for all
tokens, then attention for all (decode rows and prompts side by side on two streams), and so
on, layer by layer. Over the S1 trace its mixed steps take about 0.87 of their phase floor
(GEMMs at the matmul rate, then attention at the copy bandwidth) but only 0.59 of their
roofline, where the two would overlap (bench/step_kinds.py). The decode tokens and the prompts
share no data inside a step but the weights, so the step could run as two passes, the decode
tokens' on one stream and the prompts' on another: the decode pass's KV reads (bandwidth) could
then run beside the prompts' GEMMs (tensor cores), at the price of reading every weight twice.

This times, in CUDA graphs, a Llama-7B-shape model of ``--layers`` layers (random bf16 weights,
no adapters) on the trace's mixed-step compositions:

- one pass: the engine's way;
- two passes, one after the other on one stream;
- two passes on two streams (the decode pass on the capturing stream, the prompts' on a second
  one, joined at the end);
- the decode pass alone and the prompts' pass alone.

With ``--carveouts`` the one pass and the two streams are timed again with the GEMMs told to
leave that many SMs to other work (cuBLASLt's SM count target, torch's experimental carve-out;
cuBLASLt for every GEMM then, carve-out 0 included): two streams can only overlap where the
GEMMs do not hold every SM. With ``--partitions K:P`` the two streams are timed with the SMs
shared out: the GEMMs leave K SMs free and the decode pass's attention runs on K x P programs
that stride over its rows (kernels/attention.py, DecodeLaunch.programs; one context split), so
the decode rows' KV reads keep to about K SMs while the GEMMs of either pass take the rest
(bench/sm_partition.py measures the two halves alone).

    python bench/mixed_split.py [--layers 8] [--carveouts 0 16 32 64] [--partitions 33:4] \
        [--out bench/results/mixed_split.json]

Measured (H200, 2026-12-03; mixed_split.json, mixed_split_carveout.json,
mixed_split_partition.json, mixed_split_partition2.json), µs a layer, one pass / two passes on
one stream / on two streams: 450 decodes + six 256-token prompts 2016.6 / 2067.2 / 2048.2; 400 +
four 400-token prompts 1947.5 / 2092.2 / 2112.9. Two streams overlap nothing; with the GEMMs
leaving SMs free the one pass slows and the two streams do not beat it; partitioned, the best
(48 SMs, 8 programs each) took 2185-2244 against 1947-1991. The engine keeps one pass.
"""

from __future__ import annotations

import argparse
import contextlib
import random
import sys
from dataclasses import replace
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

import torch  # noqa: E402

import kernels  # noqa: E402
from bench import kernels as kb  # noqa: E402
from bench.bench_models import SHAPES, Shape  # noqa: E402
from bench.provenance import write_result  # noqa: E402
from kernels import attention  # noqa: E402
from services.inference.engine.batch import BatchEntry, StepBatch  # noqa: E402
from services.inference.models.config import ModelConfig  # noqa: E402
from services.inference.models.llama import Transformer  # noqa: E402
from services.inference.tiny_model import BOS_TOKEN, EOS_TOKEN  # noqa: E402

PAGE = 16
MAX_LEN = SHAPES["llama-7b"].max_positions
# name: (decode sequences, their context), [(prompt chunk's start, its tokens)]
SCENARIOS = {
    "450 decodes at 400 + six 256-token prompts": ((450, 400), [(0, 256)] * 6),
    "400 decodes at 400 + four 400-token prompts": ((400, 400), [(0, 400)] * 4),
    "300 decodes at 400 + three 512-token prompts": ((300, 400), [(0, 512)] * 3),
    "300 decodes at 400 + a 1700-token chunk at 200": ((300, 400), [(200, 1700)]),
    "128 decodes at 300 + two 512-token prompts": ((128, 300), [(0, 512)] * 2),
}


def model_config(shape: Shape) -> ModelConfig:
    """The engine's config of a benchmark shape (bench/bench_models.py), as its model dir's
    config.json would give it."""
    return ModelConfig.from_dict(shape.config({BOS_TOKEN: 0, EOS_TOKEN: 1}))


def build_model(cfg: ModelConfig, device: torch.device) -> Transformer:
    with torch.device(device):
        model = Transformer(cfg, MAX_LEN)
    gen = torch.Generator(device).manual_seed(0)
    for name, buf in model.named_buffers():
        if name.startswith("rope_"):
            continue
        if name.endswith("layernorm.weight") or name == "norm.weight":
            buf.fill_(1.0)
        else:
            buf.normal_(0, 0.02, generator=gen)
    model.to(torch.bfloat16)
    model.init_rope(device)
    return model


def entries_for(decode, prompts, rng: random.Random, free: list[int]):
    """BatchEntries of the decode sequences and of the prompts' chunks, pages from ``free``."""
    dec, pre = [], []
    seqs, ctx = decode
    for _ in range(seqs):
        pages = [free.pop() for _ in range(ctx // PAGE + 1)]
        dec.append(BatchEntry([rng.randrange(32000)], ctx, pages, None, True))
    for start, n in prompts:
        pages = [free.pop() for _ in range(-(-(start + n) // PAGE))]
        ids = [rng.randrange(32000) for _ in range(n)]
        pre.append(BatchEntry(ids, start, pages, None, True))
    return dec, pre


def batch_of(entries, max_pages: int, device: torch.device) -> StepBatch:
    tokens = sum(len(e.token_ids) for e in entries)
    batch = StepBatch(tokens, len(entries), max_pages, 2, PAGE, device)
    batch.fill(entries)
    torch.cuda.synchronize()
    return batch


@contextlib.contextmanager
def decode_programs(programs: int):
    """The model's attention calls made with the decode rows on ``programs`` striding
    programs, one context split (kernels.paged_attention is looked up at each call)."""
    plain = kernels.paged_attention
    cfg = attention.DecodeLaunch(splits=1, programs=programs)

    def capped(*args, out=None, prefill_tiles=None):
        return attention.paged_attention(*args, out=out, prefill_tiles=prefill_tiles, decode=cfg)

    kernels.paged_attention = capped
    try:
        yield
    finally:
        kernels.paged_attention = plain


def scenario(model, pool, decode, prompts, max_pages: int, device, carveouts, partitions) -> dict:
    rng = random.Random(0)
    free = list(range(pool.shape[2] // PAGE))
    rng.shuffle(free)
    dec, pre = entries_for(decode, prompts, rng, free)
    both = batch_of(dec + pre, max_pages, device)
    bd = batch_of(dec, max_pages, device)
    bp = batch_of(pre, max_pages, device)
    side = torch.cuda.Stream(device)

    def one_pass():
        model(both, pool, None)

    def serial():
        model(bd, pool, None)
        model(bp, pool, None)

    def streams(decode_cap: int = 0):
        """The prompts' pass on the side stream, the decode pass on this one; with
        ``decode_cap``, its attention on that many striding programs."""
        main = torch.cuda.current_stream(device)
        side.wait_stream(main)
        with torch.cuda.stream(side):
            model(bp, pool, None)
        with decode_programs(decode_cap) if decode_cap else contextlib.nullcontext():
            model(bd, pool, None)
        main.wait_stream(side)

    fns = {
        "one pass": one_pass,
        "two passes, one stream": serial,
        "two passes, two streams": streams,
        "decode pass alone": lambda: model(bd, pool, None),
        "prompts' pass alone": lambda: model(bp, pool, None),
    }
    layers = len(model.layers)
    with torch.inference_mode():
        out = {name: kb.timed(fn, layers, eager=False).graph_us for name, fn in fns.items()}
        for carveout in carveouts:
            with kb.gemm_carveout(carveout):
                for name in ("one pass", "two passes, two streams"):
                    out[f"{name}, {carveout} SMs out"] = kb.timed(
                        fns[name], layers, eager=False
                    ).graph_us
        for sms, per_sm in partitions:
            cap = sms * per_sm
            with kb.gemm_carveout(sms):
                out[f"partitioned {sms}:{per_sm}"] = kb.timed(
                    lambda cap=cap: streams(cap), layers, eager=False
                ).graph_us
                with decode_programs(cap):
                    out[f"decode pass alone on {sms}:{per_sm}"] = kb.timed(
                        fns["decode pass alone"], layers, eager=False
                    ).graph_us
    out["tokens"] = both.num_tokens
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--carveouts", type=int, nargs="*", default=[])
    ap.add_argument("--partitions", nargs="*", default=[], help="K:P, SMs and programs an SM")
    ap.add_argument("--scenarios", type=int, default=len(SCENARIOS), help="the first N")
    ap.add_argument("--out", type=Path, default=REPO / "bench/results/mixed_split.json")
    args = ap.parse_args()
    device = torch.device("cuda")
    cfg = model_config(replace(SHAPES["llama-7b"], layers=args.layers))
    model = build_model(cfg, device)
    need = max(
        sum(-(-(s + n) // PAGE) for s, n in prompts) + decode[0] * (decode[1] // PAGE + 1)
        for decode, prompts in SCENARIOS.values()
    )
    max_pages = MAX_LEN // PAGE
    pool = torch.randn(args.layers, 2, (need + 16) * PAGE, cfg.kv_dim, device=device,
                       dtype=torch.bfloat16)  # fmt: skip
    rows = []
    print(f"{'scenario':48s} {'tokens':>6} {'one':>7} {'serial':>7} {'2 strm':>7} {'decode':>7} "
          f"{'prompts':>7}  (µs a layer)")  # fmt: skip
    for name, (decode, prompts) in list(SCENARIOS.items())[: args.scenarios]:
        parts = [tuple(int(v) for v in p.split(":")) for p in args.partitions]
        t = scenario(model, pool, decode, prompts, max_pages, device, args.carveouts, parts)
        rows.append({"scenario": name, **{k: round(v, 2) for k, v in t.items()}})
        prompts_alone = t["prompts' pass alone"]
        print(f"{name:48s} {t['tokens']:>6} {t['one pass']:>7.1f} "
              f"{t['two passes, one stream']:>7.1f} {t['two passes, two streams']:>7.1f} "
              f"{t['decode pass alone']:>7.1f} {prompts_alone:>7.1f}", flush=True)  # fmt: skip
        for carveout in args.carveouts:
            one, two = (
                t[f"{k}, {carveout} SMs out"] for k in ("one pass", "two passes, two streams")
            )
            print(f"{'':48s} {carveout:>3} SMs out: one pass {one:7.1f}, two streams {two:7.1f}",
                  flush=True)  # fmt: skip
        for part in args.partitions:
            both, alone = t[f"partitioned {part}"], t[f"decode pass alone on {part}"]
            print(f"{'':48s} partitioned {part}: {both:7.1f} (its decode pass alone {alone:7.1f})",
                  flush=True)  # fmt: skip
    write_result(args.out, "mixed_split.py", {
        "benchmark": "a mixed step as one pass or as a decode pass and a prompts' pass",
        "gpu": torch.cuda.get_device_name(), "layers": args.layers, "rows": rows,
    })  # fmt: skip


if __name__ == "__main__":
    main()
