"""vidpipe inside another program: a pipeline built from a file or a dict, results in Python.

::

    import pipeline

    async with pipeline.Pipeline.from_dict(
        {"pipeline": "app", "models": "samples/models",
         "stages": [{"name": "objects", "type": "infer", "model": "squares"}]},
    ) as pipe:
        pipe.add_source("test://?frames=10")
        async for message in pipe.results():
            print(message["frame"], message["objects"])

Each result is the ``vidpipe.detections/v1`` message (docs/messages.md), the
same dict a NATS subscriber decodes. Without a NATS URL (``nats_url=`` or the
config's ``nats.url``) nothing connects anywhere and no server is started:
results reach only this program. With one, every message is also published,
and the program sees exactly what subscribers receive.

Results come through :meth:`Pipeline.results` (an async iterator; several may
run at once) and :meth:`Pipeline.on_result` (a callback, plain or async). Both
are called in frame order per source. An iterator's queue holds ``max_queue``
messages; while it is full the pipeline waits for the reader (files lose
nothing; live sources drop their oldest frames, counted as ``queue_full``),
except while stopping, when the oldest queued message is dropped instead
(counted in ``ResultStream.dropped``). An iterator that is left (``break``) or
closed stops receiving.

The pipeline ends once every source it ran has ended (as ``vidpipe run`` does)
and then the iterators finish; ``keep_running=True`` keeps it up for sources
added later, until :meth:`Pipeline.stop`.

A pipeline belongs to the event loop that started it: call its methods on that
loop's thread and stop it before the loop ends (its decode and model threads
run on otherwise). It runs once: after :meth:`Pipeline.stop`, make a new one.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import inspect
import logging
import traceback
from collections.abc import Awaitable, Callable, Mapping
from pathlib import Path
from types import TracebackType
from typing import Any

from inference.ratelimit import RateLimitedLog
from inference.schema import ConfigError, raise_errors
from pipeline.cancel import cancel_and_wait
from pipeline.config import PipelineConfig, load_config, missing_source_files, nats_url_problem, parse_source
from pipeline.health import readiness_problems
from pipeline.runtime import Runtime
from pipeline.stats import PipelineReport

__all__ = ["Message", "Pipeline", "ResultCallback", "ResultStream"]

log = logging.getLogger("vidpipe.embed")

Message = dict[str, Any]
ResultCallback = Callable[[Message], Awaitable[None] | None]


class _Channel:
    """One reader's bounded queue, held by the pipeline (the reader holds a :class:`ResultStream`)."""

    def __init__(self, limit: int) -> None:
        self.items: collections.deque[Message] = collections.deque()
        self.limit = limit
        self.readable = asyncio.Event()
        self.writable = asyncio.Event()
        self.writable.set()
        self.ended = False  # the pipeline finished: what is queued is still read
        self.left = False  # the reader went away: nothing more is queued
        self.blocking = True  # full: wait for the reader (False while stopping: drop the oldest)
        self.dropped = 0

    async def put(self, message: Message) -> None:
        while self.blocking and len(self.items) >= self.limit and not self.left:
            self.writable.clear()
            await self.writable.wait()
        if self.left or self.ended:
            return
        if len(self.items) >= self.limit:
            self.items.popleft()
            self.dropped += 1
        self.items.append(message)
        self.readable.set()

    async def get(self) -> Message | None:
        while not self.items:
            if self.ended or self.left:
                return None
            self.readable.clear()
            await self.readable.wait()
        message = self.items.popleft()
        self.writable.set()
        return message

    def end(self) -> None:
        self.ended = True
        self.readable.set()

    def leave(self) -> None:
        self.left = True
        self.items.clear()
        self.readable.set()
        self.writable.set()


class ResultStream:
    """An async iterator of one reader's results; see the module docstring for its queue."""

    def __init__(self, channel: _Channel) -> None:
        self._channel = channel

    @property
    def dropped(self) -> int:
        """Messages dropped because this reader's queue was full while the pipeline stopped."""
        return self._channel.dropped

    def __aiter__(self) -> ResultStream:
        return self

    async def __anext__(self) -> Message:
        message = await self._channel.get()
        if message is None:
            raise StopAsyncIteration
        return message

    def close(self) -> None:
        """Stop receiving; the pipeline no longer waits for this reader."""
        self._channel.leave()

    async def aclose(self) -> None:
        self.close()

    async def __aenter__(self) -> ResultStream:
        return self

    async def __aexit__(self, *exc: object) -> None:
        self.close()

    def __del__(self) -> None:
        # A reader that broke out of `async for` drops its stream: it must not hold the pipeline.
        self._channel.leave()


class Pipeline:
    """One pipeline run inside this program; use ``async with`` or :meth:`start` / :meth:`stop`.

    ``nats_url``: also publish every result to this NATS server (``nats://``, ``tls://``,
    ``ws://``, ``wss://``; several joined by commas); by default the config's ``nats.url``
    or ``nats.servers``, and with neither no NATS at all. ``max_frames``: stop each source
    after this many frames (at least 1). ``keep_running``: stay up when every source has
    ended, for sources added later, until :meth:`stop`.

    ``pipe = Pipeline(load_config("configs/demo.yaml", check_resources=True), max_frames=100)``
    """

    def __init__(
        self,
        config: PipelineConfig,
        *,
        nats_url: str | None = None,
        max_frames: int | None = None,
        keep_running: bool = False,
    ) -> None:
        # bool is an int to Python, and a str would only fail later inside the intake task.
        if max_frames is not None and (
            not isinstance(max_frames, int) or isinstance(max_frames, bool) or max_frames < 1
        ):
            raise ValueError(f"max_frames must be a whole number of at least 1 (or None), got {max_frames!r}")
        if nats_url is not None and (problem := nats_url_problem(nats_url.split(","))) is not None:
            # Refused here rather than after start() has tried to connect for seconds.
            raise ConfigError("nats_url", None, "", *problem)
        self.config = config
        if config.fleet is not None:
            log.warning(
                "pipeline %s: its fleet: section is for vidpipe run --fleet; an embedded pipeline "
                "runs the sources it is given (the config's, and add_source) itself",
                config.pipeline,
            )
        if config.http is not None:
            log.warning(
                "pipeline %s: its http: section is for vidpipe run; an embedded pipeline starts no "
                "HTTP server: the program serves its own (metrics_text() and readiness() give "
                "/metrics and /readyz)",
                config.pipeline,
            )
        # No URL here or in the config: no NATS at all (no embedded server either).
        self.nats_url = nats_url or config.nats.url or (",".join(config.nats.servers) or None)
        self.runtime = Runtime(
            config, nats_url=self.nats_url, max_frames=max_frames, on_message=self._deliver
        )
        self.runtime.publisher.connect_hint = "check nats_url= or nats.url / nats.servers in the config"
        self._keep_running = keep_running
        self._callbacks: list[ResultCallback] = []
        self._channels: set[_Channel] = set()
        self._errors = RateLimitedLog(logger=log)
        self._tracebacks = RateLimitedLog(logger=log, level=logging.DEBUG)
        self._started = False
        self._stopping = False
        self._ended = False  # the result streams have ended
        self._watch: asyncio.Task[None] | None = None
        self._shutdown: asyncio.Task[None] | None = None
        self._done = asyncio.Event()

    # -- building ------------------------------------------------------------------------

    @classmethod
    def from_file(
        cls, path: str | Path, *, sources: str | list[str] | None = None, **options: Any
    ) -> Pipeline:
        """A pipeline YAML file; ``sources`` replaces its sources (like ``vidpipe run --source``).

        ``Pipeline.from_file("configs/demo.yaml", sources=["clip.mp4"], max_frames=100)``

        ``sources`` is a list of URLs, or one URL as a str; their relative paths start at the
        working folder. ``options`` are :class:`Pipeline`'s (``nats_url``, ``max_frames``,
        ``keep_running``). Raises :class:`~inference.schema.ConfigError` (``FILE:LINE: ...``)
        for a bad file, with every problem ``vidpipe validate`` reports (a model the
        repository lacks, a missing file), and for a file in ``sources`` that is missing.
        """
        if isinstance(sources, str):
            sources = [sources]  # one URL, not one source per character
        config = load_config(path, sources=sources, check_resources=True)
        if sources is not None:
            # load_config leaves them, as vidpipe run goes on without one; validate --source does not.
            hint = "relative paths start at the working folder"
            raise_errors(missing_source_files(config.sources, "from_file", "sources[{i}]", hint))
        return cls(config, **options)

    @classmethod
    def from_dict(cls, data: Mapping[str, Any], *, base_dir: str | Path = ".", **options: Any) -> Pipeline:
        """A config as a dict, keyed as the YAML file is; relative paths start at ``base_dir``.
        Checked as :meth:`from_file` checks a file."""
        return cls(load_config(Path(base_dir) / "<config>", data=dict(data), check_resources=True), **options)

    # -- lifecycle -----------------------------------------------------------------------

    async def start(self) -> Pipeline:
        """Load the models, connect NATS (when there is a URL) and start the config's sources.

        ``pipe = await Pipeline.from_file("configs/demo.yaml").start()``

        Raises :class:`~pipeline.stages.publish.PublishError` when NATS cannot be reached and
        :class:`~pipeline.runtime.PipelineStartError` for what only starting finds (an output
        folder that cannot be written, a model that does not load). A pipeline starts once.
        """
        if self._started:
            if self._shutdown is not None:
                raise RuntimeError("a stopped pipeline cannot be started again: make a new Pipeline")
            raise RuntimeError("the pipeline was already started")
        self._started = True
        if self._keep_running:
            self.runtime.keep_running()
        try:
            await self.runtime.start()
        except BaseException:
            with contextlib.suppress(Exception):
                await self.runtime.stop()
            self._finish_streams()
            self._done.set()
            raise
        if self.runtime.sources:
            self._watch_sources()
        return self

    def add_source(self, url: str, *, id: str | None = None, **options: Any) -> str:
        """Start a source (``url`` and any ``sources:`` key as keyword arguments); returns its id.

        ``pipe.add_source("clip.mp4", id="door", realtime=True)``

        Relative file paths start at the config's folder (``base_dir`` for a dict). Raises
        :class:`~inference.schema.ConfigError` for bad options or a file that is missing
        (a camera is not tried), ``ValueError`` for an id in use and
        :class:`~pipeline.runtime.SourceLimitError` at ``runtime.max_sources``.
        """
        if not self._started or self._shutdown is not None:
            raise RuntimeError("add_source needs a started pipeline that has not finished")
        data = {"url": url, **({"id": id} if id is not None else {}), **options}
        # The checks a config file's source gets; a derived id is unique among the running sources.
        config = parse_source(
            data, base_dir=self.config.base_dir, taken_ids=self.runtime.sources, file="add_source"
        )
        hint = "relative paths start at the config's folder, base_dir for a dict"
        raise_errors(missing_source_files([config], "add_source", "sources.url", hint))
        run = self.runtime.add_source(config)
        self._watch_sources()
        return run.source.id

    async def remove_source(self, source_id: str) -> bool:
        """Stop a source after its frames in flight are published; False if there is none.

        ``removed = await pipe.remove_source("door")``

        Once the pipeline is stopping or stopped there is nothing to remove: False.
        """
        if self._shutdown is not None:
            return False
        return await self.runtime.remove_source(source_id)

    async def wait(self) -> None:
        """Until the pipeline has finished and stopped (its sources ended, or :meth:`stop`).

        ``await pipe.wait()``: once it returns, :meth:`stop` has nothing left to do.
        """
        if not self._started:
            raise RuntimeError("wait() needs a started pipeline: start() it, or use async with")
        await self._done.wait()

    def request_stop(self) -> None:
        """Begin a graceful stop without waiting (safe inside a result callback)."""
        if self._started:
            self._begin_shutdown()

    async def stop(self) -> None:
        """Stop intake, finish and deliver the frames in flight, close NATS; iterators then end."""
        if not self._started:
            return
        await asyncio.shield(self._begin_shutdown())

    async def __aenter__(self) -> Pipeline:
        return await self.start()

    async def __aexit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        await self.stop()

    def _watch_sources(self) -> None:
        if self._keep_running or self._watch is not None:
            return

        async def watch() -> None:
            await self.runtime.wait()
            self._begin_shutdown()

        self._watch = asyncio.create_task(watch(), name=f"embed-watch-{self.config.pipeline}")

    def _begin_shutdown(self) -> asyncio.Task[None]:
        if self._shutdown is None:
            self._stopping = True
            for channel in self._channels:
                channel.blocking = False
                channel.writable.set()  # a writer waiting for room drops the oldest instead
            self.runtime.request_stop()
            self._shutdown = asyncio.create_task(self._stop_runtime(), name="embed-stop")
        return self._shutdown

    async def _stop_runtime(self) -> None:
        try:
            await self.runtime.stop()
        finally:
            self._finish_streams()
            try:
                await cancel_and_wait(self._watch)
            finally:
                # Only now: a program that stops its loop once wait() returns leaves nothing running.
                self._done.set()

    def _finish_streams(self) -> None:
        self._ended = True
        for channel in self._channels:
            channel.end()
        self._channels.clear()

    # -- results -------------------------------------------------------------------------

    def results(self, *, max_queue: int = 256) -> ResultStream:
        """An async iterator of results from now on; it ends when the pipeline finishes."""
        if max_queue < 1:
            raise ValueError("max_queue must be at least 1")
        channel = _Channel(max_queue)
        channel.blocking = not self._stopping
        if self._ended:
            channel.end()
        else:
            self._channels.add(channel)
        return ResultStream(channel)

    def on_result(self, callback: ResultCallback) -> ResultCallback:
        """Call ``callback(message)`` for every result (usable as a decorator).

        ``pipe.on_result(lambda message: print(message["frame"]))``

        An async callback is awaited before the source's next message. An exception
        (``CancelledError`` included, unless the pipeline itself is being cancelled) is
        logged with its traceback, at most once per 10 s per kind, and the pipeline goes
        on; ``SystemExit`` and ``KeyboardInterrupt`` are not caught and end the program.
        Do not await :meth:`stop` inside one: it waits for this very callback; call
        :meth:`request_stop`.
        """
        self._callbacks.append(callback)
        return callback

    async def _deliver(self, message: Message) -> None:
        for callback in self._callbacks:
            try:
                result = callback(message)
                if inspect.isawaitable(result):
                    await result
            except asyncio.CancelledError as exc:
                current = asyncio.current_task()
                if current is not None and current.cancelling():
                    raise  # the pipeline is being cancelled, not only the callback's own await
                self._callback_failed(callback, message, exc)
            except Exception as exc:
                self._callback_failed(callback, message, exc)
        for channel in list(self._channels):
            if channel.left:
                self._channels.discard(channel)
                continue
            await channel.put(message)

    def _callback_failed(self, callback: ResultCallback, message: Message, exc: BaseException) -> None:
        text = f"{type(exc).__name__}: {exc}" if str(exc) else type(exc).__name__
        # Where in the callback it failed, so the line alone leads to the bug; the whole
        # traceback at DEBUG, on the same schedule (once per 10 s per kind).
        frames = traceback.extract_tb(exc.__traceback__)
        where = f" (at {frames[-1].filename}:{frames[-1].lineno} in {frames[-1].name})" if frames else ""
        key = f"callback:{type(exc).__name__}"
        failed = (
            f"result callback {getattr(callback, '__name__', callback)!r} failed on frame "
            f"{message.get('frame')} of {message.get('source')}: {text}"
        )
        self._errors(key, failed + where)
        self._tracebacks(key, f"{failed}\n{''.join(traceback.format_exception(exc)).rstrip()}")

    # -- state ---------------------------------------------------------------------------

    @property
    def finished(self) -> bool:
        """True once the pipeline has finished and stopped (what :meth:`wait` waits for)."""
        return self._done.is_set()

    def report(self) -> PipelineReport:
        """Sources, models and totals as they are now (what ``/v1/stats`` shows).

        ``[(s.id, s.state.value, s.published) for s in pipe.report().sources]``
        """
        return self.runtime.report()

    def metrics_text(self) -> bytes:
        """The Prometheus text exposition of this pipeline's metrics (what ``/metrics`` serves).

        ``web.Response(body=pipe.metrics_text(), content_type="text/plain")`` in an aiohttp route.
        """
        return self.runtime.metrics.render()

    def readiness(self) -> list[str]:
        """Why the pipeline is not ready, one reason each (what ``/readyz`` lists); empty when ready.

        Running no source is no reason: an embedded pipeline's sources may come from
        :meth:`add_source`. ``ready = not pipe.readiness()``
        """
        return readiness_problems(self.report(), sources_required=False)
