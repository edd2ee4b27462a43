"""ModelRunner: one forward pass per step over the scheduler's choice.

On CUDA, decode-only steps (every sequence computes one token and samples it) replay a CUDA
graph captured at start-up for a fixed batch size; the step's sequences are padded up to the
smallest captured size. Eager PyTorch spends most of a decode step launching a few thousand
small kernels from Python; a replay launches them all at once. Steps with prefill tokens run
eagerly. A graph reads the step's metadata from StepBatch's fixed device tensors and the
adapters from the LoRA index, both filled in place, so one capture serves every later step.

Padding rows decode token 0 at position 0 of the engine's reserved pool page with no adapter:
their K/V writes land in that page and their logits are dropped, so they touch no sequence's
state.

The LoRA kernels' path (two launches or the fused kernel, kernels.lora_apply) is chosen per
step from what only the host knows: how many of the step's tokens use an adapter, on how many
distinct adapters, of which rank (kernels/lora_paths.py). A graph fixes the path it
was captured with, so batch sizes where the fused path can win get a second graph.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Sequence

import torch

from kernels import LoraIndex, lora_paths
from services.inference.engine.batch import BatchEntry, StepBatch
from services.inference.engine.page_pool import PagePool
from services.inference.models.llama import LoraContext, Transformer

log = logging.getLogger(__name__)


class ModelRunner:
    def __init__(
        self,
        model: Transformer,
        pool: PagePool,
        lora_index: LoraIndex,
        max_lora_rank: int,
        max_num_seqs: int,
        max_num_batched_tokens: int,
        max_model_len: int,
        max_loras: int,
        row_ranks: Sequence[int],
    ) -> None:
        """``row_ranks``: each LoRA index row's largest rank, kept current by the adapter
        manager (read per step to choose the kernel path)."""
        self.model, self.pool = model, pool
        self.max_lora_rank = max_lora_rank
        self.row_ranks = row_ranks
        # The shrunk activations are max_lora_rank wide whatever the step holds: a fixed shape
        # for CUDA graphs; the kernels only compute up to each adapter's own rank.
        self.lora = LoraContext(lora_index, max_lora_rank)
        self.batch = StepBatch(
            max_tokens=max_num_batched_tokens,
            max_seqs=max_num_seqs,
            max_pages_per_seq=-(-max_model_len // pool.page_size),
            # One per resident adapter, plus base-model runs before them and padding after.
            max_segments=max_loras + 2,
            page_size=pool.page_size,
            device=pool.tensor.device,
        )
        # (batch size, fused LoRA path) -> the graph and its output
        self._graphs: dict[tuple[int, bool], tuple[torch.cuda.CUDAGraph, torch.Tensor]] = {}
        self._pad: BatchEntry | None = None
        self._sizes: tuple[int, ...] = ()  # captured batch sizes, ascending
        self.graph_steps = 0  # steps served by a graph replay
        self.last_graph = False  # whether the latest step replayed one
        self.fused_steps = 0  # steps whose LoRA path was the fused one (CUDA only runs it)

    @property
    def graph_sizes(self) -> tuple[int, ...]:
        return self._sizes

    @property
    def fused_graph_sizes(self) -> tuple[int, ...]:
        return tuple(sorted(size for size, fused in self._graphs if fused))

    def _fusable(self, size: int) -> bool:
        """Whether a decode step of ``size`` sequences could prefer the fused path."""
        r = self.max_lora_rank
        return lora_paths.decode_prefers_fused(size, size, r, r)

    def prefers_fused(self, entries: Sequence[BatchEntry]) -> bool | None:
        """The step's LoRA path: None (the shapes decide) for prefill-sized steps, else
        kernels.lora_paths.decode_prefers_fused over the step's adapter tokens."""
        if sum(len(e.token_ids) for e in entries) > lora_paths.FUSED_MAX_TOKENS:
            return None
        distinct = {e.lora_row for e in entries if e.lora_row is not None}
        if not distinct:
            return False
        tokens = sum(len(e.token_ids) for e in entries if e.lora_row is not None)
        rank = max(self.row_ranks[r] for r in distinct)
        return lora_paths.decode_prefers_fused(tokens, len(distinct), rank, self.max_lora_rank)

    @torch.inference_mode()
    def capture_graphs(self, sizes: Sequence[int]) -> None:
        """Capture the decode step for each batch size (largest first, so smaller graphs reuse
        its memory from the shared pool). Takes one pool page for the padding rows."""
        if self.pool.tensor.device.type != "cuda" or not sizes:
            return
        page = self.pool.reserve_page("cuda-graph padding")
        self._pad = BatchEntry((0,), 0, (page,), None, True)
        memory = torch.cuda.graph_pool_handle()
        start = time.perf_counter()
        side = torch.cuda.Stream()
        keys = [(size, False) for size in sizes]
        keys += [(size, True) for size in sizes if self._fusable(size)]
        for size, fused in sorted(keys, reverse=True):
            self.batch.fill([self._pad] * size)
            self.lora.fused = fused
            side.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(side):  # warm-up: compiles kernels, settles the allocator
                for _ in range(2):
                    self._forward(self.lora)
            torch.cuda.current_stream().wait_stream(side)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=memory):
                logits = self._forward(self.lora)  # [size, vocab]
            self._graphs[size, fused] = (graph, logits)
        self.lora.fused = None
        self._sizes = tuple(sorted(size for size, fused in self._graphs if not fused))
        torch.cuda.synchronize()
        log.info(
            "captured decode CUDA graphs for batch sizes %s (and with fused LoRA kernels for "
            "%s) in %.1f s",
            list(self.graph_sizes), list(self.fused_graph_sizes), time.perf_counter() - start,
        )  # fmt: skip

    def _graph_for(self, entries: Sequence[BatchEntry]) -> int | None:
        sizes = self.graph_sizes
        if not sizes or len(entries) > sizes[-1]:
            return None
        if any(len(e.token_ids) != 1 or not e.sample for e in entries):
            return None
        return min(size for size in sizes if size >= len(entries))

    def _forward(self, lora: LoraContext | None) -> torch.Tensor:
        """The step on the filled batch: the inputs the previous step sampled, then the model."""
        self.batch.resolve_inputs()
        return self.model(self.batch, self.pool.tensor, lora)

    @torch.inference_mode()
    def execute(self, entries: Sequence[BatchEntry]) -> torch.Tensor:
        """Run one step; returns float32 logits [number of sampling entries, vocab], in order.
        After a graph replay the rows are a view of the graph's output, valid until the next
        step."""
        fused = self.prefers_fused(entries)
        self.fused_steps += bool(fused)
        size = self._graph_for(entries)
        if size is not None:
            self.batch.fill([*entries, *[self._pad] * (size - len(entries))])
            # a size without a fused graph cannot prefer it (_fusable); kept safe regardless
            graph, logits = self._graphs.get((size, bool(fused)), self._graphs[size, False])
            graph.replay()
            self.graph_steps += 1
            self.last_graph = True
            return logits[: len(entries)]
        self.last_graph = False
        self.batch.fill(entries)
        self.lora.fused = fused
        return self._forward(self.lora if self.batch.has_lora else None)
