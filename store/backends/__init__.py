"""Object storage behind the adapter store: one interface (base.py), two implementations."""

from __future__ import annotations

from store.backends.base import MultipartWriter, ObjectNotFound, ObjectStore, RangeReader
from store.config import BackendKind, StoreConfig

__all__ = ["MultipartWriter", "ObjectNotFound", "ObjectStore", "RangeReader", "open_backend"]


def open_backend(config: StoreConfig) -> ObjectStore:
    """The backend the config names."""
    if config.backend is BackendKind.S3:
        from store.backends.s3 import S3ObjectStore

        return S3ObjectStore(config)
    from store.backends.local import LocalObjectStore

    return LocalObjectStore(config.root)
