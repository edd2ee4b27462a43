"""Host time of StepBatch.fill: the step metadata the engine writes before every forward pass.

The GPU waits for it (a step's fill runs after the previous step's sampling), so its host time
adds to every step. Cases: decode steps of 64 and 256 sequences (one token each, contexts of a
few hundred to a few thousand tokens, pages of 16) and a prefill step of 8 prompts of 512
tokens; adapters distinct, as the scheduler sorts them. Median over repeats of the mean of 200
fills.

    python bench/step_batch.py [--device cuda|cpu] [--out bench/results/step_batch.json]
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

import torch  # noqa: E402

from bench import adapter_load  # noqa: E402
from services.inference.engine.batch import BatchEntry, StepBatch  # noqa: E402

PAGE = 16


def _decode(seqs: int, lo: int, hi: int, rng: random.Random) -> list[BatchEntry]:
    out = []
    for b in range(seqs):
        ctx = rng.randint(lo, hi)
        pages = rng.sample(range(100_000), ctx // PAGE + 1)
        out.append(BatchEntry([rng.randrange(32000)], ctx, pages, b, True))
    return out


def _prefill(seqs: int, tokens: int, rng: random.Random) -> list[BatchEntry]:
    out = []
    for b in range(seqs):
        pages = rng.sample(range(100_000), -(-tokens // PAGE))
        ids = [rng.randrange(32000) for _ in range(tokens)]
        out.append(BatchEntry(ids, 0, pages, b, True))
    return out


def time_fill(batch: StepBatch, entries: list[BatchEntry], repeats: int, n: int = 200) -> float:
    for _ in range(20):
        batch.fill(entries)
    means = []
    for _ in range(repeats):
        t = time.perf_counter()
        for _ in range(n):
            batch.fill(entries)
        means.append((time.perf_counter() - t) / n)
    return statistics.median(means) * 1e6


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    default = "cuda" if torch.cuda.is_available() else "cpu"
    ap.add_argument("--device", default=default)
    ap.add_argument("--repeats", type=int, default=7)
    ap.add_argument("--out", default=str(REPO / "bench/results/step_batch.json"))
    args = ap.parse_args()
    device = torch.device(args.device)
    rng = random.Random(0)
    cases = {
        "decode, 64 sequences, contexts 128-384": _decode(64, 128, 384, rng),
        "decode, 256 sequences, contexts 512-2048": _decode(256, 512, 2048, rng),
        "prefill, 8 prompts of 512 tokens": _prefill(8, 512, rng),
    }
    batch = StepBatch(8192, 256, 4096 // PAGE + 1, 258, PAGE, device)
    rows = []
    for name, entries in cases.items():
        us = time_fill(batch, entries, args.repeats)
        rows.append({"case": name, "fill_us": round(us, 1)})
        print(f"{name:45s} {us:8.1f} µs")
    machine = adapter_load.machine() | {"device": args.device}
    with open(args.out, "w") as f:
        command = "python bench/step_batch.py " + " ".join(sys.argv[1:])
        json.dump({"command": command, "machine": machine, "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
