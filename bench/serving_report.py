"""What bench/serving.py reports of a run: the clients' view (throughput, time to first token,
time per output token, the tail after the last arrival) and each step's share of its roofline
from the engine's step log, and the table it prints."""

from __future__ import annotations

import json
from collections import Counter
from pathlib import Path


def pct(values: list[float], q: float) -> float | None:
    if not values:
        return None
    values = sorted(values)
    return values[min(len(values) - 1, int(q / 100 * len(values)))]


def analyse(results: list[dict], steps: list[dict], roof) -> dict:
    ok = [r for r in results if r["status"] == "OK" and r["tokens"] > 0]
    rejected = sum(r["status"] == "RESOURCE_EXHAUSTED" for r in results)
    failed = sum(r["status"] not in ("OK", "RESOURCE_EXHAUSTED") for r in results)
    begin = min(r["sent"] for r in results)
    end = max((r["last"] for r in ok), default=begin)
    tokens = sum(r["tokens"] for r in ok)
    ttft = [r["first"] - r["sent"] for r in ok]
    tpot = [(r["last"] - r["first"]) / (r["tokens"] - 1) for r in ok if r["tokens"] > 1]
    window = [s for s in steps if begin <= s["launched_at"] <= end and s["gpu_ms"]]
    for s in window:
        args = (s["tokens"], s["kv_read"], s["kv_written"], s["attn_pairs"])
        lora = s.get("adapter_bytes", 0)  # the step's adapters' weights, read once
        s["share"] = roof.step_bound_ms(*args, adapter_bytes=lora) / s["gpu_ms"]
        s["phase_share"] = roof.step_phase_bound_ms(*args, adapter_bytes=lora) / s["gpu_ms"]
    # The device's busy share of the steps' span: with steps launched ahead it is below 1 only
    # where the step thread launched nothing while the device had finished (the host's stalls)
    gpu_s = sum(s["gpu_ms"] for s in window) / 1e3
    span_s = (
        window[-1]["launched_at"] + window[-1]["gpu_ms"] / 1e3 - window[0]["launched_at"]
        if window
        else 0.0
    )
    big = [s["share"] for s in window if s["seqs"] >= 64]
    big_steps = [s for s in window if s["seqs"] >= 64]
    return {
        "requests": len(results),
        "completed": len(ok),
        "rejected": rejected,
        "failed": failed,
        "complete_tokens": sum(r["tokens"] == r["output_len"] for r in ok) == len(results),
        "output_tokens": tokens,
        "wall_s": end - begin,
        "output_tokens_per_s": tokens / (end - begin) if end > begin else 0.0,
        "requests_per_s": len(ok) / (end - begin) if end > begin else 0.0,
        "ttft_p50_s": pct(ttft, 50),
        "ttft_p99_s": pct(ttft, 99),
        "tpot_p50_s": pct(tpot, 50),
        "tpot_p99_s": pct(tpot, 99),
        "last_end_after_last_arrival_s": end - max(r["arrival"] for r in results),
        "steps": len(window),
        "step_gpu_s": gpu_s,
        "gpu_busy_share": gpu_s / span_s if span_s > 0 else None,
        "steps_batch_64_plus": len(big),
        "roofline_share_batch_64_plus": {q: pct(big, q) for q in (10, 25, 50, 75, 90)},
        "roofline_share_all": {q: pct([s["share"] for s in window], q) for q in (10, 50, 90)},
        # the same steps against the phase roofline (bench/roofline.py, step_phase_bound_ms)
        "phase_share_batch_64_plus": {
            q: pct([s["phase_share"] for s in big_steps], q) for q in (10, 50, 90)
        },
        "decode_steps_batch_64_plus": {
            "steps": len(dec := [s for s in big_steps if s["prefill_tokens"] == 0]),
            "share_p50": pct([s["share"] for s in dec], 50),
        },
        "mixed_steps_batch_64_plus": {
            "steps": len(mix := [s for s in big_steps if s["prefill_tokens"] > 0]),
            "share_p50": pct([s["share"] for s in mix], 50),
            "phase_share_p50": pct([s["phase_share"] for s in mix], 50),
        },
        # prefill tokens beyond the prompts: preempted sequences' prompts and outputs again. The
        # step log counts chunks of more than one token as prefill (the kernels' shapes), so a
        # prompt whose last chunk was one token (chunked at the step's token budget) counts that
        # token as a decode: -1 or -2 where nothing was recomputed.
        "recomputed_tokens": sum(s["prefill_tokens"] for s in window)
        - sum(r["prompt_len"] for r in results if r["status"] == "OK"),
        "median_step_gpu_ms": pct([s["gpu_ms"] for s in window], 50),
        "median_step_host_ms": pct([s["host_ms"] for s in window], 50),
        "graph_steps": sum(s["graph"] for s in window),
        "median_batch": pct([s["seqs"] for s in window], 50),
        # steps by their LoRA kernels' path (the engine's ModelRunner.LoraMode values)
        "lora_paths": dict(Counter(s.get("lora", "none") for s in window).most_common()),
    }


class StepLogReader:
    """The engine's step log as it grows: each read() returns the records appended since the
    last one (a run's steps, without reading the earlier runs' again)."""

    def __init__(self, path: Path) -> None:
        self.path, self._offset = path, 0

    def read(self) -> list[dict]:
        if not self.path.exists():
            return []
        with self.path.open("rb") as f:
            f.seek(self._offset)
            data = f.read()
        end = data.rfind(b"\n") + 1  # a line still being written waits for the next read
        self._offset += end
        return [json.loads(line) for line in data[:end].splitlines() if line.strip()]


def vs_base_over_passes(rows: list[dict]) -> list[dict]:
    """Each (run, front, n)'s throughput ratio to the base model over its passes (each pass's
    ratio is against the base model's run of the same pass): mean, lowest, highest. One pass's
    ratio moves by about a point from run to run, so several passes, each side by side with its
    own base run, say more than one."""
    ratios: dict[tuple, list[float]] = {}
    for r in rows:
        if "vs_base" in r:
            ratios.setdefault((r["run"], r.get("via", "grpc"), r["adapters"]), []).append(
                r["vs_base"]
            )
    return [
        {"run": run, "via": via, "adapters": n, "passes": len(v), "mean": sum(v) / len(v),
         "min": min(v), "max": max(v)}
        for (run, via, n), v in ratios.items()
    ]  # fmt: skip


def table(rows: list[dict]) -> str:
    head = (
        f"{'run':<10}{'pass':>5}{'via':>8}{'n':>6}{'done':>7}{'rej':>5}{'tok/s':>9}{'vs base':>8}"
        f"{'req/s':>7}"
        f"{'TTFT p50':>10}{'p99':>8}{'TPOT p50':>10}{'p99':>8}{'tail s':>8}{'step/roof':>10}"
        f"{'GPU busy':>9}"
    )

    def ms(x):
        return f"{1e3 * x:.1f}" if x is not None else "-"

    lines = [head]
    for r in rows:
        share = r["roofline_share_batch_64_plus"][50]
        busy = r.get("gpu_busy_share")
        lines.append(
            f"{r['run']:<10}{r.get('pass', 1):>5}{r.get('via', 'grpc'):>8}{r['adapters']:>6}"
            f"{r['completed']:>7}"
            f"{r['rejected']:>5}"
            f"{r['output_tokens_per_s']:>9.0f}{r.get('vs_base', 1.0):>8.3f}"
            f"{r['requests_per_s']:>7.1f}{ms(r['ttft_p50_s']):>10}{ms(r['ttft_p99_s']):>8}"
            f"{ms(r['tpot_p50_s']):>10}{ms(r['tpot_p99_s']):>8}"
            f"{r['last_end_after_last_arrival_s']:>8.1f}"
            f"{'-' if share is None else f'{share:.2f}':>10}"
            f"{'-' if busy is None else f'{busy:.3f}':>9}"
        )
    return (
        "\n".join(lines) + "\n(TTFT, TPOT in ms; pass 1: no adapter has served a request yet "
        "(preloaded in the host cache, or in the store only with --preload-adapters off), later "
        "passes: they have; tail: last end after the last arrival; "
        "step/roof: median step's share of its roofline, steps of >= 64 sequences; GPU busy: "
        "the steps' device time over their span)"
    )
