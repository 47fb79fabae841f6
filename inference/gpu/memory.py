"""GPU-side memory: page-locked host arrays and device buffer pools.

Both are sized when a model loads and reused; steady state allocates nothing
on the host or the device::

    staging = pinned_array((32, 3, 640, 640), "float32")        # host, page-locked
    tensors = device_pool((32, 3, 640, 640), "float32", count=1, device=1, name="det/instance-1")

Pinned memory is the only host memory a copy can overlap with compute from
(the TensorRT backend stages host inputs and outputs through it). A device
pool is a :class:`~inference.memory.BufferPool` of CuPy arrays on one GPU, so
leases are ref-counted and a pool that runs dry makes its producer wait.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from inference.device import require_cupy
from inference.memory import BufferPool

__all__ = ["device_pool", "pinned_array"]


def pinned_array(shape: tuple[int, ...], dtype: Any) -> np.ndarray:
    """A NumPy array backed by page-locked host memory (the only kind a copy can overlap with)."""
    cp = require_cupy()
    dt = np.dtype(dtype)
    count = int(np.prod(shape, dtype=np.int64))
    memory = cp.cuda.alloc_pinned_memory(max(1, count * dt.itemsize))
    # The array keeps ``memory`` alive through its base buffer.
    return np.frombuffer(memory, dtype=dt, count=count).reshape(shape)


def device_pool(
    shape: tuple[int, ...], dtype: Any, count: int, *, name: str = "device", device: int | None = None
) -> BufferPool:
    """A :class:`BufferPool` of CuPy arrays on GPU ``device`` (default: the current one)."""
    cp = require_cupy()
    gpu = cp.cuda.Device(device) if device is not None else cp.cuda.Device()
    # CuPy allocates on the current device: make it the pool's GPU while the arrays are made.
    with gpu:
        return BufferPool(shape, dtype, count, xp=cp, name=name)
