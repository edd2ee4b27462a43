"""The LoRA calls of one decoder layer as the serving engine makes them (CUDA).

bench/kernels.py sizes each call for its own adapters (max_rank = the adapters' rank, a segment
capacity of the adapters in use); the engine does not: its calls carry max_lora_rank (128 by
default) and a segment capacity fixed for its CUDA graphs (min(resident adapters,
max_num_seqs) + 2). This times S1's calls (q/k/v and o of rank-8 adapters, Llama-2-7B shapes,
bf16) in a CUDA graph, per layer, over token counts and adapter counts, by max_rank, segment
capacity and path (two launches, fused, or the shapes' choice), and with ``--splits`` the
two-launch path by shrink split and expand block. Bandwidth counts each used adapter's A and B
once plus the activations (bench/kernels.py's lora_bytes) against 4.2 TB/s of copy bandwidth.
With ``--profile`` each case's engine default (max_rank 128, capacity 514) also runs eagerly
under the torch profiler, and its rows say how much of the time each kernel takes.

With ``--steps`` the cases are instead the serving trace's step compositions (bench/serving.py's
step log, n = 1000, adapters in the host cache): mixed steps of decode tokens on distinct adapters
beside a few prompts' prefill chunks, and the decode steps of 10 requests/s; each by path and
max_rank, and with the MLP calls (gate/up, down) an S1 step also launches, masked: its adapters
have no MLP modules, so those launches find nothing to do.

With ``--small`` the cases are the decode steps of 10 requests/s (8-32 tokens on adapters drawn
from 100, each drawn three times), by the two launches the engine makes there against fused
launches whose small tiles take the GEMV body (SMALL_POINTS), at 16 and 8 rank rows.

With ``--one-token`` the cases are ``--small``'s and the variants fused launches whose tiles are
all of one token (ONE_TOKEN_POINTS): the block-16 tile table holds every token as its own tile, so
a token whose adapter another token shares also takes the GEMV body (its second read of the
adapter mostly from L2) instead of putting its tile's one program on the dot body.

With ``--hoist`` the cases are ``--one-token``'s, the full decode steps of CASES and the
trace's mixed steps, by the fused kernel's one-token GEMV body with every load issued first
(LoraLaunch.gemv_hoist: 8 rank rows, 4096-wide blocks, 8 warps) and without, on one-token tiles
(decode steps) and on the usual tiles, beside the engine's fused-step rule at 16 rows and the
two launches.

With ``--sharing`` the cases are decode steps whose tokens share adapters more (SHARING_CASES),
by the two launches against one-token tiles with every load issued first, and against tiles of
up to two tokens of one adapter (as ``--pairs``): where the one-token rule
(kernels/lora_paths.one_token_step_fuses) stops, and whether pairs move that end.

With ``--pairs`` the cases are decode steps from 16 to 512 tokens on adapters drawn from 32 to
2000 (PAIR_CASES), by the engine's one-token tiles (each token a tile, the GEMV body's loads
hoisted) against tiles of up to two tokens of one adapter (LoraLaunch.gemv_pair: the second
token reuses the weights the program loaded for the first; the tables StepBatch.fill writes
with pair_tiles), the one-token tiles on the launch compiled with pairs too, and the two
launches.

With ``--dot`` the cases are the trace's mixed steps (and two prompts alone), every call fused
at 16 rank rows as the engine's narrow steps make them, by the fused kernel's dot body, which
their prompts' tiles take: tile tokens, weight blocks, warps and parts (DOT_POINTS; the run of
bench/results/lora_engine_calls_dot.json also timed the expand loading y a block ahead, an
option of the kernel at e10a3fb that lost on the many-adapter steps and was removed).

With ``--stages`` the cases are ``--dot``'s and mixed steps of the few-adapter traces
(STAGES_CASES), every call fused at 16 rank rows by fused_config's own launch, by its software
pipeline's depth (STAGES: the loads a program keeps in flight in the dot body's shrink and expand
loops, which set a prompt tile's program's time), beside the two launches.

With ``--floor`` the cases are prompts alone (one adapter, 64 to 1024 tokens), decode tokens alone
and the two together (FLOOR_CASES), every call at 16 rank rows adding into y in place (as the
engine's steps under 256 tokens do; ``--parts`` times its larger ones, which write the delta):
fused_config's own launch, its dot body split over 2 and 4 parts, and the two launches. Where a
mixed step's time stays when its tokens shrink says which tiles set its floor (S1 n = 5's mixed
steps took 1.65 ms each beyond the base model's on next to no adapter bytes:
step_compare_s1_small_2b669a6_h100_n5.json).

With ``--s2`` the cases are S2's steps (ranks 8-64, which take the two launches) by the two
launches' blocks (S2_POINTS), and on the fused kernel holding all 64 rank rows (S2_FUSED_POINTS:
its dot body's tiles, weight blocks, warps and parts).

With ``--s2-steps`` the cases are S2's mixed steps (S2_STEP_CASES), by the engine's WIDE two
launches against the fused kernel at 64 rank rows (S2_STEP_POINTS); with ``--s2-rule``, S2's
mixed steps of few to many adapters (S2_RULE_CASES), the engine's WIDE two launches against
its WIDE_FUSED launch (kernels.lora_paths.prefill_step_fuses_wide).

With ``--s2-split`` the cases are S2's decode steps (S2_SPLIT_CASES), by the shrink's rank
blocks shared over programs (rank_split), its d_in split, rank rows and expand blocks
(S2_SPLIT_POINTS), with the tiles listed by rank and not, and the torch profiler's shrink and
expand times for some (kernels.lora._wide_split chose from it).

With ``--parts`` the cases are ``--stages``' and prompts alone (PARTS_CASES), every call as the
engine's narrow steps of 256 tokens or more make them (fused at 16 rank rows, writing the delta
onto which the GEMM adds, decode tokens apart where kernels.lora_paths.mixed_decodes_apart says),
by the dot body's parts (fused_config's own, then 2 and 4), beside the two launches in place.

With ``--delta-dot`` the cases are mixed steps of the S1 traces and a prompt alone
(DELTA_DOT_CASES), every call as ``--parts`` makes them, by the dot body's tile tokens, weight
blocks and warps (DELTA_DOT_POINTS) and its pipeline depth (DELTA_STAGES), beside the two
launches in place.

With ``--delta-split`` the cases are ``--delta-dot``'s, each call timed alone (q/k/v, then o),
writing the delta: by fused_config's own launch, and with a grid of the step's own tiles (a
segment capacity of its adapters + 2, or of its entries + 2 where its decode tokens are apart,
not the engine's 514: the programs that find no tile left out). A row's tb_per_s counts that
call's bytes (a delta's y written once, not read and written). At 9f4d3b9 it also timed 2 parts,
the calls in place, and the dot body's tiles sharing d_in among 2 and 4 programs; at b43b3ef 3
and 6 programs an SM striding over the tiles (options the fused kernel had then:
docs/kernels.md).

With ``--apart`` the cases are mixed steps whose decode tokens share adapters (drawn from 5,
30, 100 and 1000) beside prompts, every call fused at 16 rank rows as the engine's narrow steps
make them (the masked MLP calls beside), on the segments' tiles (the decode tokens of one
adapter together in dot-body tiles) against each entry apart (every decode token a one-token
tile on the GEMV body: kernels.lora_paths.mixed_decodes_apart), and against the launch without
its GEMV body (every tile on the dot body: compiled for sm_90, the GEMV body holds these
launches at 128 registers a thread, 4 programs an SM, where without it they hold 96 in place
and 76-77 writing the delta, 5 and 6 programs: python -m bench.kernel_resources --delta).

With ``--s2-gemv`` the cases are S2's decode steps (S2_GEMV_CASES: tokens drawn from 100 and
from 1000 adapters), by the engine's WIDE two launches against fused launches at 64 rank rows
whose one-token tiles (every token its own tile) take the GEMV body at 64 rows
(S2_GEMV_POINTS: weight block, warps, and the narrow body's rows for tiles of rank 32 or less),
beside the fused kernel at 64 rows on the segments' tiles (its dot body, no GEMV body).

With ``--s2-small`` the cases are S2's decode steps at 10 requests/s (S2_SMALL_CASES: 8-32
tokens on adapters drawn from 100, each drawn SMALL_DRAWS times), where the engine's WIDE two
launches cost four launches' latency a layer (bench/results/step_compare_s2_f7c5ece_rate10_n100
.json: 1.15 ms a step beyond the base model's fit, against 0.22 ms of adapter bytes), against
one fused launch a call at 64 rank rows on the segments' tiles (its dot body).

With ``--s2-few`` the cases are S2's full decode steps on few to many adapters (S2_FEW_CASES:
S2 n = 5's, and the 20-100 adapters that adapter affinity leaves n = 100's steps), by the
engine's WIDE two launches (with the torch profiler's shrink and expand times) against their
d_in splits, rank splits, rank rows, tile tokens and expand blocks (S2_FEW_POINTS), and the
fused kernel at 64 rank rows on its dot body (S2_FUSED_POINTS).

With ``--s2-prefill`` the cases are S2's prefill-sized steps on few adapters (S2_PREFILL_CASES:
a step's 2048 tokens of prompts, and prompts beside the decode tokens of 20-40 adapters, as adapter
affinity leaves n = 100's), which take the WIDE two launches in 16-token tiles (fewer than
WIDE_FUSED_MIN_ADAPTERS adapters), by the two launches' tile tokens and expand blocks
(S2_PREFILL_POINTS), against the engine's WIDE_FUSED launch: whether larger tiles, each reading an
adapter's A and Bᵀ for more tokens, pay where prompts fill them.

With ``--gemv`` the cases are both sets, decode-only and the trace's steps, and the variants the
fused kernel's GEMV body (kernels/lora_fused.py) by rank rows, tiles it takes (gemv_max), weight
block and warps (GEMV_POINTS), every call on the fused kernel, against the engine's fused-step
rule (q/k/v fused, o fused from 256 tokens; prefill-sized steps all fused) and all two
launches.

    python bench/lora_engine_calls.py [--splits] [--profile] [--steps] [--small] [--one-token] \
        [--hoist] [--sharing] [--pairs] [--dot] [--apart] [--s2] [--s2-steps] [--s2-gemv] \
        [--s2-split] [--s2-small] [--s2-few] [--s2-prefill] \
        [--gemv] [--points N] \
        [--out bench/results/lora_engine_calls.json]
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

import torch  # noqa: E402

from bench import kernels as kb  # noqa: E402
from bench.provenance import write_result  # noqa: E402
from kernels import lora, lora_paths  # noqa: E402
from kernels.lora_layout import K, O, Q, V  # noqa: E402
from kernels.lora_ref import make_lora_tokens  # noqa: E402

CALLS = (kb.CALLS[0], kb.CALLS[1])  # q/k/v and o: S1's modules
# tokens, adapters (drawn uniformly, as S1's power law with alpha 1): the last three are the
# serving benchmark's full decode steps with n = 5, 100 and 1000
CASES = (
    (16, 100),  # the first two: decode steps at 10 requests/s with n = 100
    (32, 100),
    (292, 100),
    (292, 290),
    (64, 60),
    (512, 30),
    (1024, 100),
    (512, 5),
    (512, 100),
    (512, 1000),
)
# --steps: (decode tokens, adapters they are drawn from, prefill chunks' lengths): mixed steps
# of the n = 1000 trace (its step log: ~360 distinct adapters beside 1000-2000 tokens in all)
# and 10 requests/s decode steps with n = 100.
STEP_CASES = (
    (400, 1000, (400, 400, 400, 400)),
    (400, 1000, (200, 200, 200)),
    (300, 1000, (512, 512, 512)),
    (16, 100, ()),
    (16, 100, (256,)),
    # few adapters (n = 5): prefill-sized steps of a few prompts, whether o should fuse there
    (300, 5, (512, 512, 512)),
    (0, 5, (1024, 1024)),
)
# --gemv: (GEMV rank rows, most tokens of a GEMV tile, weight block, warps). A first sweep over
# 1 and 16 tokens, blocks 256-1024 and 4 or 8 warps found 1 token, 1024 and 4 warps fastest
# where adapters are many (bench/results/lora_engine_calls_gemv_sweep.json); these go on from
# there.
GEMV_POINTS = (
    (16, 1, 1024, 4),
    (8, 1, 1024, 4),
    (8, 1, 2048, 4),
    (8, 1, 2048, 8),
    (16, 1, 1024, 2),
    (8, 1, 1024, 2),
    (8, 2, 2048, 4),
    (16, 2, 1024, 4),
)
# --small: the decode steps of 10 requests/s (8-32 sequences on adapters drawn uniformly from
# n = 100, so a few tiles of two or three tokens), each composition drawn SMALL_DRAWS times, by
# the two launches the engine makes there and fused launches whose tiles of up to 1, 2 or 4
# tokens take the GEMV body, at 16 and at 8 rank rows (rows, tiles it takes, block, warps).
SMALL_CASES = ((8, 100), (12, 100), (16, 100), (24, 100), (32, 100))
SMALL_DRAWS = 3
SMALL_POINTS = (
    (16, 1, 1024, 4),
    (16, 2, 1024, 4),
    (8, 1, 2048, 4),
    (8, 2, 2048, 4),
    (8, 4, 2048, 4),
    (8, 4, 1024, 4),
)
# --one-token: (GEMV rank rows, weight block, warps, o fused), every tile one token.
ONE_TOKEN_CASES = (*SMALL_CASES, (48, 100), (63, 1000))
ONE_TOKEN_POINTS = (
    (8, 2048, 4, True),
    (8, 2048, 4, False),
    (16, 1024, 4, True),
    (16, 2048, 8, True),
    (8, 2048, 8, True),
    (8, 4096, 8, True),
)
# --hoist: decode steps of 64 tokens and more (CASES' full steps) and the trace's mixed steps
HOIST_DECODE_CASES = ((64, 60), (292, 100), (292, 290), (512, 100), (512, 1000))
HOIST_STEP_CASES = STEP_CASES[:3]
# --sharing: (tokens, adapters drawn from): about 4 to 100 tokens an adapter
# --pairs: decode steps (tokens, adapters drawn from): the saturating S1 traces' batches (about
# 230 on the H100's pool, 300 on the H200's) at n = 100 to 2000, and the sharing rule's ends
PAIR_CASES = ((16, 100), (64, 1000), (64, 100), (128, 1000), (229, 2000), (229, 1000),
              (229, 100), (292, 1000), (292, 100), (512, 1000), (512, 100), (256, 32))  # fmt: skip
SHARING_CASES = ((64, 16), (64, 8), (128, 24), (128, 16), (256, 48), (256, 32), (512, 80),
                 (512, 60), (512, 30), (512, 5), (256, 5))  # fmt: skip
# --dot: (tile tokens, shrink block, expand block, warps, parts) of the fused kernel's dot body;
# None: fused_config's own (the engine's narrow steps: 16, 256, 256, 4, 1 since 9af3fd9)
DOT_POINTS = (
    None,
    (32, 256, 256, 4, 1),
    (16, 256, 256, 4, 1),
    (64, 256, 256, 8, 1),
    (32, 256, 512, 8, 1),
    (32, 512, 512, 8, 1),
    (32, 128, 128, 4, 1),
    (32, 256, 256, 4, 2),
    (32, 256, 256, 8, 2),
)
DOT_CASES = (*STEP_CASES[:3], *STEP_CASES[4:])  # the 10 requests/s prompt step too
# --stages: the dot body's pipeline depth (fused_config's own launch otherwise), on --dot's
# cases and the mixed steps of S1 n = 5 / 100 / 1000's traces on an H100 (about 900 tokens, 650 of
# them prompts', on average; bench/results/step_compare_s1_small_2b669a6_h100_n5.json)
STAGES = (3, 2, 4, 5, 6)
STAGES_CASES = (*DOT_CASES, (250, 5, (400, 250)), (220, 100, (300,)), (220, 1000, (300,)))
# --floor: (decode tokens, adapters they are drawn from, prompts' lengths), the prompts each on an
# adapter of its own; the fused dot body's parts (fused_config's own, then 2 and 4)
FLOOR_CASES = (
    (0, 1, (64,)), (0, 1, (256,)), (0, 1, (512,)), (0, 1, (1024,)), (0, 4, (256,) * 4),
    (250, 5, ()), (250, 5, (400, 250)), (220, 1000, ()), (220, 1000, (300,)),
)  # fmt: skip
FLOOR_PARTS = (None, 2, 4)
# --parts: the engine's mixed steps (--stages' cases) and prompts alone, as its narrow steps of
# 256 tokens or more make them (every call fused, writing the delta, decode tokens apart where
# lora_paths.mixed_decodes_apart says), by the dot body's parts (fused_config's own, 2, 4)
PARTS_CASES = (*STAGES_CASES, (0, 1, (512,)), (0, 4, (256,) * 4), (0, 1, (1024,)))
# --delta-dot: the engine's mixed steps (S1 n = 5 / 100 / 1000 traces' and a prompt alone), every
# call writing the delta as --parts', by the dot body's tile tokens, weight blocks and warps
# (block_m, shrink_k, expand_n, warps, parts; None: fused_config's own) and pipeline depth
DELTA_DOT_CASES = (STEP_CASES[0], STEP_CASES[2], STEP_CASES[5], (250, 5, (400, 250)),
                   (220, 100, (300,)), (220, 1000, (300,)), (0, 1, (1024,)))  # fmt: skip
DELTA_DOT_POINTS = (
    None,
    (32, 256, 256, 4, 1),
    (64, 256, 256, 8, 1),
    (16, 128, 128, 4, 1),
    (16, 256, 256, 8, 1),
    (16, 512, 512, 8, 1),
    (16, 256, 512, 4, 1),
    (16, 128, 256, 4, 1),
    (32, 128, 128, 4, 1),
)
DELTA_STAGES = (3, 5)
# --delta-split: --delta-dot's cases, each call alone (q/k/v, then o), writing the delta by
# fused_config's own launch and on a grid of the step's own tiles
# --s2: S2's steps (ranks 8, 16, 32 and 64 cycled over n = 100 adapters, q/k/v/o), which take
# the two launches at the engine's max_lora_rank (a fused step needs every rank <= 16): decode
# steps at the saturating trace's batch and a mixed step; by the two launches' blocks (rank rows
# a shrink and an expand program hold, split of d_in, expand columns, tile tokens).
S2_RANKS = (8, 16, 32, 64)
S2_CASES = ((400, 100, ()), (256, 100, ()), (64, 100, ()), (300, 100, (512, 512, 512)))
S2_POINTS = (  # (rank rows, split_k, expand_n, block_m); None: launch_config's own choice
    None,
    (32, 2, 256, 16),
    (64, 2, 256, 16),
    (16, 1, 256, 16),
    (16, 4, 256, 16),
    (16, 2, 128, 16),
    (32, 1, 128, 16),
    (64, 1, 128, 16),
    (16, 2, 256, 32),
    (32, 2, 256, 32),
)
# --s2, fused at max_rank 64: None: fused_config's own; else (tile tokens, shrink block, expand
# block, warps, parts) of the dot body, which S2's tiles take (no GEMV body above 16 rows)
S2_FUSED_POINTS = (
    None,
    (16, 256, 256, 8, 2),
    (16, 256, 256, 8, 4),
    (16, 128, 128, 4, 1),
    (16, 128, 128, 4, 4),
)
# --s2-steps: S2's mixed steps (prefill-sized), with the masked MLP calls, by the engine's WIDE
# two launches (32 rank rows) against the fused kernel at 64 rows (S2_STEP_POINTS: tile tokens,
# weight blocks, warps, parts of its dot body)
S2_STEP_CASES = ((400, 100, (400,) * 4), (400, 100, (200,) * 3), (300, 100, (512,) * 3),
                 (300, 5, (512,) * 3), (0, 5, (1024, 1024)))  # fmt: skip
S2_STEP_POINTS = (
    None,
    (16, 128, 128, 4, 1),
    (16, 64, 64, 4, 1),
    (16, 128, 128, 8, 1),
    (32, 128, 128, 4, 1),
    (16, 256, 256, 4, 1),
    (16, 128, 128, 4, 2),
)
# --s2-rule: S2's mixed steps by the adapters they hold (drawn from 5 to 1000), the engine's WIDE
# two launches against its WIDE_FUSED launch (lora_paths.prefill_step_fuses_wide)
S2_RULE_CASES = ((300, 5, (512,) * 3), (300, 30, (512,) * 3), (300, 60, (512,) * 3),
                 (300, 100, (512,) * 3), (300, 1000, (512,) * 3), (400, 1000, (400,) * 4),
                 (400, 30, (400,) * 4), (400, 100, (200,) * 3), (400, 1000, (200,) * 3),
                 (0, 5, (1024, 1024)))  # fmt: skip
# --s2-split: S2's decode steps (drawn from 100 and from 1000 adapters) on the engine's WIDE two
# launches (32 rank rows a program, split 2) against shrinks whose rank blocks spread over
# programs (rank_split) and other rank rows, splits and expand blocks (S2_SPLIT_POINTS: shrink
# rows, rank_split, split_k, expand rows, expand_n); "sorted": the tiles listed by their
# adapter's rank, largest first (the host's order, kernels/tile_table.py, is by segment).
S2_SPLIT_CASES = ((400, 100, ()), (256, 100, ()), (64, 100, ()), (400, 1000, ()),
                  (300, 100, (512,) * 3))  # fmt: skip
S2_SPLIT_POINTS = (
    (32, 1, 2, 32, 256),
    (32, 2, 2, 32, 256),
    (16, 2, 2, 32, 256),
    (16, 4, 2, 32, 256),
    (32, 1, 4, 32, 256),
    (32, 2, 2, 64, 128),
    (16, 4, 2, 64, 128),
    (32, 2, 1, 32, 256),
)
# --apart: (decode tokens, adapters they are drawn from, prefill chunks' lengths), the decode
# tokens' sharing from about 90 (n = 5) to 1.2 (n = 1000) tokens an adapter
APART_CASES = (
    (450, 100, (200,)),
    (400, 100, (400, 400, 400)),
    (300, 100, (512, 512, 512)),
    (450, 1000, (200,)),
    (450, 30, (200,)),
    (450, 5, (200,)),
)
# --s2-gemv: S2's decode steps (tokens, adapters drawn from), and the GEMV body at 64 rank rows
# (weight block, warps, narrow rows: 32 = tiles of rank <= 32 in 32-row blocks twice as wide)
# --s2-small: S2's decode steps at 10 requests/s (8-32 sequences on about as many adapters)
S2_SMALL_CASES = ((8, 100, ()), (16, 100, ()), (24, 100, ()), (32, 100, ()))
S2_GEMV_CASES = ((400, 100, ()), (256, 100, ()), (64, 100, ()), (400, 1000, ()), (256, 1000, ()))
S2_GEMV_POINTS = (
    (256, 8, 0),
    (256, 8, 32),
    (128, 4, 0),
    (128, 4, 32),
    (512, 8, 32),
)
# --s2-few: S2's decode steps (tokens, adapters drawn from); points (shrink rows, rank_split,
# split_k, expand rows, expand_n, block_m). 64-token tiles do not compile: the expand's
# registers are capped (_EXPAND_MAX_REGISTERS), and its 64 x 256 block needs 158.
S2_FEW_CASES = ((224, 5, ()), (128, 5, ()), (224, 20, ()), (224, 40, ()), (288, 40, ()),
                (224, 100, ()))  # fmt: skip
S2_FEW_POINTS = (
    (32, 2, 1, 32, 256, 16),
    (32, 2, 2, 32, 256, 16),
    (32, 2, 4, 32, 256, 16),
    (32, 2, 8, 32, 256, 16),
    (32, 2, 16, 32, 256, 16),
    (32, 1, 16, 32, 256, 16),
    (32, 1, 4, 32, 256, 16),
    (16, 4, 4, 32, 256, 16),
    (64, 1, 4, 64, 128, 16),
    (32, 2, 2, 32, 256, 32),
    (32, 2, 4, 32, 256, 32),
    (32, 2, 4, 32, 128, 16),
    (32, 2, 8, 32, 128, 32),
)
# --s2-prefill: S2's prefill-sized steps (decode tokens, adapters drawn from, prompts' chunks);
# points (block_m, expand_n) of the WIDE two launches (32 rank rows, no splits)
S2_PREFILL_CASES = ((0, 5, (1024, 1024)), (0, 5, (512,) * 4), (100, 20, (512,) * 3),
                    (224, 40, (512,) * 3), (64, 20, (1024, 960)))  # fmt: skip
S2_PREFILL_POINTS = ((16, 256), (32, 256), (32, 128), (64, 128), (64, 64))
# each S2 mode's cases (ranks S2_RANKS cycled over the adapters)
S2_MODE_CASES = {"s2": S2_CASES, "s2_split": S2_SPLIT_CASES, "s2_prefill": S2_PREFILL_CASES,
                 "s2_few": S2_FEW_CASES, "s2_small": S2_SMALL_CASES, "s2_gemv": S2_GEMV_CASES,
                 "s2_steps": S2_STEP_CASES, "s2_rule": S2_RULE_CASES}  # fmt: skip
S1_MODULES = (Q, K, V, O)
LAYERS = 4  # each with its own weights, so one layer's adapters do not stay in L2


def fused_launches(t: int, max_rank: int, calls, **fields) -> list:
    """fused_config's launch for each of ``calls`` at ``t`` tokens, with ``fields`` replaced."""
    return [
        lora.fused_config(t, kb.POOL_W, max_rank, len(m), max(w), d_in=d)._replace(**fields)
        for m, d, w in calls
    ]


def time_case(
    t: int,
    n: int,
    gen: torch.Generator,
    variants: list[dict],
    prefill: tuple[int, ...] = (),
    ranks: tuple[int, ...] = (8,),
) -> list[dict]:
    """t tokens on adapters drawn uniformly from n; with ``prefill``, that many more chunks of
    those lengths, each on an adapter of its own (a prompt's), after the decode tokens; the
    adapters' ranks cycled from ``ranks``."""
    rows = torch.randint(0, n, (t,), generator=gen)
    decode_distinct = int(torch.unique(rows).numel())
    prompts = torch.randperm(n, generator=gen)[: len(prefill)]
    # the step's entries (adapter, tokens): each decode token, then each prompt's chunk,
    # grouped by adapter as the engine's steps are (a stable sort: decode tokens first)
    entries = sorted([(int(r), 1) for r in rows]
                     + [(int(p), k) for p, k in zip(prompts, prefill, strict=True)],
                     key=lambda e: e[0])  # fmt: skip
    rows = torch.tensor([r for r, k in entries for _ in range(k)], dtype=torch.int32)
    starts = [0]
    for _, k in entries:
        starts.append(starts[-1] + k)
    decode, t = t, rows.numel()
    case = kb.build_lora(n, ranks, LAYERS, rows)
    used = int(torch.unique(rows).numel())
    all_calls = kb.CALLS if any(v.get("mlp") for v in variants) else CALLS
    nbytes = kb.lora_bytes(rows, ranks, t, CALLS)
    xs = [[torch.randn(t, d, dtype=kb.DT, device=kb.DEV) for _, d, _ in all_calls]
          for _ in range(LAYERS)]  # fmt: skip
    ys = [[torch.zeros(t, sum(w), dtype=kb.DT, device=kb.DEV) for _, _, w in all_calls]
          for _ in range(LAYERS)]  # fmt: skip
    out = []
    for v in variants:
        max_rank, cap = v["max_rank"], v["segments"]
        # With the MLP calls the step's module mask is S1's (q, k, v, o): they find no work.
        calls = all_calls if v.get("mlp") else CALLS
        modules = S1_MODULES if v.get("mlp") else None
        apart = v.get("apart")
        if apart == "engine":  # the engine's narrow mixed step's choice at S1's rank 8
            apart = lora_paths.mixed_decodes_apart(decode, decode_distinct, 8)
        if cap == "own":  # the step's own segments: its entries where they are apart
            cap = (len(starts) - 1 if apart else used) + 2
        cap = cap or used + 2
        tokens = make_lora_tokens(case.rows, capacity=cap, modules=modules,
                                  one_token_tiles=bool(v.get("one_token") or apart),
                                  entries=starts if apart else None,
                                  pair_tiles=bool(v.get("pairs")),
                                  zeros=bool(v.get("delta")))  # fmt: skip
        if v.get("sorted"):
            tokens = rank_sorted(tokens, case.index.ranks[:, Q].cpu())
        cfgs = [None] * len(calls)
        fused = [v.get("fused")] * len(calls)
        if v.get("engine"):  # the engine's per-call choice in a fused step (kernels/lora_paths)
            fused = [lora_paths.decode_call_fused(True, t, len(m), max_rank) or t > 512
                     for m, _, _ in calls]  # fmt: skip
        if v.get("o_two"):  # o (the last call) on the two launches
            fused[-1] = False
        if v.get("gemv_max"):
            cfgs = fused_launches(
                t, max_rank, calls,
                gemv_max=v["gemv_max"], gemv_k=v["gemv_block"], gemv_n=v["gemv_block"],
                shrink_warps=v["warps"], gemv_r=v.get("gemv_r", 0),
                **{k: v[k] for k in ("gemv_narrow", "gemv_hoist", "gemv_pair") if k in v},
            )  # fmt: skip
            if v.get("o_two"):
                cfgs[-1] = None
        if v.get("dot"):
            bm, sk, en, warps, parts = v["dot"]
            cfgs = fused_launches(t, max_rank, calls, block_m=bm, shrink_k=sk, expand_n=en,
                                  shrink_warps=warps, parts=parts)  # fmt: skip
        if v.get("stages"):
            cfgs = fused_launches(t, max_rank, calls, stages=v["stages"])
        if v.get("parts"):
            cfgs = fused_launches(t, max_rank, calls, parts=v["parts"])
        if v.get("no_gemv"):  # the fused launch without its GEMV body: every tile on the dot body
            cfgs = fused_launches(t, max_rank, calls, gemv_max=0)
        if v.get("split_k"):
            cfgs = [
                lora.launch_config(t, d, kb.POOL_W, max_rank, len(m))._replace(
                    split_k=v["split_k"], expand_n=v["expand_n"],
                    **{k: v[k] for k in ("shrink_r", "expand_r", "block_m", "rank_split")
                       if k in v},
                )
                for m, d, _ in calls
            ]  # fmt: skip
        split = max((c.split_k for c in cfgs if c), default=16) if cfgs[0] else 16
        ws = torch.empty(lora.workspace_size(t, 3, max_rank) * split, device=kb.DEV)

        block = v.get("rank_block", 16)

        delta = bool(v.get("delta"))
        only = v.get("only")  # the index in calls of the one call timed (None: every call)

        def fn(tokens=tokens, cfgs=cfgs, ws=ws, fused=fused, max_rank=max_rank, calls=calls,
               rank_block=block, delta=delta, only=only):  # fmt: skip
            for layer in range(LAYERS):
                for c, (m, _, w) in enumerate(calls):
                    if only is not None and c != only:
                        continue
                    lora.lora_apply(
                        ys[layer][c], xs[layer][c], case.pool[layer], case.index, tokens, m, w,
                        max_rank, workspace=ws, config=cfgs[c], fused=fused[c],
                        rank_block=rank_block, delta=delta,
                    )  # fmt: skip

        try:
            us = kb.timed(fn, LAYERS, eager=False).graph_us
        except Exception as e:  # noqa: BLE001 - a point that does not compile (ptxas: registers)
            if torch.cuda.is_current_stream_capturing():
                raise
            lines = str(e).splitlines() or [type(e).__name__]
            why = next((x for x in lines if "fatal" in x), lines[0])
            row = dict(tokens=t, adapters=n, used=used, **v, error=why.strip()[:300])
            print(json.dumps(row), flush=True)
            out.append(row)
            continue
        if "apart" in v:
            v = dict(v, apart_taken=bool(apart))
        row_bytes = nbytes
        if only is not None:  # the one call's bytes; a delta's y written, not read
            call = CALLS[only]
            row_bytes = kb.lora_bytes(rows, ranks, t, (call,)) - delta * t * sum(call[2]) * kb.EL
        row = dict(tokens=t, adapters=n, used=used, **v, segments_used=cap, us=us,
                   decode_tokens=decode, prefill=list(prefill),
                   tb_per_s=round(row_bytes / (us * 1e-6) / 1e12, 3))  # fmt: skip
        if v.get("profile"):
            row["kernels_us"] = kernel_times(fn)
        print(json.dumps(row), flush=True)
        out.append(row)
    return out


def rank_sorted(tokens, ranks: torch.Tensor):
    """``tokens`` with each tile table's tiles listed by their adapter's rank x tokens, largest
    first (rows -1 stay last)."""
    tables = tokens.tiles.cpu().clone()
    for table in tables:
        used = int((table[:, 0] >= 0).sum())
        rows = table[:used]
        work = ranks[rows[:, 0].long()] * (rows[:, 2] - rows[:, 1])
        table[:used] = rows[torch.argsort(work, descending=True, stable=True)]
    return tokens._replace(tiles=tables.to(tokens.tiles.device))


def kernel_times(fn, reps: int = 5) -> dict[str, float]:
    """Device µs per layer of each kernel fn launches (eager, under the torch profiler)."""
    from torch.profiler import ProfilerActivity, profile

    fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(reps):
            fn()
        torch.cuda.synchronize()
    out: dict[str, float] = {}
    for e in prof.key_averages():
        if e.device_type.name == "CUDA" and e.device_time_total > 0:
            out[e.key[:60]] = round(e.device_time_total / (reps * LAYERS), 2)
    return dict(sorted(out.items(), key=lambda kv: -kv[1]))


def dot_variants(points, max_rank: int, mlp: bool) -> list[dict]:
    """Fused variants at ``max_rank`` from dot-body points (None: fused_config's own launch)."""
    v = dict(max_rank=max_rank, segments=514, fused=True, mlp=mlp)
    return [dict(v, dot=point) if point else v for point in points]


def gemv_variant(point: tuple[int, int, int, int], mlp: bool = False) -> dict:
    """A variant from a (GEMV rows, tiles it takes, weight block, warps) point: calls of 8 rows
    carry max_rank 8."""
    rows, gmax, block, warps = point
    return dict(max_rank=rows, segments=514, gemv_max=gmax, gemv_r=rows, gemv_block=block,
                warps=warps, mlp=mlp)  # fmt: skip


# the modes (flags of their own): (flag, help)
FLAGS = (
    ("--splits", "two launches by split_k, expand_n"),
    ("--profile", "kernel times of the engine default"),
    ("--steps", "the serving trace's step compositions"),
    ("--gemv", "the fused kernel's GEMV body, both sets"),
    ("--small", "the decode steps of 10 requests/s, by GEMV body"),
    ("--one-token", "--small's steps with every tile one token"),
    ("--hoist", "one-token GEMV bodies, loads issued first and not"),
    ("--sharing", "decode steps of shared adapters, by path"),
    ("--pairs", "decode steps on one-token tiles against two-token tiles of an adapter"),
    ("--dot", "mixed steps by the dot body's blocks"),
    ("--stages", "mixed steps by the dot body's pipeline depth"),
    ("--floor", "prompts alone, decode tokens alone and together, by parts"),
    ("--parts", "the engine's mixed steps writing the delta, by parts"),
    ("--delta-dot", "mixed steps writing the delta, by dot-body points"),
    ("--delta-split", "--delta-dot's steps, each call alone, the engine's grid and their own"),
    ("--apart", "mixed steps, decode tokens' tiles by segment and apart"),
    ("--s2", "S2's steps by two-launch blocks"),
    ("--s2-steps", "S2's mixed steps, two launches against fused at 64 rows"),
    ("--s2-rule", "S2's mixed steps by their adapters, WIDE against WIDE_FUSED"),
    ("--s2-split", "S2's decode steps, shrink rank blocks over programs"),
    ("--s2-gemv", "S2's decode steps, one-token tiles on a 64-row GEMV body"),
    ("--s2-small", "S2's 10 req/s decode steps, WIDE against one fused launch"),
    ("--s2-few", "S2's decode steps on few adapters by the two launches' splits"),
    ("--s2-prefill", "S2's prefill-sized steps on few adapters by the two launches' tiles"),
)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    for flag, text in FLAGS:
        ap.add_argument(flag, action="store_true", help=text)
    ap.add_argument("--points", type=int, default=None,
                    help="--gemv, --s2: the first this many of GEMV_POINTS, S2_POINTS")  # fmt: skip
    ap.add_argument("--out", type=Path, default=REPO / "bench/results/lora_engine_calls.json")
    args = ap.parse_args()
    variants = []
    if args.gemv:
        for mlp in (False, True):
            variants += [dict(max_rank=16, segments=514, engine=True, mlp=mlp),
                         dict(max_rank=16, segments=514, fused=False, mlp=mlp)]  # fmt: skip
            variants += [gemv_variant(p, mlp) for p in GEMV_POINTS[: args.points]]
            # the first point without the narrow blocks for rank-8 tiles (as before them)
            variants.append(dict(gemv_variant(GEMV_POINTS[0], mlp), gemv_narrow=0))
    elif args.small:
        variants += [dict(max_rank=16, segments=514, fused=False)]
        variants += [gemv_variant(p) for p in SMALL_POINTS]
    elif args.one_token:
        variants += [dict(max_rank=16, segments=514, fused=False)]
        for rows, block, warps, o_fused in ONE_TOKEN_POINTS:
            v = gemv_variant((rows, 1, block, warps))
            variants.append(dict(v, one_token=True, **({} if o_fused else {"o_two": True})))
    elif args.hoist:
        variants += [dict(max_rank=16, segments=514, fused=False),
                     dict(max_rank=16, segments=514, engine=True)]  # fmt: skip
        for one_token in (True, False):
            for hoist in (False, True):
                v = gemv_variant((8, 1, 4096, 8))
                variants.append(dict(v, one_token=one_token, gemv_hoist=hoist))
    elif args.sharing:
        one = dict(gemv_variant((8, 1, 4096, 8)), one_token=True, gemv_hoist=True)
        variants += [dict(max_rank=16, segments=514, fused=False), one,
                     dict(one, gemv_pair=True, pairs=True)]  # fmt: skip
    elif args.pairs:
        one = dict(gemv_variant((8, 1, 4096, 8)), one_token=True, gemv_hoist=True, gemv_pair=False)
        variants += [dict(max_rank=16, segments=514, fused=False), one,
                     dict(one, gemv_pair=True), dict(one, gemv_pair=True, pairs=True)]  # fmt: skip
    elif args.dot:
        variants.append(dict(max_rank=16, segments=514, fused=False, mlp=True))
        variants += dot_variants(DOT_POINTS, max_rank=16, mlp=True)
    elif args.stages:
        variants.append(dict(max_rank=16, segments=514, fused=False))
        variants += [dict(max_rank=16, segments=514, fused=True, stages=n) for n in STAGES]
    elif args.floor or args.parts:  # --parts: as the engine's steps of 256 tokens or more
        variants.append(dict(max_rank=16, segments=514, fused=False))
        v = dict(max_rank=16, segments=514, fused=True)
        if args.parts:
            v.update(delta=True, apart="engine")
        variants += [dict(v, parts=parts) if parts else v for parts in FLOOR_PARTS]
    elif args.delta_dot:
        variants.append(dict(max_rank=16, segments=514, fused=False))
        engine = dict(delta=True, apart="engine")
        variants += [dict(v, **engine) for v in dot_variants(DELTA_DOT_POINTS, 16, False)]
        v = dict(max_rank=16, segments=514, fused=True, **engine)
        variants += [dict(v, stages=n) for n in DELTA_STAGES]
    elif args.delta_split:
        v = dict(max_rank=16, segments=514, fused=True, apart="engine")
        for only in range(len(CALLS)):
            delta = dict(v, delta=True, only=only)
            variants += [delta, dict(delta, segments="own")]
    elif args.apart:
        narrow = dict(max_rank=16, segments=514, fused=True, mlp=True)  # the engine's NARROW
        variants += [narrow, dict(narrow, apart=True), dict(narrow, no_gemv=True)]
    elif args.s2:
        for point in S2_POINTS[: args.points]:
            v = dict(max_rank=128, segments=514, fused=False)
            if point:
                r, split, en, bm = point
                v.update(split_k=split, expand_n=en, shrink_r=r, expand_r=r, block_m=bm)
            variants.append(v)
        variants += dot_variants(S2_FUSED_POINTS, max_rank=64, mlp=False)
    elif args.s2_split:
        wide = dict(max_rank=128, segments=514, fused=False, rank_block=32)
        variants += [dict(wide, profile=True), dict(wide, sorted=True)]
        for sr, rs, split, er, en in S2_SPLIT_POINTS:
            v = dict(wide, shrink_r=sr, rank_split=rs, split_k=split, expand_r=er, expand_n=en)
            variants.append(v)
            if (sr, rs, er) in ((16, 4, 32), (32, 2, 32)):
                variants += [dict(v, sorted=True), dict(v, profile=True)]
    elif args.s2_prefill:
        wide = dict(max_rank=128, segments=514, fused=False, rank_block=32)
        variants.append(dict(wide, profile=True))
        for bm, en in S2_PREFILL_POINTS:
            variants.append(dict(wide, shrink_r=32, rank_split=1, split_k=1, expand_r=32,
                                 expand_n=en, block_m=bm))  # fmt: skip
        variants += dot_variants((None,), max_rank=64, mlp=False)
    elif args.s2_few:
        wide = dict(max_rank=128, segments=514, fused=False, rank_block=32)
        variants.append(dict(wide, profile=True))
        for sr, rs, split, er, en, bm in S2_FEW_POINTS:
            variants.append(dict(wide, shrink_r=sr, rank_split=rs, split_k=split, expand_r=er,
                                 expand_n=en, block_m=bm))  # fmt: skip
        variants += dot_variants(S2_FUSED_POINTS, max_rank=64, mlp=False)
    elif args.s2_small:
        variants.append(dict(max_rank=128, segments=514, fused=False, rank_block=32, mlp=True))
        variants += dot_variants((None,), max_rank=64, mlp=True)
    elif args.s2_gemv:
        variants.append(dict(max_rank=128, segments=514, fused=False, rank_block=32, mlp=True))
        variants += dot_variants((None,), max_rank=64, mlp=True)
        for block, warps, narrow in S2_GEMV_POINTS:
            v = dict(max_rank=64, segments=514, gemv_max=1, gemv_r=64, gemv_block=block,
                     warps=warps, gemv_narrow=narrow, one_token=True, mlp=True)  # fmt: skip
            variants.append(v)
    elif args.s2_steps:
        variants.append(dict(max_rank=128, segments=514, fused=False, rank_block=32, mlp=True))
        variants += dot_variants(S2_STEP_POINTS, max_rank=64, mlp=True)
    elif args.s2_rule:
        variants.append(dict(max_rank=128, segments=514, fused=False, rank_block=32, mlp=True))
        variants += dot_variants((None,), max_rank=64, mlp=True)
    elif args.steps:
        for mlp in (False, True):
            for max_rank, fused in ((128, None), (16, None), (16, True), (16, False)):
                variants.append(dict(max_rank=max_rank, segments=514, fused=fused, mlp=mlp))
    elif args.splits:
        for split in (1, 2, 4, 8, 16):
            for en in (256, 128):
                variants.append(dict(max_rank=128, segments=514, split_k=split, expand_n=en))
        for fused in (False, True):  # an engine sized for rank-16 adapters
            variants.append(dict(max_rank=16, segments=514, fused=fused))
    else:
        for max_rank in (128, 64, 32, 16):
            for cap in (514, None):  # the engine's capacity at 512 sequences; the adapters used
                for fused in (False, True, None):
                    variants.append(dict(max_rank=max_rank, segments=cap, fused=fused))
    if args.profile:
        variants.insert(0, dict(max_rank=128, segments=514, fused=None, mlp=args.steps,
                                profile=True))  # fmt: skip
    gen = torch.Generator().manual_seed(0)
    s2_cases = next((cases for mode, cases in S2_MODE_CASES.items() if getattr(args, mode)), None)
    if args.gemv:
        decode = [v for v in variants if not v.get("mlp")]
        steps = [v for v in variants if v.get("mlp")]
        rows = [r for t, n in CASES for r in time_case(t, n, gen, decode)]
        rows += [r for t, n, p in STEP_CASES for r in time_case(t, n, gen, steps, p)]
    elif args.small:
        rows = [r for t, n in SMALL_CASES for _ in range(SMALL_DRAWS)
                for r in time_case(t, n, gen, variants)]  # fmt: skip
    elif args.one_token:
        rows = [r for t, n in ONE_TOKEN_CASES for _ in range(SMALL_DRAWS)
                for r in time_case(t, n, gen, variants)]  # fmt: skip
    elif args.hoist:
        rows = [r for t, n in ONE_TOKEN_CASES for _ in range(SMALL_DRAWS)
                for r in time_case(t, n, gen, variants)]  # fmt: skip
        rows += [r for t, n in HOIST_DECODE_CASES for r in time_case(t, n, gen, variants)]
        steps = [v for v in variants if not v.get("one_token")]  # prompts: no one-token tiles
        rows += [r for t, n, p in HOIST_STEP_CASES for r in time_case(t, n, gen, steps, p)]
    elif args.sharing:
        rows = [r for t, n in SHARING_CASES for r in time_case(t, n, gen, variants)]
    elif args.pairs:
        rows = [r for t, n in PAIR_CASES for r in time_case(t, n, gen, variants)]
    elif args.dot:
        rows = [r for t, n, p in DOT_CASES for r in time_case(t, n, gen, variants, p)]
    elif args.stages:
        rows = [r for t, n, p in STAGES_CASES for r in time_case(t, n, gen, variants, p)]
    elif args.floor:
        rows = [r for t, n, p in FLOOR_CASES for r in time_case(t, n, gen, variants, p)]
    elif args.parts:
        rows = [r for t, n, p in PARTS_CASES for r in time_case(t, n, gen, variants, p)]
    elif args.delta_dot or args.delta_split:
        rows = [r for t, n, p in DELTA_DOT_CASES for r in time_case(t, n, gen, variants, p)]
    elif args.apart:
        rows = [r for t, n, p in APART_CASES for r in time_case(t, n, gen, variants, p)]
    elif s2_cases is not None:  # S2's ranks; --s2-small's steps drawn SMALL_DRAWS times each
        draws = SMALL_DRAWS if args.s2_small else 1
        rows = [r for t, n, p in s2_cases for _ in range(draws)
                for r in time_case(t, n, gen, variants, p, S2_RANKS)]  # fmt: skip
    elif args.steps:
        rows = [r for t, n, p in STEP_CASES for r in time_case(t, n, gen, variants, p)]
    else:
        rows = [r for t, n in CASES for r in time_case(t, n, gen, variants)]
    write_result(args.out, "lora_engine_calls.py", {
        "benchmark": "one layer's LoRA calls (q/k/v, o) as the engine makes them, "
        + ("S1 (rank 8)" if s2_cases is None else "S2 (ranks 8-64)"),
        "gpu": torch.cuda.get_device_name(), "rows": rows,
    })  # fmt: skip


if __name__ == "__main__":
    main()
