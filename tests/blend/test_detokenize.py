"""Incremental detokenisation (blend.decode.TextStream) on the real SmolLM2 tokenizer: the text streamed a token
at a time equals a full decode of the tokens, for random token sequences and for text with multi-byte UTF-8
characters split across tokens; a stop string spanning tokens ends the text where a full decode finds it."""
from __future__ import annotations

import random

import pytest

from blend import TextStream

pytestmark = pytest.mark.slow
SAMPLES = ["héllo wörld — 日本語のテキスト 😀🎉 ok", "naïve café, ünïcödé; 5€ ✓", "emoji 👩‍👩‍👧 family, 中文 text"]


@pytest.fixture(scope="module")
def tokenizer(smollm):
    return smollm.tokenizer


def streamed(tokenizer, ids: list[int], stop: tuple[str, ...] = ()) -> tuple[str, TextStream]:
    stream = TextStream(tokenizer, stop=stop, eos_ids=frozenset())
    text = "".join(delta for token in ids for delta in stream.push(token)) + "".join(stream.finish())
    return text, stream


def test_incremental_text_equals_a_full_decode(tokenizer):
    rng = random.Random(0)
    vocab = len(tokenizer)
    cases = [[rng.randrange(vocab) for _ in range(rng.randrange(1, 80))] for _ in range(200)]
    cases += [tokenizer.encode(text * rng.randrange(1, 4), add_special_tokens=False) for text in SAMPLES]
    split = [ids for ids in cases[-len(SAMPLES):]
             if any(tokenizer.decode(ids[:k]).endswith("\ufffd") for k in range(1, len(ids)))]
    assert split  # some character's bytes really are split across tokens
    for ids in cases:
        text, stream = streamed(tokenizer, ids)
        assert text == stream.text == tokenizer.decode(ids, skip_special_tokens=True)


def test_a_stop_string_spanning_tokens_ends_the_text_where_a_full_decode_finds_it(tokenizer):
    rng = random.Random(1)
    for sample in SAMPLES:
        ids = tokenizer.encode(sample, add_special_tokens=False)
        full = tokenizer.decode(ids)
        for _ in range(10):
            start = rng.randrange(1, len(full) - 3)
            stop = full[start:start + rng.randrange(2, 6)]
            text, stream = streamed(tokenizer, ids, stop=(stop, "never there"))
            assert text == full[:full.find(stop)] and stream.stop_sequence == stop
            assert stream.finish_reason == "stop"
            assert len(stream.tokens) < len(ids) or full.find(stop) + len(stop) > len(tokenizer.decode(ids[:-1]))
    # tokens pushed after the stop (decoded on the model thread before it heard) release nothing
    ids = tokenizer.encode("one, two, three, four", add_special_tokens=False)
    text, stream = streamed(tokenizer, ids, stop=(", t",))
    assert text == "one" and stream.push(ids[0]) == () and stream.tokens == ids[:len(stream.tokens)]
