"""Fair sharing between tenants through the real services: does a tenant that floods the
inference service raise another tenant's time to first token?

Both services run as deployed (``python -m services.adapter_store``, ``python -m
services.inference`` with --auth-tokens and the store token), each tenant on its own adapter
(rank 8 on q/k/v/o, under its namespace) with its own bearer token. For each scheduling policy
(--scheduling fair, then fcfs) one inference process serves three phases of --seconds each:

1. light alone: tenant ``light`` sends requests at rate r (Poisson arrivals);
2. heavy alone: tenant ``heavy`` sends at 10 r;
3. both at once.

Each tenant's client runs in a process of its own with its own connection, as separate tenants'
clients do: sharing one event loop and one HTTP/2 connection with the flood would delay the
light tenant's first tokens in the client, not in the service.

r is set from the service's measured capacity (requests per second with a full batch, timed
first with all requests sent at once): 10 r is --overload times it, so the heavy tenant alone
builds a backlog. The goal (issue 17): in phase 3 the light tenant's TTFT p99 at most 2x its p99
of phase 1, and in phase 2 the same throughput as first come, first served (work-conserving).
Heavy requests still queued when a phase ends are cancelled before the next.

    python bench/fairness.py --device cuda                       # Llama-7B shape, bf16
    python bench/fairness.py --device cpu --shape tiny --prompt-len 16 --output-len 16 \\
        --max-num-seqs 8 --seconds 20 --out bench/results/fairness_cpu.json
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import os
import random
import shutil
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

import grpc  # noqa: E402

from bench.adapter_load import machine  # noqa: E402
from bench.bench_models import SHAPES, make_model  # noqa: E402
from bench.bench_services import (  # noqa: E402
    UPLOAD_OPTIONS,
    free_port,
    upload_adapter,
    wait_serving,
)
from bench.provenance import git_commit  # noqa: E402
from lorafleet.v1 import adapter_store_pb2_grpc as store_grpc  # noqa: E402
from lorafleet.v1 import inference_pb2 as pb  # noqa: E402
from lorafleet.v1 import inference_pb2_grpc as pb_grpc  # noqa: E402
from services.auth import bearer_metadata, token_digest  # noqa: E402
from services.inference.service_stats import summarize  # noqa: E402
from store.synthetic import synthetic_adapter  # noqa: E402

log = logging.getLogger("bench.fairness")
TENANTS = ("light", "heavy")
HEAVY_FACTOR = 10
SERVE_TIMEOUT_S = 900.0  # a service's start, model loading and CUDA graphs included


def write_tokens(work: Path) -> dict[str, str]:
    tokens = {name: f"bench-{name}-{os.urandom(8).hex()}" for name in (*TENANTS, "service")}
    items = [{"sha256": token_digest(tokens[t]), "role": "tenant", "tenant": t} for t in TENANTS]
    items.append({"sha256": token_digest(tokens["service"]), "role": "service"})
    (work / "tokens.json").write_text(json.dumps({"tokens": items}))
    (work / "service.token").write_text(tokens["service"])
    return tokens


def start_store(work: Path, tokens: dict[str, str], shape) -> tuple[subprocess.Popen, str]:
    port = free_port()
    proc = subprocess.Popen(
        [sys.executable, "-m", "services.adapter_store", "--port", str(port), "--root",
         str(work / "store"), "--auth-tokens", str(work / "tokens.json"), "--log-level",
         "WARNING"],
        cwd=REPO,
    )  # fmt: skip
    address = f"127.0.0.1:{port}"
    wait_serving(address, proc, SERVE_TIMEOUT_S)
    files = synthetic_adapter(shape.base(), rank=8, modules=("q_proj", "k_proj", "v_proj",
                                                                "o_proj"), seed=0)  # fmt: skip
    with grpc.insecure_channel(address, options=UPLOAD_OPTIONS) as channel:
        stub = store_grpc.AdapterStoreStub(channel)
        for tenant in TENANTS:
            upload_adapter(stub, f"{tenant}/a", files, bearer_metadata(tokens[tenant]))
    return proc, address


def start_inference(args, model: Path, work: Path, store: str, scheduling: str):
    port = free_port()
    proc = subprocess.Popen(
        [sys.executable, "-m", "services.inference", "--port", str(port), "--model", str(model),
         "--device", args.device, "--adapter-store", store, "--scheduling", scheduling,
         "--max-num-seqs", str(args.max_num_seqs), "--max-queue", "100000",
         "--auth-tokens", str(work / "tokens.json"),
         "--adapter-store-token-file", str(work / "service.token"), "--log-level", "WARNING"],
        cwd=REPO, env={**os.environ, "OMP_NUM_THREADS": str(args.threads)},
    )  # fmt: skip
    address = f"127.0.0.1:{port}"
    wait_serving(address, proc, SERVE_TIMEOUT_S)
    return proc, address


class Client:
    def __init__(self, stub, tokens: dict[str, str], args) -> None:
        self.stub, self.tokens, self.args = stub, tokens, args
        self.prompt = [(7 * i) % 500 + 3 for i in range(args.prompt_len)]

    async def one(self, tenant: str, out: list) -> None:
        """One request; appends (tenant, ttft seconds, tokens, seconds) when it completes."""
        sampling = pb.SamplingParams(max_new_tokens=self.args.output_len, ignore_eos=True)
        request = pb.GenerateRequest(
            adapter_id=f"{tenant}/a", prompt_token_ids=self.prompt, sampling=sampling
        )
        start = time.perf_counter()
        first, tokens = None, 0
        async for msg in self.stub.Generate(
            request, metadata=bearer_metadata(self.tokens[tenant]), timeout=3600
        ):
            if first is None:
                first = time.perf_counter() - start
            tokens += len(msg.token_ids)
        out.append((tenant, first, tokens, time.perf_counter() - start))

    async def capacity(self, n: int) -> float:
        """Requests per second of one tenant's n requests sent at once."""
        out: list = []
        start = time.perf_counter()
        await asyncio.gather(*(self.one("heavy", out) for _ in range(n)))
        return n / (time.perf_counter() - start)


def tenant_process(spec: dict, stop, results) -> None:
    """One tenant's client for one phase, in a process of its own with its own connection, as
    separate tenants are: a flooding tenant's streams then share neither an HTTP/2 connection
    nor an event loop with the tenant measured. Poisson arrivals at spec["rate"] for
    spec["seconds"] from spec["start"] (perf_counter, which is system-wide on Linux); a light
    tenant awaits every request (up to 3x the phase), a heavy one cancels what is unfinished
    once ``stop`` is set or at 3x the phase. Puts (tenant, rows, cancelled, end time)."""
    results.put(asyncio.run(_tenant_phase(spec, stop)))


async def _tenant_phase(spec: dict, stop) -> tuple:
    tenant, rate, seconds, start = spec["tenant"], spec["rate"], spec["seconds"], spec["start"]
    args = argparse.Namespace(prompt_len=spec["prompt_len"], output_len=spec["output_len"])
    rng = random.Random(f"{spec['seed']}-{tenant}")
    done: list = []
    tasks: list[asyncio.Task] = []
    async with grpc.aio.insecure_channel(spec["address"]) as channel:
        client = Client(pb_grpc.InferenceStub(channel), {tenant: spec["token"]}, args)
        t = 0.0
        while True:
            t += rng.expovariate(rate)
            if t >= seconds:
                break
            await asyncio.sleep(max(0.0, start + t - time.perf_counter()))
            tasks.append(asyncio.create_task(client.one(tenant, done)))
        deadline = start + 3 * seconds
        pending = [x for x in tasks if not x.done()]
        while pending and time.perf_counter() < deadline:
            if tenant == "heavy" and stop.is_set():
                break
            await asyncio.wait(pending, timeout=0.2)
            pending = [x for x in pending if not x.done()]
        end = time.perf_counter()
        for task in pending:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
    return tenant, done, len(pending), end


def phase(args, address: str, tokens: dict[str, str], rates: dict[str, float], seed: int) -> dict:
    """Both tenants' clients for one phase, each in its own process (tenant_process); the heavy
    tenant stops once every light request has ended."""
    import multiprocessing

    ctx = multiprocessing.get_context("spawn")
    stop, results = ctx.Event(), ctx.Queue()
    start = time.perf_counter() + 3.0  # every client process is up by then
    procs = {}
    for tenant, rate in rates.items():
        spec = {"tenant": tenant, "rate": rate, "seconds": args.seconds, "start": start,
                "seed": seed, "address": address, "token": tokens[tenant],
                "prompt_len": args.prompt_len, "output_len": args.output_len}  # fmt: skip
        procs[tenant] = ctx.Process(target=tenant_process, args=(spec, stop, results))
        procs[tenant].start()
    out = {}
    for _ in procs:
        tenant, rows, cancelled, end = results.get(timeout=4 * args.seconds + 60)
        out[tenant] = (rows, cancelled, end)
        if tenant == "light":
            stop.set()
    for proc in procs.values():
        proc.join()
    window = max(end for _, _, end in out.values()) - start
    result = {
        "seconds": args.seconds,
        "rates": rates,
        "cancelled_heavy": out.get("heavy", ([], 0, 0))[1],
    }
    for tenant, (rows, _, _) in out.items():
        result[tenant] = {
            "requests": len(rows),
            "ttft": _summary([r[1] for r in rows]),
            "tokens_per_second": sum(r[2] for r in rows) / window,
        }
    return result


def _summary(values: list[float]) -> dict:
    s = summarize(values, len(values))
    return {"count": s.count, "p50_s": s.p50, "p99_s": s.p99, "mean_s": s.mean, "max_s": s.max}


async def measure(args, address: str, tokens: dict[str, str]) -> dict:
    async with grpc.aio.insecure_channel(address) as channel:
        client = Client(pb_grpc.InferenceStub(channel), tokens, args)
        # Warm-up: both adapters in the pool, the batch sizes run once (CUDA graphs replayed).
        await asyncio.gather(client.one("light", []), client.capacity(args.max_num_seqs))
        capacity = await client.capacity(4 * args.max_num_seqs)
        light = args.overload * capacity / HEAVY_FACTOR
        phases = {
            "light alone": {"light": light},
            "heavy alone": {"heavy": HEAVY_FACTOR * light},
            "both": {"light": light, "heavy": HEAVY_FACTOR * light},
        }
        out = {"capacity_rps": capacity}
        for i, (name, rates) in enumerate(phases.items()):
            out[name] = await asyncio.to_thread(phase, args, address, client.tokens, rates, i)
            log.info("%s: %s", name, json.dumps(out[name]))
        alone, both = out["light alone"]["light"]["ttft"], out["both"]["light"]["ttft"]
        out["light_p99_ratio"] = both["p99_s"] / alone["p99_s"] if alone["p99_s"] else None
        return out


def table(results: dict) -> str:
    lines = [
        f"{'policy':7} {'phase':12} {'tenant':6} {'reqs':>5} {'TTFT p50':>9} {'TTFT p99':>9} "
        f"{'tok/s':>8}"
    ]
    for policy, r in results["policies"].items():
        for phase in ("light alone", "heavy alone", "both"):
            for tenant in TENANTS:
                row = r[phase].get(tenant)
                if row is None:
                    continue
                t = row["ttft"]
                lines.append(
                    f"{policy:7} {phase:12} {tenant:6} {row['requests']:>5} "
                    f"{t['p50_s'] * 1000:>7.1f}ms {t['p99_s'] * 1000:>7.1f}ms "
                    f"{row['tokens_per_second']:>8.1f}"
                )
        ratio = r["light_p99_ratio"]
        lines.append(
            f"{policy:7} light TTFT p99 with heavy / alone: {ratio:.2f}x (goal <= 2x); "
            f"capacity {r['capacity_rps']:.1f} req/s"
        )
    return "\n".join(lines)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shape", choices=sorted(SHAPES), default="llama-7b")
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--work-dir", default="/tmp/lorafleet-bench-fairness")
    parser.add_argument("--prompt-len", type=int, default=128)
    parser.add_argument("--output-len", type=int, default=128)
    parser.add_argument("--max-num-seqs", type=int, default=64)
    parser.add_argument("--seconds", type=float, default=60.0, help="length of each phase")
    parser.add_argument(
        "--overload", type=float, default=1.5, help="the heavy tenant's rate over capacity"
    )
    parser.add_argument("--policies", default="fair,fcfs")
    parser.add_argument("--threads", type=int, default=1, help="OMP threads (CPU runs)")
    parser.add_argument("--out", default="bench/results/fairness.json")
    args = parser.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")

    import torch

    work = Path(args.work_dir)
    shutil.rmtree(work / "store", ignore_errors=True)
    work.mkdir(parents=True, exist_ok=True)
    shape = SHAPES[args.shape]
    model = make_model(work / f"model-{args.shape}", shape, torch.device(args.device))
    tokens = write_tokens(work)
    store, store_address = start_store(work, tokens, shape)
    results = {
        "machine": machine(),
        "device": args.device,
        "command": " ".join(sys.argv),
        "commit": git_commit(),
        "shape": args.shape,
        "prompt_len": args.prompt_len,
        "output_len": args.output_len,
        "max_num_seqs": args.max_num_seqs,
        "overload": args.overload,
        "heavy_factor": HEAVY_FACTOR,
        # Other work on the machine shows in wall-clock TTFT (on a shared CPU above all).
        "load_average_start": os.getloadavg(),
        "policies": {},
    }
    out = REPO / args.out
    try:
        for policy in args.policies.split(","):
            proc, address = start_inference(args, model, work, store_address, policy)
            try:
                results["policies"][policy] = asyncio.run(measure(args, address, tokens))
            finally:
                proc.terminate()
                proc.wait()
            results["load_average_end"] = os.getloadavg()
            out.write_text(json.dumps(results, indent=2) + "\n")  # after each policy
    finally:
        store.terminate()
        store.wait()
    print(table(results))
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
