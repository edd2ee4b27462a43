"""Where an adapter's objects live in the bucket (or under the local root).

    manifests/<adapter_id>/@v/<version:010d>.json      the version's manifest: the commit point
    manifests/<adapter_id>/@v/<version:010d>.deleted   tombstone: keeps a deleted number unused
    blobs/<adapter_id>/<upload uuid>.safetensors       adapter_model.safetensors of one upload

Invariants: a version exists exactly when its manifest does; the manifest is written (with
create-if-absent, so concurrent uploads get distinct numbers) only after its blob is complete.
Adapter id segments start with [a-z0-9], so "@v" can never be a segment of an id, and all keys
of one adapter's versions share the prefix ``manifests/<adapter_id>/@v/`` that no other
adapter's keys have: in any listing order that walks keys by prefix, one adapter's version keys
come together.
"""

from __future__ import annotations

import re
from typing import NamedTuple

from store.errors import InvalidRequest

MAX_ADAPTER_ID_CHARS = 128
MANIFESTS = "manifests/"
BLOBS = "blobs/"
_VERSIONS = "/@v/"
_SEGMENT = r"[a-z0-9][a-z0-9._-]*"
_ADAPTER_ID = re.compile(rf"{_SEGMENT}(/{_SEGMENT})*")
_PREFIX = re.compile(r"[a-z0-9._/-]*")
_VERSION_KEY = re.compile(
    rf"{MANIFESTS}(?P<id>.+){re.escape(_VERSIONS)}(?P<version>\d{{10}})\.(?P<kind>json|deleted)"
)
MAX_VERSION = 2**32 - 1  # versions travel as uint32


class VersionKey(NamedTuple):
    adapter_id: str
    version: int
    deleted: bool  # a tombstone rather than a manifest


def check_adapter_id(adapter_id: str) -> str:
    if not adapter_id:
        raise InvalidRequest("adapter_id is empty")
    if len(adapter_id) > MAX_ADAPTER_ID_CHARS:
        raise InvalidRequest(
            f"adapter_id is {len(adapter_id)} characters; at most {MAX_ADAPTER_ID_CHARS} allowed"
        )
    if not _ADAPTER_ID.fullmatch(adapter_id):
        raise InvalidRequest(
            f"adapter_id {adapter_id!r} is invalid: use segments of lowercase letters, digits, "
            "'.', '_' and '-' that start with a letter or digit, joined by '/' "
            "(for example acme/support-bot)"
        )
    return adapter_id


def check_prefix(prefix: str) -> str:
    if len(prefix) > MAX_ADAPTER_ID_CHARS or not _PREFIX.fullmatch(prefix):
        raise InvalidRequest(
            f"prefix {prefix!r} is invalid: at most {MAX_ADAPTER_ID_CHARS} characters of "
            "lowercase letters, digits, '.', '_', '-' and '/'"
        )
    return prefix


def check_version(version: int) -> int:
    if not 0 <= version <= MAX_VERSION:
        raise InvalidRequest(f"version {version} is out of range")
    return version


def versions_prefix(adapter_id: str) -> str:
    return f"{MANIFESTS}{adapter_id}{_VERSIONS}"


def manifest_key(adapter_id: str, version: int) -> str:
    return f"{versions_prefix(adapter_id)}{version:010d}.json"


def tombstone_key(adapter_id: str, version: int) -> str:
    return f"{versions_prefix(adapter_id)}{version:010d}.deleted"


def blob_key(adapter_id: str, upload_id: str) -> str:
    return f"{BLOBS}{adapter_id}/{upload_id}.safetensors"


def after_adapter(adapter_id: str) -> str:
    """A key that sorts after every version key of the adapter and before the next adapter's."""
    return f"{versions_prefix(adapter_id)}~"


def parse_version_key(key: str) -> VersionKey | None:
    """The adapter, version and kind a manifests/ key names; None for any other key."""
    match = _VERSION_KEY.fullmatch(key)
    if match is None or not _ADAPTER_ID.fullmatch(match["id"]):
        return None
    return VersionKey(match["id"], int(match["version"]), match["kind"] == "deleted")
