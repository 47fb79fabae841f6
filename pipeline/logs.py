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


class MalformedHttpFilter(logging.Filter):
    """aiohttp logs a request that is not valid HTTP (a broken request line, a header given
    twice where HTTP allows one) as an ERROR "Error handling request" with a traceback. It
    is the client's fault, answered with a plain 400 before vidpipe sees the request: one
    warning line that says what was wrong, and who sent it."""

    def filter(self, record: logging.LogRecord) -> bool:
        exc = record.exc_info[1] if record.exc_info else None
        if record.getMessage().startswith("Error handling request") and _is_bad_http(exc):
            peer = record.args[0] if isinstance(record.args, tuple) and record.args else "?"
            record.msg = "HTTP: refused a request from %s that is not valid HTTP: %s"
            record.args = (peer, _bad_http_text(exc))
            record.levelno, record.levelname = logging.WARNING, "WARNING"
            record.exc_info = None
        return True


def _is_bad_http(exc: BaseException | None) -> bool:
    try:
        from aiohttp.http_exceptions import HttpProcessingError
    except ImportError:  # the API's extra is not installed
        return False
    return isinstance(exc, HttpProcessingError)


def _bad_http_text(exc: BaseException | None) -> str:
    # aiohttp's message, e.g. "400, message: Duplicate 'Content-Type' header found.", in one line.
    text = str(getattr(exc, "message", "") or exc).splitlines()
    return text[0].strip() if text else type(exc).__name__


def setup_logging(level: str = "info", fmt: str = "plain", debug: bool = False) -> None:
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(JsonFormatter() if fmt == "json" else PlainFormatter(debug))
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(logging.DEBUG if debug else getattr(logging, level.upper(), logging.INFO))
    # Library chatter (aiortc, aioice, nats reconnect noise) stays out of an operator's log.
    for noisy in ("aioice", "aiortc", "nats", "asyncio", "aiohttp.access"):
        logging.getLogger(noisy).setLevel(logging.WARNING if not debug else logging.INFO)
    server = logging.getLogger("aiohttp.server")
    if not any(isinstance(f, MalformedHttpFilter) for f in server.filters):
        server.addFilter(MalformedHttpFilter())
