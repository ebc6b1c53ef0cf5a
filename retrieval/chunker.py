"""Split a document into chunks measured in LLM tokens, cut at the coarsest natural boundary.

Contract (tested):
- `chunk.text == document[chunk.start:chunk.end]`, and it has no leading or trailing whitespace;
- only whitespace, or text the tokenizer drops entirely (control characters), lies before the
  first chunk, between chunks and after the last one, so the chunks in order cover every
  character the model would see exactly once;
- `chunk.token_ids == tokenizer(chunk.text, add_special_tokens=False, split_special_tokens=True)["input_ids"]`:
  a document is text, so a control token's string in it (`<|im_start|>`) is read as text, never as the token
  (a document cannot forge a turn in the prompts that retrieve it); each chunk is tokenized on its own (never a
  slice of the document's tokens), so the ids are what the model sees when the chunk is rendered alone, and no
  token straddles two chunks;
- `1 <= chunk.n_tokens <= max_tokens`; chunks aim at `target_tokens`, and a chunk under
  `min_tokens` is merged into a neighbour whenever the merge fits in `max_tokens`.

Cuts prefer paragraph breaks, then line breaks, then sentence ends, then spaces; a run of text
with no space at all (a URL, a hash) is cut between characters as a last resort.
"""
from __future__ import annotations

import bisect
import hashlib
import re
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from retrieval.settings import ChunkingSettings

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

# Boundary strengths, strongest first; each level's separator regex.
PARAGRAPH, LINE, SENTENCE, WORD, CHAR = 4, 3, 2, 1, 0
_SEPARATORS = [
    (PARAGRAPH, re.compile(r"\n[ \t\r\f\v]*\n\s*")),
    (LINE, re.compile(r"\n\s*")),
    (SENTENCE, re.compile(r"(?<=[.!?])\s+|(?<=[.!?][\"')\]])\s+")),
    (WORD, re.compile(r"\s+")),
]


def sha256_text(text: str) -> str:
    return hashlib.sha256(text.encode("utf-8")).hexdigest()


@dataclass
class Chunk:
    """A piece of a document: what the chunker makes, the metadata stores and a search returns."""

    doc_id: str
    ordinal: int
    text: str
    token_ids: list[int]  # the text tokenized alone (no special tokens)
    start: int  # character offsets in the document: text == document[start:end]
    end: int
    id: int | None = None  # set once stored: the index's vector id
    kv_key: str | None = None  # set once stored: its KV entry, for cleaning up on replace and delete
    content_hash: str = field(init=False)  # sha256 of text

    def __post_init__(self) -> None:
        self.content_hash = sha256_text(self.text)

    @property
    def n_tokens(self) -> int:
        return len(self.token_ids)


@dataclass
class _Piece:
    start: int
    end: int
    n_tokens: int
    strength: int  # of the boundary before this piece


class Chunker:
    def __init__(self, tokenizer: PreTrainedTokenizerBase, settings: ChunkingSettings | None = None) -> None:
        settings = settings or ChunkingSettings()
        self.tokenizer = tokenizer
        self.max_tokens = settings.max_tokens
        self.target_tokens = min(settings.target_tokens, settings.max_tokens)
        self.min_tokens = min(settings.min_tokens, self.target_tokens)

    def encode(self, text: str) -> list[int]:
        return self.tokenizer(text, add_special_tokens=False, split_special_tokens=True)["input_ids"]

    def chunk(self, doc_id: str, text: str) -> list[Chunk]:
        """The chunks of `text` in order; [] when it holds only whitespace."""
        start, end = _strip(text, 0, len(text))
        if start == end:
            return []
        pieces = self._split(text, start, end, PARAGRAPH, 0)
        groups = self._merge_small(text, self._pack(text, pieces))
        chunks: list[Chunk] = []
        for first, last in groups:
            body = text[first.start:last.end]
            ids = self.encode(body)
            if ids:  # text the tokenizer drops entirely (e.g. control characters) gives the model nothing
                chunks.append(Chunk(doc_id, len(chunks), body, ids, first.start, last.end))
        return chunks

    # 1. Pieces: spans of at most target_tokens, split recursively at ever finer boundaries.
    def _split(self, text: str, start: int, end: int, strength: int, before: int) -> list[_Piece]:
        n = len(self.encode(text[start:end]))
        if n <= self.target_tokens:
            return [_Piece(start, end, n, before)]
        for level, separator in _SEPARATORS:
            if level > strength:
                continue
            spans = _split_at(separator, text, start, end)
            if len(spans) > 1:
                pieces = []
                for i, (a, b) in enumerate(spans):
                    pieces += self._split(text, a, b, level - 1, before if i == 0 else level)
                return pieces
        return self._hard_split(text, start, end, before)

    def _hard_split(self, text: str, start: int, end: int, before: int) -> list[_Piece]:
        """Cut a space-free run between characters, each part at most target_tokens.

        The run is tokenized once and cut after every target_tokens tokens; each part is then
        re-tokenized alone (BPE may read a part's edges differently) and shortened by a character
        at a time in the rare case that it grew past the target. Linear in the run's length.
        """
        offsets = self.tokenizer(text[start:end], add_special_tokens=False, split_special_tokens=True,
                                 return_offsets_mapping=True)["offset_mapping"]
        token_ends = [start + e for _, e in offsets]  # non-decreasing character ends
        pieces: list[_Piece] = []
        first = start
        while first < end:
            done = bisect.bisect_right(token_ends, first)  # tokens wholly before `first`
            cut = end if done + self.target_tokens >= len(token_ends) else \
                max(first + 1, token_ends[done + self.target_tokens - 1])
            n = len(self.encode(text[first:cut]))
            while n > self.target_tokens and cut - first > 1:
                cut -= 1
                n = len(self.encode(text[first:cut]))
            pieces.append(_Piece(first, cut, n, before if not pieces else CHAR))
            first = cut
        return pieces

    # 2. Packing: fill chunks up to target_tokens, cutting at the strongest boundary that still
    #    leaves the chunk at least half full.
    def _pack(self, text: str, pieces: list[_Piece]) -> list[tuple[_Piece, _Piece]]:
        groups: list[tuple[_Piece, _Piece]] = []
        current: list[_Piece] = []
        for piece in pieces:
            while current and _estimate(current + [piece]) > self.target_tokens:
                cut = self._best_cut(current)
                groups += self._emit(text, current[:cut])
                current = current[cut:]
            current.append(piece)
        if current:
            groups += self._emit(text, current)
        return groups

    def _best_cut(self, current: list[_Piece]) -> int:
        """Index in `current` to cut before: the strongest boundary past half the target, else the end."""
        best, best_strength, filled = len(current), -1, current[0].n_tokens
        for i in range(1, len(current)):
            if filled >= self.target_tokens // 2 and current[i].strength >= best_strength:
                best, best_strength = i, current[i].strength
            filled += current[i].n_tokens + _JOIN_COST.get(current[i].strength, 0)
        return best

    def _emit(self, text: str, group: list[_Piece]) -> list[tuple[_Piece, _Piece]]:
        """The group as one chunk, or split where the token estimate was too low for max_tokens."""
        if len(group) == 1 or self._fits(text, group[0], group[-1]):
            return [(group[0], group[-1])]
        half = len(group) // 2
        return self._emit(text, group[:half]) + self._emit(text, group[half:])

    # 3. Tiny chunks: merge each into its previous (else next) neighbour when that fits.
    def _merge_small(self, text: str, groups: list[tuple[_Piece, _Piece]]) -> list[tuple[_Piece, _Piece]]:
        i = 0
        while i < len(groups) and len(groups) > 1:
            first, last = groups[i]
            if len(self.encode(text[first.start:last.end])) < self.min_tokens:
                if i > 0 and self._fits(text, groups[i - 1][0], last):
                    groups[i - 1:i + 1] = [(groups[i - 1][0], last)]
                    continue
                if i + 1 < len(groups) and self._fits(text, first, groups[i + 1][1]):
                    groups[i:i + 2] = [(first, groups[i + 1][1])]
                    continue
            i += 1
        return groups

    def _fits(self, text: str, first: _Piece, last: _Piece) -> bool:
        return len(self.encode(text[first.start:last.end])) <= self.max_tokens


# Tokens that joining two pieces adds: the newlines (a space merges into the next word's token).
_JOIN_COST = {PARAGRAPH: 2, LINE: 1}


def _estimate(pieces: list[_Piece]) -> int:
    return pieces[0].n_tokens + sum(p.n_tokens + _JOIN_COST.get(p.strength, 0) for p in pieces[1:])


def _strip(text: str, start: int, end: int) -> tuple[int, int]:
    while start < end and text[start].isspace():
        start += 1
    while end > start and text[end - 1].isspace():
        end -= 1
    return start, end


def _split_at(separator: re.Pattern[str], text: str, start: int, end: int) -> list[tuple[int, int]]:
    """Non-empty stripped spans of text[start:end] between matches of `separator`."""
    spans, position = [], start
    for match in separator.finditer(text, start, end):
        spans.append(_strip(text, position, match.start()))
        position = match.end()
    spans.append(_strip(text, position, end))
    return [(a, b) for a, b in spans if a < b]
