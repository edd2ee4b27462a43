"""Container health probe: exits 0 when a gRPC server at HOST:PORT reports SERVING.

python -m services.healthcheck localhost:50051 [--service NAME] [--timeout SECONDS]
"""

from __future__ import annotations

import argparse
import sys

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc


def check(address: str, service: str = "", timeout: float = 3.0) -> bool:
    """True when the server at ``address`` answers SERVING for ``service`` within ``timeout``."""
    with grpc.insecure_channel(address) as channel:
        stub = health_pb2_grpc.HealthStub(channel)
        try:
            reply = stub.Check(health_pb2.HealthCheckRequest(service=service), timeout=timeout)
        except grpc.RpcError:
            return False
    return reply.status == health_pb2.HealthCheckResponse.SERVING


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("address", help="HOST:PORT of the gRPC server")
    parser.add_argument("--service", default="", help="service name ('' = the whole server)")
    parser.add_argument("--timeout", type=float, default=3.0, help="seconds to wait for a reply")
    args = parser.parse_args(argv)
    return 0 if check(args.address, args.service, args.timeout) else 1


if __name__ == "__main__":
    sys.exit(main())
