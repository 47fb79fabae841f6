"""The HTTP server: metrics, health, the sources API, WHIP ingest and the dashboard.

::

    http:
      listen: 127.0.0.1:8080     # host:port; port 0 picks a free one
      token: null                # bearer token; required (16+ characters) off loopback
      max_connections: 256       # open connections at once (at most half the open-file limit)
      max_connections_per_client: 64   # open connections from one client address
      header_timeout: 10.0       # seconds to send a request's headers
      keepalive_timeout: 15.0    # seconds an idle keep-alive connection stays open
      file_roots: []             # folders POST /v1/sources may open files in; none by default
      source_schemes: [file, test, rtsp, rtsps, whip, http, https, udp, rtp, srt]  # not v4l2

``vidpipe run CONFIG --http HOST:PORT`` serves it too (the token may come from
``VIDPIPE_HTTP_TOKEN``). Endpoints (docs/api.md has examples):

=========================================  ===============================================
``GET /healthz``, ``GET /readyz``          liveness / readiness (never need the token)
``GET /metrics``                           Prometheus text
``GET /v1/sources``                        every source (``pipeline.stats.SourceReport``)
``POST /v1/sources``                       add a source (JSON, same keys as YAML)
``DELETE /v1/sources/{id}``                stop and remove a source
``GET /v1/sources/{id}/snapshot.jpg``      latest published frame, annotated
``GET /v1/sources/{id}/stream.mjpeg``      live annotated view, multipart JPEG (``?fps=``)
``GET /v1/stats``                          per-source fps/latency/drops, per-model batching
``GET /v1/fleet``                          in a fleet: workers (alive, load, version), sources (owner, since)
``GET /v1/models``                         the model repository's status
``POST /v1/models/{name}/reload``          swap in a model's new config and files (JSON body)
``POST /whip/{id}``                        WHIP: SDP offer in, answer out
``DELETE /whip/{id}/{session}``            WHIP: end a session
``POST /whep/{id}``                        WHEP: live annotated view over WebRTC
``DELETE /whep/{id}/{session}``            WHEP: end a session
``GET /``                                  the dashboard
=========================================  ===============================================

With a token configured, every request but ``/healthz``, ``/readyz`` and the
dashboard's static files (which hold no data; the page sends the token on every
API call it makes) needs ``Authorization: Bearer <token>``; ``/readyz`` then shows
callers without it counts only, no source ids or reasons.

Requests that change state (every method but GET, HEAD and OPTIONS) are refused with 403
when they come from another site (an ``Origin`` other than the server's own, or
``Sec-Fetch-Site: cross-site`` / ``same-site``), token or not, and their bodies
must carry their own content type (``application/json``, ``application/sdp`` for
WHIP and WHEP offers): a web page cannot send either without a CORS preflight, which this
server never grants. docs/security.md has the whole picture.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import dataclasses
import enum
import hmac
import ipaddress
import json
import logging
import resource
import socket
import time
from collections.abc import Awaitable, Callable, Collection
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import numpy as np
from aiohttp import web

from inference.errors import VidpipeError
from inference.model import ModelState
from inference.schema import ConfigError
from pipeline.config import HttpConfig, SourceConfig, SourcePolicy, SourceRefused, parse_source
from pipeline.fleet.desired import check_source
from pipeline.fleet.worker import FleetWorker
from pipeline.frames import Frame
from pipeline.health import readiness_problems
from pipeline.http_guard import GuardedSite
from pipeline.outputs.whep import WhepError as WhepEgressError
from pipeline.outputs.whep import WhepServer
from pipeline.runtime import Runtime, SourceLimitError
from pipeline.snapshot import render_snapshot
from pipeline.sources.base import SourceError, SourceState
from pipeline.sources.whip import MAX_SDP_BYTES, WhipError, WhipSource
from pipeline.stats import ModelReport, Overload, PipelineReport, SourceReport
from pipeline.webrtc_guard import (
    OfferGuard,
    OfferRefused,
    PendingSession,
    default_ice_networks,
    parse_network,
)

log = logging.getLogger("vidpipe.api")

MAX_BODY_BYTES = 1024 * 1024
# A reload body holds at most {"force": true}.
MAX_RELOAD_BODY_BYTES = 64 * 1024
# Off loopback the token is all that stands between the network and the API.
MIN_TOKEN_CHARS = 16
# Methods that change nothing; every other one is refused from another site.
SAFE_METHODS = frozenset({"GET", "HEAD", "OPTIONS"})
# The routes a page in http.allowed_origins may embed: images, never the API's data.
EMBEDDABLE = frozenset({"/v1/sources/{id}/snapshot.jpg", "/v1/sources/{id}/stream.mjpeg"})
WEB_DIR = Path(__file__).resolve().parent / "web"
# Routes anyone may call: probes must work without secrets, and the dashboard's
# static files hold no data (the page sends the token with every API call).
PROBE_PATHS = frozenset({"/healthz", "/readyz"})
OPEN_PATHS = frozenset({"/"})
LOOPBACK_NAMES = frozenset({"127.0.0.1", "localhost", "::1"})
OPEN_PREFIXES = ("/web/",)
PROMETHEUS_TEXT = "text/plain; version=0.0.4; charset=utf-8"
RATE_WINDOW = 5  # seconds of samples behind the fps figure
# Live MJPEG views: frames per second a viewer gets unless it asks (?fps=), and the most.
MJPEG_FPS = 10.0
MJPEG_MAX_FPS = 30.0
MJPEG_BOUNDARY = "vidpipe-frame"

Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]


class ApiConfigError(VidpipeError):
    """The HTTP server cannot start as configured; ``key`` is the setting to change."""

    def __init__(self, message: str, key: str = "http.listen") -> None:
        self.key = key
        super().__init__(message)


def parse_listen(listen: str) -> tuple[str, int]:
    """``host:port`` (``[v6]:port`` for IPv6) into its parts."""
    host, sep, port_text = listen.rpartition(":")
    if not sep or not port_text.isdigit() or not 0 <= int(port_text) <= 65535:
        raise ApiConfigError(f"http.listen: expected HOST:PORT, got {listen!r}")
    host = host.strip("[]")
    if not host:
        raise ApiConfigError(f"http.listen: {listen!r} has no host; use 127.0.0.1:PORT or 0.0.0.0:PORT")
    return host, int(port_text)


def is_loopback(host: str) -> bool:
    """True when every address ``host`` resolves to is a loopback address."""
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        pass
    try:
        infos = socket.getaddrinfo(host, None, type=socket.SOCK_STREAM)
    except OSError as exc:
        raise ApiConfigError(f"http.listen: cannot resolve host {host!r}: {exc}") from None
    return bool(infos) and all(ipaddress.ip_address(info[4][0]).is_loopback for info in infos)


def check_http_config(config: HttpConfig) -> tuple[str, int]:
    """Host and port to bind; refuses a non-loopback address without a token."""
    host, port = parse_listen(config.listen)
    if config.token is not None and not config.token.strip():
        raise ApiConfigError("http.token is empty; set a real token or remove the key", key="http.token")
    if not is_loopback(host):
        if not config.token:
            raise ApiConfigError(
                f"http.listen {config.listen} is reachable from other machines, so the API needs a "
                "token: set http.token (or VIDPIPE_HTTP_TOKEN), or listen on 127.0.0.1"
            )
        if len(config.token) < MIN_TOKEN_CHARS:
            raise ApiConfigError(
                f"http.token is {len(config.token)} characters; off loopback it must have at least "
                f"{MIN_TOKEN_CHARS} (e.g. python3 -c 'import secrets; print(secrets.token_urlsafe(24))')",
                key="http.token",
            )
    return host, port


def connection_cap(configured: int) -> int:
    """``http.max_connections``, lowered to half of this process's open-file limit.

    The other half is for sources, NATS, models and the accept itself: an HTTP
    client must never be able to take the process's last descriptor.
    """
    soft, _ = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft == resource.RLIM_INFINITY:
        return configured
    return max(1, min(configured, soft // 2))


async def _read_body(request: web.Request, content_type: str, limit: int, what: str) -> bytes | web.Response:
    """The whole body of a ``content_type`` request of at most ``limit`` bytes, or the error answer.

    ``StreamReader.read(n)`` returns what has arrived so far, not n bytes: an offer
    that comes in several TCP segments must be read until the end of the body.
    """
    if request.content_type != content_type:
        return _error(415, f"Content-Type must be {content_type}, got {request.content_type!r}")
    too_big = _error(413, f"{what} larger than {limit} bytes")
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


async def _read_sdp(request: web.Request) -> str | web.Response:
    """A WHIP or WHEP offer: the whole ``application/sdp`` body as text, or the error answer."""
    body = await _read_body(request, "application/sdp", MAX_SDP_BYTES, "SDP offer")
    if isinstance(body, web.Response):
        return body
    try:
        return body.decode("utf-8")
    except UnicodeDecodeError:
        return _error(400, "bad SDP offer: not UTF-8 text")


def _error(status: int, message: str, headers: dict[str, str] | None = None) -> web.Response:
    return web.json_response({"error": message}, status=status, headers=headers)


class ApiServer:
    """One aiohttp server for a :class:`~pipeline.runtime.Runtime`."""

    def __init__(
        self,
        runtime: Runtime,
        config: HttpConfig,
        *,
        max_body: int = MAX_BODY_BYTES,
        fleet: FleetWorker | None = None,
    ) -> None:
        self.runtime = runtime
        # In a fleet, POST/DELETE /v1/sources change the fleet's desired sources instead.
        self.fleet = fleet
        self.config = config
        self.host, self._requested_port = check_http_config(config)
        self._token = config.token.encode() if config.token else None
        # Pages that may embed the live views and snapshots (http.allowed_origins).
        self._embedders = frozenset(_origin(o) for o in config.allowed_origins)
        self.port: int | None = None
        self._runner: web.AppRunner | None = None
        self._sampler: asyncio.Task[None] | None = None
        self._rates: dict[str, collections.deque[tuple[float, int]]] = {}
        self._snapshots: dict[str, tuple[Frame, bytes]] = {}
        # One reload per model at a time: a second request waits for the first one's answer.
        self._reloads: dict[str, asyncio.Task[tuple[int, dict[str, Any]]]] = {}
        self.site: GuardedSite | None = None
        # Created with the first WHEP viewer.
        self._whep: WhepServer | None = None
        # What WHIP and WHEP offers may ask: candidate ranges, pending sessions per client.
        networks = [n for n in map(parse_network, config.ice_networks or []) if n is not None]
        self.webrtc = OfferGuard(
            networks if config.ice_networks is not None else default_ice_networks(self.host),
            config.max_pending_webrtc_per_client,
        )
        self.app = web.Application(
            client_max_size=max_body, middlewares=[self._errors, self._cross_site, self._auth]
        )
        self.app.on_response_prepare.append(self._security_headers)
        r = self.app.router
        r.add_get("/healthz", self.healthz)
        r.add_get("/readyz", self.readyz)
        r.add_get("/metrics", self.metrics)
        r.add_get("/v1/sources", self.list_sources)
        r.add_post("/v1/sources", self.add_source)
        r.add_delete("/v1/sources/{id}", self.delete_source)
        r.add_get("/v1/sources/{id}/snapshot.jpg", self.snapshot)
        r.add_get("/v1/sources/{id}/stream.mjpeg", self.stream_mjpeg)
        for path in EMBEDDABLE:
            r.add_route("OPTIONS", path, self.embed_preflight)
        r.add_get("/v1/stats", self.stats)
        r.add_get("/v1/fleet", self.fleet_status)
        r.add_get("/v1/models", self.models)
        r.add_post("/v1/models/{name}/reload", self.reload_model)
        r.add_post("/whip/{name}", self.whip_offer)
        r.add_delete("/whip/{name}/{session}", self.whip_delete)
        r.add_post("/whep/{id}", self.whep_offer)
        r.add_delete("/whep/{id}/{session}", self.whep_delete)
        r.add_get("/", self.dashboard)
        r.add_static("/web/", WEB_DIR, show_index=False, follow_symlinks=False)

    @property
    def url(self) -> str:
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"http://{host}:{self.port}"

    async def start(self) -> None:
        """Bind and serve; ``port`` then holds the actual port (useful with port 0)."""
        infos = socket.getaddrinfo(self.host, self._requested_port, type=socket.SOCK_STREAM)
        family, _, _, _, address = infos[0]
        sock = socket.socket(family, socket.SOCK_STREAM)
        try:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            sock.bind(address)
        except OSError as exc:
            sock.close()
            raise ApiConfigError(f"http.listen {self.config.listen}: cannot bind: {exc.strerror}") from None
        self.port = int(sock.getsockname()[1])
        cap = connection_cap(self.config.max_connections)
        if cap < self.config.max_connections:
            soft, _ = resource.getrlimit(resource.RLIMIT_NOFILE)
            log.warning(
                "http.max_connections %d lowered to %d: half of this process's open-file limit (%d)",
                self.config.max_connections,
                cap,
                soft,
            )
        # No access log: the dashboard polls every second; failures are logged below.
        # aiohttp keeps an idle keep-alive connection for an hour unless told otherwise.
        self._runner = web.AppRunner(
            self.app,
            access_log=None,
            handle_signals=False,
            keepalive_timeout=self.config.keepalive_timeout,
        )
        await self._runner.setup()
        self.site = GuardedSite(
            self._runner,
            sock,
            max_connections=cap,
            header_timeout=self.config.header_timeout,
            max_connections_per_client=self.config.max_connections_per_client,
        )
        await self.site.start()
        self._sampler = asyncio.create_task(self._sample_rates(), name="api-rates")
        log.info("HTTP API on %s%s", self.url, " (bearer token required)" if self._token else "")

    async def stop(self) -> None:
        if self._sampler is not None:
            self._sampler.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._sampler
        # Peer connections of stopped WHIP sources close in the background; let them finish.
        for run in list(self.runtime.sources.values()):
            if isinstance(run.source, WhipSource) and run.source.stopping:
                await run.source.closed()
        # Live views end first: a streaming response would otherwise hold cleanup up.
        self.runtime.outputs.relay.end_all()
        if self._whep is not None:
            await self._whep.close()
        if self._runner is not None:
            await self._runner.cleanup()
            self._runner = None

    # -- middleware --------------------------------------------------------------------------

    @web.middleware
    async def _errors(self, request: web.Request, handler: Handler) -> web.StreamResponse:
        """Every error as JSON ``{"error": ...}``, including aiohttp's own (404, 405, 413)."""
        try:
            return await handler(request)
        except web.HTTPException as exc:
            if exc.status < 400:
                raise
            headers = {k: v for k, v in exc.headers.items() if k in ("Allow", "WWW-Authenticate")}
            message = exc.text if exc.text and not exc.text.startswith(f"{exc.status}:") else exc.reason
            return _error(exc.status, message, headers)
        except asyncio.CancelledError:
            raise
        except Exception as exc:
            # The plain log format shows no tracebacks (only --debug does), so say what it was.
            # ascii(): a decoded path may hold a newline, which would forge a log line.
            path = ascii(request.path)
            log.error("%s %s failed: %s: %s", request.method, path, type(exc).__name__, ascii(str(exc)))
            log.debug("%s %s failed", request.method, path, exc_info=True)
            return _error(500, "internal error; see the server log")

    @web.middleware
    async def _cross_site(self, request: web.Request, handler: Handler) -> web.StreamResponse:
        """Refuse state changes a page on another site asks a browser to make, token or not."""
        if request.method in SAFE_METHODS:
            return await handler(request)
        fetch_site = request.headers.get("Sec-Fetch-Site", "").lower()
        if fetch_site in ("cross-site", "same-site"):
            return _error(403, f"cross-site request refused (Sec-Fetch-Site: {fetch_site})")
        origin = request.headers.get("Origin")
        # Host and port only: behind a TLS proxy the page's origin is https:// while this
        # server sees http://. "null" (sandboxed frames, file:// pages) has neither.
        if origin is not None and urlsplit(origin).netloc.lower() != request.host.lower():
            return _error(403, f"cross-site request refused (Origin {origin!r} is not this server)")
        return await handler(request)

    @web.middleware
    async def _auth(self, request: web.Request, handler: Handler) -> web.StreamResponse:
        if request.path in PROBE_PATHS:
            return await handler(request)
        if self._token is None:
            # Without a token only loopback clients reach the server, but a web page in a
            # local browser can too, through a domain it rebinds to 127.0.0.1. Such requests
            # carry that domain in Host; refuse everything but loopback names.
            if _host_name(request.host) not in LOOPBACK_NAMES:
                return _error(403, f"Host {request.host!r} is not allowed; use 127.0.0.1 or localhost")
            return await handler(request)
        if request.path in OPEN_PATHS or request.path.startswith(OPEN_PREFIXES):
            return await handler(request)
        if request.method == "OPTIONS" and self._embedder(request) is not None:
            return await handler(request)  # a CORS preflight carries no credentials, by design
        if not self._authorized(request):
            return _error(
                401, "missing or wrong bearer token", {"WWW-Authenticate": 'Bearer realm="vidpipe"'}
            )
        return await handler(request)

    def _authorized(self, request: web.Request) -> bool:
        """The request carries the configured token (always True without one)."""
        if self._token is None:
            return True
        scheme, _, given = request.headers.get("Authorization", "").partition(" ")
        # compare_digest: the time taken does not reveal how much of the token matched.
        return scheme.lower() == "bearer" and hmac.compare_digest(given.strip().encode(), self._token)

    def _embedder(self, request: web.Request) -> str | None:
        """The allowed page (http.allowed_origins) asking for a live view or snapshot, if any.

        ``Origin`` where the browser sends one (CORS requests); an ``<img>`` sends none,
        but the ``Referer`` it sends by default still carries the page's origin.
        """
        if not self._embedders:
            return None
        route = request.match_info.route.resource
        if route is None or route.canonical not in EMBEDDABLE:
            return None
        page = request.headers.get("Origin") or request.headers.get("Referer")
        origin = _origin(page) if page else ""
        return origin if origin in self._embedders else None

    async def embed_preflight(self, request: web.Request) -> web.Response:
        """The CORS preflight of an allowed page's ``fetch`` with the token (live views, snapshots)."""
        if self._embedder(request) is None:
            return _error(403, "this page's origin is not in http.allowed_origins")
        return web.Response(
            status=204,
            headers={
                "Access-Control-Allow-Methods": "GET",
                "Access-Control-Allow-Headers": "Authorization",
                "Access-Control-Max-Age": "600",
            },
        )

    async def _security_headers(self, request: web.Request, response: web.StreamResponse) -> None:
        response.headers.setdefault("X-Content-Type-Options", "nosniff")
        response.headers.setdefault("Cache-Control", "no-store")
        embedder = self._embedder(request)
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

    # -- health and metrics ------------------------------------------------------------------

    async def healthz(self, request: web.Request) -> web.Response:
        problem = self.fleet.health_problem() if self.fleet is not None else None
        if problem is not None:
            return web.json_response({"status": "failing", "reason": problem}, status=503)
        return web.json_response({"status": "ok"})

    async def readyz(self, request: web.Request) -> web.Response:
        report = self.runtime.report()
        reasons = readiness_problems(report)
        if self._token is not None and not self._authorized(request):
            # A probe needs the verdict; source ids and reasons are for those with the token.
            counts = {"ready": not reasons, **_readiness_counts(report)}
            return web.json_response(counts, status=503 if reasons else 200)
        if reasons:
            return web.json_response({"ready": False, "reasons": reasons}, status=503)
        return web.json_response({"ready": True, "reasons": []})

    async def metrics(self, request: web.Request) -> web.Response:
        # The classic text format: what Metrics.render() writes and every scraper reads.
        return web.Response(body=self.runtime.metrics.render(), headers={"Content-Type": PROMETHEUS_TEXT})

    # -- sources -----------------------------------------------------------------------------

    async def list_sources(self, request: web.Request) -> web.Response:
        return web.json_response([_source_json(s) for s in self.runtime.report().sources])

    async def add_source(self, request: web.Request) -> web.Response:
        # JSON only: a cross-site form or no-cors fetch cannot send this type without a
        # CORS preflight, which this server never grants.
        if request.content_type != "application/json":
            return _error(415, f"Content-Type must be application/json, got {request.content_type!r}")
        body = await request.read()  # over client_max_size: 413 via the error middleware
        try:
            data = _parse_json(body)
        except ValueError as exc:
            return _error(400, f"body: {exc}")
        base_dir = self.runtime.config.base_dir
        policy = SourcePolicy.from_http(self.config, base_dir)
        # An id derived from the URL is unique among the running (or the fleet's desired) sources;
        # the fleet's are read only when an id is to be derived.
        sources = self.runtime.sources
        taken: Collection[str] = sources
        if self.fleet is not None and not (isinstance(data, dict) and data.get("id") is not None):
            taken = self.fleet.desired_ids()  # a live view of the keys: no per-request decode
        try:
            config = parse_source(data, base_dir=base_dir, taken_ids=taken, policy=policy, file="request")
        except ConfigError as exc:
            hint = f" (hint: {exc.hint})" if exc.hint else ""
            return _error(403 if isinstance(exc, SourceRefused) else 400, f"{exc.path}: {exc.problem}{hint}")
        if self.fleet is not None:
            return await self._add_desired(config)
        sid = config.source_id
        if sid in sources:
            return _error(409, f"sources.id: source {sid!r} already exists; DELETE it first")
        try:
            run = self.runtime.add_source(config)
        except SourceLimitError as exc:
            return _error(429, str(exc))
        except SourceError as exc:
            return _error(400, f"sources.url: {exc}")
        except ValueError as exc:
            return _error(409, f"sources.id: {exc}")
        log.info("source %s added over the API (%s)", sid, run.source.display_url)
        return web.json_response(
            _source_json(run.report()), status=201, headers={"Location": f"/v1/sources/{sid}"}
        )

    async def delete_source(self, request: web.Request) -> web.Response:
        sid = request.match_info["id"]
        if self.fleet is not None:
            return await self._remove_desired(sid)
        if not await self.runtime.remove_source(sid):
            return _error(404, f"no source {sid!r}")
        self._snapshots.pop(sid, None)
        self._rates.pop(sid, None)
        log.info("source %s removed over the API", sid)
        return web.Response(status=204)

    # -- fleet -------------------------------------------------------------------------------

    async def _add_desired(self, config: SourceConfig) -> web.Response:
        """Add to the fleet's desired sources; the worker placement picks starts it (202)."""
        assert self.fleet is not None and self.fleet.desired is not None
        taken = self.fleet.desired_ids()  # a live view of the keys: no per-request copy or decode
        sid = config.source_id
        if len(taken) >= self.fleet.max_desired and sid not in taken:
            full = f"fleet {self.fleet.name} holds {len(taken)} sources (fleet.max_desired)"
            return _error(429, f"{full}; remove one first")
        try:
            check_source(config)
        except SourceError as exc:
            return _error(400, f"sources.url: {exc}")
        if not await self.fleet.desired.add(config):
            return _error(
                409, f"sources.id: source {sid!r} already exists in fleet {self.fleet.name}; DELETE it first"
            )
        log.info("source %s added to fleet %s over the API", sid, self.fleet.name)
        return web.json_response(
            {"id": sid, "fleet": self.fleet.name, "desired": True},
            status=202,
            headers={"Location": f"/v1/sources/{sid}"},
        )

    async def _remove_desired(self, sid: str) -> web.Response:
        assert self.fleet is not None and self.fleet.desired is not None
        if not await self.fleet.desired.remove(sid):
            return _error(404, f"no source {sid!r} in fleet {self.fleet.name}")
        log.info("source %s removed from fleet %s over the API", sid, self.fleet.name)
        return web.Response(status=204)

    async def fleet_status(self, request: web.Request) -> web.Response:
        if self.fleet is None:
            return _error(404, "not in a fleet; run with --fleet NAME or fleet: in the config")
        return web.json_response(self.fleet.status())

    async def snapshot(self, request: web.Request) -> web.Response:
        sid = request.match_info["id"]
        run = self.runtime.sources.get(sid)
        if run is None:
            return _error(404, f"no source {sid!r}")
        frame = run.last_frame
        if frame is None:
            return _error(404, f"source {sid!r} has not published a frame yet")
        cached = self._snapshots.get(sid)
        if cached is not None and cached[0] is frame:
            jpeg = cached[1]
        else:
            # JPEG encoding takes milliseconds per frame: keep it off the event loop, and
            # keep the frame's pooled buffer from being reused while the thread reads it.
            buffer = frame.buffer.retain() if frame.buffer is not None else None
            try:
                jpeg = await asyncio.to_thread(render_snapshot, frame)
            finally:
                if buffer is not None:
                    buffer.release()
            self._snapshots[sid] = (frame, jpeg)
        return web.Response(body=jpeg, content_type="image/jpeg", headers={"X-Frame-Index": str(frame.index)})

    async def stream_mjpeg(self, request: web.Request) -> web.StreamResponse:
        """The source's annotated frames as ``multipart/x-mixed-replace`` JPEGs, rate-capped.

        The viewer reads the newest frame each time: one that reads slowly skips frames,
        and the graph never waits for it.
        """
        sid = request.match_info["id"]
        if sid not in self.runtime.sources:
            return _error(404, f"no source {sid!r}")
        try:
            fps = float(request.query.get("fps", MJPEG_FPS))
        except ValueError:
            fps = -1.0
        if not 0.1 <= fps <= MJPEG_MAX_FPS:
            return _error(400, f"fps: expected a number from 0.1 to {MJPEG_MAX_FPS:g}")
        sub = self.runtime.outputs.relay.subscribe(sid, fps)
        try:
            response = web.StreamResponse(
                headers={"Content-Type": f"multipart/x-mixed-replace; boundary={MJPEG_BOUNDARY}"}
            )
            await response.prepare(request)
            loop = asyncio.get_running_loop()
            due = loop.time()
            while (item := await sub.next()) is not None:
                jpeg = await asyncio.to_thread(item.jpeg)
                head = (
                    f"--{MJPEG_BOUNDARY}\r\nContent-Type: image/jpeg\r\n"
                    f"Content-Length: {len(jpeg)}\r\nX-Frame-Index: {item.index}\r\n\r\n"
                )
                await response.write(head.encode() + jpeg + b"\r\n")
                due = max(due + 1.0 / fps, loop.time())
                await asyncio.sleep(due - loop.time())
        except (ConnectionResetError, ConnectionError):
            pass  # the viewer went away
        finally:
            sub.close()
        return response

    @property
    def whep(self) -> WhepServer:
        """The WHEP viewers' sessions."""
        if self._whep is None:
            self._whep = WhepServer(self.runtime.outputs.relay)
        return self._whep

    async def whep_offer(self, request: web.Request) -> web.Response:
        sid = request.match_info["id"]
        if sid not in self.runtime.sources:
            return _error(404, f"no source {sid!r}")
        offer = await _read_sdp(request)
        if isinstance(offer, web.Response):
            return offer
        guarded = self._guard_offer(request, offer)
        if isinstance(guarded, web.Response):
            return guarded
        offer, unconnected = guarded
        try:
            session, answer = await self.whep.offer(sid, offer, unconnected)
        except WhepEgressError as exc:
            unconnected.settled()
            return _error(exc.status, exc.message)
        return web.Response(
            status=201, text=answer, content_type="application/sdp",
            headers={"Location": f"/whep/{sid}/{session}"},
        )  # fmt: skip

    async def whep_delete(self, request: web.Request) -> web.Response:
        sid, session = request.match_info["id"], request.match_info["session"]
        if not await self.whep.end(session, sid):
            return _error(404, f"no active WHEP session {session!r} for {sid!r}")
        return web.Response(status=200)

    # -- stats -------------------------------------------------------------------------------

    async def _sample_rates(self) -> None:
        while True:
            now = time.monotonic()
            for sid, run in list(self.runtime.sources.items()):
                self._rates.setdefault(sid, collections.deque(maxlen=RATE_WINDOW)).append(
                    (now, run.published)
                )
            for sid in set(self._rates) - set(self.runtime.sources):
                del self._rates[sid]
            await asyncio.sleep(1.0)

    def _fps(self, sid: str, published: int) -> float | None:
        samples = self._rates.get(sid)
        if not samples:
            return None
        t0, p0 = samples[0]
        elapsed = time.monotonic() - t0
        if elapsed < 0.5:
            return None
        return round((published - p0) / elapsed, 2)

    async def stats(self, request: web.Request) -> web.Response:
        report = self.runtime.report()
        sources = [
            {
                "id": src.id,
                "state": src.state.value,
                "reason": src.reason,
                "fps": self._fps(src.id, src.published),
                "latency_ms": {"p50": src.latency_ms.p50, "p99": src.latency_ms.p99},
                "published": src.published,
                "dropped": sum(src.dropped.values()),
                "dropped_by_reason": dict(src.dropped),
                "queue_depth": src.queue_depth,
                "overload": _overload_json(src.overload),
            }
            for src in report.sources
        ]
        models = [_model_json(m) for m in report.models if m.batches]
        return web.json_response({"time": report.time, "sources": sources, "models": models})

    async def models(self, request: web.Request) -> web.Response:
        repo = self.runtime.models
        if repo is None:
            return web.json_response([])
        return web.json_response([_jsonable(s) for s in repo.status()])

    async def reload_model(self, request: web.Request) -> web.Response:
        """Re-read a model's config.yaml and files and swap the new copy in once it is ready.

        Requests already queued on the old copy finish; if the new copy fails, the old
        one keeps serving and the answer (422) says why.
        """
        name = request.match_info["name"]
        raw = await _read_body(request, "application/json", MAX_RELOAD_BODY_BYTES, "reload body")
        if isinstance(raw, web.Response):
            return raw
        try:
            data = _parse_json(raw) if raw.strip() else {}
        except ValueError as exc:
            return _error(400, f"body: {exc}")
        if not isinstance(data, dict) or set(data) - {"force"}:
            return _error(400, 'body: expected {} or {"force": true}')
        force = data.get("force", False)
        if not isinstance(force, bool):
            return _error(400, f"force: expected true or false, got {force!r}")
        force = force or request.query.get("force") in ("1", "true")
        repo = self.runtime.models
        if repo is None or name not in repo.names():
            return _error(404, f"no model {name!r} in the repository")
        if name not in self.runtime.config.models_used() and not force:
            # Loading a model nobody uses costs memory and time for nothing; ask for it explicitly.
            return _error(
                409,
                f'model {name!r} is not used by this pipeline; send {{"force": true}} to reload it anyway',
            )
        task = self._reloads.get(name)
        if task is None:
            task = self._reloads[name] = asyncio.create_task(self._reload(name), name=f"reload-{name}")
            task.add_done_callback(lambda _: self._reloads.pop(name, None))
        # shield: a client that hangs up must not cancel the reload others wait for.
        status, body = await asyncio.shield(task)
        return web.json_response(body, status=status)

    async def _reload(self, name: str) -> tuple[int, dict[str, Any]]:
        repo = self.runtime.models
        assert repo is not None
        status = await repo.reload(name)
        body = _jsonable(status)
        if status.state is not ModelState.READY or status.reason:
            body["error"] = status.reason or f"model {name} is {status.state.value}"
            return 422, body
        log.info("model %s reloaded", name)
        return 200, body

    # -- WHIP --------------------------------------------------------------------------------

    def _guard_offer(self, request: web.Request, offer: str) -> tuple[str, PendingSession] | web.Response:
        """The offer with only allowed ICE candidates, counted as pending for its client."""
        try:
            return self.webrtc.filter_offer(offer), self.webrtc.admit(request.remote or "")
        except OfferRefused as exc:
            return _error(exc.status, exc.message)

    def _whip_source(self, name: str) -> WhipSource | None:
        for run in self.runtime.sources.values():
            if isinstance(run.source, WhipSource) and run.source.name == name:
                return run.source
        return None

    async def whip_offer(self, request: web.Request) -> web.Response:
        name = request.match_info["name"]
        source = self._whip_source(name)
        if source is None:
            return _error(404, f"no whip:// source named {name!r}")
        offer = await _read_sdp(request)
        if isinstance(offer, web.Response):
            return offer
        guarded = self._guard_offer(request, offer)
        if isinstance(guarded, web.Response):
            return guarded
        offer, unconnected = guarded
        try:
            session, answer = await source.accept(offer, unconnected)
        except WhipError as exc:
            unconnected.settled()
            return _error(exc.status, exc.message)
        return web.Response(
            status=201,
            text=answer,
            content_type="application/sdp",
            headers={"Location": f"/whip/{name}/{session}"},
        )

    async def whip_delete(self, request: web.Request) -> web.Response:
        name = request.match_info["name"]
        source = self._whip_source(name)
        if source is None or not await source.end_session(request.match_info["session"]):
            return _error(404, f"no active WHIP session {request.match_info['session']!r} for {name!r}")
        return web.Response(status=200)

    # -- dashboard ---------------------------------------------------------------------------

    async def dashboard(self, request: web.Request) -> web.FileResponse:
        return web.FileResponse(WEB_DIR / "index.html", headers={"Content-Type": "text/html"})


def _host_name(host: str) -> str:
    """The name in a Host header, without the port (``[::1]:8080`` -> ``::1``)."""
    if host.startswith("["):
        return host[1 : host.find("]")] if "]" in host else host
    return host.rsplit(":", 1)[0] if host.count(":") == 1 else host


def _reject_constant(name: str) -> Any:
    raise ValueError(f"{name} is not allowed")


def _unique_keys(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for key, value in pairs:
        if key in out:
            # Parsers disagree on which duplicate wins; refuse rather than guess.
            raise ValueError(f"duplicate key {key!r}")
        out[key] = value
    return out


def _parse_json(body: bytes) -> Any:
    """An API request body; ValueError says what is wrong with it."""
    try:
        return json.loads(body, parse_constant=_reject_constant, object_pairs_hook=_unique_keys)
    except RecursionError:
        raise ValueError("not valid JSON (nested too deeply)") from None
    except ValueError as exc:
        if str(exc).startswith("duplicate key"):
            raise
        raise ValueError(f"not valid JSON ({exc})") from None


def _origin(url: str) -> str:
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


def _readiness_counts(report: PipelineReport) -> dict[str, Any]:
    """What /readyz tells a caller without the token: numbers, no names."""
    needed = set(report.models_needed)
    return {
        "sources": len(report.sources),
        "sources_up": sum(src.state is SourceState.UP for src in report.sources),
        "models": len(needed),
        "models_ready": sum(m.state is ModelState.READY for m in report.models if m.name in needed),
        "nats_connected": report.nats_connected,
    }


def _source_json(src: SourceReport) -> dict[str, Any]:
    return {
        "id": src.id,
        "url": src.url,
        "state": src.state.value,
        "reason": src.reason,
        "live": src.live,
        "frames": src.frames,
        "published": src.published,
        "dropped": dict(src.dropped),
        "reconnects": src.reconnects,
        "queue_depth": src.queue_depth,
    }


def _overload_json(overload: Overload | None) -> dict[str, Any] | None:
    """A source that cannot keep up (pipeline.overload), with the log line's text."""
    return None if overload is None else {**_jsonable(overload), "message": overload.message()}


def _model_json(model: ModelReport) -> dict[str, Any]:
    return {
        "model": model.name,
        "batches": model.batches,
        "requests": model.requests,
        "mean_batch_size": model.mean_batch_size,
        "batch_sizes": {str(size): n for size, n in sorted(model.batch_sizes.items())},
        "queue_ms": {"p50": model.queue_ms.p50, "p99": model.queue_ms.p99},
    }


def _jsonable(value: Any) -> Any:
    """Dataclasses, enums, tuples and paths as JSON values."""
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return {f.name: _jsonable(getattr(value, f.name)) for f in dataclasses.fields(value)}
    if isinstance(value, enum.Enum):
        return value.value
    if isinstance(value, dict):
        return {str(k): _jsonable(v) for k, v in value.items()}
    if isinstance(value, (list, tuple, set, frozenset)):
        return [_jsonable(v) for v in value]
    if value is None or isinstance(value, (str, int, float, bool)):
        return value
    if isinstance(value, np.generic):
        return value.item()
    return str(value)


__all__ = ["ApiConfigError", "ApiServer", "is_loopback", "parse_listen"]
