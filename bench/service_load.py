"""The serving path as deployed: decode step time of 64 gRPC streams while cold adapters load
through the service's own RPCs, and time to first token over gRPC.

bench/adapter_load.py drives the engine and the service's adapter path in one process. This one
adds everything else the service does per token and per load: the gRPC server, the servicer, the
event loop streaming every token to its client. It runs once per engine placement (--engines),
over the same store and adapters:

- this process runs InferenceServer (as ``python -m services.inference`` does: gRPC, health);
  for the placement "process" (the service's default, --engine process) the engine runs in a
  fourth process, bench/traced_engine.py (services/inference/engine_process.py with every step
  and collection recorded); for "thread" its step thread runs here and is timed here;
- the adapter store, on the local backend (bench/adapter_load.py's --serve-store mode);
- the client (this file's --client mode): ``batch`` Generate streams, half of them on resident
  adapters, issuing requests back to back with staggered lengths so contexts stay stationary;
  windows without loads alternate with windows in which it makes adapters cold and loads them
  (LoadAdapter, then UnloadAdapter, which drops them from the host cache too, so the next load
  fetches from the store again). Before the streams it times Generate to the first token for
  cold and warm adapters and the base model.

The client marks its windows with time.perf_counter, the service its steps: on Linux both are
CLOCK_MONOTONIC, so they compare across processes. Only steps that decode the full batch and
nothing else count, each in the window that holds it whole. Goal (issue 5): step p99 under loads
at most 1.05x of the p99 without.

    python bench/service_load.py                           # CUDA, Llama-7B shape, bf16
    python bench/service_load.py --shape tiny --device cpu --batch 8 --rounds 6 --decode-len 64

A run whose windows hold no full-batch decode step (requests so short that a stream is always
starting its next one) has no ratio to report: it says so, and exits 1.
"""

from __future__ import annotations

import argparse
import asyncio
import functools
import json
import logging
import os
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

import grpc  # noqa: E402

from bench.adapter_load import (  # noqa: E402
    PROMPT_TOKENS,
    RANK,
    Collection,
    CollectionLog,
    StepTime,
    StepTimer,
    machine,
    set_up,
)
from lorafleet.v1 import inference_pb2 as pb  # noqa: E402
from lorafleet.v1 import inference_pb2_grpc as pb_grpc  # noqa: E402
from services.inference.service_stats import summarize  # noqa: E402

log = logging.getLogger("bench.service_load")


# ------------------------------------------------------------------ the client (its own process)


async def client(spec: dict) -> dict:
    """Drive the service as its users do; return the TTFTs and the windows, perf_counter times."""
    batch, decode_len = spec["batch"], spec["decode_len"]
    prompt = [(11 * i) % 500 + 3 for i in range(PROMPT_TOKENS)]
    async with grpc.aio.insecure_channel(spec["address"]) as channel:
        stub = pb_grpc.InferenceStub(channel)

        async def first_token(name: str, rid: str) -> float:
            sampling = pb.SamplingParams(max_new_tokens=1, ignore_eos=True)
            req = pb.GenerateRequest(
                request_id=rid, adapter_id=name, prompt_token_ids=prompt, sampling=sampling
            )
            t = time.perf_counter()
            async for _ in stub.Generate(req):
                return time.perf_counter() - t
            raise RuntimeError(f"{rid}: the stream ended without a token")

        for name in spec["warm"]:
            await stub.LoadAdapter(pb.LoadAdapterRequest(adapter_id=name, pin=True))
        await first_token("", "warmup")  # compiles/allocates the prefill path
        await first_token(spec["warm"][0], "warmup-lora")
        ttft = {
            "base_s": await first_token("", "base"),
            "warm_adapter_s": await first_token(spec["warm"][0], "warm"),
            "cold_adapter_s": [],
        }
        for i, name in enumerate(spec["cold"]):  # never loaded before: fetched from the store
            ttft["cold_adapter_s"].append(await first_token(name, f"cold-{i}"))
            await stub.UnloadAdapter(pb.UnloadAdapterRequest(adapter_id=name))

        stop = asyncio.Event()
        first_done = [asyncio.Event() for _ in range(batch)]

        async def stream(i: int) -> None:
            name = spec["warm"][i % len(spec["warm"])] if i % 2 else ""
            n = 0
            while not stop.is_set():
                new = decode_len * (i + 1) // batch if n == 0 else decode_len
                sampling = pb.SamplingParams(max_new_tokens=max(new, 1), ignore_eos=True)
                req = pb.GenerateRequest(
                    request_id=f"decode-{i}-{n}", adapter_id=name, prompt_token_ids=prompt,
                    sampling=sampling,
                )  # fmt: skip
                async for _ in stub.Generate(req):
                    pass
                first_done[i].set()
                n += 1

        tasks = [asyncio.create_task(stream(i)) for i in range(batch)]
        windows: list[tuple[str, float, float]] = []
        try:
            for done in first_done:  # one full cycle: contexts spread out
                await done.wait()
            loads = spec["loads"]
            for r in range(spec["rounds"]):
                t = time.perf_counter()
                await asyncio.sleep(spec["quiet_s"])
                windows.append(("quiet", t, time.perf_counter()))
                t = time.perf_counter()
                for j in range(2):  # back to back: a load is always in flight
                    name = loads[(2 * r + j) % len(loads)]
                    await stub.LoadAdapter(pb.LoadAdapterRequest(adapter_id=name))
                    await stub.UnloadAdapter(pb.UnloadAdapterRequest(adapter_id=name))
                windows.append(("load", t, time.perf_counter()))
        finally:
            stop.set()
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
    return {"ttft": ttft, "windows": windows, "loads": 2 * spec["rounds"]}


# ------------------------------------------------------------------ the service (this process)


async def run(args) -> dict:
    """Each engine placement in turn, over one store and one set of adapters."""
    if args.switch_interval_ms is not None:  # the GIL's: how long a thread may hold it when
        sys.setswitchinterval(args.switch_interval_ms / 1000)  # another waits (default 5 ms)
    setup = set_up(args, "store-service")
    try:
        variants = {}
        for engine in args.engines.split(","):
            log.info("--- engine: %s", engine)
            variants[engine] = await run_variant(args, setup, engine)
    finally:
        setup.store.terminate()
        setup.store.wait()
    return {"machine": machine(), "variants": variants}


async def run_variant(args, setup, engine: str) -> dict:
    import torch

    from services.inference import server as server_module
    from services.inference.config import ServiceConfig
    from services.inference.engine_client import RemoteEngine

    device = torch.device(args.device)
    warm, cold, loads, mb = setup.warm, setup.cold, setup.loads, setup.mb
    trace = Path(args.work_dir) / "engine-trace.json"
    trace.unlink(missing_ok=True)
    os.environ["LORAFLEET_BENCH_TRACE"] = str(trace)
    # The engine process runs bench/traced_engine.py, which times its steps there.
    server_module.RemoteEngine = functools.partial(RemoteEngine, module="bench.traced_engine")
    n_adapters = len(warm) + len(cold) + len(loads)
    server = server_module.InferenceServer(
        ServiceConfig(
            model=setup.model, adapter_store=setup.address, port=0, device=args.device,
            max_num_seqs=args.batch + 8, max_loras=n_adapters + 4, max_lora_rank=RANK,
            host_cache_mb=int((n_adapters + 2) * mb), max_queue=4 * args.batch,
            pool_memory_mb=None if device.type == "cuda" else 512, engine=engine,
            preload_adapters="off",  # the cold adapters must come from the store when asked
        )
    )  # fmt: skip
    try:
        await server.start()
        timer = StepTimer(server.engine.core) if engine == "thread" else None
        spans: dict = {}  # the engine process records what else ran (bench/traced_engine.py)
        spec = {
            "address": f"127.0.0.1:{server.port}", "batch": args.batch,
            "decode_len": args.decode_len, "rounds": args.rounds, "quiet_s": args.quiet_s,
            "warm": warm, "cold": cold, "loads": loads,
        }  # fmt: skip
        with CollectionLog() as gc_log:
            proc = await asyncio.create_subprocess_exec(
                sys.executable, __file__, "--client", json.dumps(spec),
                stdout=asyncio.subprocess.PIPE,
            )  # fmt: skip
            out, _ = await proc.communicate()
        if proc.returncode != 0:
            raise RuntimeError(f"the client failed (exit {proc.returncode})")
    finally:
        await server.stop()
    if timer is not None:  # the step thread ran here, beside the event loop
        steps, collections = timer.steps, gc_log.collections
    else:  # the engine process wrote its steps and collections when it stopped
        recorded = json.loads(trace.read_text())
        steps = [StepTime(**s) for s in recorded["steps"]]
        collections = [Collection(**c) for c in recorded["collections"]]
        spans = recorded["spans"]
    return analyse(args, json.loads(out), steps, collections, mb, spans)


def analyse(
    args, report: dict, steps, collections: list[Collection], mb: float, spans: dict
) -> dict:
    full = [s for s in steps if s.outputs == s.tokens == args.batch]
    by_kind: dict[str, list] = {"quiet": [], "load": []}
    for kind, a, b in report["windows"]:
        by_kind[kind] += [s for s in full if a <= s.start and s.start + s.seconds <= b]

    def stats(seconds: list[float], count: str = "steps") -> dict:
        s = summarize(seconds, len(seconds))
        return {count: len(seconds), "p50_s": s.p50, "p99_s": s.p99, "max_s": s.max}

    def overlapping(step) -> str:
        end = step.start + step.seconds
        hit = {f"gc{c.generation}" for c in collections if c.start < end and step.start < c.end}
        for what, rows in spans.items():
            if any(t < end and step.start < t + d for t, d in rows):
                hit.add(what)
        return "+".join(sorted(hit)) or "none"

    quiet, load = (stats([x.seconds for x in by_kind[k]]) for k in ("quiet", "load"))
    # What a stream sees between two tokens: a step plus whatever the step thread did before
    # the next one (e.g. a LoadAdapter's copy issued between steps), start to next start.
    ordered = sorted(steps, key=lambda x: x.start)
    next_start = {id(a): b.start for a, b in zip(ordered, ordered[1:], strict=False)}

    def periods(samples) -> dict:
        return stats([next_start[id(x)] - x.start for x in samples if id(x) in next_start])

    quiet_period, load_period = periods(by_kind["quiet"]), periods(by_kind["load"])
    threads: dict[str, list[int]] = {}
    for c in collections:
        threads.setdefault(c.thread, [0, 0, 0])[c.generation] += 1
    ttft = report["ttft"]
    cold = sorted(ttft["cold_adapter_s"])
    return {
        "shape": args.shape, "rank": RANK, "adapter_mb": mb,
        "switch_interval_s": sys.getswitchinterval(),
        "prompt_tokens": PROMPT_TOKENS, "batch": args.batch, "decode_len": args.decode_len,
        "loads": report["loads"],
        "ttft": {**ttft, "cold_adapter_median_s": cold[len(cold) // 2] if cold else None},
        "step_no_loads": quiet, "step_with_loads": load,
        "p99_ratio": load["p99_s"] / quiet["p99_s"] if quiet["p99_s"] else None,
        "p50_ratio": load["p50_s"] / quiet["p50_s"] if quiet["p50_s"] else None,
        "period_no_loads": quiet_period, "period_with_loads": load_period,
        "period_p99_ratio": load_period["p99_s"] / quiet_period["p99_s"]
        if quiet_period["p99_s"] else None,
        "slowest_with_loads": [
            (s.seconds, overlapping(s))
            for s in sorted(by_kind["load"], key=lambda x: -x.seconds)[:6]
        ],
        "gc_threads": threads,
        "engine_process_spans": {
            k: stats([d for _, d in rows], "count") for k, rows in spans.items() if rows
        },
    }  # fmt: skip


def report_text(r: dict) -> str:
    ms = lambda s: f"{s * 1000:8.1f} ms"  # noqa: E731
    t = r["ttft"]
    a, b = r["step_no_loads"], r["step_with_loads"]
    lines = [
        f"time to first token over gRPC ({r['shape']}, prompt {r['prompt_tokens']} tokens):",
        f"  cold adapter ({r['adapter_mb']:.1f} MB, rank {r['rank']}), median of "
        f"{len(t['cold_adapter_s'])}  {ms(t['cold_adapter_median_s'] or 0.0)}",
        f"  warm adapter             {ms(t['warm_adapter_s'])}",
        f"  base model               {ms(t['base_s'])}",
        f"decode step, {r['batch']} gRPC streams (contexts {r['prompt_tokens']} to "
        f"{r['prompt_tokens'] + r['decode_len']}):      p50         p99",
        f"  no loads             {ms(a['p50_s'])} {ms(a['p99_s'])}  ({a['steps']} steps)",
        f"  with loads           {ms(b['p50_s'])} {ms(b['p99_s'])}  ({b['steps']} steps, "
        f"{r['loads']} loads)",
        f"  p99 ratio {r['p99_ratio']:.3f}, p50 ratio {r['p50_ratio']:.3f} (goal: p99 <= 1.05)",
        f"  step period (start to next start): no loads {ms(r['period_no_loads']['p50_s'])} "
        f"{ms(r['period_no_loads']['p99_s'])}; with loads {ms(r['period_with_loads']['p50_s'])} "
        f"{ms(r['period_with_loads']['p99_s'])}; p99 ratio {r['period_p99_ratio']:.3f}",
        "  slowest with loads: "
        + ", ".join(f"{s * 1000:.1f} ms ({p})" for s, p in r["slowest_with_loads"]),
        "  collections ran on: "
        + "; ".join(f"{k} gen0 {v[0]} gen1 {v[1]} gen2 {v[2]}" for k, v in r["gc_threads"].items()),
    ]
    for what, v in r.get("engine_process_spans", {}).items():
        lines.append(f"  engine process {what}: {v['count']}x, p50 {ms(v['p50_s'])}, "
                     f"p99 {ms(v['p99_s'])}, max {ms(v['max_s'])}")  # fmt: skip
    return "\n".join(lines)


def main() -> int:
    if len(sys.argv) == 3 and sys.argv[1] == "--client":
        print(json.dumps(asyncio.run(client(json.loads(sys.argv[2])))))
        return 0
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shape", default="llama-7b")
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--work-dir", default="/tmp/lorafleet-bench")
    parser.add_argument("--batch", type=int, default=64, help="decoding gRPC streams")
    parser.add_argument("--warm", type=int, default=8, help="resident adapters in the batch")
    parser.add_argument("--cold", type=int, default=8, help="cold adapters timed for TTFT")
    parser.add_argument("--load-adapters", type=int, default=8, help="adapters the loads cycle")
    parser.add_argument("--rounds", type=int, default=64, help="quiet + load windows (2 loads)")
    parser.add_argument("--quiet-s", type=float, default=0.35, help="length of a quiet window")
    parser.add_argument("--decode-len", type=int, default=256, help="tokens per stream request")
    parser.add_argument(
        "--switch-interval-ms", type=float, default=None, help="the service process's GIL switch"
    )
    parser.add_argument(
        "--engines", default="process,thread",
        help="where the engine runs, each in turn: its own process, a thread of the service",
    )  # fmt: skip
    parser.add_argument("--out", default=str(REPO / "bench/results/service_load.json"))
    args = parser.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s")
    result = asyncio.run(run(args))
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=2) + "\n")
    print(f"machine: {result['machine']}")
    missing = []
    for engine, r in result["variants"].items():
        print(f"\n=== engine: {engine}")
        if r["p99_ratio"] is None or not r["step_with_loads"]["steps"]:
            missing.append(engine)
            print(
                f"  too few full-batch decode steps to compare: {r['step_no_loads']['steps']} "
                f"in quiet windows, {r['step_with_loads']['steps']} in windows with loads "
                "(more --rounds or a longer --decode-len)"
            )
            continue
        print(report_text(r))
    return 1 if missing else 0


if __name__ == "__main__":
    sys.exit(main())
