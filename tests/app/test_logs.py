"""Every log line is JSON, the multipart parser's included."""
from __future__ import annotations

import json
import logging

from app.logs import LIBRARY_LOGGERS, setup_logging


def test_the_multipart_parsers_lines_are_json(capsys):
    root = logging.getLogger("ragblend")
    saved = root.handlers[:], root.level, getattr(root, "_ragblend_configured", False)
    root.handlers, root._ragblend_configured = [], False
    try:
        setup_logging()
        logging.getLogger("python_multipart.multipart").warning("Skipping data after last boundary")
        logging.getLogger("ragblend.server").warning("request", extra={"status": 507})
        lines = capsys.readouterr().err.strip().splitlines()
        entries = [json.loads(line) for line in lines]
        assert [e["msg"] for e in entries] == ["Skipping data after last boundary", "request"]
        assert entries[0]["logger"] == "python_multipart.multipart" and entries[1]["status"] == 507
    finally:
        for name in LIBRARY_LOGGERS:
            library = logging.getLogger(name)
            library.handlers, library.propagate = [], True
        root.handlers, root.level, root._ragblend_configured = saved
