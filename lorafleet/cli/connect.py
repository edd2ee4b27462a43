"""How the CLI reaches a service: its token (``--token`` or LORAFLEET_TOKEN, sent as
``authorization: Bearer TOKEN``) and TLS (``--ca``, and ``--cert``/``--key`` for a service that
requires client certificates)."""

from __future__ import annotations

import argparse
import os

import grpc

from services import tls
from services.auth import bearer_metadata

TOKEN_ENV = "LORAFLEET_TOKEN"


def add_arguments(parser: argparse.ArgumentParser, suppress: bool = False) -> None:
    """The connection flags; ``suppress``: for a parser that repeats them after an action, so
    that they keep the value given before it unless given again."""

    def default(value):
        return argparse.SUPPRESS if suppress else value

    parser.add_argument(
        "--token",
        default=default(os.environ.get(TOKEN_ENV)),
        help=f"bearer token for a service with authentication (default ${TOKEN_ENV})",
    )
    parser.add_argument(
        "--ca", default=default(None), help="PEM CA certificates: connect over TLS, trusting them"
    )
    parser.add_argument(
        "--cert", default=default(None), help="PEM client certificate (mutual TLS; with --key)"
    )
    parser.add_argument("--key", default=default(None), help="PEM private key of --cert")


class ConnectFlagError(Exception):
    """A connection flag is wrong; the message says which."""


def channel(address: str, args: argparse.Namespace) -> grpc.Channel:
    if (args.cert is None) != (args.key is None):
        raise ConnectFlagError("--cert and --key go together")
    if args.ca is None:
        if args.cert is not None:
            raise ConnectFlagError("--cert needs --ca (client certificates are a TLS feature)")
        return tls.channel(address, None)
    try:
        credentials = tls.channel_credentials(args.ca, args.cert, args.key)
    except OSError as exc:
        raise ConnectFlagError(f"cannot read {exc.filename}: {exc.strerror}") from None
    return tls.channel(address, credentials)


def metadata(args: argparse.Namespace) -> tuple[tuple[str, str], ...]:
    """The call metadata that carries the token, if there is one."""
    token = (args.token or "").strip()
    return bearer_metadata(token) if token else ()
