"""GatewayConfig: every setting of the HTTP gateway, from flags and environment variables.

This is the one place that reads the environment. Each flag has a variable,
LORAFLEET_GATEWAY_<FLAG> (e.g. LORAFLEET_GATEWAY_PORT for --port); a flag on the command line
wins over its variable. Three settings also honour the variables the whole stack shares:
LORAFLEET_INFERENCE, LORAFLEET_ADAPTER_STORE and LORAFLEET_LOG_LEVEL.
"""

from __future__ import annotations

import argparse
import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, fields
from pathlib import Path

from services.flag_env import flag_values

ENV_PREFIX = "LORAFLEET_GATEWAY_"
LOG_LEVELS = ("DEBUG", "INFO", "WARNING", "ERROR")
INT32_MAX = 2**31 - 1  # SamplingParams' int32 fields: max_new_tokens, top_k, stop_token_ids


@dataclass(frozen=True)
class GatewayConfig:
    inference: str  # HOST:PORT of the inference service
    adapter_store: str | None = None  # HOST:PORT; None = no registry, /v1/models lists the base
    host: str = "127.0.0.1"
    port: int = 8000
    max_request_bytes: int = 8 * 2**20  # JSON bodies; uploads are bounded by the store
    max_n: int = 16  # generations one request may start: prompts x n
    chat_max_tokens: int = 512  # a chat request's max_tokens when it gives none
    rpc_timeout_s: float = 60.0  # deadline of every gRPC call but Generate and UploadAdapter
    shutdown_grace_s: float = 5.0  # requests in flight may finish within this after SIGTERM
    lora_path_root: Path | None = None  # load_lora_adapter's lora_path must lie under it
    log_level: str = "INFO"

    def __post_init__(self) -> None:
        for name in ("inference", "adapter_store"):
            value = getattr(self, name)
            if value is None and name == "adapter_store":
                continue
            host, sep, port = (value or "").rpartition(":")
            if not sep or not host or not port.isdigit():
                raise ValueError(f"--{_flag(name)} must be HOST:PORT, got {value!r}")
        if not 0 <= self.port <= 65535:
            raise ValueError(f"--port must be a TCP port (0..65535), got {self.port}")
        for name in ("max_request_bytes", "max_n", "chat_max_tokens"):
            if getattr(self, name) < 1:
                raise ValueError(f"--{_flag(name)} must be at least 1, got {getattr(self, name)}")
        if self.chat_max_tokens > INT32_MAX:
            raise ValueError(f"--chat-max-tokens must be at most {INT32_MAX}")
        if self.rpc_timeout_s <= 0:
            raise ValueError(f"--rpc-timeout-s must be positive, got {self.rpc_timeout_s}")
        if self.shutdown_grace_s < 0:
            raise ValueError(f"--shutdown-grace-s must be >= 0, got {self.shutdown_grace_s}")
        if self.lora_path_root is not None:
            object.__setattr__(self, "lora_path_root", Path(self.lora_path_root))
        if self.log_level.upper() not in LOG_LEVELS:
            raise ValueError(f"--log-level must be one of {LOG_LEVELS}, got {self.log_level!r}")
        object.__setattr__(self, "log_level", self.log_level.upper())

    @classmethod
    def from_args(
        cls, argv: Sequence[str] | None = None, environ: Mapping[str, str] | None = None
    ) -> GatewayConfig:
        """Parses flags over environment defaults. Errors exit with argparse's usage message."""
        env = os.environ if environ is None else environ
        parser = build_parser()
        args = parser.parse_args(argv)
        values = flag_values(cls, args, env, ENV_PREFIX, _SHARED_ENV, _TYPES, parser)
        if "inference" not in values:
            parser.error("--inference is required (or set LORAFLEET_INFERENCE)")
        try:
            return cls(**values)
        except ValueError as exc:
            parser.error(str(exc))
            raise  # unreachable: parser.error exits


# Variables the whole stack shares (the CLI finds the services through the first two too).
_SHARED_ENV = {
    "inference": "LORAFLEET_INFERENCE",
    "adapter_store": "LORAFLEET_ADAPTER_STORE",
    "log_level": "LORAFLEET_LOG_LEVEL",
}

_TYPES = {
    "port": int,
    "max_request_bytes": int,
    "max_n": int,
    "chat_max_tokens": int,
    "rpc_timeout_s": float,
    "shutdown_grace_s": float,
    "lora_path_root": Path,
}

_HELP = {
    "inference": "inference service address HOST:PORT (also LORAFLEET_INFERENCE)",
    "adapter_store": "adapter store address HOST:PORT (also LORAFLEET_ADAPTER_STORE; without it "
    "there is no adapter registry and /v1/models lists the base model alone)",
    "host": "address to listen on (default 127.0.0.1; 0.0.0.0 for every interface)",
    "port": "HTTP port (default 8000)",
    "max_request_bytes": "largest JSON request body in bytes (default 8 MiB); adapter uploads "
    "are bounded by the store's --max-adapter-bytes",
    "max_n": "generations one request may start, prompts x n (default 16)",
    "chat_max_tokens": "max_tokens of a chat request that gives none (default 512)",
    "rpc_timeout_s": "deadline in seconds of every gRPC call but Generate and UploadAdapter "
    "(default 60)",
    "shutdown_grace_s": "seconds requests in flight may finish after SIGTERM (default 5)",
    "lora_path_root": "POST /v1/load_lora_adapter reads lora_path only under this directory "
    "(default: anywhere on this host)",
    "log_level": "DEBUG, INFO, WARNING or ERROR (also LORAFLEET_LOG_LEVEL)",
}


def _flag(name: str) -> str:
    return name.replace("_", "-")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m services.gateway",
        description="lorafleet HTTP gateway: OpenAI-compatible completions and chat, and a REST "
        "adapter registry, over the inference service and the adapter store.",
        epilog=f"Every flag can also be set with {ENV_PREFIX}<FLAG>, e.g. {ENV_PREFIX}PORT=8000.",
    )
    for f in fields(GatewayConfig):
        parser.add_argument(
            "--" + _flag(f.name), dest=f.name, default=None, help=_HELP[f.name],
            type=_TYPES.get(f.name, str),
        )  # fmt: skip
    return parser
