"""Latest-frame-only fan-out of annotated frames to live viewers (MJPEG, WHEP).

Like aiortc's ``MediaRelay`` with ``buffered=False``: each subscriber holds one
slot, and a new frame replaces an unread one. A viewer that reads slowly (or
never) only misses frames; nothing upstream ever waits for it.
"""

from __future__ import annotations

import asyncio
import threading
from dataclasses import dataclass, field

import cv2
import numpy as np

from pipeline.heap import trim_soon

__all__ = ["FrameRelay", "LiveFrame", "Subscription"]

JPEG_QUALITY = 75


@dataclass(slots=True)
class LiveFrame:
    """An annotated BGR frame for viewers; its JPEG is encoded once, on first use."""

    source: str
    index: int
    pts: float
    image: np.ndarray
    _jpeg: bytes | None = field(default=None, repr=False)
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False)

    def jpeg(self) -> bytes:
        """JPEG bytes (call on a worker thread: encoding takes milliseconds)."""
        with self._lock:
            if self._jpeg is None:
                ok, buf = cv2.imencode(".jpg", self.image, [cv2.IMWRITE_JPEG_QUALITY, JPEG_QUALITY])
                if not ok:
                    raise RuntimeError(f"JPEG encoding failed for frame {self.index} of {self.source}")
                self._jpeg = buf.tobytes()
            return self._jpeg


class Subscription:
    """One viewer of one source: the newest frame not yet read, and a wake-up."""

    def __init__(self, relay: FrameRelay, source: str, fps: float) -> None:
        self.relay = relay
        self.source = source
        self.fps = fps
        self.skipped = 0  # frames replaced before this viewer read them
        self._latest: LiveFrame | None = None
        self._ready = asyncio.Event()
        self._closed = False

    @property
    def closed(self) -> bool:
        return self._closed

    def offer(self, item: LiveFrame) -> None:
        if self._latest is not None:
            self.skipped += 1
        self._latest = item
        self._ready.set()

    def end(self) -> None:
        """The source is gone (or the server stops): :meth:`next` returns None from now on."""
        self._closed = True
        self._ready.set()

    async def next(self) -> LiveFrame | None:
        """The newest frame, waiting for one; None when the subscription has ended."""
        while True:
            if self._closed:
                return None
            item, self._latest = self._latest, None
            if item is not None:
                self._ready.clear()
                return item
            self._ready.clear()
            await self._ready.wait()

    def close(self) -> None:
        self.end()
        self.relay.unsubscribe(self)


def ended_source(source: str) -> str:
    """What a viewer of a source that has ended is told (WHEP and MJPEG alike)."""
    return (
        f"source {source!r} has ended: there is no live view; its last frame is "
        f"/v1/sources/{source}/snapshot.jpg"
    )


class FrameRelay:
    """Per source, the viewers that want its annotated frames (event loop only)."""

    def __init__(self) -> None:
        self._subs: dict[str, set[Subscription]] = {}
        # Sources that ended (and are still listed): a viewer of one gets nothing, ever.
        self._ended: set[str] = set()

    def subscribe(self, source: str, fps: float) -> Subscription:
        """A viewer of ``source``; of a source that has ended, one that ends at once."""
        sub = Subscription(self, source, fps)
        if source in self._ended:
            sub.end()
            return sub
        self._subs.setdefault(source, set()).add(sub)
        return sub

    def ended(self, source: str) -> bool:
        """Whether ``source`` has ended: its viewers were ended and new ones get nothing."""
        return source in self._ended

    def begin(self, source: str) -> None:
        """``source`` runs (again, when an ended one is added back under its id)."""
        self._ended.discard(source)

    def unsubscribe(self, sub: Subscription) -> None:
        subs = self._subs.get(sub.source)
        if subs is not None:
            subs.discard(sub)
            if not subs:
                del self._subs[sub.source]
                if not self._subs:
                    trim_soon()  # the viewers' encoders freed much, in their threads' arenas

    def viewers(self, source: str) -> int:
        return len(self._subs.get(source, ()))

    def max_fps(self, source: str) -> float:
        """The highest rate any viewer of ``source`` wants; 0 when nobody watches."""
        return max((s.fps for s in self._subs.get(source, ())), default=0.0)

    def publish(self, item: LiveFrame) -> None:
        for sub in list(self._subs.get(item.source, ())):
            sub.offer(item)

    def end(self, source: str) -> None:
        self._ended.add(source)
        for sub in list(self._subs.pop(source, ())):
            sub.end()

    def end_all(self) -> None:
        for source in list(self._subs):
            self.end(source)
