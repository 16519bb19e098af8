"""Structured logging for both programs.

Operational logs go to stderr, as text (``2026-11-22T12:00:00.123Z INFO lodestone.broker message
key=value ...``) or as JSON lines (one object per record) when ``json_lines`` is set. Extra
fields passed with ``log.info("...", extra={"fields": {...}})`` are kept as structured fields in
both forms, so a log shipper or the Spark job can read them without parsing prose.

Stdout is reserved for the ``listening <what> <url>`` lines that tests and operators read.
"""

from __future__ import annotations

import json
import logging
import sys
import time


class _JsonFormatter(logging.Formatter):
    def format(self, record: logging.LogRecord) -> str:
        out = {
            "ts": _iso(record.created),
            "level": record.levelname,
            "logger": record.name,
            "msg": record.getMessage(),
        }
        fields = getattr(record, "fields", None)
        if fields:
            out.update(fields)
        if record.exc_info:
            out["exc"] = self.formatException(record.exc_info)
        return json.dumps(out, default=str, separators=(",", ":"))


class _TextFormatter(logging.Formatter):
    def format(self, record: logging.LogRecord) -> str:
        line = f"{_iso(record.created)} {record.levelname} {record.name} {record.getMessage()}"
        fields = getattr(record, "fields", None)
        if fields:
            line += " " + " ".join(f"{k}={_text_value(v)}" for k, v in fields.items())
        if record.exc_info:
            line += "\n" + self.formatException(record.exc_info)
        return line


def _text_value(v: object) -> str:
    s = "-" if v is None else str(v)
    return json.dumps(s) if (" " in s or "=" in s or not s) else s


def _iso(ts: float) -> str:
    return time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(ts)) + f".{int(ts % 1 * 1000):03d}Z"


def setup_logging(level: str = "INFO", json_lines: bool = False) -> None:
    """Configure the root logger once: one stderr handler, text or JSON lines."""
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(_JsonFormatter() if json_lines else _TextFormatter())
    root = logging.getLogger()
    for h in list(root.handlers):
        root.removeHandler(h)
    root.addHandler(handler)
    root.setLevel(level.upper())


def print_listening(what: str, url: str) -> None:
    """The one stdout line per bound listener: ``listening <what> <url>`` (flushed at once)."""
    print(f"listening {what} {url}", flush=True)
