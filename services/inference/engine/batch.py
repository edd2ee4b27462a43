"""StepBatch: all per-step metadata of one forward pass, in fixed-capacity tensors filled in place.

The tensors are allocated once with the engine's limits (tokens, sequences, pages per sequence,
LoRA segments) so that a later CUDA-graph capture sees stable addresses; each step writes the
live prefix and the model reads views of it. The tensors are views of one flat byte buffer
(``packed``), laid out so that what a step wrote is a prefix of it (wire()). On CUDA ``packed`` is
a pinned staging copy and the device tensors are views of a device buffer of the same layout,
filled by one non-blocking copy of that prefix a step (rather than one copy a tensor: the host
spends about 10 us issuing each); the staging is written again only after an event recorded
behind that copy has completed. A tensor-parallel step sends the same prefix to the other ranks
in one broadcast (engine/tensor_parallel.py); a rank that receives it calls adopt().
"""

from __future__ import annotations

import array
import math
from collections.abc import Sequence
from typing import NamedTuple

import torch

from kernels import LoraTokens
from kernels.lora_layout import NUM_MODULES
from kernels.tile_table import (
    ATTENTION_BLOCK,
    EMPTY,
    FIELDS,
    PAIR_BLOCK,
    TILE_BLOCKS,
    block_tiles,
    max_tiles,
    query_tiles,
    table_rows,
)

# Each tensor's offset in the packed buffers: 16 bytes, what Triton's pointer specialization
# and vectorized loads want of the kernels' tables.
_ALIGN = 16


class BatchEntry(NamedTuple):
    """One sequence's share of a step, as the scheduler decided it."""

    token_ids: Sequence[int]  # the tokens computed this step (a prefill chunk or one decode)
    start_pos: int  # position of token_ids[0] = tokens already in the KV cache
    pages: Sequence[int]  # the sequence's KV pages, covering start_pos + len(token_ids)
    lora_row: int | None  # LoRA index row of the sequence's adapter, None = base model
    sample: bool  # True when this chunk ends the sequence: its last token's logits are sampled
    # The last token's id is not known on the host yet: it is row src_row of the tokens the
    # previous step sampled (StepBatch.prev_tokens), read on the device. None: all known.
    src_row: int | None = None


class StepBatch:
    def __init__(
        self,
        max_tokens: int,
        max_seqs: int,
        max_pages_per_seq: int,
        max_segments: int,
        page_size: int,
        device: torch.device,
        row_modules: Sequence[int] | None = None,
    ) -> None:
        """``row_modules``: the modules of each LoRA index row's adapter as bits (bit m: module
        m), kept current by the adapter manager; each step lists the modules its adapters have
        from it (LoraTokens.modules). None: every step lists every module."""
        self.max_tokens, self.max_seqs = max_tokens, max_seqs
        self._row_modules = row_modules
        self.max_pages_per_seq, self.max_segments = max_pages_per_seq, max_segments
        self.page_size, self.device = page_size, device
        shapes = {
            "input_ids": ((max_tokens,), torch.int64),
            "input_src": ((max_tokens,), torch.int64),
            "positions": ((max_tokens,), torch.int64),
            "slot_mapping": ((max_tokens,), torch.int64),
            "token_lora": ((max_tokens,), torch.int32),
            "seq_lens": ((max_seqs,), torch.int32),
            "query_starts": ((max_seqs + 1,), torch.int32),
            "logits_indices": ((max_seqs,), torch.int64),
            "seg_starts": ((max_segments + 1,), torch.int32),
            "seg_lora": ((max_segments,), torch.int32),
            "lora_modules": ((NUM_MODULES,), torch.int32),
            # The LoRA kernels' tiles, one table per block size (kernels/tile_table.py).
            "lora_tiles": (
                (len(TILE_BLOCKS), table_rows(max_tokens, max_segments), FIELDS),
                torch.int32,
            ),
            # The prefill attention kernel's tiles: sequences of two query rows or more.
            "attn_tiles": (
                (max(1, max_tiles(max_tokens, ATTENTION_BLOCK, max_seqs)), FIELDS),
                torch.int32,
            ),
            # Last, so that a step's bytes end with its sequences' rows (wire()).
            "block_tables": ((max_seqs, max_pages_per_seq), torch.int32),
        }
        pin = device.type == "cuda"
        offsets, total = {}, 0
        for k, (s, d) in shapes.items():
            offsets[k] = total
            total += -(-math.prod(s) * d.itemsize // _ALIGN) * _ALIGN
        self.packed = torch.zeros(total, dtype=torch.uint8, pin_memory=pin)  # every host tensor
        self._tables_at = offsets["block_tables"]

        def views(flat: torch.Tensor) -> dict[str, torch.Tensor]:
            return {
                k: flat[offsets[k] : offsets[k] + math.prod(s) * d.itemsize].view(d).view(s)
                for k, (s, d) in shapes.items()
            }

        self._host = views(self.packed)
        # The device tensors: views of one buffer of the same layout (the host's on the CPU).
        self._dev_packed = torch.zeros(total, dtype=torch.uint8, device=device) if pin else None
        self._dev = self._host if self._dev_packed is None else views(self._dev_packed)
        # The tokens the latest launched step sampled, in its sampling order: the next step's
        # inputs whose ids the host does not know yet are read from here (resolve_inputs).
        self.prev_tokens = torch.zeros(max_seqs, dtype=torch.int64, device=device)
        self._copied: torch.cuda.Event | None = None  # behind the latest staging -> device copy
        self._zeros = (0,) * max_pages_per_seq  # pads block-table rows to the step's widest
        for name in ("lora_tiles", "attn_tiles"):  # no tiles yet
            self._host[name][..., 0] = -1
        if self._dev_packed is not None:
            self._dev_packed.copy_(self.packed)
        # Rows of each table the last step wrote: the LoRA tables', then attention's.
        self._tiles_used = [0] * (len(TILE_BLOCKS) + 1)
        self.num_tokens = self.num_seqs = self.num_logits = self.num_sampled = 0
        self.has_lora = False
        self.tiles_apart = False  # whether the last fill cut its entries apart (one_token_tiles)
        # whether the last fill listed the tokens without an adapter as tiles too (zero_tiles;
        # a tensor-parallel worker that adopts a step sets it from the step's mode)
        self.zero_tiles = False

    def fill(
        self,
        entries: Sequence[BatchEntry],
        pad_tokens: int | None = None,
        pad_seqs: int | None = None,
        one_token_tiles: bool = False,
        zero_tiles: bool = False,
        pair_tiles: bool = False,
    ) -> None:
        """Write one step's metadata. Entries must be sorted by LoRA row (segments contiguous).

        ``pad_tokens``/``pad_seqs`` (a mixed step's CUDA graph) pad the step to that many
        tokens and sequences: padding tokens belong to no sequence (no K/V slot, no adapter;
        attention leaves their rows unwritten), padding sequences have no tokens and no context,
        and every padding sequence's logits row reads token 0 (dropped). ``one_token_tiles``:
        the LoRA tile table of the smallest block cuts each entry's tokens apart from the other
        entries', so every decode token (an entry of one token) is a tile of its own and a
        prompt's tokens are tiles of that block, where the table otherwise cuts each adapter's
        segment (the tokens of every entry on that adapter) into tiles of the block: a decode
        step's fused calls on one-token tiles (kernels.lora_paths.one_token_step_fuses) and a
        mixed step's whose decode tokens take them (ModelRunner.step_lora). Steps of more
        adapter entries than their tiles' bound holds (tile_table.max_tiles over the segment
        capacity) keep the segments' tiles. ``zero_tiles``: the LoRA tile tables also list the
        tokens without an adapter, padding included (rows ZERO_ROW), for a step whose fused
        calls write their deltas rather than add them (LoraContext.addend). ``pair_tiles``
        (with one_token_tiles; for a step whose every entry is one token, a decode step):
        that table cuts each adapter's tokens two to a tile (tile_table.PAIR_BLOCK), which the
        one-token GEMV body takes with the weights loaded once (LoraLaunch.gemv_pair)."""
        if not entries:
            raise ValueError("a step needs at least one sequence")
        seqs = len(entries) if pad_seqs is None else pad_seqs
        if len(entries) > seqs or seqs > self.max_seqs:
            padded = "" if pad_seqs is None else f" (padded to {seqs})"
            raise ValueError(f"{len(entries)} sequences{padded} exceed max_seqs {self.max_seqs}")
        self.wait_staging()  # the previous step's copies may still read the staging
        ps = self.page_size
        ids: list[int] = []
        sources: list[int] = []
        pos: list[int] = []
        slots: list[int] = []
        rows: list[int] = []
        seq_lens: list[int] = []
        starts = [0]
        entry_rows: list[int] = []  # each entry's LoRA row (-1: none)
        logits: list[int] = []
        h = self._host
        width = max(len(e.pages) for e in entries)  # block tables: one write, rows padded
        tables: list[int] = []
        for b, e in enumerate(entries):
            n = len(e.token_ids)
            end = e.start_pos + n
            if n == 0 or len(e.pages) * ps < end or len(e.pages) > self.max_pages_per_seq:
                raise ValueError(f"entry {b}: {n} tokens at {e.start_pos} on {len(e.pages)} pages")
            ids.extend(e.token_ids)
            sources.extend([-1] * n)
            if e.src_row is not None:
                sources[-1] = e.src_row
            pos.extend(range(e.start_pos, end))
            p = e.start_pos
            while p < end:  # position q at pages[q // ps] * ps + q % ps: a slot run per page
                page_end = min(end, (p // ps + 1) * ps)
                shift = e.pages[p // ps] * ps - p // ps * ps
                slots.extend(range(p + shift, page_end + shift))
                p = page_end
            row = -1 if e.lora_row is None else e.lora_row
            rows.extend([row] * n)
            entry_rows.append(row)
            seq_lens.append(end)
            starts.append(starts[-1] + n)
            if e.sample:
                logits.append(starts[-1] - 1)
            tables.extend(e.pages)
            tables.extend(self._zeros[: width - len(e.pages)])
        real = len(ids)
        t = real if pad_tokens is None else pad_tokens
        if real > t or t > self.max_tokens:
            padded = "" if pad_tokens is None else f" (padded to {t})"
            raise ValueError(f"{real} tokens{padded} exceed max_tokens {self.max_tokens}")
        if t > real:
            n = t - real
            ids.extend([0] * n)
            sources.extend([-1] * n)
            pos.extend([0] * n)
            slots.extend([-1] * n)
            rows.extend([-1] * n)
        for _ in range(seqs - len(entries)):
            seq_lens.append(0)
            starts.append(real)
            tables.extend(self._zeros[:width])
        n_logits = len(logits)
        if pad_seqs is not None:  # a graph's logits rows are as many as its sequences
            logits.extend([0] * (seqs - len(logits)))
        seg_starts, seg_rows = _segments(rows)
        if len(seg_rows) > self.max_segments:
            raise ValueError(f"{len(seg_rows)} LoRA segments exceed {self.max_segments}")
        entries_apart = None
        apart_block = TILE_BLOCKS[0]
        if one_token_tiles and pair_tiles and real == len(entries):  # tokens two to a tile
            entries_apart, apart_block = (seg_starts, seg_rows), PAIR_BLOCK
        elif one_token_tiles:
            entries_apart = (starts[: len(entry_rows) + 1], entry_rows)
            if zero_tiles and t > real:  # the padding: one entry of no adapter
                entries_apart = (entries_apart[0] + [t], entry_rows + [-1])
        self._write_tiles(seg_starts, seg_rows, starts, entries_apart, zero_tiles, apart_block)
        self.zero_tiles = zero_tiles
        _write(h["lora_modules"], self._modules(seg_rows))
        # Unused segments are empty (start = end = t) and base-only, like make_lora_tokens pads.
        seg_starts += [t] * (self.max_segments + 1 - len(seg_starts))
        seg_rows += [-1] * (self.max_segments - len(seg_rows))
        for name, values in (
            ("input_ids", ids),
            ("input_src", sources),
            ("positions", pos),
            ("slot_mapping", slots),
            ("token_lora", rows),
            ("seq_lens", seq_lens),
            ("query_starts", starts),
            ("logits_indices", logits),
            ("seg_starts", seg_starts),
            ("seg_lora", seg_rows),
        ):
            if values:
                _write(h[name], values)
        block_tables = h["block_tables"][:seqs]
        block_tables[:, width:].zero_()  # what longer rows of earlier steps left
        _write(block_tables[:, :width], tables)
        self.num_tokens, self.num_seqs, self.num_logits = t, seqs, len(logits)
        self.num_sampled = n_logits
        self.has_lora = any(r >= 0 for r in seg_rows)
        self._to_device()

    @property
    def counts(self) -> tuple[int, int, int, int, bool]:
        """What fill() decided besides the host tensors: tokens, sequences, logits rows,
        sampled rows, whether any token uses an adapter (adopt() takes them)."""
        return self.num_tokens, self.num_seqs, self.num_logits, self.num_sampled, self.has_lora

    def wire(self, num_seqs: int) -> torch.Tensor:
        """What a step of ``num_seqs`` sequences (padding included) wrote of ``packed``: every
        host tensor but the block tables whole, then those sequences' rows of the block tables,
        laid out last (at the service's defaults 115 KB and 1 KB a sequence, against 640 KB for
        the whole buffer, 524 KB of it block tables): the device's copy of the step and what a
        tensor-parallel step sends."""
        return self.packed[: self._wire_bytes(num_seqs)]

    def _wire_bytes(self, num_seqs: int) -> int:
        return self._tables_at + num_seqs * self.max_pages_per_seq * 4

    @property
    def copied(self) -> torch.cuda.Event | None:
        """Recorded on the step's stream behind the latest step's input copies (None on the CPU
        and before the first): adapter transfers wait for it (AdapterCopier.issue)."""
        return self._copied

    def wait_staging(self) -> None:
        """Block until the host tensors may be written (the previous copy has read them)."""
        if self._copied is not None:
            self._copied.synchronize()

    def adopt(self, counts: tuple[int, int, int, int, bool]) -> None:
        """Take a step another rank filled: ``packed`` holds its host tensors (received after
        wait_staging()), ``counts`` its counts."""
        self.num_tokens, self.num_seqs, self.num_logits, self.num_sampled, self.has_lora = counts
        self._to_device()

    def _to_device(self) -> None:
        """One copy of what the step wrote (wire()); the device rows of the block tables past
        the step's sequences keep older bytes, which no view of this step reads."""
        if self._dev_packed is not None:
            n = self._wire_bytes(self.num_seqs)
            self._dev_packed[:n].copy_(self.packed[:n], non_blocking=True)
            self._copied = torch.cuda.Event()
            self._copied.record()

    def resolve_inputs(self) -> None:
        """input_ids[t] = prev_tokens[input_src[t]] where input_src[t] >= 0: the ids of tokens
        the previous step sampled, on the device (inside a CUDA graph too), no host sync."""
        d = self._dev
        src = d["input_src"][: self.num_tokens]
        ids = d["input_ids"][: self.num_tokens]
        picked = self.prev_tokens[src.clamp(min=0)]
        ids.copy_(torch.where(src >= 0, picked, ids))

    # Live views for the model. [T] = this step's tokens, [S] = its sequences.
    @property
    def input_ids(self) -> torch.Tensor:  # [T]
        return self._dev["input_ids"][: self.num_tokens]

    @property
    def positions(self) -> torch.Tensor:  # [T]
        return self._dev["positions"][: self.num_tokens]

    @property
    def slot_mapping(self) -> torch.Tensor:  # [T]
        return self._dev["slot_mapping"][: self.num_tokens]

    @property
    def block_tables(self) -> torch.Tensor:  # [S, max_pages_per_seq]
        return self._dev["block_tables"][: self.num_seqs]

    @property
    def seq_lens(self) -> torch.Tensor:  # [S]: context length including this step's tokens
        return self._dev["seq_lens"][: self.num_seqs]

    @property
    def query_starts(self) -> torch.Tensor:  # [S + 1]
        return self._dev["query_starts"][: self.num_seqs + 1]

    @property
    def logits_indices(self) -> torch.Tensor:  # [S_sample]: rows whose logits are sampled
        return self._dev["logits_indices"][: self.num_logits]

    @property
    def lora_tokens(self) -> LoraTokens:
        """The step's adapter addressing (rows -1 where a token uses the base model only)."""
        d = self._dev
        return LoraTokens(
            d["token_lora"][: self.num_tokens], d["seg_starts"], d["seg_lora"], d["lora_tiles"],
            d["lora_modules"], self.zero_tiles,
        )  # fmt: skip

    def _modules(self, seg_rows: list[int]) -> list[int]:
        """1 for each module some adapter of the step has, else 0."""
        if self._row_modules is None:
            return [1] * NUM_MODULES
        bits = 0
        for row in seg_rows:
            if row >= 0:
                bits |= self._row_modules[row]
        return [(bits >> m) & 1 for m in range(NUM_MODULES)]

    @property
    def attention_tiles(self) -> torch.Tensor:  # [K, 3]: the prefill attention kernel's tiles
        return self._dev["attn_tiles"]

    def _write_tiles(
        self,
        seg_starts: list[int],
        seg_rows: list[int],
        starts: list[int],
        entries: tuple[list[int], list[int]] | None,
        zeros: bool = False,
        apart_block: int = TILE_BLOCKS[0],
    ) -> None:
        """Each block size's tiles of the step's adapter segments and the prefill attention
        tiles of its sequences (query ``starts``), into their host tables; the rows the previous
        step wrote past them go back to empty (row -1). With ``entries`` (each entry's query
        starts and LoRA row), the smallest block's tiles cut each entry apart instead (fill's
        one_token_tiles), in tiles of at most ``apart_block`` tokens (fill's pair_tiles pass
        the segments with PAIR_BLOCK), when the launches' tile bound holds them. ``zeros``: the
        tokens without an adapter are tiles too (fill's zero_tiles)."""
        lora = self._host["lora_tiles"]
        apart = None if entries is None else block_tiles(*entries, apart_block, zeros)
        if apart is not None:
            bound = max_tiles(entries[0][-1], TILE_BLOCKS[0], self.max_segments)
            if len(apart) // FIELDS > min(bound, lora.shape[1]):
                apart = None
        self.tiles_apart = apart is not None
        tables = [(lora[b], block_tiles(seg_starts, seg_rows, block, zeros) if b or apart is None
                   else apart) for b, block in enumerate(TILE_BLOCKS)]  # fmt: skip
        tables.append((self._host["attn_tiles"], query_tiles(starts, ATTENTION_BLOCK)))
        for i, (table, flat) in enumerate(tables):
            n = len(flat) // FIELDS
            stale = self._tiles_used[i] - n
            if stale > 0:
                flat += EMPTY * stale
            if flat:
                _write(table.view(-1), flat)
            self._tiles_used[i] = n


_TYPECODES = {torch.int32: "i", torch.int64: "q"}


def _write(dst: torch.Tensor, values: list[int]) -> None:
    """A 1-D dst's first len(values) elements, or all of a 2-D dst (row-major, len(values) =
    dst.numel()), = values. Through an array.array: a third or less of torch.tensor(list)'s
    time for lists of a thousand ints and more (it converts each int on its own)."""
    src = torch.frombuffer(array.array(_TYPECODES[dst.dtype], values), dtype=dst.dtype)
    if dst.dim() == 1:
        dst[: len(values)] = src
    else:
        dst.copy_(src.view(dst.shape))


def _segments(rows: list[int]) -> tuple[list[int], list[int]]:
    starts: list[int] = []
    seg_rows: list[int] = []
    for t, r in enumerate(rows):
        if not seg_rows or r != seg_rows[-1]:
            starts.append(t)
            seg_rows.append(r)
    starts.append(len(rows))
    return starts, seg_rows
