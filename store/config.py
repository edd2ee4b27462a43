"""StoreConfig: every setting of one adapter-store process, read from flags and environment."""

from __future__ import annotations

import argparse
import json
import logging
import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from enum import StrEnum
from functools import cached_property
from pathlib import Path

from store.base_model import BaseModelShape

MIB = 1 << 20
# gRPC's default message limit is 4 MiB; upload chunks must fit in one message.
MAX_UPLOAD_CHUNK_BYTES = 4 * MIB
# S3 refuses multipart parts under 5 MiB (except the last one).
MIN_PART_BYTES = 5 * MIB


class BackendKind(StrEnum):
    LOCAL = "local"
    S3 = "s3"


@dataclass(frozen=True)
class StoreConfig:
    host: str = "127.0.0.1"
    port: int = 50051
    backend: BackendKind = BackendKind.LOCAL
    root: Path = Path("data/adapters")  # local backend
    s3_endpoint: str | None = None  # None = AWS's own endpoint for the region
    s3_bucket: str | None = None
    s3_region: str = "us-east-1"
    aws_access_key_id: str | None = field(default=None, repr=False)
    aws_secret_access_key: str | None = field(default=None, repr=False)
    aws_session_token: str | None = field(default=None, repr=False)
    max_adapter_bytes: int = 2048 * MIB
    # The bytes of adapters a tenant may keep stored (every live version under its name);
    # None: no limit. An upload that would pass it fails RESOURCE_EXHAUSTED.
    tenant_max_bytes: int | None = None
    max_rank: int = 128
    base_model_config: Path | None = None
    log_level: str = "INFO"
    # Storage calls: a refused or dropped connection is retried max_attempts times in all,
    # with backoff; one attempt waits at most connect_timeout_s + read_timeout_s.
    connect_timeout_s: float = 2.0
    read_timeout_s: float = 10.0
    max_attempts: int = 3
    io_threads: int = 16
    part_bytes: int = 8 * MIB  # multipart part size on upload
    # Fetch: the object is read as ranges of fetch_range_bytes, fetch_parallelism of them
    # streaming at once, each in messages of fetch_chunk_bytes (under gRPC's default 4 MiB
    # message limit, so that clients need no option), at most fetch_queue_chunks read ahead.
    fetch_parallelism: int = 2
    fetch_range_bytes: int = 32 * MIB
    fetch_chunk_bytes: int = 4 * MIB - 4096
    fetch_queue_chunks: int = 2
    upload_parts_in_flight: int = 2
    # Uploads in flight at once: each holds up to upload_parts_in_flight + 1 parts and a chunk.
    max_concurrent_uploads: int = 8
    # Of those, one tenant's at once (None: half of them, at least 1), so that no tenant's
    # uploads hold every slot; and an upload that receives no bytes for upload_idle_timeout_s
    # fails, so that a stalled client does not hold its slot for upload_timeout_s.
    tenant_max_concurrent_uploads: int | None = None
    upload_idle_timeout_s: float = 60.0
    # An upload still running after this long fails. So an unfinished S3 multipart upload of
    # the store's blobs begun longer ago than stale_upload_s (at least upload_timeout_s; by
    # default 5 minutes more, for clocks that disagree) is no live upload's, and is aborted.
    upload_timeout_s: float = 1800.0
    stale_upload_s: float | None = None
    probe_interval_s: float = 5.0  # how often the service checks that storage answers
    metrics_port: int | None = None  # serve Prometheus metrics over HTTP here (0: a free port)
    # How often the storage is rescanned for other store processes' changes, which are then
    # announced to this one's watchers (store/rescan.py); 0: never (one store on its storage).
    watch_rescan_s: float = 5.0
    # Tenancy (services/auth.py, services/tls.py): None = no authentication, plain TCP.
    auth_tokens: Path | None = None
    tls_cert: Path | None = None
    tls_key: Path | None = None
    tls_client_ca: Path | None = None  # mutual TLS: clients must present a cert it signed

    def __post_init__(self) -> None:
        if not 0 <= self.port <= 65535:
            raise ValueError(f"port must be in [0, 65535], got {self.port}")
        if self.metrics_port is not None and not 0 <= self.metrics_port <= 65535:
            raise ValueError(f"metrics_port must be in [0, 65535], got {self.metrics_port}")
        if self.backend is BackendKind.S3 and not self.s3_bucket:
            raise ValueError("the s3 backend needs --s3-bucket")
        if self.max_adapter_bytes < 1:
            raise ValueError("max_adapter_bytes must be positive")
        if self.tenant_max_bytes is not None and self.tenant_max_bytes < 1:
            raise ValueError(f"tenant_max_bytes must be positive, got {self.tenant_max_bytes}")
        if self.max_rank < 1:
            raise ValueError("max_rank must be positive")
        if self.part_bytes < MIN_PART_BYTES:
            raise ValueError(f"part_bytes must be at least {MIN_PART_BYTES} (an S3 limit)")
        if not 1 <= self.fetch_chunk_bytes <= MAX_UPLOAD_CHUNK_BYTES:
            raise ValueError(f"fetch_chunk_bytes must be in [1, {MAX_UPLOAD_CHUNK_BYTES}]")
        if self.fetch_range_bytes < self.fetch_chunk_bytes:
            raise ValueError("fetch_range_bytes must be at least fetch_chunk_bytes")
        for name in (
            "io_threads",
            "fetch_parallelism",
            "fetch_queue_chunks",
            "upload_parts_in_flight",
            "max_concurrent_uploads",
            "max_attempts",
        ):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be at least 1")
        slots = self.tenant_max_concurrent_uploads
        if slots is not None and slots < 1:
            raise ValueError(f"tenant_max_concurrent_uploads must be at least 1, got {slots}")
        for name in (
            "connect_timeout_s", "read_timeout_s", "probe_interval_s", "upload_timeout_s",
            "upload_idle_timeout_s",
        ):  # fmt: skip
            if getattr(self, name) <= 0:
                raise ValueError(f"{name} must be positive")
        if self.watch_rescan_s < 0:
            raise ValueError(f"watch_rescan_s must be 0 (off) or more, got {self.watch_rescan_s}")
        if self.stale_upload_s is not None and self.stale_upload_s < self.upload_timeout_s:
            raise ValueError(
                "stale_upload_s must be at least upload_timeout_s: an upload younger than the "
                "timeout may still be live"
            )
        if logging.getLevelName(self.log_level.upper()) not in range(0, 100):
            raise ValueError(f"unknown log level {self.log_level!r}")
        if self.base_model_config is not None and not self.base_model_config.is_file():
            raise ValueError(f"--base-model-config {self.base_model_config} is not a file")
        if (self.tls_cert is None) != (self.tls_key is None):
            raise ValueError("--tls-cert and --tls-key go together: give both or neither")
        if self.tls_client_ca is not None and self.tls_cert is None:
            raise ValueError("--tls-client-ca needs --tls-cert and --tls-key (mutual TLS)")
        for name in ("auth_tokens", "tls_cert", "tls_key", "tls_client_ca"):
            path = getattr(self, name)
            if path is not None and not path.is_file():
                raise ValueError(f"--{name.replace('_', '-')} {path} is not a file")

    @property
    def tenant_upload_slots(self) -> int:
        """Uploads one tenant may have in flight at once."""
        if self.tenant_max_concurrent_uploads is not None:
            return self.tenant_max_concurrent_uploads
        return max(1, self.max_concurrent_uploads // 2)

    @property
    def stale_upload_after_s(self) -> float:
        """Age past which an unfinished multipart upload on S3 is left over (sweep_uploads)."""
        if self.stale_upload_s is not None:
            return self.stale_upload_s
        return self.upload_timeout_s + 300.0

    @cached_property
    def base_shape(self) -> BaseModelShape | None:
        """The base model that uploads must fit, from --base-model-config (a config.json)."""
        if self.base_model_config is None:
            return None
        try:
            raw = json.loads(self.base_model_config.read_text())
        except (OSError, json.JSONDecodeError) as exc:
            raise ValueError(f"cannot read {self.base_model_config}: {exc}") from exc
        return BaseModelShape.from_hf_config(raw)

    @classmethod
    def from_args(
        cls, argv: Sequence[str] | None = None, environ: Mapping[str, str] | None = None
    ) -> StoreConfig:
        """The only place that reads the environment: AWS_* credentials and region, and
        LORAFLEET_LOG_LEVEL as the default of --log-level."""
        env = os.environ if environ is None else environ
        args = _parser(env).parse_args(argv)
        return cls(
            host=args.host,
            port=args.port,
            backend=BackendKind(args.backend),
            root=Path(args.root),
            s3_endpoint=args.s3_endpoint,
            s3_bucket=args.s3_bucket,
            s3_region=args.s3_region,
            aws_access_key_id=env.get("AWS_ACCESS_KEY_ID"),
            aws_secret_access_key=env.get("AWS_SECRET_ACCESS_KEY"),
            aws_session_token=env.get("AWS_SESSION_TOKEN"),
            max_adapter_bytes=args.max_adapter_bytes,
            tenant_max_bytes=args.tenant_max_bytes,
            max_rank=args.max_rank,
            base_model_config=Path(args.base_model_config) if args.base_model_config else None,
            log_level=args.log_level.upper(),
            probe_interval_s=args.probe_interval_s,
            metrics_port=args.metrics_port,
            watch_rescan_s=args.watch_rescan_s,
            max_concurrent_uploads=args.max_concurrent_uploads,
            tenant_max_concurrent_uploads=args.tenant_max_concurrent_uploads,
            upload_timeout_s=args.upload_timeout_s,
            upload_idle_timeout_s=args.upload_idle_timeout_s,
            stale_upload_s=args.stale_upload_s,
            **{
                name: Path(getattr(args, name)) if getattr(args, name) else None
                for name in ("auth_tokens", "tls_cert", "tls_key", "tls_client_ca")
            },
        )


def _parser(env: Mapping[str, str]) -> argparse.ArgumentParser:
    d = StoreConfig  # the flags' defaults are the dataclass's, so the two cannot drift apart
    parser = argparse.ArgumentParser(
        prog="python -m services.adapter_store",
        description="The lorafleet adapter store: a gRPC service keeping versioned LoRA adapters.",
    )
    parser.add_argument("--host", default=d.host)
    parser.add_argument("--port", type=int, default=d.port)
    parser.add_argument("--backend", choices=[k.value for k in BackendKind], default=d.backend)
    parser.add_argument("--root", default=str(d.root), help="local backend: directory")
    parser.add_argument("--s3-endpoint", help="s3 backend: endpoint URL (MinIO, SeaweedFS)")
    parser.add_argument("--s3-bucket", help="s3 backend: bucket name (must exist)")
    parser.add_argument(
        "--s3-region",
        default=env.get("AWS_REGION") or env.get("AWS_DEFAULT_REGION") or d.s3_region,
    )
    parser.add_argument("--max-adapter-bytes", type=int, default=d.max_adapter_bytes)
    parser.add_argument("--max-rank", type=int, default=d.max_rank)
    parser.add_argument(
        "--tenant-max-bytes",
        type=int,
        default=d.tenant_max_bytes,
        help="bytes of adapters each tenant may keep stored, every version counted (with "
        "--auth-tokens; default: no limit)",
    )
    parser.add_argument(
        "--max-concurrent-uploads",
        type=int,
        default=d.max_concurrent_uploads,
        help="uploads in flight at once; more fail RESOURCE_EXHAUSTED",
    )
    parser.add_argument(
        "--tenant-max-concurrent-uploads",
        type=int,
        default=d.tenant_max_concurrent_uploads,
        help="uploads one tenant may have in flight at once (default: half of "
        "--max-concurrent-uploads); more fail RESOURCE_EXHAUSTED",
    )
    parser.add_argument(
        "--upload-idle-timeout-s",
        type=float,
        default=d.upload_idle_timeout_s,
        help="seconds an upload may go without receiving bytes; then it fails DEADLINE_EXCEEDED",
    )
    parser.add_argument(
        "--upload-timeout-s",
        type=float,
        default=d.upload_timeout_s,
        help="seconds one upload may take; longer ones fail DEADLINE_EXCEEDED",
    )
    parser.add_argument(
        "--stale-upload-s",
        type=float,
        help="s3 backend: unfinished multipart uploads under blobs/ begun longer ago than this "
        "are aborted (default: --upload-timeout-s + 300)",
    )
    parser.add_argument(
        "--base-model-config", help="config.json of the base model that adapters must fit"
    )
    parser.add_argument("--log-level", default=env.get("LORAFLEET_LOG_LEVEL", d.log_level))
    parser.add_argument(
        "--probe-interval-s",
        type=float,
        default=d.probe_interval_s,
        help="seconds between storage checks",
    )
    parser.add_argument(
        "--metrics-port",
        type=int,
        default=d.metrics_port,
        help="serve Prometheus metrics over HTTP on this port (default: none)",
    )
    parser.add_argument(
        "--watch-rescan-s",
        type=float,
        default=d.watch_rescan_s,
        help="seconds between rescans of the storage for other store processes' uploads and "
        "deletes, announced to this store's watchers; 0: never",
    )
    parser.add_argument(
        "--auth-tokens",
        help="JSON file of sha256 token digests with their roles; without it, no authentication",
    )
    parser.add_argument("--tls-cert", help="PEM certificate chain: serve TLS (with --tls-key)")
    parser.add_argument("--tls-key", help="PEM private key of --tls-cert")
    parser.add_argument(
        "--tls-client-ca", help="PEM CA certificates: require client certificates (mutual TLS)"
    )
    return parser
