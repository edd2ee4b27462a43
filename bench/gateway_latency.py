"""The HTTP gateway's added time to first token, against the gRPC API, on any machine.

The inference service (the tiny shape of bench/bench_models.py by default) and the gateway run
as their own processes, as ``python -m services.inference`` and ``python -m services.gateway``
start them; one client process sends requests at a low rate (exponential gaps), each one over
gRPC or through the gateway's streamed completions at random, with the same kind of prompt
(random token ids) and output length, so both fronts see the same engine load side by side.
TTFT is what bench/serving.py's clients measure (bench/serving_client.py): from sending the
request to the first message with tokens (gRPC) or the first chunk with text (gateway).
``--background K`` keeps K long streams running through the gateway meanwhile, so that the
measured requests meet other streams' chunks in the gateway's event loop (as at 10 requests/s
on the H200, where it carries about 2300 tokens/s).

    python bench/gateway_latency.py                       # 8 req/s for 40 s, tiny, CPU
    python bench/gateway_latency.py --background 8 --rate 4 --duration 30
    python bench/gateway_latency.py --stub                # the fronts' own cost alone

Absolute figures on a CPU only indicate; the difference between the two fronts is the point.
The engine's own time to first token varies by several milliseconds from request to request
on a CPU, so one run's difference is uncertain by about as much as the gateway adds. With
``--stub`` a stand-in inference service answers every Generate at once (its first message
without any model, the next ones 2 ms apart), so what is measured is the two fronts' own cost,
the gateway's against a gRPC client's (runs differ by about 0.1 ms on a 2-core machine).
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
import random
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

import grpc  # noqa: E402

from bench.bench_services import free_port, wait_serving  # noqa: E402
from bench.provenance import write_result  # noqa: E402
from bench.serving_client import HttpClient, grpc_completion  # noqa: E402
from lorafleet.v1 import inference_pb2 as pb  # noqa: E402
from lorafleet.v1 import inference_pb2_grpc as pb_grpc  # noqa: E402

log = logging.getLogger("bench.gateway_latency")

FRONTS = ("grpc", "gateway")


def pct(values: list[float], q: float) -> float | None:
    if not values:
        return None
    values = sorted(values)
    return values[min(len(values) - 1, int(q / 100 * len(values)))]


async def measure(args, grpc_address: str, http_address: str, base_model: str, vocab: int):
    """The measured requests (and the background streams); per request its front, TTFT,
    tokens and status."""
    rng = random.Random(args.seed)
    channel = grpc.aio.insecure_channel(grpc_address)
    stub = pb_grpc.InferenceStub(channel)
    http = HttpClient(http_address, keep_alive=not args.new_connections)
    stop = asyncio.Event()

    def prompt() -> list[int]:
        return [rng.randrange(3, vocab) for _ in range(rng.randrange(*args.prompt_len))]

    def body(tokens: list[int], max_tokens: int) -> dict:
        return {"model": base_model, "prompt": tokens, "max_tokens": max_tokens,
                "temperature": 0, "ignore_eos": True, "stream": True,
                "stream_options": {"include_usage": True}}  # fmt: skip

    async def background() -> None:
        while not stop.is_set():
            await http.completion(body(prompt(), args.background_tokens), args.timeout_s)

    async def one(front: str, at: float) -> dict:
        tokens, out_len = prompt(), rng.randrange(*args.output_len)
        await asyncio.sleep(max(0.0, at - time.perf_counter()))
        sent = time.perf_counter()
        if front == "grpc":
            sampling = pb.SamplingParams(max_new_tokens=out_len, ignore_eos=True)
            req = pb.GenerateRequest(prompt_token_ids=tokens, sampling=sampling)
            first, _, n, status = await grpc_completion(stub, req, args.timeout_s)
        else:
            first, _, n, status = await http.completion(body(tokens, out_len), args.timeout_s)
        ttft = None if first is None else first - sent
        return {"front": front, "ttft_s": ttft, "tokens": n, "status": status}

    streams = [asyncio.ensure_future(background()) for _ in range(args.background)]
    await asyncio.sleep(2.0 if streams else 0.0)  # the background streams are running
    at, calls = time.perf_counter() + 0.5, []
    for i in range(args.warmup + int(args.rate * args.duration)):
        at += rng.expovariate(args.rate)
        calls.append((i >= args.warmup, one(rng.choice(FRONTS), at)))
    results = await asyncio.gather(*(c for _, c in calls))
    stop.set()
    await asyncio.gather(*streams)
    await http.close()
    await channel.close()
    return [r for (counted, _), r in zip(calls, results, strict=True) if counted]


def summary(results: list[dict]) -> dict:
    out = {}
    for front in FRONTS:
        mine = [r for r in results if r["front"] == front]
        ok = [r["ttft_s"] for r in mine if r["status"] == "OK" and r["ttft_s"] is not None]
        out[front] = {"requests": len(mine), "ok": len(ok), "ttft_p50_s": pct(ok, 50),
                      "ttft_p90_s": pct(ok, 90),
                      "ttft_mean_s": sum(ok) / len(ok) if ok else None}  # fmt: skip
    g, h = out["grpc"], out["gateway"]
    if g["ok"] and h["ok"]:
        out["ttft_p50_added_s"] = h["ttft_p50_s"] - g["ttft_p50_s"]
        out["ttft_mean_added_s"] = h["ttft_mean_s"] - g["ttft_mean_s"]
    return out


def table(s: dict) -> str:
    lines = [f"{'front':<8} {'requests':>8} {'ok':>4} {'p50 ms':>8} {'p90 ms':>8} {'mean ms':>8}"]
    for front in FRONTS:
        r = s[front]
        ms = [f"{1e3 * r[k]:8.2f}" if r[k] is not None else f"{'-':>8}"
              for k in ("ttft_p50_s", "ttft_p90_s", "ttft_mean_s")]  # fmt: skip
        lines.append(f"{front:<8} {r['requests']:>8} {r['ok']:>4} {' '.join(ms)}")
    if "ttft_p50_added_s" in s:
        lines.append(f"gateway adds {1e3 * s['ttft_p50_added_s']:.2f} ms to TTFT p50 "
                     f"({1e3 * s['ttft_mean_added_s']:.2f} ms to the mean)")  # fmt: skip
    return "\n".join(lines)


class _Stub(pb_grpc.InferenceServicer):
    """The inference service's Generate and GetModelInfo, answered without a model."""

    async def GetModelInfo(self, request, context):  # noqa: N802 (the gRPC method's name)
        return pb.ModelInfo(model_id="stub", context_window=1 << 20)

    async def Generate(self, request, context):  # noqa: N802
        n = request.sampling.max_new_tokens or 16
        for i in range(1, n + 1):
            last = i == n
            yield pb.GenerateResponse(
                request_id=request.request_id, token_ids=[i], text="x",
                finish_reason=pb.FINISH_REASON_LENGTH if last else pb.FINISH_REASON_UNSPECIFIED,
                usage=pb.Usage(prompt_tokens=len(request.prompt_token_ids), completion_tokens=i),
            )  # fmt: skip
            if not last:
                await asyncio.sleep(0.002)


async def serve_stub(port: int) -> None:
    from grpc_health.v1 import health, health_pb2, health_pb2_grpc

    server = grpc.aio.server()
    pb_grpc.add_InferenceServicer_to_server(_Stub(), server)
    checks = health.HealthServicer()
    checks.set("", health_pb2.HealthCheckResponse.SERVING)
    health_pb2_grpc.add_HealthServicer_to_server(checks, server)
    server.add_insecure_port(f"127.0.0.1:{port}")
    await server.start()
    await server.wait_for_termination()


def span(text: str) -> tuple[int, int]:
    low, _, high = text.partition(":")
    return int(low), int(high)


def main() -> None:
    from bench.adapter_load import machine
    from bench.bench_models import SHAPES, make_model
    from bench.serving import wait_gateway

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shape", choices=sorted(SHAPES), default="tiny")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--rate", type=float, default=8.0, help="measured requests per second")
    parser.add_argument("--duration", type=float, default=40.0, help="seconds of arrivals")
    parser.add_argument("--warmup", type=int, default=10, help="requests not counted, first")
    parser.add_argument("--prompt-len", type=span, default=(32, 33), help="LOW:HIGH tokens")
    parser.add_argument("--output-len", type=span, default=(4, 9), help="LOW:HIGH tokens")
    parser.add_argument("--background", type=int, default=0,
                        help="long streams kept running through the gateway")  # fmt: skip
    parser.add_argument("--background-tokens", type=int, default=256)
    parser.add_argument("--new-connections", action="store_true",
                        help="a new TCP connection per HTTP request (no keep-alive)")  # fmt: skip
    parser.add_argument("--stub", action="store_true",
                        help="a stand-in inference service, answering at once")  # fmt: skip
    parser.add_argument("--serve-stub", type=int, metavar="PORT", help=argparse.SUPPRESS)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--timeout-s", type=float, default=120.0)
    parser.add_argument(
        "--work-dir", type=Path, default=Path(tempfile.gettempdir()) / "lorafleet-gw-latency"
    )
    parser.add_argument(
        "--out", type=Path, default=REPO / "bench" / "results" / "gateway_latency.json"
    )
    args = parser.parse_args()
    if args.serve_stub is not None:
        asyncio.run(serve_stub(args.serve_stub))
        return
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s")

    shape = SHAPES[args.shape]
    path = os.environ.get("PYTHONPATH")
    env = {**os.environ, "PYTHONPATH": str(REPO) + (os.pathsep + path if path else "")}
    port, gateway_port = free_port(), free_port()
    address = f"127.0.0.1:{port}"
    if args.stub:
        service = [sys.executable, __file__, "--serve-stub", str(port)]
    else:
        import torch

        args.work_dir.mkdir(parents=True, exist_ok=True)
        model = make_model(args.work_dir / f"model-{args.shape}", shape, torch.device(args.device))
        service = [sys.executable, "-m", "services.inference", "--model", str(model),
                   "--port", str(port), "--device", args.device]  # fmt: skip
    procs = []
    try:
        procs.append(subprocess.Popen(service, cwd=REPO, env=env))
        wait_serving(address, procs[-1], 600)
        procs.append(subprocess.Popen([sys.executable, "-m", "services.gateway", "--port",
                                       str(gateway_port), "--inference", address],
                                      cwd=REPO, env=env))  # fmt: skip
        http_address = f"127.0.0.1:{gateway_port}"
        base_model = wait_gateway(http_address, procs[-1], 120)
        results = asyncio.run(measure(args, address, http_address, base_model, shape.vocab))
    finally:
        for p in reversed(procs):
            p.terminate()
            try:
                p.wait(timeout=30)
            except subprocess.TimeoutExpired:
                p.kill()
    s = summary(results)
    print(table(s))
    write_result(args.out, "gateway_latency.py", {
        "benchmark": "time to first token through the HTTP gateway against gRPC, side by side",
        "machine": machine(), "stub": args.stub,
        "shape": None if args.stub else args.shape, "device": None if args.stub else args.device,
        "rate": args.rate, "duration_s": args.duration, "prompt_len": args.prompt_len,
        "output_len": args.output_len, "background": args.background,
        "keep_alive": not args.new_connections, "summary": s, "requests": results,
    }, indent=2)  # fmt: skip


if __name__ == "__main__":
    main()
