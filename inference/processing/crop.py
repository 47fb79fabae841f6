"""Cutting detections out of a frame for a second-stage model.

``crop_upright`` rectifies a rotated text quadrilateral into an upright
rectangle (for text classifiers/recognisers); ``crop_box`` cuts an
axis-aligned box. Both take H×W×3 images and source-pixel coordinates.
"""

from __future__ import annotations

from collections.abc import Sequence

import cv2
import numpy as np

__all__ = ["VERTICAL_RATIO", "crop_box", "crop_upright"]

# A rectified crop at least this many times taller than wide is a vertical
# text line and is turned 90° counter-clockwise so it reads left to right.
VERTICAL_RATIO = 1.5


def crop_upright(
    image: np.ndarray, polygon: Sequence[Sequence[float]] | np.ndarray, out_height: int | None = None
) -> np.ndarray:
    """Perspective-warp the quadrilateral ``polygon`` to an upright rectangle.

    ``polygon`` is four ``(x, y)`` corners clockwise from top-left (as
    :class:`~inference.results.Detection` carries them). The crop is as wide as
    the longer of the top/bottom edges and as tall as the longer of the
    left/right edges (rounded, at least 1 px each); the border replicates edge pixels.
    With ``out_height`` the result is scaled, keeping its aspect ratio, to that
    height in the same warp. Vertical lines (height/width ≥ 1.5) come back
    rotated 90° counter-clockwise. Always returns a new contiguous array.
    """
    src = np.asarray(polygon, dtype=np.float32).reshape(-1, 2)
    if src.shape != (4, 2):
        raise ValueError(f"crop_upright needs four (x, y) corners, got an array of shape {src.shape}")
    tl, tr, br, bl = src
    # Rounded, not truncated, so float noise in the corners cannot lose a pixel.
    width = max(1, round(float(max(np.linalg.norm(tr - tl), np.linalg.norm(br - bl)))))
    height = max(1, round(float(max(np.linalg.norm(bl - tl), np.linalg.norm(br - tr)))))
    vertical = height / width >= VERTICAL_RATIO
    if out_height is not None:
        if out_height < 1:
            raise ValueError(f"out_height must be at least 1, got {out_height}")
        # Scale the warp target so the final (possibly rotated) crop is out_height tall.
        final_h = width if vertical else height
        factor = out_height / final_h
        width, height = max(1, round(width * factor)), max(1, round(height * factor))
        if vertical:
            width = out_height
        else:
            height = out_height
    dst = np.array([[0, 0], [width, 0], [width, height], [0, height]], dtype=np.float32)
    matrix = cv2.getPerspectiveTransform(src, dst)
    crop = cv2.warpPerspective(
        image, matrix, (width, height), flags=cv2.INTER_CUBIC, borderMode=cv2.BORDER_REPLICATE
    )
    if vertical:
        crop = np.ascontiguousarray(np.rot90(crop))
    return crop


def crop_box(image: np.ndarray, box: Sequence[float] | np.ndarray, pad: float = 0) -> np.ndarray:
    """The pixels of ``box`` (``x1, y1, x2, y2``) grown by ``pad`` on each side, as a view of ``image``.

    Fractional edges round outwards; the box is clipped to the image. The crop
    is never empty: a box that is degenerate or lies outside the image yields
    at least 1×1 pixel, the image pixels nearest to it. The result is a view,
    so copy it if the frame's buffer will be reused.
    """
    h, w = image.shape[:2]
    if h == 0 or w == 0:
        raise ValueError("crop_box: the image is empty")
    x1, y1, x2, y2 = (float(v) for v in box)
    x1, x2 = min(x1, x2) - pad, max(x1, x2) + pad
    y1, y2 = min(y1, y2) - pad, max(y1, y2) + pad
    left, right = _span(x1, x2, w)
    top, bottom = _span(y1, y2, h)
    return image[top:bottom, left:right]


def _span(lo: float, hi: float, size: int) -> tuple[int, int]:
    """Integer ``[start, end)`` covering ``[lo, hi]`` inside ``[0, size)``, at least 1 wide."""
    start = min(max(int(np.floor(lo)), 0), size - 1)
    end = max(min(int(np.ceil(hi)), size), start + 1)
    return start, end
