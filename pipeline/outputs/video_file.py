"""An annotated recording: BGR frames encoded with PyAV, timed from the frames' pts.

::

    outputs:
      - {type: file, path: "out/{source}.mp4", annotate: true, codec: libx264, crf: 23}

Each frame lasts until the next one's pts (the last one as long as the one
before), so the file's frame count and duration are those of what was
published, whatever the source's rate or its gaps. Runs on a worker thread.
"""

from __future__ import annotations

from fractions import Fraction
from pathlib import Path
from typing import Any

import numpy as np

__all__ = ["VideoFileWriter"]

# 90 kHz, as MPEG and RTP count: fine enough for any frame rate's pts.
TIME_BASE = Fraction(1, 90000)


class VideoFileWriter:
    """Writes frames to ``path``; opened at the first frame (its size fixes the file's)."""

    def __init__(self, path: Path, codec: str = "libx264", crf: int = 23) -> None:
        self.path = path
        self.codec = codec
        self.crf = crf
        self.frames = 0
        self._container: Any = None
        self._stream: Any = None
        self._first_pts: float | None = None
        # One frame is held back until the next one's pts says how long it lasts.
        self._held: tuple[np.ndarray, int] | None = None
        self._last_duration = 0
        # Encoders do not carry a frame's duration to its packet; the muxer needs it for the
        # last frame (an MP4's duration is the last sample's pts plus its duration).
        self._durations: dict[int, int] = {}

    def _open(self, image: np.ndarray) -> None:
        import av

        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._container = av.open(str(self.path), "w")
        options = {"crf": str(self.crf)} if self.codec in ("libx264", "libx265") else {}
        stream = self._container.add_stream(self.codec, rate=25, options=options)
        stream.width = image.shape[1] - image.shape[1] % 2
        stream.height = image.shape[0] - image.shape[0] % 2
        stream.pix_fmt = "yuv420p"
        stream.time_base = TIME_BASE
        stream.codec_context.time_base = TIME_BASE
        self._stream = stream

    def write(self, image: np.ndarray, pts: float) -> None:
        """Add a BGR frame shown at ``pts`` seconds (on the source's timeline)."""
        if self._container is None:
            self._open(image)
            self._first_pts = pts
        assert self._first_pts is not None
        ticks = round((pts - self._first_pts) / TIME_BASE)
        if self._held is not None:
            held, held_ticks = self._held
            if ticks <= held_ticks:
                ticks = held_ticks + 1  # pts must increase; a repeated one is nudged
            self._encode(held, held_ticks, ticks - held_ticks)
        self._held = (image, ticks)

    def _encode(self, image: np.ndarray, ticks: int, duration: int) -> None:
        import av

        h, w = self._stream.height, self._stream.width
        frame = av.VideoFrame.from_ndarray(np.ascontiguousarray(image[:h, :w]), format="bgr24")
        frame.pts = ticks
        frame.time_base = TIME_BASE
        frame.duration = duration
        self._last_duration = duration
        self._durations[ticks] = duration
        self._mux(self._stream.encode(frame))
        self.frames += 1

    def _mux(self, packets: Any) -> None:
        for packet in packets:
            if packet.pts is not None:
                packet.duration = self._durations.pop(packet.pts, packet.duration)
            self._container.mux(packet)

    def close(self) -> None:
        """Write the held frame, flush the encoder and finish the file."""
        if self._container is None:
            return
        if self._held is not None:
            image, ticks = self._held
            self._held = None
            self._encode(image, ticks, self._last_duration or round(Fraction(1, 25) / TIME_BASE))
        self._mux(self._stream.encode(None))
        self._container.close()
        self._container = None
