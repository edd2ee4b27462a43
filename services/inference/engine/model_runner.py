"""ModelRunner: one forward pass per step over the scheduler's choice.

On CUDA every step replays a CUDA graph captured at start-up, when one fits: decode steps (every
sequence computes one token and samples it) for a set of batch sizes, padded with rows that
decode token 0 at position 0 of the engine's reserved pool page with no adapter (their K/V
writes land in that page and their logits are dropped); mixed steps (prefill chunks beside
decodes) for a set of token counts, padded with tokens of no sequence (no K/V slot, no adapter)
and sequences of no tokens. Eager PyTorch spends most of a step launching a few thousand small
kernels from Python (on the H200, 2-4x a mixed step's kernel time); a replay launches them all
at once. A graph reads the step's metadata from StepBatch's fixed device tensors and the adapters
from the LoRA index, both filled in place, so one capture serves every later step. Each size is
captured without LoRA kernels (steps of the base model alone cost nothing for LoRA) and with
them.

The LoRA kernels' path (two launches or the fused kernel, kernels.lora_apply) is chosen per
step from what only the host knows: how many of the step's tokens use an adapter, on how many
distinct adapters, of which rank and on which modules (kernels/lora_paths.py). A graph fixes the
path it was captured with, so decode sizes where the fused path can win get a third graph;
mixed steps let each call's shapes decide, sized for the engine's max_lora_rank, or, when every
adapter of the step fits FUSED_PREFILL_MAX_ROWS rank rows, run every call fused, sized for
those (prefill-sized mixed steps get that graph too). Steps with an adapter above
FUSED_DECODE_ROWS rank rows (S2's ranks up to 64) take two launches whose programs hold
WIDE_RANK_ROWS rank rows (kernels.lora_paths.step_is_wide), one more graph per size in an
engine whose max_lora_rank allows such adapters; prefill-sized ones of many adapters, none
above WIDE_FUSED_ROWS, run every call fused at those rows (prefill_step_fuses_wide), another
mixed graph per size in an engine whose max_lora_rank reaches them. A step makes no call for
modules none of its adapters has: eagerly for any module; every graph with LoRA calls, decode
or mixed, also comes without the MLP calls, for steps whose adapters adapt attention only (H200,
16 decode tokens on 13 adapters, one layer's S1 calls: 19.6 µs, 26.3 with the masked MLP
launches; bench/results/lora_engine_calls_steps.json).
"""

from __future__ import annotations

import enum
import logging
import time
from collections.abc import Sequence
from typing import NamedTuple

import torch

from kernels import LoraIndex, lora_paths
from kernels.lora_layout import DOWN, GATE, NUM_MODULES, UP, K, O, Q, V
from services.inference.engine.batch import BatchEntry, StepBatch
from services.inference.engine.page_pool import PagePool
from services.inference.models.llama import LoraContext, Transformer

log = logging.getLogger(__name__)


class LoraMode(enum.Enum):
    """The LoRA kernels a graph was captured with (LoraContext.fused for each)."""

    NONE = "none"  # no LoRA kernels: every sequence of the step is on the base model
    TWO = "two launches"  # decode-sized: shrink, then expand
    FUSED = "fused"  # decode-sized, mostly distinct adapters: the one-launch kernel
    SHAPES = "by shapes"  # mixed steps: each call's shapes pick
    # prefill-sized steps whose adapters all fit FUSED_PREFILL_MAX_ROWS rank rows: every call
    # on the fused kernel, sized for those rows (kernels.lora_paths.prefill_step_narrows)
    NARROW = "fused, narrow"
    # steps of any size with an adapter above FUSED_DECODE_ROWS: two launches whose programs
    # hold WIDE_RANK_ROWS rank rows (kernels.lora_paths.step_is_wide)
    WIDE = "two launches, wide"
    # decode steps whose adapters all fit ONE_TOKEN_ROWS rank rows, small or sharing adapters
    # little: every call fused, each token its own tile (kernels.lora_paths.one_token_step_fuses)
    ONE_TOKEN = "fused, one-token tiles"
    # prefill-sized steps of many adapters, one above FUSED_PREFILL_MAX_ROWS and none above
    # WIDE_FUSED_ROWS: every call fused at those rows (kernels.lora_paths.prefill_step_fuses_wide)
    WIDE_FUSED = "fused, wide"

    @property
    def fused(self) -> bool | None:
        return {
            LoraMode.TWO: False, LoraMode.FUSED: True, LoraMode.NARROW: True,
            LoraMode.WIDE: False, LoraMode.ONE_TOKEN: True, LoraMode.WIDE_FUSED: True,
        }.get(self)  # fmt: skip


# Steps whose LoRA deltas the base GEMMs add onto when the engine's lora_addend is on
# (LoraContext.addend): steps of ADDEND_MIN_TOKENS tokens or more on which every call is fused
# (the prefill-sized NARROW and WIDE_FUSED, the decode-sized FUSED and ONE_TOKEN, each where
# its single-slice calls fuse too: lora_paths.decode_call_fused, ModelRunner._zero_tiles). A
# GEMM of that many tokens is about compute-bound on an H100 or H200 (Llama-7B's q/k/v at 256
# tokens: 26 GFLOP against 100 MB of weights), so reading its addend in its epilogue mostly
# hides, where an in-place LoRA call reads the GEMM's output back over HBM (at 2048 tokens 67
# MB a layer for q/k/v and o); the tokens without a delta (base model, padding) get zeros. On
# an H100 the serving trace's mixed steps took 0.71-0.95x of the in-place LoRA time beyond
# their GEMMs, its decode steps of 256 tokens or more 0.92-1.01x (bench/lora_addend.py).
ADDEND_MODES = (LoraMode.NARROW, LoraMode.WIDE_FUSED, LoraMode.FUSED, LoraMode.ONE_TOKEN)
ADDEND_MIN_TOKENS = 256

# Steps of at most this many tokens compute their LoRA deltas beside the base GEMMs when the
# engine's lora_side_stream is on (LoraContext.beside): small decode steps, whose LoRA launches
# are a few programs each and cost their latency. H200, Llama-7B shape, distinct rank-8 q/k/v/o
# adapters, the decode steps' GPU spans in graphs (bench/decode_ab.py --compare
# lora-side-stream): at 16 sequences 5.42 ms beside against 5.63 in place (the base model 5.12),
# at 64 8.47 against 8.36: there the LoRA programs, slowed by the GEMM they share the SMs with,
# outlast it, and the zeroing and the add cost more than the overlap saves. With every decode
# size up to 512 beside, the captured graphs' memory outgrew what the pool's sizing leaves
# (the service's start ran out of memory at its defaults; docs/inference_service.md).
SIDE_STREAM_MAX_TOKENS = 32

# The attention projections' modules as bits (LoraContext.modules): the module set of the
# graphs without MLP calls (every LoRA graph, decode or mixed, has such a twin).
ATTENTION = sum(1 << m for m in (Q, K, V, O))


class GraphKey(NamedTuple):
    tokens: int  # the step's tokens, padding included
    seqs: int  # its sequences, padding included (= tokens for decode graphs)
    lora: LoraMode
    modules: int | None = None  # the modules its LoRA calls cover (bits); None: every module

    def encode(self) -> tuple[int, int, int, int]:
        """As four ints (a tensor-parallel command header's fields); NO_GRAPH: none."""
        modules = -1 if self.modules is None else self.modules
        return self.tokens, self.seqs, list(LoraMode).index(self.lora), modules

    @classmethod
    def decode(cls, fields: Sequence[int]) -> GraphKey | None:
        tokens, seqs, mode, modules = fields
        if tokens == 0:
            return None
        return cls(tokens, seqs, list(LoraMode)[mode], None if modules < 0 else modules)


NO_GRAPH = (0, 0, 0, -1)  # GraphKey.encode() of an eager step
ALL_MODULES = (1 << NUM_MODULES) - 1


class StepLora(NamedTuple):
    """A step's LoRA calls: their path, the modules its adapters have (bits; None: all), and
    whether the smallest block's tile table cuts every entry apart (StepBatch.fill's
    one_token_tiles: each decode token a tile of its own; ONE_TOKEN steps, and NARROW steps
    whose decode tokens share their adapters a few to one: lora_paths.mixed_decodes_apart).
    Tensor-parallel workers adopt the filled batch, tiles included, so encode() leaves the
    last two out."""

    mode: LoraMode
    modules: int | None
    one_token_tiles: bool = False
    # ONE_TOKEN steps whose every call's launch takes two-token tiles (ModelRunner.pair_modules):
    # the tokens that share an adapter go two to a tile (StepBatch.fill's pair_tiles)
    pair_tiles: bool = False

    def encode(self) -> tuple[int, int]:
        """As two ints (a tensor-parallel command header's fields)."""
        return list(LoraMode).index(self.mode), -1 if self.modules is None else self.modules

    @classmethod
    def decode(cls, mode: int, modules: int) -> StepLora:
        return cls(list(LoraMode)[mode], None if modules < 0 else modules)


def pair_modules(hidden: int, q_dim: int, kv_dim: int, inter: int, width: int) -> int:
    """The modules (bits) whose calls in a ONE_TOKEN step take two-token tiles on a model of
    these widths and a pool ``width`` elements wide: those whose launch hoists the GEMV body's
    loads (lora.gemv_hoists: the slice's A and Bᵀ rows each one block and one pool chunk, as
    Llama-7B's q/k/v and o; the MLP's 11008-wide slices do not, nor a grouped-query model's
    q/k/v, whose d_in is wider than its pool), which is where the pair body is
    (lora.fused_config's gemv_pair, on with lora_paths.ONE_TOKEN_PAIRS)."""
    from kernels import lora as triton_lora  # the Triton modules load where they run

    bits = 0
    for mods, d_in, widths in (
        ((Q, K, V), hidden, (q_dim, kv_dim, kv_dim)),
        ((O,), q_dim, (hidden,)),
        ((GATE, UP), hidden, (inter, inter)),
        ((DOWN,), inter, (hidden,)),
    ):
        cfg = triton_lora.fused_config(
            lora_paths.FUSED_MAX_TOKENS, width, lora_paths.ONE_TOKEN_ROWS, len(mods),
            max(widths), d_in=d_in,
        )  # fmt: skip
        if cfg.gemv_pair and triton_lora.gemv_hoists(cfg, d_in, width, widths):
            bits |= sum(1 << m for m in mods)
    return bits


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
        row_modules: Sequence[int] | None = None,
        lora_side_stream: bool = False,
        lora_addend: bool = True,
    ) -> None:
        """``row_ranks``: each LoRA index row's largest rank, kept current by the adapter
        manager (read per step to choose the kernel path); ``row_modules``: each row's modules
        as bits (StepBatch lists a step's modules from them; None: every module);
        ``lora_side_stream``: small decode steps (up to SIDE_STREAM_MAX_TOKENS tokens) compute
        their LoRA deltas beside the base GEMMs (LoraContext), on a side stream on CUDA;
        ``lora_addend``: steps on ADDEND_MODES write their LoRA deltas first and their base GEMMs
        add onto them (LoraContext.addend)."""
        self.model, self.pool = model, pool
        self.max_lora_rank = max_lora_rank
        self.row_ranks, self.row_modules = row_ranks, row_modules
        # A step's calls are sized for max_lora_rank rank rows, or fewer where every adapter of
        # the step fits fewer (FUSED, NARROW): one shape per graph, whatever the step holds;
        # the kernels only compute up to each adapter's own rank.
        self.lora = LoraContext(lora_index, max_lora_rank)
        self._addend = lora_addend
        self._side_tokens = 0
        if lora_side_stream:
            self._side_tokens = min(SIDE_STREAM_MAX_TOKENS, max_num_batched_tokens)
            layer = model.layers[0]
            widest = max(w.shape[0] for w in (
                layer.attn.wqkv, layer.attn.wo, layer.mlp.w_gate_up, layer.mlp.w_down
            ))  # fmt: skip
            device = pool.tensor.device
            side = None
            if device.type == "cuda":  # the Triton modules load where they run (kernels/)
                from kernels.tiles import side_stream

                side = side_stream(device)
            self.lora.use_side_stream(
                torch.empty(self._side_tokens * widest, dtype=pool.tensor.dtype, device=device),
                side,
            )
        self.pair_modules = 0
        if lora_paths.ONE_TOKEN_PAIRS and pool.tensor.device.type == "cuda":  # the CPU: no tiles
            attn, mlp = model.layers[0].attn, model.layers[0].mlp
            self.pair_modules = pair_modules(
                attn.hidden, attn.q_dim, attn.kv_dim, mlp.inter, pool.tensor.shape[-1]
            )
        self.batch = StepBatch(
            max_tokens=max_num_batched_tokens,
            max_seqs=max_num_seqs,
            max_pages_per_seq=-(-max_model_len // pool.page_size),
            # One per adapter in the step (at most one per sequence, at most the resident
            # ones), plus base-model runs before them and padding after.
            max_segments=min(max_loras, max_num_seqs) + 2,
            page_size=pool.page_size,
            device=pool.tensor.device,
            row_modules=row_modules,
        )
        self._graphs: dict[GraphKey, tuple[torch.cuda.CUDAGraph, torch.Tensor]] = {}
        self._pad: BatchEntry | None = None
        self._decode_sizes: tuple[int, ...] = ()  # captured decode batch sizes, ascending
        self._mixed_sizes: tuple[int, ...] = ()  # captured mixed-step token counts, ascending
        self._max_seqs = max_num_seqs
        self.graph_steps = 0  # steps served by a graph replay
        self.last_graph = False  # whether the latest step replayed one
        self.fused_steps = 0  # decode steps whose LoRA path was the fused one (CUDA runs it)
        self.attention_steps = 0  # steps replayed on a graph without MLP LoRA calls
        self.apart_steps = 0  # NARROW steps whose decode tokens took one-token tiles
        self.last_lora = LoraMode.NONE  # the latest step's LoRA path (the step log's "lora")
        # Under tensor parallelism, this rank's end of the group (engine/tensor_parallel.py):
        # rank 0 sends each filled step and the graph it replays (if any) to the workers, which
        # replay the same graph (every rank captures the same ones, in the same order: their
        # collectives are in them); every rank receives the step's sampled inputs from rank 0.
        self.tp = None

    @property
    def graph_sizes(self) -> tuple[int, ...]:
        """Decode batch sizes with a captured graph."""
        return self._decode_sizes

    @property
    def mixed_graph_sizes(self) -> tuple[int, ...]:
        """Token counts of the captured mixed (prefill + decode) step graphs."""
        return self._mixed_sizes

    @property
    def fused_graph_sizes(self) -> tuple[int, ...]:
        return tuple(sorted(k.tokens for k in self._graphs if k.lora is LoraMode.FUSED))

    @property
    def one_token_graph_sizes(self) -> tuple[int, ...]:
        """Decode batch sizes with a graph of ONE_TOKEN steps (every call fused, one-token
        tiles)."""
        return tuple(sorted({k.tokens for k in self._graphs if k.lora is LoraMode.ONE_TOKEN}))

    @property
    def narrow_graph_sizes(self) -> tuple[int, ...]:
        """Token counts of the mixed graphs sized for FUSED_PREFILL_MAX_ROWS rank rows."""
        return tuple(sorted(k.tokens for k in self._graphs if k.lora is LoraMode.NARROW))

    @property
    def wide_fused_graph_sizes(self) -> tuple[int, ...]:
        """Token counts of the mixed graphs fused at WIDE_FUSED_ROWS rank rows."""
        return tuple(sorted(k.tokens for k in self._graphs if k.lora is LoraMode.WIDE_FUSED))

    @property
    def attention_graph_sizes(self) -> tuple[int, ...]:
        """Step sizes (decode batch sizes and mixed steps' token counts) with a graph whose LoRA
        calls cover the attention modules only."""
        return tuple(sorted({k.tokens for k in self._graphs if k.modules == ATTENTION}))

    def _narrows(self, tokens: int, adapters: int) -> bool:
        """Whether a mixed step of ``tokens`` tokens on ``adapters`` distinct adapters may be
        sized for fewer rank rows than the engine's (lora_paths.mixed_step_narrows), in an
        engine whose max_lora_rank is above those rows. A NARROW graph is captured at each mixed
        size where a step of it may narrow (its sequences bound its adapters)."""
        rows = lora_paths.FUSED_PREFILL_MAX_ROWS
        return self.max_lora_rank > rows and lora_paths.mixed_step_narrows(tokens, adapters)

    def _wides(self) -> bool:
        """Whether steps may hold adapters above FUSED_DECODE_ROWS (WIDE graphs are captured)."""
        return lora_paths.step_is_wide(self.max_lora_rank)

    def _wide_fuses(self, tokens: int) -> bool:
        """Whether a mixed step of ``tokens`` tokens may run fused at WIDE_FUSED_ROWS rank rows:
        prefill-sized, in an engine whose adapters may be that wide (its calls are then sized
        for those rows; kernels.lora_paths.prefill_step_fuses_wide)."""
        rows = lora_paths.fused_rank_rows(self.max_lora_rank)
        return tokens > lora_paths.FUSED_MAX_TOKENS and rows >= lora_paths.WIDE_FUSED_ROWS

    def _fusable(self, size: int) -> bool:
        """Whether a decode step of ``size`` sequences could prefer the fused path."""
        return lora_paths.decode_prefers_fused(size, size, lora_paths.FUSED_DECODE_ROWS)

    def _one_token(self, tokens: int) -> bool:
        """Whether a decode step (or graph) of ``tokens`` tokens may take ONE_TOKEN: decode-sized
        (FUSED_MAX_TOKENS: the launches' rules are measured up to there), and at most one token
        a segment of the batch's capacity, so that its one-token tiles fit the tile table and
        the fused grid (both sized for tokens / 16 + that capacity: tile_table.max_tiles)."""
        return tokens <= min(self.batch.max_segments, lora_paths.FUSED_MAX_TOKENS)

    def step_lora(self, entries: Sequence[BatchEntry]) -> StepLora:
        """The step's LoRA path and modules, from one pass over its entries: for a decode step
        whose adapters fit ONE_TOKEN_ROWS and share little (or share any amount where every
        call takes two-token tiles: pair_modules), ONE_TOKEN (lora_paths.one_token_step_fuses,
        StepLora.pair_tiles); else for a decode-sized step (up to FUSED_MAX_TOKENS
        tokens) fused or two launches by lora_paths.decode_prefers_fused over its adapter
        tokens; for a prefill-sized one (and a decode-sized mixed one on
        lora_paths.NARROW_MIN_ADAPTERS adapters: lora_paths.mixed_step_narrows) NARROW
        when every adapter of it fits FUSED_PREFILL_MAX_ROWS
        (lora_paths.prefill_step_narrows: every call fused, sized for those rows), its decode
        tokens each a one-token tile when they share their adapters a few to one (the fused
        kernel's GEMV body, rather than a dot-body tile of the decode tokens that share an
        adapter: lora_paths.mixed_decodes_apart); when an adapter is above
        those rows and none above WIDE_FUSED_ROWS, WIDE_FUSED if the step holds many adapters
        (lora_paths.prefill_step_fuses_wide: every call fused at those rows). Otherwise, with an
        adapter above FUSED_DECODE_ROWS, two launches of WIDE_RANK_ROWS-row programs (WIDE,
        lora_paths.step_is_wide); else two launches (decode-sized) or the shapes' choice, at
        max_lora_rank."""
        tokens = adapter_tokens = decode_tokens = 0
        rows, decode_rows = set(), set()
        for e in entries:
            n = len(e.token_ids)
            tokens += n
            if e.lora_row is not None:
                adapter_tokens += n
                rows.add(e.lora_row)
                if n == 1:
                    decode_tokens += 1
                    decode_rows.add(e.lora_row)
        if not rows:
            return StepLora(LoraMode.NONE, None)
        modules = None
        if self.row_modules is not None:
            modules = 0
            for r in rows:
                modules |= self.row_modules[r]
        rank = max(self.row_ranks[r] for r in rows)
        if tokens == len(entries) and self._one_token(tokens):  # one token each: decode
            used = ALL_MODULES if modules is None else modules
            # every call takes two-token tiles
            pairs = self.pair_modules != 0 and (used & ~self.pair_modules) == 0
            if lora_paths.one_token_step_fuses(adapter_tokens, len(rows), rank, pairs):
                return StepLora(LoraMode.ONE_TOKEN, modules, True, pairs)
        decode_sized = tokens <= lora_paths.FUSED_MAX_TOKENS
        narrow = (
            (tokens > len(entries) or not decode_sized)  # a decode step never narrows
            and self._narrows(tokens, len(rows))
            and lora_paths.prefill_step_narrows(rank)
        )
        decode_fuses = not narrow and decode_sized
        if decode_fuses and lora_paths.decode_prefers_fused(adapter_tokens, len(rows), rank):
            return StepLora(LoraMode.FUSED, modules)
        if narrow:
            apart = lora_paths.mixed_decodes_apart(decode_tokens, len(decode_rows), rank)
            return StepLora(LoraMode.NARROW, modules, apart)
        if self._wide_fuses(tokens) and lora_paths.prefill_step_fuses_wide(rank, len(rows)):
            return StepLora(LoraMode.WIDE_FUSED, modules)
        if lora_paths.step_is_wide(rank):
            return StepLora(LoraMode.WIDE, modules)
        return StepLora(LoraMode.TWO if decode_sized else LoraMode.SHAPES, modules)

    def _lora_for(self, mode: LoraMode, modules: int | None) -> LoraContext | None:
        """The LoRA context set up for a step (or a graph) of ``mode`` covering ``modules``."""
        if mode is LoraMode.NONE:
            return None
        rows = self._rows(mode)
        self.lora.fused, self.lora.rows, self.lora.modules = mode.fused, rows, modules
        self.lora.one_token = mode is LoraMode.ONE_TOKEN
        self.lora.rank_block = lora_paths.WIDE_RANK_ROWS if mode is LoraMode.WIDE else 16
        self.lora.addend = self._zero_tiles(mode, self.batch.num_tokens)
        self.lora.beside = not self.lora.addend and 0 < self.batch.num_tokens <= self._side_tokens
        return self.lora

    def _rows(self, mode: LoraMode) -> int:
        """The rank rows a step of ``mode`` makes its calls with: the engine's max_lora_rank,
        or fewer where step_lora found that every adapter of the step fits fewer."""
        rows = self.max_lora_rank
        if mode is LoraMode.FUSED:  # its adapters all fit FUSED_DECODE_ROWS (step_lora)
            rows = min(lora_paths.FUSED_DECODE_ROWS, rows)
        elif mode is LoraMode.ONE_TOKEN:  # they all fit ONE_TOKEN_ROWS (step_lora)
            rows = min(lora_paths.ONE_TOKEN_ROWS, rows)
        elif mode is LoraMode.NARROW:  # they all fit FUSED_PREFILL_MAX_ROWS (step_lora)
            rows = min(lora_paths.FUSED_PREFILL_MAX_ROWS, rows)
        elif mode is LoraMode.WIDE_FUSED:  # they all fit WIDE_FUSED_ROWS (step_lora)
            rows = min(lora_paths.WIDE_FUSED_ROWS, rows)
        return rows

    def _zero_tiles(self, mode: LoraMode, tokens: int) -> bool:
        """Whether a step (or graph) of ``mode`` and ``tokens`` tokens (padding included)
        writes its LoRA deltas for its GEMMs to add onto (LoraContext.addend), its tile tables
        listing every token (StepBatch.fill's zero_tiles): with lora_addend, on ADDEND_MODES
        from ADDEND_MIN_TOKENS tokens, where its single-slice calls fuse too (its calls of
        several slices do on every such mode: lora_paths.decode_call_fused), since a delta
        needs the fused kernel."""
        if not (self._addend and mode in ADDEND_MODES and tokens >= ADDEND_MIN_TOKENS):
            return False
        one_token = mode is LoraMode.ONE_TOKEN
        return lora_paths.decode_call_fused(True, tokens, 1, self._rows(mode), one_token) is True

    def mixed_seqs(self, tokens: int) -> int:
        """Sequences a mixed graph of ``tokens`` tokens holds: a mixed step has a sequence of
        two tokens or more, so it has fewer sequences than tokens."""
        return min(self._max_seqs, tokens - 1)

    def graph_keys(self, decode_sizes: Sequence[int], mixed_sizes: Sequence[int]) -> list[GraphKey]:
        """The graphs capture_graphs() captures: for each decode batch size and mixed-step token
        count, one without LoRA kernels and one on each LoRA path that may serve it, each of
        those also without the MLP modules' calls."""
        keys = []
        for size in decode_sizes:
            keys.append(GraphKey(size, size, LoraMode.NONE))
            modes = [LoraMode.TWO]
            modes += [LoraMode.FUSED] if self._fusable(size) else []
            modes += [LoraMode.ONE_TOKEN] if self._one_token(size) else []
            modes += [LoraMode.WIDE] if self._wides() else []
            for mode in modes:  # each also without the MLP calls
                keys += [GraphKey(size, size, mode), GraphKey(size, size, mode, ATTENTION)]
        for tokens in mixed_sizes:
            seqs = self.mixed_seqs(tokens)
            keys.append(GraphKey(tokens, seqs, LoraMode.NONE))
            modes = [LoraMode.SHAPES]
            modes += [LoraMode.NARROW] if self._narrows(tokens, seqs) else []
            modes += [LoraMode.WIDE_FUSED] if self._wide_fuses(tokens) else []
            modes += [LoraMode.WIDE] if self._wides() else []
            for mode in modes:  # each also without the MLP calls, as the decode graphs
                keys += [GraphKey(tokens, seqs, mode), GraphKey(tokens, seqs, mode, ATTENTION)]
        return keys

    @torch.inference_mode()
    def capture_graphs(self, decode_sizes: Sequence[int], mixed_sizes: Sequence[int] = ()) -> None:
        """Capture the decode step for each batch size and the mixed step for each token count,
        each without LoRA kernels (base-model steps) and with them on each path that may serve
        it, each such graph also without the MLP modules' calls (a twin replayed for steps whose
        adapters adapt attention only; it reuses its full graph's warm-up run); largest first,
        so smaller graphs reuse its memory from the shared pool. Takes one pool page for
        padding rows.
        Every graph writes its logits into one buffer (one graph replays at a time, and a step's
        logits are read before the next step's replay, as execute() says), so no graph holds
        logits of its own. Each did before: 65 MB for a 2048-token mixed graph at a 32000-token
        vocabulary, four times that at 128k; on the H200 at the service's defaults (the side
        stream then taking every decode size) the graphs' memory grew by about their logits
        each, 17.7 GiB after 371 of 492 graphs."""
        if self.pool.tensor.device.type != "cuda" or not (decode_sizes or mixed_sizes):
            return
        page = self.pool.reserve_page("cuda-graph padding")
        self._pad = BatchEntry((0,), 0, (page,), None, True)
        memory = torch.cuda.graph_pool_handle()
        start = time.perf_counter()
        side = torch.cuda.Stream()
        keys = self.graph_keys(decode_sizes, mixed_sizes)
        vocab = self.model.lm_head.shape[0]
        shared = torch.empty(max(k.seqs for k in keys), vocab, dtype=torch.float32,
                             device=self.pool.tensor.device)  # fmt: skip
        device = self.pool.tensor.device
        # What the capture takes beyond the allocator (the compiled kernels, the instantiated
        # graphs) shows as free memory lost that the allocator did not take.
        free_before, held = torch.cuda.mem_get_info(device)[0], torch.cuda.memory_reserved(device)
        warmed: set[tuple] = set()
        # Under tensor parallelism NCCL's watchdog thread queries its events meanwhile, which a
        # capture in the default (global) mode forbids of every thread; none of this engine's
        # other threads touches the device then.
        mode = "global" if self.tp is None else "thread_local"
        for key in sorted(keys, key=lambda k: (k.tokens, k.seqs), reverse=True):
            self._fill_for(key, [self._pad])
            lora = self._lora_for(key.lora, key.modules)
            # An eager run first compiles the kernels and settles the allocator; a graph of
            # fewer modules launches a subset of its full graph's kernels (captured before it:
            # the sort keeps the order of keys), so that graph's run serves it too.
            if key[:3] not in warmed:
                side.wait_stream(torch.cuda.current_stream())
                with torch.cuda.stream(side):
                    self._forward(lora)
                torch.cuda.current_stream().wait_stream(side)
                warmed.add(key[:3])
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=memory, capture_error_mode=mode):
                logits = self._forward(lora, shared)  # [key.seqs, vocab]: rows of shared
            self._graphs[key] = (graph, logits)
        self._decode_sizes = tuple(sorted(set(decode_sizes)))
        self._mixed_sizes = tuple(sorted(set(mixed_sizes)))
        torch.cuda.synchronize()
        grown = torch.cuda.memory_reserved(device) - held
        free = torch.cuda.mem_get_info(device)[0]
        log.info(
            "captured %d CUDA graphs in %.1f s (their memory and the warm-up runs' cache %.2f "
            "GiB, their logits buffer %.2f GiB, outside the allocator %.2f GiB: kernels and "
            "instantiated graphs; %.2f GiB left free on the device): decode steps of %s "
            "sequences (with fused LoRA kernels from %s, on one-token tiles up to %s; each LoRA "
            "graph also without MLP LoRA calls), mixed steps of %s tokens (sized for %d rank "
            "rows from %s); two launches of %d rank rows for adapters above %d: %s, fused at %d "
            "rows in mixed steps of many such adapters from %s tokens",
            len(self._graphs), time.perf_counter() - start,
            grown / 2**30, shared.nbytes / 2**30, (free_before - free - grown) / 2**30,
            free / 2**30,
            list(self._decode_sizes),
            min(self.fused_graph_sizes, default=None),
            max(self.one_token_graph_sizes, default=None),
            list(self._mixed_sizes),
            lora_paths.FUSED_PREFILL_MAX_ROWS, min(self.narrow_graph_sizes, default=None),
            lora_paths.WIDE_RANK_ROWS, lora_paths.FUSED_DECODE_ROWS, self._wides(),
            lora_paths.WIDE_FUSED_ROWS, min(self.wide_fused_graph_sizes, default=None),
        )  # fmt: skip

    def _fill_for(
        self,
        key: GraphKey,
        entries: Sequence[BatchEntry],
        one_token_tiles: bool | None = None,
        pair_tiles: bool = False,
    ) -> None:
        """Fill the batch for a replay of the graph ``key``: decode graphs pad with rows that
        decode into the reserved page, mixed graphs with tokens and sequences of nothing.
        ``one_token_tiles`` (StepBatch.fill; None: a ONE_TOKEN graph's), ``pair_tiles``
        (StepBatch.fill's, for a ONE_TOKEN step's: StepLora.pair_tiles)."""
        if one_token_tiles is None:
            one_token_tiles = key.lora is LoraMode.ONE_TOKEN
        zeros = self._zero_tiles(key.lora, key.tokens)
        if key.tokens == key.seqs:  # a decode graph (a mixed one has fewer sequences than tokens)
            self.batch.fill(
                [*entries, *[self._pad] * (key.seqs - len(entries))],
                one_token_tiles=one_token_tiles, zero_tiles=zeros, pair_tiles=pair_tiles,
            )  # fmt: skip
        else:
            self.batch.fill(
                entries, pad_tokens=key.tokens, pad_seqs=key.seqs,
                one_token_tiles=one_token_tiles, zero_tiles=zeros,
            )  # fmt: skip

    def _graph_for(self, entries: Sequence[BatchEntry], step: StepLora) -> GraphKey | None:
        """The captured graph that serves this step, if any: one of its path (or the nearest
        captured: two launches for a fused decode step, the shapes' choice for a mixed one)
        whose LoRA calls cover the step's modules."""
        if not self._graphs or len(entries) > self._max_seqs:
            return None
        lora = step.mode
        if all(len(e.token_ids) == 1 and e.sample for e in entries):
            size = next((n for n in self._decode_sizes if n >= len(entries)), None)
            if size is None:
                return None
            key = GraphKey(size, size, lora)
            if key not in self._graphs and lora in (LoraMode.FUSED, LoraMode.ONE_TOKEN):
                key = key._replace(lora=LoraMode.TWO)  # no fused graph at this size
        else:
            tokens = sum(len(e.token_ids) for e in entries)
            size = next((n for n in self._mixed_sizes if n >= tokens), None)
            if size is None or len(entries) > self.mixed_seqs(size):
                return None
            key = GraphKey(size, self.mixed_seqs(size), lora)
            if lora in (LoraMode.TWO, LoraMode.FUSED, LoraMode.ONE_TOKEN):  # decode-sized paths
                key = key._replace(lora=LoraMode.SHAPES)  # a mixed step's: by shapes
        attention = key._replace(modules=ATTENTION)
        if step.modules is not None and not step.modules & ~ATTENTION:
            if attention in self._graphs:  # the step's adapters adapt attention only
                return attention
        return key if key in self._graphs else None

    def _forward(
        self, lora: LoraContext | None, logits_out: torch.Tensor | None = None
    ) -> torch.Tensor:
        """The step on the filled batch: the inputs the previous step sampled, then the model
        (its logits written into ``logits_out`` when given: Transformer.forward)."""
        if self.tp is not None:  # the tokens rank 0 sampled: the same inputs on every rank
            self.tp.broadcast(self.batch.prev_tokens)
        self.batch.resolve_inputs()
        return self.model(self.batch, self.pool.tensor, lora, logits_out)

    @torch.inference_mode()
    def forward_adopted(self, step: StepLora, key: GraphKey | None = None) -> None:
        """A tensor-parallel worker's step: rank 0 filled the batch, which this rank adopted
        (StepBatch.adopt), and chose its LoRA path and the graph it replays (``key``; None:
        eager); its logits are rank 0's to sample, so they are dropped here."""
        if key is None:
            # the adopted tables list every token where rank 0's fill did (the same rule)
            self.batch.zero_tiles = self._zero_tiles(step.mode, self.batch.num_tokens)
            self._forward(self._lora_for(step.mode, step.modules))
            return
        entry = self._graphs.get(key)
        if entry is None:  # its collectives would meet other ones on rank 0
            raise RuntimeError(f"rank 0 replays CUDA graph {key}, which this rank did not capture")
        entry[0].replay()
        self.graph_steps += 1
        self.attention_steps += key.modules is not None

    @torch.inference_mode()
    def execute(self, entries: Sequence[BatchEntry]) -> torch.Tensor:
        """Run one step; returns float32 logits [number of sampling entries, vocab], in order.
        After a graph replay the rows are a view of the graph's output, valid until the next
        step."""
        step = self.step_lora(entries)
        key = self._graph_for(entries, step)
        if key is not None:
            # The step's tiles where the graph is of its path (a ONE_TOKEN decode step may
            # replay a graph of two launches, at a size without a ONE_TOKEN graph).
            apart = step.one_token_tiles and key.lora is step.mode
            self._fill_for(key, entries, apart, apart and step.pair_tiles)
            self.apart_steps += self.batch.tiles_apart and key.lora is LoraMode.NARROW
            graph, logits = self._graphs[key]
            if self.tp is not None:
                self.tp.send_step(self.batch, step, key)
            graph.replay()
            self.graph_steps += 1
            self.fused_steps += key.lora is LoraMode.FUSED
            self.attention_steps += key.modules is not None
            self.last_graph, self.last_lora = True, key.lora
            # Decode graphs pad with sampling rows of the reserved page: only the real ones count.
            return logits[: sum(e.sample for e in entries)]
        self.last_graph, self.last_lora = False, step.mode
        self.fused_steps += step.mode is LoraMode.FUSED
        zeros = self._addend and self._zero_tiles(step.mode, sum(len(e.token_ids) for e in entries))
        self.batch.fill(entries, one_token_tiles=step.one_token_tiles, zero_tiles=zeros,
                        pair_tiles=step.pair_tiles)  # fmt: skip
        self.apart_steps += self.batch.tiles_apart and step.mode is LoraMode.NARROW
        if self.tp is not None:
            self.tp.send_step(self.batch, step)
        return self._forward(self._lora_for(step.mode, step.modules))
