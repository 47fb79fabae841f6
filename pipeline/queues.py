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


class FrameQueue(Generic[T]):
    """A bounded queue fed by one thread and drained by one asyncio task."""

    def __init__(
        self,
        maxsize: int,
        policy: OverflowPolicy,
        loop: asyncio.AbstractEventLoop,
        on_drop: Callable[[T], None] | None = None,
    ) -> None:
        if maxsize < 1:
            raise ValueError("maxsize must be at least 1")
        self.maxsize = maxsize
        self.policy = policy
        # A blocked producer resumes once the queue is down to this many frames.
        self._resume_at = maxsize // 2
        self._loop = loop
        self._items: collections.deque[T | EndOfStream] = collections.deque()
        self._cond = threading.Condition()
        self._ready = asyncio.Event()
        # True while the consumer waits for a frame: only then does a put wake the loop.
        # A busy consumer takes the next frame without waiting, so under load frames
        # arrive without a cross-thread wake-up (a syscall and a loop turn) each.
        self._waiting = False
        self._closed = False
        # Told of each frame dropped to make room: it releases and counts the frame.
        self._on_drop = on_drop

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
                oldest = self._items.popleft()
                assert not isinstance(oldest, EndOfStream)
                dropped = oldest
            self._items.append(item)
            wake, self._waiting = self._waiting, False
        if dropped is not None and self._on_drop is not None:
            self._on_drop(dropped)
        if wake:
            self._wake()
        return True

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
            items = [i for i in self._items if not isinstance(i, EndOfStream)]
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

    def peek(self) -> T | EndOfStream | None:
        """The item :meth:`get` would return now, left in the queue; None when empty."""
        with self._cond:
            return self._items[0] if self._items else None

    async def get(self) -> T | EndOfStream:
        """Wait for the next frame (or :data:`END`)."""
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
