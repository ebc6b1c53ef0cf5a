"""The rules for text from outside — JSON bodies, multipart forms, chat content parts, ingested files —
in one place. The API's schemas (app/api_models.py) and ingest (app/ingest.py) both apply them, so a
document id or title is checked the same way whichever door it came in by.
"""
from __future__ import annotations

import re

MAX_ID_CHARS = 256
MAX_TITLE_CHARS = 1024
NO_CONTROL_CHARS = r"^[^\x00-\x1f\x7f]*$"  # also the OpenAPI `pattern` of titles
ONE_LINE_NOT_BLANK = r"^[^\x00-\x1f\x7f]*[^\s\x00-\x1f\x7f][^\x00-\x1f\x7f]*$"  # ... and of ids
NOT_BLANK = r"\S"  # ... and of questions and texts
_CONTROL = re.compile(r"[\x00-\x1f\x7f]")


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
    """A document id: non-blank, at most MAX_ID_CHARS, one line with no control characters."""
    valid_unicode(not_blank(value))
    if len(value) > MAX_ID_CHARS:
        raise ValueError(f"at most {MAX_ID_CHARS} characters (got {len(value)})")
    if _CONTROL.search(value):
        raise ValueError("must not contain control characters (newlines, NUL, escapes)")
    return value


def valid_title(value: str) -> str:
    """A title: at most MAX_TITLE_CHARS, one line with no control characters (no terminal escapes)."""
    valid_unicode(value)
    if len(value) > MAX_TITLE_CHARS:
        raise ValueError(f"at most {MAX_TITLE_CHARS} characters (got {len(value)})")
    if _CONTROL.search(value):
        raise ValueError("must not contain control characters (newlines, NUL, escapes)")
    return value
