"""ServiceConfig: every setting of the inference service, from flags and environment variables.

This is the one place that reads the environment. Each flag has a variable,
LORAFLEET_INFERENCE_<FLAG> (e.g. LORAFLEET_INFERENCE_ADAPTER_STORE for --adapter-store); a flag
on the command line wins over its variable. Two settings also honour the variables the whole stack
shares: LORAFLEET_LOG_LEVEL and LORAFLEET_ADAPTER_STORE.
"""

from __future__ import annotations

import argparse
import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, fields
from pathlib import Path

from services.flag_env import flag_values
from services.inference.engine.limits import RequestLimits
from services.inference.models.config import LOAD_FORMATS

ENV_PREFIX = "LORAFLEET_INFERENCE_"
DEVICES = ("cpu", "cuda", "auto")
LOG_LEVELS = ("DEBUG", "INFO", "WARNING", "ERROR")
ENGINE_MODES = ("process", "thread")
SCHEDULING = ("fair", "fcfs")
PRELOAD = ("pool", "host", "off")
ON_OFF = ("on", "off")
# Flags that take one of a few words: the parser's choices and __post_init__'s check.
_CHOICES = {
    "device": DEVICES, "engine": ENGINE_MODES, "scheduling": SCHEDULING,
    "preload_adapters": PRELOAD, "lora_side_stream": ON_OFF, "load_format": LOAD_FORMATS,
    "cuda_graphs": ON_OFF, "lora_addend": ON_OFF,
}  # fmt: skip
_FILES = (
    "auth_tokens", "tls_cert", "tls_key", "tls_client_ca",
    "adapter_store_token_file", "adapter_store_ca", "adapter_store_cert", "adapter_store_key",
)  # fmt: skip


@dataclass(frozen=True)
class ServiceConfig:
    model: Path
    served_model_name: str | None = None  # the base model's id for clients; None = model.name
    adapter_store: str | None = None  # HOST:PORT; None = base model only
    host: str = "127.0.0.1"
    port: int = 50052
    device: str = "auto"
    metrics_port: int | None = None  # None = no metrics endpoint
    # requests waiting (for an adapter or a batch slot) before refusals; None: 16 per slot
    max_queue: int | None = None
    max_num_seqs: int | None = None  # requests in the running batch at once; None: from memory
    # tokens one step computes (prefill chunks + decodes); None: 2048, or max_num_seqs if more
    max_num_batched_tokens: int | None = None
    num_pages: int | None = None  # page pool size; None = derived from pool_memory_mb
    pool_memory_mb: int | None = None  # page pool budget; None = the engine's default
    # share of the GPU's memory the engine may fill (the pool takes what the rest leaves)
    gpu_memory_utilization: float = 0.93
    max_loras: int | None = None  # adapters resident in the page pool at once; None: from memory
    max_lora_rank: int = 128
    tensor_parallel_size: int = 1  # ranks the model is sharded over (engine/tensor_parallel.py)
    # Host cache (pinned on CUDA) of adapters, a superset of the pool; None: from the host's
    # memory (default_host_cache_bytes).
    host_cache_mb: int | None = None
    store_timeout_s: float = 10.0  # deadline of a store lookup (GetAdapter)
    fetch_timeout_s: float = 120.0  # deadline of one adapter fetch
    max_fetches: int = 8  # adapters streamed from the store at once; the rest wait in order
    # pool: the store's adapters are fetched into the host cache's free room ahead of requests,
    # then copied into free pool pages; host: the host cache only; off: neither (preload.py)
    preload_adapters: str = "pool"
    shutdown_grace_s: float = 5.0  # in-flight streams may finish within this after SIGTERM
    log_level: str = "INFO"
    engine: str = "process"  # where the step loop runs: its own process, or a thread here
    step_log: Path | None = None  # one JSON line per engine step (engine/step_log.py)
    # Per-request inputs, each checked before work proportional to it (engine/limits.py).
    max_request_id_chars: int = RequestLimits.max_request_id_chars
    max_prompt_bytes: int = RequestLimits.max_prompt_bytes
    max_prompt_tokens: int = RequestLimits.max_prompt_tokens
    max_stop_strings: int = RequestLimits.max_stop_strings
    max_stop_string_chars: int = RequestLimits.max_stop_string_chars
    max_stop_token_ids: int = RequestLimits.max_stop_token_ids
    # Tenancy: tokens (services/auth.py), TLS (services/tls.py), the store client's credentials.
    auth_tokens: Path | None = None  # None = no authentication
    tls_cert: Path | None = None
    tls_key: Path | None = None
    tls_client_ca: Path | None = None  # mutual TLS
    adapter_store_token_file: Path | None = None  # this service's token at the store
    adapter_store_ca: Path | None = None  # set: the store is reached over TLS
    adapter_store_cert: Path | None = None  # client certificate for a store with mutual TLS
    adapter_store_key: Path | None = None
    # Per-tenant quotas (services/inference/tenancy.py); None = unlimited.
    tenant_max_in_flight: int | None = None  # Generate calls in progress
    tenant_max_queued: int | None = None  # calls not yet streaming their first token
    tenant_tokens_per_second: float | None = None  # prompt + generated tokens
    # Adapter bytes one tenant may keep pinned (LoadAdapter pin); None: TENANT_PIN_SHARE of the
    # host cache (tenant_pinned_bytes)
    tenant_max_pinned_mb: float | None = None
    scheduling: str = "fair"  # fair: tenants share the batch (engine/fairness.py); fcfs
    fair_prefill_tokens: int = 256  # per tenant and step while tenants share (fair only)
    adapter_affinity: int | None = None  # engine/affinity.py's bound; 0 off; None 2x max seqs
    lora_side_stream: str = "on"  # on: small decode steps' LoRA beside the base GEMMs (CUDA)
    lora_addend: str = "on"  # on: large steps' GEMMs add onto their LoRA deltas
    load_format: str = "safetensors"  # or random: weights drawn at load (benchmarks)
    cuda_graphs: str = "on"  # on: steps replay CUDA graphs captured at start-up; off: eager

    def __post_init__(self) -> None:
        if not str(self.model):
            raise ValueError("--model is required: a Hugging Face-format model directory")
        for name, words in _CHOICES.items():
            if getattr(self, name) not in words:
                raise ValueError(
                    f"--{_flag(name)} must be one of {words}, got {getattr(self, name)!r}"
                )
        if self.log_level.upper() not in LOG_LEVELS:
            raise ValueError(f"--log-level must be one of {LOG_LEVELS}, got {self.log_level!r}")
        object.__setattr__(self, "log_level", self.log_level.upper())
        object.__setattr__(self, "model", Path(self.model))
        served = self.served_model_name
        if served is not None and (
            not served or served.strip() != served or not served.isprintable()
        ):
            raise ValueError(
                "--served-model-name must be non-empty printable text without surrounding "
                f"spaces, got {served!r}"
            )
        for name in ("port", "metrics_port"):
            value = getattr(self, name)
            if value is not None and not 0 <= value <= 65535:
                raise ValueError(f"--{_flag(name)} must be a TCP port (0..65535), got {value}")
        if self.adapter_store is not None:
            host, sep, port = self.adapter_store.rpartition(":")
            if not sep or not host or not port.isdigit():
                raise ValueError(f"--adapter-store must be HOST:PORT, got {self.adapter_store!r}")
        for name in ("max_lora_rank", "tensor_parallel_size", "fair_prefill_tokens",
                     "max_fetches", *_LIMITS):  # fmt: skip
            if getattr(self, name) < 1:
                raise ValueError(f"--{_flag(name)} must be at least 1, got {getattr(self, name)}")
        optional = (
            "num_pages", "pool_memory_mb", "max_queue", "max_num_seqs", "max_loras",
            "host_cache_mb", "max_num_batched_tokens",
        )  # fmt: skip
        for name in optional:
            value = getattr(self, name)
            if value is not None and value < 1:
                raise ValueError(f"--{_flag(name)} must be at least 1, got {value}")
        if self.host_cache_mb is not None:
            memory = host_memory_bytes()
            most = int(memory * HOST_CACHE_MAX_SHARE) // 2**20
            if self.host_cache_mb > most:
                raise ValueError(
                    f"--host-cache-mb {self.host_cache_mb} is more than this host can give it: "
                    f"{memory / 2**30:.1f} GiB of memory (its control group's limit where "
                    f"lower), of which the host cache may take {HOST_CACHE_MAX_SHARE:.0%}, "
                    f"{most} MiB"
                )
        if self.adapter_affinity is not None and self.adapter_affinity < 0:
            raise ValueError(
                f"--adapter-affinity must be 0 (off) or positive, got {self.adapter_affinity}"
            )
        step, seqs = self.max_num_batched_tokens, self.max_num_seqs
        if step is not None and seqs is not None and step < seqs:
            raise ValueError(f"--max-num-batched-tokens ({step}) must be at least --max-num-seqs "
                             f"({seqs}): every running request decodes each step")  # fmt: skip
        share = self.gpu_memory_utilization
        if not 0.0 < share <= 1.0:
            raise ValueError(f"--gpu-memory-utilization must be in (0, 1], got {share}")
        for name in ("store_timeout_s", "fetch_timeout_s"):
            if getattr(self, name) <= 0:
                raise ValueError(f"--{_flag(name)} must be positive, got {getattr(self, name)}")
        if self.shutdown_grace_s < 0:
            raise ValueError(f"--shutdown-grace-s must be >= 0, got {self.shutdown_grace_s}")
        self._check_tenancy()

    def _check_tenancy(self) -> None:
        for name in _FILES:
            value = getattr(self, name)
            if value is not None:
                object.__setattr__(self, name, Path(value))
                if not Path(value).is_file():
                    raise ValueError(f"--{_flag(name)} {value} is not a file")
        if (self.tls_cert is None) != (self.tls_key is None):
            raise ValueError("--tls-cert and --tls-key go together: give both or neither")
        if self.tls_client_ca is not None and self.tls_cert is None:
            raise ValueError("--tls-client-ca needs --tls-cert and --tls-key (mutual TLS)")
        if (self.adapter_store_cert is None) != (self.adapter_store_key is None):
            raise ValueError("--adapter-store-cert and --adapter-store-key go together")
        if self.adapter_store_cert is not None and self.adapter_store_ca is None:
            raise ValueError("--adapter-store-cert needs --adapter-store-ca (TLS to the store)")
        for name in (
            "tenant_max_in_flight", "tenant_max_queued", "tenant_tokens_per_second",
            "tenant_max_pinned_mb",
        ):  # fmt: skip
            value = getattr(self, name)
            if value is not None and not value > 0:
                raise ValueError(f"--{_flag(name)} must be positive, got {value}")

    @property
    def address(self) -> str:
        return f"{self.host}:{self.port}"

    @property
    def model_id(self) -> str:
        """The base model's id, as GetModelInfo and GetStats report it."""
        return self.served_model_name or Path(os.path.abspath(self.model)).name

    @property
    def host_cache_bytes(self) -> int:
        """--host-cache-mb, or a share of the host's memory when it is not given."""
        if self.host_cache_mb is not None:
            return self.host_cache_mb * 2**20
        return default_host_cache_bytes(host_memory_bytes())

    @property
    def tenant_pinned_bytes(self) -> int:
        """--tenant-max-pinned-mb, or TENANT_PIN_SHARE of the host cache: what one tenant's
        pins may hold of the host cache and the page pool, so that no tenant's pins alone
        leave the others no room."""
        if self.tenant_max_pinned_mb is not None:
            return int(self.tenant_max_pinned_mb * 2**20)
        return int(self.host_cache_bytes * TENANT_PIN_SHARE)

    @property
    def limits(self) -> RequestLimits:
        return RequestLimits(**{name: getattr(self, name) for name in _LIMITS})

    @classmethod
    def from_args(
        cls, argv: Sequence[str] | None = None, environ: Mapping[str, str] | None = None
    ) -> ServiceConfig:
        """Parses flags over environment defaults. Errors exit with argparse's usage message."""
        env = os.environ if environ is None else environ
        parser = build_parser()
        args = parser.parse_args(argv)
        values = flag_values(cls, args, env, ENV_PREFIX, _SHARED_ENV, _TYPES, parser)
        if "model" not in values:
            parser.error(f"--model is required (or set {ENV_PREFIX}MODEL)")
        try:
            return cls(**values)
        except ValueError as exc:
            parser.error(str(exc))
            raise  # unreachable: parser.error exits


_LIMITS = tuple(f.name for f in fields(RequestLimits))

# Without --host-cache-mb the host cache takes this share of the host's memory, within bounds:
# a quarter leaves the rest to the processes, the page cache and (on CUDA) the driver, whose
# pinned memory cannot be swapped; 32 GiB on a 128 GiB machine.
HOST_CACHE_SHARE = 0.25
# The share of the host cache one tenant's pinned adapters may hold by default: a few tenants
# pinning their most used adapters fit together, and no one tenant's pins fill the cache (a
# cache full of pins fails every other request for a cold adapter) or the pool's pages.
TENANT_PIN_SHARE = 0.125
HOST_CACHE_MIN, HOST_CACHE_MAX = 1 << 30, 64 << 30
# --host-cache-mb may take at most this share of the host's memory: the cache fills as adapters
# arrive (pinned on CUDA, where it cannot be swapped), so one larger than the memory beside the
# processes' own would end with the service killed for memory, every tenant's requests with it.
HOST_CACHE_MAX_SHARE = 0.75
# Memory limits of the process's control group (v2, then v1): a container's share of the host.
_CGROUP_LIMITS = ("/sys/fs/cgroup/memory.max", "/sys/fs/cgroup/memory/memory.limit_in_bytes")


def host_memory_bytes() -> int:
    """The machine's physical memory, or its control group's limit when that is lower."""
    memory = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    for path in _CGROUP_LIMITS:
        try:
            limit = Path(path).read_text().strip()
        except OSError:
            continue
        if limit.isdigit():  # "max": no limit
            memory = min(memory, int(limit))
    return memory


def default_host_cache_bytes(memory: int) -> int:
    """HOST_CACHE_SHARE of ``memory`` in whole MiB, between HOST_CACHE_MIN and HOST_CACHE_MAX."""
    share = int(memory * HOST_CACHE_SHARE) // 2**20 * 2**20
    return max(HOST_CACHE_MIN, min(HOST_CACHE_MAX, share))


# Variables the whole stack shares (the CLI finds the store through LORAFLEET_ADAPTER_STORE too).
_SHARED_ENV = {"log_level": "LORAFLEET_LOG_LEVEL", "adapter_store": "LORAFLEET_ADAPTER_STORE"}

_TYPES = {
    "model": Path,
    "step_log": Path,
    "port": int,
    "metrics_port": int,
    "max_queue": int,
    "max_num_seqs": int,
    "max_num_batched_tokens": int,
    "num_pages": int,
    "pool_memory_mb": int,
    "gpu_memory_utilization": float,
    "max_loras": int,
    "max_lora_rank": int,
    "tensor_parallel_size": int,
    "fair_prefill_tokens": int,
    "adapter_affinity": int,
    "host_cache_mb": int,
    "store_timeout_s": float,
    "fetch_timeout_s": float,
    "max_fetches": int,
    "shutdown_grace_s": float,
    **dict.fromkeys(_LIMITS, int),
    **dict.fromkeys(_FILES, Path),
    "tenant_max_in_flight": int,
    "tenant_max_queued": int,
    "tenant_tokens_per_second": float,
    "tenant_max_pinned_mb": float,
}

_L = RequestLimits()  # the defaults the help texts name

_HELP = {
    "model": "Hugging Face-format model directory (config.json, safetensors, tokenizer.json)",
    "served_model_name": "the base model's id for clients (GetModelInfo; the HTTP gateway's "
    "`model`); default: the model directory's name",
    "adapter_store": "adapter store address HOST:PORT (also LORAFLEET_ADAPTER_STORE; without "
    "it, only the base model serves)",
    "host": "address to listen on (default 127.0.0.1; 0.0.0.0 for every interface)",
    "port": "gRPC port (default 50052)",
    "device": "cpu, cuda or auto (cuda when a GPU is visible)",
    "metrics_port": "serve Prometheus metrics over HTTP on this port",
    "max_queue": "requests allowed to wait before new ones get RESOURCE_EXHAUSTED (default: "
    "16 per running slot, at least 1024)",
    "max_num_seqs": "requests in the running batch at once (default: as many as the page pool "
    "holds at 400 tokens each, 16 to 512, on a GPU; 64 on the CPU)",
    "num_pages": "pages in the unified KV/adapter pool (default: from --pool-memory-mb)",
    "pool_memory_mb": "memory for the unified page pool in MiB (default: what "
    "--gpu-memory-utilization leaves)",
    "gpu_memory_utilization": "share of the GPU's memory the engine may fill (default 0.93): "
    "the page pool gets what the weights and the activations leave of it, leaving at least 6 "
    "GiB per 32 layers for the CUDA graphs; GetStats and the metrics report what stays free",
    "max_loras": "adapters resident in the page pool at once (default: from memory, a LoRA "
    "index row per pool page within 1%% of the pool's bytes, at least 16)",
    "max_lora_rank": "largest adapter rank accepted (default 128)",
    "load_format": "safetensors (default): the model directory's weights; random: each weight "
    "drawn at load from a seed of its name, for benchmarks of shapes whose checkpoint does not "
    "fit the disk (the directory then needs config.json and the tokenizer only)",
    "tensor_parallel_size": "processes the model is sharded over (default 1): one per GPU, "
    "NCCL between them; gloo on the CPU. Heads, kv heads and the MLP width must divide by it",
    "host_cache_mb": "host cache for adapters in MiB, pinned on CUDA (default: from memory, "
    "25%% of the host's memory or of its cgroup's limit if lower, 1 to 64 GiB)",
    "store_timeout_s": "deadline in seconds of an adapter lookup in the store (default 10)",
    "fetch_timeout_s": "deadline in seconds of one adapter download (default 120; a download "
    "waiting for its turn is not counted)",
    "max_fetches": "adapters downloaded from the store at once (default 8); the others wait, "
    "first come first served, so a burst of cold adapters arrives one after another rather "
    "than all at the end",
    "preload_adapters": "pool (default): fetch the store's adapters (each one's latest "
    "version) into the host cache's free room ahead of their first request, up to four at a "
    "time (128 MiB between them) while no request's fetch runs, evicting nothing, and copy each "
    "into the page pool while half of its pages stay free; host: the host cache only; off: "
    "fetch an adapter when a request wants it",
    "shutdown_grace_s": "seconds in-flight streams may finish after SIGTERM (default 5)",
    "log_level": "DEBUG, INFO, WARNING or ERROR (also LORAFLEET_LOG_LEVEL)",
    "engine": "where the engine's step loop runs: 'process' (default: its own process, so no "
    "gRPC Python shares its GIL) or 'thread' (a thread of the service process)",
    "step_log": "append one JSON line per engine step to this file (tokens, KV read, host and "
    "GPU time: what bench/serving.py reads)",
    "max_request_id_chars": f"longest request_id accepted (default {_L.max_request_id_chars})",
    "max_prompt_bytes": "largest text prompt in UTF-8 bytes, checked before tokenizing "
    f"(default {_L.max_prompt_bytes})",
    "max_prompt_tokens": f"most prompt tokens (default {_L.max_prompt_tokens}; the context "
    "window bounds them too)",
    "max_stop_strings": f"most stop strings per request (default {_L.max_stop_strings})",
    "max_stop_string_chars": "longest stop string in characters (default "
    f"{_L.max_stop_string_chars})",
    "max_stop_token_ids": f"most stop_token_ids per request (default {_L.max_stop_token_ids})",
    "auth_tokens": "JSON file of sha256 token digests with roles (README, Tenancy); without it "
    "there is no authentication",
    "tls_cert": "PEM certificate chain: serve TLS (with --tls-key)",
    "tls_key": "PEM private key of --tls-cert",
    "tls_client_ca": "PEM CA certificates: require client certificates (mutual TLS)",
    "adapter_store_token_file": "file holding this service's token at the adapter store (role "
    "service); sent with every store call",
    "adapter_store_ca": "PEM CA certificates: reach the adapter store over TLS, trusting these",
    "adapter_store_cert": "PEM client certificate for an adapter store with mutual TLS",
    "adapter_store_key": "PEM private key of --adapter-store-cert",
    "tenant_max_in_flight": "Generate calls one tenant may have in progress (default unlimited)",
    "tenant_max_queued": "calls of one tenant that may wait for their first token (default "
    "unlimited)",
    "tenant_tokens_per_second": "prompt + generated tokens per second one tenant may use on "
    "average, in bursts of one second's worth (default unlimited)",
    "tenant_max_pinned_mb": "MiB of adapters one tenant may keep pinned (LoadAdapter pin; "
    "default: an eighth of the host cache)",
    "scheduling": "fair (default: tenants share the running batch, least served first) or fcfs "
    "(first come, first served)",
    "fair_prefill_tokens": "with --scheduling fair and several tenants active: prefill tokens "
    "each tenant gets per step, keeping steps short for the others' first tokens (default 256)",
    "adapter_affinity": "queued requests whose adapter the running batch already uses join "
    "before others (fewer distinct adapters a step); each request is passed at most this many "
    "times, and only the first this many of a tenant's queue are looked at (default twice "
    "--max-num-seqs; 0: arrival order)",
    "max_num_batched_tokens": "tokens one step computes, prefill chunks and decodes (default "
    "2048, or --max-num-seqs if more); the largest mixed step's CUDA graph",
    "cuda_graphs": "on (default): decode and mixed steps replay CUDA graphs captured at start-up "
    "(a few minutes on a large model); off: every step runs eagerly (a faster start, slower "
    "steps)",
    "lora_side_stream": "on (default): decode steps of up to 32 tokens compute their LoRA deltas "
    "on a second CUDA stream beside the base model's GEMMs, then add them; off: the LoRA "
    "kernels run after each GEMM, in place",
    "lora_addend": "on (default): steps of 256 tokens or more whose LoRA calls are all fused "
    "write each call's LoRA delta first and the base GEMM adds onto it, instead of the LoRA "
    "kernel reading the GEMM's output back; off: in place after the GEMM",
}


def _flag(name: str) -> str:
    return name.replace("_", "-")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m services.inference",
        description="lorafleet inference service: gRPC token streaming over one base model "
        "and many LoRA adapters fetched from the adapter store.",
        epilog=f"Every flag can also be set with {ENV_PREFIX}<FLAG>, e.g. "
        f"{ENV_PREFIX}ADAPTER_STORE=localhost:50051.",
    )
    for f in fields(ServiceConfig):
        kwargs: dict = {"default": None, "help": _HELP[f.name], "type": _TYPES.get(f.name, str)}
        if f.name in _CHOICES:
            kwargs["choices"] = _CHOICES[f.name]
        parser.add_argument("--" + _flag(f.name), dest=f.name, **kwargs)
    return parser
