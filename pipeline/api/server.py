"""``ApiServer``: the one aiohttp server, its middleware and the route modules it mounts.

::

    http:
      listen: 127.0.0.1:8080
      keepalive_timeout: 15.0    # seconds an idle keep-alive connection stays open

Every request passes, in order: errors as JSON (:mod:`~pipeline.api.answers`),
the cross-site refusal (:mod:`~pipeline.api.cross_site`), then the token
(:mod:`~pipeline.api.auth`); every answer gets the security headers. Connections
are accepted by :class:`~pipeline.http_guard.GuardedSite` (caps, header deadline).
"""

from __future__ import annotations

import logging
import resource

from aiohttp import web

from pipeline.api.answers import errors_as_json
from pipeline.api.auth import BearerAuth
from pipeline.api.cross_site import AllowedOrigins, refuse_cross_site
from pipeline.api.dashboard import add_dashboard
from pipeline.api.fleet import FleetRoutes
from pipeline.api.listen import bind, check_http_config, connection_cap
from pipeline.api.models import ModelRoutes
from pipeline.api.probes import ProbeRoutes
from pipeline.api.sources import SourceRoutes
from pipeline.api.stats import StatsRoutes
from pipeline.api.views import EMBEDDABLE, ViewRoutes
from pipeline.api.webrtc import WebRtcRoutes, offer_guard
from pipeline.config import HttpConfig
from pipeline.fleet.worker import FleetWorker
from pipeline.http_guard import GuardedSite
from pipeline.outputs.whep import WhepServer
from pipeline.runtime import Runtime
from pipeline.webrtc_guard import OfferGuard

log = logging.getLogger("vidpipe.api")

MAX_BODY_BYTES = 1024 * 1024


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
        self.port: int | None = None
        self._runner: web.AppRunner | None = None
        self.site: GuardedSite | None = None
        origins = AllowedOrigins(config.allowed_origins, EMBEDDABLE)
        self._auth = BearerAuth(config.token, origins)
        views = ViewRoutes(runtime)
        self._webrtc = WebRtcRoutes(runtime, offer_guard(config, self.host), fleet)
        fleet_routes = FleetRoutes(fleet)
        self.app = web.Application(
            client_max_size=max_body, middlewares=[errors_as_json, refuse_cross_site, self._auth.middleware]
        )
        self.app.on_response_prepare.append(origins.security_headers)
        # Registered in this order so that routes on one path share one resource.
        router = self.app.router
        ProbeRoutes(runtime, self._auth, fleet).add_to(router)
        SourceRoutes(runtime, config, fleet_routes, on_removed=(views.forget,)).add_to(router)
        views.add_to(router)
        origins.add_to(router)
        StatsRoutes(runtime).add_to(router)
        fleet_routes.add_to(router)
        ModelRoutes(runtime).add_to(router)
        self._webrtc.add_to(router)
        add_dashboard(router)

    @property
    def url(self) -> str:
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"http://{host}:{self.port}"

    @property
    def webrtc(self) -> OfferGuard:
        """What WHIP and WHEP offers may ask: candidate ranges, pending sessions per client."""
        return self._webrtc.guard

    @property
    def whep(self) -> WhepServer:
        """The WHEP viewers' sessions."""
        return self._webrtc.whep

    async def start(self) -> None:
        """Bind and serve; ``port`` then holds the actual port (useful with port 0)."""
        sock = bind(self.host, self._requested_port, self.config.listen)
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
        # No access log: the dashboard polls every second; failures are logged by errors_as_json.
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
        log.info("HTTP API on %s%s", self.url, " (bearer token required)" if self._auth.required else "")

    async def stop(self) -> None:
        # Live views end first: a streaming response would otherwise hold cleanup up.
        self.runtime.outputs.relay.end_all()
        await self._webrtc.close()
        if self.site is not None:
            # Not one of the runner's sites: stop accepting before the runner closes connections.
            await self.site.stop()
        if self._runner is not None:
            await self._runner.cleanup()
            self._runner = None
