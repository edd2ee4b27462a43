"""EngineCore: the synchronous engine. One call to step() runs one batch and returns its outputs.

It owns the model, the page pool, the adapter manager, the scheduler and the sampler, and runs
on one thread (engine.py puts it on a dedicated one). prepare(), add_adapter() and
remove_adapter() are safe from other threads: they validate and register, and touch the pool
only through the adapter manager's lock-guarded table.
"""

from __future__ import annotations

import itertools
import logging
import operator
import threading
from collections.abc import Callable
from pathlib import Path

import torch

from kernels.lora_layout import MODULES, plan_adapter
from services.inference.engine.adapter_manager import AdapterManager, AdapterState
from services.inference.engine.adapter_spec import AdapterSpec
from services.inference.engine.api import (
    AdapterKey,
    EngineStats,
    FinishReason,
    GenerationOutput,
    GenerationRequest,
)
from services.inference.engine.batch import BatchEntry
from services.inference.engine.config import EngineConfig
from services.inference.engine.detokenizer import IncrementalDetokenizer, StopStringMatcher
from services.inference.engine.errors import (
    AdapterLoadFailed,
    DuplicateRequest,
    EngineOverloaded,
    InvalidRequest,
    ModelLoadError,
    UnknownAdapter,
)
from services.inference.engine.gc_pacing import collect_if_due
from services.inference.engine.host_adapter import HostAdapter, build_host_adapter
from services.inference.engine.model_runner import ModelRunner
from services.inference.engine.page_allocator import OwnerKind
from services.inference.engine.page_pool import PagePool, pages_needed
from services.inference.engine.pool_sizing import context_window, pool_pages
from services.inference.engine.request import Sequence, SequenceStatus
from services.inference.engine.sampler import Sampler, make_generator
from services.inference.engine.scheduler import Scheduler
from services.inference.engine.token_output import append_token
from services.inference.models.config import CONFIG, ModelConfig, read_config_json
from services.inference.models.loader import load_model
from services.inference.tokenizer import Tokenizer, TokenizerError
from store.peft import BaseModelShape

log = logging.getLogger(__name__)

# Called with (request_id, logits [vocab] float32) for every sampled token: a test hook.
LogitsHook = Callable[[str, torch.Tensor], None]


class EngineCore:
    def __init__(self, config: EngineConfig, logits_hook: LogitsHook | None = None) -> None:
        self.config = config
        self.device, self.dtype = config.torch_device, config.torch_dtype
        model_dir = Path(config.model_dir)
        raw_config = read_config_json(model_dir)  # read once: the model, the adapters' shape
        self.model_config = ModelConfig.from_dict(raw_config, source=str(model_dir / CONFIG))
        self.base_shape = BaseModelShape.from_hf_config(raw_config)
        self.max_len = context_window(self.model_config, config.max_model_len)
        try:
            self.tokenizer = Tokenizer.from_model_dir(model_dir)
        except TokenizerError as e:
            raise ModelLoadError(str(e)) from e
        self.model = load_model(model_dir, self.device, self.dtype, self.max_len, self.model_config)

        mc = self.model_config
        width = mc.kv_dim
        num_pages = pool_pages(config, mc, self.device, self.dtype)
        self.pool = PagePool(
            mc.num_layers, width, num_pages, config.page_size, self.dtype, self.device
        )
        # The LoRA index's slot-table width fits the largest adapter allowed: every module at
        # max_lora_rank.
        dims = {m: tuple(self.base_shape.module_dims(name)) for m, name in enumerate(MODULES)}
        biggest = plan_adapter(dict.fromkeys(dims, config.max_lora_rank), dims, width)
        capacity = pages_needed(biggest.num_slots, config.page_size) * config.page_size
        self.adapters = AdapterManager(self.pool, config.max_loras, capacity)
        self.scheduler = Scheduler(
            self.pool, self.adapters, config.max_num_seqs, config.max_num_batched_tokens,
            config.scheduling,
        )  # fmt: skip
        self.runner = ModelRunner(
            self.model, self.pool, self.adapters.index, config.max_lora_rank,
            config.max_num_seqs, config.max_num_batched_tokens, self.max_len, config.max_loras,
            self.adapters.row_ranks,
        )  # fmt: skip
        if config.cuda_graphs and self.device.type == "cuda":
            self.runner.capture_graphs(config.graph_batch_sizes)
        self.sampler = Sampler()
        self.logits_hook = logits_hook
        self._seq_ids = itertools.count()
        self._lock = threading.Lock()
        self._live: dict[str, Sequence] = {}  # request_id -> sequence, prepared until finished
        self.steps = self.computed_tokens = self.generated_tokens = 0
        self.last_step_ran = False
        log.info(
            "engine ready: %d pages of %d tokens (%.1f MiB), context %d, device %s, %s",
            num_pages, config.page_size, self.pool.tensor.nbytes / 2**20, self.max_len,
            self.device, self.dtype,
        )  # fmt: skip

    # --- adapters (any thread) --------------------------------------------------------------

    def add_adapter(
        self,
        key: AdapterKey,
        config_json: bytes | str | dict,
        weights: bytes | memoryview | torch.Tensor,
        spec: AdapterSpec | None = None,
    ) -> HostAdapter:
        """Validate (store.peft) and keep an adapter in host memory, where ``weights`` lie (not
        copied; on CUDA pass pinned memory, or it is copied once into pinned memory). It is placed
        in the pool when a request needs it. Raises AdapterFormatError, BaseModelMismatch,
        InvalidRequest. The caller keeps ``weights`` unchanged until releasable(key) after
        remove_adapter(key). ``spec``: see build_host_adapter (validated elsewhere)."""
        if not isinstance(key, AdapterKey):
            raise TypeError("key must be an AdapterKey")
        host = build_host_adapter(
            key, config_json, weights, self.base_shape, self.pool.width,
            self.config.max_lora_rank, pin=self.device.type == "cuda", spec=spec,
        )  # fmt: skip
        need = self.adapters.pages_of(host)
        if need > self.pool.num_usable:
            raise InvalidRequest(
                f"adapter {key} needs {need} pool pages; the pool has {self.pool.num_usable}"
            )
        if not self.adapters.add(host):
            raise InvalidRequest(f"adapter {key} is already loaded; remove it first")
        log.info("adapter %s added: rank %d, %d pool pages", key, host.max_rank, need)
        return host

    def add_adapter_dir(self, key: AdapterKey, path: str | Path) -> HostAdapter:
        path = Path(path)
        cfg, weights = path / "adapter_config.json", path / "adapter_model.safetensors"
        for f in (cfg, weights):
            if not f.is_file():
                raise InvalidRequest(f"{f} is missing: not a PEFT adapter directory")
        return self.add_adapter(key, cfg.read_bytes(), weights.read_bytes())

    def remove_adapter(self, key: AdapterKey) -> None:
        """New requests cannot use it; requests already using it finish on it."""
        self.adapters.remove(key)

    # --- requests ---------------------------------------------------------------------------

    def prepare(self, request: GenerationRequest) -> Sequence:
        """Validate a request and make its sequence; any thread. Raises before anything is
        queued: InvalidRequest, DuplicateRequest, UnknownAdapter, EngineOverloaded."""
        sp = request.sampling
        if request.prompt is not None:
            ids = self.tokenizer.encode(request.prompt)
        else:
            ids = [_token_id(t) for t in request.prompt_token_ids]
        if not ids:
            raise InvalidRequest(f"request {request.request_id}: the prompt is empty")
        vocab = self.model_config.vocab_size
        for i, t in enumerate(ids):
            if t is None or not 0 <= t < vocab:
                given = t if request.prompt_token_ids is None else request.prompt_token_ids[i]
                raise InvalidRequest(
                    f"request {request.request_id}: prompt token {i} is "
                    f"{given!r}, outside the vocabulary [0, {vocab})"
                )
        if len(ids) + sp.max_new_tokens > self.max_len:
            raise InvalidRequest(
                f"request {request.request_id}: {len(ids)} prompt tokens + max_new_tokens "
                f"{sp.max_new_tokens} exceed the context window of {self.max_len} tokens"
            )
        adapter_pages = 0
        if request.adapter is not None:
            host = self.adapters.get(request.adapter)
            if host is None:
                raise UnknownAdapter(f"adapter {request.adapter} is not loaded in this engine")
            adapter_pages = self.adapters.pages_of(host)
        kv_pages = pages_needed(len(ids) + sp.max_new_tokens, self.pool.page_size)
        if kv_pages + adapter_pages > self.pool.num_usable:
            raise InvalidRequest(
                f"request {request.request_id} needs {kv_pages} KV pages + {adapter_pages} "
                f"adapter pages; the pool has {self.pool.num_usable}"
            )
        eos = frozenset() if sp.ignore_eos else self.tokenizer.eos_token_ids
        with self._lock:
            if request.request_id in self._live:
                raise DuplicateRequest(f"request id {request.request_id!r} is already in flight")
            if len(self._live) >= self.config.max_queue:
                raise EngineOverloaded(
                    f"{len(self._live)} requests in flight (max_queue {self.config.max_queue})"
                )
            if request.adapter is not None:
                self.adapters.acquire(request.adapter)  # may still raise UnknownAdapter
            seq = Sequence(
                request_id=request.request_id,
                seq_id=next(self._seq_ids),
                prompt_ids=ids,
                sampling=sp,
                adapter=request.adapter,
                finish_ids=eos | frozenset(sp.stop_token_ids),
                eos_ids=eos,
                generator=make_generator(sp, self.device),
                detokenizer=IncrementalDetokenizer(self.tokenizer, ids),
                stops=StopStringMatcher(sp.stop),
                tenant=request.tenant,
            )
            self._live[request.request_id] = seq
        return seq

    def enqueue(self, seq: Sequence) -> None:
        """Queue a prepared sequence (step thread); one aborted meanwhile is dropped."""
        if seq.status is not SequenceStatus.FINISHED:
            self.scheduler.add(seq)

    def add_request(self, request: GenerationRequest) -> None:
        """prepare() + enqueue(), for callers that drive step() themselves."""
        self.enqueue(self.prepare(request))

    def abort(self, request_id: str) -> GenerationOutput | None:
        """Finish a request now and free its pages (step thread); None if it is not in flight."""
        with self._lock:
            seq = self._live.get(request_id)
        if seq is None or seq.status is SequenceStatus.FINISHED:
            return None
        text = ""  # held-back text is dropped: the caller asked to stop
        return self._finish(seq, FinishReason.ABORT, (), text)

    def take_load_failures(
        self,
    ) -> tuple[list[tuple[str, AdapterLoadFailed]], dict[AdapterKey, BaseException]]:
        """End the queued requests whose adapter's copy into the pool failed (step thread):
        (request_id, error) for each, and the failed adapters with the cause. Until this is
        called a failed adapter is not copied again (AdapterManager.take_failed_loads)."""
        failed = self.adapters.take_failed_loads()
        errors = []
        for seq in list(self.scheduler.waiting) if failed else ():
            cause = failed.get(seq.adapter)
            if cause is not None:
                self._finish(seq, FinishReason.ABORT, (), "")
                errors.append((seq.request_id, load_failed(seq.adapter, cause)))
        return errors, failed

    def abort_all(self) -> list[GenerationOutput]:
        with self._lock:
            ids = list(self._live)
        return [out for rid in ids if (out := self.abort(rid)) is not None]

    @property
    def has_work(self) -> bool:
        return self.scheduler.has_work

    # --- the step ---------------------------------------------------------------------------

    def step(self, during: Callable[[], None] | None = None) -> list[GenerationOutput]:
        """Schedule, run one forward pass, sample, detokenize; returns this step's outputs.
        ``during`` runs once the step's GPU work is queued, before waiting for it (Engine
        applies its queued commands there). ``last_step_ran`` tells whether anything could
        run (it cannot while every queued request waits for an adapter copy)."""
        self.adapters.reap()
        scheduled = self.scheduler.schedule()
        self.last_step_ran = bool(scheduled)
        if not scheduled:
            self.adapters.issue_loads()  # no step to overlap with
            collect_if_due()  # nothing runs while queued requests wait: collect meanwhile
            return []
        entries = [
            BatchEntry(
                s.seq.next_chunk(s.num_tokens),
                s.seq.num_computed,
                self.pool.kv_pages(s.seq.seq_id),
                s.lora_row,
                s.samples,
            )  # fmt: skip
            for s in scheduled
        ]
        logits = self.runner.execute(entries)  # [sampling sequences, vocab]
        # The GPU computes meanwhile (the step's work is queued; the sampler's sync waits for
        # it), so the adapter copies prepared for this step are issued now, and a collection
        # due now costs nothing; on CPU both simply run after the forward.
        self.adapters.issue_loads()
        if during is not None:
            during()
        collect_if_due()
        self.steps += 1
        sampling = [s.seq for s in scheduled if s.samples]
        for s in scheduled:
            s.seq.num_computed += s.num_tokens
            self.computed_tokens += s.num_tokens
        if not sampling:
            return []
        tokens = self.sampler(
            logits, [q.sampling for q in sampling], [q.generator for q in sampling]
        ).tolist()
        if self.logits_hook is not None:
            for i, seq in enumerate(sampling):
                self.logits_hook(seq.request_id, logits[i])
        return [self._append(seq, tok) for seq, tok in zip(sampling, tokens, strict=True)]

    def _append(self, seq: Sequence, token: int) -> GenerationOutput:
        self.generated_tokens += 1
        text, reason = append_token(seq, token, self.max_len)
        if reason is None:
            return self._output(seq, (token,), text, None)
        return self._finish(seq, reason, (token,), text)

    def _finish(
        self, seq: Sequence, reason: FinishReason, tokens: tuple[int, ...], text: str
    ) -> GenerationOutput:
        self.scheduler.remove(seq)
        seq.finish_reason = reason
        if seq.adapter is not None:
            self.adapters.release(seq.adapter)
        with self._lock:
            self._live.pop(seq.request_id, None)
        return self._output(seq, tokens, text, reason)

    @staticmethod
    def _output(seq, tokens, text, reason) -> GenerationOutput:
        return GenerationOutput(
            request_id=seq.request_id,
            token_ids=tokens,
            text=text,
            finish_reason=reason,
            prompt_tokens=len(seq.prompt_ids),
            completion_tokens=len(seq.output_ids),
        )

    # --- introspection ----------------------------------------------------------------------

    def check_integrity(self) -> None:
        self.pool.check_integrity()

    def stats(self) -> EngineStats:
        alloc = self.pool.allocator
        states = self.adapters.state_counts()
        return EngineStats(
            num_running=len(self.scheduler.running),
            num_waiting=len(self.scheduler.waiting),
            num_pages=self.pool.num_usable,
            free_pages=alloc.num_free,
            kv_pages=alloc.num_owned(OwnerKind.KV),
            adapter_pages=alloc.num_owned(OwnerKind.ADAPTER),
            adapters_in_pool=states[AdapterState.IN_POOL],
            adapters_loading=states[AdapterState.LOADING],
            adapters_host=states[AdapterState.HOST],
            steps=self.steps,
            computed_tokens=self.computed_tokens,
            generated_tokens=self.generated_tokens,
            preemptions=self.scheduler.preemptions,
            adapter_loads=self.adapters.loads,
            adapter_evictions=self.adapters.evictions,
        )


def load_failed(key: AdapterKey, cause: BaseException) -> AdapterLoadFailed:
    return AdapterLoadFailed(
        f"adapter {key} could not be copied into the GPU page pool "
        f"({type(cause).__name__}: {cause}); the engine keeps serving, retry later"
    )


def _token_id(value: object) -> int | None:
    """An integer token id (numpy integers included), or None for anything else."""
    if isinstance(value, bool):
        return None
    try:
        return operator.index(value)
    except TypeError:
        return None
