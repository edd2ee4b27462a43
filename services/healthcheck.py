"""Container health probe: exits 0 when a gRPC server at HOST:PORT reports SERVING.

python -m services.healthcheck localhost:50051 [--service NAME] [--timeout SECONDS]
    [--ca FILE [--cert FILE --key FILE]]   (a server with TLS; health needs no token)
"""

from __future__ import annotations

import argparse
import sys

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from services import tls


def check(
    address: str,
    service: str = "",
    timeout: float = 3.0,
    credentials: grpc.ChannelCredentials | None = None,
) -> bool:
    """True when the server at ``address`` answers SERVING for ``service`` within ``timeout``;
    ``credentials``: TLS (services/tls.py), None for plain TCP."""
    with tls.channel(address, credentials) as channel:
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
    parser.add_argument("--ca", help="PEM CA certificates: the server serves TLS")
    parser.add_argument("--cert", help="PEM client certificate, for a server with mutual TLS")
    parser.add_argument("--key", help="PEM private key of --cert")
    args = parser.parse_args(argv)
    credentials = None
    if args.ca is not None:
        credentials = tls.channel_credentials(args.ca, args.cert, args.key)
    return 0 if check(args.address, args.service, args.timeout, credentials) else 1


if __name__ == "__main__":
    sys.exit(main())
