"""TLS for both services and their clients: credentials from PEM files, and where a server
binds without protection.

A server given ``--tls-cert`` and ``--tls-key`` serves TLS only; with ``--tls-client-ca`` as well
it requires every client to present a certificate signed by that CA (mutual TLS). Health checks
then need TLS too (``python -m services.healthcheck --ca``).
"""

from __future__ import annotations

import ipaddress
import logging
from pathlib import Path

import grpc

log = logging.getLogger(__name__)


def _read(path: Path | None) -> bytes | None:
    return None if path is None else Path(path).read_bytes()


def server_credentials(
    cert: Path, key: Path, client_ca: Path | None = None
) -> grpc.ServerCredentials:
    return grpc.ssl_server_credentials(
        [(_read(key), _read(cert))],
        root_certificates=_read(client_ca),
        require_client_auth=client_ca is not None,
    )


def channel_credentials(
    ca: Path | None = None, cert: Path | None = None, key: Path | None = None
) -> grpc.ChannelCredentials:
    """Trusts ``ca`` (None: the system's roots); presents ``cert`` for mutual TLS."""
    return grpc.ssl_channel_credentials(
        root_certificates=_read(ca), private_key=_read(key), certificate_chain=_read(cert)
    )


def channel(target: str, credentials: grpc.ChannelCredentials | None, options=None, api=grpc):
    """A channel to ``target``: TLS with ``credentials``, plain TCP without; ``api``: grpc, or
    grpc.aio for an asyncio channel."""
    if credentials is None:
        return api.insecure_channel(target, options=options)
    return api.secure_channel(target, credentials, options=options)


def bind(server, address: str, credentials: grpc.ServerCredentials | None) -> int:
    """Add the listening port (secure when ``credentials``); the port bound, 0 on failure."""
    if credentials is None:
        return server.add_insecure_port(address)
    return server.add_secure_port(address, credentials)


def is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False


def warn_if_exposed(
    name: str, host: str, authenticated: bool, tls: bool, anyone_may: str, in_clear: str
) -> None:
    """A server reachable beyond this machine should not run without tokens or TLS; the
    warnings say what ``anyone_may`` do without tokens, and what crosses ``in_clear`` without
    TLS besides the tokens."""
    if is_loopback(host):
        return
    if not authenticated:
        log.warning(
            "%s listens on %s without authentication: anyone who reaches it may %s; pass "
            "--auth-tokens FILE",
            name, host, anyone_may,
        )  # fmt: skip
    if not tls:
        log.warning(
            "%s listens on %s without TLS: tokens and %s cross the network in clear; pass "
            "--tls-cert and --tls-key",
            name, host, in_clear,
        )  # fmt: skip
