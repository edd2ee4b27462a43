"""The gateway as a process over the real services, and small HTTP helpers for its tests."""

from __future__ import annotations

from pathlib import Path

import httpx2 as httpx

from tests.services.inference.stack import Proc, free_port, wait_for


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
    last = ["no answer"]

    def answers() -> bool:
        if proc.popen.poll() is not None:
            raise RuntimeError(f"{proc.name} exited:\n{proc.log()[-3000:]}")
        try:
            reply = httpx.get(url(proc, path), timeout=2.0)
        except httpx.TransportError:
            return False
        last[0] = reply.text
        return reply.status_code == 200

    try:
        wait_for(answers, timeout, every=0.1, what=f"{proc.name} {path} answering 200")
    except TimeoutError as exc:
        raise TimeoutError(f"{exc}: {last[0]}\n{proc.log()[-3000:]}") from None
    return proc
