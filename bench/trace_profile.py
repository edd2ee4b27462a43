"""Where a serving trace's GPU time goes, kernel by kernel: the engine of the inference service
(its own step loop, default limits, CUDA graphs), in process, on the serving benchmark's trace,
with the torch profiler over windows of steps.

bench/serving.py measures the trace end to end through the services; this shows what its steps
spend their time on, which a step's total (the step log) cannot: the trace of 1000 requests at
once (bench/serving.py's, same seed), for the base model and with n rank-8 q/k/v/o adapters,
each window's kernels summed by kind (GEMMs, attention's decode and prefill kernels, LoRA,
the pointwise kernels, the rest) in ms per step, beside the steps' own GPU time. Each trace's
adapters are placed in the pool's free room first, as the services' preload places them (with
``--cold`` they start in the host cache).

    python bench/trace_profile.py --adapters 0 100 --windows 40:70 300:330 700:730
    python bench/trace_profile.py --shape tiny --device cpu --requests 24 --windows 2:6

On the CPU (a check that the script runs) the profiler, started from the event loop's thread,
does not see the step thread's operators: the windows there report their steps, no kernels.

With ``--by-step`` (CUDA) one window of each trace is profiled from the step thread instead, and
every launch is preceded by a marker kernel on the step's stream (torch.cuda._sleep's
spin_kernel): the kernels between two markers, in the GPU's order, are one step's, so each step's
kernel time by kind joins its step log record, and the report sums them by step kind (decode
steps, mixed steps) beside those steps' adapter bytes, tokens and GPU time. The profiled
trace's throughput is not the engine's (the window ends on the step thread, which then sums the
profile): compare the kernel times, not its tokens/s.

    python bench/trace_profile.py --adapters 0 1000 --by-step 0:3000
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import sys
import tempfile
import time
from collections import defaultdict
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

import torch  # noqa: E402

from bench.bench_models import SHAPES, make_model  # noqa: E402
from bench.serving import WORKLOADS, make_trace, with_adapters  # noqa: E402
from services.inference.engine.api import AdapterKey, GenerationRequest  # noqa: E402
from services.inference.engine.config import EngineConfig  # noqa: E402
from services.inference.engine.engine import Engine  # noqa: E402
from services.inference.engine.errors import PoolBusy  # noqa: E402
from services.inference.engine.sampling_params import SamplingParams  # noqa: E402
from store.synthetic import synthetic_adapter  # noqa: E402

# Kernel kinds, by a piece of the kernel's name (the first that matches).
KINDS = (
    ("attention decode", ("_decode_kernel", "_combine_kernel")),
    ("attention prefill", ("_prefill_kernel",)),
    ("lora", ("lora_",)),  # the two launches' _lora_shrink/_lora_expand, the fused kernel
    ("pointwise", ("_rope_kv", "_rmsnorm", "_silu_mul", "_write_kv")),
    ("gemm", ("nvjet", "gemm", "xmma", "cutlass", "Kernel2", "sm90_")),
)


def kind_of(name: str) -> str:
    for kind, marks in KINDS:
        if any(m in name for m in marks):
            return kind
    return "other"


class Window:
    """The profiler over steps [first, last) of the engine's count (started and stopped from the
    event loop that watches the count: the profiler records the GPU's kernels whatever thread
    launched them)."""

    def __init__(self, first: int, last: int) -> None:
        self.first, self.last = first, last
        self.prof = None
        self.kernels: dict[str, list[float]] = {}
        self.done = False

    def poll(self, steps: int, cuda: bool, end: bool = False) -> None:
        """Start or stop the profiler at ``steps`` (the engine's count); ``end``: the trace ended,
        so a window still open ends at ``steps``."""
        if self.done:
            return
        if self.prof is None and steps >= self.first and not end:
            from torch.profiler import ProfilerActivity, profile

            activities = [ProfilerActivity.CUDA] if cuda else [ProfilerActivity.CPU]
            self.prof = profile(activities=activities)
            self.prof.__enter__()
            self.first = steps  # the step the window really begins at
        elif self.prof is not None and (steps >= self.last or end):
            if cuda:
                torch.cuda.synchronize()
            self.prof.__exit__(None, None, None)
            self.last = steps
            self.done = True
            for e in self.prof.key_averages():
                us = getattr(e, "self_device_time_total", None)
                if us is None:
                    us = getattr(e, "self_cuda_time_total", 0.0)
                if cuda and us <= 0:
                    continue
                if not cuda:
                    us = e.self_cpu_time_total
                self.kernels[e.key] = [us / 1e3, e.count]

    def report(self, records: list[dict]) -> dict:
        steps = [r for r in records if self.first <= r["step"] < self.last]
        n = max(1, len(steps))
        by_kind: dict[str, float] = defaultdict(float)
        for name, (ms, _) in self.kernels.items():
            by_kind[kind_of(name)] += ms
        top = sorted(self.kernels.items(), key=lambda kv: -kv[1][0])[:20]
        return {
            "steps": [self.first, self.last],
            "mean_seqs": sum(r["seqs"] for r in steps) / n,
            "mean_tokens": sum(r["tokens"] for r in steps) / n,
            "mean_prefill_tokens": sum(r["prefill_tokens"] for r in steps) / n,
            "mixed_steps": sum(r["prefill_tokens"] > 0 for r in steps),
            "mean_adapters": sum(r["adapters"] for r in steps) / n,
            "step_gpu_ms": sum(r["gpu_ms"] or 0.0 for r in steps) / n,
            "kernel_ms_per_step": {k: round(v / n, 3) for k, v in sorted(by_kind.items())},
            "top_kernels": [
                {"name": k[:90], "ms_per_step": round(v[0] / n, 3), "calls": v[1]} for k, v in top
            ],
        }


MARKER = "spin_kernel"  # torch.cuda._sleep's kernel: one before every launch (--by-step)


def kernels_by_step(
    kernels: list[tuple[str, float, float]], marks: list[int | None]
) -> tuple[dict[int, dict[str, float]], int]:
    """Each step's kernel time by kind (kind_of), ms, and how many markers the profile holds:
    ``kernels`` are (name, GPU start µs, duration µs) in any order, ``marks`` the step each
    MARKER kernel opened, in launch order (None: a launch that ran no step). Kernels before the
    first marker are no step's; a step opened by a marker runs until the next one. Where the
    profile holds fewer or more markers than ``marks`` (a profiler that dropped records), the
    caller must not trust the steps: the count says so."""
    ordered = sorted(kernels, key=lambda k: k[1])
    out: dict[int, dict[str, float]] = {}
    current: dict[str, float] | None = None
    seen = 0
    for name, _, us in ordered:
        if MARKER in name:
            step = marks[seen] if seen < len(marks) else None
            seen += 1
            current = None if step is None else out.setdefault(step, defaultdict(float))
        elif current is not None:
            current[kind_of(name)] += us / 1e3
    return {step: dict(kinds) for step, kinds in out.items()}, seen


class StepProfile:
    """--by-step: the profiler over launches [first, last) of the engine's count, started and
    stopped on the step thread (EngineCore.launch wrapped), a marker kernel before each launch."""

    def __init__(self, core, first: int, last: int) -> None:
        self.core, self.first, self.last = core, first, last
        self.prof = None
        self.marks: list[int | None] = []
        self.steps: dict[int, dict[str, float]] = {}
        self.markers_found = 0
        self.done = False
        self._launch = core.launch
        core.launch = self.launch

    def launch(self, during=None):
        step = self.core.steps  # the number the step about to launch gets
        if self.prof is None and not self.done and step >= self.first:
            from torch.profiler import ProfilerActivity, profile

            self.prof = profile(activities=[ProfilerActivity.CUDA])
            self.prof.__enter__()
        if self.prof is not None:
            torch.cuda._sleep(1)
        launched = self._launch(during=during)
        if self.prof is not None:
            self.marks.append(step if launched is not None else None)
            if self.core.steps >= self.last:
                self.stop()
        return launched

    def stop(self) -> None:
        """Ends the window (on the step thread, or after the trace) and sums it by step."""
        if self.prof is None:
            return
        torch.cuda.synchronize()
        self.prof.__exit__(None, None, None)
        kernels = [
            (e.name, e.time_range.start, e.time_range.end - e.time_range.start)
            for e in self.prof.events()
            if e.device_type.name == "CUDA"
        ]  # fmt: skip
        self.steps, self.markers_found = kernels_by_step(kernels, self.marks)
        self.prof, self.done = None, True

    def restore(self) -> None:
        self.core.launch = self._launch


def by_step_report(steps: dict[int, dict[str, float]], records: list[dict]) -> dict:
    """The profiled steps' kernel time by kind, summed over decode steps and over mixed steps
    (s), beside their adapter bytes (GB), tokens and GPU time (s)."""
    out = {}
    for label, mixed in (("decode", False), ("mixed", True)):
        rows = [r for r in records if r["step"] in steps and (r["prefill_tokens"] > 0) == mixed]
        kinds: dict[str, float] = defaultdict(float)
        for r in rows:
            for kind, ms in steps[r["step"]].items():
                kinds[kind] += ms / 1e3
        out[label] = {
            "steps": len(rows),
            "gpu_s": sum(r["gpu_ms"] or 0.0 for r in rows) / 1e3,
            "kernel_s": {k: round(v, 4) for k, v in sorted(kinds.items())},
            "adapter_gb": sum(r["adapter_bytes"] for r in rows) / 1e9,
            "tokens": sum(r["tokens"] for r in rows),
        }
    return out


def marked_fields(marked: StepProfile, records: list[dict]) -> dict:
    """A trace's --by-step results, for its row (and printed): the markers found against the
    launches, the by-step report, and every profiled step's kernel time by kind."""
    found, launches = marked.markers_found, len(marked.marks)
    if found != launches:
        print(f"  the profile holds {found} markers for {launches} launches: its steps are not "
              "each step's", flush=True)  # fmt: skip
    report = by_step_report(marked.steps, records)
    for label, v in report.items():
        print(f"  {label} steps: {v['steps']}, GPU {v['gpu_s']:.2f} s, adapter bytes "
              f"{v['adapter_gb']:.1f} GB | " + ", ".join(
                  f"{k} {t:.3f}" for k, t in v["kernel_s"].items()), flush=True)  # fmt: skip
    return {
        "markers": {"launches": launches, "found": found},
        "by_step": report,
        "steps_profiled": {str(k): {kind: round(ms, 4) for kind, ms in v.items()}
                           for k, v in sorted(marked.steps.items())},
    }  # fmt: skip


def warm_profiler(cuda: bool) -> None:
    """Start and stop the profiler once before the traces: its first start initializes the
    tracing library, which took long enough on the H200 for a hundred steps to pass before the
    first window began (it begins where the profiler has started: Window.first)."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CUDA] if cuda else [ProfilerActivity.CPU]):
        torch.zeros(1, device="cuda" if cuda else "cpu").add_(1)
        if cuda:
            torch.cuda.synchronize()


async def run_trace(engine: Engine, trace, keys, vocab: int, windows: list[Window], seed: int):
    """Every request of ``trace`` at once; returns (output tokens, seconds)."""
    gen = torch.Generator().manual_seed(seed)
    cuda = engine.device.type == "cuda"

    async def one(i, r) -> int:
        ids = torch.randint(3, vocab, (r.prompt_len,), generator=gen).tolist()
        sp = SamplingParams(max_new_tokens=r.output_len, ignore_eos=True)
        key = None if r.adapter is None else keys[r.adapter]
        req = GenerationRequest(f"t{seed}-{i}", prompt_token_ids=ids, adapter=key, sampling=sp)
        n = 0
        async for out in engine.generate(req):
            n += len(out.token_ids)
        return n

    done = asyncio.Event()

    async def watch() -> None:
        while not done.is_set():
            for w in windows:
                w.poll(engine.core.steps, cuda)
            await asyncio.sleep(0.0005)

    watcher = asyncio.create_task(watch())
    start = time.perf_counter()
    counts = await asyncio.gather(*(one(i, r) for i, r in enumerate(trace)))
    seconds = time.perf_counter() - start
    done.set()
    await watcher
    for w in windows:
        if w.prof is not None:  # the trace ended inside it: end it there
            w.poll(engine.core.steps, cuda, end=True)
    return sum(counts), seconds


async def place(engine: Engine, keys: list) -> int:
    """Copies ``keys``' adapters into the pool's free room, as the services' preload does (no
    eviction; it stops at the first that finds none); returns how many it placed."""
    for i, key in enumerate(keys):
        try:
            await engine.load_adapter(key, if_free=True)
        except PoolBusy:
            return i
    return len(keys)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shape", choices=sorted(SHAPES), default="llama-7b")
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--requests", type=int, default=1000, help="all at once")
    parser.add_argument("--adapters", type=int, nargs="+", default=[0, 100])
    parser.add_argument("--workload", choices=sorted(WORKLOADS), default="S1")
    parser.add_argument("--windows", nargs="+", default=["40:70", "300:330", "700:730"],
                        help="FIRST:LAST step ranges to profile in each trace")  # fmt: skip
    parser.add_argument(
        "--by-step", default=None, metavar="FIRST:LAST",
        help="CUDA: profile these launches of each trace from the step thread, each step's "
        "kernels apart (marker kernels), instead of --windows",
    )  # fmt: skip
    parser.add_argument(
        "--cold", action="store_true",
        help="leave the adapters in the host cache before each trace; by default the trace's "
        "adapters are placed in the pool first, as the services' preload places them",
    )  # fmt: skip
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--work-dir", type=Path, default=Path(tempfile.gettempdir()) / "lorafleet-serving"
    )
    parser.add_argument(
        "--out", type=Path, default=REPO / "bench" / "results" / "trace_profile.json"
    )
    args = parser.parse_args()
    if args.by_step and args.device != "cuda":
        parser.error("--by-step needs CUDA (its markers are kernels)")

    from bench.adapter_load import machine
    from bench.roofline import Roofline, measure_ceilings

    shape = SHAPES[args.shape]
    device = torch.device(args.device)
    args.work_dir.mkdir(parents=True, exist_ok=True)
    model = make_model(args.work_dir / f"model-{args.shape}", shape, device)
    ceilings = measure_ceilings(device)
    roof = Roofline.for_shape(shape, ceilings, dtype_bytes=2 if device.type == "cuda" else 4)
    step_log = args.work_dir / "trace_profile_steps.jsonl"
    step_log.unlink(missing_ok=True)
    t = time.perf_counter()
    engine = Engine(EngineConfig(model_dir=model, device=device.type, step_log=step_log,
                                 max_num_batched_tokens=2048))  # fmt: skip
    print(f"engine ready in {time.perf_counter() - t:.0f} s: {engine.limits}", flush=True)
    warm_profiler(device.type == "cuda")
    ranks, modules = WORKLOADS[args.workload]
    files = {r: synthetic_adapter(shape.base(), rank=r, alpha=2.0 * r, modules=modules, seed=r)
             for r in ranks}  # fmt: skip
    keys = []
    for i in range(max(args.adapters)):
        f = files[ranks[i % len(ranks)]]
        keys.append(AdapterKey(f"bench/{args.workload.lower()}-{i}", 1))
        engine.add_adapter(keys[-1], f.config_json, f.safetensors)
    rows = []

    async def go() -> None:
        await engine.start()
        try:
            for n in args.adapters:
                trace = with_adapters(make_trace(math.inf, args.requests, None, args.seed), n,
                                      1.0, args.seed)  # fmt: skip
                placed = 0 if args.cold else await place(engine, keys[:n])
                before = engine.core.steps
                marked = None
                if args.by_step:
                    a, b = (int(v) for v in args.by_step.split(":"))
                    marked = StepProfile(engine.core, before + a, before + b)
                    windows = []
                else:
                    windows = [Window(before + int(a), before + int(b))
                               for a, b in (w.split(":") for w in args.windows)]  # fmt: skip
                try:
                    tokens, seconds = await run_trace(engine, trace, keys[:n], shape.vocab,
                                                      windows, args.seed)  # fmt: skip
                finally:
                    if marked is not None:
                        marked.restore()
                if marked is not None:  # the trace ended inside the window: the engine idles
                    marked.stop()
                records = [r.public() for r in engine.core.step_log.recent if r.step >= before]
                gpu = sum(r["gpu_ms"] or 0.0 for r in records) / 1e3
                bound = sum(roof.step_phase_bound_ms(r["tokens"], r["kv_read"], r["kv_written"],
                                                     r["attn_pairs"], r["adapter_bytes"])
                            for r in records) / 1e3  # fmt: skip
                row = {
                    "adapters": n, "placed_in_pool": placed, "requests": len(trace),
                    "output_tokens": tokens,
                    "seconds": seconds, "output_tokens_per_s": tokens / seconds,
                    "steps": len(records), "gpu_s": gpu, "phase_bound_s": bound,
                    "windows": [w.report(records) for w in windows if w.done],
                }  # fmt: skip
                if marked is not None:
                    row.update(marked_fields(marked, records))
                rows.append(row)
                print(f"n={n} ({placed} placed in the pool first): {tokens} tokens in "
                      f"{seconds:.2f} s = {tokens / seconds:.0f} tok/s, "
                      f"{len(records)} steps, GPU {gpu:.2f} s, phase bound {bound:.2f} s",
                      flush=True)  # fmt: skip
                for w in row["windows"]:
                    print(f"  steps {w['steps']}: seqs {w['mean_seqs']:.0f} tokens "
                          f"{w['mean_tokens']:.0f} (prefill {w['mean_prefill_tokens']:.0f}) "
                          f"step {w['step_gpu_ms']:.2f} ms | " + ", ".join(
                              f"{k} {v:.2f}" for k, v in w["kernel_ms_per_step"].items()),
                          flush=True)  # fmt: skip
        finally:
            await engine.stop()

    asyncio.run(go())
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps({
        "benchmark": "kernel time by kind over windows of the serving trace, engine in process",
        "shape": args.shape, "workload": args.workload, "ceilings": ceilings._asdict(),
        "machine": machine(), "limits": str(engine.limits), "results": rows,
        "command": "python bench/trace_profile.py " + " ".join(sys.argv[1:]),
    }, indent=2) + "\n")  # fmt: skip
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
