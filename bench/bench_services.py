"""What the benchmarks that run the services as processes share: a free port, waiting for a
server's health, and uploading an adapter's files to the store."""

from __future__ import annotations

import socket
import subprocess
import time

from lorafleet.v1 import adapter_store_pb2 as store_pb
from lorafleet.v1 import adapter_store_pb2_grpc as store_grpc
from services.healthcheck import check
from store.synthetic import AdapterFiles

CHUNK = 4 << 20  # upload chunk bytes
UPLOAD_OPTIONS = [("grpc.max_send_message_length", 8 << 20)]  # channel options for uploads


_ISSUED: set[int] = set()


def free_port() -> int:
    """A port free now that this process has not handed out before: ports taken one after
    another, each socket closed in between, may repeat before the first is bound."""
    while True:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        if port not in _ISSUED:
            _ISSUED.add(port)
            return port


def wait_serving(address: str, proc: subprocess.Popen, timeout: float) -> None:
    """Until the server at ``address`` reports SERVING; fails if ``proc`` exits or time runs
    out."""
    deadline = time.monotonic() + timeout
    while not check(address, timeout=2.0):
        if proc.poll() is not None:
            raise RuntimeError(f"the process serving {address} exited with {proc.returncode}")
        if time.monotonic() > deadline:
            raise TimeoutError(f"{address} was not SERVING after {timeout:.0f} s")
        time.sleep(0.5)


def upload_adapter(
    stub: store_grpc.AdapterStoreStub,
    adapter_id: str,
    files: AdapterFiles,
    metadata: tuple = (),
    timeout: float = 300.0,
) -> store_pb.AdapterInfo:
    """One UploadAdapter call: the header, then the weights in CHUNK-byte chunks."""

    def requests():
        header = store_pb.UploadAdapterHeader(
            adapter_id=adapter_id, adapter_config_json=files.config_json.decode()
        )
        yield store_pb.UploadAdapterRequest(header=header)
        body = files.safetensors
        for i in range(0, len(body), CHUNK):
            yield store_pb.UploadAdapterRequest(chunk=body[i : i + CHUNK])

    return stub.UploadAdapter(requests(), timeout=timeout, metadata=metadata)
