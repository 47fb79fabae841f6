"""WebRTC signalling: WHIP ingest (``/whip/{name}``) and the WHEP live view (``/whep/{id}``).

::

    sources:
      - url: whip://door          # a browser or OBS pushes to POST /whip/door
    http:
      ice_networks: null          # address ranges ICE candidates may name; null: those of http.listen
      max_pending_webrtc_per_client: 4

``POST`` takes an ``application/sdp`` offer and answers 201 with the SDP answer and
the session's URL in ``Location``; ``DELETE`` on that URL ends the session. Every
offer first passes the :class:`~pipeline.webrtc_guard.OfferGuard` (allowed ICE
candidates, pending sessions per client). ``PATCH`` on a session URL (trickle ICE,
ICE restart) gets 405 with ``Allow: DELETE`` and what to do instead.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from aiohttp import web

from pipeline.api.answers import error, log
from pipeline.api.bodies import read_body
from pipeline.config import HttpConfig
from pipeline.outputs.whep import WhepError as WhepEgressError
from pipeline.outputs.whep import WhepServer
from pipeline.runtime import Runtime
from pipeline.sources.whip import MAX_SDP_BYTES, WhipError, WhipSource
from pipeline.webrtc_guard import (
    OfferGuard,
    OfferRefused,
    PendingSession,
    default_ice_networks,
    parse_network,
)

if TYPE_CHECKING:
    from pipeline.fleet.worker import FleetWorker


# Neither trickle ICE nor ICE restarts are taken, so PATCH is not a method of a session
# (RFC 9110's 405, with Allow); a trickling client is told what works instead.
NO_PATCH = (
    "PATCH is not supported: this server takes no trickle ICE or ICE restart; put the ICE "
    "candidates in the offer (send it once ICE gathering is complete), and DELETE this URL "
    "to end the session"
)


def offer_guard(config: HttpConfig, host: str) -> OfferGuard:
    """What WHIP and WHEP offers may ask of a server listening on ``host``."""
    networks = [n for n in map(parse_network, config.ice_networks or []) if n is not None]
    return OfferGuard(
        networks if config.ice_networks is not None else default_ice_networks(host),
        config.max_pending_webrtc_per_client,
    )


async def read_sdp(request: web.Request) -> str | web.Response:
    """A WHIP or WHEP offer: the whole ``application/sdp`` body as text, or the error answer."""
    body = await read_body(request, "application/sdp", MAX_SDP_BYTES, "SDP offer")
    if isinstance(body, web.Response):
        return body
    try:
        return body.decode("utf-8")
    except UnicodeDecodeError:
        return error(400, "bad SDP offer: not UTF-8 text")


class WebRtcRoutes:
    """WHIP offers go to the named ``whip://`` source; WHEP viewers get a :class:`WhepServer` session."""

    def __init__(self, runtime: Runtime, guard: OfferGuard, fleet: FleetWorker | None = None) -> None:
        self._runtime = runtime
        self.guard = guard
        self._fleet = fleet
        # Created with the first WHEP viewer.
        self._whep: WhepServer | None = None

    def add_to(self, router: web.UrlDispatcher) -> None:
        router.add_post("/whip/{name}", self.whip_offer)
        router.add_delete("/whip/{name}/{session}", self.whip_delete)
        router.add_route("*", "/whip/{name}/{session}", self.session_other)
        router.add_post("/whep/{id}", self.whep_offer)
        router.add_delete("/whep/{id}/{session}", self.whep_delete)
        router.add_route("*", "/whep/{id}/{session}", self.session_other)

    @property
    def whep(self) -> WhepServer:
        """The WHEP viewers' sessions."""
        if self._whep is None:
            self._whep = WhepServer(self._runtime.outputs.relay)
        return self._whep

    async def close(self) -> None:
        """Wait for stopped WHIP sources' peer connections, and end every WHEP session."""
        # Peer connections of stopped WHIP sources close in the background; let them finish.
        for run in list(self._runtime.sources.values()):
            if isinstance(run.source, WhipSource) and run.source.stopping:
                await run.source.closed()
        if self._whep is not None:
            await self._whep.close()

    async def _read_offer(self, request: web.Request) -> tuple[str, PendingSession] | web.Response:
        """The request's SDP offer with only allowed ICE candidates, counted as pending for its client."""
        offer = await read_sdp(request)
        if isinstance(offer, web.Response):
            return offer
        try:
            return self.guard.filter_offer(offer), self.guard.admit(request.remote or "")
        except OfferRefused as exc:
            return error(exc.status, exc.message)

    async def session_other(self, request: web.Request) -> web.Response:
        """Any method but DELETE on a WHIP or WHEP session URL, whatever the session: 405.

        A ``PATCH`` (trickle ICE, ICE restart) is told what works instead.
        """
        message = NO_PATCH if request.method == "PATCH" else "Method Not Allowed"
        return error(405, message, {"Allow": "DELETE"})

    # -- WHIP --------------------------------------------------------------------------------

    def _whip_source(self, name: str) -> WhipSource | None:
        for run in self._runtime.sources.values():
            if isinstance(run.source, WhipSource) and run.source.name == name:
                return run.source
        return None

    async def whip_offer(self, request: web.Request) -> web.Response:
        name = request.match_info["name"]
        source = self._whip_source(name)
        if source is None:
            return self._not_here(name)
        guarded = await self._read_offer(request)
        if isinstance(guarded, web.Response):
            return guarded
        offer, unconnected = guarded
        try:
            session, answer = await source.accept(offer, unconnected)
        except WhipError as exc:
            unconnected.settled()
            return error(exc.status, exc.message)
        return web.Response(
            status=201,
            text=answer,
            content_type="application/sdp",
            headers={"Location": f"/whip/{name}/{session}"},
        )

    def _not_here(self, name: str) -> web.Response:
        """No source here takes ``whip://name``; in a fleet, say which worker does, or that none does yet."""
        runner = self._fleet.whip_runner(name) if self._fleet is not None else None
        if self._fleet is None or runner is None:
            return error(404, f"no whip:// source named {name!r}")
        sid, worker = runner
        where = f"whip://{name} (source {sid!r}) of fleet {self._fleet.name}"
        if worker is None or worker == self._fleet.id:
            # Placed a moment from now (a claim, a start, a takeover): worth a retry.
            return error(503, f"{where} is not running yet; retry", {"Retry-After": "2"})
        return error(
            404,
            f"{where} runs on worker {worker!r}, not this one: publish there "
            "(GET /v1/fleet lists who runs what)",
        )

    async def whip_delete(self, request: web.Request) -> web.Response:
        name = request.match_info["name"]
        source = self._whip_source(name)
        if source is None or not await source.end_session(request.match_info["session"]):
            return error(404, f"no active WHIP session {request.match_info['session']!r} for {name!r}")
        return web.Response(status=200)

    # -- WHEP --------------------------------------------------------------------------------

    async def whep_offer(self, request: web.Request) -> web.Response:
        sid = request.match_info["id"]
        if sid not in self._runtime.sources:
            return error(404, f"no source {sid!r}")
        guarded = await self._read_offer(request)
        if isinstance(guarded, web.Response):
            return guarded
        offer, unconnected = guarded
        try:
            session, answer = await self.whep.offer(sid, offer, unconnected)
        except WhepEgressError as exc:
            unconnected.settled()
            return error(exc.status, exc.message)
        return web.Response(
            status=201, text=answer, content_type="application/sdp",
            headers={"Location": f"/whep/{sid}/{session}"},
        )  # fmt: skip

    async def whep_delete(self, request: web.Request) -> web.Response:
        sid, session = request.match_info["id"], request.match_info["session"]
        if not await self.whep.end(session, sid):
            return error(404, f"no active WHEP session {session!r} for {sid!r}")
        log.info("source %s: WHEP session %s ended: the viewer ended it (DELETE)", sid, session)
        return web.Response(status=200)
