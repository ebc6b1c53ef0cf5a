"""Content-defined cuts over token ids: the same text cut the same wherever it appears, also text with little
entropy, and a blank line always a cut."""
from __future__ import annotations

import random

import numpy as np
import pytest

from blend.chunking import WINDOW, content_cuts, window_cuts

SIZES = dict(average=24, min_tokens=12, max_tokens=96)
LINE, BLANK = 10, 11  # a token holding a line break, one holding a blank line
BREAKS = dict(breaks=np.array([LINE, BLANK]), paragraphs=np.array([BLANK]))
RESYNC = SIZES["average"] + SIZES["min_tokens"] + WINDOW  # how far into a text its cuts may differ


def spans(ids: list[int], **sizes) -> list[tuple[int, ...]]:
    out, start = [], 0
    for end in content_cuts(ids, **sizes):
        out.append(tuple(ids[start:end]))
        start = end
    return out


def text(seed: int, n: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(100, 50_000) for _ in range(n)]


def records(seed: int, n: int) -> list[int]:
    """Text with little entropy: one record template (fixed ids) over and over, a few values in it, a line each."""
    rng = random.Random(seed)
    out: list[int] = []
    while len(out) < n:
        out += [501, 502, rng.randrange(600, 610), 503, 504, 505, rng.randrange(600, 603), 506, 507, 508, 509,
                rng.randrange(600, 640), 510, LINE]
    return out[:n]


def one_line(seed: int, n: int) -> list[int]:
    """The same with no line break at all (a JSON tool result on one line)."""
    return [t for t in records(seed, n * 2) if t != LINE][:n]


def cuts_in(ids: list[int], offset: int, length: int, **options) -> set[int]:
    """The cuts that fall inside [offset + RESYNC, offset + length - RESYNC), relative to offset."""
    return {c - offset for c in content_cuts(ids, **SIZES, **options)
            if offset + RESYNC <= c < offset + length - RESYNC}


@pytest.mark.parametrize("make", [text, records, one_line])
def test_a_cut_depends_only_on_the_text_around_it(make):
    passage = make(1, 600)
    alone = cuts_in(passage, 0, len(passage), **BREAKS)
    assert len(alone) >= 600 // SIZES["max_tokens"]
    for before, after in ((text(3, 3), text(4, 5)), (text(5, 40), []), (records(6, 77), text(7, 200)),
                          (one_line(8, 13), records(9, 30))):
        moved = cuts_in(before + passage + after, len(before), len(passage), **BREAKS)
        assert moved == alone


@pytest.mark.parametrize("make", [text, records, one_line])
def test_the_same_text_gives_the_same_spans_behind_any_label(make):
    passage = make(1, 400)
    first = spans(text(2, 7) + passage, **SIZES, **BREAKS)
    inner = set(first[1:-1])  # the first span holds the label, the last what follows
    for label in (text(3, 3), text(4, 40), []):
        again = spans(label + passage + text(5, 20), **SIZES, **BREAKS)
        assert sum(len(s) for s in again if s in inner) >= 0.8 * len(passage)


def test_a_blank_line_is_always_a_cut():
    rng = random.Random(11)
    for _ in range(200):
        documents = [make(rng.randrange(1000), rng.randrange(1, 150)) for make in rng.choices([text, records], k=6)]
        ids, ends = [], []
        for doc in documents:
            ids += doc + [BLANK]  # (a line break right after another is a blank line too)
            ends.append(len(ids))
        ids += text(12, 30)
        cut = content_cuts(ids, **SIZES, **BREAKS)
        assert set(ends) <= set(cut)
        lengths = [b - a for a, b in zip([0] + cut, cut)]
        assert max(lengths) <= 96
        short = [b for a, b in zip([0] + cut, cut) if b - a < 12]
        assert set(short) <= set(ends) | {len(ids)}  # shorter than the minimum only where a blank line ends it
    assert content_cuts([5, 6, LINE, LINE, 7, 8], **SIZES, **BREAKS) == [4, 6]  # after the run of line breaks


def test_every_span_within_the_sizes_and_the_cuts_cover_the_text():
    for ids in (text(6, 3000), records(6, 3000), one_line(6, 3000)):
        cut = content_cuts(ids, **SIZES, **BREAKS)
        lengths = [b - a for a, b in zip([0] + cut, cut)]
        assert cut[-1] == len(ids) and all(12 <= n <= 96 for n in lengths)
        assert 3000 / 48 < len(cut) < 3000 / 12


def test_a_repeated_paragraph_and_one_token_lines_stay_within_the_bounds():
    paragraph = text(7, 30)
    repeated = content_cuts(paragraph * 200, **SIZES)
    assert len(repeated) <= 6000 / 12 and all(12 <= b - a <= 96 for a, b in zip([0] + repeated, repeated))
    lines = content_cuts([13, LINE] * 5000, **SIZES, **BREAKS)  # one token, a newline, 5,000 times
    assert all(12 <= b - a <= 96 for a, b in zip([0] + lines, lines))
    assert content_cuts(text(8, 5), **SIZES) == [5] and content_cuts([], **SIZES) == []
    with pytest.raises(ValueError):
        content_cuts(text(8, 50), average=16, min_tokens=40, max_tokens=64)


def test_windows_are_fixed_from_the_start():
    assert window_cuts(600, 256) == [256, 512, 600] and window_cuts(0, 256) == []
