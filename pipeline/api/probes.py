"""What orchestrators and scrapers read: ``/healthz``, ``/readyz`` and ``/metrics``.

``/healthz`` fails only when this process is stuck (its event loop, in a fleet its
own loops), never for an outage outside it; ``/readyz`` says that (NATS, models,
sources). Both never need the token (a probe has no secrets); with a
token configured, ``/readyz`` shows callers without it counts only, no source ids
or reasons. The verdicts come from :mod:`pipeline.health` over the runtime's
:class:`~pipeline.stats.PipelineReport`.
"""

from __future__ import annotations

from typing import Any

from aiohttp import web

from inference.model import ModelState
from pipeline.api.auth import BearerAuth
from pipeline.fleet.worker import FleetWorker
from pipeline.health import readiness_problems
from pipeline.runtime import Runtime
from pipeline.sources.base import SourceState
from pipeline.stats import PipelineReport

PROMETHEUS_TEXT = "text/plain; version=0.0.4; charset=utf-8"


def readiness_counts(report: PipelineReport) -> dict[str, Any]:
    """What /readyz tells a caller without the token: numbers, no names."""
    needed = set(report.models_needed)
    return {
        "sources": len(report.sources),
        "sources_up": sum(src.state is SourceState.UP for src in report.sources),
        "models": len(needed),
        "models_ready": sum(m.state is ModelState.READY for m in report.models if m.name in needed),
        "nats_connected": report.nats_connected,
    }


class ProbeRoutes:
    """``GET /healthz``, ``GET /readyz``, ``GET /metrics``."""

    def __init__(self, runtime: Runtime, auth: BearerAuth, fleet: FleetWorker | None) -> None:
        self._runtime = runtime
        self._auth = auth
        # In a fleet: a worker whose loops are stuck is not live; one cut off from NATS
        # or its buckets is not ready.
        self._fleet = fleet

    def add_to(self, router: web.UrlDispatcher) -> None:
        router.add_get("/healthz", self.healthz)
        router.add_get("/readyz", self.readyz)
        router.add_get("/metrics", self.metrics)

    async def healthz(self, request: web.Request) -> web.Response:
        problem = self._fleet.health_problem() if self._fleet is not None else None
        if problem is not None:
            return web.json_response({"status": "failing", "reason": problem}, status=503)
        return web.json_response({"status": "ok"})

    async def readyz(self, request: web.Request) -> web.Response:
        report = self._runtime.report()
        reasons = readiness_problems(report, sources_required=self._sources_required())
        fleet_problem = self._fleet.readiness_problem() if self._fleet is not None else None
        if fleet_problem is not None:
            reasons.append(fleet_problem)
        if self._auth.required and not self._auth.authorized(request):
            # A probe needs the verdict; source ids and reasons are for those with the token.
            counts = {"ready": not reasons, **readiness_counts(report)}
            return web.json_response(counts, status=503 if reasons else 200)
        if reasons:
            return web.json_response({"ready": False, "reasons": reasons}, status=503)
        return web.json_response({"ready": True, "reasons": []})

    def _sources_required(self) -> bool:
        """Whether running no source makes this pipeline not ready.

        Only where the configuration names its sources: one that names none waits for
        ``POST /v1/sources`` (which a load balancer routes only to a ready pipeline), and
        a fleet worker runs what placement gives it, maybe nothing while others run it all.
        """
        return bool(self._runtime.config.sources) and self._fleet is None

    async def metrics(self, request: web.Request) -> web.Response:
        # The classic text format: what Metrics.render() writes and every scraper reads.
        return web.Response(body=self._runtime.metrics.render(), headers={"Content-Type": PROMETHEUS_TEXT})
