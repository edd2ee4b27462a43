"""The scheduler on DESIGN.md's serving traces with and without its decode reserve, on the CPU.

The engine's own scheduler, pool and step loop (EngineCore, one step after the other) run the
trace of bench/serving.py on the tiny generated model, with the H200 service's sizes (16-token
pages, the pool's KV pages, 512 sequences, 2048 tokens a step): what the scheduler decides
depends on tokens and pages, not on the model. Each step's GPU time is modeled by a
least-squares fit to a serving run's base-model step log (decode steps: a + b x sequences + c x
context tokens read; steps with prefill: a + b x tokens + c x context tokens + d x attention
pairs), and a modeled clock, advanced by each step's modeled time, sets when requests arrive
(rate traces) and when their tokens come. Figures are therefore modeled, not measured: the
fit's own check is the serving run's steps, whose modeled total it prints beside their GPU time.

With the reserve (Scheduler.decode_reserve, the engine's default), a queued sequence joins only
if its pages leave one free page for each running sequence; without it admission takes every
free page and the running sequences' growth then preempts the newest, to be recomputed.

    python bench/admission.py [--runs inf:1000 40:15] [--num-pages 13000] \
        [--serving bench/results/serving_s1_apart.json] [--out bench/results/admission.json]
"""

from __future__ import annotations

import argparse
import hashlib
import json
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

import torch  # noqa: E402

from bench.provenance import write_result  # noqa: E402
from bench.serving import make_trace, parse_run  # noqa: E402
from bench.serving_report import pct  # noqa: E402
from bench.step_compare import load_runs  # noqa: E402
from services.inference.engine.api import AdapterKey, GenerationRequest  # noqa: E402
from services.inference.engine.config import EngineConfig  # noqa: E402
from services.inference.engine.core import EngineCore  # noqa: E402
from services.inference.engine.sampling_params import SamplingParams  # noqa: E402
from services.inference.tiny_model import make_model  # noqa: E402

PAGE_SIZE = 16  # the service's default
STEP_TOKENS = 2048  # a step's tokens (prefill chunks + decodes), the service's default
# The H200 service's pool at its defaults holds about this many KV pages: its saturating run's
# steps read at most 206,956 context tokens (bench/results/serving_s1_apart.json's log).
NUM_PAGES = 13000


def saturating_base(runs: dict[tuple, list[dict]]) -> list[dict] | None:
    """The steps of a serving run's base model on its trace of requests all at once (pass 1):
    what StepModel is fit to. ``runs``: bench.step_compare.load_runs's."""
    for (trace, n, pas), steps in runs.items():
        if trace.startswith("inf:") and n == 0 and pas == 1:
            return steps
    return None


def fullest_step(steps: list[dict]) -> dict:
    """The step at the 90th percentile of context tokens read: how full a run's steps got
    (bench/step_kinds.py's occupancy)."""
    return sorted(steps, key=lambda s: s["kv_read"])[int(0.9 * (len(steps) - 1))]


def fit_to(serving: Path) -> tuple[dict, dict[tuple, list[dict]], list[dict], StepModel]:
    """A serving run's JSON, its runs' steps (its step log beside it, NAME_steps.jsonl.gz),
    the base model's steps of its trace of requests all at once, and the StepModel fit to
    them. Raises ValueError when it has no such trace."""
    result, runs = load_runs(serving, serving.with_name(serving.stem + "_steps.jsonl.gz"))
    base = saturating_base(runs)
    if base is None:
        raise ValueError(f"{serving} has no base-model run of requests all at once (inf:N, "
                         "pass 1)")  # fmt: skip
    return result, runs, base, StepModel(base)


def least_squares(x: list[list[float]], y: list[float]) -> list[float]:
    """The coefficients c minimizing |x c - y| (x: a row of features per sample)."""
    xt = torch.tensor(x, dtype=torch.float64)
    yt = torch.tensor(y, dtype=torch.float64)[:, None]
    return torch.linalg.lstsq(xt, yt).solution[:, 0].tolist()


class StepModel:
    """Modeled GPU ms of a step record, fit to a serving run's steps."""

    def __init__(self, steps: list[dict]) -> None:
        self.decode = self._fit([s for s in steps if s["prefill_tokens"] == 0], self._decode_x)
        self.mixed = self._fit([s for s in steps if s["prefill_tokens"] > 0], self._mixed_x)

    @staticmethod
    def _decode_x(s: dict) -> list[float]:
        return [1.0, s["seqs"], s["kv_read"]]

    @staticmethod
    def _mixed_x(s: dict) -> list[float]:
        return [1.0, s["tokens"], s["kv_read"], s["attn_pairs"]]

    @staticmethod
    def _fit(steps: list[dict], features) -> list[float]:
        return least_squares([features(s) for s in steps], [s["gpu_ms"] for s in steps])

    def ms(self, s: dict) -> float:
        coef, x = (
            (self.decode, self._decode_x(s))
            if s["prefill_tokens"] == 0
            else (self.mixed, self._mixed_x(s))
        )
        return sum(c * v for c, v in zip(coef, x, strict=True))


def simulate(
    model_dir: Path,
    run: str,
    reserve: bool,
    cost: Callable[[dict], float],
    num_pages: int,
    adapter_of: Callable[[int], AdapterKey | None] = lambda i: None,
    setup: Callable[[EngineCore], None] = lambda core: None,
    compute: bool = True,
    max_num_seqs: int = 512,
    **engine: object,
) -> dict:
    """One trace through the engine's scheduler on the CPU, each step's time ``cost(record)``
    ms. ``adapter_of``: the adapter of the trace's request i (default: the base model);
    ``setup``: called with the engine before the trace (to add those adapters); ``compute``:
    False skips the model's forward pass, every sampled token's logits zeros (what the
    scheduler decides depends on tokens and pages, not on the tokens' values: every request
    ignores EOS); ``max_num_seqs``: the running batch's bound (512: the H200 service's);
    ``engine``: more EngineConfig fields."""
    rate, count, seconds = parse_run(run)
    cfg = EngineConfig(
        model_dir=model_dir, device="cpu", page_size=PAGE_SIZE, num_pages=num_pages,
        max_num_seqs=max_num_seqs, max_num_batched_tokens=STEP_TOKENS, max_model_len=1100,
        max_queue=8192,
        **engine,
    )  # fmt: skip
    core = EngineCore(cfg, None)
    core.scheduler.decode_reserve = reserve
    if not compute:
        vocab_size = core.model_config.vocab_size
        core.runner.execute = lambda entries: torch.zeros(sum(e.sample for e in entries),
                                                          vocab_size)  # fmt: skip
    setup(core)
    trace = make_trace(rate, count, seconds, seed=0)
    gen = torch.Generator().manual_seed(0)
    vocab = core.model_config.vocab_size
    arrivals = []
    for i, r in enumerate(trace):
        ids = torch.randint(3, vocab, (r.prompt_len,), generator=gen).tolist()
        sampling = SamplingParams(max_new_tokens=r.output_len, ignore_eos=True)
        arrivals.append((r.arrival_s, GenerationRequest(f"r{i}", prompt_token_ids=ids,
                                                        adapter=adapter_of(i),
                                                        sampling=sampling)))  # fmt: skip
    clock, k, steps = 0.0, 0, []
    first: dict[str, float] = {}
    last = 0.0
    start = time.perf_counter()
    while k < len(arrivals) or core.has_work:
        while k < len(arrivals) and arrivals[k][0] <= clock:
            core.add_request(arrivals[k][1])
            k += 1
        if not core.has_work:
            clock = arrivals[k][0]  # idle until the next arrival
            continue
        outputs = core.step()
        record = core.step_log.recent[-1].public()
        steps.append(record)
        clock += cost(record) / 1e3
        for out in outputs:
            first.setdefault(out.request_id, clock)
            last = clock
    arrival = {f"r{i}": r.arrival_s for i, r in enumerate(trace)}
    ttft = [first[rid] - arrival[rid] for rid in first]
    prompts = sum(r.prompt_len for r in trace)
    gpu_s = sum(cost(s) for s in steps) / 1e3
    fingerprint = [(s["seqs"], s["tokens"], s["kv_read"], s["adapters"]) for s in steps]
    fullest = fullest_step(steps)
    return {
        "run": run, "decode_reserve": reserve, "requests": len(trace), "steps": len(steps),
        "steps_with_prefill": sum(1 for s in steps if s["prefill_tokens"] > 0),
        "median_batch": statistics.median(s["seqs"] for s in steps),
        # how full the steps got: the 90th percentile of context tokens read, and that step's
        # sequences and adapters (bench/step_kinds.py's occupancy)
        "kv_read_p90": fullest["kv_read"], "seqs_at_kv_p90": fullest["seqs"],
        "adapters_at_kv_p90": fullest["adapters"],
        "preemptions": core.scheduler.preemptions,
        "recomputed_tokens": sum(s["prefill_tokens"] for s in steps) - prompts,
        "modeled_gpu_s": round(gpu_s, 3),
        "modeled_output_tokens_per_s": round(sum(r.output_len for r in trace) / clock, 1),
        "modeled_ttft_p50_s": round(pct(ttft, 50), 4),
        "modeled_ttft_p99_s": round(pct(ttft, 99), 4),
        "modeled_last_end_after_last_arrival_s": round(last - max(arrival.values()), 3),
        "cpu_s": round(time.perf_counter() - start, 1),
        # each step's sequences, tokens, context read and adapters, hashed: equal runs decided
        # alike
        "steps_hash": hashlib.sha256(json.dumps(fingerprint).encode()).hexdigest()[:16],
    }  # fmt: skip


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--runs", nargs="+", default=["inf:1000", "40:15"],
                    help="RATE:SECONDS, or inf:REQUESTS (bench/serving.py's traces)")  # fmt: skip
    ap.add_argument("--num-pages", type=int, default=NUM_PAGES)
    ap.add_argument("--serving", type=Path,
                    default=REPO / "bench/results/serving_s1_apart.json",
                    help="a serving run whose base-model steps (n = 0, pass 1, all at once) "
                         "the cost model is fit to; its step log beside it "
                         "(NAME_steps.jsonl.gz)")  # fmt: skip
    ap.add_argument("--out", type=Path, default=REPO / "bench/results/admission.json")
    args = ap.parse_args()
    try:
        _, _, base, cost = fit_to(args.serving)
    except ValueError as exc:
        ap.error(str(exc))
    real = sum(s["gpu_ms"] for s in base) / 1e3
    modeled = sum(cost.ms(s) for s in base) / 1e3
    print(
        f"cost model: its serving run's base steps {real:.2f} s of GPU time, modeled "
        f"{modeled:.2f} s"
    )
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        model_dir = make_model(Path(tmp) / "model", preset="tiny-llama")
        for run in args.runs:
            for reserve in (False, True):
                row = simulate(model_dir, run, reserve, cost.ms, args.num_pages)
                print(row, flush=True)
                rows.append(row)
    print(
        f"\n{'run':10s} {'reserve':>7s} {'steps':>6s} {'preempt':>7s} {'recomputed':>10s} "
        f"{'GPU s':>7s} {'tok/s':>7s} {'TTFT p50':>9s} {'p99':>7s} {'tail s':>7s}"
    )
    for r in rows:
        print(
            f"{r['run']:10s} {('on' if r['decode_reserve'] else 'off'):>7s} {r['steps']:6d} "
            f"{r['preemptions']:7d} {r['recomputed_tokens']:10d} {r['modeled_gpu_s']:7.2f} "
            f"{r['modeled_output_tokens_per_s']:7.0f} {r['modeled_ttft_p50_s']:9.3f} "
            f"{r['modeled_ttft_p99_s']:7.3f} {r['modeled_last_end_after_last_arrival_s']:7.2f}"
        )
    print("(modeled: each step's GPU time from the fit, the clock from their sum)")
    write_result(args.out, "admission.py", {
        "benchmark": "the scheduler on the serving traces, decode reserve off and on; step "
        "times modeled by a fit to a serving run's base-model steps (H200)",
        "serving_run": str(args.serving.relative_to(REPO)) if args.serving.is_relative_to(REPO)
        else str(args.serving),
        "cost_model": {"decode": cost.decode, "mixed": cost.mixed, "fit_run_gpu_s": real,
                       "fit_run_modeled_s": modeled},
        "num_pages": args.num_pages, "page_size": PAGE_SIZE, "rows": rows,
    })  # fmt: skip


if __name__ == "__main__":
    main()
