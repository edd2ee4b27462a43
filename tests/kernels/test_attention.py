"""Triton paged attention and K/V write against the float64 reference (attention_ref.py).

Pages are shuffled through the pool and every page no sequence owns holds NaN, so a read past a
sequence's context or through a wrong block-table entry shows up as NaN.
"""

from __future__ import annotations

import pytest
import torch

import kernels
from kernels import attention, attention_ref
from tests.kernels.pools import build_kv
from tests.kernels.sizes import (
    ATTN_SHAPES,
    DECODE_BATCH,
    DECODE_LENS,
    DEVICE,
    DTYPES,
    ON_GPU,
    PREFILL_LENS,
    assert_close,
)

SMALL_DECODE = {} if ON_GPU else {"block_n": 16}
SMALL_PREFILL = None if ON_GPU else attention.PrefillLaunch(block_q=16, block_n=16)


def _attend(shape, lens, queries, dtype, gen, decode=None):
    kv = build_kv(
        lens, queries, shape.page_size, shape.kv_heads * shape.head_dim, dtype, DEVICE, gen
    )
    t = sum(queries)
    q = torch.randn(t, shape.heads, shape.head_dim, generator=gen).to(dtype).to(DEVICE)
    scale = shape.head_dim**-0.5
    out = attention.paged_attention(
        q,
        kv.pool_layer,
        kv.block_tables,
        kv.seq_lens,
        kv.query_starts,
        shape.page_size,
        scale,
        decode=decode,
        prefill=SMALL_PREFILL,
    )
    ref = _reference(q, kv, shape.page_size, scale)
    assert_close(out, ref, dtype)


@pytest.mark.parametrize("shape", ATTN_SHAPES, ids=lambda s: s.name)
@pytest.mark.parametrize("splits", [0, 1, 4])
def test_decode(shape, splits):
    """One query per sequence, contexts from one token to several pages; splits 0 = auto."""
    i = ATTN_SHAPES.index(shape) * 3 + [0, 1, 4].index(splits)
    gen = torch.Generator().manual_seed(i)
    lens = [DECODE_LENS[(b + i) % len(DECODE_LENS)] for b in range(DECODE_BATCH)]
    cfg = attention.DecodeLaunch(splits=splits, **SMALL_DECODE)
    _attend(shape, lens, [1] * len(lens), DTYPES[i % len(DTYPES)], gen, decode=cfg)


@pytest.mark.parametrize("splits", [1, 4])
@pytest.mark.parametrize("programs", [1, 5])
def test_decode_on_fewer_programs(splits, programs):
    """DecodeLaunch.programs: a few programs stride over every (row, kv head, split), decode
    steps and mixed ones alike, with the same results as a program per item (GQA shape)."""
    gen = torch.Generator().manual_seed(70 + splits + programs)
    shape = ATTN_SHAPES[1]
    cfg = attention.DecodeLaunch(splits=splits, programs=programs, **SMALL_DECODE)
    lens = [DECODE_LENS[b % len(DECODE_LENS)] for b in range(DECODE_BATCH)]
    _attend(shape, lens, [1] * len(lens), DTYPES[0], gen, decode=cfg)
    _attend(shape, [9, 1, 23, 6, 14], [1, 1, 5, 1, 14], DTYPES[0], gen, decode=cfg)


def test_decode_kernel_serves_any_mix():
    """As many query rows as sequences, but one sequence has two and another none: the decode
    kernel (chosen from shapes alone) still attends each row over its own causal prefix."""
    gen = torch.Generator().manual_seed(21)
    lens = sorted(DECODE_LENS, reverse=True)  # the two-query sequence needs >= 2 tokens
    queries = [2, 0] + [1] * (len(lens) - 2)
    _attend(
        ATTN_SHAPES[1],
        lens,
        queries,
        DTYPES[0],
        gen,
        decode=attention.DecodeLaunch(splits=2, **SMALL_DECODE),
    )


@pytest.mark.parametrize("shape", ATTN_SHAPES, ids=lambda s: s.name)
@pytest.mark.parametrize("dtype", DTYPES)
def test_prefill_varlen(shape, dtype):
    """Packed prompts of different lengths, chunked prefill (context longer than the queries),
    a sequence with no queries, and a decode row in the same batch."""
    gen = torch.Generator().manual_seed(ATTN_SHAPES.index(shape) * 7 + DTYPES.index(dtype))
    lens = [c for c, _ in PREFILL_LENS] + [9]
    queries = [n for _, n in PREFILL_LENS] + [0]
    _attend(shape, lens, queries, dtype, gen)


@pytest.mark.parametrize("dtype", DTYPES)
def test_write_kv_then_prefill(dtype):
    """Prefill as the engine runs it: write the step's K/V into pages (padding rows have slot
    -1, K is a strided view of a fused projection), then attend over them."""
    gen = torch.Generator().manual_seed(31 + DTYPES.index(dtype))
    shape = ATTN_SHAPES[1]
    w = shape.kv_heads * shape.head_dim
    lens = [c for c, _ in PREFILL_LENS]
    queries = [n for _, n in PREFILL_LENS]
    kv = build_kv(lens, queries, shape.page_size, w, dtype, DEVICE, gen)
    t = sum(queries)
    pad = 3
    fused = torch.randn(t + pad, 3 * w, generator=gen).to(dtype).to(DEVICE)  # [T, q | k | v]
    k = fused[:, w : 2 * w].view(t + pad, shape.kv_heads, shape.head_dim)
    v = fused[:, 2 * w :].view(t + pad, shape.kv_heads, shape.head_dim)
    slots = torch.cat([kv.slot_mapping, torch.full((pad,), -1, device=DEVICE)])
    pool = kv.pool_layer.clone()
    ref_pool = kv.pool_layer.clone()
    attention.write_kv(pool, k, v, slots)
    attention_ref.write_kv(ref_pool, k, v, slots)
    assert torch.equal(pool.nan_to_num(7.0), ref_pool.nan_to_num(7.0))
    q = torch.randn(t, shape.heads, shape.head_dim, generator=gen).to(dtype).to(DEVICE)
    scale = shape.head_dim**-0.5
    out = attention.paged_attention(
        q,
        pool,
        kv.block_tables,
        kv.seq_lens,
        kv.query_starts,
        shape.page_size,
        scale,
        prefill=SMALL_PREFILL,
    )
    ref = _reference(q, kv, shape.page_size, scale, pool_layer=ref_pool)
    assert_close(out, ref, dtype)


def test_dispatch_and_out_buffer():
    """kernels.paged_attention fills a given out buffer on either path, and returns it."""
    gen = torch.Generator().manual_seed(41)
    shape = ATTN_SHAPES[0]
    kv = build_kv(
        [5, 9], [1, 1], shape.page_size, shape.kv_heads * shape.head_dim, torch.float32, DEVICE, gen
    )
    q = torch.randn(2, shape.heads, shape.head_dim, generator=gen).to(DEVICE)
    out = torch.full_like(q, float("nan"))
    got = kernels.paged_attention(
        q,
        kv.pool_layer,
        kv.block_tables,
        kv.seq_lens,
        kv.query_starts,
        shape.page_size,
        0.25,
        out=out,
    )
    assert got is out
    ref = _reference(q, kv, shape.page_size, 0.25)
    assert torch.allclose(out.double(), ref, atol=1e-3 if ON_GPU else 1e-5)


def _args():
    gen = torch.Generator().manual_seed(2)
    kv = build_kv([5, 9], [1, 1], 4, 32, torch.float32, DEVICE, gen)
    q = torch.randn(2, 4, 16, device=DEVICE)
    return dict(
        q=q,
        pool_layer=kv.pool_layer,
        block_tables=kv.block_tables,
        seq_lens=kv.seq_lens,
        query_starts=kv.query_starts,
        page_size=4,
        scale=0.25,
    )


@pytest.mark.parametrize(
    ("change", "message"),
    [
        (lambda a: a.update(q=a["q"][:, :3]), "not kv_heads x head_dim"),
        (lambda a: a.update(q=a["q"][0]), "q must be"),
        (lambda a: a.update(seq_lens=a["seq_lens"].long()), "seq_lens must be int32"),
        (lambda a: a.update(query_starts=a["query_starts"][:2]), "query_starts must have"),
        (lambda a: a.update(block_tables=a["block_tables"][:1]), "block_tables must be"),
        (lambda a: a.update(page_size=0), "page_size must be positive"),
        (lambda a: a.update(pool_layer=a["pool_layer"][0]), "pool_layer must be"),
        (lambda a: a.update(out=torch.empty(3, device=DEVICE)), "out must be"),
    ],
)
def test_attention_rejects_bad_input(change, message):
    args = _args()
    change(args)
    with pytest.raises(ValueError, match=message):
        attention.paged_attention(**args)


def test_write_kv_rejects_bad_input():
    pool = torch.zeros(2, 8, 32, device=DEVICE)
    k = torch.zeros(3, 2, 16, device=DEVICE)
    with pytest.raises(ValueError, match="fill the pool width"):
        attention.write_kv(
            pool, k[:, :1], k[:, :1], torch.zeros(3, dtype=torch.int64, device=DEVICE)
        )
    with pytest.raises(ValueError, match="slot_mapping must be"):
        attention.write_kv(pool, k, k, torch.zeros(2, dtype=torch.int64, device=DEVICE))


def _reference(q, kv, page_size, scale, pool_layer=None):
    """The float64 reference over ``kv``'s pages (or ``pool_layer`` in their place)."""
    pool = kv.pool_layer if pool_layer is None else pool_layer
    return attention_ref.paged_attention(
        q.double(), pool, kv.block_tables, kv.seq_lens, kv.query_starts, page_size, scale
    )


@pytest.mark.parametrize("pad", [5, 0])
@pytest.mark.parametrize("splits", [1, 4])
def test_mixed_step_with_padding_rows(splits, pad):
    """A mixed step as a CUDA graph pads it: decode rows (some mid-prompt one-token chunks),
    prefill chunks, empty sequences, and padding rows past the last sequence's, which no
    kernel writes. Every sequence's rows match the reference; splits > 1 exercises the
    per-sequence split partials of the decode kernel's mixed mode. With no padding rows (a step
    that fills its graph exactly) the empty sequence starts one row past q's end (q allocated
    to it): the decode kernel, which serves none of its rows, must not read that row (on the
    H200 such a read faulted where it lay past q's allocation; the interpreter cannot see it)."""
    gen = torch.Generator().manual_seed(51 + splits)
    shape = ATTN_SHAPES[1]
    lens = [9, 1, 23, 6, 14, 5, 30, 7, 0]
    queries = [1, 1, 5, 1, 14, 2, 1, 7, 0]
    kv = build_kv(
        lens, queries, shape.page_size, shape.kv_heads * shape.head_dim, DTYPES[0], DEVICE, gen
    )
    t = sum(queries)
    assert kv.query_starts.tolist()[-2:] == [t, t]  # the empty sequence starts past the rows
    q = torch.randn(t + pad, shape.heads, shape.head_dim, generator=gen).to(DTYPES[0])
    q = q.to(DEVICE)
    out = torch.full_like(q, 7.0)
    attention.paged_attention(
        q, kv.pool_layer, kv.block_tables, kv.seq_lens, kv.query_starts, shape.page_size,
        shape.head_dim**-0.5, out=out,
        decode=attention.DecodeLaunch(splits=splits, **SMALL_DECODE), prefill=SMALL_PREFILL,
    )  # fmt: skip
    ref = _reference(q[:t], kv, shape.page_size, shape.head_dim**-0.5)
    assert_close(out[:t], ref, DTYPES[0])
    assert torch.equal(out[t:], torch.full_like(out[t:], 7.0))  # padding rows untouched


@pytest.mark.parametrize("programs", [1, 0])
def test_mixed_step_reads_the_given_tile_table(programs):
    """The engine's path: the prefill tiles come from a host-built table (tile_table.
    query_tiles) sized for a graph's bound, rows past the step's last tile empty; with one
    program per head (programs 1) it strides over every tile. Prompts of several 64-row
    tiles, chunks, decode rows, an empty sequence and padding rows, as a mixed graph has."""
    from kernels.tile_table import ATTENTION_BLOCK, EMPTY, max_tiles, query_tiles

    gen = torch.Generator().manual_seed(61 + programs)
    shape = ATTN_SHAPES[1]
    lens = [130, 9, 70, 40, 3, 0]
    queries = [130, 1, 3, 1, 2, 0]
    kv = build_kv(
        lens, queries, shape.page_size, shape.kv_heads * shape.head_dim, DTYPES[0], DEVICE, gen
    )
    t, pad = sum(queries), 6
    flat = query_tiles(kv.query_starts.tolist(), ATTENTION_BLOCK)
    assert len(flat) // 3 == 5  # 130 rows in three tiles, then the 3- and 2-row chunks
    bound = max_tiles(t + pad, ATTENTION_BLOCK, len(lens)) + 4  # a table sized for more
    table = torch.tensor(flat + list(EMPTY) * (bound - len(flat) // 3), dtype=torch.int32)
    q = torch.randn(t + pad, shape.heads, shape.head_dim, generator=gen).to(DTYPES[0])
    q = q.to(DEVICE)
    out = torch.full_like(q, 7.0)
    attention.paged_attention(
        q, kv.pool_layer, kv.block_tables, kv.seq_lens, kv.query_starts, shape.page_size,
        shape.head_dim**-0.5, out=out, decode=attention.DecodeLaunch(**SMALL_DECODE),
        prefill=attention.PrefillLaunch(block_n=16 if not ON_GPU else 64, tile_programs=programs),
        prefill_tiles=table.view(-1, 3).to(DEVICE),
    )  # fmt: skip
    ref = _reference(q[:t], kv, shape.page_size, shape.head_dim**-0.5)
    assert_close(out[:t], ref, DTYPES[0])
    assert torch.equal(out[t:], torch.full_like(out[t:], 7.0))  # padding rows untouched


def test_a_given_tile_table_is_checked():
    """A table cut for other tiles, too short for the call, or of another dtype is refused."""
    from kernels.tile_table import ATTENTION_BLOCK, max_tiles

    gen = torch.Generator().manual_seed(71)
    kv = build_kv([5, 9], [1, 4], 4, 32, torch.float32, DEVICE, gen)
    q = torch.randn(5, 4, 16, device=DEVICE)
    bound = max_tiles(5, ATTENTION_BLOCK, 2)
    good = torch.full((bound, 3), -1, dtype=torch.int32, device=DEVICE)
    args = (q, kv.pool_layer, kv.block_tables, kv.seq_lens, kv.query_starts, 4, 0.25)
    cases = [
        (dict(prefill_tiles=good, prefill=attention.PrefillLaunch(block_q=16)), "64-row tiles"),
        (dict(prefill_tiles=good[:-1]), "prefill_tiles must be int32"),
        (dict(prefill_tiles=good.long()), "prefill_tiles must be int32"),
    ]
    for kwargs, message in cases:
        with pytest.raises(ValueError, match=message):
            attention.paged_attention(*args, **kwargs)
