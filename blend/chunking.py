"""Content-defined cut points over token ids: the same text gives the same cuts wherever it appears.

Every cut is decided by the ids around it alone, also in text with little entropy (records, tables, logs):
- a blank line (a paragraph: where pasted documents meet) is always a cut;
- a line break is a cut unless a preferred cut lies within `min_tokens` of it;
- winnowing: the position of the smallest hash of WINDOW ids in each run of `average` positions is a cut unless a
  preferred cut lies within `min_tokens` (preferred: a paragraph, then a line break, then the smaller hash). Every
  run of `average` positions holds one such minimum whatever the text, so no text lacks candidates;
- a stretch still longer than `max_tokens` between two cuts is divided evenly, from those two cuts.
So a cut depends on the ids within about `average + min_tokens + WINDOW` of it: after that far into a passage, it is
cut exactly as anywhere else, behind any label, number or neighbour. Linear in the length.
"""
from __future__ import annotations

from collections.abc import Sequence

import numpy as np

WINDOW = 4  # token ids hashed together (fewer: cuts track the text more closely; more: fewer spurious ties)
_MIX = np.uint64(0x9E3779B97F4A7C15)
_NONE = np.iinfo(np.uint64).max  # no candidate
PARAGRAPH, LINE, HASHED = 0, 1, 2  # a candidate's class: the lower is preferred


def _mixed(ids: np.ndarray) -> np.ndarray:
    """splitmix64 of each id: [n] uint64, well spread whatever the vocabulary."""
    with np.errstate(over="ignore"):
        x = ids.astype(np.uint64) + _MIX
        x = (x ^ (x >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
        x = (x ^ (x >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
        return x ^ (x >> np.uint64(31))


def window_hashes(array: np.ndarray) -> np.ndarray:
    """[n] uint64: a hash of ids[i-WINDOW+1 .. i] at i (the first WINDOW-1 positions: _NONE)."""
    n = len(array)
    out = np.full(n, _NONE, dtype=np.uint64)
    if n < WINDOW:
        return out
    mixed, h = _mixed(array), np.zeros(n - WINDOW + 1, dtype=np.uint64)
    with np.errstate(over="ignore"):
        for k in range(WINDOW):  # rotate each id's mix by its place in the window, so order matters
            part = mixed[k:n - WINDOW + 1 + k]
            shift = np.uint64(7 * k)
            h ^= (part << shift) | (part >> (np.uint64(64) - shift)) if k else part
    out[WINDOW - 1:] = h >> np.uint64(1)  # (never _NONE)
    return out


_POSITION = np.uint64((1 << 24) - 1)  # a rank's low bits: a position (texts of up to 16M tokens)


def _ranks(hashes: np.ndarray, classes: np.ndarray | None = None, rightmost: bool = False) -> np.ndarray:
    """[n] uint64, all distinct: the class (2 bits), then the hash, then the position (with `rightmost` the later
    position ranks first)."""
    positions = np.arange(len(hashes), dtype=np.uint64)
    ranks = ((hashes >> np.uint64(25)) << np.uint64(24)) | (_POSITION - positions if rightmost else positions)
    return ranks if classes is None else ranks | (classes.astype(np.uint64) << np.uint64(62))


def _sliding_min(a: np.ndarray, w: int) -> np.ndarray:
    """[n - w + 1]: the minimum of each run of w values (van Herk / Gil-Werman: linear whatever w)."""
    n = len(a)
    blocks = np.concatenate([a, np.full(-n % w, _NONE, dtype=a.dtype)]).reshape(-1, w)
    prefix = np.minimum.accumulate(blocks, axis=1).ravel()
    suffix = np.minimum.accumulate(blocks[:, ::-1], axis=1)[:, ::-1].ravel()
    return np.minimum(suffix[:n - w + 1], prefix[w - 1:n])


def _winnowed(hashes: np.ndarray, w: int) -> np.ndarray:
    """Positions holding the smallest hash (the rightmost of equals) of some run of w positions (sorted, unique)."""
    minima = _sliding_min(_ranks(hashes, rightmost=True), min(w, len(hashes)))
    return np.unique((_POSITION - (minima & _POSITION)).astype(np.int64))


def _among(array: np.ndarray, sorted_ids: np.ndarray | None) -> np.ndarray:
    """[n] bool: which ids are among `sorted_ids` (a binary search: cheap on the many tiny texts of a chat)."""
    if sorted_ids is None or not len(sorted_ids):
        return np.zeros(len(array), dtype=bool)
    return sorted_ids[np.minimum(np.searchsorted(sorted_ids, array), len(sorted_ids) - 1)] == array


def _lines(array: np.ndarray, breaks: np.ndarray | None, paragraphs: np.ndarray | None
           ) -> tuple[np.ndarray, np.ndarray]:
    """([n] bool: a line break, [n] bool: the end of a blank line, where a run of line breaks ends)."""
    line, blank = _among(array, breaks), _among(array, paragraphs)
    blank[1:] |= line[1:] & line[:-1]
    blank[:-1] &= ~line[1:]
    return line, blank


def cut_positions(ids: Sequence[int], *, average: int, min_tokens: int, breaks: np.ndarray | None = None,
                  paragraphs: np.ndarray | None = None) -> np.ndarray:
    """Positions i (sorted) after which `ids` is cut by content (before `max_tokens` divides long stretches).
    breaks: ids of tokens holding a line break; paragraphs: those holding a blank line (so does a line break right
    after another: the cut falls after the last of the run)."""
    array = np.asarray(ids, dtype=np.int64)
    n = len(array)
    if n == 0:
        return np.empty(0, dtype=np.int64)
    line, blank = _lines(array, breaks, paragraphs)
    last = np.arange(n) < n - 1
    if n < 2 * min_tokens:  # no room for a cut but a blank line's (the many tiny messages of a chat)
        return np.nonzero(blank & last)[0]
    hashes = window_hashes(array)
    classes = np.full(n, 3, dtype=np.int64)  # 3: not a candidate
    classes[_winnowed(hashes, average)] = HASHED
    classes[line] = LINE
    classes[blank] = PARAGRAPH
    keys = _ranks(np.where(hashes == _NONE, hashes >> np.uint64(1), hashes), classes)
    keys[classes == 3] = _NONE
    # a candidate is kept when it ranks first within min_tokens - 1 of it (so kept ones are min_tokens apart)
    reach = min_tokens - 1
    padded = np.concatenate([np.full(reach, _NONE, dtype=np.uint64), keys, np.full(reach, _NONE, dtype=np.uint64)])
    nearest = _sliding_min(padded, 2 * reach + 1)
    kept = (keys == nearest) & (keys != _NONE)
    inside = np.zeros(n, dtype=bool)  # not within min_tokens of the text's ends (a shorter span would be left)
    inside[min_tokens - 1:n - min_tokens] = True
    return np.nonzero((kept & inside) | (blank & last))[0]


def content_cuts(ids: Sequence[int], *, average: int, min_tokens: int, max_tokens: int,
                 breaks: np.ndarray | None = None, paragraphs: np.ndarray | None = None) -> list[int]:
    """Span ends (exclusive, ascending, the last is len(ids)) cutting `ids` by content. Every span holds at most
    `max_tokens` and, but where a blank line ends it, at least `min_tokens` (a shorter text is one span)."""
    if not 0 < 2 * min_tokens <= max_tokens:
        raise ValueError(f"need 0 < 2 * min_tokens <= max_tokens, got {min_tokens} and {max_tokens}")
    n = len(ids)
    if n == 0:
        return []
    ends = (cut_positions(ids, average=average, min_tokens=min_tokens, breaks=breaks, paragraphs=paragraphs)
            + 1).tolist() + [n]
    cuts, start = [], 0
    for end in ends:  # a stretch longer than max_tokens: divided evenly between its two content-defined ends
        pieces = -(-(end - start) // max_tokens)
        cuts += [start + (end - start) * k // pieces for k in range(1, pieces)] + [end]
        start = end
    return cuts


def window_cuts(n: int, window: int) -> list[int]:
    """Span ends cutting n tokens into fixed windows from the start (LMCache's rule: the last one shorter)."""
    return [min(end, n) for end in range(window, n + window, window)] if n else []
