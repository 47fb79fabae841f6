"""Batch pre-processing on the GPU, a drop-in for :class:`~inference.processing.resize.ImagePreprocessor`.

Same configuration, same call, same :class:`ResizeMeta` results, so the CPU
post-processing maps boxes back to source pixels identically::

    input: {shape: [3, 640, 640], color: bgr, resize: letterbox, dtype: float16}

    pre = GpuPreprocessor(config.input, max_batch=32)
    metas = pre(images, out)          # out: a (N, 3, 640, 640) CuPy array

``images`` may be CuPy arrays, anything with ``__cuda_array_interface__`` or
a CUDA ``__dlpack__`` (used in place), :class:`~inference.gpu.memory.DeviceFrame`
objects (the preprocessor's stream waits on their upload event) or NumPy
arrays (gathered into pinned staging and copied in one transfer). The whole
batch is one kernel launch on ``stream``; the call returns before the GPU is
done, and :attr:`GpuPreprocessor.done` is an event recorded after the launch.

:meth:`GpuPreprocessor.crops` is the cascade variant: axis-aligned boxes from
one or more device frames, cut exactly like
:func:`~inference.processing.crop.crop_box`, straight into a batch tensor.
:func:`roi_resize` cuts boxes into fixed-size uint8 crops, and
:func:`warp_crops` rectifies rotated quadrilaterals into uint8 crops.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np

from inference.config import InputConfig
from inference.device import current_stream, is_device_array, record_event, require_cupy
from inference.gpu import kernels
from inference.processing.resize import ResizeMeta, geometry

__all__ = ["GpuPreprocessor", "device_image", "roi_resize", "warp_crops"]


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
        self.allocations = 0

    def reserve(self, nbytes: int) -> None:
        from inference.gpu.memory import pinned_array

        if self.done is not None:
            # The previous batch's copy must have left the pinned buffer before it is rewritten.
            self.done.synchronize()
        if self.host is None or self.host.nbytes < nbytes:
            size = max(nbytes, 2 * (self.host.nbytes if self.host is not None else 0))
            self.host = pinned_array((size,), np.uint8)
            self.device = self._cp.empty((size,), dtype=self._cp.uint8)
            self.allocations += 1


class GpuPreprocessor:
    """Resizes and normalises a batch of images into a device tensor with one kernel launch."""

    def __init__(self, config: InputConfig, *, max_batch: int = 64, stream: Any = None) -> None:
        c, h, w = config.shape
        if c != 3:
            raise ValueError(f"input.shape {config.shape}: only 3-channel model inputs are supported")
        cp = require_cupy()
        self._cp = cp
        self.config = config
        self.channels, self.height, self.width = c, h, w
        self.max_batch = max(1, max_batch)
        self.stream = stream
        self._channels = kernels.source_channels(config)
        self._fill = int(config.pad_value)
        self._norm = cp.asarray(kernels.normalisation(config))
        from inference.gpu.memory import pinned_array

        self._items_host = pinned_array((self.max_batch, kernels.ITEM_FIELDS), np.int64)
        self._items = cp.empty((self.max_batch, kernels.ITEM_FIELDS), dtype=cp.int64)
        self._staging = _HostStaging(cp)
        self.done: Any = None
        self._items_copied: Any = None
        self._keep: list[Any] = []

    @property
    def staging_allocations(self) -> int:
        """How often the host-image staging grew (constant once the largest batch was seen)."""
        return self._staging.allocations

    def geometry(self, src_w: int, src_h: int) -> ResizeMeta:
        """Where a ``src_w × src_h`` image lands in this model's input."""
        return geometry(self.config.resize, src_w, src_h, self.width, self.height)

    def __call__(self, images: Sequence[Any], out: Any) -> list[ResizeMeta]:
        """Write ``images`` into ``out[:len(images)]``; return each image's :class:`ResizeMeta`."""
        self._check_out(out, len(images))
        stream = self._stream()
        sources = self._sources(images, stream)
        rois = [(0, 0, w, h) for _, _, w, h in sources]
        metas = [self.geometry(w, h) for _, _, w, h in sources]
        self._launch([(p, pitch) for p, pitch, _, _ in sources], rois, metas, out, stream)
        return metas

    def crops(
        self,
        frames: Sequence[Any],
        boxes: Sequence[Sequence[float]] | np.ndarray,
        frame_index: Sequence[int],
        out: Any,
        pad: float = 0,
    ) -> list[ResizeMeta]:
        """Crop ``boxes`` (``x1, y1, x2, y2`` in source pixels of ``frames[frame_index[k]]``) into ``out``.

        Each crop is the region ``crop_box(frame, box, pad)`` would cut; the
        metas map model pixels back to crop pixels (add the box's corner for
        frame pixels).
        """
        self._check_out(out, len(frame_index))
        stream = self._stream()
        sources = self._sources(frames, stream)
        items, rois, metas = [], [], []
        for box, fi in zip(boxes, frame_index, strict=True):
            ptr, pitch, w, h = sources[fi]
            roi = kernels.box_roi(box, w, h, pad)
            items.append((ptr, pitch))
            rois.append(roi)
            metas.append(self.geometry(roi[2], roi[3]))
        self._launch(items, rois, metas, out, stream)
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
                from inference.processing.resize import check_image

                check_image(image, i)
                host.append((i, image))
                found.append(None)
                continue
            wait = getattr(image, "wait", None)
            if callable(wait):
                wait(stream)  # a DeviceFrame: order after its upload, on the device
            if not hasattr(image, "__cuda_array_interface__"):
                if not is_device_array(image):
                    raise ValueError(f"image {i}: expected a NumPy or CUDA array, got {type(image).__name__}")
                image = self._cp.from_dlpack(image)
                self._keep.append(image)
            found.append(device_image(image, i))
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


def _check_crop_slots(out: Any, k: int) -> None:
    """``out`` must be ``(K, H, W, 3)`` uint8 with room for ``k`` crops."""
    if out.ndim != 4 or out.shape[3] != 3 or np.dtype(out.dtype) != np.dtype(np.uint8):
        raise ValueError(f"out must be (K, H, W, 3) uint8, got {out.shape} {out.dtype}")
    if k > out.shape[0]:
        raise ValueError(f"{k} crops do not fit {out.shape[0]} slots")


def _frame_views(frames: Sequence[Any], stream: Any) -> list[tuple[int, int, int, int]]:
    """Device views of ``frames``; frames still being uploaded are waited for on ``stream``."""
    views = []
    for i, frame in enumerate(frames):
        wait = getattr(frame, "wait", None)
        if callable(wait):
            wait(stream)  # an event wait on the stream, not a host sync
        views.append(device_image(frame, i))
    return views


def warp_crops(
    frames: Sequence[Any],
    hinv: np.ndarray,
    sizes: Sequence[tuple[int, int]],
    frame_index: Sequence[int],
    out: Any,
    *,
    fill: int = 0,
    stream: Any = None,
) -> Any:
    """Rectify crops with inverse homographies (output pixel → source pixel) into ``out``.

    ``frames`` are H×W×3 uint8 device images, ``hinv`` is ``(K, 3, 3)``,
    ``sizes[k] = (w, h)`` the crop's size inside ``out`` (``K×H×W×3`` uint8 on the
    device; the rest of each slot is ``fill``). For a text quadrilateral ``q``
    and crop size ``(w, h)``::

        M = cv2.getPerspectiveTransform(q, [[0, 0], [w, 0], [w, h], [0, h]])
        hinv[k] = np.linalg.inv(M)

    Returns the event recorded after the launch.
    """
    cp = require_cupy()
    stream = stream if stream is not None else current_stream()
    k = len(frame_index)
    _check_crop_slots(out, k)
    for w, h in sizes:
        if not (1 <= w <= out.shape[2] and 1 <= h <= out.shape[1]):
            raise ValueError(f"crop size {(w, h)} does not fit slots of {out.shape[2]}×{out.shape[1]}")
    views = _frame_views(frames, stream)
    sources = [(views[fi][0], views[fi][1], views[fi][2], views[fi][3]) for fi in frame_index]
    table = kernels.pack_warp_items(sources, sizes)
    with stream:
        items = cp.asarray(table)
        matrices = cp.asarray(np.ascontiguousarray(np.asarray(hinv, dtype=np.float32).reshape(k, 9)))
    kernels.launch_warp(items, matrices, k, out, fill, stream)
    return record_event(stream)


def roi_resize(
    frames: Sequence[Any],
    boxes: Sequence[Sequence[float]] | np.ndarray,
    frame_index: Sequence[int],
    out: Any,
    *,
    pad: float = 0,
    stream: Any = None,
) -> Any:
    """Cut ``boxes`` like ``crop_box`` and stretch each to ``out``'s ``K×H×W×3`` uint8 slots.

    Equivalent to ``cv2.resize(crop_box(frame, box, pad), (W, H))`` per box, one
    launch for all. Returns the event recorded after the launch.
    """
    cp = require_cupy()
    stream = stream if stream is not None else current_stream()
    k = len(frame_index)
    _check_crop_slots(out, k)
    out_h, out_w = int(out.shape[1]), int(out.shape[2])
    views = _frame_views(frames, stream)
    sources, rois, metas = [], [], []
    for box, fi in zip(boxes, frame_index, strict=True):
        ptr, pitch, w, h = views[fi]
        roi = kernels.box_roi(box, w, h, pad)
        sources.append((ptr, pitch))
        rois.append(roi)
        metas.append(geometry("stretch", roi[2], roi[3], out_w, out_h))
    table = kernels.pack_items(sources, rois, metas)
    with stream:
        items = cp.asarray(table)
        norm = cp.zeros(9, dtype=cp.float32)
    kernels.launch_preprocess(items, k, out, kernels.MODE_U8, norm, (0, 1, 2), 0, stream)
    return record_event(stream)
