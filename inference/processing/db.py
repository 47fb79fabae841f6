"""Post-processing of DB (Differentiable Binarization) text-detection maps.

The model outputs a per-pixel text probability map ``[N, 1, H, W]`` in which
each text line appears *shrunk*. For each image this module:

1. thresholds the map at ``thresh`` (optionally dilating the mask 2×2) —
   only inside the region the image occupies, never the letterbox padding;
2. finds the outer contours and fits each a minimum-area rotated rectangle;
   rectangles whose short side is under ``min_box_size`` are dropped;
3. scores a rectangle by the mean probability inside it and drops those under
   ``box_thresh``;
4. expands ("unclips") the rectangle by ``area × unclip_ratio / perimeter``
   with a rounded offset, re-fits the minimum-area rectangle and drops it if
   its short side is under ``min_box_size + 2``;
5. orders the corners clockwise from top-left and maps them to source pixels.

With more than ``max_candidates`` contours, the largest (by area) are kept.
Results come in reading order: by the top-left corner's ``y``, then ``x``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import cv2
import numpy as np
import pyclipper

from inference.processing.resize import ResizeMeta

__all__ = ["DBParams", "TextBox", "db_boxes", "order_corners"]

# pyclipper works on integers; offsetting at 1/16 px keeps sub-pixel corners.
_CLIPPER_SCALE = 16.0


@dataclass(frozen=True, slots=True)
class DBParams:
    """Thresholds for :func:`db_boxes` (the same names as ``TaskConfig``)."""

    thresh: float = 0.3
    box_thresh: float = 0.5
    unclip_ratio: float = 1.6
    max_candidates: int = 1000
    min_box_size: float = 3.0
    dilate: bool = False


@dataclass(slots=True)
class TextBox:
    """A text quadrilateral in source pixels, clockwise from top-left, and its score."""

    corners: np.ndarray  # (4, 2) float64
    score: float


def order_corners(points: np.ndarray) -> np.ndarray:
    """Four points as ``[top-left, top-right, bottom-right, bottom-left]``.

    The two left-most points form the left edge and the two right-most the
    right edge; on each edge the upper point comes first.
    """
    pts = np.asarray(points, dtype=np.float64).reshape(4, 2)
    by_x = pts[np.argsort(pts[:, 0], kind="stable")]
    left, right = by_x[:2], by_x[2:]
    tl, bl = (left[0], left[1]) if left[0, 1] <= left[1, 1] else (left[1], left[0])
    tr, br = (right[0], right[1]) if right[0, 1] <= right[1, 1] else (right[1], right[0])
    return np.stack([tl, tr, br, bl])


def _ordered(points: list[list[float]]) -> list[list[float]]:
    """:func:`order_corners` on four ``[x, y]`` lists (a stable sort by x, as there)."""
    left0, left1, right0, right1 = sorted(points, key=lambda p: p[0])
    tl, bl = (left0, left1) if left0[1] <= left1[1] else (left1, left0)
    tr, br = (right0, right1) if right0[1] <= right1[1] else (right1, right0)
    return [tl, tr, br, bl]


def _min_rect(points: np.ndarray) -> tuple[list[list[float]], float]:
    """The minimum-area rectangle's ordered corners and its short side."""
    rect = cv2.minAreaRect(points)
    return _ordered(cv2.boxPoints(rect).tolist()), min(rect[1])


def _mean_inside(prob: np.ndarray, corners: list[list[float]]) -> float:
    """Mean of ``prob`` over the pixels of the quadrilateral ``corners``."""
    h, w = prob.shape
    xs = [p[0] for p in corners]
    ys = [p[1] for p in corners]
    x0 = min(max(math.floor(min(xs)), 0), w - 1)
    x1 = min(max(math.ceil(max(xs)), 0), w - 1)
    y0 = min(max(math.floor(min(ys)), 0), h - 1)
    y1 = min(max(math.ceil(max(ys)), 0), h - 1)
    mask = np.zeros((y1 - y0 + 1, x1 - x0 + 1), dtype=np.uint8)
    # np.round rounds halves to even; so does Python's round.
    shifted = np.array([[round(x - x0), round(y - y0)] for x, y in corners], dtype=np.int32)
    cv2.fillPoly(mask, [shifted], 1)
    return float(cv2.mean(prob[y0 : y1 + 1, x0 : x1 + 1], mask)[0])


def _unclip(corners: list[list[float]], ratio: float) -> np.ndarray | None:
    """Grow a rectangle outwards by ``area × ratio / perimeter``; ``None`` if nothing is left."""
    (ax, ay), (bx, by), _, (dx, dy) = corners
    rect_w = math.hypot(bx - ax, by - ay)
    rect_h = math.hypot(dx - ax, dy - ay)
    perimeter = 2.0 * (rect_w + rect_h)
    if perimeter <= 0:
        return None
    distance = rect_w * rect_h * ratio / perimeter
    offset = pyclipper.PyclipperOffset()
    offset.ArcTolerance = 0.25 * _CLIPPER_SCALE
    path = [[round(x * _CLIPPER_SCALE), round(y * _CLIPPER_SCALE)] for x, y in corners]
    offset.AddPath(path, pyclipper.JT_ROUND, pyclipper.ET_CLOSEDPOLYGON)
    grown = offset.Execute(distance * _CLIPPER_SCALE)
    if not grown:
        return None
    return np.array([p for polygon in grown for p in polygon], dtype=np.float32) / np.float32(_CLIPPER_SCALE)


def db_boxes(prob: np.ndarray, meta: ResizeMeta, params: DBParams) -> list[TextBox]:
    """Text quadrilaterals (source pixels) from one ``H×W`` probability map.

    A frame has a handful of boxes of four corners each: they are worked on as Python
    floats, because NumPy's per-call cost on a 4×2 array is larger than the arithmetic.
    """
    if prob.ndim != 2:
        raise ValueError(f"expected an H×W probability map, got shape {prob.shape}")
    # Work on the part of the map that shows the image; its origin is the content's corner,
    # so map coordinates convert to source pixels by the scale alone.
    y0, x0 = meta.pad_y, meta.pad_x
    region = prob[y0 : y0 + meta.content_h, x0 : x0 + meta.content_w]
    if region.size == 0:
        return []
    if region.dtype != np.float32:
        region = region.astype(np.float32)
    # 255 where text, in one pass (OpenCV takes a scalar operand; its stubs only know arrays).
    mask = cv2.compare(region, params.thresh, cv2.CMP_GT)  # type: ignore[call-overload]
    if params.dilate:
        mask = cv2.dilate(mask, np.ones((2, 2), dtype=np.uint8))
    contours, _ = cv2.findContours(mask, cv2.RETR_LIST, cv2.CHAIN_APPROX_SIMPLE)
    if len(contours) > params.max_candidates:
        areas = np.array([cv2.contourArea(c) for c in contours])
        order = np.argsort(-areas, kind="stable")[: params.max_candidates]
        contours = [contours[i] for i in order]

    sx, sy = meta.scale_x, meta.scale_y
    limit_x, limit_y = float(meta.src_w), float(meta.src_h)
    boxes: list[TextBox] = []
    for contour in contours:
        corners, short_side = _min_rect(contour)
        if short_side < params.min_box_size:
            continue
        score = _mean_inside(region, corners)
        if score < params.box_thresh:
            continue
        grown = _unclip(corners, params.unclip_ratio)
        if grown is None:
            continue
        corners, short_side = _min_rect(grown)
        if short_side < params.min_box_size + 2:
            continue
        src = [[min(max(x / sx, 0.0), limit_x), min(max(y / sy, 0.0), limit_y)] for x, y in corners]
        boxes.append(TextBox(np.array(src, dtype=np.float64), score))
    boxes.sort(key=lambda b: (b.corners[0, 1], b.corners[0, 0]))
    return boxes
