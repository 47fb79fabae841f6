"""Other sites' pages: their state changes refused, the allowed ones embedding views, security headers.

::

    http:
      allowed_origins: [https://wall.example.com]   # pages that may show live views and snapshots

Requests that change state (every method but GET, HEAD and OPTIONS) are refused with
403 when they come from another site (an ``Origin`` other than the server's own, or
``Sec-Fetch-Site: cross-site`` / ``same-site``), token or not. Every answer carries
``X-Content-Type-Options``, ``Cache-Control: no-store`` and a same-origin
``Cross-Origin-Resource-Policy``; only the embeddable routes answer a page in
``http.allowed_origins`` with CORS headers. docs/security.md has the whole picture.
"""

from __future__ import annotations

from collections.abc import Collection, Iterable
from urllib.parse import urlsplit

from aiohttp import web

from pipeline.api.answers import Handler, error

# Methods that change nothing; every other one is refused from another site.
SAFE_METHODS = frozenset({"GET", "HEAD", "OPTIONS"})


@web.middleware
async def refuse_cross_site(request: web.Request, handler: Handler) -> web.StreamResponse:
    """Refuse state changes a page on another site asks a browser to make, token or not."""
    if request.method in SAFE_METHODS:
        return await handler(request)
    fetch_site = request.headers.get("Sec-Fetch-Site", "").lower()
    if fetch_site in ("cross-site", "same-site"):
        return error(403, f"cross-site request refused (Sec-Fetch-Site: {fetch_site})")
    origin = request.headers.get("Origin")
    # Host and port only: behind a TLS proxy the page's origin is https:// while this
    # server sees http://. "null" (sandboxed frames, file:// pages) has neither.
    if origin is not None and urlsplit(origin).netloc.lower() != request.host.lower():
        return error(403, f"cross-site request refused (Origin {origin!r} is not this server)")
    return await handler(request)


def origin_of(url: str) -> str:
    """``scheme://host[:port]`` of a URL or origin, lower-case; "" when it has none."""
    parts = urlsplit(url.strip())
    try:
        port = parts.port
    except ValueError:
        return ""
    host = parts.hostname or ""
    if parts.scheme not in ("http", "https") or not host:
        return ""
    host = f"[{host}]" if ":" in host else host
    return f"{parts.scheme}://{host}" + (f":{port}" if port is not None else "")


class AllowedOrigins:
    """The pages in ``http.allowed_origins``, and the routes (``embeddable``) they may embed."""

    def __init__(self, allowed: Iterable[str], embeddable: Collection[str]) -> None:
        self._origins = frozenset(origin_of(o) for o in allowed)
        # Route patterns (``/v1/sources/{id}/snapshot.jpg``): images, never the API's data.
        self._embeddable = embeddable

    def add_to(self, router: web.UrlDispatcher) -> None:
        for path in self._embeddable:
            router.add_route("OPTIONS", path, self.preflight)

    def embedder(self, request: web.Request) -> str | None:
        """The allowed page asking for an embeddable route, if any.

        ``Origin`` where the browser sends one (CORS requests); an ``<img>`` sends none,
        but the ``Referer`` it sends by default still carries the page's origin.
        """
        if not self._origins:
            return None
        route = request.match_info.route.resource
        if route is None or route.canonical not in self._embeddable:
            return None
        page = request.headers.get("Origin") or request.headers.get("Referer")
        origin = origin_of(page) if page else ""
        return origin if origin in self._origins else None

    async def preflight(self, request: web.Request) -> web.Response:
        """The CORS preflight of an allowed page's ``fetch`` with the token (live views, snapshots)."""
        if self.embedder(request) is None:
            return error(403, "this page's origin is not in http.allowed_origins")
        return web.Response(
            status=204,
            headers={
                "Access-Control-Allow-Methods": "GET",
                "Access-Control-Allow-Headers": "Authorization",
                "Access-Control-Max-Age": "600",
            },
        )

    async def security_headers(self, request: web.Request, response: web.StreamResponse) -> None:
        """Set on every answer just before it is sent (``on_response_prepare``)."""
        response.headers.setdefault("X-Content-Type-Options", "nosniff")
        response.headers.setdefault("Cache-Control", "no-store")
        embedder = self.embedder(request)
        if embedder is not None:
            # An allowed page may show this live view or snapshot (http.allowed_origins).
            response.headers["Cross-Origin-Resource-Policy"] = "cross-origin"
            response.headers["Access-Control-Allow-Origin"] = embedder
            response.headers["Vary"] = "Origin, Referer"
        # Snapshots and live views are not for other sites' pages to embed.
        response.headers.setdefault("Cross-Origin-Resource-Policy", "same-origin")
        if response.content_type == "text/html":
            response.headers["Content-Security-Policy"] = (
                "default-src 'self'; img-src 'self' blob:; frame-ancestors 'none'"
            )
