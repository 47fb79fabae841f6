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
import contextlib
import logging
import tempfile
import time
import uuid
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from inference.batcher import BatcherStats
from inference.config import ModelConfig
from inference.errors import VidpipeError
from inference.memory import BufferPool
from inference.model import Model, ModelState, ModelUnavailable
from inference.ratelimit import RateLimitedLog
from inference.repository import ModelRepository
from inference.schema import ConfigError
from pipeline.admission import (
    AdmissionPacer,
    batch_at_work,
    frames_per_run,
    paced_models,
    repository_batchers,
    whole_frame_stages,
)
from pipeline.backoff import RetryLog
from pipeline.cancel import cancel_and_wait
from pipeline.config import (
    FileOutputConfig,
    PipelineConfig,
    SourceConfig,
    model_misfits,
    numbered_classes,
)
from pipeline.counters import SourceCounters
from pipeline.fleet.fence import LeaseFence, default_worker_id
from pipeline.fleet.metrics import FleetMetrics
from pipeline.frames import Frame
from pipeline.heap import trim_soon
from pipeline.metrics import Metrics
from pipeline.outputs.manager import Outputs
from pipeline.overload import OverloadMonitor
from pipeline.queues import EndOfStream, FrameQueue, OverflowPolicy, StreamBreak
from pipeline.sources.base import Source, SourceContext, SourceError, SourceState
from pipeline.sources.budget import MIB, FrameMemoryBudget
from pipeline.sources.live import reader_threads
from pipeline.sources.registry import class_of, create_source
from pipeline.stages.base import Stage, StageContext
from pipeline.stages.publish import STATUS_SCHEMA, Publisher
from pipeline.stages.registry import create_stage
from pipeline.stats import (
    LatencyWindow,
    ModelReport,
    PipelineReport,
    SourceReport,
    StageClock,
    percentiles_ms,
)
from pipeline.urls import whip_name

log = logging.getLogger("vidpipe.runtime")


class PipelineStartError(VidpipeError):
    """The pipeline cannot start; the message says why and what to do.

    When a config key is to blame, ``key`` names it and ``file``/``line`` say where
    it is, and the message starts with ``FILE:LINE: key:``.
    """

    def __init__(self, problem: str, *, file: str = "", key: str = "", line: int | None = None) -> None:
        self.problem = problem
        self.file = file
        self.key = key
        self.line = line
        where = f"{file}:{line}: " if file and line else f"{file}: " if file else ""
        super().__init__(f"{where}{key + ': ' if key else ''}{problem}")


class WhipNameTaken(ValueError):
    """A WHIP source's name is used by another running source: publishers could not reach it."""


# What a source's status message says of each state (nats.status): whether frames come
# (up), not now (down, while it retries), never again (failed), or no more (stopped).
# Connecting says nothing: it is the way to up or to down.
STATUS_OF = {
    SourceState.UP: "up",
    SourceState.BACKOFF: "down",
    SourceState.FAILED: "failed",
    SourceState.STOPPED: "stopped",
}


def _ended(run: SourceRun) -> bool:
    return run.intake is not None and run.intake.done()


class SourceLimitError(VidpipeError):
    """``runtime.max_sources`` sources are running; the new one was not started."""

    key = "runtime.max_sources"

    def __init__(self, limit: int) -> None:
        self.limit = limit
        super().__init__(
            f"runtime.max_sources: {limit} source(s) already, the limit of this process; "
            "remove one first or raise runtime.max_sources"
        )


def check_device(config: PipelineConfig) -> None:
    """``runtime.device: gpu`` needs a usable GPU; ``auto`` says which it takes."""
    wanted = config.runtime.device
    if wanted == "cpu":
        return
    from inference.device import gpu_available

    ok, reason = gpu_available()
    if ok:
        return
    if wanted == "gpu":
        raise PipelineStartError(
            f"gpu is not usable here ({reason}); use device: cpu or auto",
            key="runtime.device",
            file=config.file,
            line=config.line("runtime.device"),
        )
    log.info("runtime.device auto: using the CPU (%s)", reason)


def derive_max_in_flight(config: PipelineConfig, models: dict[str, ModelConfig], sources: int) -> int:
    """Frames of one source in the graph at once: ``runtime.max_in_flight``, or derived from the models.

    Unset, it is the graph's share (:func:`derive_graph_limit`) over ``sources``,
    rounded down and at least 1; the graph limit holds the total when there are more
    sources than frames it allows.
    """
    if config.runtime.max_in_flight is not None:
        return config.runtime.max_in_flight
    graph = derive_graph_limit(config, models)
    assert graph is not None
    return max(1, min(256, graph // max(1, sources)))


def derive_graph_limit(config: PipelineConfig, models: dict[str, ModelConfig]) -> int | None:
    """Frames of all sources together in the graph at once; None when ``runtime.max_in_flight`` is set.

    Twice what the detector's instances work on at once (the instance count times the
    largest preferred batch size, 1 without one; for the model of the whole-frame stage
    that can take the most): a batch at work on each instance and the next one ready,
    so no instance waits for a frame to be pre-processed, and no frame waits behind
    more than one batch. More frames in flight only wait in the batcher's queue:
    latency without throughput. With paced admission, a detector with ``interval: N``
    runs on one frame in N+1, so it gets N+1 times as many frames: the frames it skips
    hold their slots until the frame before them is published. (Eager, that room would
    fill the detector's queue instead: it keeps the plain limit.)
    """
    if config.runtime.max_in_flight is not None:
        return None
    paced = config.runtime.admission == "paced"
    # (model, frames per frame the detector runs on)
    whole_frame = [
        (m, frames_per_run(s) if paced else 1) for s in whole_frame_stages(config) for m in s.models()
    ]
    named = [(m, every) for m, every in whole_frame or [(m, 1) for m in config.models_used()] if m in models]
    if not named:
        return 2
    return 2 * max(_frames_at_work(models[name]) * every for name, every in named)


def _frames_at_work(model: ModelConfig) -> int:
    """Frames a model's instances work on at once: one batch each, of the preferred size."""
    return model.instance_count * batch_at_work(model)


@dataclass
class SourceRun:
    """A running source, its queue and tasks (what ``GET /v1/sources`` shows).

    Its counts are the source's :class:`SourceCounters` (``counters``), which
    ``/metrics`` reads too.
    """

    config: SourceConfig
    source: Source
    queue: FrameQueue[Frame]
    intake: asyncio.Task[None] | None = None
    publisher: asyncio.Task[None] | None = None
    # Frame tasks between intake and publish; cancelled when a removal gives up on them.
    frame_tasks: set[asyncio.Task[Frame | None]] = field(default_factory=set)
    # The latest published frame (image and objects): what the dashboard's snapshot draws.
    last_frame: Frame | None = None
    # Tells this run of the source apart from earlier ones with the same id (frame
    # numbers start at 0 again); part of the JetStream de-duplication id.
    stream_id: str = field(default_factory=lambda: uuid.uuid4().hex[:12])
    # Capture-to-publish seconds of the latest published frames (what /v1/stats shows).
    latencies: LatencyWindow = field(default_factory=LatencyWindow)
    # Time per stage of the published frames (what the overload monitor reads).
    stage_clock: StageClock = field(default_factory=StageClock)
    # Frames of this source in the graph at once (runtime.max_in_flight, or derived at its start).
    max_in_flight: int = 1
    # Of the runtime's graph-wide slots, how many this source's frames hold now.
    graph_held: int = 0
    # The last state its status messages said (nats.status), and how many they were.
    status_said: str | None = None
    status_sent: int = 0

    # What the metrics collector reads (pipeline.metrics.CountedSource).
    @property
    def id(self) -> str:
        return self.source.id

    @property
    def counters(self) -> SourceCounters:
        return self.source.stats

    @property
    def up(self) -> bool:
        return self.source.state == SourceState.UP

    @property
    def queue_depth(self) -> int:
        return len(self.queue)

    @property
    def frame_pool(self) -> BufferPool | None:
        return self.source.frame_pool

    @property
    def scheme(self) -> str:
        return self.source.config.scheme

    @property
    def live(self) -> bool:
        return self.source.live

    @property
    def published(self) -> int:
        return self.source.stats.published

    @property
    def dropped(self) -> dict[str, int]:
        return self.source.stats.dropped_by_reason()

    def report(self, overload: OverloadMonitor | None = None) -> SourceReport:
        source = self.source
        counters = source.stats
        return SourceReport(
            id=source.id,
            url=source.display_url,
            state=source.state,
            reason=source.reason,
            live=source.live,
            frames=counters.frames,
            decoded=counters.decoded,
            published=counters.published,
            failing=counters.failing,
            dropped=counters.dropped_by_reason(),
            reconnects=counters.reconnects,
            queue_depth=len(self.queue),
            latency_ms=self.latencies.percentiles_ms(),
            stage_seconds=self.stage_clock.totals(),
            overload=overload.current(source.id) if overload is not None else None,
            fps=counters.fps(),
        )


class Runtime:
    """Runs one pipeline until its finite sources end, a limit is reached, or it is stopped.

    ``nats_url`` None publishes nowhere: messages reach only ``on_message``
    (embedding without NATS, :mod:`pipeline.embed`).
    """

    def __init__(
        self,
        config: PipelineConfig,
        *,
        nats_url: str | None,
        max_frames: int | None = None,
        metrics: Metrics | None = None,
        on_published: Callable[[Frame], None] | None = None,
        on_message: Callable[[dict[str, Any]], Awaitable[None]] | None = None,
        overload_interval: float = 10.0,
    ) -> None:
        self.config = config
        self.nats_url = nats_url
        self.max_frames = max_frames
        self.metrics = metrics or Metrics()
        self.metrics.reader_threads.set_function(lambda: float(reader_threads()))
        self.models: ModelRepository | None = None
        self.loading_model: str | None = None  # the model being loaded while the runtime starts
        self.stages: list[Stage] = []
        # A fleet worker's publisher asks the fence before every message; the worker,
        # built on this runtime, fills it (pipeline.fleet.fence).
        self.fence: LeaseFence | None = None
        self.fleet_metrics: FleetMetrics | None = None
        if config.fleet is not None:
            self.fleet_metrics = FleetMetrics(self.metrics.registry, config.fleet.name)
            refused = self.fleet_metrics.fenced.labels(config.fleet.name)
            self.fence = LeaseFence(config.fleet.worker_id or default_worker_id(), refused)
        self.publisher = Publisher(
            config.nats,
            nats_url,
            config.pipeline,
            self.metrics,
            fence=self.fence,
            on_sent=self._on_sent,
            on_message=on_message,
        )
        self.sources: dict[str, SourceRun] = {}
        # Every source's frame pool is sized against this; a removed source gives its share back.
        self.frame_memory = FrameMemoryBudget(config.runtime.frame_memory_mb * MIB)
        self._stopping = asyncio.Event()
        self._idle = asyncio.Event()
        self._errors = RateLimitedLog()
        # Frames of all sources in the graph at once, when derived (derive_graph_limit); set
        # once the models are loaded. Waiters are served in turn, so sources share it evenly.
        self._graph_slots: asyncio.Semaphore | None = None
        # Holds the next frame until the detector is about to be free (runtime.admission).
        self.pacer = AdmissionPacer(lambda name: None, {})
        self._unordered: list[Stage] = []
        self._ordered: list[Stage] = []
        self.started_at = 0.0
        # Called on the event loop after each frame is published (embedding, benchmarks).
        self._on_published = on_published
        self._published_removed = 0  # by sources no longer here (published_total adds the rest)
        self.source_ids_seen: set[str] = set()  # every source started, also removed ones
        # The loop the sources' threads hand their state changes to (set as they start).
        self._loop: asyncio.AbstractEventLoop | None = None
        self._persistent = False
        # Says which source cannot keep up, once per interval (pipeline.overload).
        models = {s.name: s.models()[0] for s in config.stages if s.models()}
        # A whole-frame detector's interval (a cascade, with on:, has none).
        intervals = {
            s.name: getattr(s, "interval", 0)
            for s in config.stages
            if s.models() and not getattr(s, "on", None)
        }
        self.overload = OverloadMonitor(models, intervals=intervals, interval=overload_interval)
        self._overload_task: asyncio.Task[None] | None = None
        # /metrics reads the running sources' counters at scrape time.
        self.metrics.collector.watch(config.pipeline, lambda: list(self.sources.values()))
        # Live views, recordings and clips; idle for sources nobody watches or records.
        self._warnings = RateLimitedLog(logger=log, level=logging.WARNING)
        # A camera that stays down: its first failures each a line, then one every few minutes.
        self._retry_log = RetryLog()
        # Clips messages go the way events go: outbox or acks, losses counted (pipeline.stages.publish).
        self.outputs = Outputs(
            config, publish=self.publisher.publish_clip, on_recording_drop=self._on_recording_drop
        )

    # -- lifecycle -------------------------------------------------------------------------

    async def start(self) -> None:
        """Load models, build stages, connect NATS and start every source.

        After a :meth:`request_stop` meanwhile (Ctrl-C while the models load) no source
        starts; :meth:`stop` then releases what did.
        """
        await self.prepare()
        if not self.stop_requested:
            self.start_sources()

    @property
    def stop_requested(self) -> bool:
        """Whether :meth:`request_stop` (or :meth:`stop`) was called."""
        return self._stopping.is_set()

    async def prepare(self) -> None:
        """Everything but the sources: models, stages, the NATS connection. A stop asked for
        while it loads the models ends it after the model loading then (a load runs in a
        thread and is not cut short): no further model, stage or connection."""
        self.started_at = time.time()
        check_device(self.config)
        self._make_output_folders()
        await self._load_models()
        if self.stop_requested:
            return
        graph = derive_graph_limit(self.config, self._model_configs())
        if graph is not None:
            self._graph_slots = asyncio.Semaphore(graph)
        if self.models is not None:
            self.pacer = AdmissionPacer(
                repository_batchers(self.models), paced_models(self.config, self._model_configs())
            )
        ctx = StageContext(config=self.config, models=self.models, metrics=self.metrics, errors=self._errors)
        self.stages = [create_stage(s, ctx) for s in self.config.stages]
        first_ordered = next((i for i, s in enumerate(self.stages) if s.ordered), len(self.stages))
        self._unordered = self.stages[:first_ordered]
        self._ordered = self.stages[first_ordered:]
        for stage in self.stages:
            await stage.start()
        await self.publisher.connect()
        self._overload_task = asyncio.create_task(self._watch_overload(), name="overload")
        log.info(
            "pipeline %s publishing to %s (%s)",
            self.config.pipeline,
            self.publisher.display_url,
            self.publisher.mode,
        )

    def _make_output_folders(self) -> None:
        """Create the recordings' and clips' folders now: one that cannot be is a start error
        naming its line, not an error on every frame later."""
        cfg = self.config
        for i, out in enumerate(cfg.outputs):
            key = f"outputs[{i}].path" if isinstance(out, FileOutputConfig) else f"outputs[{i}].dir"
            template = out.path if isinstance(out, FileOutputConfig) else out.dir + "/"
            # The folder up to the first placeholder ({source}, {start}); the rest is made per source.
            fixed = template.split("{", 1)[0]
            folder = Path(cfg.base_dir) / fixed.rsplit("/", 1)[0] if "/" in fixed else Path(cfg.base_dir)
            try:
                folder.mkdir(parents=True, exist_ok=True)
                with tempfile.NamedTemporaryFile(dir=folder, prefix=".vidpipe-"):
                    pass  # a file can be made there (root can make one where access() cannot tell)
            except OSError as exc:
                raise PipelineStartError(
                    f"cannot write to {folder}: {exc.strerror or exc}",
                    key=key, file=cfg.file, line=cfg.line(key) or cfg.line(f"outputs[{i}]"),
                ) from None  # fmt: skip

    def start_sources(self) -> None:
        for src in self.config.sources:
            self.add_source(src)

    async def _load_models(self) -> None:
        cfg = self.config
        names = cfg.models_used()
        if not names:
            return
        root = cfg.models_path()
        assert root is not None  # checked by load_config
        if not root.is_dir():
            raise PipelineStartError(
                f"repository folder {root} not found; check the path",
                key="models", file=cfg.file, line=cfg.line("models"),
            )  # fmt: skip
        self.models = ModelRepository(Path(root), observer=self.metrics)
        self.metrics.model_info.status = self.models.status
        log.info("loading %d model(s): %s", len(names), ", ".join(names))
        for name in names:
            if self.stop_requested:
                return  # stopped while starting: the models left are not loaded
            i = next(i for i, s in enumerate(cfg.stages) if name in s.models())
            key = f"stages[{i}].model"
            if name not in self.models.names():
                raise PipelineStartError(
                    f"model {name!r} is not in the repository {root} "
                    f"(it has: {', '.join(self.models.names()) or 'no models'})",
                    key=key, file=cfg.file, line=cfg.line(key),
                )  # fmt: skip
            self.loading_model = name
            try:
                status = await self.models.load(name)
            finally:
                self.loading_model = None
            if status.state is not ModelState.READY:
                raise PipelineStartError(
                    f"model {name} is unavailable: {status.reason}",
                    key=key,
                    file=cfg.file,
                    line=cfg.line(key),
                )
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
            # keep_running() may come while this waits (the API's last source removed).
            if not self._persistent:
                if intakes and all(t.done() for t in intakes):
                    return
                if not intakes and not self.sources:
                    return
            self._idle.clear()
            pending = [t for t in intakes if not t.done()]
            changed = asyncio.ensure_future(self._idle.wait())
            try:
                await asyncio.wait([*pending, changed], return_when=asyncio.FIRST_COMPLETED)
            finally:
                # A source that ended leaves this waiter pending: cancel it, or it outlives
                # the loop ("Task was destroyed but it is pending" at exit).
                changed.cancel()

    def request_stop(self) -> None:
        self._stopping.set()

    async def stop(self) -> None:
        """Graceful drain: stop intake, finish frames in flight, publish, flush NATS."""
        self._stopping.set()
        await cancel_and_wait(self._overload_task)
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
        await self.outputs.close()
        await self.publisher.close(timeout=self.config.runtime.drain_timeout)
        for stage in self.stages:
            await stage.stop()
        if self.models is not None:
            await self.models.close()

    # -- sources ---------------------------------------------------------------------------

    def max_in_flight(self, sources: int) -> int:
        """Frames in flight for a source started when ``sources`` run (the config's count at least)."""
        running = max(sources, len(self.config.sources))
        return derive_max_in_flight(self.config, self._model_configs(), running)

    def _model_configs(self) -> dict[str, ModelConfig]:
        if self.models is None:  # loaded before any source starts
            return {}
        return {n: self.models.get(n).config for n in self.config.models_used()}

    def add_source(self, config: SourceConfig) -> SourceRun:
        """Start a source; raises ValueError if its id is taken, SourceLimitError when full.

        Every source holds a thread, a frame pool and its queue; ended sources count
        too (they keep their last frame and counters) until they are removed.
        """
        sid = config.source_id
        existing = self.sources.get(sid)
        if existing is not None:
            if existing.intake is not None and not existing.intake.done():
                raise ValueError(f"source {sid!r} already exists")
            self._forget(existing)  # an ended run with the same id makes room
        if len(self.sources) >= self.config.runtime.max_sources:
            raise SourceLimitError(self.config.runtime.max_sources)
        owner = self.whip_owner(config)
        if owner is not None:
            raise WhipNameTaken(f"whip name {whip_name(config.url)!r} is already used by source {owner!r}")
        self.source_ids_seen.add(sid)
        loop = self._loop = asyncio.get_running_loop()
        policy: OverflowPolicy = "drop_oldest" if config.live else "block"
        # Every frame of this source is in its queue, in flight, being decoded, or the
        # latest one kept for the snapshot; more buffers than that would never be used.
        in_flight = self.max_in_flight(len(self.sources) + 1)
        # This run's id in the messages' Nats-Msg-Id; its clips (written later, maybe after
        # the source is gone) carry it too.
        stream_id = uuid.uuid4().hex[:12]
        clips = self.outputs.add_source(
            config, gives_packets=class_of(config).gives_packets, stream_id=stream_id
        )
        # Drops and reconnects are counted by the source's own counters (pipeline.counters).
        context = SourceContext(
            on_state=self._on_source_state,
            frame_pool_size=config.queue_size + in_flight + 4,
            frame_memory=self.frame_memory,
            packet_listener=clips,
        )
        try:
            source = create_source(config, context)
        except BaseException:
            self.outputs.forget_source(sid)
            raise
        counters = source.stats

        def on_drop(frame: Frame) -> None:
            frame.release()
            counters.drop("queue_full")

        queue: FrameQueue[Frame] = FrameQueue(config.queue_size, policy, loop, on_drop, breaks=True)
        run = SourceRun(
            config=config, source=source, queue=queue, max_in_flight=in_flight, stream_id=stream_id
        )
        self.sources[sid] = run
        run.intake = asyncio.create_task(self._intake(run), name=f"intake-{sid}")
        source.start(queue)
        self._idle.set()
        return run

    def model_misfit(self, model: Model) -> str | None:
        """Why a fresh copy of a model (a reload) cannot serve this pipeline's stages, or None.

        The checks of ``vidpipe validate`` (:func:`~pipeline.config.model_misfits`):
        a new task kind that finds no objects under a whole-frame stage, labels
        that no longer hold a stage's ``classes`` (or no labels, when a stage filters by name).
        """
        cfg = self.config
        stages = list(enumerate(cfg.stages))
        # A copy without labels labels its objects by class number, as validate reads it.
        path = model.model_path
        numbers = numbered_classes(model.config, path) if not model.labels and path is not None else None
        problems = model_misfits(
            stages, model.name, model.config.task.kind, model.labels, class_numbers=numbers
        )
        if not problems:
            return None
        errors = [ConfigError(cfg.file, cfg.line(key), key, problem, hint) for key, problem, hint in problems]
        return "; ".join(e.render() for e in errors)

    def whip_owner(self, config: SourceConfig) -> str | None:
        """The running source that publishers of ``config``'s WHIP name reach, if any (None: free)."""
        if config.scheme != "whip":
            return None
        name = whip_name(config.url)
        for sid, run in self.sources.items():
            if run.config.scheme == "whip" and whip_name(run.config.url) == name and not _ended(run):
                return sid
        return None

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
                await cancel_and_wait(run.publisher, run.intake, *run.frame_tasks)
            except asyncio.CancelledError:
                current = asyncio.current_task()
                if current is not None and current.cancelling():
                    raise  # this removal was cancelled, not only the intake
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
        self.outputs.forget_source(sid)
        if run.last_frame is not None:
            run.last_frame.release()
            run.last_frame = None
        run.source.release_pools()
        while run.graph_held:  # frames given up on (a removal that timed out) held these
            self._give_graph_slot(run)
        if self.sources.get(sid) is run:
            del self.sources[sid]
            self._published_removed += run.published
        self.metrics.forget_source(self.config.pipeline, sid)
        self._retry_log.forget(sid)
        self._idle.set()
        trim_soon()  # its frame pool and decoder freed much, in the arenas of its threads

    def _on_source_state(self, source: Source, state: SourceState, reason: str) -> None:
        # Called from the source's thread; logging is thread-safe.
        about = {"source": source.id}
        said = STATUS_OF.get(state)
        if said is not None and self.config.nats.status and self._loop is not None:
            run = self.sources.get(source.id)
            if run is not None and run.source is source:
                # A loop that has closed ended the run (and its stop said so): nothing to add.
                with contextlib.suppress(RuntimeError):
                    why = reason.removeprefix(f"source {source.id}: ")  # the message names it
                    self._loop.call_soon_threadsafe(self._say_status, run, said, why, time.time())
        if state == SourceState.FAILED:
            text = reason if reason.startswith("source ") else f"source {source.id}: {reason}"
            log.error("%s", text, extra=about)
        elif state == SourceState.BACKOFF:
            more = self._retry_log.failed(source.id)
            if more is not None:
                log.warning("source %s: %s%s", source.id, reason, more, extra=about)
            self.outputs.stream_ended(source.id)  # its clip rings go until it reconnects
        else:
            after = self._retry_log.recovered(source.id) if state == SourceState.UP else ""
            said = f" ({reason})" if reason else ""
            log.info("source %s: %s%s%s", source.id, state.value, said, after, extra=about)

    def _say_status(self, run: SourceRun, state: str, reason: str, ts: float) -> None:
        """Publish a source's ``vidpipe.status/v1`` message when its state changed (nats.status).

        Only changes: a camera that stays down retries, and each retry is not news.
        """
        if run.status_said == state:
            return
        run.status_said = state
        n, run.status_sent = run.status_sent, run.status_sent + 1
        sid = run.source.id
        message = {"schema": STATUS_SCHEMA, "pipeline": self.config.pipeline, "source": sid,
                   "state": state, "reason": reason, "ts": round(ts, 6)}  # fmt: skip
        msg_id = f"{self.config.pipeline}/{sid}/{run.stream_id}/status-{n}"
        self.publisher.publish_status(sid, message, msg_id)

    def _on_sent(self, source: str) -> None:
        # A message really left (core: sent or flushed from the outbox; JetStream: acked).
        run = self.sources.get(source)
        if run is not None:
            run.counters.message_published()
        else:
            self._published_removed += 1  # flushed from the outbox after its source went

    def _on_recording_drop(self, source: str) -> None:
        self.metrics.recording_dropped.labels(self.config.pipeline, source).inc()
        self._warnings(
            f"recording:{source}",
            f"source {source}: a frame left out of its recording: drawing and encoding are slower "
            "than the source (vidpipe_recording_frames_dropped_total counts them; lower max_fps, "
            "or record without annotate)",
            extra={"source": source},
        )

    def _count_drop(self, source: str, reason: str) -> None:
        run = self.sources.get(source)
        if run is not None:
            run.counters.drop(reason)

    # -- frames ----------------------------------------------------------------------------

    async def _intake(self, run: SourceRun) -> None:
        sid = run.source.id
        counters = run.counters
        # A slot is taken before a frame leaves the source's queue and given back once the
        # frame is published or dropped: exactly max_in_flight frames are in the graph at
        # most, and a live source's waiting frames stay in its drop-oldest queue, so the
        # graph always takes the freshest one.
        slots = asyncio.Semaphore(run.max_in_flight)
        in_flight: asyncio.Queue[asyncio.Task[Frame | None] | StreamBreak | None] = asyncio.Queue()
        publisher = run.publisher = asyncio.create_task(
            self._publish_in_order(run, in_flight, slots), name=f"publish-{sid}"
        )
        accepted = 0
        try:
            while True:
                await slots.acquire()
                await self._take_graph_slot(run)
                item = await run.queue.get()
                if isinstance(item, EndOfStream):
                    slots.release()
                    self._give_graph_slot(run)
                    break
                if isinstance(item, StreamBreak):
                    # A live stream went down: the publisher ends its tracks after the
                    # frames before the break, as at the source's end.
                    slots.release()
                    self._give_graph_slot(run)
                    in_flight.put_nowait(item)
                    continue
                if self._stopping.is_set() and run.source.live:
                    item.release()
                    slots.release()
                    self._give_graph_slot(run)
                    counters.drop("shutdown")
                    continue
                if not run.source.live:
                    # A file's frame was decoded ahead and waited for the graph by design
                    # (lossless); its latency starts when the graph takes it.
                    item.capture_ts = time.time()
                counters.accepted += 1
                accepted += 1
                task = asyncio.create_task(self._process(item))
                run.frame_tasks.add(task)
                task.add_done_callback(run.frame_tasks.discard)
                in_flight.put_nowait(task)
                if self.max_frames is not None and accepted >= self.max_frames:
                    run.source.stop(f"max frames reached: {self.max_frames}")
                    run.queue.close()
                    for frame in run.queue.drain():
                        frame.release()
                    break
        finally:
            in_flight.put_nowait(None)
            await publisher
            self.outputs.forget_source(sid)  # finish its recordings and clips

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
                run = self.sources.get(frame.source)
                if run is not None and not isinstance(exc, ModelUnavailable):
                    run.counters.failing += 1  # a model that is down is a readiness reason of its own
                # Per source: one camera's failures must not hide another's.
                self._errors(
                    f"{stage.name}:{frame.source}:{type(exc).__name__}",
                    f"stage {stage.name} failed on frame {frame.index} of {frame.source}: "
                    f"{type(exc).__name__}: {exc}; frame dropped",
                    extra={"source": frame.source},
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
        in_flight: asyncio.Queue[asyncio.Task[Frame | None] | StreamBreak | None],
        slots: asyncio.Semaphore,
    ) -> None:
        while True:
            task = await in_flight.get()
            if task is None:
                await self._end_source(run)
                return
            if isinstance(task, StreamBreak):
                await self._end_source(run, f"down-{task.next_index}")
                continue
            try:
                await self._finish(run, await task)
            except asyncio.CancelledError:
                raise
            except Exception as exc:
                # Never let one frame end this source's publisher: its slots would never
                # come back and intake would wait forever.
                run.counters.drop("publish_failed")
                log.error("source %s: a frame failed after processing: %r", run.source.id, exc)
            finally:
                slots.release()
                self._give_graph_slot(run)

    async def _take_graph_slot(self, run: SourceRun) -> None:
        """A graph-wide slot (derived limit only), taken once a frame waits: the freshest goes in."""
        if self._graph_slots is None:
            return
        # Waiting for a frame first keeps a slow camera from holding a slot it cannot use.
        await run.queue.wait_ready()
        await self._graph_slots.acquire()
        run.graph_held += 1
        # Taken from the source's queue after the wait: a live camera's freshest frame.
        head = run.queue.peek()
        if not isinstance(head, Frame):
            return  # the end of the stream: nothing to pace
        held = await self.pacer.wait(head.index)
        if held:
            self.metrics.admission_held.labels(self.config.pipeline).inc()
            self.metrics.admission_held_seconds.labels(self.config.pipeline).inc(held)

    def _give_graph_slot(self, run: SourceRun) -> None:
        if self._graph_slots is not None and run.graph_held:
            run.graph_held -= 1
            self._graph_slots.release()

    async def _finish(self, run: SourceRun, frame: Frame | None) -> None:
        """Ordered stages and publish for one frame (None: dropped by a stage, already counted)."""
        if frame is None:
            return
        if self._ordered and await self._run_stages(frame, self._ordered) is None:
            return
        try:
            latency = await self.publisher.publish(frame, run.stream_id)
        except Exception as exc:
            run.counters.drop("publish_failed")
            # Once per source and interval: a scene too crowded for max_payload fails every frame.
            self._errors(
                f"publish:{frame.source}:{type(exc).__name__}",
                f"source {frame.source}: frame {frame.index} not published: {exc}",
                extra={"source": frame.source},
            )
            frame.release()
            return
        for obj in frame.objects:
            obj.crops.clear()  # crops were for the cascade; do not keep them alive
        await self.outputs.frame_published(frame)
        # The newest frame stays (the dashboard draws it); the one before goes back to the pool.
        if run.last_frame is not None:
            run.last_frame.release()
        run.last_frame = frame
        if latency is not None:  # the histogram's own observation, so the report agrees with /metrics
            run.latencies.add(latency)
        run.stage_clock.add(frame.stage_times)
        if self._on_published is not None:
            try:
                self._on_published(frame)
            except Exception as exc:  # an embedder's hook must not stall this source
                log.error("on_published hook failed on frame %d of %s: %r", frame.index, frame.source, exc)

    async def _end_source(self, run: SourceRun, key: str = "end") -> None:
        """After a source's last frame, or the last before its stream broke: publish what
        that closes (tracks that end). ``key`` tells the closings of one run apart."""
        events = [event for stage in self._ordered for event in stage.end_source(run.source.id)]
        if not events:
            return
        # A track leaves every zone before it ends, whichever zones stage says which.
        events.sort(key=lambda event: event.type == "track_end")
        try:
            await self.publisher.publish_events(run.source.id, events, run.stream_id, key)
        except Exception as exc:
            log.error("source %s: %d closing event(s) not published: %s", run.source.id, len(events), exc)

    # -- reporting -------------------------------------------------------------------------

    async def _watch_overload(self) -> None:
        while True:
            await asyncio.sleep(self.overload.interval)
            try:
                self.overload.check(self.report())
            except Exception as exc:  # a reporting bug must not end the checks for good
                self._errors("overload", f"overload check failed: {type(exc).__name__}: {exc}")

    def published_total(self) -> int:
        """Messages published across every source, also removed ones."""
        return self._published_removed + sum(run.published for run in list(self.sources.values()))

    def report(self) -> PipelineReport:
        """Sources, models and totals as they are now (what the API and health read)."""
        needed = self.config.models_used()
        counters = self.metrics.collector.models()
        models = []
        if self.models is not None:
            for status in self.models.status():
                if status.name not in needed:
                    continue
                st = counters.get(status.name) or BatcherStats()
                models.append(
                    ModelReport(
                        name=status.name,
                        state=status.state,
                        reason=status.reason,
                        batches=st.batches,
                        requests=st.batched_requests,
                        batch_sizes=st.batch_sizes,
                        queue_ms=percentiles_ms(st.queue_recent),
                        compute_ms=percentiles_ms(st.compute_recent),
                    )
                )
        return PipelineReport(
            pipeline=self.config.pipeline,
            time=time.time(),
            sources=[run.report(self.overload) for run in self.sources.values()],
            models=models,
            models_needed=needed,
            models_loaded=self.models is not None,
            nats_connected=self.publisher.connected.is_set(),
            published=self.published_total(),
        )


__all__ = [
    "PipelineStartError",
    "Runtime",
    "SourceError",
    "SourceLimitError",
    "SourceRun",
    "derive_max_in_flight",
]
