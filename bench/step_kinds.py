"""Where a serving run's GPU time goes, by kind of step, against two floors.

bench/serving.py's step log (one JSON line a step, engine/step_log.py) split into its runs as
bench/step_compare.py splits it; each run's steps are grouped into decode steps and mixed steps
(some prefill), each of under 64 sequences or more, and for each group this prints the steps,
their GPU time, and the time of two floors (bench/roofline.py, the ceilings the serving run
measured): the step's roofline (its bytes at the copy bandwidth or its FLOPs at the matmul rate,
whichever is longer: what a step could reach whose memory-bound and compute-bound work overlap)
and its phase floor (the projections at their bound, then the attention at its own: what a step
reaches that runs them one after the other, as the engine's steps do). A mixed step of 2048
tokens is compute-bound in its GEMMs and memory-bound in its decode attention, so the gap
between the two floors is what overlapping them could win. A second table says how full each
run's steps got (occupancy): a LoRA run's adapters hold pool pages that its KV cache then lacks.

    python bench/step_kinds.py --serving bench/results/serving_s1_pool_n1000.json \
        --steps bench/results/serving_s1_pool_n1000_steps.jsonl.gz
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.bench_models import SHAPES  # noqa: E402
from bench.provenance import write_result  # noqa: E402
from bench.roofline import Ceilings, Roofline  # noqa: E402
from bench.step_compare import load_runs  # noqa: E402


def kind(step: dict) -> str:
    return ("mixed" if step["prefill_tokens"] else "decode") + (
        " 64+" if step["seqs"] >= 64 else " <64"
    )


def group(steps: list[dict], roof: Roofline) -> list[dict]:
    """Per kind of step: count, GPU seconds, and both floors in seconds and as shares."""
    sums: dict[str, list[float]] = {}
    for s in steps:
        args = (s["tokens"], s["kv_read"], s["kv_written"], s["attn_pairs"], s["adapter_bytes"])
        row = sums.setdefault(kind(s), [0, 0.0, 0.0, 0.0])
        row[0] += 1
        row[1] += s["gpu_ms"] / 1e3
        row[2] += roof.step_bound_ms(*args) / 1e3
        row[3] += roof.step_phase_bound_ms(*args) / 1e3
    return [
        {"kind": k, "steps": int(n), "gpu_s": round(g, 3), "roofline_s": round(r, 3),
         "roofline_share": round(r / g, 3), "phase_floor_s": round(p, 3),
         "phase_share": round(p / g, 3)}
        for k, (n, g, r, p) in sorted(sums.items())
    ]  # fmt: skip


def occupancy(steps: list[dict]) -> dict:
    """How full a run's steps got: steps, and the 90th percentile of a step's sequences and of
    the KV tokens it read (the capacity the run held at its fullest; a LoRA run's adapters
    take pool pages from the KV cache, so its batches can be smaller and its steps more)."""

    def p90(values: list[int]) -> int:
        ranked = sorted(values)
        return ranked[min(len(ranked) - 1, (9 * len(ranked)) // 10)]

    return {"steps": len(steps), "seqs_p90": p90([s["seqs"] for s in steps]),
            "kv_read_p90": p90([s["kv_read"] for s in steps])}  # fmt: skip


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--serving", type=Path, required=True, help="bench/serving.py's JSON")
    ap.add_argument("--steps", type=Path, required=True, help="that run's step log (.gz or not)")
    ap.add_argument("--out", type=Path, default=None, help="write the rows as JSON here")
    args = ap.parse_args()
    serving, runs = load_runs(args.serving, args.steps)
    roof = Roofline.for_shape(SHAPES[serving["shape"]], Ceilings(**serving["ceilings"]))
    report = {}
    print(f"{'run':>16} {'kind':>10} {'steps':>5} {'GPU s':>7} {'roofline s':>10} {'share':>5} "
          f"{'phase s':>7} {'share':>5}")  # fmt: skip
    names = {key: "{} {}:{}".format(*key) for key in runs}  # trace adapters:pass
    for key, run in runs.items():
        name = names[key]
        rows = report[name] = group(run, roof)
        for r in rows:
            print(f"{name:>16} {r['kind']:>10} {r['steps']:>5} {r['gpu_s']:>7.2f} "
                  f"{r['roofline_s']:>10.2f} {r['roofline_share']:>5.2f} "
                  f"{r['phase_floor_s']:>7.2f} {r['phase_share']:>5.2f}")  # fmt: skip
    print("(run: trace adapters:pass; share: the floor's time over the GPU time)")
    full = {}
    print(f"\n{'run':>16} {'steps':>5} {'seqs p90':>8} {'KV read p90':>11}")
    for key, run in runs.items():
        name = names[key]
        o = full[name] = occupancy(run)
        print(f"{name:>16} {o['steps']:>5} {o['seqs_p90']:>8} {o['kv_read_p90']:>11}")
    print("(p90: a step's sequences and KV tokens read, 90th percentile over the run's steps)")
    if args.out:
        write_result(args.out, "step_kinds.py", {"serving_commit": serving.get("commit"),
                                                 "runs": report, "occupancy": full})  # fmt: skip


if __name__ == "__main__":
    main()
