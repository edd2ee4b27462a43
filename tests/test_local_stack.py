"""The local stack as a person starts it: `make run`'s supervisor, and docker-compose.yml's
services started as plain processes (no Docker engine runs here) with SeaweedFS for MinIO."""

from __future__ import annotations

import os
import re
import signal
import socket
import stat
import subprocess
import sys
import time
from pathlib import Path

import grpc
import httpx2 as httpx
import pytest
import yaml

from lorafleet.v1 import inference_pb2 as pb
from lorafleet.v1 import inference_pb2_grpc as pb_grpc
from services.inference.tiny_model import make_adapter
from tests.s3server import free_ports

REPO = Path(__file__).resolve().parents[1]
# `python` resolves to this interpreter, as it does to the image's in a container.
ENV = {
    **os.environ,
    "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ.get('PATH', '')}",
    "OMP_NUM_THREADS": "1",
    "PYTHONUNBUFFERED": "1",
}


def generate(address: str, adapter_id: str, token: str | None, prompt: str = "Once upon") -> list:
    with grpc.insecure_channel(address) as channel:
        stub = pb_grpc.InferenceStub(channel)
        request = pb.GenerateRequest(
            adapter_id=adapter_id, prompt=prompt,
            sampling=pb.SamplingParams(max_new_tokens=6, ignore_eos=True),
        )  # fmt: skip
        metadata = () if token is None else (("authorization", f"Bearer {token}"),)
        return list(stub.Generate(request, timeout=60, metadata=metadata))


def complete_over_http(base_url: str, model: str, token: str | None = None) -> dict:
    reply = httpx.post(
        f"{base_url}/v1/completions",
        json={"model": model, "prompt": "Once upon a time", "max_tokens": 6, "ignore_eos": True},
        headers={} if token is None else {"Authorization": f"Bearer {token}"},
        timeout=60,
    )
    assert reply.status_code == 200, reply.text
    return reply.json()


def test_make_run_supervisor_fails_clearly_and_leaves_nothing_running(tmp_path):
    """The gateway told to take the inference service's port cannot bind: the supervisor names
    it, stops the services it started and exits 1 (its probe meets gRPC, not HTTP, on that
    port). Once, such a clash killed the supervisor and left its children running."""
    store_port, inference_port, metrics_port = free_ports(3)
    proc = subprocess.run(
        [sys.executable, "-m", "services.local_stack", "--data", str(tmp_path / "data"),
         "--store-port", str(store_port), "--inference-port", str(inference_port),
         "--metrics-port", str(metrics_port), "--gateway-port", str(inference_port),
         "--device", "cpu"],
        cwd=REPO, env=ENV, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
        timeout=300,
    )  # fmt: skip
    assert proc.returncode == 1, proc.stdout[-3000:]
    assert "local stack failed: gateway exited with status" in proc.stdout, proc.stdout[-3000:]
    assert "stopping inference service" in proc.stdout and "stopping adapter store" in proc.stdout
    # run() returned: no child kept the output pipe open. Nothing listens on the ports any more
    # (SO_REUSEADDR: the probes' closed connections may linger in TIME_WAIT).
    for port in (store_port, inference_port):
        with socket.socket() as s:
            s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            s.bind(("127.0.0.1", port))
            s.listen()


def test_make_run_supervisor_serves_demo_adapters_and_stops_on_ctrl_c(tmp_path):
    ports = free_ports(4)  # distinct: ports taken one by one may repeat
    proc = subprocess.Popen(
        [sys.executable, "-m", "services.local_stack", "--data", str(tmp_path / "data"),
         "--store-port", str(ports[0]), "--inference-port", str(ports[1]),
         "--metrics-port", str(ports[2]), "--gateway-port", str(ports[3]), "--device", "cpu"],
        cwd=REPO, env=ENV, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
    )  # fmt: skip
    lines: list[str] = []
    try:
        deadline = time.monotonic() + 240
        while time.monotonic() < deadline:
            line = proc.stdout.readline()
            if not line:
                break
            lines.append(line)
            if "Ctrl-C stops the services" in line:
                break
        assert any("lorafleet is up" in x for x in lines), "".join(lines[-40:])
        # Authentication is on, with tokens generated once, printed, and kept private.
        auth = tmp_path / "data" / "auth"
        token = (auth / "demo.token").read_text().strip()
        for path in auth.iterdir():
            assert stat.S_IMODE(path.stat().st_mode) == 0o600, path
        assert any(token in x for x in lines)
        assert any(f"LORAFLEET_TOKEN=$(cat {auth}/demo.token)" in x for x in lines)
        for adapter in ("demo/support", "demo/poet", "demo/coder", ""):
            messages = generate(f"127.0.0.1:{ports[1]}", adapter, token)
            assert messages[-1].finish_reason == pb.FINISH_REASON_LENGTH
            assert messages[-1].usage.completion_tokens == 6
        with pytest.raises(grpc.RpcError) as refused:
            generate(f"127.0.0.1:{ports[1]}", "demo/poet", None)
        assert refused.value.code() == grpc.StatusCode.UNAUTHENTICATED
        # The gateway speaks OpenAI's API over the same services, with the same tokens.
        out = complete_over_http(f"http://127.0.0.1:{ports[3]}", "demo/poet", token)
        assert out["usage"]["completion_tokens"] == 6
        assert (tmp_path / "data" / "models" / "demo" / "config.json").is_file()
    finally:
        proc.send_signal(signal.SIGINT)
        out, _ = proc.communicate(timeout=60)
    log = "".join(lines) + out
    assert proc.returncode == 0, log[-3000:]
    assert "stopping inference service" in log and "stopping adapter store" in log
    assert "stopping gateway" in log
    # A second start reuses the model, the adapters and the store's versions.
    assert len(list((tmp_path / "data" / "adapters").iterdir())) == 3


class _ComposeLoader(yaml.SafeLoader):
    """Reads compose files, including the `!reset` tag of override files."""


_ComposeLoader.add_constructor("!reset", lambda loader, node: None)


def compose(name: str) -> dict:
    return yaml.load((REPO / name).read_text(), Loader=_ComposeLoader)["services"]


def localize(command: list[str], replacements: dict[str, str]) -> list[str]:
    """The compose command with container names, ports and paths swapped for local ones."""
    out = []
    for arg in command:
        for old, new in replacements.items():
            arg = arg.replace(old, new)
        out.append(sys.executable if arg == "python" else arg)
    return out


def test_docker_compose_services_run_as_processes_and_stream_a_generation(tmp_path, seaweed):
    services = compose("docker-compose.yml")
    cpu = compose("docker-compose.cpu.yml")
    assert set(services) >= {
        "minio", "minio-init", "auth-init", "adapter-store", "model-init", "inference",
        "gateway",
    }  # fmt: skip
    assert (
        services["inference"]["deploy"]["resources"]["reservations"]["devices"][0]["driver"]
        == "nvidia"
    )
    assert "--device" in services["inference"]["command"]
    assert cpu["inference"]["deploy"] is None  # the CPU override drops the GPU reservation

    # minio-init's bucket, made in SeaweedFS instead.
    init = " ".join(services["minio-init"]["command"])
    bucket = re.search(r"mc mb --ignore-existing local/(\S+)", init).group(1)
    seaweed.create_bucket(bucket)

    store_port, inference_port, gateway_port, metrics_port = free_ports(4)
    models, secrets = tmp_path / "models", tmp_path / "secrets"
    replacements = {
        "http://minio:9000": seaweed.endpoint,
        "adapter-store:50051": f"127.0.0.1:{store_port}",
        "inference:50052": f"127.0.0.1:{inference_port}",
        "0.0.0.0": "127.0.0.1",
        "50051": str(store_port),
        "50052": str(inference_port),
        "9400": str(metrics_port),
        "8000": str(gateway_port),
        "/models": str(models),
        "/secrets": str(secrets),
    }
    procs: list[subprocess.Popen] = []

    def start(name: str, spec: dict) -> subprocess.Popen:
        env = {**ENV, **{k: str(v) for k, v in (spec.get("environment") or {}).items()}}
        # SeaweedFS stands in for MinIO: its own credentials replace MinIO's.
        env.update({k: v for k, v in seaweed.env.items() if k.startswith("AWS_")})
        log = open(tmp_path / f"{name}.log", "wb")  # noqa: SIM115
        proc = subprocess.Popen(localize(spec["command"], replacements), cwd=REPO, env=env,
                                stdout=log, stderr=subprocess.STDOUT)  # fmt: skip
        procs.append(proc)
        return proc

    def healthy(spec: dict, proc: subprocess.Popen, name: str, timeout: float = 120) -> None:
        check = localize(
            spec["healthcheck"]["test"][1:], {**replacements, "localhost": "127.0.0.1"}
        )
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            assert proc.poll() is None, (tmp_path / f"{name}.log").read_text()[-3000:]
            if subprocess.run(check, cwd=REPO, env=ENV).returncode == 0:
                return
            time.sleep(0.5)
        raise AssertionError(f"{name} never became healthy")

    try:
        auth_init = start("auth-init", services["auth-init"])
        assert auth_init.wait(60) == 0, (tmp_path / "auth-init.log").read_text()
        admin, acme = ((secrets / f"{n}.token").read_text().strip() for n in ("admin", "acme"))
        assert acme in (tmp_path / "auth-init.log").read_text()  # printed the first time
        model_init = start("model-init", services["model-init"])
        assert model_init.wait(120) == 0, (tmp_path / "model-init.log").read_text()
        store = start("adapter-store", services["adapter-store"])
        healthy(services["adapter-store"], store, "adapter-store")
        inference = start("inference", {**services["inference"], **cpu["inference"]})
        healthy(services["inference"], inference, "inference")

        # What the README tells a person to do next: make an adapter, upload it, generate.
        adapter = make_adapter(models / "demo", tmp_path / "adapter", rank=8, seed=5)
        cli = [sys.executable, "-m", "lorafleet.cli", "adapters", "--store",
               f"127.0.0.1:{store_port}", "upload", str(adapter), "--id", "acme/support",
               "--quiet"]  # fmt: skip
        anonymous = subprocess.run(cli, cwd=REPO, env=ENV, capture_output=True, text=True)
        assert anonymous.returncode == 1 and "UNAUTHENTICATED" in anonymous.stderr
        as_acme = {**ENV, "LORAFLEET_TOKEN": acme}
        uploaded = subprocess.run(cli, cwd=REPO, env=as_acme, capture_output=True, text=True)
        assert uploaded.returncode == 0, uploaded.stderr
        assert "acme/support version 1" in uploaded.stdout
        streamed = subprocess.run(
            [sys.executable, "-m", "lorafleet.cli", "generate", "--server",
             f"127.0.0.1:{inference_port}", "--adapter", "acme/support", "--max-new-tokens",
             "5", "--ignore-eos", "--token", admin, "Hello"],
            cwd=REPO, env=ENV, capture_output=True, text=True, timeout=120,
        )  # fmt: skip
        assert streamed.returncode == 0, streamed.stderr
        assert "5 tokens, finish length" in streamed.stderr, streamed.stderr

        # The gateway, as the README shows it: the same adapter over OpenAI's API.
        gateway = start("gateway", services["gateway"])
        healthy(services["gateway"], gateway, "gateway")
        out = complete_over_http(f"http://127.0.0.1:{gateway_port}", "acme/support", acme)
        assert out["model"] == "acme/support" and out["usage"]["completion_tokens"] == 6
    finally:
        for proc in reversed(procs):
            if proc.poll() is None:
                proc.send_signal(signal.SIGTERM)
                try:
                    proc.wait(30)
                except subprocess.TimeoutExpired:
                    proc.kill()
                    pytest.fail("a service did not stop on SIGTERM within 30 s")
