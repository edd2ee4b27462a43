"""`lorafleet stats [--json]`: the inference service's queue, page pool, throughput, adapter
load latencies and the adapters it holds."""

from __future__ import annotations

import argparse
import json
import sys

import grpc

from lorafleet.cli import connect
from lorafleet.cli.generate import inference_address_argument, report_rpc_error

_RESIDENCY = {1: "gpu", 2: "host", 3: "loading"}


def _ms(seconds: float) -> str:
    return f"{seconds * 1000:.1f} ms"


def _latency_line(name: str, s) -> str:
    if not s.count:
        return f"  {name:9} none yet"
    return (
        f"  {name:9} {s.count} loads, mean {_ms(s.mean_seconds)}, p50 {_ms(s.p50_seconds)}, "
        f"p99 {_ms(s.p99_seconds)}, max {_ms(s.max_seconds)}"
    )


def memory_line(m) -> str | None:
    """GetStats' device_memory as one line, or None on the CPU (all zeros)."""
    if not m.total_bytes:
        return None
    gib = 2**30
    return (
        f"memory    {m.free_bytes / gib:.1f} of {m.total_bytes / gib:.1f} GiB free on the "
        f"device, the engine's allocator at most {m.peak_reserved_bytes / gib:.1f} GiB"
    )


def cmd_stats(args: argparse.Namespace) -> int:
    from google.protobuf.json_format import MessageToDict

    from lorafleet.v1 import inference_pb2 as pb
    from lorafleet.v1 import inference_pb2_grpc as pb_grpc

    try:
        with connect.channel(args.server, args) as channel:
            stub = pb_grpc.InferenceStub(channel)
            md = connect.metadata(args)
            stats = stub.GetStats(pb.GetStatsRequest(), timeout=args.timeout, metadata=md)
            adapters = stub.ListAdapters(
                pb.ListResidentAdaptersRequest(), timeout=args.timeout, metadata=md
            )
    except grpc.RpcError as exc:
        report_rpc_error(exc, args.server)
        return 1
    except connect.ConnectFlagError as exc:
        print(f"lorafleet: {exc}", file=sys.stderr)
        return 1
    if args.json:
        out = {
            "stats": MessageToDict(stats, always_print_fields_with_no_presence=True),
            "adapters": MessageToDict(adapters, always_print_fields_with_no_presence=True).get(
                "adapters", []
            ),
        }
        print(json.dumps(out, indent=2))
        return 0
    p, h = stats.pool, stats.host_cache
    print(f"model     {stats.model} on {stats.device}")
    print(
        f"requests  {stats.running_requests} running, {stats.queued_requests} queued, "
        f"{stats.waiting_for_adapter} waiting for an adapter"
    )
    print(f"tokens    {stats.tokens_per_second:.1f}/s now, {stats.generated_tokens} in total")
    print(
        f"pool      {p.total_pages} pages of {p.page_size} slots: {p.kv_pages} KV, "
        f"{p.adapter_pages} adapters, {p.free_pages} free"
    )
    print(
        f"host      {h.used_bytes / 2**20:.1f} of {h.capacity_bytes / 2**20:.0f} MiB, "
        f"{h.entries} adapters{' (pinned memory)' if h.pinned_memory else ''}"
    )
    memory = memory_line(stats.device_memory)
    if memory is not None:
        print(memory)
    print(
        f"evictions {stats.adapter_evictions_gpu} from the pool "
        f"({stats.adapter_evictions_gpu_queued} wanted by queued requests), "
        f"{stats.adapter_evictions_host} from the host cache"
    )
    print("adapter loads")
    print(_latency_line("fetch", stats.adapter_fetch))
    print(_latency_line("copy", stats.adapter_copy))
    print(_latency_line("cold ttft", stats.adapter_load))
    if adapters.adapters:
        print(f"\n{'ADAPTER':40} {'VER':>4} {'WHERE':8} {'ACTIVE':>6}  FLAGS")
        for a in adapters.adapters:
            flags = ",".join(f for f, on in (("pinned", a.pinned), ("retired", a.retired)) if on)
            where = _RESIDENCY.get(a.residency, "?")
            print(f"{a.adapter_id:40} {a.version:>4} {where:8} {a.active_requests:>6}  {flags}")
    return 0


def register(commands: argparse._SubParsersAction) -> None:
    parser = commands.add_parser(
        "stats",
        help="the inference service's load, page pool and resident adapters",
        description="Show the inference service's queue, page pool, throughput, adapter load "
        "latencies and the adapters it holds (gpu, host or loading).",
    )
    inference_address_argument(parser)
    parser.add_argument("--json", action="store_true", help="machine-readable output")
    parser.add_argument("--timeout", type=float, default=10.0, help="seconds per call")
    parser.set_defaults(handler=cmd_stats)
