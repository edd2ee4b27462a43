"""bench/lora_in_gemm.py's premise: one GEMM over the input and weight extended with the prompt
adapters' columns computes the base projection plus the prompt tokens' LoRA, as the reference
LoRA does, and leaves the other tokens' rows the base projection's."""

import torch

from bench import kernels as kb
from bench import lora_in_gemm
from bench.lora_addend import case_entries


def test_prompt_chunks_are_the_prompt_entries():
    gen = torch.Generator().manual_seed(3)
    rows, starts = case_entries(decode=4, n=6, prefill=(5, 3), base=2, gen=gen)
    chunks = lora_in_gemm.prompt_chunks(rows, starts)
    assert sorted(end - first for _, first, end in chunks) == [3, 5]
    for adapter, first, end in chunks:
        assert first >= 2  # the base-model tokens come first and have no adapter
        assert (rows[first:end] == adapter).all()


def test_extended_gemm_matches_the_reference(monkeypatch):
    monkeypatch.setattr(kb, "DEV", torch.device("cpu"))
    monkeypatch.setattr(kb, "DT", torch.float32)
    for pad in (16, 64):
        results = lora_in_gemm.reference_errors(pad)
        assert [m for m, _, _ in results] == [(0, 1, 2), (3,)]
        for modules, err, delta in results:
            assert delta > 1e-2, modules  # the prompts' LoRA changes the output
            assert err <= 1e-4, (modules, err)


def test_mask_keeps_each_token_to_its_own_columns(monkeypatch):
    monkeypatch.setattr(kb, "DEV", torch.device("cpu"))
    monkeypatch.setattr(kb, "DT", torch.float32)
    gen = torch.Generator().manual_seed(5)
    rows, starts = case_entries(decode=3, n=4, prefill=(4, 6), base=1, gen=gen)
    case = kb.build_lora(4, (8,), 1, rows)
    chunks = lora_in_gemm.prompt_chunks(rows, starts)
    qkv = lora_in_gemm.QKV
    ops = lora_in_gemm.operands(case.pool[0], case.index, chunks, *qkv, kb.H, rows.numel(), 64)
    assert (ops.used, ops.kx) == (2 * 3 * 8, 64)
    prompt = torch.zeros(rows.numel(), dtype=torch.bool)
    for j, (_, first, end) in enumerate(chunks):
        prompt[first:end] = True
        block = ops.mask[first:end]
        assert (block[:, j * 24 : (j + 1) * 24] == 1).all()
        assert block.sum() == (end - first) * 24  # nothing in another chunk's columns
    assert (ops.mask[~prompt] == 0).all()  # decode and base-model tokens: no extra columns
