"""Live streams: a reader thread per connection, a supervisor that reconnects with backoff.

::

    sources:
      - id: gate
        url: udp://0.0.0.0:5000   # any live scheme: rtsp, http(s) streams, udp, rtp, srt, v4l2
        open_timeout: 10.0    # seconds to connect, negotiate and find the stream
        read_timeout: 5.0     # seconds one read may wait before the connection counts as dead
        stall_timeout: 5.0    # seconds without a decoded frame before reconnecting
        queue_size: 8         # frames waiting for the graph; the oldest is dropped when full
        reconnect:
          min_delay: 0.5      # first wait after a failure
          max_delay: 10.0     # cap of the doubling wait
          jitter: 0.2         # +-20% so cameras behind one switch do not retry in lockstep

:class:`LiveSource` is what every live FFmpeg stream shares (RTSP cameras in
:mod:`pipeline.sources.rtsp`, the other network and device schemes in
:mod:`pipeline.sources.stream`); a subclass says only how to open its URL.

Each connection is read on its own thread while the source thread supervises it:
when the connection fails, ends, stalls (no frame for ``stall_timeout``, even while
FFmpeg sits in a blocking read) or does not open in ``open_timeout``, the source
goes to ``backoff`` with a one-line reason, waits ``min_delay * 2**n`` (capped at
``max_delay``, +-``jitter``; ``n`` counts failures since the last frame), counts a
reconnect with a short reason label and connects again; while that attempt runs
the state stays ``backoff`` and the reason says ``reconnecting (retry N) after: ...``.
A reader stuck in FFmpeg is abandoned, not closed from another thread (closing a
container another thread is reading is not safe in FFmpeg): it can no longer emit,
stops at its next packet
(a stream of undecodable bytes still has packets), and otherwise at its next read
FFmpeg's interrupt ends after ``read_timeout``, freeing its connection. The next
connection starts only once the abandoned reader has ended, so a source never has
more than one reader; :func:`reader_threads` counts them all
(``vidpipe_source_reader_threads``). :meth:`Source.stop` takes effect within a
tenth of a second whatever FFmpeg is doing.

Frame indices keep counting across reconnects and ``pts`` keeps increasing;
``capture_ts`` is the wall time a frame came out of the decoder. Going from ``up``
to ``backoff`` leaves a :class:`~pipeline.queues.StreamBreak` in the queue: the
graph ends the connection's tracks there.
"""

from __future__ import annotations

import contextlib
import logging
import random
import threading
import time
from dataclasses import dataclass, field
from typing import Any

from pipeline.backoff import backoff_delay
from pipeline.config import SourceConfig
from pipeline.redact import redact_text
from pipeline.sources.base import ReconnectReason, SourceContext, SourceError, SourceState
from pipeline.sources.decode import AvSource, frame_rate

log = logging.getLogger("vidpipe.source")

__all__ = ["LiveSource", "reader_threads"]

# How often the supervisor looks at its reader; also the bound on how late stop() is seen.
_TICK = 0.05
# FFmpeg enforces open_timeout itself; the supervisor steps in only if it does not.
_OPEN_GRACE = 1.0

# Reader threads alive in this process, abandoned ones included.
_readers = 0
_readers_lock = threading.Lock()


def reader_threads() -> int:
    """Live-source reader threads alive in this process (at most one per live source)."""
    return _readers


class _Timeline:
    """A connection's frame times as strictly increasing seconds from its first frame.

    Frames without a timestamp (the first frame of some streams) and timestamps that go
    backwards (a camera whose clock was reset) are placed one frame after the previous one.
    """

    def __init__(self, step: float) -> None:
        self.step = step
        self.base: float | None = None
        self.last: float | None = None

    def next(self, raw: float | None) -> float:
        expected = 0.0 if self.last is None else self.last + self.step
        if raw is None:
            value = expected
        else:
            if self.base is None or (self.last is not None and raw - self.base <= self.last):
                self.base = raw - expected
            value = raw - self.base
        self.last = value
        return value


@dataclass
class _Attempt:
    """One connection: its reader thread fills this in, the supervisor watches it."""

    number: int
    started: float
    opened: float | None = None
    last_frame: float | None = None
    frames: int = 0
    # Set (under the source's lock) when the supervisor has given up on this reader.
    abandoned: bool = False
    # (reconnect reason, one-line message); None when the reader stopped because asked to.
    failure: tuple[ReconnectReason, str] | None = None
    # An error no reconnect can cure (frames over max_pixels, over the frame memory
    # budget): the source fails with it.
    fatal: SourceError | None = None
    done: threading.Event = field(default_factory=threading.Event)


class LiveSource(AvSource):
    """A live FFmpeg stream: reconnects with backoff, detects stalls, never gives up while running."""

    # Frame threads hold frames back (one per thread); slice threads do not.
    thread_type = "SLICE"
    skip_bad_packets = True

    def __init__(self, config: SourceConfig, context: SourceContext | None = None) -> None:
        super().__init__(config, context)
        self._lock = threading.Lock()
        self._failures = 0  # failed connections since the last frame: the backoff exponent
        self._random = random.Random()

    # -- supervision -----------------------------------------------------------------------

    def run(self) -> None:
        number = 0
        previous: _Attempt | None = None
        # Why the last connection ended and which retry follows it (for the reason shown).
        after = ""
        retry = 0
        while not self.stopping:
            number += 1
            if number == 1:
                self.set_state(SourceState.CONNECTING, self.display_url)
            if previous is not None and not previous.done.is_set():
                self.set_reason(f"retry {retry}: waiting for the abandoned connection to end, after: {after}")
            if previous is not None and not self._outlive(previous):
                break
            if previous is not None:
                # The wait is over: say so, or the API would show a wait that has passed.
                self.set_reason(f"reconnecting (retry {retry}) after: {after}")
                log.debug("source %s: %s", self.id, self.reason)
            attempt = previous = _Attempt(number=number, started=time.monotonic())
            reader = threading.Thread(
                target=self._read, args=(attempt,), name=f"live-{self.id}-{number}", daemon=True
            )
            reader.start()
            failure = self._supervise(attempt)
            if attempt.fatal is not None and not self.stopping:
                raise attempt.fatal
            if failure is None or self.stopping:
                break
            label, message = failure
            delay = backoff_delay(self._failures, self.config.reconnect, self._random.random())
            self._failures += 1
            after, retry = message, self._failures
            # The retry number makes every failure a state change of its own (one log line each).
            self.set_state(SourceState.BACKOFF, f"{message}; retry {retry} in {delay:.2f}s")
            if self._stop.wait(delay):
                break
            self.count_reconnect(label)

    def _supervise(self, attempt: _Attempt) -> tuple[ReconnectReason, str] | None:
        """Wait for the reader to fail or end; step in on stall, a hung open, or stop().

        Returns why the connection ended, or None when the source is stopping.
        """
        cfg = self.config
        while not attempt.done.wait(_TICK):
            now = time.monotonic()
            if self.stopping:
                self._abandon(attempt)
                return None
            if attempt.opened is None:
                if now - attempt.started > cfg.open_timeout + _OPEN_GRACE:
                    self._abandon(attempt)
                    return ("timeout", f"no answer from {self.display_url} in {cfg.open_timeout:g}s")
            elif now - (attempt.last_frame or attempt.opened) > cfg.stall_timeout:
                self._abandon(attempt)
                return ("stalled", f"stalled: no frame for {cfg.stall_timeout:g}s from {self.display_url}")
        if self.stopping:
            return None
        return attempt.failure or ("error", f"connection to {self.display_url} ended")

    def _outlive(self, attempt: _Attempt) -> bool:
        """Wait until an abandoned reader has ended; False if the source stops first.

        Its read ends within ``read_timeout`` (FFmpeg's interrupt) or at its next packet.
        """
        if attempt.done.is_set():
            return True
        log.info("source %s: waiting for the abandoned connection to end before reconnecting", self.id)
        while not attempt.done.wait(_TICK):
            if self.stopping:
                return False
        return True

    def _abandon(self, attempt: _Attempt) -> None:
        # Taking the lock waits out an emit in progress; after it the reader cannot emit.
        with self._lock:
            attempt.abandoned = True

    # -- the reader thread -----------------------------------------------------------------

    def _read(self, attempt: _Attempt) -> None:
        global _readers
        with _readers_lock:
            _readers += 1
        try:
            self._read_connection(attempt)
        finally:
            with _readers_lock:
                _readers -= 1
            attempt.done.set()

    def _read_connection(self, attempt: _Attempt) -> None:
        container: Any = None
        failure: tuple[ReconnectReason, str] | None
        try:
            container = self.open()
            attempt.opened = time.monotonic()
            failure = None if attempt.abandoned else self._decode_live(container, attempt)
        except SourceError as exc:
            failure = self._classify(exc, attempt)
            if exc.kind in ("too_large", "budget", "no_gpu"):
                attempt.fatal = exc  # no later attempt would fare better
        except Exception as exc:  # a bug, not the camera: reconnect all the same
            detail = redact_text(str(exc), self.url)
            failure = ("error", f"lost {self.display_url}: {type(exc).__name__}: {detail}")
        finally:
            if container is not None:
                with contextlib.suppress(Exception):
                    container.close()
        attempt.failure = failure

    def _decode_live(self, container: Any, attempt: _Attempt) -> tuple[ReconnectReason, str] | None:
        """Emit the connection's frames until it ends (returns why) or is given up (None)."""
        stream = self.video_stream(container)
        step = 1.0 / frame_rate(stream)
        timeline = _Timeline(step)
        for frame, seconds in self.frames(container, stream, lambda: attempt.abandoned):
            if attempt.abandoned or self.stopping:
                return None
            capture_ts = time.time()
            pts = timeline.next(seconds)
            with self._lock:
                if attempt.abandoned or self.stopping:
                    return None
                if attempt.frames == 0:
                    # RTP timestamps start anywhere on each connection; continue the
                    # source's timeline one frame after the last frame it kept.
                    last = self._last_kept_pts
                    self._pts_offset = 0.0 if last is None else last + step
                attempt.frames += 1
                attempt.last_frame = time.monotonic()
                self._failures = 0
                if not self.emit_frame(frame, pts, capture_ts):
                    return None
        if self.stopping:
            return None
        return ("end_of_stream", f"end of stream from {self.display_url}")

    # -- reasons ---------------------------------------------------------------------------

    def _classify(self, exc: SourceError, attempt: _Attempt) -> tuple[ReconnectReason, str]:
        """(reconnect reason label, one-line message) for a failed open or read."""
        url = self.display_url
        opening = attempt.opened is None
        since = attempt.started if opening else (attempt.last_frame or attempt.opened or attempt.started)
        elapsed = time.monotonic() - since
        cfg = self.config
        kind = exc.kind
        if kind == "refused":
            return ("refused", f"cannot connect to {url}: connection refused")
        if kind == "unreachable":
            return ("unreachable", f"cannot connect to {url}: {exc.detail.lower()}")
        if kind == "unauthorized":
            return ("unauthorized", f"{url} refused the credentials (401); check user and password")
        if kind == "forbidden":
            return ("unauthorized", f"{url} answered 403 forbidden; check the account's rights")
        if kind == "not_found":
            return ("not_found", f"{url} answered 404 not found; check the stream path")
        if kind == "no_video":
            return ("error", exc.problem)
        if kind == "redirect":
            return ("redirect", exc.problem)
        # A silent peer shows up as PyAV's interrupt, a socket timeout, while FFmpeg waits
        # for an RTSP reply as "invalid data" once the socket read gave up, and from a
        # udp:// port nobody sends to as an I/O error at the read timeout.
        timeout_limit = min(cfg.open_timeout, cfg.read_timeout) if opening else cfg.read_timeout
        late = elapsed >= 0.9 * timeout_limit
        timed_out = kind == "timeout" or (kind in ("invalid_data", "io_error") and late)
        if timed_out and opening:
            return ("timeout", f"no answer from {url} in {elapsed:.1f}s")
        if timed_out:
            return ("timeout", f"read timed out: no data from {url} for {cfg.read_timeout:g}s")
        if kind == "end_of_stream":
            return ("end_of_stream", f"end of stream from {url}")
        verb = "cannot open" if opening else "lost"
        log.debug("source %s: reader failed (%s): %s", self.id, kind, exc.detail)
        return ("error", f"{verb} {url}: {exc.detail}")
