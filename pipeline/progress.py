"""The progress line of a file run on a terminal: frames done of total, fps, ETA.

``vidpipe run`` shows it on stderr when stderr is a terminal and every source
is a file (``--no-progress`` turns it off)::

    312/900 frames (35%)  48.2 fps  ETA 0:12

The total is the containers' own frame count (their duration times the frame
rate when they do not store one); without it the line shows frames and fps only.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable
from typing import TextIO

from pipeline.cancel import cancel_and_wait


def file_frame_count(path: str) -> int | None:
    """The number of video frames a file holds, from its container; None when it does not say."""
    import av

    try:
        with av.open(path) as container:
            if not container.streams.video:
                return None
            stream = container.streams.video[0]
            if stream.frames:
                return int(stream.frames)
            if stream.duration is not None and stream.time_base and stream.average_rate:
                return round(float(stream.duration * stream.time_base) * float(stream.average_rate))
            if container.duration and stream.average_rate:
                return round(container.duration / 1_000_000 * float(stream.average_rate))
    except (OSError, ValueError, av.FFmpegError):
        return None
    return None


def format_eta(seconds: float) -> str:
    seconds = max(0, round(seconds))
    h, rest = divmod(seconds, 3600)
    m, s = divmod(rest, 60)
    return f"{h}:{m:02d}:{s:02d}" if h else f"{m}:{s:02d}"


class Progress:
    """Rewrites one line of ``out`` twice a second with ``done()`` against ``total``."""

    def __init__(
        self, done: Callable[[], int], total: int | None, out: TextIO, interval: float = 0.5
    ) -> None:
        self.done = done
        self.total = total
        self.out = out
        self.interval = interval
        self._start = time.monotonic()
        self._task: asyncio.Task[None] | None = None
        self._handlers: list[logging.Handler] = []

    def line(self) -> str:
        done = self.done()
        elapsed = max(1e-6, time.monotonic() - self._start)
        fps = done / elapsed
        if not self.total:
            return f"{done} frames  {fps:.1f} fps"
        pct = min(100, 100 * done // self.total)
        eta = format_eta((self.total - done) / fps) if fps > 0 else "?"
        return f"{done}/{self.total} frames ({pct}%)  {fps:.1f} fps  ETA {eta}"

    def start(self) -> None:
        self._start = time.monotonic()
        self._task = asyncio.create_task(self._run())
        # Log lines go to the same terminal: each first clears the progress line, which the
        # next tick draws again below it (they were appended to the progress text).
        self._handlers = [h for h in logging.getLogger().handlers if getattr(h, "stream", None) is self.out]
        for handler in self._handlers:
            handler.addFilter(self._clear)

    async def _run(self) -> None:
        while True:
            self._draw()
            await asyncio.sleep(self.interval)

    def _draw(self) -> None:
        # \r and clear-to-end: the line is rewritten in place.
        self.out.write("\r" + self.line() + "\x1b[K")
        self.out.flush()

    def _clear(self, record: logging.LogRecord) -> bool:
        """A handler filter: wipe the progress line before the log line is written."""
        self.out.write("\r\x1b[K")
        return True

    async def stop(self) -> None:
        for handler in self._handlers:
            handler.removeFilter(self._clear)
        self._handlers = []
        if self._task is not None:
            await cancel_and_wait(self._task)
            self._task = None
            self._draw()
            self.out.write("\n")
            self.out.flush()
