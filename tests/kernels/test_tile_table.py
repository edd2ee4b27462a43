"""kernels/tile_table.py: the host-built tile lists the LoRA and attention kernels read."""

from __future__ import annotations

from kernels.tile_table import block_tiles, max_tiles, query_tiles


def _tiles(flat):
    return [tuple(flat[i : i + 3]) for i in range(0, len(flat), 3)]


def test_block_tiles_list_long_tiles_first_then_single_tokens():
    """Tiles of two tokens or more first (the fused kernel's long programs start first), then
    the one-token tiles, each kind in token order; base segments (row -1) get none, and every
    adapter token is in exactly one tile."""
    # segments: row 4 x 3 tokens, row 1 x 1, base x 2, row 2 x 17 (16 + a one-token rest),
    # row 0 x 1, row 3 x 18 (16 + 2)
    starts = [0, 3, 4, 6, 23, 24, 42]
    rows = [4, 1, -1, 2, 0, 3]
    got = _tiles(block_tiles(starts, rows, 16))
    assert got == [
        (4, 0, 3), (2, 6, 22), (3, 24, 40), (3, 40, 42),  # several tokens, in token order
        (1, 3, 4), (2, 22, 23), (0, 23, 24),  # one token each, in token order
    ]  # fmt: skip
    covered = sorted(t for _, s, e in got for t in range(s, e))
    assert covered == [0, 1, 2, 3] + list(range(6, 42))
    assert len(got) <= max_tiles(42, 16, len(rows))


def test_query_tiles_skip_single_rows():
    """The attention kernel's tiles: sequences of two query rows or more, cut into 64-row
    tiles (a one-row rest last, as block_tiles orders them); the decode kernel serves the
    one-row sequences, so they get none."""
    starts = [0, 1, 130, 132, 133]
    assert _tiles(query_tiles(starts)) == [(1, 1, 65), (1, 65, 129), (2, 130, 132), (1, 129, 130)]
