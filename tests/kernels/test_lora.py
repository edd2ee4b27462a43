"""Triton multi-LoRA kernels against the float64 reference (kernels/lora_ref.py).

Grid: popularity x token order, rank x hidden size x batch, prefill segments; dtypes cycle over
the cases (one tolerance table per dtype, tests/kernels/sizes.py). Pools hold NaN wherever no
adapter owns a slot, so a stray read shows up as NaN in the output.
"""

from __future__ import annotations

import itertools

import pytest
import torch

import kernels
from kernels import lora, lora_paths, lora_ref
from kernels.lora_layout import DOWN, GATE, UP, K, O, Q, V
from tests.kernels.pools import POPULARITY, build_adapters, lora_tokens, token_rows
from tests.kernels.sizes import (
    ADAPTERS,
    BATCHES,
    DEVICE,
    DTYPES,
    LORA_SHAPES,
    ON_GPU,
    POP_BATCH,
    PREFILL_TOKENS,
    RANKS,
    SEG_CAPACITY,
    TOL,
    assert_close,
    errors,
)

# Under the interpreter, small blocks make every loop run several steps; on a GPU the
# launcher's own choice is what gets tested.
SMALL = None if ON_GPU else lora.LoraLaunch(block_m=16, shrink_k=16, shrink_r=16, expand_n=16)
PATHS = ("two_launch", "fused", "gemv")


def _config(path: str, shape, t: int, max_rank: int, parts: int = 2):
    """The launch config of a path: shrink + expand, or the fused one-launch kernel, forced
    either way; "gemv": the fused kernel with tiles of up to two tokens on its GEMV body (and
    the longer ones on its dot body). On a GPU the launcher's own blocks (launch_config,
    fused_config: one-token tiles on the GEMV body); here "fused" is the dot body alone."""
    slices = len(shape.modules)
    if path == "two_launch":
        if SMALL is not None:
            return SMALL
        return lora.launch_config(t, shape.d_in, shape.width, max_rank, slices)
    # GEMV rows: the least power of two that holds max_rank (8 and below allowed: no dot)
    gemv = dict(gemv_max=2, gemv_r=1 << (max_rank - 1).bit_length()) if path == "gemv" else {}
    if ON_GPU:
        cfg = lora.fused_config(
            t, shape.width, max_rank, slices, max(shape.widths), d_in=shape.d_in
        )
        if gemv:  # each GEMV weight block the benchmarks try, by the call's token count
            block = (256, 512, 1024)[t % 3]
            gemv.update(gemv_k=block, gemv_n=block)
        return cfg._replace(**gemv)
    rows = lora.fused_rank_rows(max_rank)
    block_m = 32 if t > 20 else 16  # 32-token tiles for the small shapes' prefill-like calls
    if gemv:  # GEMV column blocks wider than the dot's: parts own whole blocks of both
        gemv.update(gemv_k=32, gemv_n=32)
    return lora.LoraLaunch(
        block_m=block_m,
        shrink_k=16,
        shrink_r=rows,
        expand_n=16,
        fused=True,
        parts=parts,
        **gemv,
    )


def _ranks(
    n: int, modules: tuple[int, ...], choices: tuple[int, ...], gen: torch.Generator
) -> list[dict[int, int]]:
    """Per adapter, a rank for each module; about one module in five left untargeted."""
    out = []
    for i in range(n):
        r = {}
        for m in modules:
            if torch.rand((), generator=gen) < 0.2 and i % 3 == 2:
                continue
            r[m] = choices[int(torch.randint(len(choices), (), generator=gen))]
        r[modules[0]] = r.get(modules[0], choices[0])  # at least one targeted module
        out.append(r)
    return out


def _check_apply(
    shape, ranks, rows, dtype, gen, config=SMALL, workspace=None, path=None, masked=False,
    one_token=False, entries=None, delta=False, pair=False,
):  # fmt: skip
    """lora_apply against the reference; ``masked``: the tokens list the modules the rows'
    adapters have, as the engine's steps do (LoraTokens.modules); ``one_token``: the 16-token
    tile table lists every token as its own tile (a decode step's on one-token tiles), or with
    ``entries`` (their first tokens and the end) each entry's tokens apart (a mixed step's);
    ``delta``: the launch writes the delta into y, which starts as NaN, so every element it
    leaves unwritten shows (tokens without an adapter must get zeros); ``pair``: with
    one_token, the tokens that share an adapter two to a tile."""
    max_rank = max(max(r.values()) for r in ranks)
    if path is not None:
        config = _config(path, shape, rows.numel(), max_rank, parts=1 + rows.numel() % 3)
    dims = {m: (shape.d_in, w) for m, w in zip(shape.modules, shape.widths, strict=True)}
    setup = build_adapters(ranks, dims, shape.width, dtype, DEVICE, gen)
    tokens = lora_tokens(
        rows, DEVICE, SEG_CAPACITY, one_token=one_token, entries=entries, zeros=delta, pair=pair
    )
    if masked:
        used = {m for row in rows.tolist() if row >= 0 for m, r in ranks[row].items() if r}
        tokens = tokens._replace(modules=_module_mask(used))
    t = rows.numel()
    x = torch.randn(t, shape.d_in, generator=gen).to(dtype).to(DEVICE)
    y0 = torch.randn(t, sum(shape.widths), generator=gen).to(dtype).to(DEVICE)
    if delta:
        y0.fill_(float("nan"))
    y = y0.clone()
    lora.lora_apply(
        y,
        x,
        setup.pool[0],
        setup.index,
        tokens,
        shape.modules,
        shape.widths,
        max_rank,
        config=config,
        workspace=workspace,
        delta=delta,
    )
    ref = y0.double()
    lora_ref.lora_apply(
        ref, x.double(), setup.pool[0], setup.index, tokens, shape.modules, shape.widths, max_rank,
        delta=delta,
    )  # fmt: skip
    assert_close(y, ref, dtype)
    base = rows.to(DEVICE) < 0
    if delta:
        assert not y.isnan().any(), "a delta launch must write every token's rows"
        assert torch.equal(y[base], torch.zeros_like(y[base])), "tokens without an adapter: 0"
    else:
        assert torch.equal(y[base], y0[base]), "base-only rows must stay untouched"


@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize(
    ("popularity", "grouped"), list(itertools.product(POPULARITY, (True, False)))
)
def test_apply_popularity(popularity, grouped, path):
    """Each popularity, tokens in adapter runs (as the scheduler sorts them, and as the engine
    runs them: with the step's module mask) and scattered."""
    i = POPULARITY.index(popularity) * 2 + grouped
    gen = torch.Generator().manual_seed(100 + i)
    dtype = DTYPES[i % len(DTYPES)]
    shape = LORA_SHAPES[i % 2]
    n = POP_BATCH if popularity == "distinct" else ADAPTERS
    ranks = _ranks(n, shape.modules, RANKS, gen)
    rows = token_rows(popularity, POP_BATCH, n, gen, grouped)
    _check_apply(shape, ranks, rows, dtype, gen, path=path, masked=grouped)


@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("shape", LORA_SHAPES, ids=lambda s: s.name)
@pytest.mark.parametrize("rank", RANKS)
@pytest.mark.parametrize("batch", BATCHES)
def test_apply_rank_size_batch(shape, rank, batch, path):
    """Every rank on every hidden size at every batch; uniform popularity, adapter runs."""
    seed = LORA_SHAPES.index(shape) * 100 + RANKS.index(rank) * 10 + BATCHES.index(batch)
    gen = torch.Generator().manual_seed(seed)
    dtype = DTYPES[seed % len(DTYPES)]
    n = min(ADAPTERS, batch)
    ranks = [{m: rank for m in shape.modules} for _ in range(n)]
    rows = token_rows("uniform", batch, n, gen, grouped=True)
    _check_apply(shape, ranks, rows, dtype, gen, path=path)


@pytest.mark.parametrize("split_k", [2, 3])
def test_apply_split_k(split_k):
    """Shrink split over d_in, partial sums added by expand; decode and prefill-like rows."""
    gen = torch.Generator().manual_seed(60 + split_k)
    shape = LORA_SHAPES[2 if split_k == 2 else 1]
    cfg = SMALL or lora.launch_config(POP_BATCH, shape.d_in, shape.width, max(RANKS))
    ranks = _ranks(ADAPTERS, shape.modules, RANKS, gen)
    rows = token_rows("base_mix", POP_BATCH, ADAPTERS, gen, grouped=split_k == 2)
    _check_apply(
        shape, ranks, rows, DTYPES[split_k % len(DTYPES)], gen, config=cfg._replace(split_k=split_k)
    )


@pytest.mark.parametrize("rank_block", [32, 64])
def test_apply_wide_rank_blocks(rank_block):
    """Two launches whose programs hold 32 or 64 rank rows (lora_paths.step_is_wide), adapters
    of every rank from 1 to 64 beside the base model: ranks below, at and above the block."""
    gen = torch.Generator().manual_seed(80 + rank_block)
    shape = LORA_SHAPES[1]
    ranks = _ranks(ADAPTERS, shape.modules, (1, 7, 16, 33, 64), gen)
    rows = token_rows("base_mix", POP_BATCH, ADAPTERS, gen, grouped=True)
    cfg = lora.launch_config(POP_BATCH, shape.d_in, shape.width, 64, rank_block=rank_block)
    assert (cfg.shrink_r, cfg.expand_r, cfg.block_m) == (rank_block, rank_block, 16)
    if SMALL:
        cfg = SMALL._replace(shrink_r=rank_block, expand_r=rank_block)
    _check_apply(shape, ranks, rows, DTYPES[rank_block // 32 % len(DTYPES)], gen, config=cfg)


@pytest.mark.parametrize("rank_split,shrink_r", [(2, 32), (4, 16), (3, 16)])
def test_apply_shrink_rank_split(rank_split, shrink_r):
    """Shrinks whose rank blocks spread over ``rank_split`` programs a (tile, slice, k-split),
    with split_k 2 and expand programs of 32 rank rows: adapters of every rank from 1 to 64
    beside the base model, so some programs find no rank block of their tile."""
    gen = torch.Generator().manual_seed(90 + rank_split * shrink_r)
    shape = LORA_SHAPES[1]
    ranks = _ranks(ADAPTERS, shape.modules, (1, 7, 16, 33, 64), gen)
    rows = token_rows("base_mix", POP_BATCH, ADAPTERS, gen, grouped=True)
    cfg = SMALL or lora.launch_config(POP_BATCH, shape.d_in, shape.width, 64, rank_block=32)
    cfg = cfg._replace(shrink_r=shrink_r, expand_r=32, rank_split=rank_split, split_k=2)
    _check_apply(shape, ranks, rows, DTYPES[rank_split % len(DTYPES)], gen, config=cfg)


@pytest.mark.parametrize("tile_programs", [1, 3])
@pytest.mark.parametrize("popularity", ["distinct", "base_mix"])
def test_apply_programs_stride_over_tiles(tile_programs, popularity):
    """Two launches with fewer programs along the tiles than tiles: each program strides over
    several (one program takes them all at 1), and a tile reached by no program would stay 0."""
    gen = torch.Generator().manual_seed(70 + tile_programs)
    shape = LORA_SHAPES[1]
    ranks = _ranks(ADAPTERS, shape.modules, RANKS, gen)
    cfg = SMALL or lora.launch_config(POP_BATCH, shape.d_in, shape.width, max(RANKS))
    rows = token_rows(popularity, POP_BATCH, ADAPTERS, gen, grouped=True)
    cfg = cfg._replace(tile_programs=tile_programs, split_k=1 + tile_programs // 3)
    _check_apply(shape, ranks, rows, DTYPES[tile_programs % len(DTYPES)], gen, config=cfg)


@pytest.mark.parametrize("popularity", ["uniform", "zipf", "identical", "base_mix"])
def test_apply_one_token_tiles_of_shared_adapters(popularity):
    """A decode step's fused calls (kernels/lora_paths.one_token_step_fuses): every token its
    own tile on the GEMV body with 8 rank rows, tokens sharing adapters included (each tile
    reads its adapter again), every call fused."""
    i = POPULARITY.index(popularity)
    gen = torch.Generator().manual_seed(300 + i)
    shape = LORA_SHAPES[i % len(LORA_SHAPES)]
    ranks = _ranks(ADAPTERS, shape.modules, (8, 4, 1), gen)
    rows = token_rows(popularity, POP_BATCH, ADAPTERS, gen, grouped=True)
    t = rows.numel()
    tiles = lora_tokens(rows, DEVICE, SEG_CAPACITY, one_token=True).tiles[0].cpu()
    tiles = tiles[tiles[:, 0] >= 0]
    assert len(tiles) == int((rows >= 0).sum()) and (tiles[:, 2] - tiles[:, 1]).eq(1).all()
    if ON_GPU:
        cfg = lora.fused_config(t, shape.width, 8, len(shape.modules), max(shape.widths),
                                d_in=shape.d_in)  # fmt: skip
        assert (cfg.gemv_max, cfg.gemv_r) == (1, 8)
    else:
        cfg = lora.LoraLaunch(
            block_m=16, shrink_k=16, shrink_r=16, expand_n=16, fused=True, parts=1 + i % 2,
            gemv_max=1, gemv_k=32, gemv_n=32, gemv_r=8,
        )  # fmt: skip
    dtype = DTYPES[i % len(DTYPES)]
    _check_apply(shape, ranks, rows, dtype, gen, config=cfg, masked=True, one_token=True)


def _narrow_fused_config(shape, t: int):
    """A fused launch of 16 rank rows with its GEMV body for one-token tiles and that body's
    narrow blocks for rank-8 tiles: the engine's narrow steps' (fused_config) on a GPU, small
    blocks under the interpreter."""
    if ON_GPU:
        return lora.fused_config(t, shape.width, 16, len(shape.modules), max(shape.widths),
                                 d_in=shape.d_in)  # fmt: skip
    return lora.LoraLaunch(
        block_m=16, shrink_k=16, shrink_r=16, expand_n=16, fused=True, parts=2,
        gemv_max=1, gemv_k=16, gemv_n=16, gemv_narrow=8,
    )  # fmt: skip


@pytest.mark.parametrize("prompt_first", [False, True])
def test_mixed_step_with_its_decode_tokens_apart(prompt_first):
    """A narrow mixed step's fused calls with each entry's tokens apart (lora_paths.
    mixed_decodes_apart): decode tokens that share an adapter with each other and with a
    prompt's chunk each take a one-token tile on the GEMV body, the chunks 16-token tiles of
    their own on the dot body; base-only entries between them."""
    gen = torch.Generator().manual_seed(500 + prompt_first)
    shape = LORA_SHAPES[prompt_first % len(LORA_SHAPES)]
    ranks = _ranks(ADAPTERS, shape.modules, (8, 4, 1), gen)
    # (adapter row, tokens) per entry, grouped by adapter as the engine's steps are
    decode = [(0, 1), (0, 1), (0, 1), (1, 1), (2, 1), (2, 1), (-1, 1), (-1, 1)]
    prompts = [(0, 19), (2, 5), (-1, 7)]
    entries = sorted(prompts + decode if prompt_first else decode + prompts,
                     key=lambda e: e[0])  # fmt: skip
    rows = torch.tensor([r for r, n in entries for _ in range(n)], dtype=torch.int32)
    starts = [0]
    for _, n in entries:
        starts.append(starts[-1] + n)
    tiles = lora_tokens(rows, DEVICE, SEG_CAPACITY, True, starts).tiles[0].cpu()
    tiles = tiles[tiles[:, 0] >= 0]
    sizes = sorted((tiles[:, 2] - tiles[:, 1]).tolist())
    assert sizes == [1] * 6 + [3, 5, 16]  # the decode tokens apart; 19 = 16 + 3
    t = rows.numel()
    cfg = _narrow_fused_config(shape, t)
    assert cfg.gemv_max == 1
    _check_apply(shape, ranks, rows, DTYPES[prompt_first % len(DTYPES)], gen, config=cfg,
                 masked=True, one_token=True, entries=starts)  # fmt: skip


@pytest.mark.parametrize("grouped", [True, False])
def test_gemv_body_takes_small_rank_tiles_in_narrow_blocks(grouped):
    """A GEMV body of 16 rank rows takes the one-token tiles of adapters of rank <= 8 in blocks
    of 8 rows, twice as wide, and the others in its 16 rows: both against the reference, beside
    the dot body's longer tiles (grouped: adapters shared by runs of tokens)."""
    gen = torch.Generator().manual_seed(400 + grouped)
    shape = LORA_SHAPES[0]
    ranks = _ranks(ADAPTERS, shape.modules, (16, 8, 3, 12), gen)
    assert {r for a in ranks for r in a.values()} & {3, 8}
    rows = token_rows("uniform", POP_BATCH, ADAPTERS, gen, grouped)
    t = rows.numel()
    cfg = _narrow_fused_config(shape, t)
    assert (cfg.gemv_max, cfg.gemv_r or cfg.shrink_r, cfg.gemv_narrow) == (1, 16, 8)
    _check_apply(shape, ranks, rows, DTYPES[grouped % len(DTYPES)], gen, config=cfg,
                 one_token=not grouped)  # fmt: skip


def test_wide_gemv_body_takes_s2_ranks_on_one_token_tiles():
    """A GEMV body of as many rank rows as the engine's widest S2 adapter (64 on a GPU, 32 under
    the interpreter), with its narrow body of half those rows for tiles of adapters that fit
    them (what bench/lora_engine_calls.py --s2-gemv times): S2's mixed ranks on one-token
    tiles, shared adapters included, against the reference."""
    gen = torch.Generator().manual_seed(450)
    shape = LORA_SHAPES[0]
    wide = 64 if ON_GPU else 32
    ranks = _ranks(ADAPTERS, shape.modules, (wide, wide // 2, wide // 4, 3), gen)
    rows = token_rows("uniform", POP_BATCH, ADAPTERS, gen, grouped=True)
    t = rows.numel()
    if ON_GPU:
        cfg = lora.fused_config(t, shape.width, wide, len(shape.modules), max(shape.widths),
                                d_in=shape.d_in)._replace(
            gemv_max=1, gemv_k=256, gemv_n=256, gemv_r=wide, gemv_narrow=wide // 2,
            shrink_warps=8,
        )  # fmt: skip
    else:
        cfg = lora.LoraLaunch(
            block_m=16, shrink_k=16, shrink_r=wide, expand_n=16, fused=True, parts=2,
            gemv_max=1, gemv_k=16, gemv_n=16, gemv_r=wide, gemv_narrow=wide // 2,
        )  # fmt: skip
    _check_apply(shape, ranks, rows, DTYPES[1 % len(DTYPES)], gen, config=cfg, masked=True,
                 one_token=True)  # fmt: skip


@pytest.mark.parametrize("tiles", ["one", "pair", "segments"])
@pytest.mark.parametrize("delta", [False, True])
def test_one_token_tiles_issue_every_load_first(tiles, delta):
    """Where a slice's A and Bᵀ rows fit one GEMV block and one pool chunk (lora.gemv_hoists),
    a one-token tile's program issues all its loads before its first sum (_hoisted_gemv), and
    with gemv_pair so does a two-token tile's, its second token reusing the first's weights
    (tiles "pair": a decode step's tokens that share an adapter two to a tile); tiles of more
    tokens ("segments": adapters shared by runs of tokens) keep the GEMV and dot bodies. All
    against the reference, ranks up to 8 beside base-model rows; ``delta``: the bodies write
    the delta (a decode step's calls under lora_addend)."""
    one_token = tiles != "segments"
    gen = torch.Generator().manual_seed(500 + one_token)
    if ON_GPU:
        shape = LORA_SHAPES[0]  # q/k/v of 4096 from 4096, one 4096-element chunk
        cfg = lora.fused_config(16, shape.width, 8, 3, max(shape.widths), d_in=shape.d_in)
    else:  # one chunk of 48 holds d_in (32) and every slice (48, 16, 16)
        shape = type(LORA_SHAPES[0])("qkv_one_chunk", 48, (Q, K, V), 32, (48, 16, 16))
        cfg = lora.LoraLaunch(
            block_m=16, shrink_k=16, shrink_r=16, expand_n=16, fused=True, parts=2,
            gemv_max=1, gemv_k=64, gemv_n=64, gemv_r=8, gemv_hoist=True,
        )  # fmt: skip
    cfg = cfg._replace(gemv_pair=tiles == "pair")
    assert lora.gemv_hoists(cfg, shape.d_in, shape.width, shape.widths)
    ranks = _ranks(ADAPTERS, shape.modules, (8, 5, 1), gen)
    rows = token_rows("base_mix", POP_BATCH, ADAPTERS, gen, grouped=True)
    if tiles == "pair":  # pairs, and the odd token of an adapter a tile of one
        table = lora_tokens(rows, DEVICE, SEG_CAPACITY, one_token=True, pair=True).tiles[0]
        sizes = (table[:, 2] - table[:, 1])[table[:, 0] >= 0].cpu()
        assert sizes.max() == 2 and (sizes == 1).any() and int(sizes.sum()) == (rows >= 0).sum()
    _check_apply(shape, ranks, rows, DTYPES[one_token % len(DTYPES)], gen, config=cfg,
                 masked=True, one_token=one_token, delta=delta, pair=tiles == "pair")  # fmt: skip


def test_gemv_hoists_where_one_block_holds_a_slice():
    """The hoisted one-token body needs every slice's A rows (d_in) and Bᵀ rows within one GEMV
    block and one pool chunk; fused_config asks for it in decode calls of max_rank <= 8 only."""
    small = lora.fused_config(16, 4096, 8, 3, 4096, d_in=4096)
    assert small.gemv_hoist and lora.gemv_hoists(small, 4096, 4096, (4096, 4096, 4096))
    assert lora.gemv_hoists(small, 4096, 4096, (4096, 1024, 1024))  # GQA k, v: narrower
    assert not lora.gemv_hoists(small, 4096, 4096, (11008, 11008))  # gate/up: wider
    assert not lora.gemv_hoists(small, 11008, 4096, (4096,))  # down: d_in in three chunks
    assert not lora.gemv_hoists(small, 4096, 1024, (4096, 1024, 1024))  # four chunks a row
    assert not lora.gemv_hoists(small._replace(gemv_hoist=False), 4096, 4096, (4096,))
    assert not lora.gemv_hoists(small._replace(gemv_max=0), 4096, 4096, (4096,))
    assert not lora.fused_config(1024, 4096, 8, 3, 4096, d_in=4096).gemv_hoist  # prefill
    assert not lora.fused_config(16, 4096, 16, 3, 4096, d_in=4096).gemv_hoist  # 16 rows


def test_wide_prefill_sized_fused_calls_take_128_wide_blocks():
    """fused_config at 64 rank rows: prefill-sized calls (a WIDE_FUSED step's:
    lora_paths.prefill_step_fuses_wide) take 128-wide weight blocks and 4 warps in 16-token
    tiles; decode-sized ones keep the launch the decode rules measured (8 warps, 256 wide unless
    the narrow blocks fit a wave). On a GPU test_apply_prefill_segments runs that launch."""
    for slices, out_width in ((3, 4096), (1, 4096), (2, 11008)):
        cfg = lora.fused_config(2048, 4096, 64, slices, out_width, d_in=4096)
        assert (cfg.shrink_k, cfg.expand_n, cfg.shrink_warps) == (128, 128, 4)
        assert cfg.block_m == 16 and cfg.shrink_r == 64 and cfg.gemv_max == 0
    assert lora.fused_config(600, 1024, 64, 3, 4096, d_in=4096).shrink_k == 128
    assert lora.fused_config(2048, 4096, 32, 3, 4096, d_in=4096).shrink_k == 256  # 32 rows
    decode = lora.fused_config(512, 4096, 64, 3, 4096, d_in=4096)
    assert decode.shrink_warps in (8, lora._NARROW[64].warps) and decode.shrink_r == 64


def test_prompt_tiles_of_prefill_sized_fused_calls_keep_three_blocks_in_flight():
    """fused_config: the 16-token prompt tiles of a prefill-sized call at up to 16 rank rows (a
    narrow mixed step's) stream with 4 stages, which on sm_90 keep 4 programs an SM
    (bench/kernel_resources.py); decode-sized calls, 32-token tiles and wider rank rows keep
    3. Under the interpreter stages change nothing; on a GPU test_apply_prefill_segments and
    the engine's narrow mixed steps run the launch."""
    for slices, out_width in ((3, 4096), (1, 4096)):
        for max_rank in (8, 16):
            assert lora.fused_config(600, 4096, max_rank, slices, out_width, d_in=4096).stages == 4
            assert lora.fused_config(2048, 4096, max_rank, slices, out_width, d_in=4096).stages == 4
            assert lora.fused_config(512, 4096, max_rank, slices, out_width, d_in=4096).stages == 3
        assert lora.fused_config(4096, 4096, 16, slices, out_width, d_in=4096).stages == 3
        assert lora.fused_config(2048, 4096, 64, slices, out_width, d_in=4096).stages == 3


@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("dtype", DTYPES)
def test_apply_prefill_segments(dtype, path):
    """Prefill: long runs of one adapter next to base-only runs and one-token runs."""
    gen = torch.Generator().manual_seed(7)
    shape = LORA_SHAPES[0]
    ranks = _ranks(4, shape.modules, RANKS, gen)
    n = PREFILL_TOKENS
    cuts = sorted(torch.randperm(n - 1, generator=gen)[:5].add(1).tolist())
    bounds = [0, *cuts, n]
    runs = [0, -1, 1, 2, -1, 3]
    spans = zip(bounds[:-1], bounds[1:], runs, strict=True)
    rows = torch.cat([torch.full((b - a,), r) for a, b, r in spans])
    rows[n // 2] = 3  # a one-token run inside a long one
    _check_apply(shape, ranks, rows.to(torch.int32), dtype, gen, path=path)


@pytest.mark.parametrize("path", ("fused", "gemv"))
@pytest.mark.parametrize("popularity", ("base_mix", "zipf"))
@pytest.mark.parametrize("masked", (False, True))
def test_apply_delta_writes_every_token(path, popularity, masked):
    """delta=True (the engine's prefill-sized steps, whose base GEMM then adds onto it): y =
    the delta for every token, zeros for tokens without an adapter and for modules an adapter
    lacks, whatever y held; tiles on the dot and GEMV bodies, parts sharing columns."""
    i = ("fused", "gemv").index(path) * 4 + ("base_mix", "zipf").index(popularity) * 2 + masked
    gen = torch.Generator().manual_seed(300 + i)
    shape = LORA_SHAPES[i % 2]
    ranks = _ranks(ADAPTERS, shape.modules, RANKS, gen)
    rows = token_rows(popularity, POP_BATCH, ADAPTERS, gen, grouped=True)
    _check_apply(shape, ranks, rows, DTYPES[i % len(DTYPES)], gen, path=path, masked=masked,
                 delta=True)  # fmt: skip


@pytest.mark.parametrize("path", ("fused", "gemv"))
def test_apply_delta_of_a_mixed_step_apart_and_padded(path):
    """A mixed step's delta with its decode tokens apart (one-token tiles), a base-model
    entry among them and padding tokens after (a CUDA graph's): every token written."""
    gen = torch.Generator().manual_seed(17)
    shape = LORA_SHAPES[0]
    ranks = _ranks(4, shape.modules, RANKS, gen)
    prompt = PREFILL_TOKENS // 2
    rows = torch.tensor([0, 1, 1, -1, 2] + [3] * prompt + [-1] * 5, dtype=torch.int32)
    entries = [0, 1, 2, 3, 4, 5, 5 + prompt, rows.numel()]  # the padding: one entry
    _check_apply(shape, ranks, rows, DTYPES[0], gen, path=path, one_token=True,
                 entries=entries, delta=True)  # fmt: skip


def test_apply_delta_of_a_module_marked_unused_is_zero():
    """A module no adapter of the step has (LoraTokens.modules): its slice of the delta is
    zeros for every token, adapters or not."""
    gen = torch.Generator().manual_seed(19)
    shape = next(s for s in LORA_SHAPES if s.modules == (GATE, UP))
    ranks = [{GATE: RANKS[i % len(RANKS)], UP: 8} for i in range(ADAPTERS)]
    rows = token_rows("base_mix", POP_BATCH, ADAPTERS, gen, grouped=True)
    max_rank = max(RANKS)
    dims = {m: (shape.d_in, w) for m, w in zip(shape.modules, shape.widths, strict=True)}
    setup = build_adapters(ranks, dims, shape.width, DTYPES[0], DEVICE, gen)
    tokens = lora_tokens(rows, DEVICE, SEG_CAPACITY, zeros=True)._replace(
        modules=_module_mask({GATE})
    )
    x = torch.randn(rows.numel(), shape.d_in, generator=gen).to(DTYPES[0]).to(DEVICE)
    y = torch.full((rows.numel(), sum(shape.widths)), float("nan"), dtype=DTYPES[0], device=DEVICE)
    config = _config("fused", shape, rows.numel(), max_rank)
    lora.lora_apply(
        y, x, setup.pool[0], setup.index, tokens, shape.modules, shape.widths, max_rank,
        config=config, delta=True,
    )  # fmt: skip
    up = y[:, shape.widths[0] :]
    assert torch.equal(up, torch.zeros_like(up))
    assert not y.isnan().any() and y[rows.to(DEVICE) >= 0, : shape.widths[0]].abs().sum() > 0


def test_apply_delta_refuses_the_two_launches():
    """The two launches add into y; a delta call that would take them is refused by name, as
    are tables listing every token on the two launches and a delta call without them."""
    gen = torch.Generator().manual_seed(23)
    shape = LORA_SHAPES[0]
    ranks = _ranks(ADAPTERS, shape.modules, RANKS, gen)
    rows = token_rows("uniform", POP_BATCH, ADAPTERS, gen, grouped=True)
    dims = {m: (shape.d_in, w) for m, w in zip(shape.modules, shape.widths, strict=True)}
    setup = build_adapters(ranks, dims, shape.width, DTYPES[0], DEVICE, gen)
    x = torch.randn(rows.numel(), shape.d_in, generator=gen).to(DTYPES[0]).to(DEVICE)
    y = torch.zeros(rows.numel(), sum(shape.widths), dtype=DTYPES[0], device=DEVICE)
    tokens = lora_tokens(rows, DEVICE, SEG_CAPACITY, zeros=True)
    with pytest.raises(ValueError, match="delta=True writes the delta on the fused kernel"):
        lora.lora_apply(
            y, x, setup.pool[0], setup.index, tokens, shape.modules, shape.widths, max(RANKS),
            fused=False, delta=True,
        )  # fmt: skip
    # tables that list every token would stop the two launches' programs at their first zero
    # tile: refused, in place too, and by the shrink and expand called alone
    with pytest.raises(ValueError, match="the two launches cannot take tile tables"):
        lora.lora_apply(
            y, x, setup.pool[0], setup.index, tokens, shape.modules, shape.widths, max(RANKS),
            fused=False,
        )  # fmt: skip
    with pytest.raises(ValueError, match="lora_shrink cannot take tile tables"):
        lora.lora_shrink(x, setup.pool[0], setup.index, tokens, shape.modules, max(RANKS))
    h = torch.zeros(rows.numel(), len(shape.modules), max(RANKS), dtype=DTYPES[0], device=DEVICE)
    with pytest.raises(ValueError, match="lora_expand cannot take tile tables"):
        lora.lora_expand(y, h, setup.pool[0], setup.index, tokens, shape.modules, shape.widths)
    # and a delta launch needs them: without, the rows of base-model tokens would stay unwritten
    plain = lora_tokens(rows, DEVICE, SEG_CAPACITY)
    with pytest.raises(ValueError, match="the tile tables must list the tokens without"):
        lora.lora_apply(
            y, x, setup.pool[0], setup.index, plain, shape.modules, shape.widths, max(RANKS),
            fused=True, delta=True,
        )  # fmt: skip


def _module_mask(modules) -> torch.Tensor:
    mask = torch.zeros(7, dtype=torch.int32)
    mask[list(modules)] = 1
    return mask.to(DEVICE)


@pytest.mark.parametrize("path", PATHS)
def test_apply_reads_the_module_mask(path):
    """A step's module mask (LoraTokens.modules): with the modules its adapters have, the
    result is the reference's, the module no adapter has skipped; with a module marked unused
    the launch leaves its slice alone, adapters or not (the kernels trust the mask)."""
    gen = torch.Generator().manual_seed(13)
    shape = next(s for s in LORA_SHAPES if s.modules == (GATE, UP))
    ranks = [{GATE: RANKS[i % len(RANKS)]} for i in range(ADAPTERS)]  # no adapter has UP
    rows = token_rows("uniform", POP_BATCH, ADAPTERS, gen, grouped=True)
    _check_apply(shape, ranks, rows, DTYPES[0], gen, path=path, masked=True)
    max_rank = max(RANKS)
    dims = {m: (shape.d_in, w) for m, w in zip(shape.modules, shape.widths, strict=True)}
    setup = build_adapters(ranks, dims, shape.width, DTYPES[0], DEVICE, gen)
    tokens = lora_tokens(rows, DEVICE, SEG_CAPACITY)._replace(modules=_module_mask({UP}))
    x = torch.randn(rows.numel(), shape.d_in, generator=gen).to(DTYPES[0]).to(DEVICE)
    y0 = torch.randn(rows.numel(), sum(shape.widths), generator=gen).to(DTYPES[0]).to(DEVICE)
    y = y0.clone()
    config = _config(path, shape, rows.numel(), max_rank)
    lora.lora_apply(
        y, x, setup.pool[0], setup.index, tokens, shape.modules, shape.widths, max_rank,
        config=config,
    )  # fmt: skip
    assert torch.equal(y, y0), "a module marked unused must cost its slice nothing"


def test_apply_reuses_workspace():
    """One preallocated workspace across calls: nothing stale leaks from the first call."""
    gen = torch.Generator().manual_seed(11)
    shape = LORA_SHAPES[0]
    ranks = _ranks(ADAPTERS, shape.modules, RANKS, gen)
    max_rank = max(max(r.values()) for r in ranks)
    t = POP_BATCH
    need = lora.workspace_size(t, len(shape.modules), max_rank, SMALL)
    ws = torch.full((need,), float("nan"), device=DEVICE)  # poisoned: every read must be written
    for popularity in ("identical", "distinct", "base_mix"):
        rows = token_rows(popularity, t, ADAPTERS, gen, grouped=True)
        _check_apply(shape, ranks, rows, DTYPES[0], gen, workspace=ws)


def test_launch_config_chooses_paths():
    """lora_apply's default path from shapes alone (H 4096, I 11008): two launches for every
    decode-sized call (whatever the adapters' popularity), fused for prefill calls of several
    slices while a fused program holds at most 16 rank rows (it computes them all for every
    adapter); the fused config holds every rank row; two-launch programs hold 16 rank rows
    whatever max_rank."""
    qkv, o, gate_up, down = (4096, 3, 4096), (4096, 1, 4096), (4096, 2, 11008), (11008, 1, 4096)

    def fused(t, call, rank=16):
        d_in, slices, out = call
        return lora.launch_config(t, d_in, 4096, rank, slices, out).fused

    for t in (1, 32, 64, 256, 512):
        assert not any(fused(t, c, rank) for c in (qkv, o, gate_up, down) for rank in (16, 64))
    assert fused(4096, qkv) and fused(4096, gate_up) and not fused(4096, o)
    assert not fused(4096, down) and fused(513, qkv)
    assert not fused(4096, qkv, rank=256)  # too many rank rows to hold
    assert not any(fused(4096, qkv, rank) for rank in (32, 64, 128))  # rows wasted on small ones
    assert {
        lora.launch_config(t, 4096, 4096, r, 3).shrink_r for t in (1, 4096) for r in (8, 128)
    } == {16}
    # wider programs where the caller asks (lora_paths.step_is_wide), in 16-token tiles always
    wide = lora.launch_config(4096, 4096, 4096, 128, 3, rank_block=32)
    assert (wide.shrink_r, wide.expand_r, wide.block_m) == (32, 32, 16)
    assert lora.launch_config(4096, 4096, 4096, 128, 3).block_m == 32
    with pytest.raises(ValueError, match="rank_block"):
        lora.launch_config(64, 4096, 4096, 128, 3, rank_block=24)
    assert not lora.launch_config(512, 4096, 4096, 16, 3).fused  # shrink / expand alone
    cfg = lora.fused_config(1, 4096, 64, 3, 4096, d_in=4096)
    assert cfg.fused and cfg.shrink_r >= 64 and cfg.parts > 1 and cfg.block_m == 16
    assert lora.fused_config(4096, 4096, 16, 3, 4096, d_in=4096).block_m == 32
    # a step's prefill-sized calls (up to 2048 tokens) in 16-token tiles, larger ones in 32
    assert [lora.fused_config(t, 4096, 16, 3, 4096, d_in=4096).block_m
            for t in (513, 2048, 2049)] == [16, 16, 32]  # fmt: skip
    # one-token tiles on the GEMV body, its weight blocks inside one pool chunk, at the
    # engine's 16 fused rank rows; launches of more rows have no GEMV body
    g = lora.fused_config(64, 4096, 16, 3, 4096, d_in=4096)
    assert (g.gemv_max, g.gemv_k, g.gemv_n) == (1, 1024, 1024)
    assert lora.fused_config(64, 1536, 16, 3, 1536, d_in=1536).gemv_k == 512
    assert cfg.gemv_max == 0


@pytest.mark.parametrize("sms", [8, 132])
def test_decode_calls_split_d_in_and_the_workspace_bound_holds(monkeypatch, sms):
    """Decode-sized two-launch calls split d_in at least in two (their tokens share adapters:
    few tiles), larger ones only when too few programs would stream; workspace_size without a
    config bounds every choice."""
    monkeypatch.setattr(lora, "num_sms", lambda: sms)
    for t in (1, 16, 64, 300, 512, 513, 1024, 2048):
        for d_in, slices in ((4096, 3), (4096, 1), (11008, 1), (64, 3)):
            cfg = lora.launch_config(t, d_in, 4096, 128, slices)
            if 2048 <= d_in <= 4096 and t <= 512:
                assert cfg.split_k >= 2, (t, d_in)
            if t > 512 and sms == 132:
                assert cfg.split_k == 1, (t, d_in)
            assert cfg.rank_split == 1
            need = lora.workspace_size(t, slices, 128, cfg)
            assert need <= lora.workspace_size(t, slices, 128), (t, d_in, slices)
            # WIDE steps (32 rank rows): decode-sized ones share rank blocks over two shrink
            # programs, and stop splitting d_in from 256 tokens (_wide_split)
            wide = lora.launch_config(t, d_in, 4096, 128, slices, rank_block=32)
            assert wide.rank_split == (2 if t <= 512 else 1), t
            if t <= 512 and sms == 132:
                assert wide.split_k == (1 if t >= 256 else cfg.split_k), (t, d_in, slices)
            need = lora.workspace_size(t, slices, 128, wide)
            assert need <= lora.workspace_size(t, slices, 128), (t, d_in, slices)
    assert lora.launch_config(64, 64, 64, 16, 3).split_k == 1  # too little d_in to split


def test_fused_config_fills_one_wave(monkeypatch):
    """fused_config takes smaller blocks where a decode call's programs overflow one wave of
    the default launch but fit one wave of the smaller blocks' (on sm_90 with 132 SMs, as the
    H200), and gives down two parts while two give at most one program an SM."""
    monkeypatch.setattr(lora, "num_sms", lambda: 132)
    monkeypatch.setattr(lora, "_hopper", lambda: True)

    def cfg(t, rank, slices, out, d_in=4096):
        c = lora.fused_config(t, 4096, rank, slices, out, d_in=d_in)
        return c.shrink_k, c.expand_n, c.shrink_warps, c.parts

    assert cfg(128, 16, 3, 4096) == (256, 256, 4, 1)  # q, k, v: 384 programs, one wave
    assert cfg(160, 16, 3, 4096) == (256, 128, 4, 1)  # 480: 396 a wave, 528 with 256 x 128
    assert cfg(256, 16, 3, 4096)[:3] == (256, 256, 4)  # 768: two waves either way
    assert cfg(256, 16, 2, 11008) == (256, 128, 4, 1)  # gate_up: 512 (3 an SM: 396 a wave)
    assert cfg(512, 16, 3, 4096)[:3] == (256, 256, 4)  # 1536: several waves either way
    assert cfg(64, 64, 3, 4096) == (256, 256, 8, 1)  # 192 of 264
    assert cfg(128, 64, 3, 4096) == (128, 128, 4, 1)  # 384: 264 a wave, 528 with 128 x 128
    assert cfg(256, 64, 2, 11008)[:3] == (128, 128, 4)  # gate_up: 512
    assert cfg(272, 64, 2, 11008)[:3] == (256, 256, 8)  # 544: two waves either way
    assert cfg(256, 64, 3, 4096)[:3] == (256, 256, 8)  # 768
    assert cfg(128, 32, 3, 4096)[:3] == (256, 256, 4)  # rank rows never measured: default
    assert cfg(2048, 16, 3, 4096)[:3] == (256, 256, 4)  # prefill: default
    assert cfg(64, 64, 1, 4096, 11008)[3] == 2  # down: 128 programs on 132 SMs
    assert cfg(67, 64, 1, 4096, 11008)[3] == 1  # 134: more than one an SM
    assert cfg(256, 16, 1, 4096, 11008)[3] == 1
    monkeypatch.setattr(lora, "_hopper", lambda: False)  # the counts are sm_90's
    assert cfg(160, 16, 3, 4096)[:3] == (256, 256, 4)


def test_decode_path_rule():
    """The engine's per-step choice (kernels/lora_paths.py): fused only for decode steps whose
    adapter tokens are mostly on distinct adapters, hold enough rank rows in the engine's
    16-row fused launches, and whose adapters fit one pass of them."""
    rule = lora_paths.decode_prefers_fused
    assert lora_paths.FUSED_DECODE_ROWS == 16
    assert rule(256, 256, 16) and rule(512, 400, 8) and rule(64, 64, 16) and rule(64, 64, 4)
    assert not rule(32, 32, 16)  # too few rank rows to fill the GPU
    assert not rule(256, 64, 16) and not rule(512, 100, 8)  # tokens share adapters
    assert rule(292, 189, 8) and rule(128, 64, 8)  # half or more on distinct adapters
    assert not rule(256, 256, 32) and not rule(64, 64, 64)  # several passes: two launches
    assert not rule(0, 0, 0)


def test_decode_call_rule():
    """Each call's path in a step (kernels/lora_paths.py): in a fused step, calls of several
    slices fuse, and calls of one slice only from 4096 tokens x rank rows of the batch; in a
    step of one-token tiles every call fuses; other steps' choice passes through."""
    call = lora_paths.decode_call_fused
    assert call(True, 64, 3, 16) and call(True, 64, 2, 16)  # qkv, gate_up
    assert not call(True, 64, 1, 16) and not call(True, 255, 1, 16)  # o, down: too few rows
    assert not call(True, 32, 1, 16) and not call(True, 63, 1, 8)
    assert call(True, 256, 1, 16) and call(True, 64, 1, 64) and call(True, 64, 1, 40)
    assert call(False, 512, 3, 16) is False and call(None, 512, 1, 16) is None
    # one-token tiles (one_token_step_fuses): every call fuses, whatever its size
    assert call(True, 63, 1, 8, True) and call(True, 1, 1, 8, True)
    assert call(True, 128, 1, 8, True) and call(True, 512, 1, 8, True)
    assert not call(False, 16, 1, 8, True) and call(None, 16, 1, 8, True) is None


def test_one_token_step_rule():
    """Decode steps whose adapters all fit ONE_TOKEN_ROWS (8) rank rows fuse every call on
    one-token tiles: below the fused rule's size (1024 // 16 = 64 adapter tokens) whatever
    they share, from there while they share adapters at most ONE_TOKEN_MAX_SHARING to one, or
    at any sharing when every call takes two-token tiles (``pairs``)."""
    rule = lora_paths.one_token_step_fuses
    assert lora_paths.ONE_TOKEN_ROWS == 8 and lora_paths.ONE_TOKEN_MAX_SHARING == 8
    assert rule(1, 1, 8) and rule(15, 14, 4) and rule(63, 1, 8)  # small: any sharing
    assert rule(64, 64, 8) and rule(512, 390, 8) and rule(512, 98, 8)
    assert rule(64, 8, 8) and not rule(64, 7, 8)  # 8 tokens an adapter and no more
    assert not rule(512, 5, 8) and not rule(512, 63, 8) and rule(512, 64, 8)
    assert not rule(16, 16, 16) and not rule(512, 512, 9)  # wider than 8 rank rows
    assert not rule(0, 0, 0)
    assert rule(512, 5, 8, True) and rule(256, 1, 8, True) and rule(64, 7, 8, True)  # pairs
    assert not rule(512, 5, 16, True) and not rule(0, 0, 0, True)


def test_fused_config_gemv_rows_fit_the_call():
    """The GEMV body holds ONE_TOKEN_ROWS rank rows in 4096-wide weight blocks (decode, 8 warps;
    2048 for prefill) when the call's adapters fit them (max_rank <= 8), else the launch's rows
    (16 and up) in 1024-wide ones, where a 16-row body takes rank-8 tiles in the 8-row blocks
    (gemv_narrow); the dot body's rows stay a power of two >= 16."""
    small = lora.fused_config(16, 4096, 8, 3, 4096, d_in=4096)
    assert (small.gemv_r, small.gemv_k, small.gemv_n, small.shrink_r) == (8, 4096, 4096, 16)
    assert small.shrink_warps == 8  # decode: 8 warps stream the 8 x 4096 blocks
    prefill = lora.fused_config(1024, 4096, 8, 3, 4096, d_in=4096)
    assert (prefill.gemv_r, prefill.gemv_k, prefill.shrink_warps) == (8, 2048, 4)
    assert lora.fused_config(16, 4096, 16, 3, 4096, d_in=4096).gemv_narrow == 8  # rank-8 tiles
    assert lora.fused_config(16, 4096, 4, 1, 4096, d_in=4096).gemv_r == 8
    wide = lora.fused_config(16, 4096, 16, 3, 4096, d_in=4096)
    assert (wide.gemv_r, wide.gemv_k, wide.gemv_n, wide.shrink_r) == (16, 1024, 1024, 16)
    assert lora.fused_config(16, 1536, 8, 3, 1536, d_in=1536).gemv_k == 512  # fits the width


def test_fused_config_reads_the_one_token_rows_when_called(monkeypatch):
    """The GEMV body's narrow rows are lora_paths.ONE_TOKEN_ROWS as it is when a launch is
    chosen, not as it was when kernels/lora.py was imported."""
    monkeypatch.setattr(lora_paths, "ONE_TOKEN_ROWS", 4)
    rank8 = lora.fused_config(16, 4096, 8, 3, 4096, d_in=4096)
    assert (rank8.gemv_r, rank8.gemv_narrow, rank8.gemv_hoist) == (16, 4, False)
    rank4 = lora.fused_config(16, 4096, 4, 3, 4096, d_in=4096)
    assert (rank4.gemv_r, rank4.gemv_k, rank4.gemv_hoist) == (4, 4096, True)


@pytest.mark.parametrize("fused", [True, False, None])
def test_apply_fused_flag_picks_the_path(monkeypatch, fused):
    """lora_apply(fused=...) runs the path asked for (None: the shapes' choice, two launches
    for 3 tokens) and matches the reference either way."""
    setup, tokens, x, y = _small_call()
    ran = []
    for name in ("_fused", "_shrink"):
        real = getattr(lora, name)
        monkeypatch.setattr(lora, name, lambda *a, _n=name, _f=real: (ran.append(_n), _f(*a)))
    args = (setup.pool[0], setup.index, tokens, (Q, K, V), (32, 16, 16), 16)
    lora.lora_apply(y, x, *args, fused=fused)
    assert ran == (["_fused"] if fused else ["_shrink"])
    want = torch.zeros(3, 64, dtype=torch.float64)
    pool = setup.pool[0].cpu().double()
    lora_ref.lora_apply(want, x.cpu().double(), pool, *_cpu(args[1:3]), *args[3:])
    torch.testing.assert_close(y.cpu().double(), want, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("fused", [False, None])
def test_apply_rank_block_reaches_the_two_launches(monkeypatch, fused):
    """lora_apply(rank_block=32) runs two launches whose programs hold 32 rank rows (asked for,
    or the shapes' choice), and matches the reference."""
    setup, tokens, x, y = _small_call()
    seen = []
    real = lora._shrink
    monkeypatch.setattr(lora, "_shrink", lambda *a: (seen.append(a[7]), real(*a)))
    args = (setup.pool[0], setup.index, tokens, (Q, K, V), (32, 16, 16), 16)
    lora.lora_apply(y, x, *args, fused=fused, rank_block=32)
    assert [(c.shrink_r, c.expand_r, c.block_m) for c in seen] == [(32, 32, 16)]
    want = torch.zeros(3, 64, dtype=torch.float64)
    pool = setup.pool[0].cpu().double()
    lora_ref.lora_apply(want, x.cpu().double(), pool, *_cpu(args[1:3]), *args[3:])
    torch.testing.assert_close(y.cpu().double(), want, rtol=1e-5, atol=1e-5)


def _cpu(items):
    """The index and tokens' tensors on the CPU (their other fields as they are)."""
    return [type(i)(*(t.cpu() if isinstance(t, torch.Tensor) else t for t in i)) for i in items]


def test_fused_config_must_hold_every_rank_row():
    setup, tokens, x, y = _small_call()
    cfg = lora.LoraLaunch(16, 16, 16, 16, fused=True)  # 16 rank rows, max_rank 32
    with pytest.raises(ValueError, match="rank rows"):
        lora.lora_apply(
            y, x, setup.pool[0], setup.index, tokens, (Q, K, V), (32, 16, 16), 32, config=cfg
        )


def test_gemv_rows_must_hold_every_rank_row():
    setup, tokens, x, y = _small_call()
    cfg = lora.LoraLaunch(16, 16, 16, 16, fused=True, gemv_max=1, gemv_r=8)  # max_rank 16
    with pytest.raises(ValueError, match="GEMV body holds 8 rank rows"):
        lora.lora_apply(
            y, x, setup.pool[0], setup.index, tokens, (Q, K, V), (32, 16, 16), 16, config=cfg
        )
    for bad, name in ((dict(gemv_max=3), "gemv_max"), (dict(gemv_n=48), "gemv_n"),
                      (dict(gemv_r=24), "gemv_r")):  # fmt: skip
        with pytest.raises(ValueError, match=f"{name} must be a power of two"):
            lora.lora_apply(
                y, x, setup.pool[0], setup.index, tokens, (Q, K, V), (32, 16, 16), 16,
                config=cfg._replace(**{"gemv_r": 16, **bad}),
            )  # fmt: skip


def test_fused_call_refuses_more_tiles_than_a_grid_holds(monkeypatch):
    """The fused grid's tiles lie along y, which CUDA caps: a call with more says so, and the
    shapes never choose the fused kernel for one."""
    setup, tokens, x, y = _small_call()
    monkeypatch.setattr(lora, "_MAX_GRID_Y", 2)  # the bound of 3 tokens in 6 segments: 4
    cfg = lora.LoraLaunch(16, 16, 16, 16, fused=True)
    with pytest.raises(ValueError, match="at most 2 tiles"):
        lora.lora_apply(
            y, x, setup.pool[0], setup.index, tokens, (Q, K, V), (32, 16, 16), 16, config=cfg
        )
    # where the shapes would pick the fused kernel, such a call takes the two launches instead
    monkeypatch.setattr(lora, "shapes_prefer_fused", lambda *a: True)
    ran = []
    for name in ("_fused", "_shrink"):
        real = getattr(lora, name)
        monkeypatch.setattr(lora, name, lambda *a, _n=name, _f=real: (ran.append(_n), _f(*a)))
    lora.lora_apply(y, x, setup.pool[0], setup.index, tokens, (Q, K, V), (32, 16, 16), 16)
    assert ran == ["_shrink"]


def test_shrink_and_expand_match_reference():
    """The two halves on their own, as the public lora_shrink / lora_expand."""
    gen = torch.Generator().manual_seed(5)
    dtype = DTYPES[-1]
    shape = LORA_SHAPES[0]
    dims = {m: (shape.d_in, w) for m, w in zip(shape.modules, shape.widths, strict=True)}
    ranks = _ranks(ADAPTERS, shape.modules, RANKS, gen)
    max_rank = max(max(r.values()) for r in ranks)
    setup = build_adapters(ranks, dims, shape.width, dtype, DEVICE, gen)
    rows = token_rows("base_mix", POP_BATCH, ADAPTERS, gen, grouped=False)
    tokens = lora_tokens(rows, DEVICE, SEG_CAPACITY)
    x = torch.randn(POP_BATCH, shape.d_in, generator=gen).to(dtype).to(DEVICE)
    h = lora.lora_shrink(
        x, setup.pool[0], setup.index, tokens, shape.modules, max_rank, config=SMALL
    )
    h_ref = lora_ref.lora_shrink(
        x.double(), setup.pool[0], setup.index, tokens, shape.modules, max_rank
    )
    assert h.shape == h_ref.shape
    assert_close(h, h_ref, dtype)
    assert torch.equal(h[rows.to(DEVICE) < 0], torch.zeros_like(h[rows.to(DEVICE) < 0]))
    y0 = torch.randn(POP_BATCH, sum(shape.widths), generator=gen).to(dtype).to(DEVICE)
    y = y0.clone()
    lora.lora_expand(
        y,
        h_ref.to(dtype),
        setup.pool[0],
        setup.index,
        tokens,
        shape.modules,
        shape.widths,
        config=SMALL,
    )
    ref = y0.double()
    lora_ref.lora_expand(
        ref,
        h_ref.to(dtype).double(),
        setup.pool[0],
        setup.index,
        tokens,
        shape.modules,
        shape.widths,
    )
    assert_close(y, ref, dtype)


def test_dispatch_routes_by_device(monkeypatch):
    """kernels.lora_apply: Triton for CUDA tensors, the reference for CPU ones; same numbers."""
    if not ON_GPU:  # CPU tensors must never reach the Triton launcher

        def no_triton():
            raise AssertionError("CPU tensors were routed to the Triton launcher")

        monkeypatch.setattr(kernels, "_triton_lora", no_triton)
    gen = torch.Generator().manual_seed(3)
    shape = LORA_SHAPES[0]
    ranks = _ranks(3, shape.modules, RANKS, gen)
    rows = token_rows("uniform", 6, 3, gen, grouped=True)
    dims = {m: (shape.d_in, w) for m, w in zip(shape.modules, shape.widths, strict=True)}
    setup = build_adapters(ranks, dims, shape.width, torch.float32, DEVICE, gen)
    tokens = lora_tokens(rows, DEVICE, SEG_CAPACITY)
    x = torch.randn(6, shape.d_in, generator=gen).to(DEVICE)
    y = torch.zeros(6, sum(shape.widths), device=DEVICE)
    max_rank = max(max(r.values()) for r in ranks)
    kernels.lora_apply(
        y, x, setup.pool[0], setup.index, tokens, shape.modules, shape.widths, max_rank
    )
    ref = torch.zeros(6, sum(shape.widths), dtype=torch.float64, device=DEVICE)
    lora_ref.lora_apply(
        ref, x.double(), setup.pool[0], setup.index, tokens, shape.modules, shape.widths, max_rank
    )
    assert errors(y, ref).norm <= TOL[torch.float32].norm


def _small_call():
    gen = torch.Generator().manual_seed(1)
    dims = {
        Q: (32, 32),
        K: (32, 16),
        V: (32, 16),
        O: (32, 32),
        GATE: (32, 48),
        UP: (32, 48),
        DOWN: (48, 32),
    }
    setup = build_adapters([{Q: 4, K: 4, V: 4}], dims, 16, torch.float32, DEVICE, gen)
    tokens = lora_tokens(torch.zeros(3, dtype=torch.int32), DEVICE)
    x = torch.randn(3, 32, device=DEVICE)
    y = torch.zeros(3, 64, device=DEVICE)
    return setup, tokens, x, y


@pytest.mark.parametrize(
    ("change", "message"),
    [
        (lambda a: a.update(modules=(Q, K, V, O)), "modules must list"),
        (lambda a: a.update(out_widths=(32, 16, 17)), "columns"),
        (lambda a: a.update(x=a["x"].to(torch.int32)), "x must be float16"),
        (lambda a: a.update(x=a["x"][:2]), "tokens"),
        (lambda a: a.update(max_rank=0), "max_rank must be positive"),
        (lambda a: a.update(pool_layer=a["pool_layer"][0]), "pool_layer must be"),
        (
            lambda a: a.update(workspace=torch.zeros(3, dtype=torch.int32, device=DEVICE)),
            "workspace must be",
        ),
        (
            lambda a: a.update(index=a["index"]._replace(ranks=a["index"].ranks.long())),
            "ranks must be int32",
        ),
        (
            lambda a: a.update(tokens=a["tokens"]._replace(seg_starts=a["tokens"].seg_starts[:-1])),
            "seg_starts needs",
        ),
    ],
)
def test_apply_rejects_bad_input(change, message):
    setup, tokens, x, y = _small_call()
    args = dict(
        y=y,
        x=x,
        pool_layer=setup.pool[0],
        index=setup.index,
        tokens=tokens,
        modules=(Q, K, V),
        out_widths=(32, 16, 16),
        max_rank=4,
    )
    change(args)
    with pytest.raises(ValueError, match=message):
        lora.lora_apply(**args)
