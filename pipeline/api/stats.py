"""``GET /v1/stats``: per source fps, latency, drops and overload; per model batching.

What the dashboard polls: the runtime's :class:`~pipeline.stats.PipelineReport`, whose
``fps`` is each source's published-message rate over its last few seconds, kept by the
source's own counters (:class:`~pipeline.counters.SourceCounters`).
"""

from __future__ import annotations

from typing import Any

from aiohttp import web

from pipeline.api.answers import jsonable
from pipeline.runtime import Runtime
from pipeline.stats import ModelReport, Overload


def overload_json(overload: Overload | None) -> dict[str, Any] | None:
    """A source that cannot keep up (pipeline.overload), with the log line's text."""
    return None if overload is None else {**jsonable(overload), "message": overload.message()}


def model_json(model: ModelReport) -> dict[str, Any]:
    return {
        "model": model.name,
        "batches": model.batches,
        "requests": model.requests,
        "mean_batch_size": model.mean_batch_size,
        "batch_sizes": {str(size): n for size, n in sorted(model.batch_sizes.items())},
        "queue_ms": {"p50": model.queue_ms.p50, "p99": model.queue_ms.p99},
    }


class StatsRoutes:
    """``GET /v1/stats``, from the runtime's report."""

    def __init__(self, runtime: Runtime) -> None:
        self._runtime = runtime

    def add_to(self, router: web.UrlDispatcher) -> None:
        router.add_get("/v1/stats", self.stats)

    async def stats(self, request: web.Request) -> web.Response:
        report = self._runtime.report()
        sources = [
            {
                "id": src.id,
                "state": src.state.value,
                "reason": src.reason,
                "fps": src.fps,
                "latency_ms": {"p50": src.latency_ms.p50, "p99": src.latency_ms.p99},
                "published": src.published,
                "dropped": sum(src.dropped.values()),
                "dropped_by_reason": dict(src.dropped),
                "queue_depth": src.queue_depth,
                "overload": overload_json(src.overload),
            }
            for src in report.sources
        ]
        models = [model_json(m) for m in report.models if m.batches]
        return web.json_response({"time": report.time, "sources": sources, "models": models})
