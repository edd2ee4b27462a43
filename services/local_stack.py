"""`make run`: the local stack on embedded defaults, with no Docker.

Generates the demo model and three demo adapters under ``data/`` when they are missing, starts the
adapter store (local backend under ``data/store``), the inference service (GPU when there is
one, else the CPU) and the HTTP gateway, uploads the demo adapters that the store does not hold
yet, prints how to call the stack, and stops the services cleanly on Ctrl-C or SIGTERM.

Authentication is on: the first start generates tokens under ``data/auth`` (services/tokens.py:
an admin token, the inference service's own, and one for tenant ``demo``, whose namespace holds
the demo adapters), prints them once, and keeps each in a file of mode 0600.

    python -m services.local_stack [--data DIR] [--store-port P] [--inference-port P]
        [--gateway-port P] ...
"""

from __future__ import annotations

import argparse
import http.client
import logging
import signal
import subprocess
import sys
import threading
import time
import urllib.request
from collections.abc import Callable
from pathlib import Path
from typing import NamedTuple

import grpc

from lorafleet.cli.adapters import upload_requests
from lorafleet.v1 import adapter_store_pb2 as pb
from lorafleet.v1 import adapter_store_pb2_grpc as pb_grpc
from services import tokens
from services.auth import bearer_metadata
from services.healthcheck import check

log = logging.getLogger("lorafleet.local_stack")


DEMO_TENANT = "demo"  # the tenant whose namespace holds the demo adapters


class DemoAdapter(NamedTuple):
    adapter_id: str
    rank: int
    targets: tuple[str, ...]
    seed: int


DEMO_ADAPTERS = (
    DemoAdapter("demo/support", 8, ("q_proj", "v_proj"), 1),
    DemoAdapter("demo/poet", 16, ("q_proj", "k_proj", "v_proj", "o_proj"), 2),
    DemoAdapter(
        "demo/coder",
        32,
        ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"),
        3,
    ),
)


def prepare_demo(data: Path) -> tuple[Path, list[tuple[DemoAdapter, Path]]]:
    """The demo model and adapters under ``data``, generated once and reused afterwards."""
    from services.inference.tiny_model import make_adapter, make_model

    model_dir = data / "models" / "demo"
    if not (model_dir / "config.json").is_file():
        log.info("generating the demo model in %s", model_dir)
        make_model(model_dir, preset="demo", seed=0)
    adapters = []
    for spec in DEMO_ADAPTERS:
        out = data / "adapters" / spec.adapter_id.replace("/", "-")
        if not (out / "adapter_model.safetensors").is_file():
            log.info("generating demo adapter %s in %s", spec.adapter_id, out)
            make_adapter(
                model_dir, out, rank=spec.rank, lora_alpha=2 * spec.rank,
                target_modules=spec.targets, seed=spec.seed,
            )  # fmt: skip
        adapters.append((spec, out))
    return model_dir, adapters


def _wait(name: str, proc: subprocess.Popen, probe: Callable[[], bool], timeout_s: float) -> None:
    """Block until ``probe()`` is true; fail if the process dies or time runs out."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"{name} exited with status {proc.returncode} before serving")
        if probe():
            return
        time.sleep(0.3)
    raise RuntimeError(f"{name} was not ready within {timeout_s:.0f} s")


def _answers_200(url: str) -> bool:
    try:
        with urllib.request.urlopen(url, timeout=2.0) as reply:
            return reply.status == 200
    except (OSError, http.client.HTTPException):  # not up yet, or not HTTP on that port
        return False


def prepare_tokens(directory: Path) -> None:
    """The stack's tokens, generated and printed on the first start only."""
    issued = tokens.init(directory, [DEMO_TENANT])
    if issued:
        print(f"\nGenerated tokens (shown only now; kept in {directory}, mode 0600):")
        for item in issued:
            print(f"  {item.name:8} {item.token}")
        print(flush=True)


def upload_missing(
    store_address: str, adapters: list[tuple[DemoAdapter, Path]], token: str
) -> None:
    metadata = bearer_metadata(token)
    with grpc.insecure_channel(store_address) as channel:
        stub = pb_grpc.AdapterStoreStub(channel)
        for spec, directory in adapters:
            try:
                request = pb.GetAdapterRequest(adapter_id=spec.adapter_id)
                info = stub.GetAdapter(request, timeout=10, metadata=metadata)
                log.info("%s version %d is already in the store", spec.adapter_id, info.version)
                continue
            except grpc.RpcError as exc:
                if exc.code() != grpc.StatusCode.NOT_FOUND:
                    raise
            info = stub.UploadAdapter(
                upload_requests(spec.adapter_id, directory), timeout=60, metadata=metadata
            )
            log.info("uploaded %s as version %d", spec.adapter_id, info.version)


def stop(procs: list[tuple[str, subprocess.Popen]], grace_s: float = 15.0) -> int:
    """SIGTERM every child, newest first, then SIGKILL what is still alive after the grace."""
    status = 0
    for name, proc in reversed(procs):
        if proc.poll() is None:
            log.info("stopping %s", name)
            proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout=grace_s)
        except subprocess.TimeoutExpired:
            log.warning("%s did not stop within %.0f s: killing it", name, grace_s)
            proc.kill()
            proc.wait()
        if proc.returncode not in (0, -signal.SIGTERM):
            status = 1
    return status


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--data", type=Path, default=Path("data"), help="state directory")
    parser.add_argument("--host", default="127.0.0.1", help="address the services bind")
    parser.add_argument("--store-port", type=int, default=50051)
    parser.add_argument("--inference-port", type=int, default=50052)
    parser.add_argument("--gateway-port", type=int, default=8000, help="HTTP (OpenAI API)")
    parser.add_argument("--metrics-port", type=int, default=9400)
    parser.add_argument("--device", choices=("auto", "cpu", "cuda"), default="auto")
    parser.add_argument("--ready-timeout", type=float, default=300.0, help="seconds per service")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")

    stop_requested = threading.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: stop_requested.set())

    model_dir, adapters = prepare_demo(args.data)
    auth = args.data / "auth"
    prepare_tokens(auth)
    store_address = f"{args.host}:{args.store_port}"
    inference_address = f"{args.host}:{args.inference_port}"
    # Children get their own process group: Ctrl-C reaches only this supervisor, which then
    # stops them newest first (the gateway, then inference, so streams end before the store goes).
    spawn = {"start_new_session": True}
    procs: list[tuple[str, subprocess.Popen]] = []
    try:
        store = subprocess.Popen(
            [sys.executable, "-m", "services.adapter_store", "--host", args.host,
             "--port", str(args.store_port), "--backend", "local",
             "--root", str(args.data / "store"), "--auth-tokens", str(auth / tokens.TOKENS_FILE)],
            **spawn,
        )  # fmt: skip
        procs.append(("adapter store", store))
        _wait("adapter store", store, lambda: check(store_address, timeout=1.0), args.ready_timeout)
        upload_missing(store_address, adapters, (auth / "admin.token").read_text().strip())
        inference = subprocess.Popen(
            [sys.executable, "-m", "services.inference", "--host", args.host,
             "--port", str(args.inference_port), "--model", str(model_dir),
             "--adapter-store", store_address, "--device", args.device,
             "--metrics-port", str(args.metrics_port),
             "--auth-tokens", str(auth / tokens.TOKENS_FILE),
             "--adapter-store-token-file", str(auth / "service.token")],
            **spawn,
        )  # fmt: skip
        procs.append(("inference service", inference))
        _wait(
            "inference service",
            inference,
            lambda: check(inference_address, timeout=1.0),
            args.ready_timeout,
        )
        gateway = subprocess.Popen(
            [sys.executable, "-m", "services.gateway", "--host", args.host,
             "--port", str(args.gateway_port), "--inference", inference_address,
             "--adapter-store", store_address],
            **spawn,
        )  # fmt: skip
        procs.append(("gateway", gateway))
        gateway_url = f"http://{args.host}:{args.gateway_port}"
        _wait("gateway", gateway, lambda: _answers_200(gateway_url + "/health"), args.ready_timeout)
        ids = ", ".join(spec.adapter_id for spec, _ in adapters)
        print(
            f"\nlorafleet is up.\n"
            f"  inference  {inference_address}   (metrics http://{args.host}:{args.metrics_port})\n"
            f"  store      {store_address}   (adapters: {ids})\n"
            f"  gateway    {gateway_url}   (OpenAI API, REST adapter registry)\n\n"
            f"  tokens     {auth}/: {DEMO_TENANT}.token (tenant {DEMO_TENANT}, adapters "
            f"{DEMO_TENANT}/...), admin.token (everything), service.token (the inference "
            f"service's)\n\n"
            f"Try:\n"
            f"  export LORAFLEET_TOKEN=$(cat {auth}/{DEMO_TENANT}.token)\n"
            f"  .venv/bin/lorafleet generate --server {inference_address} "
            f'--adapter demo/poet "Once upon a time"\n'
            f"  .venv/bin/lorafleet adapters --store {store_address} list\n"
            f"  .venv/bin/lorafleet stats --server {inference_address}\n"
            f'  curl {gateway_url}/v1/completions -H "Authorization: Bearer $LORAFLEET_TOKEN" '
            f"-H 'Content-Type: application/json' "
            f"""-d '{{"model": "demo/poet", "prompt": "Once upon a time", "max_tokens": 16}}'\n\n"""
            f"Ctrl-C stops the services.\n",
            flush=True,
        )
        while not stop_requested.wait(0.5):
            for name, proc in procs:
                if proc.poll() is not None:
                    log.error("%s exited with status %d", name, proc.returncode)
                    stop_requested.set()
        return stop(procs)
    except (RuntimeError, grpc.RpcError) as exc:
        log.error("local stack failed: %s", exc)
        stop(procs)
        return 1
    except BaseException:  # anything else: no child outlives the supervisor
        stop(procs)
        raise


if __name__ == "__main__":
    sys.exit(main())
