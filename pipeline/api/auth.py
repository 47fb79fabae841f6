"""Who may call the API: the bearer token, and without one loopback Host names only.

::

    http:
      token: null     # or VIDPIPE_HTTP_TOKEN; required (16+ characters) off loopback

With a token configured, every request but ``/healthz``, ``/readyz`` and the
dashboard's static files (which hold no data; the page sends the token on every
API call it makes) needs ``Authorization: Bearer <token>``. Without one, only
requests whose ``Host`` is a loopback name get through: a page a local browser
shows can reach 127.0.0.1 through a domain it rebinds, but not with that name.
"""

from __future__ import annotations

import hmac

from aiohttp import web

from pipeline.api.answers import Handler, error
from pipeline.api.cross_site import AllowedOrigins

# Routes anyone may call: probes must work without secrets, and the dashboard's
# static files hold no data (the page sends the token with every API call).
PROBE_PATHS = frozenset({"/healthz", "/readyz"})
OPEN_PATHS = frozenset({"/"})
OPEN_PREFIXES = ("/web/",)
LOOPBACK_NAMES = frozenset({"127.0.0.1", "localhost", "::1"})


def host_name(host: str) -> str:
    """The name in a Host header, without the port (``[::1]:8080`` -> ``::1``)."""
    if host.startswith("["):
        return host[1 : host.find("]")] if "]" in host else host
    return host.rsplit(":", 1)[0] if host.count(":") == 1 else host


class BearerAuth:
    """The ``http.token`` check, as a middleware and for routes that answer callers without it."""

    def __init__(self, token: str | None, origins: AllowedOrigins) -> None:
        self._token = token.encode() if token else None
        # A CORS preflight of an allowed page carries no credentials, by design.
        self._origins = origins

    @property
    def required(self) -> bool:
        """Whether a token is configured."""
        return self._token is not None

    def authorized(self, request: web.Request) -> bool:
        """The request carries the configured token (always True without one)."""
        if self._token is None:
            return True
        scheme, _, given = request.headers.get("Authorization", "").partition(" ")
        # compare_digest: the time taken does not reveal how much of the token matched.
        return scheme.lower() == "bearer" and hmac.compare_digest(given.strip().encode(), self._token)

    @web.middleware
    async def middleware(self, request: web.Request, handler: Handler) -> web.StreamResponse:
        if request.path in PROBE_PATHS:
            return await handler(request)
        if self._token is None:
            # Without a token only loopback clients reach the server, but a web page in a
            # local browser can too, through a domain it rebinds to 127.0.0.1. Such requests
            # carry that domain in Host; refuse everything but loopback names.
            if host_name(request.host) not in LOOPBACK_NAMES:
                return error(403, f"Host {request.host!r} is not allowed; use 127.0.0.1 or localhost")
            return await handler(request)
        if request.path in OPEN_PATHS or request.path.startswith(OPEN_PREFIXES):
            return await handler(request)
        if request.method == "OPTIONS" and self._origins.embedder(request) is not None:
            return await handler(request)  # a CORS preflight carries no credentials, by design
        if not self.authorized(request):
            return error(401, "missing or wrong bearer token", {"WWW-Authenticate": 'Bearer realm="vidpipe"'})
        return await handler(request)
