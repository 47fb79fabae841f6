"""The bounded queue between a source's decode thread and the event loop.

Its overflow policy is the source's promise to the operator:

* ``block`` (files): the decode thread waits, so every frame is processed; a
  full queue lets it resume once half is taken, so it decodes a run of frames
  at a time rather than waking for each one;
* ``drop_oldest`` (live cameras): the oldest waiting frame is dropped and
  counted with reason ``queue_full``, so latency cannot grow without bound.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import threading
from collections.abc import Callable
from typing import Generic, Literal, TypeVar

T = TypeVar("T")

OverflowPolicy = Literal["block", "drop_oldest"]


class EndOfStream:
    """Sentinel the producer leaves when a source has no more frames."""

    def __repr__(self) -> str:
        return "EndOfStream"


END = EndOfStream()


class StreamBreak:
    """Marker a source leaves where its stream breaks: a live source that left ``up`` for
    ``backoff``, or a looping file at the end of a pass.

    The frames after it come from a new connection (or the clip from its start), if any;
    the graph ends the stream's tracks at it. ``next_index`` is the
    index the next frame will have. Only a queue made with ``breaks=True`` keeps it.
    """

    __slots__ = ("next_index",)

    def __init__(self, next_index: int) -> None:
        self.next_index = next_index

    def __repr__(self) -> str:
        return f"StreamBreak(next_index={self.next_index})"


Marker = EndOfStream | StreamBreak


class FrameQueue(Generic[T]):
    """A bounded queue fed by one thread and drained by one asyncio task."""

    def __init__(
        self,
        maxsize: int,
        policy: OverflowPolicy,
        loop: asyncio.AbstractEventLoop,
        on_drop: Callable[[T], None] | None = None,
        breaks: bool = False,
    ) -> None:
        if maxsize < 1:
            raise ValueError("maxsize must be at least 1")
        self.maxsize = maxsize
        self.policy = policy
        # A blocked producer resumes once the queue is down to this many frames.
        self._resume_at = maxsize // 2
        self._loop = loop
        self._items: collections.deque[T | Marker] = collections.deque()
        self._cond = threading.Condition()
        self._ready = asyncio.Event()
        # True while the consumer waits for a frame: only then does a put wake the loop.
        # A busy consumer takes the next frame without waiting, so under load frames
        # arrive without a cross-thread wake-up (a syscall and a loop turn) each.
        self._waiting = False
        self._closed = False
        # Told of each frame dropped to make room: it releases and counts the frame.
        self._on_drop = on_drop
        # Whether the consumer wants StreamBreak markers (put_break does nothing otherwise).
        self._breaks = breaks

    def __len__(self) -> int:
        return len(self._items)

    def put(self, item: T, stop: threading.Event | None = None) -> bool:
        """Add a frame from the producer thread; False if the queue was closed meanwhile."""
        dropped: T | None = None
        with self._cond:
            if self.policy == "block" and len(self._items) >= self.maxsize:
                # Full: wait until the consumer has taken half, then fill up again in one go,
                # so a decoder runs several frames at a time instead of waking for each one.
                while len(self._items) > self._resume_at and not self._closed:
                    if stop is not None and stop.is_set():
                        return False
                    self._cond.wait(timeout=0.1)
            if self._closed:
                return False
            if len(self._items) >= self.maxsize:
                dropped = self._drop_oldest_frame()
            self._items.append(item)
            wake, self._waiting = self._waiting, False
        if dropped is not None and self._on_drop is not None:
            self._on_drop(dropped)
        if wake:
            self._wake()
        return True

    def _drop_oldest_frame(self) -> T | None:
        """Take the oldest waiting frame out (markers stay where they are); under the lock."""
        for i, queued in enumerate(self._items):
            if not isinstance(queued, (EndOfStream, StreamBreak)):
                del self._items[i]
                return queued
        return None

    def put_break(self, next_index: int) -> None:
        """Mark a break in a live stream, after the frames already put; only with ``breaks``."""
        if not self._breaks:
            return
        with self._cond:
            if self._closed:
                return
            self._items.append(StreamBreak(next_index))
            wake, self._waiting = self._waiting, False
        if wake:
            self._wake()

    def put_end(self) -> None:
        """Mark the end of the stream; the consumer sees :data:`END` after the last frame."""
        with self._cond:
            self._items.append(END)
            wake, self._waiting = self._waiting, False
        if wake:
            self._wake()

    def close(self) -> None:
        """Stop accepting frames and release a blocked producer (shutdown)."""
        with self._cond:
            self._closed = True
            self._cond.notify_all()

    def drain(self) -> list[T]:
        """Take every waiting frame out (used when shutting down)."""
        with self._cond:
            items = [i for i in self._items if not isinstance(i, (EndOfStream, StreamBreak))]
            self._items.clear()
            self._cond.notify_all()
        return items

    async def wait_ready(self) -> None:
        """Wait until a frame (or :data:`END`) is waiting, without taking it.

        The consumer can then wait for something else (a slot in the graph) and still
        take the freshest frame: a live source keeps replacing the oldest meanwhile.
        """
        while True:
            with self._cond:
                if self._items:
                    return
                self._ready.clear()
                self._waiting = True
            await self._ready.wait()

    def peek(self) -> T | Marker | None:
        """The item :meth:`get` would return now, left in the queue; None when empty."""
        with self._cond:
            return self._items[0] if self._items else None

    async def get(self) -> T | Marker:
        """Wait for the next frame (or :data:`END`, or a :class:`StreamBreak`)."""
        while True:
            with self._cond:
                if self._items:
                    item = self._items.popleft()
                    if len(self._items) <= self._resume_at:
                        self._cond.notify()
                    return item
            await self.wait_ready()

    def _wake(self) -> None:
        # A closed loop means nobody is waiting any more.
        with contextlib.suppress(RuntimeError):
            self._loop.call_soon_threadsafe(self._ready.set)
