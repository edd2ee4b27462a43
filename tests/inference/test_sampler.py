"""SamplingParams validation and the Sampler: filters, distributions, seeded reproducibility."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from services.inference.engine.sampler import Sampler, make_generator
from services.inference.engine.sampling_params import SamplingParams

VOCAB = 40
DRAWS = 4000


def _logits(seed: int, rows: int = 1, vocab: int = VOCAB) -> torch.Tensor:
    return torch.randn((rows, vocab), generator=torch.Generator().manual_seed(seed)) * 2.0


def _draw(logits_row: torch.Tensor, params: SamplingParams, n: int = DRAWS) -> torch.Tensor:
    """n independent samples of one row: n rows in one batch, each with its own seed."""
    ps = [dataclasses.replace(params, seed=s) for s in range(n)]
    gens = [make_generator(p, "cpu") for p in ps]
    return Sampler()(logits_row.expand(n, -1).contiguous(), ps, gens)


def _freq(tokens: torch.Tensor) -> torch.Tensor:
    return torch.bincount(tokens, minlength=VOCAB).float() / len(tokens)


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("max_new_tokens", 0),
        ("max_new_tokens", 2.0),
        ("temperature", -0.1),
        ("temperature", float("nan")),
        ("temperature", float("inf")),
        ("top_p", 0.0),
        ("top_p", 1.5),
        ("top_k", -1),
        ("top_k", True),
        ("seed", -1),
        ("seed", 2**64),
        ("stop", "eos"),
        ("stop", ("",)),
        ("stop_token_ids", (3, -2)),
        ("ignore_eos", 1),
    ],
)
def test_params_reject_bad_values_naming_the_field(field: str, value: object):
    with pytest.raises(ValueError, match=field):
        SamplingParams(**{field: value})


def test_params_normalize_sequences():
    p = SamplingParams(stop=["\n\n", "END"], stop_token_ids=[5], temperature=1, top_p=1)
    assert p.stop == ("\n\n", "END") and p.stop_token_ids == (5,)
    assert isinstance(p.temperature, float) and not p.greedy
    assert hash(p) == hash(
        SamplingParams(stop=("\n\n", "END"), stop_token_ids=(5,), temperature=1.0)
    )
    assert SamplingParams().greedy


def test_make_generator():
    assert make_generator(SamplingParams(), "cpu") is None
    seeded = SamplingParams(temperature=1.0, seed=123)
    a, b = make_generator(seeded, "cpu"), make_generator(seeded, "cpu")
    assert torch.equal(torch.rand(8, generator=a), torch.rand(8, generator=b))
    unseeded = SamplingParams(temperature=1.0)
    c, d = make_generator(unseeded, "cpu"), make_generator(unseeded, "cpu")
    assert not torch.equal(torch.rand(8, generator=c), torch.rand(8, generator=d))


def test_greedy_is_argmax_and_tiny_temperature_matches_it():
    logits = _logits(0, rows=64)
    greedy = [SamplingParams()] * 64
    assert torch.equal(Sampler()(logits, greedy, [None] * 64), logits.argmax(-1))
    cold = [SamplingParams(temperature=1e-4, seed=i) for i in range(64)]
    gens = [make_generator(p, "cpu") for p in cold]
    assert torch.equal(Sampler()(logits, cold, gens), logits.argmax(-1))


def test_temperature_distribution_matches_softmax():
    row = _logits(1)[0]
    for temperature in (0.7, 1.5):
        freq = _freq(_draw(row, SamplingParams(temperature=temperature)))
        expected = torch.softmax(row / temperature, -1)
        # 4000 draws: the standard error of a frequency is at most 0.008.
        assert (freq - expected).abs().max() < 0.03, temperature


def test_top_k_stays_in_the_k_best():
    row = _logits(2)[0]
    tokens = _draw(row, SamplingParams(temperature=1.5, top_k=5))
    best = set(row.topk(5).indices.tolist())
    assert set(tokens.tolist()) == best  # never outside, and every one of them drawn
    expected = torch.zeros(VOCAB)
    expected[list(best)] = torch.softmax(row[list(best)] / 1.5, -1)
    assert (_freq(tokens) - expected).abs().max() < 0.03


def test_top_p_stays_in_the_nucleus():
    row = _logits(3)[0]
    probs = torch.softmax(row, -1)
    order = probs.argsort(descending=True)
    mass = probs[order].cumsum(0)
    for top_p in (0.3, 0.75, 0.9):
        size = int((mass < top_p).sum()) + 1  # smallest prefix whose mass reaches top_p
        nucleus = set(order[:size].tolist())
        tokens = _draw(row, SamplingParams(temperature=1.0, top_p=top_p))
        assert set(tokens.tolist()) == nucleus, top_p
    # top_k and top_p together: the smaller of the two sets.
    tokens = _draw(row, SamplingParams(temperature=1.0, top_p=0.9, top_k=2))
    assert set(tokens.tolist()) == set(order[:2].tolist())


def test_tiny_top_p_is_greedy():
    row = _logits(4)[0]
    tokens = _draw(row, SamplingParams(temperature=2.0, top_p=1e-6), n=50)
    assert set(tokens.tolist()) == {int(row.argmax())}


def test_seed_reproducible_whatever_the_batch():
    """The same seeded request in different rows of different batches draws the same tokens."""
    target = SamplingParams(temperature=1.0, top_p=0.95, top_k=20, seed=77)
    others = [
        SamplingParams(),
        SamplingParams(temperature=0.8, seed=1),
        SamplingParams(temperature=1.3, top_k=3),
        SamplingParams(temperature=0.5, top_p=0.5, seed=9),
        SamplingParams(),
    ]
    layouts = [([], []), (others[:2], others[2:]), (others, []), ([others[0]], others[1:4])]
    runs = []
    for run, (before, after) in enumerate(layouts):
        params = [*before, target, *after]
        gens = [make_generator(p, "cpu") for p in params]
        row = len(before)
        tokens = []
        for step in range(30):
            logits = _logits(1000 * run + step, rows=len(params))
            logits[row] = _logits(step)[0]  # the target's logits depend on the step only
            tokens.append(int(Sampler()(logits, params, gens)[row]))
        runs.append(tokens)
    assert all(r == runs[0] for r in runs)
    assert len(set(runs[0])) > 3  # it really samples


def test_bad_calls():
    sampler = Sampler()
    with pytest.raises(ValueError, match="batch, vocab"):
        sampler(torch.zeros(VOCAB), [SamplingParams()], [None])
    with pytest.raises(ValueError, match="2 logit rows but 1 params"):
        sampler(torch.zeros(2, VOCAB), [SamplingParams()], [None, None])
    with pytest.raises(ValueError, match="row 0 samples"):
        sampler(torch.zeros(1, VOCAB), [SamplingParams(temperature=1.0)], [None])
