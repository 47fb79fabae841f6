"""``GET /v1/stats``: per source fps, latency, drops and overload; per model batching.

What the dashboard polls. Everything but ``fps`` is the runtime's
:class:`~pipeline.stats.PipelineReport`; ``fps`` is the published-frame rate over
the last :data:`RATE_WINDOW` seconds, sampled here once a second
(:class:`FpsSampler`).
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import time
from typing import Any

from aiohttp import web

from pipeline.api.answers import jsonable
from pipeline.runtime import Runtime
from pipeline.stats import ModelReport, Overload

RATE_WINDOW = 5  # seconds of samples behind the fps figure


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


class FpsSampler:
    """Each source's published count once a second, the last :data:`RATE_WINDOW` samples kept."""

    def __init__(self, runtime: Runtime) -> None:
        self._runtime = runtime
        self._rates: dict[str, collections.deque[tuple[float, int]]] = {}
        self._task: asyncio.Task[None] | None = None

    def start(self) -> None:
        self._task = asyncio.create_task(self._sample(), name="api-rates")

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task

    def forget(self, sid: str) -> None:
        """A removed source's samples: gone now, not at the next sample."""
        self._rates.pop(sid, None)

    async def _sample(self) -> None:
        while True:
            now = time.monotonic()
            for sid, run in list(self._runtime.sources.items()):
                self._rates.setdefault(sid, collections.deque(maxlen=RATE_WINDOW)).append(
                    (now, run.published)
                )
            for sid in set(self._rates) - set(self._runtime.sources):
                del self._rates[sid]
            await asyncio.sleep(1.0)

    def fps(self, sid: str, published: int) -> float | None:
        samples = self._rates.get(sid)
        if not samples:
            return None
        t0, p0 = samples[0]
        elapsed = time.monotonic() - t0
        if elapsed < 0.5:
            return None
        return round((published - p0) / elapsed, 2)


class StatsRoutes:
    """``GET /v1/stats``, from the runtime's report and the fps sampler."""

    def __init__(self, runtime: Runtime, rates: FpsSampler) -> None:
        self._runtime = runtime
        self._rates = rates

    def add_to(self, router: web.UrlDispatcher) -> None:
        router.add_get("/v1/stats", self.stats)

    async def stats(self, request: web.Request) -> web.Response:
        report = self._runtime.report()
        sources = [
            {
                "id": src.id,
                "state": src.state.value,
                "reason": src.reason,
                "fps": self._rates.fps(src.id, src.published),
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
