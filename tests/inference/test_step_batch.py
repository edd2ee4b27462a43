"""StepBatch: one step's metadata, written in place into fixed-capacity tensors."""

from __future__ import annotations

import pytest
import torch

from services.inference.engine.batch import BatchEntry, StepBatch


def _batch() -> StepBatch:
    return StepBatch(
        max_tokens=32, max_seqs=4, max_pages_per_seq=5, max_segments=3, page_size=4,
        device=torch.device("cpu"),
    )  # fmt: skip


def test_fill_packs_prefill_and_decode():
    b = _batch()
    b.fill(
        [
            BatchEntry([7, 8, 9, 10, 11], 0, [3, 1], None, True),  # prefill, base model
            BatchEntry([42], 6, [0, 2], 1, True),  # decode of a 7th token, LoRA row 1
            BatchEntry([5, 6], 4, [4, 5, 6], 1, False),  # a prefill chunk, not sampled
        ]
    )
    assert b.input_ids.tolist() == [7, 8, 9, 10, 11, 42, 5, 6]
    assert b.positions.tolist() == [0, 1, 2, 3, 4, 6, 4, 5]
    # position p of a sequence lives at slot pages[p // 4] * 4 + p % 4
    assert b.slot_mapping.tolist() == [12, 13, 14, 15, 4, 10, 20, 21]
    assert b.seq_lens.tolist() == [5, 7, 6]
    assert b.query_starts.tolist() == [0, 5, 6, 8]
    assert b.logits_indices.tolist() == [4, 5]
    assert b.block_tables.tolist() == [[3, 1, 0, 0, 0], [0, 2, 0, 0, 0], [4, 5, 6, 0, 0]]
    lt = b.lora_tokens
    assert lt.token_lora.tolist() == [-1] * 5 + [1] * 3
    assert lt.seg_starts.tolist() == [0, 5, 8, 8]  # padded with empty segments
    assert lt.seg_lora.tolist() == [-1, 1, -1]


def test_tiles_match_the_reference_and_forget_the_previous_step():
    """The LoRA kernels' tile tables (kernels/tile_table.py) equal make_lora_tokens' for the
    same rows, and rows a longer earlier step wrote are empty again (row -1)."""
    from kernels import make_lora_tokens
    from kernels.tile_table import TILE_BLOCKS

    b = StepBatch(
        max_tokens=80, max_seqs=4, max_pages_per_seq=6, max_segments=6, page_size=16,
        device=torch.device("cpu"),
    )  # fmt: skip
    b.fill(
        [BatchEntry([1] * 40, 0, [0, 1, 2], 0, True), BatchEntry([2] * 35, 0, [3, 4, 5], 2, True)]
    )
    first = b.lora_tokens.tiles.clone()
    assert first[0, :6].tolist() == [
        [0, 0, 16], [0, 16, 32], [0, 32, 40], [2, 40, 56], [2, 56, 72], [2, 72, 75]
    ]  # fmt: skip
    assert first[0, 6:, 0].eq(-1).all() and first[2, :2].tolist() == [[0, 0, 40], [2, 40, 75]]
    b.fill([BatchEntry([3], 5, [0], None, True), BatchEntry([4, 5], 3, [1], 1, True)])
    tiles = b.lora_tokens.tiles
    ref = make_lora_tokens(torch.tensor([-1, 1, 1]), capacity=6).tiles
    for k in range(len(TILE_BLOCKS)):
        used = int(ref[k, :, 0].ge(0).sum())
        assert used == 1 and tiles[k, :used].tolist() == ref[k, :used].tolist() == [[1, 1, 3]]
        assert tiles[k, used:, 0].eq(-1).all()  # the first step's tiles are gone


def test_one_token_tiles_fill_the_smallest_block_table_only():
    """fill(one_token_tiles=True) (a decode step's fused calls): the 16-token table lists
    every adapter token as its own tile, shared adapters included; the other tables keep their
    segments' tiles; the next step without it writes the 16-token tiles again, the stale rows
    empty."""
    from kernels.tile_table import TILE_BLOCKS

    b = StepBatch(
        max_tokens=16, max_seqs=6, max_pages_per_seq=2, max_segments=8, page_size=4,
        device=torch.device("cpu"),
    )  # fmt: skip
    rows = [None, 1, 1, 1, 3, 3]
    entries = [BatchEntry([7], 2, [k], r, True) for k, r in enumerate(rows)]
    b.fill(entries, one_token_tiles=True)
    tiles = b.lora_tokens.tiles
    assert tiles[0, :6].tolist() == [
        [1, 1, 2], [1, 2, 3], [1, 3, 4], [3, 4, 5], [3, 5, 6], [-1, 0, 0]
    ]  # fmt: skip
    for k in range(1, len(TILE_BLOCKS)):
        assert tiles[k, :3].tolist() == [[1, 1, 4], [3, 4, 6], [-1, 0, 0]]
    b.fill(entries)
    assert b.lora_tokens.tiles[0, :3].tolist() == [[1, 1, 4], [3, 4, 6], [-1, 0, 0]]
    assert b.lora_tokens.tiles[0, 2:, 0].eq(-1).all()


def test_pair_tiles_put_a_decode_steps_shared_adapter_tokens_two_to_a_tile():
    """fill(one_token_tiles=True, pair_tiles=True) on a decode step: the 16-token table cuts
    each adapter's tokens two to a tile (the pairs first, then the tiles of one, as
    tile_table.block_tiles lists them), padding as zero tiles where asked; on a mixed step
    (not every entry one token) the entries are cut apart as without pairs."""
    from kernels.tile_table import ZERO_ROW

    b = StepBatch(
        max_tokens=16, max_seqs=8, max_pages_per_seq=8, max_segments=8, page_size=4,
        device=torch.device("cpu"),
    )  # fmt: skip
    rows = [None, 1, 1, 1, 3, 3, 4]
    entries = [BatchEntry([7], 2, [k], r, True) for k, r in enumerate(rows)]
    b.fill(entries, one_token_tiles=True, pair_tiles=True)
    assert b.lora_tokens.tiles[0, :5].tolist() == [
        [1, 1, 3], [3, 4, 6], [1, 3, 4], [4, 6, 7], [-1, 0, 0]
    ]  # fmt: skip
    assert b.tiles_apart
    b.fill(entries, pad_tokens=9, one_token_tiles=True, zero_tiles=True, pair_tiles=True)
    assert b.lora_tokens.tiles[0, :6].tolist() == [
        [ZERO_ROW, 0, 1], [ZERO_ROW, 7, 9], [1, 1, 3], [3, 4, 6], [1, 3, 4], [4, 6, 7]
    ]  # fmt: skip
    prompt = BatchEntry([5, 6, 7], 0, [7], 1, True)
    b.fill([*entries[1:3], prompt], one_token_tiles=True, pair_tiles=True)
    assert b.lora_tokens.tiles[0, :4].tolist() == [[1, 2, 5], [1, 0, 1], [1, 1, 2], [-1, 0, 0]]


def test_one_token_tiles_of_a_mixed_step_cut_each_entry_apart():
    """fill(one_token_tiles=True) on a mixed step (a narrow step's decode tokens apart): in the
    16-token table each decode token is a tile of its own and a prompt's chunk takes 16-token
    tiles of its own, though both share the adapter's segment (longer tiles first, as
    tile_table.block_tiles lists them); the other tables keep the segments' tiles. A step of
    more adapter entries than the tiles' bound (the segment capacity) keeps the segments'."""
    from kernels.tile_table import TILE_BLOCKS

    b = StepBatch(
        max_tokens=64, max_seqs=8, max_pages_per_seq=8, max_segments=4, page_size=4,
        device=torch.device("cpu"),
    )  # fmt: skip
    prompt = BatchEntry(list(range(20)), 0, list(range(5)), 2, True)  # tokens 2..21
    entries = [
        BatchEntry([7], 2, [5], 2, True), BatchEntry([7], 2, [6], 2, True), prompt,
        BatchEntry([7], 2, [7], 5, True),
    ]  # fmt: skip
    b.fill([BatchEntry([7], 2, [0], None, True), *entries], one_token_tiles=True)
    tiles = b.lora_tokens.tiles
    assert tiles[0, :6].tolist() == [
        [2, 3, 19], [2, 19, 23], [2, 1, 2], [2, 2, 3], [5, 23, 24], [-1, 0, 0]
    ]  # fmt: skip
    assert tiles[1, :3].tolist() == [[2, 1, 23], [5, 23, 24], [-1, 0, 0]]
    assert TILE_BLOCKS[1] == 32 and b.tiles_apart
    # five adapter entries of one token each: 5 tiles, where 5 tokens on a capacity of 4
    # segments bound the tiles at 1 + 4
    five = [BatchEntry([7], 2, [k], r, True) for k, r in enumerate((1, 1, 1, 1, 1))]
    b.fill([*five, BatchEntry([1, 2], 0, [6], 3, True)], one_token_tiles=True)
    assert b.lora_tokens.tiles[0, :3].tolist() == [[1, 0, 5], [3, 5, 7], [-1, 0, 0]]
    assert not b.tiles_apart


def _cover(table: torch.Tensor, t: int) -> list[int]:
    """Each token's tile row in a tile table (every token in exactly one tile), -1 if none."""
    rows = [-1] * t
    for row, start, end in table.tolist():
        if row == -1:
            break
        for k in range(start, end):
            assert rows[k] == -1, f"token {k} in two tiles"
            rows[k] = row
    return rows


@pytest.mark.parametrize("apart", [False, True])
def test_zero_tiles_cover_every_token_padding_included(apart):
    """fill(zero_tiles=True), a step whose fused LoRA calls write their deltas (the GEMMs add
    onto them): every table lists every token exactly once, base-model tokens and a mixed
    graph's padding as ZERO_ROW tiles (first), with or without the decode tokens apart; the
    next fill without them lists adapter tokens only."""
    from kernels.tile_table import TILE_BLOCKS, ZERO_ROW

    b = StepBatch(
        max_tokens=64, max_seqs=8, max_pages_per_seq=8, max_segments=6, page_size=4,
        device=torch.device("cpu"),
    )  # fmt: skip
    entries = [
        BatchEntry([7], 2, [0], None, True),  # a base-model decode
        BatchEntry(list(range(18)), 0, list(range(1, 6)), None, False),  # a base prompt's chunk
        BatchEntry([7], 2, [6], 2, True),
        BatchEntry(list(range(20)), 0, list(range(7, 12)), 2, True),  # tokens 20..39
        BatchEntry([7], 2, [12], 5, True),
    ]
    b.fill(entries, pad_tokens=48, pad_seqs=7, one_token_tiles=apart, zero_tiles=True)
    want = [ZERO_ROW] * 19 + [2] * 21 + [5] + [ZERO_ROW] * 7
    tiles = b.lora_tokens.tiles
    for k, block in enumerate(TILE_BLOCKS):
        assert _cover(tiles[k], 48) == want, block
        listed = [r for r, _, _ in tiles[k].tolist() if r != -1]
        assert listed == sorted(listed, key=lambda r: r != ZERO_ROW)  # the zero tiles first
        assert all(e - s <= block for r, s, e in tiles[k].tolist() if r != -1)
    assert b.tiles_apart == apart
    if apart:  # the decode token on row 2 is a tile of its own
        assert [2, 19, 20] in tiles[0].tolist()
    b.fill(entries, pad_tokens=48, pad_seqs=7)
    assert _cover(b.lora_tokens.tiles[0], 48) == [-1] * 19 + [2] * 21 + [5] + [-1] * 7


def test_attention_tiles_list_the_prompts_and_forget_the_previous_step():
    """The prefill attention kernel's table (kernels/tile_table.query_tiles): the query rows
    of every sequence of two tokens or more, in 64-row tiles; a shorter step empties the rows
    a longer one wrote."""
    b = StepBatch(
        max_tokens=200, max_seqs=6, max_pages_per_seq=12, max_segments=4, page_size=16,
        device=torch.device("cpu"),
    )  # fmt: skip
    b.fill(
        [
            BatchEntry([1], 9, [0], None, True),  # decode: the decode kernel's
            BatchEntry([2] * 150, 0, list(range(1, 11)), None, True),  # 3 tiles
            BatchEntry([3] * 2, 4, [11], 0, False),  # a two-token chunk: a tile
        ],
        pad_tokens=180,
        pad_seqs=5,
    )
    tiles = b.attention_tiles.tolist()
    assert tiles[:4] == [[1, 1, 65], [1, 65, 129], [1, 129, 151], [2, 151, 153]]
    assert all(row[0] == -1 for row in tiles[4:])
    b.fill([BatchEntry([5] * 3, 0, [0], None, True), BatchEntry([6], 7, [1], None, True)])
    tiles = b.attention_tiles.tolist()
    assert tiles[0] == [0, 0, 3] and all(row[0] == -1 for row in tiles[1:])
    b.fill([BatchEntry([7], 3, [0], None, True), BatchEntry([8], 7, [1], None, True)])
    assert all(row[0] == -1 for row in b.attention_tiles.tolist())  # decode only: none


def test_module_mask_lists_the_modules_of_the_step_adapters():
    """LoraTokens.modules: the modules the step's adapters have (row bits kept by the adapter
    manager), none for a base-model step, every one without row bits."""
    row_modules = [0b0001111, 0b1110000, 0b0000001]  # q/k/v/o; gate/up/down; q alone
    b = StepBatch(
        max_tokens=16, max_seqs=4, max_pages_per_seq=2, max_segments=4, page_size=4,
        device=torch.device("cpu"), row_modules=row_modules,
    )  # fmt: skip
    b.fill([BatchEntry([1], 2, [0], 2, True), BatchEntry([2], 3, [1], 0, True)])
    assert b.lora_tokens.modules.tolist() == [1, 1, 1, 1, 0, 0, 0]
    b.fill([BatchEntry([1], 2, [0], 1, True), BatchEntry([2], 3, [1], None, True)])
    assert b.lora_tokens.modules.tolist() == [0, 0, 0, 0, 1, 1, 1]
    b.fill([BatchEntry([1], 2, [0], None, True)])
    assert b.lora_tokens.modules.tolist() == [0] * 7
    assert _batch().lora_tokens.modules is not None
    everything = _batch()
    everything.fill([BatchEntry([1], 2, [0], None, True)])
    assert everything.lora_tokens.modules.tolist() == [1] * 7


def test_slots_of_a_chunk_that_starts_inside_a_page():
    b = _batch()
    b.fill([BatchEntry(list(range(6)), 3, [9, 2, 7], None, True)])  # positions 3..8
    assert b.slot_mapping.tolist() == [39, 8, 9, 10, 11, 28]


def test_buffers_keep_their_addresses():
    """Every step writes into the same tensors (what a CUDA graph replays)."""
    b = _batch()
    b.fill([BatchEntry([1, 2, 3], 0, [0], 0, True)])
    ptrs = {name: t.data_ptr() for name, t in b._dev.items()}
    b.fill([BatchEntry([4], 3, [0], None, True), BatchEntry([9, 9], 0, [1], None, True)])
    assert {name: t.data_ptr() for name, t in b._dev.items()} == ptrs
    assert not b.has_lora  # base model only: the eager LoRA hooks are skipped
    assert b.lora_tokens.token_lora.tolist() == [-1, -1, -1]
    assert b.block_tables.tolist() == [[0, 0, 0, 0, 0], [1, 0, 0, 0, 0]]


def test_block_tables_are_rewritten_whole():
    """A step's block tables hold each sequence's pages and zeros after them, whatever longer
    rows an earlier step wrote there."""
    b = _batch()
    b.fill([BatchEntry([1], 16, [4, 3, 2, 1, 0], 0, True), BatchEntry([2], 8, [1, 2, 3], 1, True)])
    b.fill([BatchEntry([1], 2, [7], 0, True), BatchEntry([2], 5, [5, 6], 1, True)])
    assert b.block_tables.tolist() == [[7, 0, 0, 0, 0], [5, 6, 0, 0, 0]]


def test_a_rank_that_receives_the_wire_bytes_sees_the_same_step():
    """What a tensor-parallel step sends (wire: every tensor but the block tables, then the
    step's rows of them) makes another rank's batch, whatever its buffer held, the same step."""
    entries = [
        BatchEntry([7, 8, 9, 10, 11], 0, [3, 1], None, True),
        BatchEntry([42], 6, [0, 2], 1, True),
    ]
    sent, got = _batch(), _batch()
    sent.fill(entries, pad_tokens=8, pad_seqs=3)
    wire = sent.wire(sent.num_seqs)
    assert wire.numel() == sent.packed.numel() - (4 - 3) * 5 * 4  # one unused row of 5 pages
    got.packed.fill_(0x7F)  # stale bytes of earlier steps
    got.packed[: wire.numel()].copy_(wire)
    got.adopt(sent.counts)
    for name in ("input_ids", "positions", "slot_mapping", "block_tables", "seq_lens",
                 "query_starts", "logits_indices"):  # fmt: skip
        assert torch.equal(getattr(got, name), getattr(sent, name)), name
    assert torch.equal(got.lora_tokens.tiles, sent.lora_tokens.tiles)
    assert torch.equal(got.lora_tokens.seg_lora, sent.lora_tokens.seg_lora)


def test_capacity_and_consistency_errors():
    b = _batch()
    with pytest.raises(ValueError, match="at least one sequence"):
        b.fill([])
    with pytest.raises(ValueError, match="5 sequences exceed max_seqs 4"):
        b.fill([BatchEntry([1], 0, [0], None, True)] * 5)
    with pytest.raises(ValueError, match="33 tokens exceed max_tokens 32"):
        b.fill(
            [
                BatchEntry([1] * 17, 0, [0] * 5, None, True),
                BatchEntry([1] * 16, 0, [1] * 4, None, True),
            ]
        )
    with pytest.raises(ValueError, match="entry 0: 5 tokens at 0 on 1 pages"):
        b.fill([BatchEntry([1] * 5, 0, [0], None, True)])
    with pytest.raises(ValueError, match="4 LoRA segments exceed 3"):
        b.fill([BatchEntry([1], 0, [0], row, True) for row in (0, 1, 2, 3)])


def test_fill_pads_a_mixed_step_for_its_graph():
    """Padding tokens belong to no sequence (no slot, no adapter), padding sequences have no
    tokens and read logits row 0, and the sequences' own rows come first."""
    b = _batch()
    b.fill(
        [BatchEntry([7, 8, 9], 0, [3], None, True), BatchEntry([42], 6, [0, 2], 1, False)],
        pad_tokens=7,
        pad_seqs=4,
    )
    assert b.input_ids.tolist() == [7, 8, 9, 42, 0, 0, 0]
    assert b.slot_mapping.tolist() == [12, 13, 14, 10, -1, -1, -1]
    assert b.seq_lens.tolist() == [3, 7, 0, 0]
    assert b.query_starts.tolist() == [0, 3, 4, 4, 4]
    assert b.logits_indices.tolist() == [2, 0, 0, 0]  # one sampled row, then padding
    assert b.num_sampled == 1
    lt = b.lora_tokens
    assert lt.token_lora.tolist() == [-1, -1, -1, 1, -1, -1, -1]
    assert lt.seg_starts.tolist() == [0, 3, 4, 7] and lt.seg_lora.tolist() == [-1, 1, -1]
    with pytest.raises(ValueError, match="padded to 3"):
        b.fill([BatchEntry([1, 2, 3, 4], 0, [0], None, True)], pad_tokens=3, pad_seqs=2)


def test_inputs_in_flight_are_read_on_the_device():
    """An entry whose last token is still in flight reads it from the previous step's
    sampled tokens (StepBatch.prev_tokens) by row."""
    b = _batch()
    b.prev_tokens[:3] = torch.tensor([70, 71, 72])
    b.fill(
        [
            BatchEntry([5, 6, 0], 0, [0], None, True, 2),  # last token = row 2's
            BatchEntry([0], 3, [1], None, True, 0),  # row 0's
            BatchEntry([9], 4, [2, 3], None, True),  # known
        ]
    )
    b.resolve_inputs()
    assert b.input_ids.tolist() == [5, 6, 72, 70, 9]
