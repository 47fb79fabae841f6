"""An annotated recording: BGR frames encoded with PyAV, timed from the frames' pts.

::

    outputs:
      - {type: file, path: "out/{source}-{start}.mp4", annotate: true, codec: libx264, crf: 23}

Each frame lasts until the next one's pts (the last one as long as the one
before), so the file's frame count and duration are those of what was
published, whatever the source's rate or its gaps. Runs on a worker thread.

A recording survives a crash or ``kill -9`` up to its last second: MP4 and MOV
are written fragmented (an empty ``moov`` first, then a fragment at least every
``FRAGMENT_S`` seconds, each flushed to the file), and the encoder holds no
frames back (``tune=zerolatency``). A recording never replaces an earlier one:
``{start}`` in the path becomes the time it opens (``YYYYmmddTHHMMSS``), and a
path that exists all the same gets ``.1``, ``.2``, ... before its extension.
"""

from __future__ import annotations

import functools
import logging
import re
import tempfile
import time
from fractions import Fraction
from pathlib import Path
from typing import Any

import numpy as np

log = logging.getLogger("vidpipe.outputs")

__all__ = ["FRAGMENT_S", "RecordingError", "VideoFileWriter", "format_problem", "recording_path"]


class RecordingError(Exception):
    """A recording cannot go on (its folder, its file, its encoder); the message names the path."""


# 90 kHz, as MPEG and RTP count: fine enough for any frame rate's pts.
TIME_BASE = Fraction(1, 90000)
# MPEG-4 part 2 and H.263 store the clock's rate in 16 bits: 90 kHz is refused there.
SHORT_CLOCK = {"mpeg4": Fraction(1, 60000), "h263": Fraction(1, 60000), "h263p": Fraction(1, 60000)}
# The most a crash or kill can cost of an MP4 recording: a fragment is written this often.
FRAGMENT_S = 1.0
FRAGMENTED = {
    "movflags": "frag_keyframe+empty_moov+default_base_moof",
    "frag_duration": str(round(FRAGMENT_S * 1e6)),
    # Each fragment reaches the file at once, not when FFmpeg's write buffer fills.
    "flush_packets": "1",
}


def recording_path(template: Path, now: float | None = None) -> Path:
    """A new, empty file for a recording opening now: ``{start}`` filled in, no file reused.

    The file is created here (exclusively), so two recordings opening at once cannot
    both take the same name.
    """
    stamp = time.strftime("%Y%m%dT%H%M%S", time.localtime(time.time() if now is None else now))
    path = Path(str(template).replace("{start}", stamp))
    path.parent.mkdir(parents=True, exist_ok=True)
    n = 0
    candidate = path
    while True:
        try:
            candidate.open("xb").close()
            return candidate
        except FileExistsError:
            n += 1
            candidate = path.with_name(f"{path.stem}.{n}{path.suffix}")


class VideoFileWriter:
    """Writes frames to ``template`` (see :func:`recording_path`); opened at the first frame.

    The first frame's size fixes the file's; a frame of another size finishes the file
    and opens the next one (a new :attr:`path`, which is the file being written).
    """

    def __init__(self, template: Path, codec: str = "libx264", crf: int = 23, quiet: bool = False) -> None:
        self.template = template
        self.quiet = quiet  # no "recording to" line: a trial (format_problem), not a recording
        self.path: Path | None = None
        self.codec = codec
        self.crf = crf
        self.time_base = SHORT_CLOCK.get(codec, TIME_BASE)
        self.frames = 0
        # Set once the recording could not be opened or written: later frames are not tried.
        self.failed = False
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

        try:
            self.path = path = recording_path(self.template)
        except OSError as exc:
            self.failed = True
            raise RecordingError(
                f"cannot record to {self.template}: {exc.strerror or exc} ({self.template.parent})"
            ) from None
        fragmented = path.suffix.lower() in (".mp4", ".m4v", ".mov")
        try:
            self._container = av.open(str(path), "w", options=FRAGMENTED if fragmented else {})
            options = {}
            # By the encoder FFmpeg picks: `codec: h264` is libx264 too, and took no crf.
            encoder = av.codec.Codec(self.codec, "w").name
            if encoder in ("libx264", "libx265"):
                # zerolatency: no lookahead and no B-frames, so every frame encoded so far is in
                # the file (a kill loses at most the last fragment, not the encoder's queue).
                options = {"crf": str(self.crf), "tune": "zerolatency"}
            if encoder == "libx265":
                # x265 prints its banner and statistics to stderr itself, past FFmpeg's log
                # callback: lines that break `--log-format json`. FFmpeg still reports a failure.
                options["x265-params"] = "log-level=none"
            stream = self._container.add_stream(self.codec, rate=25, options=options)
            stream.width, stream.height = self._size(image)
            stream.pix_fmt = "yuv420p"
            stream.time_base = self.time_base
            stream.codec_context.time_base = self.time_base
        except Exception as exc:
            # Nothing was written: leave no empty file behind.
            self._abandon()
            path.unlink(missing_ok=True)
            raise RecordingError(f"cannot record to {path}: {_reason(exc)}") from None
        self._stream = stream
        if not self.quiet:
            log.info("recording to %s", path)

    def _abandon(self) -> None:
        self.failed = True
        container, self._container = self._container, None
        if container is not None:
            try:
                container.close()
            except Exception as exc:  # a half-set-up container may not close cleanly
                log.debug("closing a failed recording: %r", exc)

    def write(self, image: np.ndarray, pts: float) -> None:
        """Add a BGR frame shown at ``pts`` seconds (on the source's timeline).

        Raises :class:`RecordingError` when the recording cannot be opened or written;
        it is then :attr:`failed` and takes no more frames.
        """
        if self.failed:
            return
        if self._container is not None and self._size(image) != (self._stream.width, self._stream.height):
            self._next_file(image)
        if self._container is None:
            self._open(image)
            self._first_pts = pts
        try:
            self._write(image, pts)
        except Exception as exc:
            self._abandon()
            if self.frames == 0 and self.path is not None:
                self.path.unlink(missing_ok=True)  # nothing in it: leave no empty file behind
            raise RecordingError(f"cannot write {self.path}: {_reason(exc)}") from None

    @staticmethod
    def _size(image: np.ndarray) -> tuple[int, int]:
        """The encoded width and height of ``image``: 4:2:0 needs even sides."""
        return image.shape[1] - image.shape[1] % 2, image.shape[0] - image.shape[0] % 2

    def _next_file(self, image: np.ndarray) -> None:
        """The picture changed size (a WHIP publisher turned its phone): an encoder's size is
        fixed, so this file is finished and the frames go on in a new one."""
        old, (width, height) = self.path, self._size(image)
        try:
            self.close()
        except Exception as exc:
            log.error("recording %s not finished: %s", old, _reason(exc))
            self._abandon()
            self.failed = False  # the next file may still open
        self._held, self._durations, self._last_duration, self._first_pts = None, {}, 0, None
        self.frames = 0
        log.info(
            "recording %s: the picture changed to %dx%d; recording goes on in a new file", old, width, height
        )

    def _write(self, image: np.ndarray, pts: float) -> None:
        assert self._first_pts is not None
        ticks = round((pts - self._first_pts) / self.time_base)
        if self._held is not None:
            held, held_ticks = self._held
            if ticks <= held_ticks:
                ticks = held_ticks + 1  # pts must increase; a repeated one is nudged
            self._encode(held, held_ticks, ticks - held_ticks)
        self._held = (image, ticks)

    def _encode(self, image: np.ndarray, ticks: int, duration: int) -> None:
        import av

        h, w = self._stream.height, self._stream.width
        if self.frames == 0 and duration > 0:
            # The encoder opens at its first frame: the rate it (and the file's header) states
            # is the source's, from the first frame's duration, not a fixed 25.
            rate = (1 / (duration * self.time_base)).limit_denominator(1001)
            self._stream.codec_context.framerate = rate
        frame = av.VideoFrame.from_ndarray(np.ascontiguousarray(image[:h, :w]), format="bgr24")
        frame.pts = ticks
        frame.time_base = self.time_base
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
            self._encode(image, ticks, self._last_duration or round(Fraction(1, 25) / self.time_base))
        self._mux(self._stream.encode(None))
        self._container.close()
        self._container = None


@functools.lru_cache(maxsize=64)
def format_problem(suffix: str, codec: str) -> str | None:
    """Why a recording ending in ``suffix`` cannot hold ``codec`` video; None when it can.

    Tried for real: a few frames are recorded into a scratch file exactly as a recording
    is, so every refusal (``'webm' format does not support 'libx264' codec``, a muxer
    that takes the codec but not its timing) is found before a run, not during it.
    """
    with tempfile.TemporaryDirectory(prefix="vidpipe-format-") as folder:
        trial = Path(folder) / f"trial{suffix}"
        writer = VideoFileWriter(trial, codec=codec, quiet=True)
        try:
            for i in range(3):
                writer.write(np.zeros((48, 64, 3), np.uint8), i / 25)
            writer.close()
        except RecordingError as exc:
            if writer.path is None:
                return None  # the scratch folder, not the format: nothing to say about the config
            reason = str(exc).split(": ", 1)[-1]
        except Exception as exc:  # a muxer that fails at its end (PyAV raises what FFmpeg gave)
            reason = _reason(exc)
        else:
            return None
    # The scratch file's name means nothing to the caller.
    return re.sub(rf": '{re.escape(str(trial))}' returned (-?\d+)", r" (FFmpeg returned \1)", reason)


def _reason(exc: BaseException) -> str:
    """An FFmpeg or OS error as one readable phrase (an unknown encoder says which)."""
    import av

    if isinstance(exc, av.codec.codec.UnknownCodecError):
        return f"FFmpeg has no encoder {exc.args[0] if exc.args else ''!r}; use e.g. codec: libx264"
    if isinstance(exc, OSError) and exc.strerror:
        return exc.strerror
    return str(exc) or type(exc).__name__
