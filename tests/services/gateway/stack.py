"""The gateway as a process over the real services, and small HTTP helpers for its tests."""

from __future__ import annotations

import time
from pathlib import Path

import httpx2 as httpx

from tests.services.inference.stack import Proc, free_port


def gateway_proc(inference: str, store: str | None, log_dir: Path, *flags: str) -> Proc:
    port = free_port()
    args = ["services.gateway", "--host", "127.0.0.1", "--port", str(port)]
    args += ["--inference", inference]
    if store is not None:
        args += ["--adapter-store", store]
    return Proc("gateway", [*args, *flags], log_dir / f"gateway-{port}.log", port)


def url(proc: Proc, path: str = "") -> str:
    return f"http://127.0.0.1:{proc.port}{path}"


def wait_http(proc: Proc, path: str = "/health", timeout: float = 60.0) -> Proc:
    """Until ``path`` answers 200 (the gateway is up and its inference service SERVING)."""
    deadline = time.monotonic() + timeout
    last = None
    while time.monotonic() < deadline:
        if proc.popen.poll() is not None:
            raise RuntimeError(f"{proc.name} exited:\n{proc.log()[-3000:]}")
        try:
            last = httpx.get(url(proc, path), timeout=2.0)
            if last.status_code == 200:
                return proc
        except httpx.TransportError:
            pass
        time.sleep(0.1)
    body = last.text if last is not None else "no answer"
    raise TimeoutError(
        f"{proc.name} {path} not 200 after {timeout} s: {body}\n{proc.log()[-3000:]}"
    )
