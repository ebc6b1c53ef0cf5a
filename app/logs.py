"""Structured (JSON-lines) logging on stderr, quiet by default: RAGBLEND_LOG_LEVEL=INFO for more."""
from __future__ import annotations

import json
import logging
import os
import sys
import time

LIBRARY_LOGGERS = ("python_multipart", "multipart")
_STD_ATTRS = set(logging.LogRecord("", 0, "", 0, "", (), None).__dict__) | {"message", "asctime"}


class JsonFormatter(logging.Formatter):
    def format(self, record: logging.LogRecord) -> str:
        entry = {"ts": round(time.time(), 3), "level": record.levelname.lower(), "logger": record.name,
                 "msg": record.getMessage()}
        entry.update({k: v for k, v in record.__dict__.items() if k not in _STD_ATTRS})
        if record.exc_info:
            entry["exc"] = self.formatException(record.exc_info)
        return json.dumps(entry, default=str)


class StderrHandler(logging.StreamHandler):
    """Writes to sys.stderr as it is when a record comes (a redirect or a test's capture made later), never to a
    stream closed since setup."""

    def __init__(self) -> None:
        logging.Handler.__init__(self)

    @property
    def stream(self):
        return sys.stderr


def setup_logging(level: str | None = None) -> None:
    """Route the `ragblend.*` loggers to stderr as JSON lines; silence chatty libraries."""
    root = logging.getLogger("ragblend")
    if getattr(root, "_ragblend_configured", False):
        return
    handler = StderrHandler()
    handler.setFormatter(JsonFormatter())
    root.addHandler(handler)
    root.setLevel((level or os.environ.get("RAGBLEND_LOG_LEVEL", "WARNING")).upper())
    root.propagate = False
    root._ragblend_configured = True
    # Libraries that log in a request's path (the multipart parser: "Skipping data after last boundary") write
    # JSON lines through the same handler, at WARNING and above
    for library in LIBRARY_LOGGERS:
        logger = logging.getLogger(library)
        logger.handlers = [handler]  # ours alone, whatever an earlier setup left
        logger.setLevel(logging.WARNING)
        logger.propagate = False
    for noisy in ("transformers", "sentence_transformers", "httpx", "faiss"):
        logging.getLogger(noisy).setLevel(logging.ERROR)
