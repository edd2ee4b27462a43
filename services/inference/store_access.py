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
import logging
import os
from dataclasses import asdict, dataclass
from pathlib import Path

import grpc

from services import tls
from services.auth import bearer_metadata

log = logging.getLogger(__name__)


class TokenFile:
    """A token kept alone in a file; ``metadata()`` carries the file's current token."""

    def __init__(self, path: Path) -> None:
        self.path = Path(path)
        self._stamp: tuple[int, int, int] | None = None
        self._metadata: tuple[tuple[str, str], ...] = ()
        self.metadata()
        if not self._metadata:
            raise ValueError(f"--adapter-store-token-file {self.path} holds no token")

    def metadata(self) -> tuple[tuple[str, str], ...]:
        try:
            st = os.stat(self.path)
            stamp = (st.st_ino, st.st_size, st.st_mtime_ns)
            if stamp != self._stamp:
                token = self.path.read_text(encoding="utf-8").strip()
                self._stamp = stamp
                if token:
                    self._metadata = bearer_metadata(token)
                else:
                    log.error("%s holds no token; the previous one is still sent", self.path)
        except (OSError, UnicodeDecodeError) as exc:
            if self._stamp is not None:  # read before: keep sending that token
                log.error("cannot read %s (%s); the previous token is still sent", self.path, exc)
            else:
                raise ValueError(f"cannot read --adapter-store-token-file: {exc}") from None
        return self._metadata


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
        raw = json.loads(text)
        return cls(raw["target"], *(None if raw[k] is None else Path(raw[k]) for k in _PATHS))

    def token(self) -> TokenFile | None:
        return None if self.token_file is None else TokenFile(self.token_file)

    def _credentials(self) -> grpc.ChannelCredentials | None:
        if self.ca is None:
            return None
        return tls.channel_credentials(self.ca, self.cert, self.key)

    def channel(self, options) -> grpc.Channel:
        credentials = self._credentials()
        if credentials is None:
            return grpc.insecure_channel(self.target, options=options)
        return grpc.secure_channel(self.target, credentials, options=options)

    def aio_channel(self, options) -> grpc.aio.Channel:
        credentials = self._credentials()
        if credentials is None:
            return grpc.aio.insecure_channel(self.target, options=options)
        return grpc.aio.secure_channel(self.target, credentials, options=options)


_PATHS = ("token_file", "ca", "cert", "key")
