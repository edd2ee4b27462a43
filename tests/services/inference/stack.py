"""Real processes for the inference service tests: the adapter store and the inference service
started as `python -m ...` on free loopback ports, plus small gRPC client helpers."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from bench.bench_services import free_port
from lorafleet.v1 import adapter_store_pb2 as store_pb
from lorafleet.v1 import adapter_store_pb2_grpc as store_grpc
from lorafleet.v1 import inference_pb2 as pb
from lorafleet.v1 import inference_pb2_grpc as pb_grpc

REPO = Path(__file__).resolve().parents[3]
CHUNK = 64 * 1024


def rss_bytes(pid: int) -> int:
    """The resident memory of process ``pid`` (Linux), 0 once it is gone."""
    try:
        status = Path(f"/proc/{pid}/status").read_text()
    except FileNotFoundError:
        return 0
    for line in status.splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    return 0


@dataclass
class Proc:
    """A service process with its log file; stop() is idempotent."""

    name: str
    args: list[str]
    log_path: Path
    port: int
    env: dict[str, str] = field(default_factory=dict)
    popen: subprocess.Popen | None = None
    credentials: grpc.ChannelCredentials | None = None  # set when the process serves TLS
    new_session: bool = False  # a process group of its own, with its children (signal_group)

    def channel(self) -> grpc.Channel:
        if self.credentials is None:
            return grpc.insecure_channel(self.address)
        return grpc.secure_channel(self.address, self.credentials)

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.port}"

    def start(self) -> Proc:
        # One intra-op thread: the tiny models' matmuls gain nothing from more, and on a busy
        # machine threads that wait for each other make every step many times slower.
        env = {**os.environ, "LORAFLEET_LOG_LEVEL": "INFO", "OMP_NUM_THREADS": "1", **self.env}
        log = open(self.log_path, "ab")  # noqa: SIM115 (kept open for the process' lifetime)
        self.popen = subprocess.Popen(
            [sys.executable, "-m", *self.args], cwd=REPO, env=env, stdout=log, stderr=log,
            start_new_session=self.new_session,
        )  # fmt: skip
        log.close()
        return self

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    def send(self, sig: int) -> None:
        if self.popen is not None and self.popen.poll() is None:
            self.popen.send_signal(sig)

    def signal_group(self, sig: int) -> None:
        """``sig`` to every process of its group, as a supervisor or a terminal sends it
        (new_session only: the group is this process's and its children's)."""
        assert self.new_session, "signal_group needs a process started with new_session"
        if self.popen is not None and self.popen.poll() is None:
            os.killpg(self.popen.pid, sig)

    def stop(self, sig: int = signal.SIGTERM, timeout: float = 20.0) -> int | None:
        if self.popen is None:
            return None
        if self.popen.poll() is None:
            self.popen.send_signal(sig)
            try:
                self.popen.wait(timeout)
            except subprocess.TimeoutExpired:
                self.popen.kill()
                self.popen.wait()
        return self.popen.returncode

    def wait_serving(self, timeout: float = 60.0) -> Proc:
        deadline = time.monotonic() + timeout
        with self.channel() as channel:
            stub = health_pb2_grpc.HealthStub(channel)
            while time.monotonic() < deadline:
                if self.popen.poll() is not None:
                    raise RuntimeError(f"{self.name} exited:\n{self.log()[-3000:]}")
                try:
                    reply = stub.Check(health_pb2.HealthCheckRequest(), timeout=1.0)
                    if reply.status == health_pb2.HealthCheckResponse.SERVING:
                        return self
                except grpc.RpcError:
                    pass
                time.sleep(0.1)
        raise TimeoutError(f"{self.name} not SERVING after {timeout} s:\n{self.log()[-3000:]}")


def store_proc(root: Path, log_dir: Path, port: int | None = None, extra=()) -> Proc:
    port = port or free_port()
    args = ["services.adapter_store", "--host", "127.0.0.1", "--port", str(port)]
    if not extra:
        args += ["--backend", "local", "--root", str(root)]
    return Proc("adapter store", [*args, *extra], log_dir / f"store-{port}.log", port)


def inference_proc(model: Path, store: str | None, log_dir: Path, *flags: str) -> Proc:
    port = free_port()
    args = ["services.inference", "--host", "127.0.0.1", "--port", str(port)]
    args += ["--model", str(model), "--device", "cpu", "--host-cache-mb", "64"]
    if store is not None:
        args += ["--adapter-store", store]
    return Proc("inference", [*args, *flags], log_dir / f"inference-{port}.log", port)


def upload(address: str, adapter_id: str, adapter_dir: Path) -> store_pb.AdapterInfo:
    """Uploads a PEFT adapter directory through the store's UploadAdapter."""
    config = (adapter_dir / "adapter_config.json").read_text()
    body = (adapter_dir / "adapter_model.safetensors").read_bytes()

    def messages():
        header = store_pb.UploadAdapterHeader(adapter_id=adapter_id, adapter_config_json=config)
        yield store_pb.UploadAdapterRequest(header=header)
        for i in range(0, len(body), CHUNK):
            yield store_pb.UploadAdapterRequest(chunk=body[i : i + CHUNK])

    with grpc.insecure_channel(address) as channel:
        return store_grpc.AdapterStoreStub(channel).UploadAdapter(messages(), timeout=30)


@dataclass
class Stream:
    """What one Generate call returned."""

    messages: list[pb.GenerateResponse] = field(default_factory=list)
    code: grpc.StatusCode = grpc.StatusCode.OK
    details: str = ""

    @property
    def token_ids(self) -> list[int]:
        return [t for m in self.messages for t in m.token_ids]

    @property
    def text(self) -> str:
        return "".join(m.text for m in self.messages)

    @property
    def last(self) -> pb.GenerateResponse:
        return self.messages[-1]


def sampling(**kwargs) -> pb.SamplingParams:
    return pb.SamplingParams(**kwargs)


def inference_stub(channel: grpc.Channel) -> pb_grpc.InferenceStub:
    return pb_grpc.InferenceStub(channel)


def collect(stub: pb_grpc.InferenceStub, request: pb.GenerateRequest, timeout=60.0) -> Stream:
    out = Stream()
    try:
        for msg in stub.Generate(request, timeout=timeout):
            out.messages.append(msg)
    except grpc.RpcError as exc:
        out.code, out.details = exc.code(), exc.details()
    return out


def wait_for(predicate, timeout: float = 15.0, every: float = 0.05, what: str = "condition"):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(every)
    raise TimeoutError(f"{what} not reached within {timeout} s")
