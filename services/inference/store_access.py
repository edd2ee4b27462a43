"""How the inference service reaches the adapter store: its address, the token it sends
(``--adapter-store-token-file``) and TLS (``--adapter-store-ca``, and for a store with mutual
TLS ``--adapter-store-cert``/``--adapter-store-key``).

Both the service (lookups, the watch) and its fetch worker process (fetches) connect with it;
the worker gets it as one JSON argument (paths only: the token never appears on a command line).
The token file holds the token alone, surrounding whitespace ignored; it is read again when it
changes, so the token can be rotated without a restart.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, fields
from pathlib import Path

import grpc

from services import tls
from services.auth import TokenFileError, WatchedFile, bearer_metadata


class TokenFile:
    """A token kept alone in a file; ``metadata()`` carries the file's current token. Raises
    TokenFileError (a ValueError) if the file holds none at construction."""

    def __init__(self, path: Path) -> None:
        self.path = Path(path)
        self._file = WatchedFile(self.path, _FLAG, self._parse, "the previous token is still sent")

    def _parse(self, text: str) -> tuple[tuple[str, str], ...]:
        token = text.strip()
        if not token:
            raise TokenFileError(f"{_FLAG} {self.path} holds no token")
        return bearer_metadata(token)

    def metadata(self) -> tuple[tuple[str, str], ...]:
        return self._file.current()


@dataclass(frozen=True)
class StoreAccess:
    target: str  # HOST:PORT
    token_file: Path | None = None
    ca: Path | None = None  # set: TLS
    cert: Path | None = None
    key: Path | None = None

    def encode(self) -> str:
        return json.dumps({k: None if v is None else str(v) for k, v in asdict(self).items()})

    @classmethod
    def decode(cls, text: str) -> StoreAccess:
        """encode()'s inverse: every field but the target is a path or None."""
        raw = json.loads(text)
        paths = {f.name: raw[f.name] for f in fields(cls) if f.name != "target"}
        return cls(raw["target"], **{k: None if v is None else Path(v) for k, v in paths.items()})

    def token(self) -> TokenFile | None:
        return None if self.token_file is None else TokenFile(self.token_file)

    def _credentials(self) -> grpc.ChannelCredentials | None:
        if self.ca is None:
            return None
        return tls.channel_credentials(self.ca, self.cert, self.key)

    def channel(self, options) -> grpc.Channel:
        return tls.channel(self.target, self._credentials(), options)

    def aio_channel(self, options) -> grpc.aio.Channel:
        return tls.channel(self.target, self._credentials(), options, grpc.aio)


_FLAG = "--adapter-store-token-file"
