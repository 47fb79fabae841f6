"""GPU-side memory: pinned host staging, device buffer pools and device frames.

Everything is sized when a pipeline starts and reused; steady state allocates
nothing on the host or the device::

    # per source: decoded frames staged in pinned memory, uploaded asynchronously
    staging = PinnedPool((1080, 1920, 3), "uint8", count=4)
    frames = device_pool((1080, 1920, 3), "uint8", count=8, name="cam1/frames")
    frame = upload(image, staging, frames, stream)      # returns at once
    ...
    frame.wait(consumer_stream)   # the consumer waits on the device, not on the host
    frame.release()

A :class:`DeviceFrame` carries its array, the stream it was written on and
an event recorded after the write, so the next stage orders itself after the
copy with ``stream.wait_event`` instead of a host synchronisation. Pools are
:class:`~inference.memory.BufferPool` instances, so leases are ref-counted and a
pool that runs dry makes its producer wait (backpressure).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from types import ModuleType
from typing import Any

import numpy as np

from inference.device import record_event, require_cupy, wait_event
from inference.memory import BufferHandle, BufferPool

__all__ = [
    "DeviceFrame",
    "PinnedPool",
    "device_pool",
    "pinned_array",
    "upload",
]


def pinned_array(shape: tuple[int, ...], dtype: Any) -> np.ndarray:
    """A NumPy array backed by page-locked host memory (the only kind a copy can overlap with)."""
    cp = require_cupy()
    dt = np.dtype(dtype)
    count = int(np.prod(shape, dtype=np.int64))
    memory = cp.cuda.alloc_pinned_memory(max(1, count * dt.itemsize))
    # The array keeps ``memory`` alive through its base buffer.
    return np.frombuffer(memory, dtype=dt, count=count).reshape(shape)


def _pinned_module() -> ModuleType:
    # BufferPool allocates through ``xp.empty(shape, dtype=...)``; this stand-in
    # module makes those arrays pinned.
    module = ModuleType("vidpipe_pinned")

    def empty(shape: tuple[int, ...], dtype: Any = np.float32) -> np.ndarray:
        return pinned_array(tuple(shape), dtype)

    module.empty = empty  # type: ignore[attr-defined]
    return module


class PinnedPool(BufferPool):
    """A :class:`BufferPool` of page-locked NumPy arrays for host→device staging."""

    def __init__(self, shape: tuple[int, ...], dtype: Any, count: int, *, name: str = "pinned") -> None:
        super().__init__(shape, dtype, count, xp=_pinned_module(), name=name)


def device_pool(shape: tuple[int, ...], dtype: Any, count: int, *, name: str = "device") -> BufferPool:
    """A :class:`BufferPool` of CuPy arrays on the current device."""
    return BufferPool(shape, dtype, count, xp=require_cupy(), name=name)


@dataclass(eq=False)
class DeviceFrame:
    """A device array, the stream that writes it and the event that marks the write done.

    ``handle`` is the pool lease behind ``array`` (``None`` for arrays the frame
    does not own); ``staging`` a pinned lease to give back once the copy is done.
    """

    array: Any
    stream: Any = None
    event: Any = None
    handle: BufferHandle | None = None
    staging: BufferHandle | None = None
    info: dict[str, Any] = field(default_factory=dict)

    @property
    def shape(self) -> tuple[int, ...]:
        return tuple(self.array.shape)

    @property
    def __cuda_array_interface__(self) -> dict[str, Any]:
        # Consumers that only know the protocol still get the pixels; they
        # should call wait() first (the preprocessor does).
        interface: dict[str, Any] = self.array.__cuda_array_interface__
        return interface

    def wait(self, stream: Any) -> None:
        """Order ``stream`` after the write on the device (no host blocking)."""
        wait_event(stream, self.event)

    def synchronize(self) -> None:
        """Block the host until the write is done."""
        if self.event is not None:
            self.event.synchronize()
        self._drop_staging()

    def ready(self) -> bool:
        """Whether the write has finished (non-blocking)."""
        done = self.event is None or bool(self.event.done)
        if done:
            self._drop_staging()
        return done

    def _drop_staging(self) -> None:
        if self.staging is not None:
            staging, self.staging = self.staging, None
            staging.release()

    def retain(self) -> DeviceFrame:
        if self.handle is not None:
            self.handle.retain()
        return self

    def release(self) -> None:
        """Give the buffers back; the staging buffer only once the upload has finished."""
        if self.staging is not None:
            self.synchronize()
        if self.handle is not None:
            handle, self.handle = self.handle, None
            handle.release()


def upload(
    image: np.ndarray,
    staging: BufferPool,
    frames: BufferPool,
    stream: Any,
    *,
    timeout: float | None = None,
) -> DeviceFrame:
    """Copy an H×W×C host image into a pooled device buffer, asynchronously on ``stream``.

    The image goes through a pinned staging buffer so the copy can overlap
    with compute. Images smaller than the pool's shape occupy its top-left
    corner; the frame's array is that view (rows keep the pool's pitch).
    """
    h, w = image.shape[:2]
    fh, fw = frames.shape[:2]
    if h > fh or w > fw or image.shape[2:] != frames.shape[2:]:
        raise ValueError(f"frame of shape {image.shape} does not fit the device pool's {frames.shape}")
    pinned = staging.acquire(timeout=timeout)
    try:
        device = frames.acquire(timeout=timeout)
    except BaseException:
        pinned.release()
        raise
    try:
        host = pinned.array[:h, :w]
        np.copyto(host, image)
        target = device.array[:h, :w]
        if h == fh and w == fw:
            target.set(pinned.array, stream=stream)
        else:
            # A 2-D strided copy moves exactly the image's rows into the pitched view.
            cp = require_cupy()
            item = image.dtype.itemsize * int(np.prod(image.shape[2:], dtype=np.int64))
            cp.cuda.runtime.memcpy2DAsync(
                target.data.ptr,
                target.strides[0],
                host.ctypes.data,
                host.strides[0],
                w * item,
                h,
                cp.cuda.runtime.memcpyHostToDevice,
                stream.ptr,
            )
        event = record_event(stream)
    except BaseException:
        pinned.release()
        device.release()
        raise
    return DeviceFrame(target, stream=stream, event=event, handle=device, staging=pinned)
