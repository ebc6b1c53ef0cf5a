"""Content-defined cut points over token ids: the same text gives the same cuts wherever it appears.

A cut may fall after token i when a hash of the WINDOW token ids ending at i has its low bits zero (one
position in `average` on random text). Only those few ids decide, so a text's cuts do not depend on what
precedes it: after its first cut past `min_tokens`, a passage pasted behind another label, number or
neighbour is cut exactly as before. `min_tokens` keeps spans from being tiny (a paragraph of one token
repeated, 10,000 one-token lines), `max_tokens` cuts a text that never hashes low (one paragraph repeated
has the same candidates every repeat, so it is cut the same way each time). Linear in the length.
"""
from __future__ import annotations

from collections.abc import Sequence

import numpy as np

WINDOW = 4  # token ids that decide a cut (fewer: cuts track the text more closely; more: fewer spurious ones)
_MIX = np.uint64(0x9E3779B97F4A7C15)


def _mixed(ids: np.ndarray) -> np.ndarray:
    """splitmix64 of each id: [n] uint64, well spread whatever the vocabulary."""
    with np.errstate(over="ignore"):
        x = ids.astype(np.uint64) + _MIX
        x = (x ^ (x >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
        x = (x ^ (x >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
        return x ^ (x >> np.uint64(31))


def candidates(ids: Sequence[int], average: int, breaks: np.ndarray | None = None) -> np.ndarray:
    """Positions i (sorted) after which the content allows a cut: the hash of ids[i-WINDOW+1 .. i] is 0 mod
    `average` (a power of two is not needed: any modulus gives one candidate in `average` on average), or
    ids[i] is one of `breaks` (sorted token ids: a line break, so a pasted document's span ends with it)."""
    n = len(ids)
    array = np.asarray(ids, dtype=np.int64)
    at_break = np.nonzero(np.isin(array, breaks))[0] if breaks is not None and len(breaks) else None
    if n < WINDOW:
        return at_break if at_break is not None else np.empty(0, dtype=np.int64)
    mixed = _mixed(array)
    h = np.zeros(n - WINDOW + 1, dtype=np.uint64)
    with np.errstate(over="ignore"):
        for k in range(WINDOW):  # rotate each id's mix by its place in the window, so order matters
            part = mixed[k:n - WINDOW + 1 + k]
            shift = np.uint64(7 * k)
            h ^= (part << shift) | (part >> (np.uint64(64) - shift)) if k else part
    hashed = np.nonzero(h % np.uint64(average) == 0)[0] + WINDOW - 1
    return hashed if at_break is None else np.union1d(hashed, at_break)


def content_cuts(ids: Sequence[int], *, average: int, min_tokens: int, max_tokens: int,
                 breaks: np.ndarray | None = None) -> list[int]:
    """Span ends (exclusive, ascending, the last is len(ids)) cutting `ids` by content. Every span holds at
    least `min_tokens` (a shorter text is one span) and at most `max_tokens`."""
    if not 0 < 2 * min_tokens <= max_tokens:
        raise ValueError(f"need 0 < 2 * min_tokens <= max_tokens, got {min_tokens} and {max_tokens}")
    n, cuts, start = len(ids), [], 0

    def forced(end: int) -> int:  # no candidate in reach: cut at the maximum, leaving at least the minimum
        nonlocal start
        while end - start > max_tokens:
            start += max_tokens if end - start - max_tokens >= min_tokens else end - start - min_tokens
            cuts.append(start)
        return start

    for i in candidates(ids, average, breaks).tolist():
        end = i + 1
        forced(end)
        if end - start >= min_tokens and n - end >= min_tokens:
            cuts.append(end)
            start = end
    forced(n)
    return cuts + [n] if n else []


def window_cuts(n: int, window: int) -> list[int]:
    """Span ends cutting n tokens into fixed windows from the start (LMCache's rule: the last one shorter)."""
    return [min(end, n) for end in range(window, n + window, window)] if n else []
