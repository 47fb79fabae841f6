"""The graph runtime: sources in, stages, in-order publish out.

Shape: one asyncio task per frame walks the stages (see docs/architecture.md).
Per source:

    decode thread -> FrameQueue (block | drop_oldest) -> intake task
        -> frame task: unordered stages (infer, cascades)   up to max_in_flight at once
        -> publisher task: awaits frame tasks in arrival order, runs ordered stages
           (track and everything after it), then publishes.

So a source's messages leave in frame order even with several frames in flight,
model calls from all sources meet in each model's batcher, and every queue is
bounded: the FrameQueue by ``queue_size``, frames in flight by ``max_in_flight``.
"""

from __future__ import annotations

import asyncio
import logging
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from inference.repository import ModelRepository
from pipeline.config import PipelineConfig, SourceConfig
from pipeline.frames import Frame
from pipeline.metrics import Metrics
from pipeline.queues import EndOfStream, FrameQueue, OverflowPolicy
from pipeline.stages.base import Stage, StageContext, create_stage
from pipeline.stages.publish import Publisher
from pipeline.stages.source import Source, SourceError, SourceState, create_source

log = logging.getLogger("vidpipe.runtime")


class PipelineStartError(RuntimeError):
    """The pipeline cannot start; the message says why and what to do."""


def resolve_device(wanted: str) -> str:
    """``cpu`` or ``gpu`` for ``runtime.device``; asking for a GPU that is not there is an error."""
    if wanted == "cpu":
        return "cpu"
    from inference.device import gpu_available

    ok, reason = gpu_available()
    if ok:
        return "gpu"
    if wanted == "gpu":
        raise PipelineStartError(
            f"runtime.device: gpu is not usable here ({reason}); use device: cpu or auto"
        )
    log.info("runtime.device auto: using the CPU (%s)", reason)
    return "cpu"


@dataclass
class SourceRun:
    """A running source and its counters (what ``GET /v1/sources`` shows)."""

    config: SourceConfig
    source: Source
    queue: FrameQueue[Frame]
    intake: asyncio.Task[None] | None = None
    publisher: asyncio.Task[None] | None = None
    published: int = 0
    dropped: dict[str, int] = field(default_factory=dict)
    # The latest published frame (image and objects): what the dashboard's snapshot draws.
    last_frame: Frame | None = None
    # Tells this run of the source apart from earlier ones with the same id (frame
    # numbers start at 0 again); part of the JetStream de-duplication id.
    stream_id: str = field(default_factory=lambda: uuid.uuid4().hex[:12])
    latencies: list[float] = field(default_factory=list)

    def describe(self) -> dict[str, Any]:
        return {
            "id": self.source.id,
            "url": self.source.display_url,
            "state": self.source.state.value,
            "reason": self.source.reason,
            "live": self.source.live,
            "frames": self.source.stats.frames,
            "published": self.published,
            "dropped": dict(self.dropped),
            "reconnects": self.source.stats.reconnects,
            "queue_depth": len(self.queue),
        }


class _RateLimitedLog:
    """At most one log line per key per ``interval`` seconds, with a count of the rest."""

    def __init__(self, interval: float = 10.0) -> None:
        self.interval = interval
        self._last: dict[str, tuple[float, int]] = {}

    def __call__(self, key: str, message: str) -> None:
        now = time.monotonic()
        last, suppressed = self._last.get(key, (0.0, 0))
        if now - last >= self.interval:
            extra = f" ({suppressed} more since last report)" if suppressed else ""
            log.error("%s%s", message, extra)
            self._last[key] = (now, 0)
        else:
            self._last[key] = (last, suppressed + 1)


class Runtime:
    """Runs one pipeline until its finite sources end, a limit is reached, or it is stopped."""

    def __init__(
        self,
        config: PipelineConfig,
        *,
        nats_url: str,
        max_frames: int | None = None,
        metrics: Metrics | None = None,
        on_published: Callable[[Frame], None] | None = None,
    ) -> None:
        self.config = config
        self.nats_url = nats_url
        self.max_frames = max_frames
        self.metrics = metrics or Metrics()
        self.models: ModelRepository | None = None
        self.stages: list[Stage] = []
        self.publisher = Publisher(config.nats, nats_url, config.pipeline, self.metrics)
        self.publisher.on_sent = self._on_sent
        self.sources: dict[str, SourceRun] = {}
        self._stopping = asyncio.Event()
        self._idle = asyncio.Event()
        self._stage_error_log = _RateLimitedLog()
        self._unordered: list[Stage] = []
        self._ordered: list[Stage] = []
        self.started_at = 0.0
        # Called on the event loop after each frame is published (embedding, benchmarks).
        self._on_published = on_published
        self.device = "cpu"
        self._published = 0  # across every source, also removed ones
        self._persistent = False

    # -- lifecycle -------------------------------------------------------------------------

    async def start(self) -> None:
        """Load models, build stages, connect NATS and start every source."""
        await self.prepare()
        self.start_sources()

    async def prepare(self) -> None:
        """Everything but the sources: models, stages, the NATS connection."""
        self.started_at = time.time()
        self.device = resolve_device(self.config.runtime.device)
        await self._load_models()
        ctx = StageContext(config=self.config, models=self.models, metrics=self.metrics)
        self.stages = [create_stage(s, ctx) for s in self.config.stages]
        first_ordered = next((i for i, s in enumerate(self.stages) if s.ordered), len(self.stages))
        self._unordered = self.stages[:first_ordered]
        self._ordered = self.stages[first_ordered:]
        for stage in self.stages:
            await stage.start()
        await self.publisher.connect()
        log.info(
            "pipeline %s publishing to %s (%s)",
            self.config.pipeline,
            self.publisher.display_url,
            self.publisher.mode,
        )

    def start_sources(self) -> None:
        for src in self.config.sources:
            self.add_source(src)

    async def _load_models(self) -> None:
        names = sorted({s.model for s in self.config.stages if s.model})
        if not names:
            return
        root = self.config.models_path()
        assert root is not None  # checked by load_config
        if not root.is_dir():
            raise PipelineStartError(
                f"{self.config.file}: models: repository folder {root} not found; check the path"
            )
        self.models = ModelRepository(Path(root), observer=self.metrics)
        self.metrics.model_info.status = self.models.status
        for name in names:
            if name not in self.models.names():
                raise PipelineStartError(
                    f"{self.config.file}: model {name!r} is not in the repository {root} "
                    f"(it has: {', '.join(self.models.names()) or 'no models'})"
                )
            status = await self.models.load(name)
            if status.state.value != "ready":
                raise PipelineStartError(f"model {name} is unavailable: {status.reason}")
            log.info("model %s ready", name)

    def keep_running(self) -> None:
        """Do not end when the sources end (an API server may add more)."""
        self._persistent = True

    async def wait(self, duration: float | None = None) -> None:
        """Until every source has ended (or ``duration`` passed, or :meth:`request_stop`)."""
        waiters: list[asyncio.Future[Any]] = [asyncio.ensure_future(self._stopping.wait())]
        if not self._persistent:
            waiters.append(asyncio.ensure_future(self._all_sources_done()))
        try:
            await asyncio.wait(waiters, timeout=duration, return_when=asyncio.FIRST_COMPLETED)
        finally:
            for w in waiters:
                w.cancel()

    async def _all_sources_done(self) -> None:
        while True:
            intakes = [r.intake for r in self.sources.values() if r.intake is not None]
            if intakes and all(t.done() for t in intakes):
                return
            if not intakes and not self.sources:
                return
            self._idle.clear()
            pending = [t for t in intakes if not t.done()]
            await asyncio.wait([*pending, asyncio.ensure_future(self._idle.wait())],
                               return_when=asyncio.FIRST_COMPLETED)  # fmt: skip

    def request_stop(self) -> None:
        self._stopping.set()

    async def stop(self) -> None:
        """Graceful drain: stop intake, finish frames in flight, publish, flush NATS."""
        self._stopping.set()
        for run in self.sources.values():
            run.source.stop()
        intakes = [r.intake for r in self.sources.values() if r.intake is not None]
        if intakes:
            _, pending = await asyncio.wait(intakes, timeout=self.config.runtime.drain_timeout)
            for t in pending:
                t.cancel()
            if pending:
                log.warning("drain timed out; %d source(s) cancelled", len(pending))
        for run in self.sources.values():
            run.source.join(timeout=2.0)
        await self.publisher.close()
        for stage in self.stages:
            await stage.stop()
        if self.models is not None:
            await self.models.close()

    # -- sources ---------------------------------------------------------------------------

    def add_source(self, config: SourceConfig) -> SourceRun:
        """Start a source; raises ValueError if its id is taken."""
        sid = config.source_id
        existing = self.sources.get(sid)
        if existing is not None:
            if existing.intake is not None and not existing.intake.done():
                raise ValueError(f"source {sid!r} already exists")
            self._forget(existing)  # an ended run with the same id makes room
        loop = asyncio.get_running_loop()
        policy: OverflowPolicy = "drop_oldest" if config.live else "block"
        pipeline = self.config.pipeline

        def on_drop(frame: Frame) -> None:
            frame.release()
            self._count_drop(frame.source, "queue_full")

        queue: FrameQueue[Frame] = FrameQueue(config.queue_size, policy, loop, on_drop)
        source = create_source(config, self._on_source_state)
        source.on_reconnect = self._on_source_reconnect
        source.on_drop = self._on_source_drop
        # Every frame of this source is in its queue, in flight, being decoded, or the
        # latest one kept for the snapshot; more buffers than that would never be used.
        source.frame_pool_size = config.queue_size + self.config.runtime.max_in_flight + 4
        run = SourceRun(config=config, source=source, queue=queue)
        self.sources[sid] = run
        self.metrics.source_up.labels(pipeline, sid).set(0)
        run.intake = asyncio.create_task(self._intake(run), name=f"intake-{sid}")
        source.start(queue)
        self._idle.set()
        return run

    async def remove_source(self, source_id: str) -> bool:
        """Stop a source and wait for its frames in flight; False if unknown."""
        run = self.sources.get(source_id)
        if run is None:
            return False
        run.source.stop()
        run.queue.close()
        if run.intake is not None:
            try:
                await asyncio.wait_for(asyncio.shield(run.intake), self.config.runtime.drain_timeout)
            except TimeoutError:
                # Frames in flight did not finish in time (e.g. JetStream retrying while the
                # broker is down): give up on them rather than leave a half-removed source.
                log.warning(
                    "source %s: frames in flight did not finish within %.0fs; dropped",
                    source_id,
                    self.config.runtime.drain_timeout,
                )
                for task in (run.publisher, run.intake):
                    if task is not None:
                        task.cancel()
                await asyncio.gather(
                    *(t for t in (run.publisher, run.intake) if t is not None), return_exceptions=True
                )
            except asyncio.CancelledError:
                pass
        run.source.join(timeout=2.0)
        for frame in run.queue.drain():
            frame.release()
        self._forget(run)
        return True

    def _forget(self, run: SourceRun) -> None:
        """Drop everything kept for a source that has ended or been removed."""
        sid = run.source.id
        for stage in self.stages:
            stage.forget_source(sid)
        if run.last_frame is not None:
            run.last_frame.release()
            run.last_frame = None
        if self.sources.get(sid) is run:
            del self.sources[sid]
        self.metrics.forget_source(self.config.pipeline, sid)
        self._idle.set()

    def _on_source_state(self, source: Source, state: SourceState, reason: str) -> None:
        # Called from the source's thread; logging and prometheus are thread-safe.
        up = 1.0 if state == SourceState.UP else 0.0
        self.metrics.source_up.labels(self.config.pipeline, source.id).set(up)
        if state == SourceState.FAILED:
            log.error("%s", reason if reason.startswith("source ") else f"source {source.id}: {reason}")
        elif state == SourceState.BACKOFF:
            log.warning("source %s: %s", source.id, reason)
        else:
            log.info("source %s: %s%s", source.id, state.value, f" ({reason})" if reason else "")

    def _on_sent(self, source: str) -> None:
        # A message really left (core: sent or flushed from the outbox; JetStream: acked).
        self._published += 1
        run = self.sources.get(source)
        if run is not None:
            run.published += 1

    def _on_source_drop(self, source: Source, reason: str) -> None:
        # From the source's thread; prometheus counters are thread-safe.
        self._count_drop(source.id, reason)

    def _on_source_reconnect(self, source: Source, reason: str) -> None:
        # From the source's thread, like _on_source_state; the state change already logged why.
        self.metrics.source_reconnects.labels(self.config.pipeline, source.id, reason).inc()

    def _count_drop(self, source: str, reason: str) -> None:
        self.metrics.frames_dropped.labels(self.config.pipeline, source, reason).inc()
        run = self.sources.get(source)
        if run is not None:
            run.dropped[reason] = run.dropped.get(reason, 0) + 1

    # -- frames ----------------------------------------------------------------------------

    async def _intake(self, run: SourceRun) -> None:
        sid = run.source.id
        pipeline = self.config.pipeline
        # A slot is taken before a frame leaves the source's queue and given back once the
        # frame is published or dropped: exactly max_in_flight frames are in the graph at
        # most, and a live source's waiting frames stay in its drop-oldest queue, so the
        # graph always takes the freshest one.
        slots = asyncio.Semaphore(self.config.runtime.max_in_flight)
        in_flight: asyncio.Queue[asyncio.Task[Frame | None] | None] = asyncio.Queue()
        publisher = run.publisher = asyncio.create_task(
            self._publish_in_order(run, in_flight, slots), name=f"publish-{sid}"
        )
        accepted = 0
        try:
            while True:
                await slots.acquire()
                item = await run.queue.get()
                if isinstance(item, EndOfStream):
                    slots.release()
                    break
                self.metrics.queue_depth.labels(pipeline, sid).set(len(run.queue))
                pool = run.source.frame_pool
                if pool is not None:
                    self.metrics.pool_buffers.labels(pool.name, "in_use").set(pool.in_use)
                    self.metrics.pool_buffers.labels(pool.name, "capacity").set(pool.capacity)
                if self._stopping.is_set() and run.source.live:
                    item.release()
                    slots.release()
                    self._count_drop(sid, "shutdown")
                    continue
                if not run.source.live:
                    # A file's frame was decoded ahead and waited for the graph by design
                    # (lossless); its latency starts when the graph takes it.
                    item.capture_ts = time.time()
                self.metrics.frames.labels(pipeline, sid).inc()
                accepted += 1
                in_flight.put_nowait(asyncio.create_task(self._process(item)))
                if self.max_frames is not None and accepted >= self.max_frames:
                    run.source.stop()
                    run.queue.close()
                    for frame in run.queue.drain():
                        frame.release()
                    break
        finally:
            in_flight.put_nowait(None)
            await publisher

    async def _process(self, frame: Frame) -> Frame | None:
        """Run the unordered stages; None means the frame was dropped (counted)."""
        return await self._run_stages(frame, self._unordered)

    async def _run_stages(self, frame: Frame, stages: list[Stage]) -> Frame | None:
        pipeline = self.config.pipeline
        for stage in stages:
            t0 = time.perf_counter()
            try:
                await stage.process(frame)
            except asyncio.CancelledError:
                raise
            except Exception as exc:
                self._count_drop(frame.source, "stage_error")
                self._stage_error_log(
                    f"{stage.name}:{type(exc).__name__}",
                    f"stage {stage.name} failed on frame {frame.index} of {frame.source}: "
                    f"{type(exc).__name__}: {exc}; frame dropped",
                )
                log.debug("stage failure", exc_info=True)
                frame.release()
                return None
            elapsed = time.perf_counter() - t0
            frame.stage_times[stage.name] = elapsed
            self.metrics.stage_latency.labels(pipeline, stage.name).observe(elapsed)
        return frame

    async def _publish_in_order(
        self,
        run: SourceRun,
        in_flight: asyncio.Queue[asyncio.Task[Frame | None] | None],
        slots: asyncio.Semaphore,
    ) -> None:
        while True:
            task = await in_flight.get()
            if task is None:
                return
            try:
                await self._finish(run, await task)
            except asyncio.CancelledError:
                raise
            except Exception as exc:
                # Never let one frame end this source's publisher: its slots would never
                # come back and intake would wait forever.
                self._count_drop(run.source.id, "publish_failed")
                log.error("source %s: a frame failed after processing: %r", run.source.id, exc)
            finally:
                slots.release()

    async def _finish(self, run: SourceRun, frame: Frame | None) -> None:
        """Ordered stages and publish for one frame (None: dropped by a stage, already counted)."""
        if frame is None:
            return
        if self._ordered and await self._run_stages(frame, self._ordered) is None:
            return
        try:
            await self.publisher.publish(frame, run.stream_id)
        except Exception as exc:
            self._count_drop(frame.source, "publish_failed")
            log.error("source %s: frame %d not published: %s", frame.source, frame.index, exc)
            frame.release()
            return
        for obj in frame.objects:
            obj.crops.clear()  # crops were for the cascade; do not keep them alive
        # The newest frame stays (the dashboard draws it); the one before goes back to the pool.
        if run.last_frame is not None:
            run.last_frame.release()
        run.last_frame = frame
        latency = time.time() - frame.capture_ts
        run.latencies.append(latency)
        if len(run.latencies) > 512:
            del run.latencies[:256]
        if self._on_published is not None:
            try:
                self._on_published(frame)
            except Exception as exc:  # an embedder's hook must not stall this source
                log.error("on_published hook failed on frame %d of %s: %r", frame.index, frame.source, exc)

    # -- reporting -------------------------------------------------------------------------

    def frames_total(self) -> int:
        return sum(r.source.stats.frames for r in self.sources.values())

    def published_total(self) -> int:
        return self._published


__all__ = ["PipelineStartError", "Runtime", "SourceError", "SourceRun"]
