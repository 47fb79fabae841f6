"""Crops of detected objects, each with the transform that maps it back to source pixels.

A cascade stage cuts an object's axis-aligned box or warps its polygon upright
(turning vertical text lines a quarter turn), and may turn the crop further
(``upright_by``). Whatever a model finds in the crop is reported in source
pixels through :attr:`Crop.to_source`, a 3×3 homography from crop to frame
coordinates, so a detector run on rotated or warped crops still answers in
the frame's pixels.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import cv2
import numpy as np

from inference.processing.crop import VERTICAL_RATIO, crop_box, crop_upright


@dataclass(slots=True, frozen=True)
class Crop:
    """An H×W×3 image cut from a frame and the crop-to-frame homography."""

    image: np.ndarray
    to_source: np.ndarray  # 3×3, float64

    @property
    def min_side(self) -> int:
        return int(min(self.image.shape[:2]))


def cut_box(image: np.ndarray, box: Sequence[float]) -> Crop:
    """The box's pixels (a view of ``image``), offset to where the view starts in the frame."""
    crop = crop_box(image, box)
    h, w = image.shape[:2]
    # Where crop_box's view starts: the box's floor, clipped into the image.
    left = min(max(int(np.floor(min(box[0], box[2]))), 0), w - 1)
    top = min(max(int(np.floor(min(box[1], box[3]))), 0), h - 1)
    return Crop(crop, np.array([[1.0, 0.0, left], [0.0, 1.0, top], [0.0, 0.0, 1.0]]))


def cut_polygon(image: np.ndarray, polygon: Sequence[Sequence[float]]) -> Crop:
    """The quadrilateral warped upright (see :func:`~inference.processing.crop.crop_upright`)."""
    src = np.asarray(polygon, dtype=np.float32).reshape(4, 2)
    crop = crop_upright(image, src)
    tl, tr, br, bl = src
    # The warp target crop_upright chose; it turned the result a quarter when vertical.
    width = max(1, round(float(max(np.linalg.norm(tr - tl), np.linalg.norm(br - bl)))))
    height = max(1, round(float(max(np.linalg.norm(bl - tl), np.linalg.norm(br - tr)))))
    dst = np.array([[0, 0], [width, 0], [width, height], [0, height]], dtype=np.float32)
    to_source = np.linalg.inv(cv2.getPerspectiveTransform(src, dst).astype(np.float64))
    if height / width >= VERTICAL_RATIO:
        to_source = to_source @ _quarter_turn(width)
    if crop.shape[:2] != ((width, height) if height / width >= VERTICAL_RATIO else (height, width)):
        raise ValueError(f"crop of shape {crop.shape[:2]} does not match its warp {width}x{height}")
    return Crop(crop, to_source)


def rotate(crop: Crop, degrees: int) -> Crop:
    """Turn a crop counter-clockwise by a multiple of 90 degrees (contiguous, for the model)."""
    image, to_source = crop.image, crop.to_source
    for _ in range((degrees // 90) % 4):
        to_source = to_source @ _quarter_turn(image.shape[1])
        image = np.rot90(image)
    return Crop(np.ascontiguousarray(image), to_source)


def map_points(to_source: np.ndarray, points: Sequence[Sequence[float]]) -> list[tuple[float, float]]:
    """Crop coordinates to frame coordinates."""
    pts = np.asarray(points, dtype=np.float64).reshape(-1, 2)
    mapped = np.c_[pts, np.ones(len(pts))] @ to_source.T
    xy = mapped[:, :2] / mapped[:, 2:3]
    return [(float(x), float(y)) for x, y in xy]


def map_box(to_source: np.ndarray, box: Sequence[float]) -> tuple[float, float, float, float]:
    """The frame-coordinate box around a crop-coordinate box (exact for turns and offsets)."""
    x1, y1, x2, y2 = box
    corners = map_points(to_source, [(x1, y1), (x2, y1), (x2, y2), (x1, y2)])
    xs, ys = [p[0] for p in corners], [p[1] for p in corners]
    return (min(xs), min(ys), max(xs), max(ys))


def _quarter_turn(width: int) -> np.ndarray:
    """Maps ``np.rot90(a)`` coordinates back to ``a`` (width ``width``): x_a = width - y, y_a = x."""
    return np.array([[0.0, -1.0, float(width)], [1.0, 0.0, 0.0], [0.0, 0.0, 1.0]])


__all__ = ["Crop", "cut_box", "cut_polygon", "map_box", "map_points", "rotate"]
