"""How the API answers: every error as ``{"error": "..."}`` (aiohttp's own and unexpected
exceptions included) and the report's typed values as JSON."""

from __future__ import annotations

import asyncio
import dataclasses
import enum
import logging
from collections.abc import Awaitable, Callable
from typing import Any

import numpy as np
from aiohttp import web

log = logging.getLogger("vidpipe.api")

Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]


def error(status: int, message: str, headers: dict[str, str] | None = None) -> web.Response:
    """The one error shape of the API: ``{"error": message}`` with ``status``."""
    return web.json_response({"error": message}, status=status, headers=headers)


@web.middleware
async def errors_as_json(request: web.Request, handler: Handler) -> web.StreamResponse:
    """Every error as JSON ``{"error": ...}``, including aiohttp's own (404, 405, 413)."""
    try:
        return await handler(request)
    except web.HTTPException as exc:
        if exc.status < 400:
            raise
        headers = {k: v for k, v in exc.headers.items() if k in ("Allow", "WWW-Authenticate")}
        message = exc.text if exc.text and not exc.text.startswith(f"{exc.status}:") else exc.reason
        return error(exc.status, message, headers)
    except asyncio.CancelledError:
        raise
    except Exception as exc:
        # The plain log format shows no tracebacks (only --debug does), so say what it was.
        # ascii(): a decoded path may hold a newline, which would forge a log line.
        path = ascii(request.path)
        log.error("%s %s failed: %s: %s", request.method, path, type(exc).__name__, ascii(str(exc)))
        log.debug("%s %s failed", request.method, path, exc_info=True)
        return error(500, "internal error; see the server log")


def jsonable(value: Any) -> Any:
    """Dataclasses, enums, tuples and paths as JSON values."""
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return {f.name: jsonable(getattr(value, f.name)) for f in dataclasses.fields(value)}
    if isinstance(value, enum.Enum):
        return value.value
    if isinstance(value, dict):
        return {str(k): jsonable(v) for k, v in value.items()}
    if isinstance(value, (list, tuple, set, frozenset)):
        return [jsonable(v) for v in value]
    if value is None or isinstance(value, (str, int, float, bool)):
        return value
    if isinstance(value, np.generic):
        return value.item()
    return str(value)
