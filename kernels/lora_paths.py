"""Which multi-LoRA kernel path a call takes: two launches (shrink, expand: kernels/lora.py) or
one (kernels/lora_fused.py). Plain Python, no Triton: the engine consults it on the host every
step, and CPU serving never imports Triton.

Measured on the H200 (bench/results/kernels.json and kernels_sweep.json; the shared-adapter
figures from the fused-by-size revision's rows, ``lora_decode_fused_rule`` in kernels.json as
committed at 4a8bb31; one layer's seven projections, Llama-2-7B shapes, bf16):

- Prefill-sized calls of several slices fuse: x and h stay on chip for all the slices; faster
  with 1, 16 and 256 adapters alike. Shapes alone decide (launch_config).
- Decode-sized calls fuse only when the step's adapter tokens are mostly (half or more) on
  distinct adapters and hold enough rank rows to give every SM work (H200, one layer's S1
  q/k/v and o calls in a graph, two launches against fused: 292 tokens on 189 adapters 101.4
  against 85.9 µs, on 95 63.8 against 84.4; 512 on 100 72.5 against 93.5). A step fuses only
  when its adapters' ranks fit FUSED_DECODE_ROWS, and its calls are then made with that
  max_rank, whatever the engine's max_lora_rank (the host knows the step's ranks exactly; the
  kernels clamp to max_rank, so nothing is read out of bounds either way):
  H200, 512 decode tokens on 403 distinct rank-8 adapters, one layer's q/k/v and o calls in an
  engine sized for rank 128, 211.8 µs in two launches against 151.6 fused with 16 rows, where a
  fused launch holding all 128 rows took 520.4 (bench/results/lora_engine_calls.json at 1031c2c).
  Where tokens share adapters a fused program streams a whole A alone (batch 64 on one
  adapter: 79 µs against 37). Shapes cannot tell these apart; the engine can
  (decode_prefers_fused), and passes its choice per call (decode_call_fused) as
  lora_apply(fused=...).
- Calls of several slices (q, k, v; gate, up) gain from the fused kernel sooner than calls of
  one (o, down), whose tokens alone give too few programs to fill the GPU, each streaming a
  whole A. Per call, fused_config's launch against the two launches
  (bench/results/kernels_sweep_waves.json at 0b03fb3), rank 16, 64 distinct tokens: qkv 31.5
  µs against 34.4, gate_up 44.5 against 55.1, but o 20.3 against 18.1 and down 33.7 against
  23.0; 128 tokens: qkv 45.5 against 62.4, gate_up 62.9 against 97.2, o 25.7 against 28.1,
  down 43.3 against 38.6; rank 64, 64 tokens: o 31.4 against 47.4, down 58.7 against 64.7.
  So a fused step runs its multi-slice calls fused from 1024 adapter tokens x
  FUSED_DECODE_ROWS (64 tokens) and its single-slice calls from 4096 tokens x those rows (256
  tokens).
"""

from __future__ import annotations

# Calls of up to this many tokens are decode-sized: the shapes do not pick the fused path.
FUSED_MAX_TOKENS = 512
# The fused kernel holds every rank row in registers; above this the two launches are used.
FUSED_MAX_RANK = 128
# Prefill-sized calls fuse only while a fused program holds this many rank rows or fewer: it
# computes every row up to max_rank for every adapter. H200, 1024 tokens on 100 rank-8
# adapters, one layer's q/k/v and o calls, two launches against q/k/v fused: 83 µs against 80
# at max_rank 16, 97 against 118 at 32, 99 against 147 at 64, 101 against 186 at 128
# (bench/results/lora_engine_calls_before_tiles.json, the capacity cut to the adapters used).
FUSED_PREFILL_MAX_ROWS = 16
# The max_rank of the engine's fused decode steps (its fused CUDA graphs are captured with it).
FUSED_DECODE_ROWS = 16
# Decode steps fuse from this many adapter tokens x FUSED_DECODE_ROWS (decode_prefers_fused)...
FUSED_DECODE_MIN_ROWS = 1024
# ... and their single-slice calls (o, down) from this many tokens x rank rows (decode_call_fused).
FUSED_SINGLE_SLICE_MIN_ROWS = 4096
# Decode steps whose adapters all fit this many rank rows run every call fused, each token its
# own tile on the GEMV body, with programs of these rows (one_token_step_fuses): below the fused
# rule's size (adapter tokens x FUSED_DECODE_ROWS under FUSED_DECODE_MIN_ROWS) whatever their
# tokens share, and above it while they share adapters at most this much (tokens an adapter),
# or at any sharing where every call takes two-token tiles (ONE_TOKEN_PAIRS).
ONE_TOKEN_ROWS = 8
ONE_TOKEN_MAX_SHARING = 8
# Whether such a decode step's tokens that share an adapter go two to a tile (StepBatch.fill's
# pair_tiles), the GEMV body reading the adapter once for both (LoraLaunch.gemv_pair), rather
# than each token its own tile, reading it again: where every module of the step's adapters
# hoists (ModelRunner.pair_modules: Llama-7B's q/k/v and o). H100, one layer's S1 q/k/v and o
# calls in a CUDA graph, one-token tiles against pairs (bench/lora_engine_calls.py --pairs,
# bench/results/lora_engine_calls_pairs_8b7ce79_h100.json): 512 decode tokens on 100 adapters
# 56.4 against 49.4 µs, 292 on 94 41.9 against 39.5, 256 on 32 29.1 against 27.3; on adapters
# drawn from 1000 or 2000 (few tokens share) level, 229-512 tokens 55.0-99.4 against
# 55.6-99.4; the launch compiled with the pair body costs its one-token tiles nothing (within
# 1 µs); compiled for sm_90 it holds 128 registers a thread, 2 programs an SM as the one-token
# launch in place, 2 against 3 writing the delta (python -m bench.kernel_resources --pairs).
# In serving, S1 n = 1000 on one H100 one run after the other: the decode steps 1.28 s
# beyond the base model's steps fit to their shape against 1.38 (bench/step_compare.py), the
# throughput level (7133 tok/s against 7134).
ONE_TOKEN_PAIRS = True
# Decode-sized mixed steps (a prompt's chunk beside decode tokens, up to FUSED_MAX_TOKENS
# tokens) narrow too (prefill_step_narrows) when they hold at least this many distinct
# adapters; with fewer they keep each call's shapes at the engine's max_lora_rank (the two
# launches). H100, one layer's S1 q/k/v and o GEMMs with their LoRA calls in a CUDA graph, µs
# beyond the GEMMs, shapes against NARROW (bench/lora_addend.py --small-mixed,
# bench/results/lora_addend_small_mixed_e21fc80_h100.json): 287 decode tokens beside a
# 220- or 48-token chunk on 250 / 248 adapters 143.5 -> 76.1, 131.3 -> 69.6; on 97 / 94
# 67.8 -> 53.1, 64.5 -> 46.1; but on 5 adapters 35.9 -> 51.1, and 16 decode tokens beside a
# 260- or 100-token chunk on 16 / 15 adapters 34.2 -> 38.2, 35.5 -> 36.5: the shapes' path
# costs grow with the adapters, the fused kernel's less. The threshold lies between 16 and
# 94 adapters, where nothing was measured: S1's saturating trace puts about 190 adapters in
# such a step at n = 1000 (these steps, 57 of its 1376 with adapters, took 4.2 ms each beyond
# the base model's steps fit to their shape on the shapes' path: bench/results/
# step_compare_s1_e21fc80_h100_n1000_lora_pdl_on.json; narrowed, 2.39-2.80 ms in serving:
# step_compare_s1_c9d50d1_h100_n1000.json), at most 100 at n = 100 and 5 at n = 5; at 10
# requests/s a step holds about 16 sequences.
NARROW_MIN_ADAPTERS = 48
# A narrow mixed step's decode tokens take one-token tiles when they share their adapters at
# least this many to one (and at most ONE_TOKEN_MAX_SHARING): mixed_decodes_apart.
MIXED_APART_MIN_SHARING = 2
# Two-launch steps with an adapter above FUSED_DECODE_ROWS rank rows (S2's ranks 8-64) run
# programs of this many rank rows, in 16-token tiles (step_is_wide).
WIDE_RANK_ROWS = 32
# Prefill-sized steps with an adapter above FUSED_PREFILL_MAX_ROWS rank rows and none above
# these run every call fused at these rows when they hold at least WIDE_FUSED_MIN_ADAPTERS
# distinct adapters (prefill_step_fuses_wide).
WIDE_FUSED_ROWS = 64
WIDE_FUSED_MIN_ADAPTERS = 48


def fused_rank_rows(max_rank: int) -> int:
    """Rank rows a fused program holds: every row up to max_rank, a power of two >= 16."""
    rows = 16
    while rows < max_rank:
        rows *= 2
    return rows


def mixed_step_narrows(tokens: int, adapters: int) -> bool:
    """Whether a mixed step of ``tokens`` tokens on ``adapters`` distinct adapters may narrow
    (their ranks decide the rest: prefill_step_narrows): when it is prefill-sized, or
    decode-sized on NARROW_MIN_ADAPTERS adapters or more."""
    return tokens > FUSED_MAX_TOKENS or adapters >= NARROW_MIN_ADAPTERS


def shapes_prefer_fused(num_tokens: int, max_rank: int, num_slices: int) -> bool:
    """The path from shapes alone: fused for prefill-sized calls of several slices, when a
    fused program holds at most FUSED_PREFILL_MAX_ROWS rank rows."""
    if num_tokens <= FUSED_MAX_TOKENS or fused_rank_rows(max_rank) > FUSED_PREFILL_MAX_ROWS:
        return False
    return num_slices > 1


def decode_prefers_fused(adapter_tokens: int, distinct: int, step_rank: int) -> bool:
    """Whether a decode-sized step should run its LoRA calls on the fused kernel (each call's
    own path: decode_call_fused), with max_rank FUSED_DECODE_ROWS.

    adapter_tokens: the step's tokens that use an adapter; distinct: how many adapters they
    use; step_rank: the largest rank among those adapters. A step with an adapter above
    FUSED_DECODE_ROWS keeps the two launches (a fused program holds every rank row it may meet
    in registers: rows for the largest adapter would be computed, mostly masked, for all)."""
    if adapter_tokens <= 0 or fused_rank_rows(step_rank) > FUSED_DECODE_ROWS:
        return False
    mostly_distinct = 2 * distinct >= adapter_tokens
    return mostly_distinct and adapter_tokens * FUSED_DECODE_ROWS >= FUSED_DECODE_MIN_ROWS


def one_token_step_fuses(
    adapter_tokens: int, distinct: int, step_rank: int, pairs: bool = False
) -> bool:
    """Whether a decode step runs every LoRA call fused, each token its own one-token tile on
    the GEMV body, in programs of ONE_TOKEN_ROWS rank rows (4096-wide weight blocks, 8 warps,
    every load issued first: lora.fused_config): when its adapters all fit those rows, and it
    is either below the fused rule's size (fewer than FUSED_DECODE_MIN_ROWS //
    FUSED_DECODE_ROWS adapter tokens: its calls are latency-bound, a few programs each, so one
    launch a call beats two) or its tokens share adapters at most ONE_TOKEN_MAX_SHARING to one
    (``distinct``: how many adapters its ``adapter_tokens`` use). A token whose adapter another
    token shares takes the GEMV body too, reading the adapter again (mostly from L2), rather
    than a dot-body program (16 rows, 16 serial weight blocks each way) that sets the call's
    time; with ONE_TOKEN_PAIRS two such tokens share a tile and its one read of the weights.

    H200, one layer's S1 q/k/v and o calls in a CUDA graph: the decode steps of 10 requests/s
    (8-63 tokens on adapters drawn from 100 or 1000), two launches against one-token tiles: 8
    tokens 17.1 against 13.2 µs, 16 (on 15-16 adapters) 22.2-22.7 against 14.3-14.4, 32
    25.7-28.5 against 16.0-16.3, 63 42.7-43.1 against 20.2-20.4; full decode steps against the
    fused rule's 16-row launch (decode_prefers_fused) and the two launches: 64 tokens on 42
    adapters 17.9 / 41.1 / 36.1, 292 on 95 37.6 / 64.7 / 59.2, 292 on 185 45.4 / 68.8 / 102.5,
    512 on 98 51.3 / 80.4 / 61.5, 512 on 390 75.2 / 96.6 / 199.3
    (bench/results/lora_engine_calls_hoist.json). Shared more, against the two launches
    (lora_engine_calls_sharing.json): 8 tokens an adapter still gain (64 on 8 adapters 13.9
    against 20.8, 128 on 16 19.9 against 31.2, 256 on 32 26.4 against 36.7, 512 on 60 47.1
    against 49.3), 17 run level (512 on 30: 44.5 against 44.1), 100 lose (512 on 5: 41.7
    against 37.2). Two tokens to a tile (``pairs``: every call of the step takes them) win at
    every sharing timed, so such steps fuse whatever their tokens share; H100
    (lora_engine_calls_sharing_pairs_e7ae61d_h100.json), pairs / one-token tiles / two
    launches: 64 on 8 15.1 / 14.1 / 21.2, 256 on 32 26.8 / 28.6 / 37.4, 512 on 30 35.5 / 46.4 /
    45.4, 512 on 5 32.1 / 42.5 / 38.6, 256 on 5 22.4 / 24.9 / 31.7. In serving, S1 n = 5's
    decode steps (about 90 tokens an adapter) took 0.59 and 0.69 s beyond the base model's
    steps fit to their shape in two runs, against 0.75 before (docs/benchmarks.md, runs
    (bc)-(bf)): about 0.1 s a run, under a run's noise in the throughput ratio."""
    if adapter_tokens <= 0 or step_rank > ONE_TOKEN_ROWS:
        return False
    if pairs or adapter_tokens * FUSED_DECODE_ROWS < FUSED_DECODE_MIN_ROWS:
        return True
    return adapter_tokens <= ONE_TOKEN_MAX_SHARING * distinct


def mixed_decodes_apart(decode_tokens: int, distinct: int, step_rank: int) -> bool:
    """Whether a narrow mixed step (prefill_step_narrows) cuts its decode tokens into one-token
    tiles (StepBatch.fill's one_token_tiles), which its fused calls send to the GEMV body, where
    the segments' tiles put the decode tokens that share an adapter together in a tile of the
    dot body (16 rank rows, its shrink and expand one after the other): when its adapters fit
    ONE_TOKEN_ROWS and its decode tokens with an adapter share their ``distinct`` adapters
    MIXED_APART_MIN_SHARING to ONE_TOKEN_MAX_SHARING tokens to one.

    H200, one layer's S1 calls of a mixed step as the engine's narrow steps make them (every
    call fused at 16 rank rows, the masked MLP calls beside), segments' tiles against decode
    tokens apart (bench/results/lora_engine_calls_apart.json): decode tokens drawn from 100
    adapters (about 4.5 to one) 81.7 -> 71.5 µs beside a 200-token prompt, 90.0 -> 86.4 beside
    three of 400, 109.5 -> 92.7 (300 decode tokens) beside three of 512; drawn from 1000 (about
    1.2 to one: few tiles change) 92.5 -> 95.2, from 30 (15 to one) 66.3 -> 68.5, from 5 65.2
    -> 68.0."""
    if decode_tokens <= 0 or step_rank > ONE_TOKEN_ROWS:
        return False
    return MIXED_APART_MIN_SHARING * distinct <= decode_tokens <= ONE_TOKEN_MAX_SHARING * distinct


def prefill_step_narrows(step_rank: int) -> bool:
    """Whether a prefill-sized step (over FUSED_MAX_TOKENS tokens) makes its calls with
    FUSED_PREFILL_MAX_ROWS rank rows, every call on the fused kernel (the engine passes
    fused=True: decode_call_fused fuses its single-slice calls too, from 256 tokens): when every
    adapter of the step fits those rows; otherwise its calls keep the engine's max_lora_rank and
    each call's shapes pick. ``step_rank``: the step's largest adapter rank.

    H200, one layer's S1 q/k/v and o calls in a CUDA graph with the masked MLP calls beside them,
    the serving trace's mixed steps (bench/results/lora_engine_calls_steps.json at c7d24b0), at
    max_rank 128 (two launches; the engine's default) / 16 rows with the shapes' choice (q/k/v
    fused, o two launches) / 16 rows, all fused: 400 decode tokens on 331 adapters beside four
    400-token prompts 364.0 / 244.8 / 203.1 µs; 300 decode tokens on 266 beside three 512-token
    prompts 314.2 / 226.8 / 192.8; the same on 5 adapters 116.6 / 101.6 / 102.5; two 1024-token
    prompts of 2 adapters 122.5 / 103.5 / 103.9; 400 decode tokens beside three 200-token
    prompts (1000 tokens, 326 adapters) 195.6 / 196.7 / 195.6."""
    return fused_rank_rows(step_rank) <= FUSED_PREFILL_MAX_ROWS


def step_is_wide(step_rank: int) -> bool:
    """Whether a step on the two launches holds WIDE_RANK_ROWS rank rows a program (and 16-token
    tiles) rather than 16: when an adapter of it is above FUSED_DECODE_ROWS. A two-launch
    program loops over its adapter's rank in blocks of its rows, so a rank-64 adapter takes four
    trips at 16 rows, two at 32, while rank-8 adapters would compute masked rows at 32.

    H200, one layer's q/k/v and o calls of S2 steps (ranks 8, 16, 32 and 64 cycled over 100
    adapters) in a CUDA graph, 16 rows (the default: 16-token tiles, 32 from 1024 tokens) against
    32 rows in 16-token tiles (bench/results/lora_engine_calls_s2.json, --s2): 400 decode tokens
    on 98 adapters 133.6 against 116.2 µs, 256 on 94 133.9 against 111.6, 64 on 46 84.9 against
    69.5, 300 beside three 512-token prompts 304.4 against 220.8; 64 rows 125.6-146.6 for the
    first; and S1's rank-8 steps at 16 rows (69 µs for 292 tokens on 96 adapters) against 80 at
    32 (docs/kernels.md)."""
    return fused_rank_rows(step_rank) > FUSED_DECODE_ROWS


def prefill_step_fuses_wide(step_rank: int, distinct: int) -> bool:
    """Whether a prefill-sized step that does not narrow (an adapter above
    FUSED_PREFILL_MAX_ROWS) runs every call on the fused kernel at WIDE_FUSED_ROWS rank rows,
    16-token tiles, 128-wide weight blocks and 4 warps (lora.fused_config), rather than two
    launches of WIDE_RANK_ROWS-row programs (step_is_wide): when none of its adapters is above
    WIDE_FUSED_ROWS and it holds at least WIDE_FUSED_MIN_ADAPTERS distinct adapters (its
    ``distinct``). A fused program keeps x and h on chip for its tile's shrink and expand, where
    the two launches write h out and read every tile's x once per rank block; a program computes
    every row up to WIDE_FUSED_ROWS for every adapter, which costs more than it saves when few
    adapters with long prompts fill the step.

    H200, one layer's S2 calls (ranks 8, 16, 32, 64 cycled) of mixed steps in a CUDA graph, the
    masked MLP calls beside, the two launches against this launch
    (bench/results/lora_engine_calls_s2_rule.json, --s2-rule): 300 decode tokens beside three
    512-token prompts, on 5 / 30 / 59 / 98 / 256 distinct adapters 125.8 -> 152.4, 151.0 ->
    153.3, 180.9 -> 166.7, 201.8 -> 174.2, 318.0 -> 269.7 µs; 400 beside four 400-token
    prompts on 30 / 335 165.4 -> 166.8, 370.0 -> 281.7; 400 beside three 200-token prompts on 98
    / 342 150.7 -> 160.3, 322.9 -> 267.3; two 1024-token prompts of 2 adapters 158.5 -> 152.1.
    The gains grow with the adapters. The threshold lies between 30 (a loss of 1.5%) and 59 (a
    gain of 8%), a range that adapter affinity in admission (services/inference/engine/
    affinity.py) makes more common: S2 n = 100's steps of 64 sequences or more held 72
    adapters on average with it, 90 without (bench/results/serving_s2_f7c5ece*.json). The one
    loss of many adapters is the short-prompt step at 98, which one rule by adapters keeps (S2
    n = 100 through the services: the mixed steps' time over the base model's 1.17 -> 1.04 s by
    bench/step_compare.py's bins, below what two runs resolve end to end; docs/benchmarks.md)."""
    rows = fused_rank_rows(step_rank)
    return FUSED_PREFILL_MAX_ROWS < rows <= WIDE_FUSED_ROWS and distinct >= WIDE_FUSED_MIN_ADAPTERS


def decode_call_fused(
    step_fused: bool | None, num_tokens: int, num_slices: int, rows: int, one_token: bool = False
) -> bool | None:
    """One call's path in a step whose rule said ``step_fused`` (None: the shapes decide, False:
    two launches): in a fused step, calls of several slices fuse and a call of one slice fuses
    from FUSED_SINGLE_SLICE_MIN_ROWS tokens x the launch's rank ``rows`` (``num_tokens``: the
    call's, padding included, so a CUDA graph's choice is fixed by its batch size); in a step
    of one-token tiles (``one_token``: one_token_step_fuses) every call fuses."""
    if not step_fused or num_slices > 1 or one_token:
        return step_fused
    return fused_rank_rows(rows) * num_tokens >= FUSED_SINGLE_SLICE_MIN_ROWS
