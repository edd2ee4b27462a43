"""The CPU serving path's paged attention (kernels/attention_cpu.py: decode rows batched)
against the per-sequence reference (kernels/attention_ref.py), float64 and float32, MHA and
GQA, decode steps and mixed ones with prefill chunks, empty sequences and padding rows, batches
split by the byte bound. Free pages hold NaN, so a stray read shows."""

from __future__ import annotations

import pytest
import torch

import kernels
from kernels import attention_cpu, attention_ref
from tests.kernels.pools import build_kv

# (heads, kv heads, head_dim, page size)
SHAPES = ((4, 4, 8, 4), (8, 2, 16, 16))


def _compare(lens, queries, shape, dtype, gen, pad=0):
    heads, kv_heads, head_dim, page = shape
    kv = build_kv(lens, queries, page, kv_heads * head_dim, dtype, torch.device("cpu"), gen)
    # A free page of NaN first, so that slot 0 (where padded positions point) is no one's.
    pool = torch.cat([torch.full_like(kv.pool_layer[:, :page], float("nan")), kv.pool_layer], 1)
    tables = kv.block_tables + 1
    t = sum(queries)
    q = torch.randn(t + pad, heads, head_dim, generator=gen, dtype=torch.float64)
    scale = head_dim**-0.5
    args = (tables, kv.seq_lens, kv.query_starts, page, scale)
    ref = attention_ref.paged_attention(q, pool.double(), *args)
    out = torch.full_like(q, float("nan")).to(dtype)
    got = attention_cpu.paged_attention(q.to(dtype), pool, *args, out=out)
    assert got is out and not torch.isnan(out).any()
    if dtype is torch.float64:
        torch.testing.assert_close(out, ref, rtol=1e-12, atol=1e-12)
    else:
        assert float((out.double() - ref).norm() / ref.norm()) < 1e-5


@pytest.mark.parametrize("dtype", (torch.float64, torch.float32))
@pytest.mark.parametrize("shape", SHAPES, ids=("mha", "gqa"))
def test_a_decode_step_matches_the_reference(shape, dtype):
    gen = torch.Generator().manual_seed(SHAPES.index(shape) * 2 + (dtype is torch.float32))
    lens = [1, 5, 17, 3, 33, 16, 2, 9]
    _compare(lens, [1] * len(lens), shape, dtype, gen)


@pytest.mark.parametrize("shape", SHAPES, ids=("mha", "gqa"))
def test_a_mixed_step_with_empty_sequences_and_padding_rows(shape):
    """Decode rows, prefill chunks (a prompt's first and a later one), an empty sequence and
    padding rows past the last sequence's: zero, as the reference leaves them."""
    gen = torch.Generator().manual_seed(10 + SHAPES.index(shape))
    lens = [9, 1, 23, 6, 14, 0, 5, 30, 7]
    queries = [1, 1, 5, 1, 14, 0, 2, 1, 7]
    _compare(lens, queries, shape, torch.float64, gen, pad=3)


def test_decode_batches_split_at_the_byte_bound(monkeypatch):
    """A bound that holds two rows of the longest context: batches of one to a few sequences,
    sorted by context length, each correct."""
    heads, kv_heads, head_dim, _ = SHAPES[1]
    monkeypatch.setattr(attention_cpu, "BATCH_BYTES", 2 * 40 * kv_heads * head_dim * 8)
    gen = torch.Generator().manual_seed(20)
    lens = [40, 3, 25, 7, 39, 1, 12, 30]
    _compare(lens, [1] * len(lens), SHAPES[1], torch.float64, gen)


def test_cpu_tensors_take_the_batched_path(monkeypatch):
    called = []
    monkeypatch.setattr(attention_cpu, "paged_attention", lambda *a, **k: called.append(1))
    kernels.paged_attention(torch.zeros(1, 4, 8), None, None, None, None, 4, 1.0)
    assert called == [1]
