"""A burst of cold adapters: when each lands in the host cache, by how many stream at once.

The saturating trace with 1000 adapters wants several hundred cold adapters in its first
second. The inference service fetches them through its StoreClient (one fetch worker process,
single-flight per adapter, --max-fetches streams at once, the rest waiting first come first
served). Streamed all at once they share the store's and the worker's bandwidth and each lands
near the end of the whole burst; a few at a time they land one after another, the first after
about one adapter's transfer, as long as enough stream at once to keep the bandwidth used.

This starts the adapter store (local backend, as bench/serving.py runs it) on --store-dir,
uploads --adapters S1 adapters of the --shape (rank 8, q/k/v/o: 16.8 MB for Llama-7B), then
for each --slots value (0: all at once) asks a fresh StoreClient and host cache for every
adapter at once, in order, and records when each lands. Prints a table and writes JSON.
With --worker-memory default tuned each burst runs twice, side by side: with glibc's defaults in
the fetch worker and as the service runs it (fetch_worker.py: freed buffers kept, blocks
populated before they are written); each burst starts a fresh worker, so every burst's writes
are its mapping's first, as the service's first fill of its host cache is. With --preload N...
the service's preloader (host cache only) also takes every adapter, as the store's watch would
name them, N at a time (preload.PRELOAD_STREAMS is the service's), after each repeat's bursts.

    python bench/fetch_burst.py [--adapters 256] [--slots 0 4 8 16 32 64] [--repeats 2] \
        [--worker-memory default tuned] [--preload 1 4]

The store's peak resident memory is a high-water mark: put the slot counts to compare in
ascending order of their expected peak (e.g. --slots 8 16 0 --repeats 1) to read each one's.
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

import grpc  # noqa: E402
import torch  # noqa: E402

from bench.bench_services import free_port, wait_serving  # noqa: E402
from bench.provenance import write_result  # noqa: E402
from bench.serving import upload  # noqa: E402
from lorafleet.v1 import adapter_store_pb2 as store_pb  # noqa: E402
from lorafleet.v1 import adapter_store_pb2_grpc as store_grpc  # noqa: E402
from services.inference.arena import HostArena  # noqa: E402
from services.inference.engine.api import AdapterKey  # noqa: E402
from services.inference.fetch_worker import MEMORY_ENV  # noqa: E402
from services.inference.host_cache import HostCache  # noqa: E402
from services.inference.preload import Preloader  # noqa: E402
from services.inference.store_client import AdapterEvent, StoreClient  # noqa: E402


def cpu_s(pid: int) -> float:
    """A process's CPU seconds so far, user and system, all its threads, exited ones included:
    Linux's CPU-time clock of the process (clock id ~pid << 3 | 2), in nanoseconds. /proc's
    stat counts clock ticks (10 ms), which a small burst's fetch worker can stay under."""
    return time.clock_gettime_ns(((~pid) << 3) | 2) / 1e9


def minor_faults(pid: int) -> int:
    """A process's minor page faults so far, all its threads (Linux /proc)."""
    return int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[7])


def peak_rss_mb(pid: int) -> float:
    """A process's peak resident memory so far (Linux /proc: VmHWM)."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) / 1024
    return float("nan")


def children(pid: int) -> list[int]:
    out = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            if int(stat.read_text().rsplit(")", 1)[1].split()[1]) == pid:
                out.append(int(stat.parent.name))
        except (OSError, ValueError, IndexError):
            continue  # gone meanwhile
    return out


async def burst(address: str, names: list[str], warm: str, slots: int, arena: HostArena,
                store_pid: int, memory: str) -> dict:  # fmt: skip
    """Fetch every adapter of ``names`` at once, asked in order, after ``warm`` alone (which
    starts the fetch worker, with its memory ``memory``: fetch_worker.MEMORY_ENV), into an
    empty ``arena``, which it leaves empty; seconds from the start to each landing, the CPU
    seconds the store, the fetch worker and this process spent meanwhile, and the worker's
    page faults."""
    os.environ[MEMORY_ENV] = memory
    cache = HostCache(arena)
    client = StoreClient(address, cache, lookup_timeout=30, fetch_timeout=600,
                         max_fetches=slots or len(names))  # fmt: skip
    try:
        await client.fetch(AdapterKey(warm, 1))
        procs = {"store": [store_pid], "fetch worker": [p for p in children(os.getpid())
                                                        if p != store_pid],
                 "this process": [os.getpid()]}  # fmt: skip
        before = {k: sum(cpu_s(p) for p in pids) for k, pids in procs.items()}
        faults = sum(minor_faults(p) for p in procs["fetch worker"])
        start = time.perf_counter()

        async def one(name: str) -> tuple[float, int]:
            entry = await client.fetch(AdapterKey(name, 1))
            return time.perf_counter() - start, entry.block.size

        landed = await asyncio.gather(*(one(n) for n in names))
        used = {k: sum(cpu_s(p) for p in pids) - before[k] for k, pids in procs.items()}
        faults = sum(minor_faults(p) for p in procs["fetch worker"]) - faults
    finally:
        await client.close()
        for key in cache.keys():
            cache.remove(key)
    times = [t for t, _ in landed]
    total = max(times)
    ordered = sorted(times)
    gb = sum(n for _, n in landed) / 1e9
    return {
        "slots": slots or "all",
        "worker_memory": memory,
        "adapters": len(names),
        "total_s": round(total, 3),
        "mb_per_s": round(sum(n for _, n in landed) / total / 1e6, 1),
        "first_s": round(ordered[0], 3),
        "p50_s": round(statistics.median(times), 3),
        "p90_s": round(ordered[int(0.9 * (len(ordered) - 1))], 3),
        # how far from the order they were asked in: 0 when each lands in its turn
        "out_of_order": sum(a > b for a, b in zip(times, times[1:], strict=False)),
        "cpu_s_per_gb": {k: round(v / gb, 3) for k, v in used.items()},
        "worker_faults_per_gb": round(faults / gb),
        # a high-water mark: the peak of this burst or of any before it
        "store_peak_rss_mb": round(peak_rss_mb(store_pid), 1),
    }


async def preload_all(address: str, names: list[str], warm: str, streams: int,
                      arena: HostArena, sizes: dict[str, int]) -> dict:  # fmt: skip
    """The service's preloader (host cache only) over every adapter of ``names``, named to it
    as the store's watch names them, ``streams`` at a time, into an empty ``arena``, which it
    leaves empty: seconds until each landed."""
    os.environ[MEMORY_ENV] = "tuned"
    cache = HostCache(arena)
    client = StoreClient(address, cache, lookup_timeout=30, fetch_timeout=600)
    preloader = Preloader(client, cache, streams=streams)
    runner = None
    try:
        await client.fetch(AdapterKey(warm, 1))  # starts the fetch worker
        cache.remove(AdapterKey(warm, 1))
        start = time.perf_counter()
        runner = asyncio.create_task(preloader.run())
        for name in names:
            preloader.on_event(AdapterEvent(True, name, 1, sizes[name]))
        while preloader.preloaded + preloader.failed < len(names):
            await asyncio.sleep(0.005)
        total = time.perf_counter() - start
        if preloader.failed:
            raise RuntimeError(f"{preloader.failed} preloads failed")
    finally:
        if runner is not None:
            runner.cancel()
        await client.close()
        for key in cache.keys():
            cache.remove(key)
    nbytes = sum(sizes[n] for n in names)
    return {
        "preload_streams": streams,
        "adapters": len(names),
        "total_s": round(total, 3),
        "mb_per_s": round(nbytes / total / 1e6, 1),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    from bench.bench_models import SHAPES

    ap.add_argument("--shape", choices=sorted(SHAPES), default="llama-7b")
    ap.add_argument("--adapters", type=int, default=256)
    ap.add_argument("--slots", type=int, nargs="+", default=[0, 4, 8, 16, 32, 64])
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument(
        "--worker-memory", nargs="+", choices=["tuned", "default"], default=["tuned"],
        help="the fetch worker's heap and arena writes: as the service runs it (tuned), or "
        "glibc's defaults (fetch_worker.py); each burst is run with each, side by side",
    )  # fmt: skip
    ap.add_argument(
        "--preload", type=int, nargs="+", default=[],
        help="also time the service's preloader over every adapter, with each of these "
        "numbers of preloads at once (preload.PRELOAD_STREAMS is the service's)",
    )  # fmt: skip
    ap.add_argument("--store-dir", type=Path, default=None, help="default: a temporary dir")
    ap.add_argument("--out", type=Path, default=REPO / "bench/results/fetch_burst.json")
    args = ap.parse_args()
    root = Path(tempfile.mkdtemp(prefix="fetch-burst-", dir=args.store_dir))
    port = free_port()
    store = subprocess.Popen([sys.executable, "-m", "services.adapter_store", "--port", str(port),
                              "--backend", "local", "--root", str(root / "store")],
                             cwd=REPO)  # fmt: skip
    rows = []
    try:
        address = f"127.0.0.1:{port}"
        wait_serving(address, store, 60)
        t = time.perf_counter()
        *names, warm = upload(address, SHAPES[args.shape], "S1", args.adapters + 1)
        print(f"uploaded {len(names)} adapters in {time.perf_counter() - t:.1f} s", flush=True)
        size = sum(f.stat().st_size for f in (root / "store").rglob("*") if f.is_file())
        sizes = {}  # each adapter's bytes, as the store's watch announces them
        if args.preload:
            with grpc.insecure_channel(address) as channel:
                stub = store_grpc.AdapterStoreStub(channel)
                for name in names:
                    info = stub.GetAdapter(store_pb.GetAdapterRequest(adapter_id=name))
                    sizes[name] = info.size_bytes
        # One arena for every burst, resident before the first, as the service's is (pinned
        # on CUDA, as there).
        arena = HostArena(int(size * 1.2) + (64 << 20), pin=torch.cuda.is_available())
        arena.buffer.fill_(0)
        print(f"{'slots':>5} {'memory':>7} {'total s':>8} {'MB/s':>7} {'first':>6} {'p50':>6} "
              f"{'p90':>6} {'unordered':>9} {'faults/GB':>9}  CPU s/GB: store, fetch worker, "
              "this process; store's peak RSS MB so far")  # fmt: skip
        for _ in range(args.repeats):
            for slots, memory in itertools.product(args.slots, args.worker_memory):
                r = asyncio.run(burst(address, names, warm, slots, arena, store.pid, memory))
                rows.append(r)
                cpu = r["cpu_s_per_gb"]
                print(f"{r['slots']:>5} {memory:>7} {r['total_s']:>8.2f} {r['mb_per_s']:>7.0f} "
                      f"{r['first_s']:>6.2f} {r['p50_s']:>6.2f} {r['p90_s']:>6.2f} "
                      f"{r['out_of_order']:>9} {r['worker_faults_per_gb']:>9}  "
                      f"{cpu['store']:.2f} {cpu['fetch worker']:.2f} "
                      f"{cpu['this process']:.2f}; {r['store_peak_rss_mb']:.0f}",
                      flush=True)  # fmt: skip
            for streams in args.preload:
                r = asyncio.run(preload_all(address, names, warm, streams, arena, sizes))
                rows.append(r)
                print(f"preload, {streams} at once: {r['total_s']:.2f} s, {r['mb_per_s']:.0f} "
                      "MB/s", flush=True)  # fmt: skip
    finally:
        store.terminate()
        store.wait(30)
        subprocess.run(["rm", "-rf", str(root)], check=False)
    write_result(args.out, "fetch_burst.py", {
        "benchmark": "a burst of cold adapters through StoreClient: landing by streams at once",
        "shape": args.shape, "workload": "S1",
        "machine": {"cpus": os.cpu_count(), "platform": platform.platform(),
                    "python": platform.python_version()},  # fmt: skip
        "rows": rows,
    })  # fmt: skip


if __name__ == "__main__":
    main()
