"""Kernels behind one set of calls: Triton on CUDA tensors, the torch reference elsewhere.

lora_apply(y, x, pool_layer, index, tokens, modules, out_widths, max_rank)
lora_shrink(...), lora_expand(...)            # kernels/lora_ref.py documents the arguments
write_kv(pool_layer, k, v, slot_mapping)
paged_attention(q, pool_layer, block_tables, seq_lens, query_starts, page_size, scale)
"""

from kernels.attention_ref import paged_attention, write_kv
from kernels.lora_ref import (
    LoraIndex,
    LoraTokens,
    lora_apply,
    lora_expand,
    lora_shrink,
    make_lora_tokens,
)

__all__ = [
    "LoraIndex",
    "LoraTokens",
    "lora_apply",
    "lora_expand",
    "lora_shrink",
    "make_lora_tokens",
    "paged_attention",
    "write_kv",
]
