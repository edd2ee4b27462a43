"""Runs the real adapter store (`python -m services.adapter_store`) in a subprocess and talks
to it over gRPC; inspects its storage directly to prove that nothing leaked."""

from __future__ import annotations

import hashlib
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from lorafleet.v1 import adapter_store_pb2 as pb
from lorafleet.v1 import adapter_store_pb2_grpc as pb_grpc
from store.base_model import BaseModelShape
from store.synthetic import AdapterFiles
from tests.s3server import SeaweedServer, free_ports

REPO = Path(__file__).resolve().parents[3]
BASE = BaseModelShape(
    num_layers=2,
    hidden_size=64,
    intermediate_size=96,
    num_heads=4,
    num_kv_heads=2,
    head_dim=16,
    vocab_size=128,
)
HF_CONFIG = {
    "num_hidden_layers": BASE.num_layers,
    "hidden_size": BASE.hidden_size,
    "intermediate_size": BASE.intermediate_size,
    "num_attention_heads": BASE.num_heads,
    "num_key_value_heads": BASE.num_kv_heads,
    "head_dim": BASE.head_dim,
    "vocab_size": BASE.vocab_size,
}


def upload_requests(
    adapter_id: str,
    files: AdapterFiles,
    chunk_bytes: int = 64 << 10,
    sha256: str | None = None,
    **header,
) -> Iterator[pb.UploadAdapterRequest]:
    body = files.safetensors
    digest = hashlib.sha256(body).hexdigest() if sha256 is None else sha256
    yield pb.UploadAdapterRequest(
        header=pb.UploadAdapterHeader(
            adapter_id=adapter_id,
            adapter_config_json=files.config_json.decode(),
            sha256=digest,
            **header,
        )
    )
    for offset in range(0, len(body), chunk_bytes):
        yield pb.UploadAdapterRequest(chunk=body[offset : offset + chunk_bytes])


class StoreProcess:
    """One adapter-store process on a free port, with either backend."""

    def __init__(
        self,
        workdir: Path,
        backend: str,
        seaweed: SeaweedServer | None = None,
        bucket: str | None = None,
        extra_args: tuple[str, ...] = (),
        root: Path | None = None,
        python_args: tuple[str, ...] = ("-m", "services.adapter_store"),
        credentials: grpc.ChannelCredentials | None = None,  # the store serves TLS
    ) -> None:
        """``root``: the local backend's directory (default: under ``workdir``);
        ``python_args``: what the interpreter runs, before the store's flags."""
        self.python_args = python_args
        self.backend = backend
        self.workdir = Path(workdir)
        self.workdir.mkdir(parents=True, exist_ok=True)
        self.root = self.workdir / "root" if root is None else Path(root)
        self.seaweed = seaweed
        self.bucket = bucket
        (self.port,) = free_ports(1)
        self.address = f"127.0.0.1:{self.port}"
        args = ["--host", "127.0.0.1", "--port", str(self.port), "--log-level", "INFO"]
        if backend == "local":
            args += ["--backend", "local", "--root", str(self.root)]
            self.env = dict(os.environ)
        else:
            args += ["--backend", "s3", "--s3-endpoint", seaweed.endpoint, "--s3-bucket", bucket]
            self.env = seaweed.env
        self.args = [*args, *extra_args]
        self.credentials = credentials
        self.process: subprocess.Popen | None = None
        self.channel: grpc.Channel | None = None

    def start(self, timeout_s: float = 30.0) -> StoreProcess:
        self.log_path = self.workdir / "store.log"
        self._log = open(self.log_path, "ab")
        self.process = subprocess.Popen(
            [sys.executable, *self.python_args, *self.args],
            cwd=REPO,
            env=self.env,
            stdout=self._log,
            stderr=subprocess.STDOUT,
        )
        self.channel = (
            grpc.insecure_channel(self.address)
            if self.credentials is None
            else grpc.secure_channel(self.address, self.credentials)
        )
        self.stub = pb_grpc.AdapterStoreStub(self.channel)
        self.health = health_pb2_grpc.HealthStub(self.channel)
        deadline = time.monotonic() + timeout_s
        while True:
            if self.process.poll() is not None:
                raise RuntimeError(f"adapter store exited early:\n{self.log()}")
            try:
                reply = self.health.Check(health_pb2.HealthCheckRequest(), timeout=1)
                if reply.status == health_pb2.HealthCheckResponse.SERVING:
                    return self
            except grpc.RpcError:
                pass
            if time.monotonic() > deadline:
                self.process.kill()
                raise RuntimeError(f"adapter store did not get ready:\n{self.log()}")
            time.sleep(0.1)

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    def stop(self, timeout_s: float = 20.0) -> int:
        """SIGTERM, then the exit status."""
        if self.channel is not None:
            self.channel.close()
        if self.process is None:
            return 0
        self.process.send_signal(signal.SIGTERM)
        try:
            code = self.process.wait(timeout_s)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait()
            raise
        finally:
            self._log.close()
        self.process = None
        return code

    # -- what is in the storage, read directly --------------------------------------------

    def pending_uploads(self) -> list[str]:
        if self.backend == "local":
            keys = []
            for path in (self.root / ".uploads").glob("*.key"):
                try:  # the store may abort (delete) the upload between the listing and the read
                    keys.append(path.read_text())
                except FileNotFoundError:
                    continue
            return sorted(keys)
        response = self.seaweed.client().list_multipart_uploads(Bucket=self.bucket)
        return sorted(u["Key"] for u in response.get("Uploads", []) or [])

    def object_keys(self, prefix: str = "") -> list[str]:
        if self.backend == "local":
            top = self.root / "objects"
            return sorted(
                p.relative_to(top).as_posix()
                for p in top.rglob("*")
                if p.is_file() and p.relative_to(top).as_posix().startswith(prefix)
            )
        client = self.seaweed.client()
        pages = client.get_paginator("list_objects_v2").paginate(Bucket=self.bucket, Prefix=prefix)
        return sorted(o["Key"] for page in pages for o in page.get("Contents", []))

    def write_object(self, key: str, data: bytes) -> None:
        if self.backend == "local":
            (self.root / "objects" / key).write_bytes(data)
        else:
            self.seaweed.client().put_object(Bucket=self.bucket, Key=key, Body=data)

    def blob_keys(self, adapter_id: str) -> list[str]:
        return self.object_keys(f"blobs/{adapter_id}/")
