"""Preallocated, reusable arrays: the batch tensors of each model instance.

A :class:`BufferPool` creates ``count`` arrays of one shape and dtype up front
and hands them out as ref-counted handles. When every array is in use,
``acquire`` blocks until one comes back, so a slow consumer slows its producer
down instead of growing memory. The array module is pluggable (``xp``): NumPy
on the CPU, CuPy for GPU-resident buffers.

A model sizes its pools from ``config.yaml``; each instance gets one pool of
``(max(1, max_batch_size), C, H, W)`` tensors in ``input.dtype``::

    max_batch_size: 32
    input: {shape: [3, 640, 640], dtype: float32}
    instance_group: [{count: 2}]        # two pools, one per instance

Usage::

    pool = BufferPool((32, 3, 640, 640), "float32", count=2)
    with pool.acquire(timeout=1.0) as buf:
        fill(buf.array)
"""

from __future__ import annotations

import threading
import time
from types import ModuleType, TracebackType
from typing import Any

import numpy as np

from inference.errors import WholeBatchFailure


class PoolExhausted(WholeBatchFailure, TimeoutError):
    """No buffer came back within the acquire timeout (no input's fault: a batch is not retried)."""


class BufferHandle:
    """A lease on one pooled array; it returns to the pool when its count drops to zero."""

    __slots__ = ("_pool", "_refs", "array", "index")

    def __init__(self, pool: BufferPool, index: int, array: Any) -> None:
        self._pool = pool
        self._refs = 0
        self.index = index
        self.array = array

    @property
    def refs(self) -> int:
        """Current reference count (0 = back in the pool)."""
        return self._refs

    def retain(self) -> BufferHandle:
        """Add a reference, e.g. before passing the array to another thread."""
        with self._pool._cond:
            if self._refs <= 0:
                raise RuntimeError(f"{self._pool.name}: retain() on a buffer that is back in the pool")
            self._refs += 1
        return self

    def release(self) -> None:
        """Drop a reference; the last one returns the array to the pool."""
        self._pool._release(self)

    def __enter__(self) -> BufferHandle:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.release()


class BufferPool:
    """A fixed number of preallocated arrays of one shape and dtype."""

    def __init__(
        self,
        shape: tuple[int, ...],
        dtype: Any,
        count: int,
        *,
        xp: ModuleType = np,
        name: str = "buffers",
    ) -> None:
        if count < 1:
            raise ValueError(f"{name}: a buffer pool needs at least one buffer, got count={count}")
        self.name = name
        self.shape = tuple(shape)
        self.dtype = dtype
        self.xp = xp
        self._cond = threading.Condition(threading.Lock())
        self._allocations = 0
        self._handles = [BufferHandle(self, i, self._allocate()) for i in range(count)]
        self._free = list(reversed(self._handles))
        self._waits = 0
        self._closed = False

    def _allocate(self) -> Any:
        # The only place the pool creates an array, so ``allocations`` counts every one.
        array = self.xp.empty(self.shape, dtype=self.dtype)
        self._allocations += 1
        return array

    @property
    def capacity(self) -> int:
        """How many arrays the pool owns."""
        return len(self._handles)

    @property
    def allocations(self) -> int:
        """Arrays this pool has created; equal to ``capacity`` while the pool never grows."""
        return self._allocations

    @property
    def in_use(self) -> int:
        """Arrays currently handed out."""
        with self._cond:
            return len(self._handles) - len(self._free)

    @property
    def waits(self) -> int:
        """How many ``acquire`` calls found the pool empty and had to wait."""
        return self._waits

    def acquire(self, timeout: float | None = None) -> BufferHandle:
        """Take a free array, waiting for one if all are in use.

        ``timeout`` is in seconds (``None`` waits forever); running out of it raises
        :class:`PoolExhausted`.
        """
        with self._cond:
            if not self._free:
                self._waits += 1
                deadline = None if timeout is None else time.monotonic() + timeout
                while not self._free:
                    if self._closed:
                        raise PoolExhausted(f"{self.name}: the pool is closed (its source was removed)")
                    remaining = None if deadline is None else deadline - time.monotonic()
                    if remaining is not None and remaining <= 0:
                        raise PoolExhausted(
                            f"{self.name}: all {self.capacity} buffers of shape {self.shape} stayed in use "
                            f"for {timeout:g}s; a consumer is holding them (release() or a larger pool)"
                        )
                    self._cond.wait(remaining)
            handle = self._free.pop()
            handle._refs = 1
            return handle

    def _release(self, handle: BufferHandle) -> None:
        with self._cond:
            if handle._refs <= 0:
                raise RuntimeError(f"{self.name}: buffer {handle.index} released more often than acquired")
            handle._refs -= 1
            if handle._refs == 0 and not self._closed:
                self._free.append(handle)
                self._cond.notify()

    def close(self) -> None:
        """The pool's owner is gone (a removed source): let its arrays go now.

        Pool and handles refer to each other, so without this a dropped pool waits for
        Python's cyclic collector, which may not run for hours: every removed camera's
        frames stayed resident. Free arrays go at once; one still out goes when it is
        released. The pool hands out nothing more.
        """
        with self._cond:
            self._closed = True
            self._handles = []
            self._free = []
            self._cond.notify_all()

    def __repr__(self) -> str:
        return (
            f"BufferPool({self.name!r}, shape={self.shape}, dtype={self.dtype}, "
            f"capacity={self.capacity}, in_use={self.in_use})"
        )
