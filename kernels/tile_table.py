"""The kernels' tile lists, built on the host where a step's segments are known: the LoRA
kernels' and the prefill attention kernel's.

A LoRA launch cuts each adapter segment into tiles of at most BLOCK_M tokens, one adapter per
tile. The host already knows the segments when it writes a step's metadata, so it writes the
tiles too: a program reads a tile's row of the table, (LoRA index row, first token, end token),
in one load; rows past the step's last tile hold row -1. The tile count's upper bound for the call's
capacity (max_tiles) sizes the launch, so a CUDA graph captured once serves every step: the
fused kernel launches a program per tile of the bound (those past the last tile return at once);
the shrink and expand launch fewer, which stride over the tiles and stop at the first row -1
(kernels/lora.py). Before, each program found its tile by scanning the segment list on the
device: with the engine's segment capacity (resident adapters + 2, hundreds), that scan in
every program of a grid sized for the worst case added half to the LoRA time of a decode step
with a hundred adapters (H200, one layer's q/k/v and o calls, 292 tokens on 96 rank-8
adapters: 135 µs with a capacity of 514 segments, 89 with the capacity cut to 98;
bench/results/lora_engine_calls_before_tiles.json).

The prefill attention kernel of a mixed step takes the same kind of table (query_tiles: the
query rows of each sequence of two rows or more), for the same reason: a mixed step's CUDA
graph holds max_num_seqs sequences, and a grid of the bound with a device-side scan of their
query starts in every program (544 tiles x 32 heads for 2048 tokens and 512 sequences, about
30 x 32 of them with work) spent most of its programs finding no tile.

Plain Python, no Triton: the engine builds tables on the CPU path too.
"""

from __future__ import annotations

from collections.abc import Sequence

TILE_BLOCKS = (16, 32, 64)  # the BLOCK_M values a launch may use; one table each
FIELDS = 3  # row, first token, end token
EMPTY = (-1, 0, 0)
# The row of a tile of tokens without an adapter (base-model tokens, a graph's padding), listed
# only where a fused launch writes the LoRA delta rather than adding it (block_tiles' zeros):
# its programs write zeros there, so that the delta covers every token.
ZERO_ROW = -2
# The tiles of a decode step whose tokens share adapters two to a tile (StepBatch.fill's
# pair_tiles): the fused kernel's GEMV body takes such a tile with its loads hoisted, the second
# token reusing the weights loaded for the first (LoraLaunch.gemv_pair).
PAIR_BLOCK = 2
# Query rows per tile of the prefill attention kernel (kernels/attention.py), whose table the
# engine writes beside the LoRA ones: (sequence, first row, end row) for the sequences of two
# query rows or more.
ATTENTION_BLOCK = 64


def max_tiles(num_tokens: int, block: int, num_segments: int) -> int:
    """Upper bound of the tile count: every non-empty segment adds at most one partial tile,
    and at most ``num_tokens`` segments are non-empty."""
    return -(-num_tokens // block) + min(num_segments, num_tokens)


def table_rows(num_tokens: int, num_segments: int) -> int:
    """Rows each block size's table has: the bound of the smallest block (the most tiles)."""
    return max(1, max_tiles(num_tokens, TILE_BLOCKS[0], num_segments))


def block_tiles(
    starts: Sequence[int], rows: Sequence[int], block: int, zeros: bool = False
) -> list[int]:
    """The tiles of segments ``rows`` (segment g covers tokens starts[g]:starts[g+1]) with an
    adapter (row >= 0), flattened (row, start, end, ...): the tiles of two tokens or more
    first, then those of one, each kind in token order. With ``zeros`` the segments without an
    adapter are tiles too, of row ZERO_ROW, listed first (a launch that writes the delta
    instead of adding it: kernels/lora.py lora_apply's delta); they count toward max_tiles'
    bound like the others.

    Why that order: programs start roughly in table order, and in the fused LoRA kernel a tile of
    several tokens (a prompt's, its dot body) takes several times as long as one of one token (a
    decode token's, its GEMV body). Listed last, as the prompts of a mixed step often are, the
    long programs started last and ran on alone after the short ones had ended; listed first,
    the short ones fill the GPU around them. H200, one layer's S1 LoRA calls in a graph (q/k/v
    and o fused, the MLP calls masked), the n = 1000 trace's mixed steps, 400 decode tokens
    beside four 400-token prompts 170.3 -> 140.7 µs, beside three 200-token prompts 145.1 ->
    120.7, 300 beside three 512-token prompts 150.9 -> 118.3; 512 decode tokens on 405 adapters
    (their two-token tiles) 116.3 -> 104.0 (bench/results/lora_engine_calls_gemv.json, then
    lora_engine_calls_order.json with this order and the fused grid's slices first: two runs,
    whose two-launch rows, which neither change touches, agree within 1%)."""
    out: list[int] = []
    ones: list[int] = []
    zero: list[int] = []
    for g, row in enumerate(rows):
        end = starts[g + 1]
        if row < 0:
            if zeros:
                for s in range(starts[g], end, block):
                    zero.extend((ZERO_ROW, s, min(s + block, end)))
            continue
        if end - starts[g] == 1:
            ones += (row, starts[g], end)
            continue
        for s in range(starts[g], end, block):
            e = min(s + block, end)
            (out if e - s > 1 else ones).extend((row, s, e))
    return zero + out + ones


def query_tiles(starts: Sequence[int], block: int = ATTENTION_BLOCK) -> list[int]:
    """The prefill attention kernel's tiles: the query rows of each sequence with two rows or
    more (sequence b owns rows starts[b]:starts[b+1]; the decode kernel serves the one-row
    ones), cut into tiles of at most ``block`` rows, flattened (sequence, first row, end row)."""
    runs = [b if starts[b + 1] - starts[b] >= 2 else -1 for b in range(len(starts) - 1)]
    return block_tiles(starts, runs, block)
