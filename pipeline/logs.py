"""Logging set-up: one line per event that matters, plain or JSON (``--log-format json``)."""

from __future__ import annotations

import json
import logging
import sys
import time

# What a line is about, as fields of their own in JSON logs, so a log pipeline can filter
# on a camera or a model without parsing the message; set with ``extra={"source": ...}``.
CONTEXT_FIELDS = ("source", "model", "stage")


class JsonFormatter(logging.Formatter):
    """One JSON object per line: ts, level, logger, msg, and source / model / stage when known."""

    def format(self, record: logging.LogRecord) -> str:
        out = {
            "ts": round(record.created, 3),
            "level": record.levelname.lower(),
            "logger": record.name,
            "msg": record.getMessage(),
        }
        for name in CONTEXT_FIELDS:
            value = getattr(record, name, None)
            if isinstance(value, str):
                out[name] = value
        if record.exc_info and record.levelno >= logging.DEBUG and logging.getLogger().level <= logging.DEBUG:
            out["exc"] = self.formatException(record.exc_info)
        return json.dumps(out, ensure_ascii=False)


class PlainFormatter(logging.Formatter):
    """``HH:MM:SS level  message`` — no tracebacks unless debugging."""

    def __init__(self, debug: bool) -> None:
        super().__init__()
        self.debug = debug

    def format(self, record: logging.LogRecord) -> str:
        stamp = time.strftime("%H:%M:%S", time.localtime(record.created))
        line = f"{stamp} {record.levelname.lower():7s} {record.getMessage()}"
        if self.debug and record.exc_info:
            line += "\n" + self.formatException(record.exc_info)
        return line


def setup_logging(level: str = "info", fmt: str = "plain", debug: bool = False) -> None:
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(JsonFormatter() if fmt == "json" else PlainFormatter(debug))
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(logging.DEBUG if debug else getattr(logging, level.upper(), logging.INFO))
    # Library chatter (aiortc, aioice, nats reconnect noise) stays out of an operator's log.
    for noisy in ("aioice", "aiortc", "nats", "asyncio", "aiohttp.access"):
        logging.getLogger(noisy).setLevel(logging.WARNING if not debug else logging.INFO)
