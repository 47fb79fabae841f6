"""Sources: a thread per stream that demuxes and decodes into the source's :class:`FrameQueue`.

::

    sources:
      - id: lobby
        url: samples/generated/demo.mp4   # a path or file:// URL
        loop: false                       # start again at the end
        realtime: false                   # pace at the clip's frame rate
        max_fps: null                     # drop frames above this rate
      - url: test://?width=640&height=360&fps=25&frames=250

Files are lossless (their queue blocks); live sources drop the oldest frame when
the graph falls behind. A source that cannot be opened or decoded is reported in
one line naming it, goes to ``failed`` and stops; the other sources go on.
"""

from __future__ import annotations

import enum
import logging
import re
import threading
import time
from abc import ABC, abstractmethod
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any
from urllib.parse import parse_qsl, unquote, urlsplit

import numpy as np

from inference.memory import BufferHandle, BufferPool, PoolExhausted
from pipeline.config import SourceConfig, redact_url
from pipeline.frames import Frame
from pipeline.queues import FrameQueue

log = logging.getLogger("vidpipe.source")


class SourceState(enum.Enum):
    CONNECTING = "connecting"
    UP = "up"
    BACKOFF = "backoff"
    STOPPED = "stopped"
    FAILED = "failed"


@dataclass(slots=True)
class SourceStats:
    """Counters of one source; they map onto ``vidpipe_frames_total`` and friends."""

    frames: int = 0
    dropped_max_fps: int = 0
    reconnects: int = 0
    last_frame_ts: float = 0.0


StateListener = Callable[["Source", SourceState, str], None]
# Called with a short, bounded reason label (e.g. "refused", "stalled") per reconnect attempt.
ReconnectListener = Callable[["Source", str], None]
# Called with a drop reason ("max_fps", "pool_empty") for each frame the source itself drops.
DropListener = Callable[["Source", str], None]


class SourceError(RuntimeError):
    """A stream that cannot be opened or decoded; the message names it and what to do."""


class Source(ABC):
    """A stream decoded on its own thread into a :class:`FrameQueue`."""

    def __init__(self, config: SourceConfig, on_state: StateListener | None = None) -> None:
        self.config = config
        self.id = config.source_id
        self.url = config.url
        self.display_url = redact_url(config.url)
        self.state = SourceState.CONNECTING
        self.reason = ""
        self.stats = SourceStats()
        self._on_state = on_state
        self.on_reconnect: ReconnectListener | None = None
        self.on_drop: DropListener | None = None
        # Decoded frames live in a pool of buffers sized by the runtime (queue + frames in
        # flight + a few), so steady state allocates no frame memory and a graph that falls
        # behind holds the decoder back instead of growing memory.
        self.frame_pool_size = 16
        self.frame_pool: BufferPool | None = None
        # Sources that emit from the event loop must never wait for a buffer: they drop.
        self.emit_blocks = True
        self._next_due_pts: float | None = None
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._queue: FrameQueue[Frame] | None = None
        self._next_index = 0
        self._last_kept_pts: float | None = None
        self.pts_offset = 0.0

    @property
    def live(self) -> bool:
        return self.config.live

    def start(self, queue: FrameQueue[Frame]) -> None:
        self._queue = queue
        self._thread = threading.Thread(target=self._main, name=f"source-{self.id}", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        """Ask the thread to end; it leaves END in the queue."""
        self._stop.set()

    def join(self, timeout: float | None = None) -> None:
        if self._thread is not None:
            self._thread.join(timeout)

    @property
    def stopping(self) -> bool:
        return self._stop.is_set()

    def set_state(self, state: SourceState, reason: str = "") -> None:
        if state == self.state and reason == self.reason:
            return
        self.state = state
        self.reason = reason
        if self._on_state is not None:
            self._on_state(self, state, reason)

    def count_reconnect(self, reason: str) -> None:
        """Record a reconnect attempt of a live source; ``reason`` is a metric label, not free text."""
        self.stats.reconnects += 1
        if self.on_reconnect is not None:
            self.on_reconnect(self, reason)

    def _main(self) -> None:
        assert self._queue is not None
        try:
            self.run()
            if self.state not in (SourceState.FAILED,):
                self.set_state(SourceState.STOPPED, "stop requested" if self.stopping else "end of stream")
        except SourceError as exc:
            self.set_state(SourceState.FAILED, str(exc))
        except Exception as exc:  # a decoder bug must not take the process down
            self.set_state(SourceState.FAILED, f"unexpected error: {exc.__class__.__name__}: {exc}")
            log.debug("source %s crashed", self.id, exc_info=True)
        finally:
            self._queue.put_end()

    @abstractmethod
    def run(self) -> None:
        """Produce frames with :meth:`emit` until the stream ends or :meth:`stop` is called."""

    def _drop(self, reason: str) -> None:
        if self.on_drop is not None:
            self.on_drop(self, reason)

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

    def _acquire_buffer(self, shape: tuple[int, ...]) -> BufferHandle | None:
        """A pooled frame buffer of ``shape``; None when stopping (or, for loop sources, dry)."""
        pool = self.frame_pool
        if pool is None or pool.shape != shape:
            # First frame, or the stream changed resolution: a new pool; the old one's
            # buffers go with the frames that still hold them.
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

    def emit(self, image: np.ndarray, pts: float, capture_ts: float | None = None) -> bool:
        """Hand a decoded image to the graph, copied into a pooled buffer.

        Returns False when the source should stop.
        """
        assert self._queue is not None
        pts += self.pts_offset
        if not self._keep_for_max_fps(pts):
            self.stats.dropped_max_fps += 1
            self._drop("max_fps")
            return not self.stopping
        buffer = self._acquire_buffer(image.shape)
        if buffer is None:
            if self.stopping:
                return False
            self._drop("pool_empty")
            return True
        np.copyto(buffer.array, image)
        self._last_kept_pts = pts
        frame = Frame(
            source=self.id,
            index=self._next_index,
            pts=pts,
            capture_ts=capture_ts if capture_ts is not None else time.time(),
            image=buffer.array,
            buffer=buffer,
        )
        self._next_index += 1
        if not self._queue.put(frame, self._stop):
            frame.release()
            return False
        self.stats.frames += 1
        self.stats.last_frame_ts = time.time()
        if self.state != SourceState.UP:
            self.set_state(SourceState.UP)
        return not self.stopping


class TestPatternSource(Source):
    """Synthetic, deterministic frames, paced like a live camera.

    ``test://?width=640&height=360&fps=25&frames=N`` (all optional; no ``frames`` = endless).
    Each frame shows a gradient and a white square whose box is
    :func:`pattern_square_box` of the frame index, so tests know the truth.
    """

    __test__ = False  # not a pytest class

    def __init__(self, config: SourceConfig, on_state: StateListener | None = None) -> None:
        super().__init__(config, on_state)
        params = dict(parse_qsl(urlsplit(config.url).query))
        try:
            self.width = int(params.get("width", 640))
            self.height = int(params.get("height", 360))
            self.fps = float(params.get("fps", 25))
            frames = params.get("frames")
            self.frames = int(frames) if frames is not None else None
        except ValueError as exc:
            raise SourceError(f"source {self.id}: bad test:// parameter ({exc})") from None
        if not (16 <= self.width <= 7680 and 16 <= self.height <= 4320 and 0 < self.fps <= 240):
            raise SourceError(
                f"source {self.id}: test:// needs 16<=width<=7680, 16<=height<=4320, 0<fps<=240"
            )

    def run(self) -> None:
        base = pattern_background(self.width, self.height)
        image = np.empty_like(base)  # drawn into, then copied into a pooled buffer by emit
        start = time.monotonic()
        i = 0
        while not self.stopping and (self.frames is None or i < self.frames):
            due = start + i / self.fps
            delay = due - time.monotonic()
            if delay > 0 and self._stop.wait(delay):
                break
            np.copyto(image, base)
            x1, y1, x2, y2 = pattern_square_box(i, self.width, self.height)
            image[y1:y2, x1:x2] = 255
            if not self.emit(image, pts=i / self.fps):
                break
            i += 1


def pattern_background(width: int, height: int) -> np.ndarray:
    """A dim diagonal gradient, so nothing but the square is bright."""
    ys = np.linspace(0, 60, height, dtype=np.float32)[:, None]
    xs = np.linspace(0, 60, width, dtype=np.float32)[None, :]
    gray = (ys + xs).astype(np.uint8)
    return np.repeat(gray[:, :, None], 3, axis=2)


def pattern_square_box(index: int, width: int, height: int) -> tuple[int, int, int, int]:
    """Where the test pattern's square is in frame ``index`` (x1, y1, x2, y2, exclusive ends)."""
    side = max(8, min(width, height) // 6)
    span_x = width - side
    span_y = height - side
    # Bounce along both axes at different speeds so the path covers the frame.
    tx = (index * 7) % (2 * span_x)
    ty = (index * 3) % (2 * span_y)
    x = tx if tx < span_x else 2 * span_x - tx
    y = ty if ty < span_y else 2 * span_y - ty
    return (x, y, x + side, y + side)


class AvSource(Source):
    """Any stream FFmpeg can demux and decode, through PyAV (files here, cameras in subclasses).

    ``decode: cuda`` (or ``auto``) decodes with NVDEC through FFmpeg's CUDA hwaccel.
    """

    decoder = "software"

    def open_options(self) -> dict[str, str]:
        return {}

    def open_timeout(self) -> float | tuple[float, float] | None:
        return None

    def open(self) -> Any:
        import av

        from pipeline.stages.hwdecode import open_with_hwaccel

        try:
            container, self.decoder = open_with_hwaccel(
                self.url, self.open_options(), self.open_timeout(), self.config.decode
            )
            return container
        except FileNotFoundError:
            raise SourceError(f"source {self.id}: file not found: {self.display_url}") from None
        except av.FFmpegError as exc:
            raise SourceError(
                f"source {self.id}: cannot open {self.display_url}: {ffmpeg_reason(exc, self.url)}"
            ) from None
        except RuntimeError as exc:  # decode: cuda asked for, not possible here
            raise SourceError(f"source {self.id}: {exc}") from None

    def decode(self, container: Any, realtime: bool) -> int:
        """Decode every video frame of ``container``; returns the number decoded."""
        import av

        if not container.streams.video:
            raise SourceError(f"source {self.id}: {self.display_url} has no video stream")
        stream = container.streams.video[0]
        stream.thread_type = "AUTO"  # frame threads inside FFmpeg, outside the GIL
        time_base = float(stream.time_base) if stream.time_base else 0.0
        fps = float(stream.average_rate) if stream.average_rate else 25.0
        decoded = 0
        start_wall = time.monotonic()
        first_pts: float | None = None
        try:
            for packet in container.demux(stream):
                if self.stopping:
                    break
                for av_frame in packet.decode():
                    pts = (
                        float(av_frame.pts) * time_base
                        if av_frame.pts is not None and time_base
                        else decoded / fps
                    )
                    if first_pts is None:
                        first_pts = pts
                    if realtime:
                        delay = start_wall + (pts - first_pts) - time.monotonic()
                        if delay > 0 and self._stop.wait(delay):
                            return decoded
                    image = av_frame.to_ndarray(format="rgb24")
                    decoded += 1
                    if not self.emit(image, pts=pts):
                        return decoded
        except av.FFmpegError as exc:
            if decoded == 0:
                raise SourceError(
                    f"source {self.id}: cannot decode {self.display_url}: {ffmpeg_reason(exc, self.url)}"
                ) from None
            # A damaged tail: keep what was decoded and say so.
            log.warning(
                "source %s: stopped decoding %s after %d frames: %s",
                self.id,
                self.display_url,
                decoded,
                ffmpeg_reason(exc, self.url),
            )
        if decoded == 0 and not self.stopping:
            raise SourceError(f"source {self.id}: {self.display_url} has no decodable video frames")
        return decoded


class FileSource(AvSource):
    """A video file, lossless: the queue blocks so every frame is processed."""

    def __init__(self, config: SourceConfig, on_state: StateListener | None = None) -> None:
        super().__init__(config, on_state)
        parts = urlsplit(config.url)
        self.path = Path(parts.netloc + parts.path) if parts.scheme == "file" else Path(config.url)
        self.url = str(self.path)

    def run(self) -> None:
        if not self.path.is_file():
            raise SourceError(f"source {self.id}: file not found: {self.path}")
        realtime = bool(self.config.realtime)
        while not self.stopping:
            container = self.open()
            try:
                self.decode(container, realtime)
            finally:
                container.close()
            if not self.config.loop:
                break
            # Keep pts increasing across loops so max_fps and latency maths stay monotonic.
            self.pts_offset = (self._last_kept_pts or 0.0) + 1e-3


_USERINFO_RE = re.compile(r"(?P<scheme>[A-Za-z][A-Za-z0-9+.-]*://)[^/@\s]*@")


def scrub_credentials(text: str, url: str) -> str:
    """Remove a URL's credentials from text (FFmpeg messages can echo the URL they failed on)."""
    parts = urlsplit(url)
    if parts.username is not None or parts.password is not None:
        for whole in (url, unquote(url)):
            text = text.replace(whole, "<url>")
    text = _USERINFO_RE.sub(lambda m: f"{m.group('scheme')}***@", text)
    # A password on its own (e.g. in an auth error); short ones would blank common words.
    password = parts.password or ""
    for secret in (password, unquote(password)):
        if len(secret) >= 4:
            text = text.replace(secret, "***")
    return text


def ffmpeg_reason(exc: BaseException, url: str = "") -> str:
    """An FFmpeg error as one short phrase, with ``url``'s credentials scrubbed from it."""
    text = getattr(exc, "strerror", None) or str(exc) or exc.__class__.__name__
    return scrub_credentials(str(text).strip().rstrip("."), url)


def create_source(config: SourceConfig, on_state: StateListener | None = None) -> Source:
    """The :class:`Source` for a config's URL scheme."""
    scheme = config.scheme
    if scheme == "test":
        return TestPatternSource(config, on_state)
    if scheme == "file":
        return FileSource(config, on_state)
    if scheme in ("rtsp", "rtsps"):
        from pipeline.stages.rtsp import RtspSource

        return RtspSource(config, on_state)
    if scheme == "whip":
        from pipeline.stages.whip import WhipSource

        return WhipSource(config, on_state)
    raise SourceError(f"source {config.source_id}: unsupported URL scheme {scheme!r}")
