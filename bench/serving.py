"""The serving benchmark of DESIGN.md, end to end through the services as deployed.

The adapter store (local backend) and the inference service run as their own processes, exactly
as ``python -m services.adapter_store`` and ``python -m services.inference`` start them (any
``--serve-flag`` is passed on to the inference service, default flags otherwise); client
processes replay a trace over gRPC. The workload (S-LoRA's): prompt and output lengths drawn
uniformly from [8, 512), ``ignore_eos``, greedy; arrivals a Gamma process (cv 1) at a rate for
a duration, or all requests at once (rate ``inf``); each request's adapter drawn from n adapters
by a power law (alpha 1 = uniform), or the base model (n = 0). The same trace (same seed) runs for
the base model and for each n, side by side on one service.

Per run: output tokens/s, requests/s, rejected requests, time to first token and time per output
token (p50, p99) as the clients see them, how long after the last arrival the last request ended,
and from the engine's step log (--step-log, engine/step_log.py) each step's share of its
roofline (bench/roofline.py: bytes at the copy bandwidth, or FLOPs at the matmul rate, both
measured on this machine in this run), as a distribution over the steps of 64 sequences or more.
The step log itself is kept beside the JSON (NAME_steps.jsonl.gz) for bench/step_compare.py,
bench/step_kinds.py and bench/capacity_bound.py.

    python bench/serving.py                                    # CUDA, Llama-7B shape, base model
    python bench/serving.py --runs inf:1000 40:15 --adapters 0 5 100 --workload S1
    python bench/serving.py --shape tiny --device cpu --runs inf:24 4:3 --adapters 0 3
    python bench/serving.py --via grpc gateway      # the HTTP gateway's overhead, same traces

With ``--via gateway`` the clients call the HTTP gateway (services/gateway) with streamed
completions of the same token ids instead of Generate; the rows say how it compares with gRPC
(vs_grpc: throughput ratio; ttft_p50_added_s).

With ``--tensor-parallel-size N`` the service shards the model over N GPUs (N processes), and the
roofline counts N times one GPU's ceilings. ``--random-weights`` writes the model's config and
tokenizer only, and the service draws its weights (--load-format random): the Llama-70B shape's
138 GB would not fit the GPU machines' disks.

    python bench/serving.py --shape llama-70b --random-weights --tensor-parallel-size 2 \
        --workload S1r16qv --runs inf:1000 --adapters 0 1000
"""

from __future__ import annotations

import argparse
import gzip
import itertools
import json
import logging
import math
import os
import random
import shutil
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import NamedTuple

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

import grpc  # noqa: E402

from bench.bench_services import (  # noqa: E402
    UPLOAD_OPTIONS,
    free_port,
    upload_adapter,
    wait_serving,
)
from lorafleet.v1 import adapter_store_pb2_grpc as store_grpc  # noqa: E402
from lorafleet.v1 import inference_pb2 as pb  # noqa: E402
from lorafleet.v1 import inference_pb2_grpc as pb_grpc  # noqa: E402

log = logging.getLogger("bench.serving")

UPLOAD_THREADS = 8

WORKLOADS = {  # adapter ranks, cycled over the n adapters, and their target modules
    "S1": ((8,), ("q_proj", "k_proj", "v_proj", "o_proj")),
    "S2": ((8, 16, 32, 64), ("q_proj", "k_proj", "v_proj", "o_proj")),
    "S1r16": ((16,), ("q_proj", "k_proj", "v_proj", "o_proj")),  # the tensor-parallel issue's
    # The same on q and v only (PEFT's default for Llama): for the Llama-70B shape an adapter is
    # 66 MB where S1r16's is 131, so 1000 of them fit a store on a 128 GB disk.
    "S1r16qv": ((16,), ("q_proj", "v_proj")),
}
LENGTHS = (8, 512)  # prompt and output lengths are uniform in [8, 512)


class Request(NamedTuple):
    arrival_s: float  # after the trace's start
    prompt_len: int
    output_len: int
    adapter: int | None  # index among the run's adapters; None = the base model


def make_trace(rate: float, count: int | None, duration: float | None, seed: int) -> list:
    """Arrivals (Gamma, cv 1: exponential gaps) at ``rate`` for ``duration`` seconds, or
    ``count`` requests at once when the rate is infinite; lengths uniform in LENGTHS."""
    rng = random.Random(seed)
    out, t = [], 0.0
    while True:
        if math.isinf(rate):
            if len(out) == count:
                break
        else:
            t += rng.expovariate(rate)
            if t > duration:
                break
        out.append(Request(0.0 if math.isinf(rate) else t, rng.randrange(*LENGTHS),
                           rng.randrange(*LENGTHS), None))  # fmt: skip
    return out


def with_adapters(trace: list[Request], n: int, alpha: float, seed: int) -> list[Request]:
    """Each request's adapter by a power law over n (numpy's power(alpha): alpha 1 is
    uniform), drawn from its own stream so every n sees the same arrivals and lengths."""
    if n == 0:
        return trace
    import numpy as np

    rng = np.random.default_rng(seed + 1)
    picks = np.minimum((rng.power(alpha, len(trace)) * n).astype(int), n - 1)
    return [r._replace(adapter=int(a)) for r, a in zip(trace, picks, strict=True)]


# ------------------------------------------------------------------ services and setup


def upload(address: str, shape, workload: str, n: int) -> list[str]:
    """n adapters (ranks cycled as the workload says, random weights, the same bytes for one
    rank: the serving cost does not depend on the values); returns their ids, in order. They go
    up on UPLOAD_THREADS threads, a connection each (the store takes 8 uploads at once by
    default): one after another, 1000 adapters of 16 MB took 110 s on the H200 machine."""
    from store.synthetic import synthetic_adapter

    ranks, modules = WORKLOADS[workload]
    files = {r: synthetic_adapter(shape.base(), rank=r, alpha=2.0 * r, modules=modules, seed=r)
             for r in ranks[:n]}  # fmt: skip
    names = [f"bench/{workload.lower()}-{i}" for i in range(n)]
    # A subchannel pool of its own per channel: otherwise channels to one address share one
    # connection.
    options = [*UPLOAD_OPTIONS, ("grpc.use_local_subchannel_pool", 1)]

    def upload_every(first: int) -> None:  # names first, first + UPLOAD_THREADS, ...
        with grpc.insecure_channel(address, options=options) as channel:
            stub = store_grpc.AdapterStoreStub(channel)
            for i in range(first, n, UPLOAD_THREADS):
                upload_adapter(stub, names[i], files[ranks[i % len(ranks)]])

    with ThreadPoolExecutor(UPLOAD_THREADS) as pool:
        list(pool.map(upload_every, range(min(UPLOAD_THREADS, n))))  # raises the first error
    return names


def wait_gateway(address: str, proc: subprocess.Popen, timeout: float) -> str:
    """Wait until the gateway answers /health; return the base model's id (/v1/models)."""
    import urllib.error
    import urllib.request

    deadline = time.monotonic() + timeout
    while True:
        try:
            with urllib.request.urlopen(f"http://{address}/v1/models", timeout=5) as r:
                return json.loads(r.read())["data"][0]["id"]
        except (urllib.error.URLError, ConnectionError, TimeoutError):
            if proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"the gateway at {address} did not come up") from None
            time.sleep(0.5)


def preload_mode(flags: list[str]) -> str:
    """The inference service's --preload-adapters under these --serve-flag values (its default:
    pool)."""
    words = " ".join(flags).replace("=", " ").split()
    mode = "pool"
    for flag, value in zip(words, words[1:], strict=False):
        if flag == "--preload-adapters":
            mode = value
    return mode


def wait_preloaded(
    address: str, n: int, pool: bool, settle: float = 10.0, timeout: float = 1200.0
) -> dict:
    """Waits until the service's host cache holds ``n`` adapters (and with ``pool`` its page
    pool too), or nothing changed for ``settle`` seconds (its preloader found no more room);
    returns how many and how long."""
    start = time.monotonic()
    last, since = None, start
    with grpc.insecure_channel(address) as channel:
        stub = pb_grpc.InferenceStub(channel)
        while time.monotonic() - start < timeout:
            s = stub.GetStats(pb.GetStatsRequest(), timeout=10)
            now, seen = time.monotonic(), (s.host_cache.entries, s.resident_adapters)
            if seen != last:
                last, since = seen, now
            if (seen[0] >= n and (not pool or seen[1] >= n)) or now - since >= settle:
                break
            time.sleep(0.5)
    seconds = time.monotonic() - start
    log.info("preload: %d adapters wanted; %d in the host cache, %d in the page pool, after "
             "%.1f s", n, last[0], last[1], seconds)  # fmt: skip
    return {
        "adapters": n,
        "in_host_cache": last[0],
        "in_pool": last[1],
        "seconds": round(seconds, 1),
    }


def place_adapters(address: str, names: list[str]) -> set[str]:
    """Loads into the page pool those of ``names`` that are not there, one after the other,
    while the pool has room for them (it stops at the first load that leaves the pool's count of
    adapters where it was: that load evicted another); returns those of ``names`` in the pool
    then. The preload waits for n adapters in the pool, not for these n: after a trace of
    more adapters the pool holds what that trace left in it."""
    with grpc.insecure_channel(address) as channel:
        stub = pb_grpc.InferenceStub(channel)

        def in_pool() -> set[str]:
            listed = stub.ListAdapters(pb.ListResidentAdaptersRequest(), timeout=30).adapters
            return {a.adapter_id for a in listed if a.residency == pb.RESIDENCY_GPU}

        held = in_pool()
        count = stub.GetStats(pb.GetStatsRequest(), timeout=10).resident_adapters
        for name in names:
            if name in held:
                continue
            stub.LoadAdapter(pb.LoadAdapterRequest(adapter_id=name), timeout=120)
            now = stub.GetStats(pb.GetStatsRequest(), timeout=10).resident_adapters
            if now <= count:
                break
            count = now
        return in_pool() & set(names)


def wait_idle(address: str, timeout: float = 600.0) -> pb.GetStatsResponse:
    """Waits until nothing runs or waits; returns the service's stats then."""
    with grpc.insecure_channel(address) as channel:
        stub = pb_grpc.InferenceStub(channel)
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            s = stub.GetStats(pb.GetStatsRequest(), timeout=10)
            if s.running_requests == 0 and s.queued_requests == 0:
                return s
            time.sleep(0.2)
    raise TimeoutError("the service did not go idle")


def device_memory(s: pb.GetStatsResponse) -> dict:
    """The service's device memory and pool size in its stats, GiB: what a larger page pool
    could still take."""
    m = s.device_memory
    return {
        "total_gib": round(m.total_bytes / 2**30, 2),
        "free_gib": round(m.free_bytes / 2**30, 2),
        "peak_reserved_gib": round(m.peak_reserved_bytes / 2**30, 2),
        "pool_pages": s.pool.total_pages,
    }


# ------------------------------------------------------------------ one run


def run_trace(args, address: str, trace: list[Request], names: list[str], tag: str,
              vocab: int, work: Path, http: dict | None = None) -> list[dict]:  # fmt: skip
    """Split the trace over args.clients processes, start them together, merge their results."""
    start = time.perf_counter() + 1.0 + 0.05 * args.clients  # every client is up by then
    procs, outs = [], []
    for c in range(args.clients):
        mine = [dict(r._asdict(), index=i) for i, r in enumerate(trace) if i % args.clients == c]
        spec = {"start": start, "vocab": vocab, "adapters": names, "address": address,
                "channels": args.channels, "seed": args.seed * 1000 + c, "tag": f"{tag}-c{c}",
                "timeout_s": args.timeout_s, "requests": mine, **(http or {})}  # fmt: skip
        path = work / f"{tag}-client{c}.json"
        path.write_text(json.dumps(spec))
        outs.append(path.with_suffix(".out.json"))
        client = str(REPO / "bench" / "serving_client.py")
        procs.append(subprocess.Popen([sys.executable, client, str(path), str(outs[-1])]))
    for p in procs:
        if p.wait() != 0:
            raise RuntimeError(f"a client exited with {p.returncode}")
    results = [r for o in outs for r in json.loads(o.read_text())]
    for r in results:
        r["arrival"] = start + trace[r["index"]].arrival_s
        r["output_len"] = trace[r["index"]].output_len
        r["prompt_len"] = trace[r["index"]].prompt_len
    return results


def parse_run(text: str) -> tuple[float, int | None, float | None]:
    """'inf:1000' = 1000 requests at once; '40:15' = 40 requests/s for 15 s."""
    rate, _, amount = text.partition(":")
    if rate == "inf":
        return math.inf, int(amount), None
    return float(rate), None, float(amount)


def write_result(args, ceilings, rows: list[dict], preload: dict | None = None,
                 uploaded: dict | None = None) -> None:  # fmt: skip
    """The JSON so far (written after every run, so a failure keeps what was measured)."""
    from bench.adapter_load import machine
    from bench.serving_report import vs_base_over_passes

    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps({
        "benchmark": "serving workload of DESIGN.md through the deployed gRPC services",
        "shape": args.shape, "workload": args.workload, "alpha": args.alpha, "seed": args.seed,
        "serve_flags": args.serve_flag, "tensor_parallel_size": args.tensor_parallel_size,
        "random_weights": args.random_weights, "upload": uploaded, "preload": preload,
        "ceilings": ceilings._asdict(),
        "machine": machine(),
        "command": "python bench/serving.py " + " ".join(sys.argv[1:]), "results": rows,
        "vs_base_over_passes": vs_base_over_passes(rows),
    }, indent=2) + "\n")  # fmt: skip


def main() -> None:
    from bench.bench_models import SHAPES, make_model
    from bench.roofline import Ceilings, Roofline, measure_ceilings_subprocess
    from bench.serving_report import StepLogReader, analyse, table, vs_base_over_passes

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shape", choices=sorted(SHAPES), default="llama-7b")
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--runs", nargs="+", default=["inf:1000", "40:15", "10:30"],
                        help="RATE:SECONDS, or inf:REQUESTS for all at once")  # fmt: skip
    parser.add_argument("--adapters", type=int, nargs="+", default=[0],
                        help="adapter counts n, 0 = base model; each runs every trace")  # fmt: skip
    parser.add_argument("--workload", choices=sorted(WORKLOADS), default="S1")
    parser.add_argument(
        "--via", nargs="+", choices=["grpc", "gateway"], default=["grpc"],
        help="the front the clients call: gRPC, the HTTP gateway, or both (side by side)",
    )  # fmt: skip
    parser.add_argument(
        "--passes", type=int, default=1,
        help="run each trace this many times in a row: in the first no adapter has served a "
        "request yet (preloaded in the host cache, the service's default, or in the store only "
        "with --serve-flag=--preload-adapters=off: cold), in later ones they have (warm)",
    )  # fmt: skip
    parser.add_argument("--alpha", type=float, default=1.0, help="popularity power law")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--clients", type=int, default=4, help="client processes")
    parser.add_argument("--channels", type=int, default=4, help="gRPC channels per client")
    parser.add_argument("--timeout-s", type=float, default=600.0)
    parser.add_argument(
        "--serve-flag", action="append", default=[],
        help="a flag for the inference service, e.g. --serve-flag=--max-queue=9",
    )  # fmt: skip
    parser.add_argument(
        "--work-dir", type=Path, default=Path(tempfile.gettempdir()) / "lorafleet-serving"
    )
    parser.add_argument(
        "--store-dir", type=Path, default=None,
        help="where the adapter store keeps its files: DIR/store, emptied first (default: the "
        "work dir); S2 with 1000 adapters is 63 GB, more than some disks hold beside the model, "
        "so e.g. a directory in /dev/shm",
    )  # fmt: skip
    parser.add_argument(
        "--tensor-parallel-size", type=int, default=1,
        help="the service's --tensor-parallel-size (N GPUs); the roofline counts N devices' "
        "copy bandwidth and matmul rate, each measured on one",
    )  # fmt: skip
    parser.add_argument(
        "--random-weights", action="store_true",
        help="write the model's config and tokenizer only; the service draws its weights "
        "(--load-format random): for shapes whose checkpoint does not fit the disk",
    )  # fmt: skip
    parser.add_argument("--out", type=Path, default=REPO / "bench" / "results" / "serving.json")
    args = parser.parse_args()
    if args.tensor_parallel_size < 1:
        parser.error("--tensor-parallel-size must be at least 1")
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s")

    import torch

    shape = SHAPES[args.shape]
    work = args.work_dir
    work.mkdir(parents=True, exist_ok=True)
    model = make_model(work / f"model-{args.shape}", shape, torch.device(args.device),
                       weights=not args.random_weights)  # fmt: skip
    one = measure_ceilings_subprocess(args.device)
    tp = args.tensor_parallel_size  # each rank moves 1/tp of the bytes and does 1/tp of the work
    ceilings = Ceilings(one.copy_bytes_per_s * tp, one.matmul_flops_per_s * tp)
    roof = Roofline.for_shape(shape, ceilings, dtype_bytes=2 if args.device == "cuda" else 4)
    log.info("ceilings: copy %.2f TB/s, matmul %.0f TFLOP/s", ceilings.copy_bytes_per_s / 1e12,
             ceilings.matmul_flops_per_s / 1e12)  # fmt: skip
    store_dir, step_log = (args.store_dir or work) / "store", work / "steps.jsonl"
    subprocess.run(["rm", "-rf", str(store_dir)], check=True)
    step_log.unlink(missing_ok=True)
    step_reader = StepLogReader(step_log)
    store_port, port = free_port(), free_port()
    path = os.environ.get("PYTHONPATH")
    env = {**os.environ, "PYTHONPATH": str(REPO) + (os.pathsep + path if path else "")}
    store = subprocess.Popen([sys.executable, "-m", "services.adapter_store", "--port",
                              str(store_port), "--backend", "local", "--root", str(store_dir)],
                             cwd=REPO, env=env)  # fmt: skip
    service = gateway = None
    rows = []
    try:
        wait_serving(f"127.0.0.1:{store_port}", store, 60)
        start = time.monotonic()
        names = upload(f"127.0.0.1:{store_port}", shape, args.workload, max(args.adapters))
        uploaded = {"adapters": len(names), "seconds": round(time.monotonic() - start, 1),
                    "store_bytes": sum(f.stat().st_size for f in store_dir.rglob("*")
                                       if f.is_file())}  # fmt: skip
        log.info("uploaded %d adapters in %.1f s (%.1f GB in the store)", len(names),
                 uploaded["seconds"], uploaded["store_bytes"] / 1e9)  # fmt: skip
        service = subprocess.Popen([
            sys.executable, "-m", "services.inference", "--model", str(model), "--port", str(port),
            "--adapter-store", f"127.0.0.1:{store_port}", "--device", args.device,
            "--step-log", str(step_log), "--tensor-parallel-size", str(args.tensor_parallel_size),
            *(["--load-format", "random"] if args.random_weights else []), *args.serve_flag,
        ], cwd=REPO, env=env)  # fmt: skip
        address = f"127.0.0.1:{port}"
        wait_serving(address, service, 1200)
        http = None
        if "gateway" in args.via:
            gateway_port = free_port()
            gateway = subprocess.Popen([
                sys.executable, "-m", "services.gateway", "--port", str(gateway_port),
                "--inference", address, "--adapter-store", f"127.0.0.1:{store_port}",
            ], cwd=REPO, env=env)  # fmt: skip
            base_model = wait_gateway(f"127.0.0.1:{gateway_port}", gateway, 120)
            http = {"http": f"127.0.0.1:{gateway_port}", "base_model": base_model}
        # Adapters are in the store before the service starts, as a deployment's are before
        # its traffic: with preload on, the traces start once the service has preloaded them
        # (in pool mode each trace of n adapters waits until at least n adapters are in the pool
        # again: the last trace's KV cache may have taken their pages, and the preloader places
        # them again; then those of its own n that the pool lacks are loaded while it has room,
        # place_adapters: after a trace of more adapters it holds what that trace left).
        preload = None
        mode = preload_mode(args.serve_flag)
        if max(args.adapters) and mode != "off":
            preload = wait_preloaded(address, max(args.adapters), pool=mode == "pool")
        warm = [Request(0.0, 64, 8, None)] * 4
        for via in args.via:
            run_trace(args, address, warm, names, f"warmup-{via}", shape.vocab, work,
                      http if via == "gateway" else None)  # fmt: skip
        base_tps: dict[tuple, float] = {}
        grpc_rows: dict[tuple, dict] = {}
        # the base model first: every later row is compared with it
        for n, run, pas in itertools.product(args.adapters, args.runs, range(1, args.passes + 1)):
            rate, count, duration = parse_run(run)
            trace = with_adapters(make_trace(rate, count, duration, args.seed), n,
                                  args.alpha, args.seed)  # fmt: skip
            in_pool = None
            if n and mode == "pool":  # KV took adapters' pages in the last trace: back?
                in_pool = wait_preloaded(address, n, pool=True)["in_pool"]
                placed = place_adapters(address, names[:n])
                used = {names[r.adapter] for r in trace if r.adapter is not None}
            for via in args.via:  # the same trace through each front, one after the other
                log.info("run %s pass %d, %d adapters, via %s: %d requests", run, pas, n, via,
                         len(trace))  # fmt: skip
                tag = f"r{run}-p{pas}-n{n}-{via}".replace(":", "_")
                results = run_trace(args, address, trace, names[:n], tag, shape.vocab, work,
                                    http if via == "gateway" else None)  # fmt: skip
                idle = wait_idle(address)
                steps = step_reader.read()
                row = {"run": run, "pass": pas, "adapters": n, "via": via,
                       **analyse(results, steps, roof)}  # fmt: skip
                if in_pool is not None:
                    row["in_pool_at_start"] = in_pool
                    row["trace_adapters_in_pool_at_start"] = len(placed)
                    row["trace_used_adapters"] = len(used)
                    row["trace_used_adapters_in_pool_at_start"] = len(placed & used)
                row["device_memory"] = device_memory(idle)
                key = run, pas, via
                if n == 0:
                    base_tps[key] = row["output_tokens_per_s"]
                elif base_tps.get(key):
                    row["vs_base"] = row["output_tokens_per_s"] / base_tps[key]
                if via == "grpc":
                    grpc_rows[run, pas, n] = row
                elif (run, pas, n) in grpc_rows:
                    g = grpc_rows[run, pas, n]
                    row["vs_grpc"] = row["output_tokens_per_s"] / g["output_tokens_per_s"]
                    row["ttft_p50_added_s"] = row["ttft_p50_s"] - g["ttft_p50_s"]
                rows.append(row)
                print(table(rows[-1:]).splitlines()[1], flush=True)
                write_result(args, ceilings, rows, preload, uploaded)
    finally:
        for p in (gateway, service, store):
            if p is not None and p.poll() is None:
                p.terminate()
                try:
                    p.wait(timeout=60)
                except subprocess.TimeoutExpired:
                    p.kill()
    print(table(rows))
    for v in vs_base_over_passes(rows):
        if v["passes"] > 1:
            print(f"{v['run']} {v['via']} n = {v['adapters']}: vs base {v['mean']:.3f} over "
                  f"{v['passes']} passes ({v['min']:.3f}-{v['max']:.3f})")  # fmt: skip
    print(f"wrote {args.out}")
    if step_log.exists():  # beside the JSON, where bench/step_compare.py and the others look
        kept = args.out.with_name(args.out.stem + "_steps.jsonl.gz")
        with step_log.open("rb") as src, gzip.open(kept, "wb") as dst:
            shutil.copyfileobj(src, dst)
        print(f"wrote {kept}")


if __name__ == "__main__":
    main()
