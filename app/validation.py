"""The rules for text from outside — JSON bodies, multipart forms, chat content parts, ingested files —
in one place. The API's schemas (app/api/schemas/ragblend.py) and ingest (app/engine/ingest.py) both apply them, so a
document id or title is checked the same way whichever door it came in by.
"""
from __future__ import annotations

import re
import unicodedata

MAX_ID_CHARS = 256
MAX_TITLE_CHARS = 1024
# Control characters, and the bidirectional controls (embeddings, overrides, isolates, marks) that make an id or
# title read otherwise than it is ("evil\u202etxt.exe")
_CONTROLS = r"\x00-\x1f\x7f\u061c\u200e\u200f\u202a-\u202e\u2066-\u2069"


def _format_chars() -> str:
    """Unicode's format characters (category Cf: U+00AD, U+200B, U+2060, U+FEFF, the tag characters, ...) and the
    private-use planes, as a regex character class body: characters that show nothing, or nothing agreed."""
    blocks = [(0, 0x3000), (0xFE00, 0x10000), (0x11000, 0x14000), (0x1BC00, 0x1BD00), (0x1D100, 0x1D200),
              (0xE0000, 0xE0080)]  # every Cf character of Unicode 15 lies here
    cf = [c for a, b in blocks for c in range(a, b) if unicodedata.category(chr(c)) == "Cf"]
    runs: list[tuple[int, int]] = []
    for c in cf:
        runs[-1:] = [(runs[-1][0], c)] if runs and runs[-1][1] == c - 1 else [*runs[-1:], (c, c)]
    runs += [(0xE000, 0xF8FF), (0xF0000, 0xFFFFD), (0x100000, 0x10FFFD)]  # private use (Co)
    return "".join(chr(a) if a == b else f"{chr(a)}-{chr(b)}" for a, b in runs)


_INVISIBLE = _format_chars()
NO_CONTROL_CHARS = rf"^[^{_CONTROLS}]*$"  # also the OpenAPI `pattern` of titles
# ... and of ids: one line, not blank, no control, format (invisible) or private-use characters
ONE_LINE_NOT_BLANK = rf"^[^{_CONTROLS}{_INVISIBLE}]*[^\s{_CONTROLS}{_INVISIBLE}][^{_CONTROLS}{_INVISIBLE}]*$"
NOT_BLANK = r"\S"  # ... and of questions and texts
_CONTROL = re.compile(rf"[{_CONTROLS}]")
PATTERN_RULES = {  # each pattern's rule in words (a 422's message)
    NO_CONTROL_CHARS: "must be one line with no control characters (newlines, NUL, escapes, bidirectional controls)",
    ONE_LINE_NOT_BLANK: "must be one line, not blank, with no control, invisible (format) or private-use characters",
    NOT_BLANK: "must not be empty or whitespace"}
_INVISIBLE_CHAR = re.compile(f"[{_INVISIBLE}]")


def valid_unicode(value: str) -> str:
    """Text a tokenizer can read. JSON may escape a lone surrogate ("\\ud800"); UTF-8 cannot hold one."""
    try:
        value.encode("utf-8")
    except UnicodeEncodeError as exc:
        raise ValueError(f"invalid Unicode: a lone surrogate at character {exc.start}") from None
    return value


def not_blank(value: str) -> str:
    if not value.strip():
        raise ValueError("must not be empty or whitespace")
    return value


def valid_id(value: str, max_chars: int = MAX_ID_CHARS) -> str:
    """An id (a document's, a tool call's, a cache key...): non-blank, at most `max_chars`, one line with no
    control characters, and none that shows nothing or nothing agreed (format characters such as U+200B, U+FEFF,
    U+2060, U+00AD and the tag characters; private-use ones), so no two ids look alike; returned in NFC, so the
    NFC and NFD spellings of one name (a macOS file name, say) are one id."""
    valid_unicode(not_blank(value))
    if len(value) > max_chars:
        raise ValueError(f"at most {max_chars} characters (got {len(value)})")
    if _CONTROL.search(value):
        raise ValueError("must not contain control characters (newlines, NUL, escapes, bidirectional controls)")
    if found := _INVISIBLE_CHAR.search(value):
        raise ValueError(f"must not contain invisible or private-use characters (U+{ord(found.group()):04X} at "
                         f"character {found.start()})")
    return unicodedata.normalize("NFC", value)


valid_doc_id = valid_id  # a document id is an id


def valid_title(value: str) -> str:
    """A title: at most MAX_TITLE_CHARS, one line with no control characters (no terminal escapes)."""
    valid_unicode(value)
    if len(value) > MAX_TITLE_CHARS:
        raise ValueError(f"at most {MAX_TITLE_CHARS} characters (got {len(value)})")
    if _CONTROL.search(value):
        raise ValueError("must not contain control characters (newlines, NUL, escapes, bidirectional controls)")
    return unicodedata.normalize("NFC", value)
