"""The counters of one source, kept once: what ``/metrics`` and ``Runtime.report()`` both read.

Every count about a source lives in its :class:`SourceCounters` (``source.stats``)
and nowhere else: the hot path bumps a plain attribute once, the Prometheus
collector in :mod:`pipeline.metrics` reads the object at scrape time, and the
typed report (:mod:`pipeline.stats`) reads the same object, so the two cannot
disagree. A model's counters are its batcher's :class:`~inference.batcher.BatcherStats`,
read the same way.

Who writes what decides the locking: the source's producer thread hands frames
over, drops frames it cannot keep and counts reconnects, so those go through
:meth:`SourceCounters.frame_queued`, :meth:`~SourceCounters.drop` and
:meth:`~SourceCounters.reconnect`, under a lock (the event loop drops frames
too). Frames the graph takes and messages published are counted on the event
loop alone: plain ``+= 1``, no lock.
"""

from __future__ import annotations

import collections
import threading
import time
from collections.abc import Callable

FPS_WINDOW = 5.0  # seconds behind SourceReport.fps
FPS_STEP = 1.0  # seconds between two samples of the published count
FPS_MIN_SPAN = 1.0  # seconds of samples before an fps is shown


class SourceCounters:
    """Counts of one source since it started; ``created`` (unix s) is when it started.

    ``clock`` (monotonic seconds) times the samples behind :meth:`fps`; a test
    passes its own to make the rate exact.
    """

    __slots__ = (
        "_clock",
        "_fps_samples",
        "_last_published_at",
        "_lock",
        "_next_sample",
        "_reconnects",
        "accepted",
        "created",
        "dropped",
        "failing",
        "frames",
        "published",
    )

    def __init__(self, clock: Callable[[], float] = time.monotonic) -> None:
        self.created = time.time()
        self.frames = 0  # handed to the graph's queue (queue_full drops there included)
        self.accepted = 0  # taken from the queue by the graph (vidpipe_frames_total)
        self.published = 0  # detections messages that left (vidpipe_published_messages_total)
        self.dropped: dict[str, int] = {}  # by reason (vidpipe_frames_dropped_total)
        # Frames a stage failed on since the last message left, for a reason other than a
        # model being unavailable (readiness says that itself): what readiness reads.
        self.failing = 0
        self._reconnects: dict[str, int] = {}  # by reason (vidpipe_source_reconnects_total)
        self._lock = threading.Lock()
        self._clock = clock
        # (monotonic time, published) about once per FPS_STEP, FPS_WINDOW and a step back.
        self._fps_samples: collections.deque[tuple[float, int]] = collections.deque(
            maxlen=int(FPS_WINDOW / FPS_STEP) + 2
        )
        self._next_sample = 0.0
        self._last_published_at = 0.0

    # -- counting (the hot path) -------------------------------------------------------------

    def frame_queued(self) -> None:
        """A frame went into the graph's queue (from the producer's thread)."""
        with self._lock:
            self.frames += 1

    def drop(self, reason: str) -> None:
        """A frame dropped for ``reason`` (one of ``pipeline.metrics.DROP_REASONS``), from any thread."""
        with self._lock:
            self.dropped[reason] = self.dropped.get(reason, 0) + 1

    def reconnect(self, reason: str) -> None:
        """A reconnect attempt of a live source, for ``reason`` (a reconnect reason label)."""
        with self._lock:
            self._reconnects[reason] = self._reconnects.get(reason, 0) + 1

    def message_published(self) -> None:
        """A detections message left (on the event loop); samples the count for :meth:`fps`."""
        self.published += 1
        self.failing = 0
        now = self._last_published_at = self._clock()
        if now >= self._next_sample:
            self._fps_samples.append((now, self.published))
            self._next_sample = now + FPS_STEP

    # -- reading -----------------------------------------------------------------------------

    def dropped_by_reason(self) -> dict[str, int]:
        with self._lock:
            return dict(self.dropped)

    def reconnects_by_reason(self) -> dict[str, int]:
        with self._lock:
            return dict(self._reconnects)

    @property
    def reconnects(self) -> int:
        """Reconnect attempts, every reason together."""
        with self._lock:
            return sum(self._reconnects.values())

    @property
    def decoded(self) -> int:
        """Frames the decoder produced: those queued and those the source itself dropped before."""
        with self._lock:
            dropped = self.dropped
            return self.frames + dropped.get("max_fps", 0) + dropped.get("pool_empty", 0)

    def fps(self) -> float | None:
        """Messages published per second over about the last ``FPS_WINDOW`` seconds.

        The rate runs from the newest sample at least ``FPS_WINDOW`` old (the oldest
        one while the source is younger) to now; it is 0 once nothing was published
        for ``FPS_WINDOW``, and None until samples span ``FPS_MIN_SPAN``.
        """
        samples = list(self._fps_samples)  # one C call: safe beside an append
        if not samples:
            return None
        now = self._clock()
        if now - self._last_published_at >= FPS_WINDOW:
            return 0.0
        t0, n0 = samples[0]
        for t, n in samples:
            if t > now - FPS_WINDOW:
                break
            t0, n0 = t, n
        elapsed = now - t0
        if elapsed < FPS_MIN_SPAN:
            return None
        return round((self.published - n0) / elapsed, 2)


__all__ = ["FPS_WINDOW", "SourceCounters"]
