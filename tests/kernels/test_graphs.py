"""CUDA graphs (GPU only; tests/kernels/conftest.py leaves this file out without CUDA).

A decode step's kernels (K/V write, paged attention, a LoRA hook) are captured once over
fixed-capacity buffers and replayed after the buffers are refilled in place with other
batches: other adapters and popularities, other context lengths. Capturing proves there is no
host synchronization (it would abort the capture); the allocator's counters prove that with
workspaces given a step allocates nothing.
"""

from __future__ import annotations

import pytest
import torch

from kernels import attention, attention_ref, lora, lora_ref
from kernels.lora_layout import K, Q, V
from kernels.lora_ref import make_lora_tokens
from kernels.tile_table import (
    ATTENTION_BLOCK,
    EMPTY,
    TILE_BLOCKS,
    max_tiles,
    query_tiles,
    table_rows,
)
from tests.kernels.pools import build_adapters, build_kv, token_rows
from tests.kernels.sizes import assert_close

DEV = torch.device("cuda")


@pytest.mark.parametrize("path", ["fused", "launcher"])
def test_decode_step_replays_with_new_batches(path):
    """The fused kernel forced, and the launcher's choice at batch 64 (two launches)."""
    gen = torch.Generator().manual_seed(0)
    dtype = torch.bfloat16
    heads, kv_heads, head_dim, page = 32, 8, 128, 16
    w = kv_heads * head_dim
    d_in, widths = heads * head_dim, (heads * head_dim, w, w)
    batch, cap, n_adapters = 64, 72, 40
    max_rank = 64
    ranks = [{Q: (8, 16, 64)[i % 3], K: 16, V: (8, 32)[i % 2]} for i in range(n_adapters)]
    setup = build_adapters(
        ranks, {m: (d_in, o) for m, o in zip((Q, K, V), widths, strict=True)}, w, dtype, DEV, gen
    )
    lens_max = torch.randint(2, 3000, (batch,), generator=gen).tolist()
    kv = build_kv(lens_max, [1] * batch, page, w, dtype, DEV, gen)
    pool = kv.pool_layer

    # static buffers: everything a replay reads or writes
    x = torch.empty(batch, d_in, dtype=dtype, device=DEV)
    y = torch.empty(batch, sum(widths), dtype=dtype, device=DEV)
    token_lora = torch.empty(batch, dtype=torch.int32, device=DEV)
    seg_starts = torch.empty(cap + 1, dtype=torch.int32, device=DEV)
    seg_lora = torch.empty(cap, dtype=torch.int32, device=DEV)
    tiles = torch.empty(len(TILE_BLOCKS), table_rows(batch, cap), 3, dtype=torch.int32, device=DEV)
    tokens = lora_ref.LoraTokens(token_lora, seg_starts, seg_lora, tiles)
    q = torch.empty(batch, heads, head_dim, dtype=dtype, device=DEV)
    k_new = torch.empty(batch, kv_heads, head_dim, dtype=dtype, device=DEV)
    v_new = torch.empty_like(k_new)
    slots = torch.empty(batch, dtype=torch.int64, device=DEV)
    seq_lens = torch.empty(batch, dtype=torch.int32, device=DEV)
    out = torch.empty_like(q)
    lora_ws = torch.empty(lora.workspace_size(batch, 3, max_rank), device=DEV)
    lora_cfg = None
    if path == "fused":
        lora_cfg = lora.fused_config(batch, w, max_rank, 3, max(widths), d_in=d_in)
    splits = attention.decode_splits(batch, kv_heads, kv.block_tables.shape[1] * page, 64)
    attn_ws = torch.empty(
        attention.decode_workspace_size(batch, heads, head_dim, splits),
        dtype=torch.float32,
        device=DEV,
    )

    def fill(popularity: str) -> None:
        rows = token_rows(popularity, batch, n_adapters, gen, grouped=True)
        t = make_lora_tokens(rows, capacity=cap)
        token_lora.copy_(t.token_lora)
        seg_starts.copy_(t.seg_starts)
        seg_lora.copy_(t.seg_lora)
        tiles.copy_(t.tiles)
        lens = [int(torch.randint(1, n + 1, (), generator=gen)) for n in lens_max]
        seq_lens.copy_(torch.tensor(lens, dtype=torch.int32))
        pos = torch.tensor(lens) - 1
        bt = kv.block_tables.cpu()
        slots.copy_(bt[torch.arange(batch), pos // page].long() * page + pos % page)
        for t_ in (x, y, q, k_new, v_new):
            t_.copy_(torch.randn(t_.shape, generator=gen).to(dtype))

    def step() -> None:
        attention.write_kv(pool, k_new, v_new, slots)
        attention.paged_attention(
            q,
            pool,
            kv.block_tables,
            seq_lens,
            kv.query_starts,
            page,
            head_dim**-0.5,
            out=out,
            workspace=attn_ws,
        )
        lora.lora_apply(
            y,
            x,
            setup.pool[0],
            setup.index,
            tokens,
            (Q, K, V),
            widths,
            max_rank,
            workspace=lora_ws,
            config=lora_cfg,
        )

    fill("uniform")
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        step()  # compile outside the capture
    torch.cuda.current_stream().wait_stream(side)
    torch.cuda.synchronize()
    allocs = torch.cuda.memory_stats()["allocation.all.allocated"]
    step()  # with its buffers given, a step allocates nothing
    torch.cuda.synchronize()
    assert torch.cuda.memory_stats()["allocation.all.allocated"] == allocs, "allocated inside"
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):  # a host sync inside would abort the capture
        step()

    for popularity in ("distinct", "zipf", "identical", "base_mix"):
        fill(popularity)
        y0, pool0 = y.clone(), pool.clone()
        graph.replay()
        ref_pool = pool0.clone()
        attention_ref.write_kv(ref_pool, k_new, v_new, slots)
        assert torch.equal(pool.nan_to_num(1.0), ref_pool.nan_to_num(1.0))
        ref = attention_ref.paged_attention(
            q.double(), ref_pool, kv.block_tables, seq_lens, kv.query_starts, page, head_dim**-0.5
        )
        assert_close(out, ref, dtype)
        ref_y = y0.double()
        lora_ref.lora_apply(
            ref_y, x.double(), setup.pool[0], setup.index, tokens, (Q, K, V), widths, max_rank
        )
        assert_close(y, ref_y, dtype)


def test_mixed_attention_replays_with_new_batches():
    """A mixed step's attention as the engine's graphs hold it: capacity for 300 tokens and 40
    sequences, the prefill tiles read from a table the host rewrites before each replay, the
    prefill kernel on its own stream inside the capture. Each replay is another mix of
    prompts, chunks and decode rows, with empty sequences and padding rows after them."""
    gen = torch.Generator().manual_seed(3)
    dtype = torch.bfloat16
    heads, kv_heads, head_dim, page = 32, 8, 128, 16
    w = kv_heads * head_dim
    t_cap, b_cap, ctx_cap = 300, 40, 700
    kv = build_kv([ctx_cap] * b_cap, [1] * b_cap, page, w, dtype, DEV, gen)
    q = torch.empty(t_cap, heads, head_dim, dtype=dtype, device=DEV)
    out = torch.empty_like(q)
    seq_lens = torch.empty(b_cap, dtype=torch.int32, device=DEV)
    starts = torch.empty(b_cap + 1, dtype=torch.int32, device=DEV)
    bound = max_tiles(t_cap, ATTENTION_BLOCK, b_cap)
    table = torch.empty(bound, 3, dtype=torch.int32, device=DEV)

    def fill(queries: list[int]) -> list[int]:
        lens = [int(torch.randint(n, ctx_cap + 1, (), generator=gen)) if n else 0
                for n in queries]  # fmt: skip
        lens += [0] * (b_cap - len(lens))
        rows = [0, *torch.tensor(queries + [0] * (b_cap - len(queries))).cumsum(0).tolist()]
        seq_lens.copy_(torch.tensor(lens, dtype=torch.int32))
        starts.copy_(torch.tensor(rows, dtype=torch.int32))
        flat = query_tiles(rows, ATTENTION_BLOCK)
        table.copy_(torch.tensor(flat + list(EMPTY) * (bound - len(flat) // 3)).view(-1, 3))
        q.copy_(torch.randn(q.shape, generator=gen).to(dtype))
        return lens

    def step() -> None:
        attention.paged_attention(
            q, kv.pool_layer, kv.block_tables, seq_lens, starts, page, head_dim**-0.5,
            out=out, prefill_tiles=table,
        )  # fmt: skip

    fill([200, 1, 1, 30])
    step()  # compile outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):  # a host sync inside would abort the capture
        step()
    for queries in ([1] * 20 + [150, 2], [64, 65, 1, 129], [1, 299], [2] * 40):
        lens = fill(queries)
        out.fill_(7.0)
        graph.replay()
        t = sum(queries)
        ref = attention_ref.paged_attention(
            q[:t].double(), kv.pool_layer, kv.block_tables, seq_lens, starts, page,
            head_dim**-0.5,
        )  # fmt: skip
        assert_close(out[:t], ref, dtype)
        assert out[t:].eq(7.0).all(), "padding rows were written"
        assert sum(lens) > 0
