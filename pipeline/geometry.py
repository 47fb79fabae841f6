"""Plane geometry for zones and lines, in source pixels (y grows downwards).

Pure functions, no state: which side of a directed line a point is on, whether a
point is in a polygon and how far it is from its edge, where on a box the point
that stands for the object is (its *anchor*), and the dead band that keeps a
point jittering on a boundary from flipping sides on every frame.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Literal

Point = tuple[float, float]
Box = tuple[float, float, float, float]

Anchor = Literal[
    "bottom_center", "center", "top_center", "bottom_left", "bottom_right", "top_left", "top_right"
]
ANCHORS: tuple[Anchor, ...] = (
    "bottom_center", "center", "top_center", "bottom_left", "bottom_right", "top_left", "top_right"
)  # fmt: skip


def anchor_point(box: Box, anchor: Anchor = "bottom_center") -> Point:
    """The point of ``box`` (x1, y1, x2, y2) that stands for the object.

    ``bottom_center`` is where a person or a vehicle touches the ground: it
    crosses a line drawn on the floor when the object does.
    """
    x1, y1, x2, y2 = box
    xs = {"left": x1, "center": (x1 + x2) / 2, "right": x2}
    if anchor == "center":
        return ((x1 + x2) / 2, (y1 + y2) / 2)
    vertical, horizontal = anchor.split("_")
    return (xs[horizontal], y2 if vertical == "bottom" else y1)


def signed_distance(point: Point, a: Point, b: Point) -> float:
    """Distance of ``point`` from the line through ``a`` and ``b``: positive on its right.

    Right and left are as seen walking from ``a`` to ``b`` on the image (y down):
    for a line drawn left to right across the picture, the bottom is its right.
    """
    dx, dy = b[0] - a[0], b[1] - a[1]
    length = math.hypot(dx, dy)
    if length == 0:
        return 0.0
    return (dx * (point[1] - a[1]) - dy * (point[0] - a[0])) / length


def crosses_segment(p0: Point, p1: Point, a: Point, b: Point) -> bool:
    """Whether the path ``p0 -> p1`` meets the segment ``a``-``b`` (ends included).

    Used once a point has changed sides of the line through ``a`` and ``b``: a
    path that passes beyond an end of the segment went around it, not across it.
    """
    d0, d1 = signed_distance(p0, a, b), signed_distance(p1, a, b)
    if d0 == d1:
        return False
    u = d0 / (d0 - d1)  # where along p0 -> p1 the path meets the line
    x, y = p0[0] + u * (p1[0] - p0[0]), p0[1] + u * (p1[1] - p0[1])
    dx, dy = b[0] - a[0], b[1] - a[1]
    t = ((x - a[0]) * dx + (y - a[1]) * dy) / (dx * dx + dy * dy)
    return 0.0 <= t <= 1.0


def point_in_polygon(point: Point, polygon: Sequence[Point]) -> bool:
    """Even-odd rule: whether ``point`` is inside ``polygon`` (any simple or self-touching ring)."""
    x, y = point
    inside = False
    n = len(polygon)
    for i in range(n):
        (xa, ya), (xb, yb) = polygon[i], polygon[(i + 1) % n]
        if (ya > y) != (yb > y) and x < xa + (y - ya) * (xb - xa) / (yb - ya):
            inside = not inside
    return inside


def distance_to_edge(point: Point, polygon: Sequence[Point]) -> float:
    """Shortest distance from ``point`` to the boundary of ``polygon``."""
    best = math.inf
    x, y = point
    n = len(polygon)
    for i in range(n):
        (xa, ya), (xb, yb) = polygon[i], polygon[(i + 1) % n]
        dx, dy = xb - xa, yb - ya
        span = dx * dx + dy * dy
        t = 0.0 if span == 0 else max(0.0, min(1.0, ((x - xa) * dx + (y - ya) * dy) / span))
        best = min(best, math.hypot(x - (xa + t * dx), y - (ya + t * dy)))
    return best


def line_side(point: Point, a: Point, b: Point, band: float) -> int | None:
    """Which side of the line through ``a`` and ``b`` the point is clearly on: ``+1`` right, ``-1`` left.

    None within ``band`` pixels of the line: there the caller keeps the side it
    had, so a detector's jitter around the line cannot make an object cross back
    and forth; it changes sides only once clearly on the other one.
    """
    distance = signed_distance(point, a, b)
    if abs(distance) <= band:
        return None
    return 1 if distance > 0 else -1


def inside_with_hysteresis(
    previous: bool | None, point: Point, polygon: Sequence[Point], band: float
) -> bool:
    """Zone membership with the same dead band along the polygon's edge.

    A point first seen inside the band counts where it actually is.
    """
    inside = point_in_polygon(point, polygon)
    if previous is None or inside == previous:
        return inside
    return inside if distance_to_edge(point, polygon) > band else previous
