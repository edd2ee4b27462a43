"""Adapter loading on the serving path: cold time to first token, and step time under loads.

1. Cold TTFT: Generate for an adapter that is neither in the host cache nor in the page pool,
   split into fetch (store -> pinned host buffer), validate (safetensors header and shapes),
   copy (pinned buffer -> pool pages, on a side stream; GPU time from CUDA events) and first
   step (admission, prefill, first token), against the same prompt on a warm adapter and on the
   base model.
2. Step time: 64 requests decoding (half on resident adapters, contexts held stationary), in
   windows without loads alternating with windows while cold adapters are fetched from the
   store and copied into the pool, under the service's settings (garbage collections paced by
   the step thread) and CPython's automatic collection side by side (selectable too: a shorter
   GIL switch interval, a diagnostic variant of the copy); slow steps are attributed to the
   load phases and garbage collections they overlap, and each collection to the thread that
   ran it. Goal: p99 at most 1.05x.

The store runs in a subprocess on the local backend (this script's --serve-store mode, which
needs neither boto3 nor grpcio-health-checking); the engine and the service's adapter path
(pinned arena, host cache, store client with its fetch worker process, registry) run in this
process. The model is a random
Llama-7B-shaped one, generated on first use.

    python bench/adapter_load.py                                # CUDA, Llama-7B shape, bf16
    python bench/adapter_load.py --shape tiny --device cpu --cold 2 --loads 8 --decode-len 32
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import gc
import json
import logging
import os
import platform
import shutil
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import NamedTuple

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

import grpc  # noqa: E402
import torch  # noqa: E402

from bench.bench_models import SHAPES, make_model  # noqa: E402
from bench.bench_services import UPLOAD_OPTIONS, upload_adapter  # noqa: E402
from lorafleet.v1 import adapter_store_pb2_grpc as store_grpc  # noqa: E402
from services.inference.adapter_registry import AdapterRegistry  # noqa: E402
from services.inference.arena import HostArena  # noqa: E402
from services.inference.engine import adapter_copy, gc_pacing  # noqa: E402
from services.inference.engine.api import GenerationRequest  # noqa: E402
from services.inference.engine.config import EngineConfig  # noqa: E402
from services.inference.engine.engine import Engine  # noqa: E402
from services.inference.engine.sampling_params import SamplingParams  # noqa: E402
from services.inference.host_cache import HostCache  # noqa: E402
from services.inference.service_stats import summarize  # noqa: E402
from services.inference.store_client import StoreClient  # noqa: E402
from store.synthetic import synthetic_adapter  # noqa: E402

log = logging.getLogger("bench.adapter_load")
RANK = 16
PROMPT_TOKENS = 128
_DEFAULT_SWITCH_INTERVAL = sys.getswitchinterval()


class Variant(NamedTuple):
    switch_interval: float  # the GIL's (sys.setswitchinterval)
    copy: str  # "service"; diagnostic: "dma-only" (no layout kernels: the pool is not
    # written; the adapter is dropped unused)
    gc: str  # "paced" (the service's: engine/gc_pacing.py) or "auto" (CPython's automatic
    # collection, on whichever thread allocates)


# Settings compared side by side: the service's, CPython's automatic garbage collection, a
# shorter GIL switch interval, and a diagnostic that takes the layout kernels out of the host
# -> pool copy (is it the GPU work?).
VARIANTS = {
    "service": Variant(_DEFAULT_SWITCH_INTERVAL, "service", "paced"),
    "auto-gc": Variant(_DEFAULT_SWITCH_INTERVAL, "service", "auto"),
    "switch-0.5ms": Variant(0.0005, "service", "paced"),
    "diag-dma-only": Variant(_DEFAULT_SWITCH_INTERVAL, "dma-only", "paced"),
}
DEFAULT_VARIANTS = ("service", "auto-gc")


@contextlib.contextmanager
def copy_variant(mode: str):
    """Patches the engine's host -> pool copy for a diagnostic variant (see Variant)."""
    saved_write = adapter_copy.write_adapter
    if mode == "dma-only":
        adapter_copy.write_adapter = lambda pool, host, slots, src: None
    try:
        yield
    finally:
        adapter_copy.write_adapter = saved_write


@contextlib.contextmanager
def gc_variant(mode: str):
    """CPython's automatic collection for the "auto" variant, paced again after (no new freeze:
    the heap stays the one the service would have by now)."""
    if mode == "auto":
        gc_pacing.release()
    try:
        yield
    finally:
        if mode == "auto":
            gc_pacing.pace_collections(freeze=False)


def serve_store(root: str, port: int) -> None:
    """The adapter store's servicer on the local backend, without health or reflection."""
    from services.adapter_store.servicer import AdapterStoreServicer
    from services.adapter_store.wire import add_servicer
    from store.adapter_store import AdapterStore
    from store.backends import open_backend
    from store.config import StoreConfig

    async def main() -> None:
        config = StoreConfig(root=Path(root), port=port)
        # As the store's own server: uploads' 4 MiB chunks plus their framing must fit.
        limits = [
            ("grpc.max_send_message_length", 8 << 20),
            ("grpc.max_receive_message_length", 8 << 20),
        ]
        server = grpc.aio.server(options=limits)
        store = AdapterStore(open_backend(config), config)
        add_servicer(AdapterStoreServicer(store), server)
        server.add_insecure_port(f"127.0.0.1:{port}")
        await server.start()
        await server.wait_for_termination()

    asyncio.run(main())


def start_store(root: Path) -> tuple[subprocess.Popen, str]:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    proc = subprocess.Popen([sys.executable, __file__, "--serve-store", str(root), str(port)])
    address = f"127.0.0.1:{port}"
    with grpc.insecure_channel(address) as channel:
        grpc.channel_ready_future(channel).result(timeout=60)
    return proc, address


def upload_all(address: str, shape, names: list[str]) -> float:
    """Uploads a random rank-16 adapter on all seven projections under every name (the same
    bytes: the loads' cost does not depend on the values); returns its size in MB."""
    size = 0
    files = synthetic_adapter(shape.base(), rank=RANK, alpha=32.0, seed=0)
    with grpc.insecure_channel(address, options=UPLOAD_OPTIONS) as ch:
        stub = store_grpc.AdapterStoreStub(ch)
        for name in names:
            size = upload_adapter(stub, name, files).size_bytes
    return size / 1e6


class Collection(NamedTuple):
    start: float
    seconds: float
    generation: int
    thread: str  # the thread that ran it

    @property
    def end(self) -> float:
        return self.start + self.seconds


class CollectionLog:
    """Every garbage collection while installed (``with CollectionLog() as log``), paced ones
    included, with the thread that ran it. Collections never overlap (each holds the GIL
    throughout), so a start's stop is the next one."""

    def __init__(self) -> None:
        self.collections: list[Collection] = []
        self._start: tuple[float, str] | None = None

    def _on_gc(self, phase: str, info: dict) -> None:
        if phase == "start":
            self._start = (time.perf_counter(), threading.current_thread().name)
        elif self._start is not None:
            t, thread = self._start
            self._start = None
            seconds = time.perf_counter() - t
            self.collections.append(Collection(t, seconds, info["generation"], thread))

    def __enter__(self) -> CollectionLog:
        gc.callbacks.append(self._on_gc)
        return self

    def __exit__(self, *exc) -> None:
        gc.callbacks.remove(self._on_gc)


class StepTime(NamedTuple):
    start: float
    seconds: float
    outputs: int  # sequences that sampled a token
    tokens: int  # tokens computed (a pure decode step: one per sequence)
    cpu_seconds: float  # the step thread's CPU time since the previous step finished


class StepTimer:
    """Records every step the engine finishes, from its step log (services/inference/engine/
    step_log.py): ``start`` when the step was launched, ``seconds`` its device time (the step
    loop launches a step before it finishes the previous one, so host time overlaps it), and
    the step thread's CPU time between two finishes."""

    def __init__(self, core) -> None:
        self.steps: list[StepTime] = []
        self._core = core
        self._finish = core.finish
        self._cpu = time.thread_time()
        core.finish = self

    def __call__(self, launched):
        out = self._finish(launched)
        record = launched.record
        cpu, self._cpu = self._cpu, time.thread_time()
        self.steps.append(
            StepTime(record.launched_at, record.gpu_ms / 1e3, len(out), record.tokens,
                     self._cpu - cpu)
        )  # fmt: skip
        return out


async def first_token(engine: Engine, rid: str, prompt: list[int], key) -> float:
    t = time.perf_counter()
    one = SamplingParams(max_new_tokens=1, ignore_eos=True)
    request = GenerationRequest(rid, prompt_token_ids=prompt, adapter=key, sampling=one)
    async for _ in engine.generate(request):
        pass
    return time.perf_counter() - t


async def cold_ttft(engine, registry, names, prompt) -> list[dict]:
    """Per cold adapter: lookup (latest version; the service knows it from the store's watch),
    fetch, validate (header and shapes, no copy), copy, and the rest up to the first token."""
    rows = []
    for i, name in enumerate(names):
        t0 = time.perf_counter()
        version = (await registry.resolve(name, 0)).version
        t1 = time.perf_counter()
        key = await registry.acquire(name, version)
        t2 = time.perf_counter()
        try:
            rest = await first_token(engine, f"cold-{i}", prompt, key)
        finally:
            registry.release(key)
        fetch = registry.fetch_latency.last
        copy = engine.adapter_copy_seconds()[-1]
        rows.append({
            "lookup_s": t1 - t0,
            "fetch_s": fetch,
            "validate_s": t2 - t1 - fetch,
            "copy_s": copy,
            "first_step_s": rest - copy,
            "ttft_s": time.perf_counter() - t1,
        })  # fmt: skip
    return rows


class Setup(NamedTuple):
    model: Path
    store: subprocess.Popen  # the store process: the caller terminates it
    address: str
    warm: list[str]  # adapter names: resident during the step windows
    cold: list[str]  # timed cold for TTFT
    loads: list[str]  # loaded cold during the step windows, in turn
    mb: float  # one adapter's size


def set_up(args, store_dir: str) -> Setup:
    """The model (generated on first use), the store in its own process on a fresh root, and
    args.warm + args.cold + args.load_adapters adapters uploaded to it."""
    shape = SHAPES[args.shape]
    work = Path(args.work_dir)
    model = make_model(work / f"model-{args.shape}", shape, torch.device(args.device))
    shutil.rmtree(work / store_dir, ignore_errors=True)
    proc, address = start_store(work / store_dir)
    try:
        warm = [f"bench/warm-{i}" for i in range(args.warm)]
        cold = [f"bench/cold-{i}" for i in range(args.cold)]
        loads = [f"bench/load-{i}" for i in range(args.load_adapters)]
        mb = upload_all(address, shape, warm + cold + loads)
    except BaseException:
        proc.terminate()
        raise
    log.info("uploaded %d adapters of %.1f MB", len(warm + cold + loads), mb)
    return Setup(model, proc, address, warm, cold, loads, mb)


async def run(args) -> dict:
    s = set_up(args, "store")
    try:
        return await measure(
            args, torch.device(args.device), s.model, s.address, s.warm, s.cold, s.loads, s.mb
        )
    finally:
        s.store.terminate()
        s.store.wait()


async def measure(args, device, model, address, warm, cold, loads, mb) -> dict:
    n_adapters = len(warm) + len(cold) + len(loads)
    engine = Engine(EngineConfig(
        model_dir=model, device=args.device, max_num_seqs=args.batch + 8, max_lora_rank=RANK,
        max_loras=n_adapters + 4, max_num_batched_tokens=max(2048, args.batch * 2),
        pool_memory_bytes=None if device.type == "cuda" else 512 << 20,
    ))  # fmt: skip
    await engine.start()
    gc_pacing.pace_collections()  # as the service does
    cache = HostCache(HostArena(int((n_adapters + 2) * mb * 1e6), pin=device.type == "cuda"))
    store = StoreClient(address, cache, lookup_timeout=30, fetch_timeout=300)
    registry = AdapterRegistry(engine, store, cache)
    timer = StepTimer(engine.core)
    prompt = [(7 * i) % 500 + 3 for i in range(PROMPT_TOKENS)]
    keys = []
    try:
        # Warm-up: compile/allocate everything once, and make the warm adapters resident.
        await first_token(engine, "warmup", prompt, None)
        keys = [await registry.acquire(name, 0) for name in warm]  # held until the end
        for key in keys:
            await engine.load_adapter(key)
        await first_token(engine, "warmup-lora", prompt, keys[0])  # compiles the LoRA kernels
        base_ttft = await first_token(engine, "base", prompt, None)
        warm_ttft = await first_token(engine, "warm", prompt, keys[0])
        rows = await cold_ttft(engine, registry, cold, prompt)
        steps = await step_times(args, engine, registry, keys, loads, timer)
    finally:
        for key in keys:
            registry.release(key)
        await store.close()
        await engine.stop()
        gc_pacing.release()
    keys_of = ("lookup_s", "fetch_s", "validate_s", "copy_s", "first_step_s", "ttft_s")
    median = {k: sorted(r[k] for r in rows)[len(rows) // 2] for k in keys_of}
    return {
        "adapter_mb": mb, "cold_ttft": rows, "cold_ttft_median": median,
        "fetch_mb_per_s": mb / median["fetch_s"], "base_ttft_s": base_ttft,
        "warm_adapter_ttft_s": warm_ttft, **steps,
    }  # fmt: skip


async def step_times(args, engine, registry, keys, loads, timer) -> dict:
    """Decode step times of ``batch`` requests, in windows without loads and windows while cold
    adapters load, alternating, under each of ``args.variants`` (VARIANTS) in turn.

    The workload is stationary, so that windows compare like with like: each of the batch's
    streams issues requests of ``decode_len`` new tokens back to back, their starts staggered,
    so contexts stay spread over [prompt, prompt + decode_len) (decode steps get slower as
    contexts grow; comparing a later window with an earlier one would blame the loads for it).
    Only steps that decode the full batch and nothing else are counted (a stream's next request
    is prefilled in a mixed step, left out of both sides)."""
    prompt = [(11 * i) % 500 + 3 for i in range(PROMPT_TOKENS)]
    stop = asyncio.Event()

    async def stream(i: int) -> None:
        key = keys[i % len(keys)] if i % 2 and keys else None
        n = 0
        while not stop.is_set():
            new = args.decode_len * (i + 1) // args.batch if n == 0 else args.decode_len
            params = SamplingParams(max_new_tokens=max(new, 1), ignore_eos=True)
            req = GenerationRequest(f"decode-{i}-{n}", prompt_token_ids=prompt, adapter=key,
                                    sampling=params)  # fmt: skip
            async for _ in engine.generate(req):
                pass
            n += 1

    def decode_steps(since: int) -> list[StepTime]:
        return [s for s in timer.steps[since:] if s.outputs == s.tokens == args.batch]

    async def quiet_window(n: int) -> list[StepTime]:
        start = len(timer.steps)
        while len(decode_steps(start)) < n:
            await asyncio.sleep(0.005)
        return decode_steps(start)

    async def load_window(names: list[str]) -> list[StepTime]:
        start = len(timer.steps)
        for name in names:  # back to back: a load is always in flight during the window
            t0 = time.perf_counter()
            key = await registry.acquire(name, 0)
            t1 = time.perf_counter()
            await engine.load_adapter(key)
            phases.append(("copy", t1, time.perf_counter()))
            fetch = registry.fetch_latency.last
            phases.append(("fetch", t1 - validate[-1] - fetch, t1 - validate[-1]))
            phases.append(("validate", t1 - validate[-1], t1))
            phases.append(("lookup", t0, t1 - validate[-1] - fetch))
            registry.release(key)
            registry.unload(name, 0)  # dropped again: the next round loads it cold
        return decode_steps(start)

    # Where each load's time goes, to tell which phase slows the steps it overlaps.
    phases: list[tuple[str, float, float]] = []
    validate: list[float] = []
    add = engine.add_adapter

    def timed_add(*a, **kw):
        t = time.perf_counter()
        try:
            return add(*a, **kw)
        finally:
            validate.append(time.perf_counter() - t)

    engine.add_adapter = timed_add
    gc_log = CollectionLog()
    collections = gc_log.collections

    tasks = [asyncio.create_task(stream(i)) for i in range(args.batch)]
    try:
        with gc_log:
            await quiet_window(args.decode_len)  # one full cycle: contexts spread out
            windows = {name: ([], [], 0) for name in args.variants}
            spans: dict[str, list[tuple[float, float]]] = {name: [] for name in args.variants}
            per_window = 2
            rounds = max(1, args.loads // (per_window * len(args.variants)))
            for r in range(rounds):
                for name in args.variants:
                    sys.setswitchinterval(VARIANTS[name].switch_interval)
                    quiet, busy, n = windows[name]
                    names = [loads[(r * per_window + j) % len(loads)] for j in range(per_window)]
                    t0 = time.perf_counter()
                    with gc_variant(VARIANTS[name].gc):
                        quiet += await quiet_window(args.quiet_steps)
                        with copy_variant(VARIANTS[name].copy):
                            busy += await load_window(names)
                    spans[name].append((t0, time.perf_counter()))
                    windows[name] = (quiet, busy, n + len(names))
    finally:
        sys.setswitchinterval(_DEFAULT_SWITCH_INTERVAL)
        stop.set()
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)

    def stats(samples: list[StepTime]) -> dict:
        s = summarize([x.seconds for x in samples], len(samples))
        cpu = summarize([x.cpu_seconds for x in samples], len(samples))
        return {"steps": len(samples), "mean_s": s.mean, "p50_s": s.p50, "p99_s": s.p99,
                "max_s": s.max, "cpu_p50_s": cpu.p50}  # fmt: skip

    def overlapping(step: StepTime) -> str:
        end = step.start + step.seconds
        hit = {name for name, a, b in phases if a < end and step.start < b}
        hit |= {f"gc{c.generation}" for c in collections if c.start < end and step.start < c.end}
        return "+".join(sorted(hit)) or "none"

    def gc_in(steps: list[StepTime]) -> dict:
        """Collections that overlapped these steps: count and longest, per generation."""
        out = {}
        for g in (0, 1, 2):
            d = [c.seconds for c in collections if c.generation == g and any(
                c.start < s.start + s.seconds and s.start < c.end for s in steps)]  # fmt: skip
            out[f"gen{g}"] = {"count": len(d), "max_s": max(d, default=0.0)}
        return out

    def gc_threads(name: str) -> dict:
        """Collections during the variant's windows, per thread that ran them and generation."""
        out: dict[str, list[int]] = {}
        for c in collections:
            if any(a <= c.start < b for a, b in spans[name]):
                out.setdefault(c.thread, [0, 0, 0])[c.generation] += 1
        return out

    by_interval = []
    for name, (quiet, busy, n) in windows.items():
        a, b = stats(quiet), stats(busy)
        by_phase: dict[str, list[StepTime]] = {}
        for step in busy:
            by_phase.setdefault(overlapping(step), []).append(step)
        slowest = sorted(busy, key=lambda x: -x.seconds)[:6]
        by_interval.append({
            "variant": name, **VARIANTS[name]._asdict(), "loads": n,
            "step_no_loads": a, "step_with_loads": b,
            "gc_no_loads": gc_in(quiet), "gc_with_loads": gc_in(busy),
            "gc_threads": gc_threads(name),
            "p99_ratio": b["p99_s"] / a["p99_s"] if a["p99_s"] else None,
            "p50_ratio": b["p50_s"] / a["p50_s"] if a["p50_s"] else None,
            "with_loads_by_phase": {k: stats(v) for k, v in sorted(by_phase.items())},
            "slowest_with_loads": [(x.seconds, overlapping(x)) for x in slowest],
        })  # fmt: skip
    total = {g: sum(1 for c in collections if c.generation == g) for g in (0, 1, 2)}
    paced = gc_pacing.stats()
    gen2 = [c.seconds for c in collections if c.generation == 2]
    return {"batch": args.batch, "decode_len": args.decode_len, "steps": by_interval,
            "gc_collections": total, "gc_gen2_max_s": max(gen2, default=0.0),
            "gc_paced": {"collections": paced.collections, "seconds": paced.seconds}}  # fmt: skip


def machine() -> dict:
    info = {"python": platform.python_version(), "torch": torch.__version__,
            "cpus": os.cpu_count(), "platform": platform.platform()}  # fmt: skip
    if torch.cuda.is_available():
        info["gpu"] = torch.cuda.get_device_name()
        info["cuda"] = torch.version.cuda
    return info


def main() -> int:
    if len(sys.argv) == 4 and sys.argv[1] == "--serve-store":
        serve_store(sys.argv[2], int(sys.argv[3]))
        return 0
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shape", choices=sorted(SHAPES), default="llama-7b")
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--work-dir", default="/tmp/lorafleet-bench")
    parser.add_argument("--batch", type=int, default=64, help="decoding requests")
    parser.add_argument("--warm", type=int, default=8, help="resident adapters in the batch")
    parser.add_argument("--cold", type=int, default=8, help="cold loads timed for TTFT")
    parser.add_argument(
        "--loads",
        type=int,
        default=256,
        help="cold loads while stepping, in all (shared by the variants; 128 each by default: "
        "about 380 steps with loads, so p99 is not one outlier)",
    )
    parser.add_argument(
        "--load-adapters",
        type=int,
        default=8,
        help="distinct adapters those loads cycle through (each dropped after)",
    )
    parser.add_argument(
        "--decode-len", type=int, default=256, help="new tokens per request of the decoding streams"
    )
    parser.add_argument(
        "--quiet-steps", type=int, default=24, help="decode steps per window without loads"
    )
    parser.add_argument(
        "--variants",
        default=",".join(DEFAULT_VARIANTS),
        help=f"process settings to compare, comma-separated, of {', '.join(VARIANTS)}",
    )
    parser.add_argument("--out", default=str(REPO / "bench/results/adapter_load.json"))
    args = parser.parse_args()
    args.variants = args.variants.split(",")
    unknown = set(args.variants) - set(VARIANTS)
    if unknown:
        parser.error(f"unknown variants {sorted(unknown)}; known: {', '.join(VARIANTS)}")
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s")
    result = asyncio.run(run(args))
    result = {"machine": machine(), "shape": args.shape, "rank": RANK,
              "prompt_tokens": PROMPT_TOKENS, **result}  # fmt: skip
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=2) + "\n")
    print(report(result))
    return 0


def report(r: dict) -> str:
    m = r["cold_ttft_median"]
    ms = lambda s: f"{s * 1000:8.1f} ms"  # noqa: E731
    lines = [
        f"cold adapter ({r['adapter_mb']:.1f} MB, rank {r['rank']}, {r['shape']}), median of "
        f"{len(r['cold_ttft'])}:",
        f"  fetch (store -> pinned)  {ms(m['fetch_s'])}  ({r['fetch_mb_per_s']:.0f} MB/s)",
        f"  validate                 {ms(m['validate_s'])}",
        f"  copy (pinned -> pool)    {ms(m['copy_s'])}",
        f"  first step               {ms(m['first_step_s'])}",
        f"  TTFT (version known)     {ms(m['ttft_s'])}",
        f"  (version lookup          {ms(m['lookup_s'])}, when not known from the watch)",
        f"  warm adapter TTFT        {ms(r['warm_adapter_ttft_s'])}",
        f"  base model TTFT          {ms(r['base_ttft_s'])}",
        f"decode step, batch {r['batch']} (contexts {r['prompt_tokens']} to "
        f"{r['prompt_tokens'] + r['decode_len']}):        p50         p99",
    ]
    for w in r["steps"]:
        a, b = w["step_no_loads"], w["step_with_loads"]
        lines += [
            f"  {w['variant']} (switch interval {w['switch_interval'] * 1000:.1f} ms)",
            f"    no loads           {ms(a['p50_s'])} {ms(a['p99_s'])}  ({a['steps']} steps, "
            f"step thread CPU p50 {a['cpu_p50_s'] * 1000:.1f} ms)",
            f"    with loads         {ms(b['p50_s'])} {ms(b['p99_s'])}  ({b['steps']} steps, "
            f"{w['loads']} loads)",
            f"    p99 ratio {w['p99_ratio']:.3f}, p50 ratio {w['p50_ratio']:.3f} "
            f"(goal: p99 <= 1.05)",
        ]
        for phase, st in w["with_loads_by_phase"].items():
            lines.append(f"    during {phase:22s} {ms(st['p50_s'])} {ms(st['max_s'])} max "
                         f"({st['steps']} steps, step thread CPU p50 "
                         f"{st['cpu_p50_s'] * 1000:.1f} ms)")  # fmt: skip
        slow = ", ".join(f"{t * 1000:.1f} ms ({p})" for t, p in w["slowest_with_loads"])
        lines.append(f"    slowest: {slow}")
        for side in ("gc_no_loads", "gc_with_loads"):
            gens = [
                f"{k} {v['count']} (max {v['max_s'] * 1000:.1f} ms)" for k, v in w[side].items()
            ]
            lines.append(f"    {side}: " + ", ".join(gens))
        threads = "; ".join(
            f"{t} gen0 {n[0]} gen1 {n[1]} gen2 {n[2]}" for t, n in sorted(w["gc_threads"].items())
        )
        lines.append(f"    collections ran on: {threads or 'none'}")
    p = r["gc_paced"]
    lines.append(
        f"paced collections (whole run): gen0 {p['collections'][0]}, gen1 "
        f"{p['collections'][1]}, gen2 {p['collections'][2]} ({sum(p['seconds']) * 1000:.1f} ms "
        f"in all); longest gen2 seen {r['gc_gen2_max_s'] * 1000:.1f} ms"
    )
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(main())
