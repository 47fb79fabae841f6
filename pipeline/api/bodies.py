"""Request bodies: the content type each must carry, its size limit, and strict JSON.

A body must name its own type (``application/json``, ``application/sdp``): a web
page cannot send either to another site without a CORS preflight, which this
server never grants.
"""

from __future__ import annotations

import json
from typing import Any

from aiohttp import web

from pipeline.api.answers import error


async def read_body(request: web.Request, content_type: str, limit: int, what: str) -> bytes | web.Response:
    """The whole body of a ``content_type`` request of at most ``limit`` bytes, or the error answer.

    ``StreamReader.read(n)`` returns what has arrived so far, not n bytes: an offer
    that comes in several TCP segments must be read until the end of the body.
    """
    if request.content_type != content_type:
        return error(415, f"Content-Type must be {content_type}, got {request.content_type!r}")
    too_big = error(413, f"{what} larger than {limit} bytes")
    if request.content_length is not None and request.content_length > limit:
        return too_big
    chunks: list[bytes] = []
    size = 0
    while chunk := await request.content.read(limit + 1 - size):
        chunks.append(chunk)
        size += len(chunk)
        if size > limit:
            return too_big
    return b"".join(chunks)


class _Constant:
    """NaN, Infinity or -Infinity where the body had one: JSON has none of them, and the
    reader lets them through only to say where they were."""

    def __init__(self, name: str) -> None:
        self.name = name


def _constant_at(value: Any, path: str = "") -> tuple[str, str] | None:
    """The first NaN/Infinity in a parsed body and the key path to it (``sources[0].max_fps``)."""
    if isinstance(value, _Constant):
        return value.name, path
    items = value.items() if isinstance(value, dict) else enumerate(value) if isinstance(value, list) else ()
    for key, item in items:
        inner = f"{path}[{key}]" if isinstance(key, int) else f"{path}.{key}" if path else str(key)
        found = _constant_at(item, inner)
        if found is not None:
            return found
    return None


def _unique_keys(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for key, value in pairs:
        if key in out:
            # Parsers disagree on which duplicate wins; refuse rather than guess.
            raise ValueError(f"duplicate key {key!r}")
        out[key] = value
    return out


def parse_json(body: bytes) -> Any:
    """An API request body; ValueError says what is wrong with it (NaN, duplicate keys, depth)."""
    try:
        value = json.loads(body, parse_constant=_Constant, object_pairs_hook=_unique_keys)
    except RecursionError:
        raise ValueError("not valid JSON (nested too deeply)") from None
    except ValueError as exc:
        if str(exc).startswith("duplicate key"):
            raise
        raise ValueError(f"not valid JSON ({exc})") from None
    try:
        constant = _constant_at(value)
    except RecursionError:
        raise ValueError("not valid JSON (nested too deeply)") from None
    if constant is not None:
        name, where = constant
        raise ValueError(f"not valid JSON ({name} is not allowed" + (f", at {where})" if where else ")"))
    return value
