"""How many distinct adapters the steps of a saturating trace hold, admitted in arrival order or
with adapter affinity (services/inference/engine/affinity.py), on a model of the scheduler.

Every step reads each distinct adapter of its batch once, so the adapters summed over steps are
what a trace's LoRA bytes follow. The model: DESIGN.md's trace (bench/serving.make_trace,
with_adapters: the same requests and adapters as bench/serving.py), continuous batching with a
token budget a step, a cap on running sequences and a KV capacity in tokens (a page of headroom
kept per running sequence, as the scheduler's decode reserve), prompts chunked into the budget
left by the decodes; admission as the engine's scheduler makes it (engine/scheduler.py): each
step offers the queue's requests through engine/affinity.Affinity, the engine's own code, on a
copy of the queue, admits what fits and stops at the first that does not, which stays where it
is (and one request is offered even when the decodes and prompts already fill the step's
budget). It has no preemption, no fairness between tenants (one tenant) and no adapter loads
(every adapter ready), so it counts the order's effect alone; the steps are not timed. The
defaults are the H200 engine's: 512 sequences, 2048 tokens a step, and KV for about 430 running
sequences of the trace (as in its serving runs).

``--count-offers`` counts a request as passed over when one behind it is offered rather than
admitted, as the engine did before 2026-12-06 (affinity.py says why that undid the bound): with
it the model gives the adapters a step that the services measured then.

    python bench/affinity_sim.py --adapters 5 100 1000 2000 --affinity 0 512 128 [--count-offers]
"""

from __future__ import annotations

import argparse
import math
import statistics
import sys
from collections import deque
from dataclasses import dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

from bench.provenance import write_result  # noqa: E402
from bench.serving import make_trace, with_adapters  # noqa: E402
from services.inference.engine.affinity import Affinity  # noqa: E402


@dataclass(eq=False)
class _Seq:
    index: int  # its place in arrival order
    adapter: int | None
    prompt: int
    output: int
    prefilled: int = 0
    generated: int = 0
    passed_over: int = 0

    @property
    def kv(self) -> int:
        return self.prefilled + self.generated


class _CountOffers(Affinity):
    """Affinity with the count before 2026-12-06: the requests ahead of one that is offered
    are passed over, admitted or not."""

    def take(self, queue: deque) -> _Seq:
        seq = super().take(queue)
        self._pass_over()  # at once, not when (and if) it is admitted
        return seq


def simulate(
    trace,
    affinity: int,
    max_seqs: int,
    budget: int,
    kv_tokens: int,
    page: int,
    count_offers: bool = False,
) -> dict:
    waiting = [_Seq(i, r.adapter, r.prompt_len, r.output_len) for i, r in enumerate(trace)]
    running: list[_Seq] = []
    steps = mixed = 0
    adapter_steps = decode_adapter_steps = 0
    ttft: list[int] = []
    late = 0  # the most admissions a request waited beyond its place in arrival order
    order = _CountOffers if count_offers else Affinity
    while waiting or running:
        steps += 1
        tokens = prefill = 0
        for seq in running:  # decodes and unfinished prompt chunks, oldest first
            if seq.prefilled < seq.prompt:
                chunk = min(seq.prompt - seq.prefilled, budget - tokens)
                seq.prefilled += chunk
                tokens += chunk
                prefill += chunk
            else:
                seq.generated += 1
                tokens += 1
        admission = order(running, affinity)
        kv = sum(s.kv for s in running)
        offered = deque(waiting)  # the scheduler's admission reads a copy of its queue
        admitted = set()
        while offered and len(running) < max_seqs:
            seq = admission.take(offered)
            if tokens >= budget or kv + seq.prompt + page * len(running) > kv_tokens:
                break  # no budget or no room: it stays in its place; nothing more joins now
            seq.prefilled = min(seq.prompt, budget - tokens)
            tokens += seq.prefilled
            prefill += seq.prefilled
            kv += seq.prompt
            running.append(seq)
            admitted.add(id(seq))
            admission.admitted(seq)
            late = max(late, len(ttft) - seq.index)
            ttft.append(steps)
        if admitted:
            waiting = [s for s in waiting if id(s) not in admitted]
        distinct = len({s.adapter for s in running if s.adapter is not None})
        adapter_steps += distinct
        if prefill:
            mixed += 1
        else:
            decode_adapter_steps += distinct
        running = [s for s in running if s.prefilled < s.prompt or s.generated < s.output]
    ttft.sort()
    return {
        "admitted": len(ttft),
        "steps": steps,
        "mixed_steps": mixed,
        "adapter_steps": adapter_steps,
        "decode_adapter_steps": decode_adapter_steps,
        "mean_adapters_per_step": adapter_steps / steps,
        "ttft_steps_p50": statistics.median(ttft),
        "ttft_steps_p99": ttft[min(len(ttft) - 1, int(0.99 * len(ttft)))],
        "ttft_steps_max": ttft[-1],
        "most_admissions_late": late,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--adapters", type=int, nargs="+", default=[5, 100, 1000, 2000])
    parser.add_argument("--affinity", type=int, nargs="+", default=[0, 512, 256, 128],
                        help="bounds to compare (0: arrival order)")  # fmt: skip
    parser.add_argument("--requests", type=int, default=1000)
    parser.add_argument("--max-num-seqs", type=int, default=512)
    parser.add_argument("--tokens-per-step", type=int, default=2048)
    parser.add_argument("--kv-tokens", type=int, default=200_000)
    parser.add_argument("--page-size", type=int, default=16)
    parser.add_argument("--alpha", type=float, default=1.0)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--count-offers",
        action="store_true",
        help="pass requests over when one behind is offered (the old count)",
    )
    parser.add_argument("--out", type=Path, default=REPO / "bench/results/affinity_sim.json")
    args = parser.parse_args()

    rows = []
    header = (
        f"{'adapters':>8} {'affinity':>8} {'steps':>6} {'adapter-steps':>13} {'vs order':>8} "
        f"{'per step':>8} {'TTFT p50/p99/max (steps)':>24} {'most late':>9}"
    )
    print(header)
    for n in args.adapters:
        trace = with_adapters(
            make_trace(math.inf, args.requests, None, args.seed), n, args.alpha, args.seed
        )
        first = None
        for bound in args.affinity:
            r = simulate(trace, bound, args.max_num_seqs, args.tokens_per_step, args.kv_tokens,
                         args.page_size, args.count_offers)  # fmt: skip
            first = first or r["adapter_steps"]
            row = {"adapters": n, "affinity": bound, **r,
                   "vs_first": r["adapter_steps"] / first if first else None}  # fmt: skip
            rows.append(row)
            vs = "" if row["vs_first"] is None else f"{row['vs_first']:.3f}"
            print(f"{n:>8} {bound:>8} {r['steps']:>6} {r['adapter_steps']:>13} {vs:>8} "
                  f"{r['mean_adapters_per_step']:>8.1f} "
                  f"{r['ttft_steps_p50']:>10.0f}/{r['ttft_steps_p99']}/{r['ttft_steps_max']:<5} "
                  f"{r['most_admissions_late']:>9}")  # fmt: skip
    write_result(args.out, "affinity_sim.py", {
        "benchmark": "adapters summed over the steps of a saturating trace, by admission order",
        "model": "scheduler model (no timing): token budget, sequence cap, KV capacity",
        "config": {k: v for k, v in vars(args).items() if k != "out"},
        "rows": rows,
    })  # fmt: skip


if __name__ == "__main__":
    main()
