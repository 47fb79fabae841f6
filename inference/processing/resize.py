"""Image → model-input tensor: resize geometry, resizing and normalisation.

This module owns how an H×W×3 uint8 RGB image becomes one ``C×H×W`` item of a
batch tensor, and the inverse mapping from model-input pixels back to source
pixels.

Coordinates are continuous pixel coordinates: pixel ``i`` spans ``[i, i + 1)``.
``cv2.resize`` maps the edges of the source onto the edges of the destination,
so a point maps between the two with one scale and one offset per axis::

    model_x = source_x * scale_x + pad_x        source_x = (model_x - pad_x) / scale_x

Resize modes (``InputConfig.resize``):

``letterbox``
    Keep the aspect ratio, fit inside the model input and **centre** the
    content; the border is ``pad_value``. When the padding is odd the extra
    pixel goes to the right/bottom.
``stretch``
    Fill the model input, ignoring the aspect ratio.
``keep_height``
    Scale to the model height keeping the aspect ratio; the width is capped at
    the model width (wider images are squeezed) and the content sits at the
    left, padded on the right. This is the text-recogniser convention.

Normalisation is ``(x * scale - mean) / std`` with ``mean`` and ``std`` given
in the *model's* channel order (after the RGB/BGR swap). Padding is written
directly as its normalised value.

Two writers share the geometry: :class:`ImagePreprocessor` fills float
``N×C×H×W`` tensors, normalised; :class:`ImageResizer` fills uint8 ``N×H×W×3``
RGB batches, only resized and padded, for a model that normalises itself
(OpenVINO with ``backend_options.preprocess: model``).
"""

from __future__ import annotations

import threading
from collections.abc import Sequence
from dataclasses import dataclass

import cv2
import numpy as np

from inference.config import InputConfig

__all__ = [
    "ImagePreprocessor",
    "ImageResizer",
    "ResizeMeta",
    "check_image",
    "geometry",
    "keep_height_geometry",
    "letterbox_geometry",
    "stretch_geometry",
]


@dataclass(frozen=True, slots=True)
class ResizeMeta:
    """Where a source image landed inside the model input.

    ``scale_x``/``scale_y`` are model pixels per source pixel; the resized
    content occupies ``[pad_x, pad_x + content_w) × [pad_y, pad_y + content_h)``.
    """

    src_w: int
    src_h: int
    scale_x: float
    scale_y: float
    pad_x: int
    pad_y: int
    content_w: int
    content_h: int

    def to_source(self, points: np.ndarray, clip: bool = True) -> np.ndarray:
        """Map ``(..., 2)`` model-input ``(x, y)`` points to source pixels (a new float array)."""
        pts = np.asarray(points, dtype=np.float64)
        out = np.empty(pts.shape, dtype=np.float64)
        out[..., 0] = (pts[..., 0] - self.pad_x) / self.scale_x
        out[..., 1] = (pts[..., 1] - self.pad_y) / self.scale_y
        if clip:
            np.clip(out[..., 0], 0.0, self.src_w, out=out[..., 0])
            np.clip(out[..., 1], 0.0, self.src_h, out=out[..., 1])
        return out

    def boxes_to_source(self, boxes: np.ndarray, clip: bool = True) -> np.ndarray:
        """Map ``(K, 4)`` model-input ``x1, y1, x2, y2`` boxes to source pixels."""
        return self.to_source(np.asarray(boxes).reshape(-1, 2, 2), clip).reshape(-1, 4)

    def to_model(self, points: np.ndarray) -> np.ndarray:
        """Map ``(..., 2)`` source points into the model input (the inverse of :meth:`to_source`)."""
        pts = np.asarray(points, dtype=np.float64)
        out = np.empty(pts.shape, dtype=np.float64)
        out[..., 0] = pts[..., 0] * self.scale_x + self.pad_x
        out[..., 1] = pts[..., 1] * self.scale_y + self.pad_y
        return out


def _meta(src_w: int, src_h: int, new_w: int, new_h: int, pad_x: int, pad_y: int) -> ResizeMeta:
    # The effective scale is the one cv2.resize applies, i.e. after rounding the size.
    return ResizeMeta(src_w, src_h, new_w / src_w, new_h / src_h, pad_x, pad_y, new_w, new_h)


def letterbox_geometry(src_w: int, src_h: int, dst_w: int, dst_h: int) -> ResizeMeta:
    """Aspect-preserving fit, centred (odd padding: the extra pixel goes right/bottom)."""
    r = min(dst_w / src_w, dst_h / src_h)
    new_w = min(dst_w, max(1, round(src_w * r)))
    new_h = min(dst_h, max(1, round(src_h * r)))
    return _meta(src_w, src_h, new_w, new_h, (dst_w - new_w) // 2, (dst_h - new_h) // 2)


def stretch_geometry(src_w: int, src_h: int, dst_w: int, dst_h: int) -> ResizeMeta:
    """Fill the whole model input."""
    return _meta(src_w, src_h, dst_w, dst_h, 0, 0)


def keep_height_geometry(src_w: int, src_h: int, dst_w: int, dst_h: int) -> ResizeMeta:
    """Model height, width ``ceil(dst_h * src_w / src_h)`` capped at ``dst_w``, content at the left."""
    new_w = min(dst_w, max(1, -(-dst_h * src_w // src_h)))
    return _meta(src_w, src_h, new_w, dst_h, 0, 0)


_GEOMETRY = {
    "letterbox": letterbox_geometry,
    "stretch": stretch_geometry,
    "keep_height": keep_height_geometry,
}


def geometry(mode: str, src_w: int, src_h: int, dst_w: int, dst_h: int) -> ResizeMeta:
    """The placement of a ``src_w × src_h`` image in a ``dst_w × dst_h`` input for ``mode``."""
    try:
        fn = _GEOMETRY[mode]
    except KeyError:
        raise ValueError(f"unknown resize mode {mode!r}; expected one of {sorted(_GEOMETRY)}") from None
    return fn(src_w, src_h, dst_w, dst_h)


def check_image(image: object, index: int = 0, *, model: str = "") -> None:
    """Raise ``ValueError`` unless ``image`` is a non-empty H×W×3 uint8 array.

    The message names the image by ``index`` and, when given, the ``model`` it was for.
    """
    if (
        not isinstance(image, np.ndarray)
        or image.dtype != np.uint8
        or image.ndim != 3
        or image.shape[2] != 3
        or image.shape[0] == 0
        or image.shape[1] == 0
    ):
        shape = getattr(image, "shape", None)
        dtype = getattr(image, "dtype", type(image).__name__)
        where = f"{model}: image {index}" if model else f"image {index}"
        raise ValueError(f"{where}: expected a non-empty H×W×3 uint8 RGB array, got {shape} {dtype}")


def _check_batch(count: int, out: np.ndarray, item_shape: tuple[int, int, int]) -> None:
    """Refuse a batch tensor that is not ``N × item_shape`` or too small for ``count`` images."""
    if out.ndim != 4 or tuple(out.shape[1:]) != item_shape:
        raise ValueError(
            f"batch tensor has shape {out.shape}, expected (N, {', '.join(map(str, item_shape))})"
        )
    if count > out.shape[0]:
        raise ValueError(f"{count} images do not fit a batch tensor of {out.shape[0]}")


def _fill_border(dst: np.ndarray, value: float, x0: int, y0: int, cw: int, ch: int) -> None:
    """Set everything of ``dst`` (H×W or H×W×C) outside the content rectangle to ``value``."""
    dst[:y0] = value
    dst[y0 + ch :] = value
    dst[y0 : y0 + ch, :x0] = value
    dst[y0 : y0 + ch, x0 + cw :] = value


class _Staging(threading.local):
    """Per-thread reusable buffers (a task may be shared by several worker threads)."""

    content: np.ndarray | None = None
    plane: np.ndarray | None = None


_CV_DEPTH = {np.dtype(np.float32): cv2.CV_32F, np.dtype(np.float16): cv2.CV_16F}


class ImagePreprocessor:
    """Resizes and normalises images straight into a caller-provided batch tensor.

    The resize goes into a reusable uint8 staging buffer; each output channel
    is then extracted into a reusable uint8 plane and scaled/offset by OpenCV
    directly into ``out[i, c]``. Doing the interleaved→planar transpose per
    plane with OpenCV is several times faster than a batch-wide NumPy
    expression, whose strided reads dominate. Steady state allocates nothing.
    """

    def __init__(self, config: InputConfig) -> None:
        c, h, w = config.shape  # C is 3: InputConfig refuses anything else
        self.config = config
        self.channels, self.height, self.width = c, h, w
        # Model channel c reads source (RGB) channel _src[c].
        self._src = (0, 1, 2) if config.color == "rgb" else (2, 1, 0)
        std = np.asarray(config.std, dtype=np.float64)
        mean = np.asarray(config.mean, dtype=np.float64)
        self._alpha = [float(v) for v in config.scale / std]
        self._beta = [float(v) for v in -mean / std]
        self._pad = [config.pad_value * a + b for a, b in zip(self._alpha, self._beta, strict=True)]
        self._geometry = _GEOMETRY[config.resize]
        self._staging = _Staging()

    def geometry(self, src_w: int, src_h: int) -> ResizeMeta:
        """Where a ``src_w × src_h`` image lands in this model's input."""
        return self._geometry(src_w, src_h, self.width, self.height)

    def __call__(self, images: Sequence[np.ndarray], out: np.ndarray) -> list[ResizeMeta]:
        """Write ``images`` into ``out[:len(images)]``; return each image's :class:`ResizeMeta`.

        Images must be H×W×3 uint8 (see :func:`check_image`); a model checks each
        one when it is submitted, so a bad image fails its own request, not a batch.
        """
        _check_batch(len(images), out, (self.channels, self.height, self.width))
        if out.dtype not in _CV_DEPTH:
            raise ValueError(f"batch tensor dtype {out.dtype} is not float32 or float16")
        return [self.write(image, out[i]) for i, image in enumerate(images)]

    def write(self, image: np.ndarray, item: np.ndarray) -> ResizeMeta:
        """Resize and normalise one image into ``item`` (``C×H×W``)."""
        src_h, src_w = image.shape[:2]
        meta = self.geometry(src_w, src_h)
        x0, y0, cw, ch = meta.pad_x, meta.pad_y, meta.content_w, meta.content_h
        content = self._resized(image, cw, ch)
        plane = self._buffer("plane", (self.height, self.width))[:ch, :cw]
        depth = _CV_DEPTH[item.dtype]
        for c in range(self.channels):
            dst = item[c]
            _fill_border(dst, self._pad[c], x0, y0, cw, ch)
            region = dst[y0 : y0 + ch, x0 : x0 + cw]
            channel = cv2.extractChannel(content, self._src[c], dst=plane)
            if region.strides[1] == region.itemsize:
                written = cv2.addWeighted(
                    channel, self._alpha[c], channel, 0.0, self._beta[c], dst=region, dtype=depth
                )
                if np.shares_memory(written, region):
                    continue
            # A layout OpenCV cannot write into in place: do it in NumPy.
            np.multiply(channel, np.float32(self._alpha[c]), out=region, casting="unsafe")
            region += region.dtype.type(self._beta[c])
        return meta

    def _resized(self, image: np.ndarray, cw: int, ch: int) -> np.ndarray:
        if image.shape[1] == cw and image.shape[0] == ch:
            return image
        view = self._buffer("content", (self.height, self.width, 3))[:ch, :cw]
        return cv2.resize(image, (cw, ch), dst=view, interpolation=cv2.INTER_LINEAR)

    def _buffer(self, name: str, shape: tuple[int, ...]) -> np.ndarray:
        buf: np.ndarray | None = getattr(self._staging, name)
        if buf is None:
            buf = np.empty(shape, dtype=np.uint8)
            setattr(self._staging, name, buf)
        return buf


class ImageResizer:
    """Resizes images into a caller-provided uint8 ``N×H×W×3`` RGB batch, without normalising.

    For a model that swaps channels, normalises and transposes inside its own
    graph. Same geometry and :class:`ResizeMeta` as :class:`ImagePreprocessor`;
    ``cv2.resize`` writes straight into each item's content rectangle and the
    border is ``pad_value``, so steady state allocates nothing.
    """

    def __init__(self, config: InputConfig) -> None:
        _, h, w = config.shape
        self.config = config
        self.height, self.width = h, w
        self.pad_value = config.pad_value
        self._geometry = _GEOMETRY[config.resize]

    def geometry(self, src_w: int, src_h: int) -> ResizeMeta:
        """Where a ``src_w × src_h`` image lands in this model's input."""
        return self._geometry(src_w, src_h, self.width, self.height)

    def __call__(self, images: Sequence[np.ndarray], out: np.ndarray) -> list[ResizeMeta]:
        """Write ``images`` into ``out[:len(images)]``; return each image's :class:`ResizeMeta`."""
        _check_batch(len(images), out, (self.height, self.width, 3))
        if out.dtype != np.uint8:
            raise ValueError(f"batch tensor dtype {out.dtype} is not uint8")
        return [self.write(image, out[i]) for i, image in enumerate(images)]

    def write(self, image: np.ndarray, item: np.ndarray) -> ResizeMeta:
        """Resize one image into ``item`` (``H×W×3``) and pad around it."""
        src_h, src_w = image.shape[:2]
        meta = self.geometry(src_w, src_h)
        x0, y0, cw, ch = meta.pad_x, meta.pad_y, meta.content_w, meta.content_h
        _fill_border(item, self.pad_value, x0, y0, cw, ch)
        region = item[y0 : y0 + ch, x0 : x0 + cw]
        if src_w == cw and src_h == ch:
            region[...] = image
            return meta
        written = cv2.resize(image, (cw, ch), dst=region, interpolation=cv2.INTER_LINEAR)
        if not np.shares_memory(written, region):
            region[...] = written  # a layout OpenCV could not write into in place
        return meta
