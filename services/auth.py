"""Bearer-token authentication: who makes each call (a role, and a tenant's name), shared by both
services.

The token file (``--auth-tokens FILE``) is JSON::

    {"tokens": [{"sha256": HEX, "role": "tenant", "tenant": NAME},
                {"sha256": HEX, "role": "admin"},
                {"sha256": HEX, "role": "service"}]}

HEX is the lowercase hex sha256 of a token: no token is stored in clear, here or in memory.
Clients send gRPC metadata ``authorization: Bearer TOKEN``. The file is read again when it
changes (its size, modification time or inode), so tokens can be added or revoked without a
restart; a file that no longer parses leaves the previous tokens in force and logs an error.

What each caller may do is services/access.py's. Without a token file every caller is
anonymous and may do anything.
"""

from __future__ import annotations

import enum
import hashlib
import hmac
import json
import logging
import os
import re
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Generic, NamedTuple, TypeVar

import grpc

log = logging.getLogger(__name__)
T = TypeVar("T")

METADATA_KEY = "authorization"
# Open without a token: load balancers and grpcurl need them before they have credentials.
OPEN_SERVICES = frozenset(
    {
        "grpc.health.v1.Health",
        "grpc.reflection.v1alpha.ServerReflection",
        "grpc.reflection.v1.ServerReflection",
    }
)
_TENANT_NAME = re.compile(r"[a-z0-9][a-z0-9._-]*")  # one adapter-id segment (store/layout.py)
_HEX_DIGEST = re.compile(r"[0-9a-f]{64}")
_MAX_TENANT_CHARS = 64


class Role(enum.StrEnum):
    TENANT = "tenant"
    ADMIN = "admin"
    SERVICE = "service"
    ANONYMOUS = "anonymous"  # no token file: authentication is off


@dataclass(frozen=True)
class Caller:
    """Who makes a call: a role, and for a tenant its name."""

    role: Role
    tenant: str | None = None

    @property
    def namespace(self) -> str | None:
        """The adapter-id prefix a tenant is confined to; None for everyone else."""
        return None if self.tenant is None else f"{self.tenant}/"

    @property
    def unrestricted(self) -> bool:
        return self.role in (Role.ADMIN, Role.ANONYMOUS)

    def __str__(self) -> str:
        return f"tenant {self.tenant!r}" if self.role is Role.TENANT else self.role.value


ANONYMOUS = Caller(Role.ANONYMOUS)


class AuthError(Exception):
    """Base of the two refusals; services map them to status codes in their one place."""


class Unauthenticated(AuthError):
    """No token, or one that the token file does not hold (UNAUTHENTICATED)."""


class PermissionDenied(AuthError):
    """A known caller asked for something its role does not allow (PERMISSION_DENIED)."""


class TokenFileError(ValueError):
    """The token file is missing or malformed; the message names the entry and the field."""


def token_digest(token: str) -> str:
    """What the token file holds for ``token``: its sha256, lowercase hex."""
    return hashlib.sha256(token.encode()).hexdigest()


def bearer_metadata(token: str) -> tuple[tuple[str, str], ...]:
    """The call metadata that carries ``token``."""
    return ((METADATA_KEY, f"Bearer {token}"),)


def parse_tokens(text: str, source: str) -> list[tuple[bytes, Caller]]:
    """(sha256 digest, caller) per entry of a token file's text. Raises TokenFileError."""
    try:
        doc = json.loads(text)
    except json.JSONDecodeError as exc:
        raise TokenFileError(f"{source} is not JSON: {exc}") from None
    entries = doc.get("tokens") if isinstance(doc, dict) else None
    if not isinstance(entries, list):
        raise TokenFileError(f'{source}: expected {{"tokens": [...]}}')
    out: list[tuple[bytes, Caller]] = []
    seen: set[str] = set()
    for i, entry in enumerate(entries):
        where = f"{source}: tokens[{i}]"
        if not isinstance(entry, dict):
            raise TokenFileError(f"{where} must be an object")
        digest = entry.get("sha256")
        if not isinstance(digest, str) or not _HEX_DIGEST.fullmatch(digest):
            raise TokenFileError(f"{where}: sha256 must be 64 lowercase hex digits")
        if digest in seen:
            raise TokenFileError(f"{where}: the same sha256 appears twice")
        seen.add(digest)
        try:
            role = Role(entry.get("role"))
        except ValueError:
            role = None
        if role not in (Role.TENANT, Role.ADMIN, Role.SERVICE):
            raise TokenFileError(f"{where}: role must be 'tenant', 'admin' or 'service'")
        tenant = entry.get("tenant")
        if role is Role.TENANT:
            if not isinstance(tenant, str) or not valid_tenant(tenant):
                raise TokenFileError(
                    f"{where}: a tenant needs a name of at most {_MAX_TENANT_CHARS} lowercase "
                    "letters, digits, '.', '_' and '-' that starts with a letter or digit"
                )
        elif tenant is not None:
            raise TokenFileError(f"{where}: only role 'tenant' takes a tenant name")
        out.append((bytes.fromhex(digest), Caller(role, tenant)))
    return out


def valid_tenant(name: str) -> bool:
    return len(name) <= _MAX_TENANT_CHARS and _TENANT_NAME.fullmatch(name) is not None


class _Signature(NamedTuple):
    inode: int
    size: int
    mtime_ns: int


class WatchedFile(Generic[T]):
    """A file parsed at construction (TokenFileError if it is unusable) and again whenever it
    changes (its inode, size or modification time). While it is gone, or a changed version
    cannot be read or parsed, the last good value stays; that is logged once (per absence,
    per bad version), never on every look."""

    def __init__(self, path: Path, flag: str, parse: Callable[[str], T], keeps: str) -> None:
        """``flag``: the option that names the file; ``parse``: its text to the value, raising
        TokenFileError; ``keeps``: what the log says stays in force meanwhile."""
        self.path = Path(path)
        self._flag, self._parse, self._keeps = flag, parse, keeps
        self._signature = self._stat()
        if self._signature is None:
            raise TokenFileError(f"{flag} {self.path} cannot be read")
        self.value: T = self._read()
        self._failed: _Signature | None = None  # a changed file that did not parse
        self._missing = False  # the file was gone at the last look (logged once)

    def _stat(self) -> _Signature | None:
        try:
            st = os.stat(self.path)
        except OSError:
            return None
        return _Signature(st.st_ino, st.st_size, st.st_mtime_ns)

    def _read(self) -> T:
        try:
            text = self.path.read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError) as exc:
            raise TokenFileError(f"cannot read {self.path}: {exc}") from None
        return self._parse(text)

    def current(self) -> T:
        """The value of the file's latest usable version (read again if it changed)."""
        signature = self._stat()
        if signature is None:
            if not self._missing:
                self._missing = True
                log.error("%s %s is gone; %s", self._flag, self.path, self._keeps)
            return self.value
        self._missing = False
        if signature == self._signature or signature == self._failed:
            return self.value
        try:
            value = self._read()
        except TokenFileError as exc:
            self._failed = signature  # logged once per bad version of the file
            log.error(
                "%s %s changed but is not usable; %s: %s", self._flag, self.path, self._keeps, exc
            )
            return self.value
        self.value, self._signature, self._failed = value, signature, None
        return value


class TokenTable:
    """The token file, read at construction (TokenFileError if it is unusable) and again
    whenever it changes."""

    def __init__(self, path: Path) -> None:
        self.path = Path(path)
        self._file = WatchedFile(
            self.path,
            "--auth-tokens",
            lambda text: parse_tokens(text, str(self.path)),
            "the previous tokens stay",
        )
        self._entries = self._file.value
        log.info("authentication on: %d tokens from %s", len(self._entries), self.path)

    def lookup(self, token: str) -> Caller | None:
        """The caller ``token`` belongs to, or None. Every entry is compared, each in constant
        time, so the time taken says nothing about which digest (or how much of it) matched."""
        entries = self._file.current()
        if entries is not self._entries:
            self._entries = entries
            log.info("token file %s reloaded: %d tokens", self.path, len(entries))
        digest = hashlib.sha256(token.encode()).digest()
        found = None
        for stored, caller in entries:
            if hmac.compare_digest(stored, digest):
                found = caller
        return found


class Authenticator:
    """Resolves the caller of a call from its metadata: ANONYMOUS when authentication is off
    (``tokens`` None)."""

    def __init__(self, tokens: TokenTable | None) -> None:
        self.tokens = tokens

    @classmethod
    def from_file(cls, path: Path | None) -> Authenticator:
        return cls(None if path is None else TokenTable(path))

    @property
    def enabled(self) -> bool:
        return self.tokens is not None

    def caller_from_metadata(self, metadata: Iterable[tuple[str, str | bytes]] | None) -> Caller:
        if self.tokens is None:
            return ANONYMOUS
        values = [v for k, v in metadata or () if k == METADATA_KEY]
        if not values:
            raise Unauthenticated(
                "no credentials: send the metadata 'authorization: Bearer TOKEN' "
                "(the CLI: --token or LORAFLEET_TOKEN)"
            )
        value = values[0] if isinstance(values[0], str) else values[0].decode("latin-1")
        scheme, _, token = value.strip().partition(" ")
        token = token.strip()
        if scheme.lower() != "bearer" or not token:
            raise Unauthenticated("the authorization metadata must read 'Bearer TOKEN'")
        caller = self.tokens.lookup(token)
        if caller is None:
            raise Unauthenticated("the bearer token is not valid here (unknown or revoked)")
        return caller

    def caller(self, context: grpc.aio.ServicerContext) -> Caller:
        """The caller of the call in progress; raises Unauthenticated."""
        return self.caller_from_metadata(context.invocation_metadata())


class AuthInterceptor(grpc.aio.ServerInterceptor):
    """Refuses every call without a valid token before its handler runs, except health checks
    and reflection. The handlers still authorize what each call touches (``Authenticator.caller``
    and the rules below); ``status_for`` is the service's own mapping of AuthError to a code."""

    def __init__(
        self, auth: Authenticator, status_for: Callable[[AuthError], grpc.StatusCode]
    ) -> None:
        self._auth = auth
        self._status_for = status_for

    async def intercept_service(self, continuation, handler_call_details):
        handler = await continuation(handler_call_details)
        if handler is None or not self._auth.enabled:
            return handler
        service = handler_call_details.method.lstrip("/").rpartition("/")[0]
        if service in OPEN_SERVICES:
            return handler
        try:
            self._auth.caller_from_metadata(handler_call_details.invocation_metadata)
        except Unauthenticated as exc:
            return _refusal(handler, self._status_for(exc), str(exc))
        return handler


def _refusal(handler: grpc.RpcMethodHandler, code: grpc.StatusCode, message: str):
    """A handler of the same kind as ``handler`` that ends the call with ``code``."""

    async def refuse(_request, context):
        await context.abort(code, message)

    kinds = {
        (False, False): grpc.unary_unary_rpc_method_handler,
        (False, True): grpc.unary_stream_rpc_method_handler,
        (True, False): grpc.stream_unary_rpc_method_handler,
        (True, True): grpc.stream_stream_rpc_method_handler,
    }
    make = kinds[(handler.request_streaming, handler.response_streaming)]
    return make(
        refuse,
        request_deserializer=handler.request_deserializer,
        response_serializer=handler.response_serializer,
    )
