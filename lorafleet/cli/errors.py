"""How the CLI reports a failed gRPC call: one line with the status, then what to do."""

from __future__ import annotations

import sys

import grpc

_UNREACHABLE = (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED)


def report_rpc_error(exc: grpc.RpcError, service: str, address: str, flag: str, env: str) -> None:
    """``lorafleet: CODE: details``; when the service seems away, where the CLI looked for it
    and how to point it elsewhere."""
    code = exc.code()
    print(f"lorafleet: {code.name}: {exc.details()}", file=sys.stderr)
    if code == grpc.StatusCode.UNAUTHENTICATED:
        print(
            "lorafleet: the service wants a token: pass --token TOKEN or set LORAFLEET_TOKEN",
            file=sys.stderr,
        )
    if code in _UNREACHABLE:
        print(
            f"lorafleet: is the {service} running at {address}? (set {flag} or {env})",
            file=sys.stderr,
        )
