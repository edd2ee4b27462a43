"""bench/mixed_split.py's premise: a mixed step's decode tokens and prompts share nothing but the
weights, so two passes over them give the logits of one pass (the model's CPU path)."""

from __future__ import annotations

import random

import torch

from bench import mixed_split
from bench.bench_models import Shape
from services.inference.engine.batch import StepBatch


def test_two_passes_give_the_one_pass_logits():
    cfg = mixed_split.model_config(
        Shape(hidden=64, layers=2, heads=4, kv_heads=2, intermediate=96, vocab=128)
    )
    torch.manual_seed(0)
    model = mixed_split.build_model(cfg, torch.device("cpu")).float()
    model.init_rope(torch.device("cpu"))
    pages = 64
    pool = torch.randn(cfg.num_layers, 2, pages * mixed_split.PAGE, cfg.kv_dim)
    rng = random.Random(0)
    free = list(range(pages))
    rng.shuffle(free)
    dec, pre = mixed_split.entries_for((3, 40), [(0, 21), (16, 9)], rng, free)
    for e in dec + pre:
        e.token_ids[:] = [t % cfg.vocab_size for t in e.token_ids]

    def logits(entries):
        tokens = sum(len(e.token_ids) for e in entries)
        batch = StepBatch(tokens, len(entries), 8, 2, mixed_split.PAGE, torch.device("cpu"))
        batch.fill(entries)
        with torch.inference_mode():
            return model(batch, pool.clone(), None)

    one = logits(dec + pre)  # [5, vocab]: the decode rows, then the prompts' last tokens
    two = torch.cat([logits(dec), logits(pre)])
    assert one.shape == (5, cfg.vocab_size)
    torch.testing.assert_close(two, one, rtol=1e-5, atol=1e-5)
    # and the passes are not trivially equal: each sequence's logits differ
    assert not torch.allclose(one[0], one[1])
