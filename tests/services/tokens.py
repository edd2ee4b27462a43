"""Token files for the tenancy tests: tenants acme, beta and gamma, an admin and the service
credential, written as the services read them (sha256 digests only); and code_of, the status a
call ends with."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import grpc

from services.auth import bearer_metadata, token_digest
from services.tokens import write_private


@dataclass(frozen=True)
class Tokens:
    path: Path  # the token file (--auth-tokens)
    acme: str
    beta: str
    gamma: str
    admin: str
    service: str
    service_file: Path  # the service token alone (--adapter-store-token-file)

    def md(self, who: str) -> tuple[tuple[str, str], ...]:
        """The call metadata of ``who`` (acme, beta, gamma, admin, service)."""
        return bearer_metadata(getattr(self, who))


def entries(tokens: Tokens) -> list[dict]:
    return [
        {"sha256": token_digest(tokens.acme), "role": "tenant", "tenant": "acme"},
        {"sha256": token_digest(tokens.beta), "role": "tenant", "tenant": "beta"},
        {"sha256": token_digest(tokens.gamma), "role": "tenant", "tenant": "gamma"},
        {"sha256": token_digest(tokens.admin), "role": "admin"},
        {"sha256": token_digest(tokens.service), "role": "service"},
    ]


def write_token_file(path: Path, items: list[dict]) -> None:
    """Replaced atomically, as services/tokens.py does: a reader never sees half a file."""
    write_private(path, json.dumps({"tokens": items}))


def code_of(call) -> grpc.StatusCode:
    """The status ``call()`` ends with; a stream it returns is read to its end."""
    try:
        result = call()
        if hasattr(result, "__iter__") and not isinstance(result, bytes | str):
            list(result)
    except grpc.RpcError as exc:
        return exc.code()
    return grpc.StatusCode.OK


def make_tokens(directory: Path) -> Tokens:
    directory.mkdir(parents=True, exist_ok=True)
    service_file = directory / "service.token"
    tokens = Tokens(
        directory / "tokens.json",
        acme="acme-token-1",
        beta="beta-token-2",
        gamma="gamma-token-7",
        admin="admin-token-3",
        service="service-token-4",
        service_file=service_file,
    )
    service_file.write_text(f"  {tokens.service}\n")  # whitespace around it is ignored
    write_token_file(tokens.path, entries(tokens))
    return tokens
