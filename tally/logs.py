"""Structured logging: one JSON object per line, fields passed as ``extra={"fields": {...}}``.

Services log events (round committed, session aborted) with their ids as fields, so a
log pipeline can filter by job or session without parsing prose.
"""

from __future__ import annotations

import json
import logging
import sys
from datetime import UTC, datetime


def timestamp(seconds: float) -> str:
    """ISO-8601 UTC to the millisecond (``2026-11-24T19:42:23.120Z``): what log tools parse, and
    what a person reads, unlike seconds since the epoch."""
    return datetime.fromtimestamp(seconds, UTC).isoformat(timespec="milliseconds").replace("+00:00", "Z")


class JsonFormatter(logging.Formatter):
    def format(self, record: logging.LogRecord) -> str:
        entry = {
            "ts": timestamp(record.created),
            "level": record.levelname.lower(),
            "logger": record.name,
            "event": record.getMessage(),
        }
        entry.update(getattr(record, "fields", {}) or {})
        if record.exc_info:
            entry["error"] = self.formatException(record.exc_info)
        return json.dumps(entry, default=str)


class _CurrentStderr(logging.StreamHandler):
    """Writes to whatever ``sys.stderr`` is at emit time, not the one at configure time
    (a redirected or closed stream must not turn later log lines into errors)."""

    @property
    def stream(self):  # type: ignore[override]
        return sys.stderr

    @stream.setter
    def stream(self, _value) -> None:
        pass


def configure(level: str = "info", json_lines: bool = True) -> None:
    handler = _CurrentStderr()
    handler.setFormatter(
        JsonFormatter() if json_lines else logging.Formatter("%(asctime)s %(levelname)s %(name)s %(message)s")
    )
    root = logging.getLogger("tally")
    root.handlers[:] = [handler]
    root.setLevel(level.upper())
    root.propagate = False


def event(logger: logging.Logger, message: str, level: int = logging.INFO, **fields: object) -> None:
    """Log ``message`` with ``fields`` as structured data."""
    logger.log(level, message, extra={"fields": fields})


