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

import nats.errors
from aiohttp import web

from pipeline.api.answers import error
from pipeline.config import SourceConfig
from pipeline.fleet.desired import check_source
from pipeline.fleet.worker import FleetWorker
from pipeline.sources.base import SourceError
from pipeline.urls import whip_name

log = logging.getLogger("vidpipe.api")

# How long a request that changes the desired set waits for a view of it being read
# again (after a reconnect) before it is answered 503.
VIEW_WAIT_S = 5.0


# What the desired set's store raises when NATS does not answer in time or is gone.
STORE_ERRORS = (nats.errors.Error, TimeoutError, ConnectionError)


def _retry_later(message: str) -> web.Response:
    answer = error(503, message)
    answer.headers["Retry-After"] = "5"
    return answer


def _store_down(fleet: str, exc: BaseException, check: str) -> web.Response:
    """503 for a change whose outcome is unknown: NATS did not answer (it may have applied it)."""
    why = str(exc) or type(exc).__name__
    return _retry_later(
        f"fleet {fleet}: NATS did not answer ({why}); the change may or may not have been made: "
        f"{check} once NATS is back"
    )


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
        """A 503 while NATS is down, or this worker's view of the desired set is not whole
        (after a short wait)."""
        fleet = self._fleet
        assert fleet is not None
        if not fleet.connected:
            return _retry_later(f"fleet {fleet.name}: NATS is not connected; retry once it is back")
        if await fleet.desired_whole(VIEW_WAIT_S):
            return None
        return _retry_later(
            f"fleet {fleet.name}: this worker is still reading the desired sources "
            "(after a reconnect to NATS); retry in a few seconds"
        )

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
        owner = fleet.whip_owner(config)
        if owner is not None:
            return error(
                409,
                f"sources.url: whip name {whip_name(config.url)!r} is already used by source {owner!r} "
                f"in fleet {fleet.name}; give this publisher another name",
            )
        try:
            added = await fleet.desired.add(config)
        except STORE_ERRORS as exc:
            return _store_down(fleet.name, exc, f"GET /v1/fleet shows whether {sid!r} was added")
        if not added:
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
        if not fleet.connected:
            return _retry_later(f"fleet {fleet.name}: NATS is not connected; retry once it is back")
        try:
            removed = await fleet.desired.remove(sid)
        except STORE_ERRORS as exc:
            return _store_down(fleet.name, exc, f"GET /v1/fleet shows whether {sid!r} is still there")
        if not removed:
            return error(404, f"no source {sid!r} in fleet {fleet.name}")
        log.info("source %s removed from fleet %s over the API", sid, fleet.name)
        return web.Response(status=204)

    async def status(self, request: web.Request) -> web.Response:
        if self._fleet is None:
            return error(404, "not in a fleet; run with --fleet NAME or fleet: in the config")
        return web.json_response(self._fleet.status())
