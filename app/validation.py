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
NO_CONTROL_CHARS = rf"^[^{_CONTROLS}]*$"  # also the OpenAPI `pattern` of titles
ONE_LINE_NOT_BLANK = rf"^[^{_CONTROLS}]*[^\s{_CONTROLS}][^{_CONTROLS}]*$"  # ... and of ids
NOT_BLANK = r"\S"  # ... and of questions and texts
_CONTROL = re.compile(rf"[{_CONTROLS}]")


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


def valid_doc_id(value: str) -> str:
    """A document id: non-blank, at most MAX_ID_CHARS, one line with no control characters; returned in NFC, so
    the NFC and NFD spellings of one name (a macOS file name, say) are one id."""
    valid_unicode(not_blank(value))
    if len(value) > MAX_ID_CHARS:
        raise ValueError(f"at most {MAX_ID_CHARS} characters (got {len(value)})")
    if _CONTROL.search(value):
        raise ValueError("must not contain control characters (newlines, NUL, escapes, bidirectional controls)")
    return unicodedata.normalize("NFC", value)


def valid_title(value: str) -> str:
    """A title: at most MAX_TITLE_CHARS, one line with no control characters (no terminal escapes)."""
    valid_unicode(value)
    if len(value) > MAX_TITLE_CHARS:
        raise ValueError(f"at most {MAX_TITLE_CHARS} characters (got {len(value)})")
    if _CONTROL.search(value):
        raise ValueError("must not contain control characters (newlines, NUL, escapes, bidirectional controls)")
    return unicodedata.normalize("NFC", value)
