"""What every source is: an id, a state, counters, and a way to hand frames to the graph.

A source produces decoded RGB frames into its :class:`FrameQueue` until its stream
ends or :meth:`Source.stop` is called, then leaves END in the queue, once. Files,
test patterns and cameras produce on a thread of their own
(:class:`ThreadedSource`); a WHIP source produces from the event loop when a
publisher sends frames.

Every frame lives in a buffer of the source's pool, sized by the runtime, so steady
state allocates no frame memory and a graph that falls behind holds the producer
back (or, for a producer that must not wait, drops the frame as ``pool_empty``).
"""

from __future__ import annotations

import enum
import logging
import threading
import time
import traceback
from abc import ABC, abstractmethod
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, ClassVar, Literal, Protocol

import numpy as np

from inference.errors import VidpipeError
from inference.memory import BufferHandle, BufferPool, PoolExhausted
from pipeline.config import SourceConfig
from pipeline.counters import SourceCounters
from pipeline.frames import Frame
from pipeline.queues import FrameQueue
from pipeline.redact import redact_text, redact_url
from pipeline.sources.budget import FrameMemoryBudget

log = logging.getLogger("vidpipe.source")

__all__ = [
    "DropListener",
    "PacketListener",
    "ReconnectListener",
    "ReconnectReason",
    "Source",
    "SourceContext",
    "SourceError",
    "SourceState",
    "StateListener",
    "ThreadedSource",
]


class SourceState(enum.Enum):
    CONNECTING = "connecting"
    UP = "up"
    BACKOFF = "backoff"
    STOPPED = "stopped"
    FAILED = "failed"


# The ``reason`` label of vidpipe_source_reconnects_total: a closed set, so a metric
# label can never carry free text. RTSP: why the last connection ended; WHIP: how the
# last publisher's session ended.
ReconnectReason = Literal[
    "refused",
    "unreachable",
    "timeout",
    "stalled",
    "end_of_stream",
    "not_found",
    "unauthorized",
    "redirect",
    "error",
    "publisher_left",
    "track_ended",
    "connection_failed",
    "connection_closed",
]


StateListener = Callable[["Source", SourceState, str], None]
# Called with a reconnect reason label per reconnect attempt.
ReconnectListener = Callable[["Source", ReconnectReason], None]
# Called with a drop reason ("max_fps", "pool_empty", "queue_full") for each frame the
# source itself drops.
DropListener = Callable[["Source", str], None]


class PacketListener(Protocol):
    """Told of the stream as it is read (event clips keep the camera's packets).

    Both calls run on the source's thread and must return quickly. Only a class
    whose ``gives_packets`` is true calls them.
    """

    def on_packet(self, packet: Any, stream: Any) -> None:
        """A demuxed packet of ``stream``, before it is decoded (the listener may keep it)."""

    def on_frame_time(self, stream_seconds: float, pts: float) -> None:
        """A decoded frame's time in its stream and the ``pts`` it gets on the source's timeline."""


@dataclass(frozen=True, slots=True)
class SourceContext:
    """What a source is built with besides its config: who is told what, and its memory.

    The runtime makes one per source, as it makes a ``StageContext`` for stages;
    a source built alone (a check, a test) gets these defaults: nobody told, a
    pool of 16 frames, no process-wide budget.
    """

    on_state: StateListener | None = None
    on_reconnect: ReconnectListener | None = None
    on_drop: DropListener | None = None
    # Frame buffers in the source's pool: the runtime sizes it as queue + frames in flight + a few.
    frame_pool_size: int = 16
    # The process's budget every frame pool is sized against.
    frame_memory: FrameMemoryBudget | None = None
    # Gets the demuxed packets (event clips); for a class that ``gives_packets`` only.
    packet_listener: PacketListener | None = None


class SourceError(VidpipeError):
    """A stream that cannot be opened or decoded; the message names the source and the cause.

    ``kind`` says what went wrong in a word (``refused``, ``timeout``, ``not_found``, ...,
    ``error``) so callers decide without parsing the message; ``detail`` is the
    underlying cause as a phrase (FFmpeg's). Both texts have credentials redacted.
    """

    def __init__(self, source_id: str, problem: str, kind: str = "error", detail: str = "") -> None:
        super().__init__(f"source {source_id}: {problem}")
        self.source_id = source_id
        self.problem = problem
        self.kind = kind
        self.detail = detail or problem


class Source(ABC):
    """One stream: its config, state, counters, frame pool and the queue it fills.

    ``schemes`` and ``serves_live`` say which URLs a class serves
    (:func:`pipeline.sources.registry.register_source`).
    """

    schemes: ClassVar[tuple[str, ...]] = ()
    serves_live: ClassVar[bool] = True
    # Whether the class demuxes packets a PacketListener can keep (event clips need them).
    gives_packets: ClassVar[bool] = False

    def __init__(self, config: SourceConfig, context: SourceContext | None = None) -> None:
        context = context or SourceContext()
        self.config = config
        self.id = config.source_id
        self.url = config.url
        self.display_url = redact_url(config.url)
        self.state = SourceState.CONNECTING
        self.reason = ""
        # Every count about this source, once: /metrics and the report read it (pipeline.counters).
        self.stats = SourceCounters()
        self._on_state = context.on_state
        self._on_reconnect = context.on_reconnect
        self._on_drop = context.on_drop
        self.frame_pool_size = context.frame_pool_size
        self.frame_pool: BufferPool | None = None
        self.frame_memory = context.frame_memory
        self.packet_listener = context.packet_listener if self.gives_packets else None
        # A producer that must never wait for a buffer (the event loop) drops instead.
        self.emit_blocks = True
        self._stop = threading.Event()
        self._queue: FrameQueue[Frame] | None = None
        # Orders the last frame before END, whichever thread calls stop().
        self._queue_lock = threading.Lock()
        self._ended = threading.Event()
        self._next_index = 0
        self._next_due_pts: float | None = None
        self._last_kept_pts: float | None = None
        # Added to every pts so they keep increasing across loops, reconnects, publishers.
        self._pts_offset = 0.0
        self.stop_reason = "stop requested"

    @property
    def live(self) -> bool:
        return self.config.live is True

    @property
    def stopping(self) -> bool:
        return self._stop.is_set()

    @abstractmethod
    def start(self, queue: FrameQueue[Frame]) -> None:
        """Begin producing into ``queue``."""

    def stop(self, reason: str = "stop requested") -> None:
        """Ask the source to end; END follows in its queue, and its state says ``reason``."""
        if not self._stop.is_set():
            self.stop_reason = reason
        self._stop.set()

    def join(self, timeout: float | None = None) -> None:
        """Wait until END is in the queue."""
        self._ended.wait(timeout)

    def release_pools(self) -> None:
        """Give this source's frame pool back to the budget and free it (it is being removed)."""
        if self.frame_memory is not None:
            self.frame_memory.release(self)
        pool, self.frame_pool = self.frame_pool, None
        if pool is not None:
            pool.close()

    def set_state(self, state: SourceState, reason: str = "") -> None:
        if state == self.state and reason == self.reason:
            return
        if state == SourceState.BACKOFF and self.state == SourceState.UP:
            self._break_stream()
        self.state = state
        self.reason = reason
        if self._on_state is not None:
            self._on_state(self, state, reason)

    def set_reason(self, reason: str) -> None:
        """Say what the source is doing now within its state (no state change, no log line)."""
        self.reason = reason

    def _break_stream(self) -> None:
        """A break after the frames already queued: a live stream went down, or a looping
        file starts its next pass.

        What follows is another scene (a new connection, the clip from its start): the
        graph ends the stream's tracks at the break (:class:`~pipeline.queues.StreamBreak`).
        """
        with self._queue_lock:
            if self._queue is not None and not self._ended.is_set():
                self._queue.put_break(self._next_index)

    def count_reconnect(self, reason: ReconnectReason) -> None:
        """Record a reconnect attempt; ``reason`` becomes a metric label."""
        self.stats.reconnect(reason)
        if self._on_reconnect is not None:
            self._on_reconnect(self, reason)

    def _drop(self, reason: str) -> None:
        self.stats.drop(reason)
        if self._on_drop is not None:
            self._on_drop(self, reason)

    def _finish(self, state: SourceState, reason: str) -> None:
        """The final state, then END in the queue; only the first call counts."""
        with self._queue_lock:
            if self._ended.is_set():
                return
            if self.state != SourceState.FAILED:
                self.set_state(state, reason)
            if self._queue is not None:
                self._queue.put_end()
            self._ended.set()

    # -- frames ----------------------------------------------------------------------------

    def emit(
        self,
        pts: float,
        shape: tuple[int, int, int],
        fill: Callable[[np.ndarray], object],
        capture_ts: float | None = None,
    ) -> bool:
        """Hand one frame to the graph: ``fill`` writes it into a pooled buffer of ``shape``.

        A frame above ``max_fps`` is dropped before ``fill`` runs, so it costs no
        conversion. Returns False when the source should stop.
        """
        reserved = self._reserve(pts, shape)
        if reserved is None:
            return not self.stopping
        pts, buffer = reserved
        try:
            fill(buffer.array)
        except BaseException:
            buffer.release()
            raise
        return self._publish(buffer, pts, capture_ts)

    def check_frame_size(self, width: int, height: int) -> None:
        """Raise :class:`SourceError` (kind ``too_large``) for a frame over ``max_pixels``."""
        limit = self.config.max_pixels
        if width * height > limit:
            raise SourceError(
                self.id,
                f"frame size {width}x{height} is over the limit of {limit} pixels (max_pixels)",
                "too_large",
            )

    def _reserve(self, pts: float, shape: tuple[int, int, int]) -> tuple[float, BufferHandle] | None:
        """The frame's pts on the source's timeline and a buffer for it; None if dropped.

        A frame over ``max_pixels`` raises :class:`SourceError` before any buffer exists.
        """
        self.check_frame_size(shape[1], shape[0])
        pts += self._pts_offset
        if not self._keep_for_max_fps(pts):
            self._drop("max_fps")
            return None
        buffer = self._acquire_buffer(shape)
        if buffer is None:
            if not self.stopping:
                self._drop("pool_empty")
            return None
        return pts, buffer

    def _publish(self, buffer: BufferHandle, pts: float, capture_ts: float | None) -> bool:
        """Put a filled buffer in the queue as the next frame; False (and released) if ending."""
        assert self._queue is not None
        frame = Frame(
            source=self.id,
            index=self._next_index,
            pts=pts,
            capture_ts=capture_ts if capture_ts is not None else time.time(),
            image=buffer.array,
            buffer=buffer,
        )
        with self._queue_lock:
            if self._ended.is_set() or not self._queue.put(frame, self._stop):
                frame.release()
                return False
        self._next_index += 1
        self._last_kept_pts = pts
        self.stats.frame_queued()
        if self.state != SourceState.UP:
            self.set_state(SourceState.UP)
        return not self.stopping

    def _keep_for_max_fps(self, pts: float) -> bool:
        """Thin the stream to ``max_fps`` on average (15 fps at max_fps 10 keeps 10, not 7.5)."""
        if self.config.max_fps is None:
            return True
        interval = 1.0 / self.config.max_fps
        due = self._next_due_pts
        if due is not None and pts < due - 1e-6:
            return False
        # Never let the schedule fall behind the stream, or a gap would be followed by a burst.
        self._next_due_pts = max((due if due is not None else pts) + interval, pts)
        return True

    def _acquire_buffer(self, shape: tuple[int, int, int]) -> BufferHandle | None:
        """A pooled frame buffer of ``shape``; None when stopping (or, if not blocking, dry)."""
        pool = self.frame_pool
        if pool is None or pool.shape != shape:
            # First frame, or the stream changed resolution: a new pool; the old one's
            # buffers go with the frames that still hold them.
            if self.frame_memory is not None:
                nbytes = self.frame_pool_size * shape[0] * shape[1] * shape[2]
                problem = self.frame_memory.reserve(self, nbytes)
                if problem:
                    frames = f"{self.frame_pool_size} frames of {shape[1]}x{shape[0]}"
                    raise SourceError(self.id, f"{problem} ({frames})", "budget")
            pool = BufferPool(shape, np.uint8, self.frame_pool_size, name=f"frames-{self.id}")
            self.frame_pool = pool
        if not self.emit_blocks:
            try:
                return pool.acquire(timeout=0)
            except PoolExhausted:
                return None
        while not self.stopping:
            try:
                return pool.acquire(timeout=0.25)
            except PoolExhausted:
                continue
        return None


class ThreadedSource(Source):
    """A source whose :meth:`run` produces frames on a thread of its own."""

    def __init__(self, config: SourceConfig, context: SourceContext | None = None) -> None:
        super().__init__(config, context)
        self._thread: threading.Thread | None = None

    def start(self, queue: FrameQueue[Frame]) -> None:
        self._queue = queue
        self._thread = threading.Thread(target=self._main, name=f"source-{self.id}", daemon=True)
        self._thread.start()

    def join(self, timeout: float | None = None) -> None:
        if self._thread is not None:
            self._thread.join(timeout)

    @abstractmethod
    def run(self) -> None:
        """Produce frames with :meth:`emit` until the stream ends or :meth:`stop` is called."""

    def _main(self) -> None:
        state, reason = SourceState.STOPPED, "end of stream"
        try:
            self.run()
            if self.stopping:
                reason = self.stop_reason
        except SourceError as exc:
            state, reason = SourceState.FAILED, str(exc)
        except Exception as exc:  # a decoder bug must not take the process down
            detail = redact_text(str(exc), self.url)
            state, reason = SourceState.FAILED, f"unexpected error: {exc.__class__.__name__}: {detail}"
            # The stack without the exception's own text: FFmpeg's carry the URL, password and all.
            log.debug("source %s crashed at\n%s", self.id, "".join(traceback.format_tb(exc.__traceback__)))
        finally:
            self._finish(state, reason)
