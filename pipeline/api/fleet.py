"""The API of a fleet worker: ``GET /v1/fleet``, and the sources API acting on the desired set.

::

    fleet: {name: cameras}     # or vidpipe run CONFIG --fleet cameras

In a fleet, ``POST /v1/sources`` adds to the fleet's desired sources (202; the
placement loop of some worker starts it) and ``DELETE /v1/sources/{id}`` removes
from them; ``/v1/fleet`` shows the workers and who owns each source. docs/fleet.md.
"""

from __future__ import annotations

import logging
from collections.abc import Collection

from aiohttp import web

from pipeline.api.answers import error
from pipeline.config import SourceConfig
from pipeline.fleet.desired import check_source
from pipeline.fleet.worker import FleetWorker
from pipeline.sources.base import SourceError

log = logging.getLogger("vidpipe.api")

# How long a request that changes the desired set waits for a view of it being read
# again (after a reconnect) before it is answered 503.
VIEW_WAIT_S = 5.0


class FleetRoutes:
    """``GET /v1/fleet`` (404 outside a fleet) and the desired set behind the sources API."""

    def __init__(self, fleet: FleetWorker | None) -> None:
        self._fleet = fleet

    def add_to(self, router: web.UrlDispatcher) -> None:
        router.add_get("/v1/fleet", self.status)

    @property
    def active(self) -> bool:
        """Whether this server is a fleet worker's (the sources API then changes the desired set)."""
        return self._fleet is not None

    def taken_ids(self) -> Collection[str]:
        """The desired sources' ids: a live view of the keys, no per-request copy or decode."""
        assert self._fleet is not None
        return self._fleet.desired_ids()

    async def unsure(self) -> web.Response | None:
        """A 503 while this worker's view of the desired set is not whole (after a short wait)."""
        fleet = self._fleet
        assert fleet is not None
        if await fleet.desired_whole(VIEW_WAIT_S):
            return None
        answer = error(
            503,
            f"fleet {fleet.name}: this worker is still reading the desired sources "
            "(after a reconnect to NATS); retry in a few seconds",
        )
        answer.headers["Retry-After"] = "5"
        return answer

    async def add(self, config: SourceConfig) -> web.Response:
        """Add to the fleet's desired sources; the worker placement picks starts it (202)."""
        fleet = self._fleet
        assert fleet is not None and fleet.desired is not None
        # The cap counts the whole set, never the part a view being read again holds.
        unsure = await self.unsure()
        if unsure is not None:
            return unsure
        taken = fleet.desired_ids()
        sid = config.source_id
        if len(taken) >= fleet.max_desired and sid not in taken:
            full = f"fleet {fleet.name} holds {len(taken)} sources (fleet.max_desired)"
            return error(429, f"{full}; remove one first")
        try:
            check_source(config)
        except SourceError as exc:
            return error(400, f"sources.url: {exc}")
        if not await fleet.desired.add(config):
            return error(
                409, f"sources.id: source {sid!r} already exists in fleet {fleet.name}; DELETE it first"
            )
        log.info("source %s added to fleet %s over the API", sid, fleet.name)
        return web.json_response(
            {"id": sid, "fleet": fleet.name, "desired": True},
            status=202,
            headers={"Location": f"/v1/sources/{sid}"},
        )

    async def remove(self, sid: str) -> web.Response:
        """Remove from the fleet's desired sources; its owner stops it (204)."""
        fleet = self._fleet
        assert fleet is not None and fleet.desired is not None
        if not await fleet.desired.remove(sid):
            return error(404, f"no source {sid!r} in fleet {fleet.name}")
        log.info("source %s removed from fleet %s over the API", sid, fleet.name)
        return web.Response(status=204)

    async def status(self, request: web.Request) -> web.Response:
        if self._fleet is None:
            return error(404, "not in a fleet; run with --fleet NAME or fleet: in the config")
        return web.json_response(self._fleet.status())
