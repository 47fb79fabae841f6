"""Video files: decoded once (or looped), every frame processed.

::

    sources:
      - id: lobby
        url: samples/generated/demo.mp4   # a path (relative to the YAML file) or file:// URL
        loop: false                       # start again at the end
        realtime: false                   # pace at the clip's frame rate
        max_fps: null                     # drop frames above this rate
      - url: https://media.example/clips/gate.mp4   # a file over http(s): the same, fetched
        open_timeout: 10.0                # seconds to connect and read the header
        read_timeout: 5.0                 # seconds one read may wait

An http(s) URL whose path ends in a video file's extension (``.mp4``, ``.mov``,
``.mkv``, ``.webm``, ``.avi``, ``.m4v``), or any http(s) URL with ``live: false``,
is a file too: read once, lossless, and a server that stops answering fails the
source after ``read_timeout`` instead of reconnecting.

A file is lossless: its queue blocks the decode thread while the graph is behind. A
file that cannot be opened or decoded is reported in one line naming it, goes to
``failed`` and stops; the other sources go on. A damaged tail ends the file with a
warning after the frames that did decode, and a file with fewer frames than its
container declares (``stream.frames``, a cut download) logs one warning with both
counts.

With ``loop: true`` every pass is a new scene, as a camera's reconnect is: the
source leaves a :class:`~pipeline.queues.StreamBreak` after a pass's last frame,
so the tracks open then end at the seam (``track_end``) and the next pass starts
with new ids, and event clips keep to the frames of one pass. ``pts`` and frame
indices go on increasing: the next pass starts one frame after the last.
"""

from __future__ import annotations

import logging
import time
from pathlib import Path
from typing import Any

from pipeline.config import SourceConfig
from pipeline.sources.base import SourceContext, SourceError
from pipeline.sources.decode import AvSource, frame_rate
from pipeline.urls import file_path, missing_file

log = logging.getLogger("vidpipe.source")

__all__ = ["FileSource"]


class FileSource(AvSource):
    """A video file, lossless: the queue blocks so every frame is processed."""

    schemes = ("file", "http", "https")
    serves_live = False

    def __init__(self, config: SourceConfig, context: SourceContext | None = None) -> None:
        super().__init__(config, context)
        # None for a file fetched over http(s): FFmpeg opens the URL itself.
        self.path: Path | None = None
        if config.scheme == "file":
            self.path = file_path(config.url)
            self.url = str(self.path)
        self._warned_short = False
        self._pass = (0.0, 0.0, 25.0)  # a pass's first and last pts (the file's) and its rate

    def run(self) -> None:
        missing = missing_file(self.path) if self.path is not None else None
        if missing is not None:
            raise SourceError(self.id, missing[0], "not_found")
        realtime = self.config.realtime
        while not self.stopping:
            container = self.open()
            try:
                self._play(container, realtime)
            finally:
                container.close()
            if not self.config.loop or self.stopping:
                break
            # The picture jumps back to the clip's start: a new scene, as after a camera's
            # reconnect. The break ends the pass's tracks after its last frame, so none is
            # carried (or counted across a line) through the jump.
            self._break_stream()
            # The next pass starts one frame after this one's last: the timeline goes on as
            # if the clip were played twice in a row (a 1 ms step left the seam frame 1 ms
            # long, and a recording or clip across it a frame short).
            first, last, rate = self._pass
            self._pts_offset += (last - first) + 1.0 / rate

    def _play(self, container: Any, realtime: bool) -> None:
        """Decode every frame of one pass; pace it at the clip's rate when ``realtime``."""
        stream = self.video_stream(container)
        rate = frame_rate(stream)
        # What the container says it holds (0: it does not say); fewer means a cut file.
        declared = int(stream.frames or 0)
        decoded = 0
        cause = ""
        start_wall = time.monotonic()
        first_pts: float | None = None
        try:
            for frame, seconds in self.frames(container, stream):
                pts = seconds if seconds is not None else decoded / rate
                if first_pts is None:
                    first_pts = pts
                if realtime:
                    delay = start_wall + (pts - first_pts) - time.monotonic()
                    if delay > 0 and self._stop.wait(delay):
                        return
                decoded += 1
                self._pass = (first_pts, pts, rate)
                if not self.emit_frame(frame, pts):
                    return
        except SourceError as exc:
            if decoded == 0 or exc.kind == "too_large":
                raise
            cause = exc.detail
        if decoded == 0 and not self.stopping:
            raise SourceError(self.id, f"{self.display_url} has no decodable video frames")
        if self.stopping:
            return
        if 0 < decoded < declared and not self._warned_short:
            self._warned_short = True  # once per source, not once per loop
            log.warning(
                "source %s: %s ended after %d of the %d frames its container declares%s",
                self.id,
                self.display_url,
                decoded,
                declared,
                f" ({cause})" if cause else "; the file may be cut short",
            )
        elif cause:
            log.warning(
                "source %s: stopped decoding %s after %d frames: %s",
                self.id,
                self.display_url,
                decoded,
                cause,
            )
