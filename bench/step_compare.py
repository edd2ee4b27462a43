"""What adapters add to each kind of step: one serving run's step log, a LoRA run against the base
model's, step by step at the same batch.

bench/serving.py runs its traces one after another on one service, whose step log (one JSON line a
step, engine/step_log.py) holds them all in order; each result of its JSON counts its run's steps.
This splits the log into the runs (the steps before them are the service's own warm-up), then bins
the decode steps (64 sequences and more) by batch and the mixed steps (over
lora_paths.FUSED_MAX_TOKENS, 512) by tokens, and prints for each bin the median GPU time of the base
run's steps and of the LoRA run's, their difference, and the time the LoRA run's adapter bytes take
at the copy bandwidth the serving run measured (the least the difference could be); then the whole
runs' GPU time and the throughput ratio the adapter bytes alone would allow, and with them the
activations the LoRA calls read and write (totals; from the run's shape and workload); then every
LoRA step against the base model's steps fit to its shape (over_fit), by kind of step (decode,
mixed, and mixed steps of decode size, FUSED_MAX_TOKENS tokens or fewer, apart) and LoRA kernel
path, and for decode and mixed steps a line through that time against their adapter bytes' time
(bytes_line: a fixed cost a step, and a cost a byte as a multiple of the copy bandwidth's); last,
what sets the step mix (schedule: each run's steps, decode batch and peak of context tokens).

    python bench/step_compare.py --serving bench/results/serving_s1_n1000.json \
        --steps bench/results/serving_s1_n1000_steps.jsonl.gz --base 0:2 --lora 1000:2
"""

from __future__ import annotations

import argparse
import gzip
import json
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.bench_models import SHAPES  # noqa: E402
from bench.kernels import CALLS  # noqa: E402
from bench.provenance import write_result  # noqa: E402
from bench.serving import WORKLOADS  # noqa: E402
from kernels.lora_layout import MODULES  # noqa: E402
from kernels.lora_paths import FUSED_MAX_TOKENS  # noqa: E402
from store.base_model import BaseModelShape  # noqa: E402


def activation_bytes_per_token(
    base: BaseModelShape, modules: tuple[str, ...], dtype_bytes: int = 2
) -> int:
    """Bytes a token's LoRA calls move besides the adapters' weights in one step through every
    layer of ``base``, for adapters on ``modules``: each of the engine's calls (bench/kernels.py
    CALLS: q/k/v in one, o, gate/up in one, down) covering one of them reads its
    input once and reads and writes its outputs (in place; with the addend it writes the delta
    and the GEMM reads it back: as much). What LoRA applied in kernels of its own, apart from
    the base model's GEMMs, moves through memory, short of fusing with the kernels around it
    (or finding its input still in L2)."""
    elements = 0
    for call, _, _ in CALLS:
        covered = [MODULES[m] for m in call if MODULES[m] in modules]
        if covered:
            elements += base.module_dims(covered[0]).d_in
            elements += 2 * sum(base.module_dims(m).d_out for m in covered)
    return elements * dtype_bytes * base.num_layers


def split_runs(steps: list[dict], results: list[dict]) -> dict[tuple[str, int, int], list[dict]]:
    """The steps of each (trace, adapters, pass) run, from the results' step counts (in run
    order)."""
    total = sum(r["steps"] for r in results)
    if total > len(steps):
        raise ValueError(f"the results count {total} steps, the log holds {len(steps)}")
    runs, at = {}, len(steps) - total
    for r in results:
        runs[r.get("run", ""), r["adapters"], r.get("pass", 1)] = steps[at : at + r["steps"]]
        at += r["steps"]
    return runs


def load_runs(serving_path: Path, steps_path: Path) -> tuple[dict, dict[tuple, list]]:
    """A serving run's JSON and its step log (.gz or not), split into its runs (split_runs)."""
    serving = json.loads(serving_path.read_text())
    opener = gzip.open if steps_path.suffix == ".gz" else open
    with opener(steps_path, "rt") as f:
        steps = [json.loads(line) for line in f if line.strip()]
    return serving, split_runs(steps, serving["results"])


def bins(steps: list[dict], mixed: bool) -> dict[int, list[dict]]:
    out: dict[int, list[dict]] = {}
    for s in steps:
        if mixed and s["prefill_tokens"] > 0 and s["tokens"] > FUSED_MAX_TOKENS:
            out.setdefault(s["tokens"] // 256 * 256, []).append(s)
        elif not mixed and s["prefill_tokens"] == 0 and s["seqs"] >= 64:
            out.setdefault(s["seqs"] // 32 * 32, []).append(s)
    return out


def compare(base: list[dict], lora: list[dict], bandwidth: float, mixed: bool) -> list[dict]:
    rows = []
    b, lo = bins(base, mixed), bins(lora, mixed)
    for key in sorted(lo):
        if len(b.get(key, ())) < 4 or len(lo[key]) < 4:
            continue  # too few steps to say
        base_ms = statistics.median(s["gpu_ms"] for s in b[key])
        lora_ms = statistics.median(s["gpu_ms"] for s in lo[key])
        nbytes = statistics.median(s["adapter_bytes"] for s in lo[key])
        rows.append({
            "tokens" if mixed else "batch": key, "steps": len(lo[key]),
            "base_ms": round(base_ms, 2), "lora_ms": round(lora_ms, 2),
            "extra_ms": round(lora_ms - base_ms, 2),
            "adapters": statistics.median(s["adapters"] for s in lo[key]),
            "adapter_bytes_ms": round(nbytes / bandwidth * 1e3, 2),
        })  # fmt: skip
    return rows


def totals(base: list[dict], lora: list[dict], bandwidth: float, token_bytes: int = 0) -> dict:
    """Whole runs: GPU time of the base run's steps and of the LoRA run's (the same trace, so
    the same tokens), and the time the LoRA run's adapter bytes take at the copy bandwidth. A
    LoRA run whose steps each took the base model's time plus its adapters' bytes would run at
    ``bytes_bound_ratio`` of the base model's speed (steps bound by their bytes, as decode steps
    are): the most its kernels' bytes allow. ``token_bytes``: the activations' bytes a token's
    LoRA calls move a step (activation_bytes_per_token), counted for every token of a step with
    adapters (in the benchmark's LoRA runs every request has one): ``traffic_bound_ratio`` adds
    their time to the adapters' bytes'."""
    base_s = sum(s["gpu_ms"] for s in base) / 1e3
    lora_s = sum(s["gpu_ms"] for s in lora) / 1e3
    bytes_s = sum(s["adapter_bytes"] for s in lora) / bandwidth
    acts_s = sum(s["tokens"] for s in lora if s["adapters"]) * token_bytes / bandwidth
    return {
        "base_s": round(base_s, 3), "lora_s": round(lora_s, 3),
        "gpu_ratio": round(base_s / lora_s, 4), "adapter_bytes_s": round(bytes_s, 3),
        "bytes_bound_ratio": round(base_s / (base_s + bytes_s), 4),
        "extra_over_bytes": round((lora_s - base_s) / bytes_s, 2) if bytes_s else None,
        "activation_bytes_s": round(acts_s, 3) if token_bytes else None,
        "traffic_bound_ratio": (round(base_s / (base_s + bytes_s + acts_s), 4)
                                if token_bytes else None),
    }  # fmt: skip


def over_fit(base: list[dict], lora: list[dict], bandwidth: float) -> dict:
    """The LoRA run's steps against what the base model's steps would cost at their shape: a
    least-squares fit to the base run's steps (bench/admission.py's StepModel: decode steps by
    sequences and context tokens read, mixed steps by tokens, context read and attention pairs)
    applied to each LoRA step. ``schedule_s``: the fit over the LoRA run's steps against the
    base run's GPU time (what its different step mix costs, adapters aside); each row (kind of
    step, its LoRA path): the steps' GPU time beyond the fit (the LoRA kernels' cost in the
    step) and their adapter bytes at the copy bandwidth (the least that cost could be). Mixed
    steps of FUSED_MAX_TOKENS tokens or fewer are their own kind ("mixed, small"): the engine
    picks their path by their adapters (lora_paths.mixed_step_narrows); the lines count them
    among the mixed steps."""
    from bench.admission import StepModel

    model = StepModel(base)
    fit = [model.ms(s) for s in lora]
    # (step, its GPU ms beyond the fit) by kind of step and LoRA path
    groups: dict[tuple[str, str], list[tuple[dict, float]]] = {}
    for s, ms in zip(lora, fit, strict=True):
        kind = "decode"
        if s["prefill_tokens"]:
            kind = "mixed, small" if s["tokens"] <= FUSED_MAX_TOKENS else "mixed"
        groups.setdefault((kind, s.get("lora", "none")), []).append((s, s["gpu_ms"] - ms))
    rows = [
        {
            "kind": kind, "path": path, "steps": len(steps),
            "extra_s": round(sum(extra for _, extra in steps) / 1e3, 3),
            "adapter_bytes_s": round(sum(s["adapter_bytes"] for s, _ in steps) / bandwidth, 3),
        }
        for (kind, path), steps in sorted(groups.items())
    ]  # fmt: skip
    base_s = sum(s["gpu_ms"] for s in base) / 1e3
    lines = {}
    for kind in ("decode", "mixed"):
        steps = [(s, extra) for (k, _), group in groups.items() if k in (kind, f"{kind}, small")
                 for s, extra in group if s["adapter_bytes"]]  # fmt: skip
        line = bytes_line([s["adapter_bytes"] / bandwidth * 1e3 for s, _ in steps],
                          [extra for _, extra in steps])  # fmt: skip
        if line:
            lines[kind] = {"steps": len(steps), **line}
    return {"schedule_s": round(sum(fit) / 1e3 - base_s, 3), "rows": rows, "lines": lines}


def schedule(base: list[dict], lora: list[dict]) -> dict:
    """What the step mix comes from, for each run: its steps, its decode steps' mean batch and
    the most context tokens one step read (about the KV cache's peak). The same trace gives both
    runs the same tokens and context reads, so a run of more steps reads the weights more often;
    with adapters the pool's pages also hold the adapters in use, which leaves less room for the
    KV cache, so smaller batches fill it."""

    def one(steps: list[dict]) -> dict:
        decode = [s["seqs"] for s in steps if not s["prefill_tokens"]]
        return {
            "steps": len(steps),
            "decode_mean_batch": round(statistics.fmean(decode), 1) if decode else None,
            "peak_kv_tokens": max((s["kv_read"] for s in steps), default=0),
        }

    return {"base": one(base), "lora": one(lora)}


def bytes_line(bytes_ms: list[float], extra_ms: list[float]) -> dict | None:
    """The least-squares line extra = fixed + per_bytes x bytes through steps' time beyond the
    fit against their adapter bytes' time (both ms; bench/admission.py's least_squares):
    ``fixed_ms`` is what a step's LoRA calls cost whatever their bytes (their launches and
    latency), ``per_bytes`` how many times its bytes' time each byte costs (1: the calls stream
    at the copy bandwidth). None when the steps' bytes do not vary."""
    from bench.admission import least_squares

    n = len(bytes_ms)
    mean = sum(bytes_ms) / n if n else 0.0
    if n < 2 or sum((x - mean) ** 2 for x in bytes_ms) <= 1e-12 * n:
        return None
    fixed, slope = least_squares([[1.0, x] for x in bytes_ms], extra_ms)
    return {"fixed_ms": round(fixed, 3), "per_bytes": round(slope, 3),
            "mean_extra_ms": round(sum(extra_ms) / n, 3),
            "mean_bytes_ms": round(mean, 3)}  # fmt: skip


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--serving", type=Path, required=True, help="bench/serving.py's JSON")
    ap.add_argument("--steps", type=Path, required=True, help="that run's step log (.gz or not)")
    ap.add_argument("--base", default="0:1", help="ADAPTERS:PASS of the base run")
    ap.add_argument("--lora", required=True, help="ADAPTERS:PASS of the LoRA run")
    ap.add_argument("--run", default="inf:1000", help="the trace of both (bench/serving.py --runs)")
    ap.add_argument("--out", type=Path, default=None, help="write the rows as JSON here")
    args = ap.parse_args()
    serving, runs = load_runs(args.serving, args.steps)

    def pick(spec: str) -> list[dict]:
        key = (args.run, *(int(x) for x in spec.split(":")))
        if key not in runs:
            raise SystemExit(f"no run {key} in {args.serving}: it has {sorted(runs)}")
        return runs[key]

    base, lora = pick(args.base), pick(args.lora)
    bandwidth = serving["ceilings"]["copy_bytes_per_s"]
    report = {}
    for mixed in (False, True):
        kind = "mixed" if mixed else "decode"
        rows = report[kind] = compare(base, lora, bandwidth, mixed)
        print(f"{kind} steps ({'tokens' if mixed else 'batch'}): median GPU ms, base against "
              f"{args.lora} adapters:pass")  # fmt: skip
        print(f"{'bin':>6} {'steps':>5} {'base':>7} {'lora':>7} {'extra':>6} {'adapters':>8} "
              f"{'bytes':>6}")  # fmt: skip
        for r in rows:
            print(f"{r['tokens' if mixed else 'batch']:>6} {r['steps']:>5} {r['base_ms']:>7.2f} "
                  f"{r['lora_ms']:>7.2f} {r['extra_ms']:>6.2f} {r['adapters']:>8.0f} "
                  f"{r['adapter_bytes_ms']:>6.2f}")  # fmt: skip
    shape, workload = serving.get("shape"), serving.get("workload")
    token_bytes = 0
    if shape in SHAPES and workload in WORKLOADS:
        token_bytes = activation_bytes_per_token(SHAPES[shape].base(), WORKLOADS[workload][1])
    report["totals"] = t = totals(base, lora, bandwidth, token_bytes)
    print(f"all steps: base {t['base_s']:.2f} s, lora {t['lora_s']:.2f} s of GPU time "
          f"({t['gpu_ratio']:.3f}), the LoRA run's adapter bytes {t['adapter_bytes_s']:.2f} s: "
          f"the ratio they alone would allow {t['bytes_bound_ratio']:.3f}; the LoRA run's extra "
          f"time is {t['extra_over_bytes']:.1f}x its adapter bytes' time")  # fmt: skip
    if token_bytes:
        print(f"with the activations' traffic of its LoRA calls ({workload} on {shape}: each "
              f"call's input read, its outputs read and written; {token_bytes / 1e6:.2f} MB a "
              f"token a step) {t['activation_bytes_s']:.2f} s more: the ratio the traffic "
              f"allows {t['traffic_bound_ratio']:.3f}")  # fmt: skip
    report["over_fit"] = f = over_fit(base, lora, bandwidth)
    print(f"against the base model's steps fit to their shape: the LoRA run's step mix "
          f"{f['schedule_s']:+.2f} s; beyond the fit, by kind of step and LoRA path:")  # fmt: skip
    print(f"{'kind':>12} {'path':>26} {'steps':>5} {'extra s':>7} {'bytes s':>7}")
    for r in f["rows"]:
        print(f"{r['kind']:>12} {r['path']:>26} {r['steps']:>5} {r['extra_s']:>7.2f} "
              f"{r['adapter_bytes_s']:>7.2f}")  # fmt: skip
    for kind, line in f["lines"].items():
        print(
            f"{kind} steps with adapters ({line['steps']}), beyond the fit: "
            f"{line['fixed_ms']:.2f} ms + {line['per_bytes']:.2f}x their adapter bytes' time "
            f"(mean {line['mean_extra_ms']:.2f} ms on {line['mean_bytes_ms']:.2f} ms of bytes)"
        )
    report["schedule"] = m = schedule(base, lora)
    b, lo = m["base"], m["lora"]
    print(
        f"the step mix: {lo['steps']} steps against the base run's {b['steps']}, decode "
        f"steps' mean batch {lo['decode_mean_batch']} against {b['decode_mean_batch']}, at "
        f"most {lo['peak_kv_tokens']} context tokens a step against {b['peak_kv_tokens']}"
    )
    if args.out:
        write_result(args.out, "step_compare.py", {"serving_commit": serving.get("commit"),
                                                   **report})  # fmt: skip


if __name__ == "__main__":
    main()
