"""Batch pre-processing on the GPU, a drop-in for :class:`~inference.processing.resize.ImagePreprocessor`.

Same configuration, same call, same :class:`ResizeMeta` results, so the CPU
post-processing maps boxes back to source pixels identically::

    input: {shape: [3, 640, 640], color: bgr, resize: letterbox, dtype: float16}

    pre = GpuPreprocessor(config.input, max_batch=32)
    metas = pre(images, out)          # out: a (N, 3, 640, 640) CuPy array

``images`` may be CuPy arrays, anything with ``__cuda_array_interface__`` or
a CUDA ``__dlpack__`` (read in place, no copy, after the work queued on the
calling thread's current stream), or NumPy arrays: those are
gathered into one pinned staging buffer on the host and copied to the device in
one transfer per batch. The whole batch is one kernel launch on ``stream``; the
call returns before the GPU is done, and :attr:`GpuPreprocessor.done` is an
event recorded after the launch.

Everything runs on GPU ``device`` (its buffers, its launches), whichever device
the calling thread has current, so instances on different GPUs never mix.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np

from inference.config import InputConfig
from inference.device import current_stream, is_device_array, record_event, require_cupy
from inference.gpu import kernels
from inference.processing.resize import ResizeMeta, geometry

__all__ = ["GpuPreprocessor", "device_image"]


def device_image(x: Any, index: int = 0) -> tuple[int, int, int, int]:
    """``(pointer, row pitch, width, height)`` of an H×W×3 uint8 device image with packed pixels."""
    interface = x.__cuda_array_interface__
    shape = tuple(interface["shape"])
    typestr = interface["typestr"]
    if len(shape) != 3 or shape[2] != 3 or typestr not in ("|u1", "<u1") or shape[0] == 0 or shape[1] == 0:
        raise ValueError(f"image {index}: expected a non-empty H×W×3 uint8 array, got {shape} {typestr}")
    strides = interface.get("strides")
    if strides is None:
        pitch = shape[1] * 3
    else:
        pitch, pixel, channel = strides
        if pixel != 3 or channel != 1 or pitch <= 0:
            raise ValueError(
                f"image {index}: pixels must be packed (strides (pitch, 3, 1)), got strides {strides}; "
                f"copy it with cupy.ascontiguousarray"
            )
    return int(interface["data"][0]), int(pitch), int(shape[1]), int(shape[0])


class _HostStaging:
    """Grow-only pinned + device byte buffers for host images (sized by the largest batch seen)."""

    def __init__(self, cp: Any) -> None:
        self._cp = cp
        self.host: np.ndarray | None = None
        self.device: Any = None
        self.done: Any = None  # event after the last copy out of ``host``

    def reserve(self, nbytes: int) -> None:
        from inference.gpu.memory import pinned_array

        if self.done is not None:
            # The previous batch's copy must have left the pinned buffer before it is rewritten.
            self.done.synchronize()
        if self.host is None or self.host.nbytes < nbytes:
            size = max(nbytes, 2 * (self.host.nbytes if self.host is not None else 0))
            self.host = pinned_array((size,), np.uint8)
            self.device = self._cp.empty((size,), dtype=self._cp.uint8)


class GpuPreprocessor:
    """Resizes and normalises a batch of images into a device tensor with one kernel launch."""

    def __init__(
        self, config: InputConfig, *, max_batch: int = 64, stream: Any = None, device: int | None = None
    ) -> None:
        c, h, w = config.shape  # C is 3: InputConfig refuses anything else
        cp = require_cupy()
        self._cp = cp
        self.device = cp.cuda.Device(device) if device is not None else cp.cuda.Device()
        self.config = config
        self.channels, self.height, self.width = c, h, w
        self.max_batch = max(1, max_batch)
        self.stream = stream
        self._channels = kernels.source_channels(config)
        self._fill = int(config.pad_value)
        from inference.gpu.memory import pinned_array

        with self.device:
            self._norm = cp.asarray(kernels.normalisation(config))
            self._items = cp.empty((self.max_batch, kernels.ITEM_FIELDS), dtype=cp.int64)
        self._items_host = pinned_array((self.max_batch, kernels.ITEM_FIELDS), np.int64)
        self._staging = _HostStaging(cp)
        self.done: Any = None
        self._items_copied: Any = None
        self._keep: list[Any] = []

    def geometry(self, src_w: int, src_h: int) -> ResizeMeta:
        """Where a ``src_w × src_h`` image lands in this model's input."""
        return geometry(self.config.resize, src_w, src_h, self.width, self.height)

    def __call__(self, images: Sequence[Any], out: Any) -> list[ResizeMeta]:
        """Write ``images`` into ``out[:len(images)]``; return each image's :class:`ResizeMeta`.

        Host images must be H×W×3 uint8 (a model checks each one when it is submitted).
        """
        with self.device:
            self._check_out(out, len(images))
            stream = self._stream()
            sources = self._sources(images, stream)
            rois = [(0, 0, w, h) for _, _, w, h in sources]
            metas = [self.geometry(w, h) for _, _, w, h in sources]
            self._launch([(p, pitch) for p, pitch, _, _ in sources], rois, metas, out, stream)
            return metas

    # -- internals ------------------------------------------------------------

    def _stream(self) -> Any:
        return self.stream if self.stream is not None else current_stream()

    def _check_out(self, out: Any, count: int) -> None:
        if not hasattr(out, "__cuda_array_interface__"):
            raise ValueError(
                f"the batch tensor must be a device array (got {type(out).__name__}); "
                f"use ImagePreprocessor for host tensors"
            )
        expected = (self.channels, self.height, self.width)
        if out.ndim != 4 or tuple(out.shape[1:]) != expected:
            raise ValueError(
                f"batch tensor has shape {out.shape}, expected (N, {', '.join(map(str, expected))})"
            )
        if count > out.shape[0]:
            raise ValueError(f"{count} images do not fit a batch tensor of {out.shape[0]}")
        if count > self.max_batch:
            raise ValueError(f"{count} images exceed this preprocessor's max_batch {self.max_batch}")
        if np.dtype(out.dtype) not in (np.dtype(np.float32), np.dtype(np.float16)):
            raise ValueError(f"batch tensor dtype {out.dtype} is not float32 or float16")
        if not out.flags.c_contiguous:
            raise ValueError("the batch tensor must be C-contiguous")

    def _sources(self, images: Sequence[Any], stream: Any) -> list[tuple[int, int, int, int]]:
        """Device pointer, pitch, width, height per image; host images are staged and copied."""
        self._keep = []
        host: list[tuple[int, np.ndarray]] = []
        found: list[tuple[int, int, int, int] | None] = []
        for i, image in enumerate(images):
            if isinstance(image, np.ndarray):
                host.append((i, image))
                found.append(None)
                continue
            if not hasattr(image, "__cuda_array_interface__"):
                if not is_device_array(image):
                    raise ValueError(f"image {i}: expected a NumPy or CUDA array, got {type(image).__name__}")
                image = self._cp.from_dlpack(image)
                self._keep.append(image)
            found.append(device_image(image, i))
        if len(host) < len(found):
            # Device images were written on the caller's current stream: order this stream after
            # it on the device (an event wait; the host does not block).
            stream.wait_event(record_event(current_stream()))
        if host:
            found = self._stage(host, found, stream)
        return [f for f in found if f is not None]

    def _stage(
        self,
        host: list[tuple[int, np.ndarray]],
        found: list[tuple[int, int, int, int] | None],
        stream: Any,
    ) -> list[tuple[int, int, int, int] | None]:
        total = sum(image.nbytes for _, image in host)
        staging = self._staging
        staging.reserve(total)
        assert staging.host is not None
        offset = 0
        placed = []
        for i, image in host:
            n = image.nbytes
            staging.host[offset : offset + n].reshape(image.shape)[...] = image
            placed.append((i, offset, image.shape[1], image.shape[0]))
            offset += n
        staging.device[:total].set(staging.host[:total], stream=stream)
        staging.done = record_event(stream)
        base = int(staging.device.data.ptr)
        for i, off, w, h in placed:
            found[i] = (base + off, w * 3, w, h)
        return found

    def _launch(
        self,
        sources: list[tuple[int, int]],
        rois: list[tuple[int, int, int, int]],
        metas: list[ResizeMeta],
        out: Any,
        stream: Any,
    ) -> None:
        n = len(sources)
        if n == 0:
            return
        if self._items_copied is not None:
            # The pinned table is rewritten only once the previous batch's copy of it has left.
            self._items_copied.synchronize()
        table = kernels.pack_items(sources, rois, metas, out=self._items_host)
        if self.done is not None:
            # The device table may still be read by the previous launch if it ran on another stream.
            stream.wait_event(self.done)
        self._items[:n].set(table, stream=stream)
        self._items_copied = record_event(stream)
        mode = kernels.MODE_F16 if np.dtype(out.dtype) == np.dtype(np.float16) else kernels.MODE_F32
        kernels.launch_preprocess(self._items, n, out, mode, self._norm, self._channels, self._fill, stream)
        self.done = record_event(stream)
