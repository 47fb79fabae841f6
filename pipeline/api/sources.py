"""The sources API: ``GET /v1/sources``, ``POST /v1/sources``, ``DELETE /v1/sources/{id}``.

::

    http:
      file_roots: []             # folders POST /v1/sources may open files in; none by default
      source_schemes: [file, test, rtsp, rtsps, whip, http, https, udp, rtp, srt]  # not v4l2

A posted source is the same JSON object as a YAML source (``{"url": ..., "id": ...}``),
read by :func:`pipeline.config.parse_source` under the API's
:class:`~pipeline.config.SourcePolicy`. Each listed source is its
:class:`~pipeline.stats.SourceReport`.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Collection, Iterable
from pathlib import Path
from typing import Any

from aiohttp import web

from inference.schema import ConfigError
from pipeline.api.answers import error
from pipeline.api.bodies import parse_json
from pipeline.api.fleet import FleetRoutes
from pipeline.config import HttpConfig, SourcePolicy, SourceRefused, parse_source
from pipeline.runtime import Runtime, SourceLimitError, WhipNameTaken
from pipeline.sources.base import SourceError
from pipeline.stats import SourceReport

log = logging.getLogger("vidpipe.api")


def source_json(src: SourceReport) -> dict[str, Any]:
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


class SourceRoutes:
    """List, add and remove sources; in a fleet, add to and remove from its desired set."""

    def __init__(
        self,
        runtime: Runtime,
        config: HttpConfig,
        fleet: FleetRoutes,
        on_removed: Iterable[Callable[[str], None]] = (),
    ) -> None:
        self._runtime = runtime
        self._config = config
        self._fleet = fleet
        # What other routes keep per source (a cached snapshot, fps samples), forgotten at once.
        self._on_removed = tuple(on_removed)

    def add_to(self, router: web.UrlDispatcher) -> None:
        router.add_get("/v1/sources", self.list_sources)
        router.add_post("/v1/sources", self.add_source)
        router.add_get("/v1/sources/{id}", self.get_source)
        router.add_delete("/v1/sources/{id}", self.delete_source)

    async def list_sources(self, request: web.Request) -> web.Response:
        return web.json_response([source_json(s) for s in self._runtime.report().sources])

    async def get_source(self, request: web.Request) -> web.Response:
        sid = request.match_info["id"]
        run = self._runtime.sources.get(sid)
        if run is None:
            return error(404, f"no source {sid!r}")
        return web.json_response(source_json(run.report()))

    async def add_source(self, request: web.Request) -> web.Response:
        # JSON only: a cross-site form or no-cors fetch cannot send this type without a
        # CORS preflight, which this server never grants.
        if request.content_type != "application/json":
            return error(415, f"Content-Type must be application/json, got {request.content_type!r}")
        body = await request.read()  # over client_max_size: 413 via the error middleware
        try:
            data = parse_json(body)
        except ValueError as exc:
            return error(400, f"body: {exc}")
        runtime = self._runtime
        base_dir = runtime.config.base_dir
        policy = SourcePolicy.from_http(self._config, base_dir)
        # An id derived from the URL is unique among the running (or the fleet's desired) sources;
        # the fleet's are read only when an id is to be derived.
        sources = runtime.sources
        taken: Collection[str] = sources
        if self._fleet.active and not (isinstance(data, dict) and data.get("id") is not None):
            unsure = await self._fleet.unsure()
            if unsure is not None:
                return unsure
            taken = self._fleet.taken_ids()
        try:
            config = parse_source(data, base_dir=base_dir, taken_ids=taken, policy=policy, file="request")
        except ConfigError as exc:
            hint = f" (hint: {exc.hint})" if exc.hint else ""
            return error(403 if isinstance(exc, SourceRefused) else 400, f"{exc.path}: {exc.problem}{hint}")
        if self._fleet.active:
            return await self._fleet.add(config)  # a file may be on another worker's disk
        if config.scheme == "file":
            # Inside http.file_roots (the policy checked that): a missing file is the caller's
            # mistake, said now rather than as a source that fails at once.
            path = Path(config.url)
            if path.is_dir():
                return error(400, f"sources.url: {path} is a folder, not a video file")
            if not path.is_file():
                return error(400, f"sources.url: file not found: {path}")
        sid = config.source_id
        if sid in sources:
            return error(409, f"sources.id: source {sid!r} already exists; DELETE it first")
        try:
            run = runtime.add_source(config)
        except SourceLimitError as exc:
            return error(429, str(exc))
        except SourceError as exc:
            return error(400, f"sources.url: {exc}")
        except WhipNameTaken as exc:
            return error(409, f"sources.url: {exc}; give this publisher another name")
        except ValueError as exc:
            return error(409, f"sources.id: {exc}")
        log.info("source %s added over the API (%s)", sid, run.source.display_url)
        return web.json_response(
            source_json(run.report()), status=201, headers={"Location": f"/v1/sources/{sid}"}
        )

    async def delete_source(self, request: web.Request) -> web.Response:
        sid = request.match_info["id"]
        if self._fleet.active:
            return await self._fleet.remove(sid)
        last = set(self._runtime.sources) == {sid}
        if last:
            # An operator emptying the run over the API is managing its sources there: the
            # run stays up for the next one rather than ending as if its files had ended.
            self._runtime.keep_running()
        if not await self._runtime.remove_source(sid):
            return error(404, f"no source {sid!r}")
        for forget in self._on_removed:
            forget(sid)
        left = "; no sources left, the run stays up" if last else ""
        log.info("source %s removed over the API%s", sid, left)
        return web.Response(status=204)
