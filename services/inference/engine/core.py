"""EngineCore: the synchronous engine. launch() queues one step's GPU work and finish() reads its
tokens; the step loop launches step t + 1 before it finishes step t. step() is both, for one step.

It owns the model, the page pool, the adapter manager, the scheduler and the sampler, and runs
on one thread (engine.py puts it on a dedicated one). prepare(), add_adapter() and
remove_adapter() are safe from other threads: they validate and register, and touch the pool
only through the adapter manager's lock-guarded table.
"""

from __future__ import annotations

import itertools
import logging
import operator
import os
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import NamedTuple

import torch

from services.inference.arena import SharedArena
from services.inference.engine.adapter_manager import AdapterManager, AdapterState
from services.inference.engine.adapter_spec import AdapterSpec
from services.inference.engine.api import (
    AdapterKey,
    EngineStats,
    FinishReason,
    GenerationOutput,
    GenerationRequest,
    TokenLogprob,
    TopLogprob,
)
from services.inference.engine.batch import BatchEntry
from services.inference.engine.config import AFFINITY_BATCHES, EngineConfig
from services.inference.engine.detokenizer import IncrementalDetokenizer, StopStringMatcher
from services.inference.engine.errors import (
    AdapterLoadFailed,
    DuplicateRequest,
    EngineOverloaded,
    InvalidRequest,
    ModelLoadError,
    RequestFailed,
    UnknownAdapter,
)
from services.inference.engine.gc_pacing import collect_if_due
from services.inference.engine.gc_pacing import stats as gc_stats
from services.inference.engine.host_adapter import HostAdapter, build_host_adapter
from services.inference.engine.model_runner import ADDEND_MIN_TOKENS, ModelRunner
from services.inference.engine.page_allocator import OwnerKind
from services.inference.engine.page_pool import PagePool, page_bytes, pages_needed
from services.inference.engine.pool_sizing import (
    DeviceMemoryReader,
    context_window,
    engine_limits,
    lora_row_bytes,
    pool_pages,
    slot_capacity,
)
from services.inference.engine.request import Sequence, SequenceStatus
from services.inference.engine.sampler import Sampler, make_generator, to_device
from services.inference.engine.scheduler import Scheduler
from services.inference.engine.step_log import StepLog, StepRecord
from services.inference.engine.tensor_parallel import TensorParallel, WorkerLayout
from services.inference.engine.token_output import append_token
from services.inference.engine.token_transfer import TokenTicket, TokenTransfer
from services.inference.models.config import CONFIG, ModelConfig, read_config_json
from services.inference.models.loader import load_model
from services.inference.models.shard import Shard, shard_base_shape, shard_model_config
from services.inference.tokenizer import Tokenizer, TokenizerError
from store.peft import BaseModelShape

log = logging.getLogger(__name__)

# Steps in a row whose every sequence fails alone before the failure is the engine's (_execute).
MAX_FAILED_STEPS = 3
# Host time a launch may spend issuing adapter copies (AdapterManager.issue_loads): this share of
# the last step's GPU time, at least ISSUE_MIN_S. The step thread has the rest of the step for
# the previous step's tokens and the next step's scheduling.
ISSUE_SHARE, ISSUE_MIN_S = 0.25, 0.001
# Adapter bytes a launch may queue for transfer (AdapterManager.issue_loads): what this share of
# the last step's GPU time moves at the measured host -> device bandwidth, so that a transfer
# queued early in a step ends before it, leaving the copy engine free for the next step's inputs
# (adapter_copy.py). LORAFLEET_ADAPTER_DMA_SHARE=0: no byte budget (a transfer queued whole).
DMA_SHARE_ENV = "LORAFLEET_ADAPTER_DMA_SHARE"


def _dma_share() -> float:
    text = os.environ.get(DMA_SHARE_ENV, "0.5")
    try:
        share = float(text)
    except ValueError:
        share = -1.0
    if not 0.0 <= share <= 1.0:
        raise ValueError(f"{DMA_SHARE_ENV} must be a number from 0 to 1, got {text!r}")
    return share


DMA_SHARE = _dma_share()
# Called with (request_id, logits [vocab] float32) for every sampled token: a test hook.
LogitsHook = Callable[[str, torch.Tensor], None]


class LaunchedStep(NamedTuple):
    """A step whose GPU work is queued (EngineCore.launch), until finish() reads its tokens."""

    sampled: list[Sequence]  # the sequences it samples for, in row order
    ticket: TokenTicket | None  # their tokens on the way to the host; None: nothing sampled
    record: StepRecord
    logprob_rows: list[int]  # rows of ``sampled`` that asked for logprobs (ticket.extras)


class EngineCore:
    def __init__(
        self,
        config: EngineConfig,
        logits_hook: LogitsHook | None = None,
        arena: SharedArena | None = None,
    ) -> None:
        """``arena``: the host arena adapter bytes are added from (the engine process's), which
        tensor-parallel workers then map too: their loads read the bytes there."""
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
        n = config.tensor_parallel_size
        if n > 1 and self.device.type == "cuda" and torch.cuda.device_count() < n:
            raise ModelLoadError(
                f"tensor_parallel_size {n} needs {n} GPUs; torch sees {torch.cuda.device_count()}"
            )
        try:  # raises ValueError before any worker starts if the model does not split by n
            self.plan_shape = shard_base_shape(self.base_shape, n)  # one rank's adapter dims
            mc = shard_model_config(self.model_config, n)  # one rank's share of the model
        except ValueError as e:
            raise ModelLoadError(str(e)) from e
        # Ranks 1..n-1 load their shards while this one loads its own.
        self.tp = TensorParallel(config, arena) if n > 1 else None
        try:
            self._build(config, mc, Shard(0, n))
        except BaseException:
            self.close()
            raise
        self.logits_hook = logits_hook
        self._seq_ids = itertools.count()
        self._lock = threading.Lock()
        self._live: dict[str, Sequence] = {}  # request_id -> sequence, prepared until finished
        self._step_failures: list[tuple[str, RequestFailed]] = []  # take_step_failures
        self._failed_steps = 0  # steps in a row in which every sequence failed (_execute)
        self.steps = self.computed_tokens = self.generated_tokens = 0
        self.last_step_ran = False
        self._issue_budget_s = ISSUE_MIN_S  # from the last finished step's GPU time (finish)
        self._issue_bytes: int | None = None  # likewise (DMA_SHARE)
        log.info(
            "engine ready: %d pages of %d tokens (%.1f MiB), context %d, up to %d sequences "
            "per step and %d requests in flight, %d resident adapters (LoRA index %.1f MiB), "
            "adapter affinity %d, LoRA deltas as the GEMMs' addends %s, device %s, %s",
            self.pool.num_pages, config.page_size, self.pool.tensor.nbytes / 2**20, self.max_len,
            self.limits.max_num_seqs, self.limits.max_queue, self.limits.max_loras,
            self.limits.max_loras * lora_row_bytes(self.slot_capacity) / 2**20,
            self.scheduler.affinity,
            f"from {ADDEND_MIN_TOKENS} tokens" if config.lora_addend else "off",
            self.device, self.dtype,
        )  # fmt: skip

    def _build(self, config: EngineConfig, mc: ModelConfig, shard: Shard) -> None:
        """The model (this rank's shard), the pool and everything around it; with workers,
        the same layout on theirs. ``mc``: this rank's share of the model."""
        model_dir = Path(config.model_dir)
        self.model = load_model(
            model_dir, self.device, self.dtype, self.max_len, self.model_config, shard,
            config.load_format,
        )  # fmt: skip
        width = mc.kv_dim  # the pool holds this rank's kv heads
        num_pages = pool_pages(config, mc, self.device, self.dtype)
        capacity = slot_capacity(self.plan_shape, config.max_lora_rank, width, config.page_size)
        self.slot_capacity = capacity
        per_page = page_bytes(mc.num_layers, width, config.page_size, self.dtype)
        self.limits = engine_limits(config, num_pages, self.device, per_page, capacity)
        max_seqs, max_loras = self.limits.max_num_seqs, self.limits.max_loras
        self.pool = PagePool(
            mc.num_layers, width, num_pages, config.page_size, self.dtype, self.device
        )
        self.adapters = AdapterManager(self.pool, max_loras, capacity)
        self._memory = DeviceMemoryReader(self.device)
        self.scheduler = Scheduler(
            self.pool, self.adapters, max_seqs, config.max_num_batched_tokens, self.max_len,
            config.scheduling, config.fair_prefill_tokens,
            AFFINITY_BATCHES * max_seqs if config.adapter_affinity is None
            else config.adapter_affinity,
        )  # fmt: skip
        self.runner = ModelRunner(
            self.model, self.pool, self.adapters.index, config.max_lora_rank,
            max_seqs, config.max_num_batched_tokens, self.max_len, max_loras,
            self.adapters.row_ranks, self.adapters.row_modules, config.lora_side_stream,
            config.lora_addend,
        )  # fmt: skip
        graph_sizes = config.graph_sizes(max_seqs)
        if self.tp is not None:
            self.model.join_group(self.tp.group.all_reduce)
            self.tp.ready(WorkerLayout(num_pages, max_seqs, max_loras, capacity, self.max_len))
            self.adapters.copier.mirror = self.runner.tp = self.tp
            self.tp.agree_graphs(self.runner.graph_keys(*graph_sizes))
        if config.cuda_graphs and self.device.type == "cuda":  # the workers capture the same
            try:
                self.runner.capture_graphs(*graph_sizes)
            except Exception as exc:
                if self.tp is not None:  # a worker that failed its capture is the cause
                    raise self.tp.failure(exc) from exc
                raise
        self.sampler = Sampler()
        self._tokens = TokenTransfer(self.runner.batch.prev_tokens)
        self.step_log = StepLog(self.device, config.step_log)

    def check_workers(self) -> None:
        """WorkerDied if a tensor-parallel worker exited: the engine cannot step any more, so it
        stops at once, idle or not (its service exits for its supervisor)."""
        if self.tp is not None:
            self.tp.check_alive()

    def close(self) -> None:
        """Stop the tensor-parallel workers, if any (the engine calls this when it stops)."""
        if self.tp is not None:
            self.tp.close()

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
            shard=None if self.tp is None else Shard(0, self.tp.size),
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
        # Sizes first, each before any work proportional to it (limits.py); the service has
        # checked them already and passes token ids (it tokenizes: never on the step thread).
        limits = self.config.limits
        limits.check_request_id(request.request_id)
        limits.check_stops(sp.stop, len(sp.stop_token_ids))
        if request.prompt is not None:
            limits.check_prompt_text(request.prompt)
            given = self.tokenizer.encode(request.prompt)
        else:
            given = request.prompt_token_ids
        limits.check_prompt_tokens(len(given))
        if not given:
            raise InvalidRequest(f"request {request.request_id}: the prompt is empty")
        if len(given) + sp.max_new_tokens > self.max_len:
            raise InvalidRequest(
                f"request {request.request_id}: {len(given)} prompt tokens + max_new_tokens "
                f"{sp.max_new_tokens} exceed the context window of {self.max_len} tokens"
            )
        ids = _vocabulary_ids(given, self.model_config.vocab_size, request.request_id)
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
            if len(self._live) >= self.limits.max_queue:
                raise EngineOverloaded(
                    f"{len(self._live)} requests in flight (max_queue {self.limits.max_queue})"
                )
            adapter_bytes = 0
            if request.adapter is not None:  # may still raise UnknownAdapter
                adapter_bytes = self.adapters.acquire(request.adapter).nbytes
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
                adapter_bytes=adapter_bytes,
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

    def in_flight(self, request_id: str) -> bool:
        """Whether a request of this id is prepared and not finished (any thread)."""
        with self._lock:
            return request_id in self._live

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
        """Schedule, run one forward pass, sample, detokenize; returns this step's outputs
        (launch, then finish of the same step: no overlap). ``during`` runs once the step's GPU
        work is queued, before waiting for it. ``last_step_ran`` tells whether anything could
        run (it cannot while every queued request waits for an adapter copy)."""
        launched = self.launch(during)
        return [] if launched is None else self.finish(launched)

    def launch(self, during: Callable[[], None] | None = None) -> LaunchedStep | None:
        """Schedule the next step and queue its GPU work, sampling included, without waiting for
        it; None when nothing can run. The tokens it samples are in flight until finish(): a
        later launch may come first (the step loop launches step t + 1 before it finishes step
        t, so the host's work overlaps the GPU's); their ids reach that step on the device.
        ``during`` runs once the step's work is queued (Engine applies commands there)."""
        start = time.perf_counter()
        self.adapters.reap()
        scheduled = self.scheduler.schedule()
        self.last_step_ran = bool(scheduled)
        if not scheduled:
            self.adapters.issue_loads()  # no step to overlap with
            collect_if_due()  # nothing runs while queued requests wait: collect meanwhile
            return None
        mark = self.step_log.mark()
        entries = []
        for s in scheduled:
            ids, pending = s.seq.next_chunk(s.num_tokens)
            entries.append(BatchEntry(
                ids, s.seq.num_computed, self.pool.kv_pages(s.seq.seq_id), s.lora_row,
                s.samples, s.seq.last_row if pending else None,
            ))  # fmt: skip
        logits, scheduled = self._execute(scheduled, entries)  # [sampling sequences, vocab]
        sampling = [s.seq for s in scheduled if s.samples]
        for s in scheduled:
            s.seq.num_computed += s.num_tokens
            self.computed_tokens += s.num_tokens
        ticket, logprob_rows = None, []
        if sampling:
            tokens = self.sampler(
                logits, [q.sampling for q in sampling], [q.generator for q in sampling]
            )  # [sampling sequences] on the device, each in the vocabulary
            # The host reads -1 for a row whose logits are not finite (finish fails its
            # request); the next step, launched before that, reads the sampler's token.
            marked = torch.where(torch.isfinite(logits).all(dim=-1), tokens, -1)
            logprob_rows = [i for i, q in enumerate(sampling) if q.sampling.logprobs is not None]
            extras = _logprobs(logits, tokens, logprob_rows, sampling) if logprob_rows else ()
            ticket = self._tokens.put(tokens, marked, extras)
            if self.logits_hook is not None:
                for i, seq in enumerate(sampling):
                    self.logits_hook(seq.request_id, logits[i])
            for i, seq in enumerate(sampling):
                seq.inflight += 1
                seq.last_row = i
        runner = self.runner
        record = self.step_log.begin(
            scheduled, runner.last_graph, start, mark, runner.last_lora.value
        )
        # The GPU computes meanwhile (the step's work is queued), so the adapter copies
        # prepared for this step are issued now (within the budget), and a collection due now
        # costs nothing; on CPU both simply run after the forward.
        self.adapters.issue_loads(
            self._issue_budget_s, self._issue_bytes, after=self.runner.batch.copied
        )
        if during is not None:
            during()
        collect_if_due()
        self.steps += 1
        return LaunchedStep(sampling, ticket, record, logprob_rows)

    def finish(self, launched: LaunchedStep) -> list[GenerationOutput]:
        """Wait for a launched step's tokens and apply them: append, detokenize, finish the
        sequences that end. A sequence that ended meanwhile (an abort, or a stop found in an
        earlier step's token while this one ran) drops its token."""
        if launched.ticket is None:
            self._ended(launched.record)
            return []
        tokens = self._tokens.take(launched.ticket)
        self._ended(launched.record)
        logprobs = self._token_logprobs(launched, tokens)
        live = []
        for i, (seq, tok) in enumerate(zip(launched.sampled, tokens, strict=True)):
            seq.inflight -= 1
            if seq.status is not SequenceStatus.FINISHED:
                live.append((seq, tok, logprobs.get(i)))
        return self._append_all(live)

    def _ended(self, record: StepRecord) -> None:
        self.step_log.end(record)
        self._issue_budget_s = max(ISSUE_MIN_S, ISSUE_SHARE * record.gpu_ms / 1e3)
        bandwidth = self.adapters.copier.h2d_bytes_per_s
        if bandwidth and DMA_SHARE > 0:
            self._issue_bytes = int(DMA_SHARE * record.gpu_ms / 1e3 * bandwidth)

    def _token_logprobs(self, launched: LaunchedStep, tokens: list[int]) -> dict:
        """Row -> TokenLogprob for the rows that asked, from the step's copies (ticket.extras:
        the chosen tokens' log-probabilities, then the top ones' values and ids)."""
        if not launched.logprob_rows:
            return {}
        chosen, values, ids = (t.tolist() for t in launched.ticket.extras)
        out = {}
        for j, row in enumerate(launched.logprob_rows):
            k = launched.sampled[row].sampling.logprobs
            top = zip(ids[j][:k], values[j][:k], strict=True)
            out[row] = TokenLogprob(
                tokens[row], self._token_text(tokens[row]), chosen[j],
                tuple(TopLogprob(t, self._token_text(t), v) for t, v in top),
            )  # fmt: skip
        return out

    def _token_text(self, token: int) -> str:
        return self.tokenizer.decode([token], skip_special_tokens=False) if token >= 0 else ""

    # --- failures that stay with their request ----------------------------------------------

    def _execute(self, scheduled, entries):
        """The step's logits, and the scheduled sequences they are for. A forward pass that
        raises (a kernel's error on one request's data) runs again one sequence at a time: a
        sequence that fails alone ends with RequestFailed, the others keep their logits (each
        one's K/V is written again, at the same positions). When every sequence fails alone in
        MAX_FAILED_STEPS steps in a row, the fault is the engine's, not a request's: raised."""
        try:
            logits = self.runner.execute(entries)
            self._failed_steps = 0
            return logits, scheduled
        except Exception as exc:
            if self.tp is not None:  # the workers are mid-step: the group cannot go on
                raise self.tp.failure(exc) from exc
            log.warning("a step of %d sequences failed (%r); running them one by one",
                        len(entries), exc)  # fmt: skip
            error = exc
        rows, kept = [], []
        for s, entry in zip(scheduled, entries, strict=True):
            try:
                row = self.runner.execute([entry])
            except Exception as exc:  # noqa: BLE001 (reported to the request, and logged)
                log.warning("request %s fails alone: %r", s.seq.request_id, exc)
                self._fail(s.seq, RequestFailed(
                    f"request {s.seq.request_id}: the model failed on its data "
                    f"({type(exc).__name__}: {exc}); the engine keeps serving"
                ))  # fmt: skip
                continue
            kept.append(s)
            if s.samples:
                rows.append(row.clone())  # a graph's output is overwritten by the next run
        self._failed_steps = 0 if kept else self._failed_steps + 1
        if self._failed_steps >= MAX_FAILED_STEPS:
            raise error
        vocab = self.model_config.vocab_size
        logits = torch.cat(rows) if rows else torch.empty(0, vocab, device=self.device)
        return logits, kept

    def _append_all(self, sampled: list[tuple[Sequence, int, TokenLogprob | None]]) -> list:
        """Each sampled token's output; a request whose logits were not finite (token -1), or
        whose token cannot be taken (its detokenizer or stop strings fail), ends with
        RequestFailed (take_step_failures) and the others go on."""
        outputs = []
        for seq, token, logprob in sampled:
            if token < 0:
                where = "its adapter" if seq.adapter is not None else "the base model"
                self._fail(seq, RequestFailed(
                    f"request {seq.request_id}: {where} produced logits that are not finite "
                    f"(NaN or infinite) for token {len(seq.output_ids)}; "
                    + ("the adapter's weights do not work with this base model"
                       if seq.adapter is not None else "the request cannot go on")
                ))  # fmt: skip
                continue
            try:
                outputs.append(self._append(seq, token, logprob))
            except Exception as exc:
                log.exception("request %s failed in the step", seq.request_id)
                self._fail(seq, RequestFailed(
                    f"request {seq.request_id} failed in the engine: {type(exc).__name__}: {exc}"
                ))  # fmt: skip
        return outputs

    def _fail(self, seq: Sequence, error: RequestFailed) -> None:
        if seq.status is not SequenceStatus.FINISHED:
            self._finish(seq, FinishReason.ABORT, (), "")
        self._step_failures.append((seq.request_id, error))

    def take_step_failures(self) -> list[tuple[str, RequestFailed]]:
        """(request_id, error) of the requests that steps ended since the last call (step
        thread); their streams end with the error."""
        failures, self._step_failures = self._step_failures, []
        return failures

    def _append(
        self, seq: Sequence, token: int, logprob: TokenLogprob | None = None
    ) -> GenerationOutput:
        self.generated_tokens += 1
        text, reason = append_token(seq, token, self.max_len)
        logprobs = () if logprob is None else (logprob,)
        if reason is None:
            return self._output(seq, (token,), text, None, logprobs)
        return self._finish(seq, reason, (token,), text, logprobs)

    def _finish(
        self,
        seq: Sequence,
        reason: FinishReason,
        tokens: tuple[int, ...],
        text: str,
        logprobs: tuple[TokenLogprob, ...] = (),
    ) -> GenerationOutput:
        self.scheduler.remove(seq)
        seq.finish_reason = reason
        if seq.adapter is not None:
            self.adapters.release(seq.adapter)
        with self._lock:
            self._live.pop(seq.request_id, None)
        return self._output(seq, tokens, text, reason, logprobs)

    @staticmethod
    def _output(seq, tokens, text, reason, logprobs=()) -> GenerationOutput:
        return GenerationOutput(
            request_id=seq.request_id,
            token_ids=tokens,
            text=text,
            finish_reason=reason,
            prompt_tokens=len(seq.prompt_ids),
            completion_tokens=len(seq.output_ids),
            logprobs=logprobs,
        )

    # --- introspection ----------------------------------------------------------------------

    def check_integrity(self) -> None:
        """The allocator's invariants; with tensor parallelism, also that every worker's LoRA
        index, pool geometry and count of graph replays equal this rank's (step thread: it
        sends a command)."""
        self.pool.check_integrity()
        if self.tp is not None:
            self.tp.check(
                self.adapters.index, self.pool.num_pages, self.pool.page_size,
                self.runner.graph_steps,
            )  # fmt: skip

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
            adapter_evictions_queued=self.adapters.queued_evictions,
            memory=self._memory.read(),
            gc=gc_stats(),
        )


def _logprobs(logits, tokens, rows: list[int], sampling: list[Sequence]) -> tuple:
    """Device tensors for the rows that asked for logprobs: each chosen token's log-probability
    under the raw logits [n], and the top ones' values and ids [n, k] (k the largest number of
    alternatives asked for)."""
    idx = to_device(rows, torch.int64, logits.device)
    lp = torch.log_softmax(logits[idx].float(), dim=-1)  # [n, vocab]
    chosen = lp.gather(1, tokens[idx][:, None]).squeeze(1)  # [n]
    top = lp.topk(max(sampling[i].sampling.logprobs for i in rows), dim=-1)  # [n, k], k may be 0
    return (chosen, top.values, top.indices)


def load_failed(key: AdapterKey, cause: BaseException) -> AdapterLoadFailed:
    return AdapterLoadFailed(
        f"adapter {key} could not be copied into the GPU page pool "
        f"({type(cause).__name__}: {cause}); the engine keeps serving, retry later"
    )


def _vocabulary_ids(given, vocab: int, request_id: str) -> list[int]:
    """``given`` as a list of token ids in [0, vocab); InvalidRequest names the first that is
    not. Plain ints take C-speed checks only (a long prompt costs the step thread ~1 ms)."""
    ids = list(given)
    if set(map(type, ids)) <= {int} and min(ids) >= 0 and max(ids) < vocab:
        return ids
    ids = [_token_id(t) for t in ids]
    for i, t in enumerate(ids):
        if t is None or not 0 <= t < vocab:
            raise InvalidRequest(
                f"request {request_id}: prompt token {i} is {given[i]!r}, outside the "
                f"vocabulary [0, {vocab})"
            )
    return ids


def _token_id(value: object) -> int | None:
    """An integer token id (numpy integers included), or None for anything else."""
    if isinstance(value, bool):
        return None
    try:
        return operator.index(value)
    except TypeError:
        return None
