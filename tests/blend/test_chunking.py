"""Content-defined cuts over token ids: the same text cut the same wherever it appears."""
from __future__ import annotations

import random

from blend.chunking import content_cuts, window_cuts


def spans(ids: list[int], **sizes) -> list[tuple[int, ...]]:
    out, start = [], 0
    for end in content_cuts(ids, **sizes):
        out.append(tuple(ids[start:end]))
        start = end
    return out


SIZES = dict(average=24, min_tokens=12, max_tokens=96)


def text(seed: int, n: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(50_000) for _ in range(n)]


def test_the_same_text_gives_the_same_spans_behind_any_label():
    passage = text(1, 400)
    first = spans(text(2, 7) + passage, **SIZES)
    for label in (text(3, 3), text(4, 40), []):
        again = spans(label + passage + text(5, 20), **SIZES)
        inner = set(first[1:-1])  # the first span holds the label, the last what follows
        assert sum(len(s) for s in again if s in inner) >= 0.8 * len(passage)


def test_every_span_within_the_sizes_and_the_cuts_cover_the_text():
    ids = text(6, 3000)
    cut = content_cuts(ids, **SIZES)
    lengths = [b - a for a, b in zip([0] + cut, cut)]
    assert cut[-1] == len(ids) and all(12 <= n <= 96 for n in lengths)
    assert 3000 / 48 < len(cut) < 3000 / 12


def test_a_repeated_paragraph_and_one_token_lines_stay_within_the_bounds():
    paragraph = text(7, 30)
    repeated = content_cuts(paragraph * 200, **SIZES)
    assert len(repeated) <= 6000 / 12 and all(b - a <= 96 for a, b in zip([0] + repeated, repeated))
    lines = content_cuts([13, 10] * 5000, **SIZES)  # one token, a newline, 5,000 times: no candidate differs
    assert all(12 <= b - a <= 96 for a, b in zip([0] + lines, lines))
    assert content_cuts(text(8, 5), **SIZES) == [5] and content_cuts([], **SIZES) == []


def test_windows_are_fixed_from_the_start():
    assert window_cuts(600, 256) == [256, 512, 600] and window_cuts(0, 256) == []
