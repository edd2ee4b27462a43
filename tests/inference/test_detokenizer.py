"""Incremental detokenization and stop strings against the real tiny tokenizer."""

from __future__ import annotations

import random
from collections.abc import Iterable

import pytest

from services.inference.engine.detokenizer import (
    REPLACEMENT_CHAR,
    IncrementalDetokenizer,
    StopMatch,
    StopStringMatcher,
)
from services.inference.tokenizer import Tokenizer
from tests.inference.models import TinyModels

MULTIBYTE = "東京の朝 🙂🚀 naïve Ångström 👍🏽 서울 ❤️ Привет 今天天气很好 €£¥"


class CountingTokenizer(Tokenizer):
    """Counts the ids decoded, to check the per-token cost stays bounded."""

    decoded = 0

    def decode(self, ids: Iterable[int], skip_special_tokens: bool = True) -> str:
        ids = list(ids)
        self.decoded += len(ids)
        return super().decode(ids, skip_special_tokens)


@pytest.fixture(scope="module")
def tok(tiny_models: TinyModels) -> CountingTokenizer:
    base = Tokenizer.from_model_dir(tiny_models.model("tiny-llama"))
    return CountingTokenizer(
        base.inner,
        bos_token_id=base.bos_token_id,
        eos_token_ids=base.eos_token_ids,
        add_bos_token=True,
    )


def _stream(tok: Tokenizer, prompt: list[int], ids: list[int]) -> list[str]:
    detok = IncrementalDetokenizer(tok, prompt)
    deltas = [detok.add(i) for i in ids]
    deltas.append(detok.flush())
    return deltas


def test_random_streams_equal_full_decode(tok: CountingTokenizer):
    rng = random.Random(0)
    prompts = [[], tok.encode("Hi"), tok.encode("The harbour was quiet before dawn."), [0]]
    for trial in range(200):
        ids = [rng.randrange(tok.vocab_size) for _ in range(rng.randrange(1, 40))]
        deltas = _stream(tok, prompts[trial % len(prompts)], ids)
        assert "".join(deltas) == tok.decode(ids), ids


def test_multibyte_characters_split_across_tokens_are_held_back(tok: CountingTokenizer):
    ids = tok.encode(MULTIBYTE)[1:]
    pieces = [tok.decode([i]) for i in ids]
    assert sum(REPLACEMENT_CHAR in p for p in pieces) >= 10  # many tokens end mid-character
    deltas = _stream(tok, tok.encode("Text: "), ids)
    assert "".join(deltas) == MULTIBYTE
    assert not any(REPLACEMENT_CHAR in d for d in deltas)  # never a broken character
    assert deltas.count("") >= 10  # held back while a character was open


def test_prompt_ending_mid_character_is_not_used_as_context(tok: CountingTokenizer):
    ids = tok.encode("🙂🙂🙂")
    split = next(k for k in range(2, len(ids)) if tok.decode(ids[:k]).endswith(REPLACEMENT_CHAR))
    gen = ids[split:] + tok.encode(" done")[1:]
    assert "".join(_stream(tok, ids[:split], gen)) == tok.decode(gen)


def test_special_tokens_are_skipped(tok: CountingTokenizer):
    eos = next(iter(tok.eos_token_ids))
    ids = tok.encode("abc")[1:] + [eos] + tok.encode("東")[1:] + [eos]
    assert "".join(_stream(tok, [], ids)) == "abc東"


def test_cost_per_token_is_bounded(tok: CountingTokenizer):
    ids = (tok.encode(MULTIBYTE + " and some plain English text follows here. ")[1:]) * 40
    tok.decoded = 0
    _stream(tok, tok.encode("prompt"), ids)
    # A whole-sequence decode per token would touch ~len(ids)/2 ids per token on average.
    assert tok.decoded / len(ids) < 20, tok.decoded / len(ids)


def test_stop_string_across_deltas():
    m = StopStringMatcher(["END"])
    assert m.add("Hel") == StopMatch("Hel", False)
    assert m.add("lo E") == StopMatch("lo ", False)  # "E" could start END: held
    assert m.add("N") == StopMatch("", False)
    assert m.add("D and more") == StopMatch("", True)
    with pytest.raises(RuntimeError, match="after a stop string matched"):
        m.add("x")


def test_held_tail_released_when_it_is_not_a_stop():
    m = StopStringMatcher(["END", "\n\n"])
    assert m.add("THE EN") == StopMatch("THE ", False)
    assert m.add("Ds\n") == StopMatch("", True)
    m = StopStringMatcher(["END", "\n\n"])
    assert m.add("EN") == StopMatch("", False)
    assert m.add("TRY\n") == StopMatch("ENTRY", False)
    assert m.flush() == "\n"  # at the end, a held tail is ordinary text
    assert StopStringMatcher([]).add("any text") == StopMatch("any text", False)


def test_first_completed_stop_wins():
    m = StopStringMatcher(["abcd", "bc", "zz"])
    assert m.add("xab") == StopMatch("x", False)  # "ab" could begin "abcd"
    assert m.add("ce") == StopMatch("a", True)  # not "abcd" after all, but "bc"
    m = StopStringMatcher(["bc", "abcd"])
    m.add("xab")
    assert m.add("cd") == StopMatch("a", True)  # "bc" completes before "abcd" would
    m = StopStringMatcher(["c", "abc"])
    assert m.add("xabcd") == StopMatch("x", True)  # both end at "c": the longer one


@pytest.mark.parametrize("seed", range(5))
def test_stop_matcher_random(seed: int):
    rng = random.Random(seed)
    for _ in range(300):
        text = "".join(rng.choice("ab東c") for _ in range(rng.randrange(0, 30)))
        stops = ["".join(rng.choice("ab東c") for _ in range(rng.randrange(1, 5))) for _ in range(2)]
        cuts = sorted(rng.sample(range(len(text) + 1), k=min(len(text) + 1, rng.randrange(1, 8))))
        deltas = [text[a:b] for a, b in zip([0, *cuts], [*cuts, len(text)], strict=True)]
        m = StopStringMatcher(stops)
        out, stopped = "", False
        for d in deltas:
            emit, stopped = m.add(d)
            assert not any(s in out + emit for s in stops)
            out += emit
            if stopped:
                break
        # Oracle, one character at a time: the first stop to complete; on the same end, the
        # longest of those completing there.
        expected = None
        for end in range(1, len(text) + 1):
            done = [s for s in stops if text[:end].endswith(s)]
            if done:
                expected = text[: end - max(map(len, done))]
                break
        if expected is None:
            assert not stopped and out + m.flush() == text
        else:
            assert stopped and out == expected


def test_stop_string_spanning_token_boundaries(tok: CountingTokenizer):
    text = "The harbour was quiet before dawn. Fishing boats rocked"
    ids = tok.encode(text)[1:]
    stop = "before da"
    detok, m = IncrementalDetokenizer(tok, []), StopStringMatcher([stop])
    out = ""
    for i in ids:
        emit, stopped = m.add(detok.add(i))
        out += emit
        if stopped:
            break
    assert stopped and out == "The harbour was quiet "
    pieces = [tok.decode([i]) for i in ids]
    assert stop not in pieces  # the stop string spans more than one token


def test_bad_stops():
    with pytest.raises(ValueError, match="not one string"):
        StopStringMatcher("END")
    with pytest.raises(ValueError, match="non-empty"):
        StopStringMatcher(["ok", ""])


@pytest.mark.parametrize("seed", range(3))
def test_stop_matcher_holds_exactly_the_tail_that_could_begin_a_stop(seed: int):
    """After each delta without a match, everything is emitted but the longest tail that is a
    proper prefix of some stop string; many stops, self-overlapping ones included."""
    rng = random.Random(100 + seed)
    for _ in range(200):
        stops = ["".join(rng.choice("aab") for _ in range(rng.randrange(1, 7))) for _ in range(5)]
        m, fed, out = StopStringMatcher(stops), "", ""
        while not m.stopped and len(fed) < 60:
            delta = "".join(rng.choice("aabc") for _ in range(rng.randrange(0, 5)))
            emit, stopped = m.add(delta)
            fed, out = fed + delta, out + emit
            if stopped:
                break
            hold = max(
                (k for s in stops for k in range(1, len(s)) if fed.endswith(s[:k])), default=0
            )
            assert out == fed[: len(fed) - hold], (stops, fed, out)


def test_stop_strings_cost_memory_and_time_linear_in_their_length():
    """One 40,000-character stop string that keeps almost matching: the matcher's memory stays
    a few bytes per character of it (every prefix of it, kept as a string, is 800 MB), and
    streaming 40,000 characters through it costs milliseconds per thousand."""
    import time
    import tracemalloc

    stop = "ab" * 20_000
    text = "ab" * 19_999 + "ax"
    tracemalloc.start()
    try:
        start = time.perf_counter()
        m = StopStringMatcher([stop])
        out = "".join(m.add(text[i : i + 7]).emit for i in range(0, len(text), 7))
        elapsed = time.perf_counter() - start
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert not m.stopped and out + m.flush() == text
    assert peak < 4 * 2**20, peak
    assert elapsed < 2.0, elapsed
