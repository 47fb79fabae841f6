"""The annotator: a frame with what the graph found in it drawn on a copy.

Boxes (or polygons), each object's label and score, its track id when tracked,
recognised text, attributes and the zones it is in; zones and counting lines
themselves when the frame carries them. Everything drawn comes from the frame and
its objects, so a stage that adds ``zones`` to objects, or ``zones`` / ``lines``
to the frame, shows up here without a change:

- ``obj.zones``: names of the zones the object is in (added to its caption);
- ``frame.zones``: ``(name, polygon)`` in source pixels, drawn as a closed outline;
- ``frame.lines``: :class:`~pipeline.frames.LineMark`: the segment, an arrow from
  its middle pointing the way an ``in`` crossing goes (from the line's left to
  its right, walking from its first point to its second), and a caption
  ``door in 3 out 1`` with its crossings so far.

Drawing never touches the frame's pooled buffer: :func:`annotate` converts it to
a BGR copy first. It runs on worker threads (OpenCV releases the GIL), and only
for sources someone watches or records (``pipeline.outputs``).
"""

from __future__ import annotations

import math
import zlib
from collections.abc import Sequence

import cv2
import numpy as np

from pipeline.frames import DetectedObject, Frame, LineMark

__all__ = ["LINE_COLOUR", "ZONE_COLOUR", "annotate", "draw_line", "draw_zone", "to_bgr"]

FONT = cv2.FONT_HERSHEY_SIMPLEX
ZONE_COLOUR = (255, 200, 0)  # BGR: a cyan-ish blue, unlike the per-track colours' brightness
LINE_COLOUR = (0, 200, 255)


def _colour(key: str) -> tuple[int, int, int]:
    """A stable, saturated BGR colour per key (track or label)."""
    hue = zlib.crc32(key.encode()) % 180
    hsv = np.array([[[hue, 220, 255]]], dtype=np.uint8)
    b, g, r = cv2.cvtColor(hsv, cv2.COLOR_HSV2BGR)[0, 0]
    return int(b), int(g), int(r)


def object_colour(obj: DetectedObject) -> tuple[int, int, int]:
    """One colour per track (or per label when untracked), the same on every frame."""
    return _colour(f"track:{obj.track_id}" if obj.track_id is not None else f"label:{obj.label}")


def _ascii(text: str) -> str:
    # cv2's Hershey fonts only draw ASCII; anything else would come out as '?'.
    return text.encode("ascii", "replace").decode()


def caption(obj: DetectedObject) -> str:
    """``#7 car 0.93 "KA05" red [gate]``: track, label and score, text, attributes, zones."""
    parts = [f"#{obj.track_id}"] if obj.track_id is not None else []
    parts.append(f"{obj.label} {obj.score:.2f}")
    if obj.text:
        parts.append(f'"{obj.text}"')
    parts.extend(a.label for a in obj.attributes)
    zones = getattr(obj, "zones", None)
    if zones:
        parts.append("[" + ",".join(str(z) for z in zones) + "]")
    return _ascii(" ".join(parts))


def _points(points: Sequence[Sequence[float]]) -> np.ndarray:
    return np.asarray(points, dtype=np.float32).round().astype(np.int32)


def _label(
    image: np.ndarray, text: str, at: tuple[int, int], colour: tuple[int, int, int], scale: float
) -> None:
    """A caption on a dark band, so it reads on any background."""
    h, w = image.shape[:2]
    (tw, th), baseline = cv2.getTextSize(text, FONT, scale, 1)
    x = min(max(0, at[0]), max(0, w - tw - 4))
    y = min(max(th + 2, at[1]), max(th + 2, h - baseline - 2))
    cv2.rectangle(image, (x, y - th - 2), (x + tw + 4, y + baseline), (0, 0, 0), cv2.FILLED)
    cv2.putText(image, text, (x + 2, y), FONT, scale, colour, 1, cv2.LINE_AA)


def draw_zone(
    image: np.ndarray, name: str, polygon: Sequence[Sequence[float]], thickness: int, scale: float
) -> None:
    """A zone's outline and its name at its first corner."""
    if len(polygon) < 3:
        return
    pts = _points(polygon)
    cv2.polylines(image, [pts], isClosed=True, color=ZONE_COLOUR, thickness=thickness, lineType=cv2.LINE_AA)
    _label(image, _ascii(name), (int(pts[0][0]) + 3, int(pts[0][1]) - 4), ZONE_COLOUR, scale)


def draw_line(image: np.ndarray, line: LineMark, thickness: int, scale: float) -> None:
    """A counting line, the arrow of its ``in`` direction, and ``name in N out M``."""
    (ax, ay), (bx, by) = line.a, line.b
    length = math.hypot(bx - ax, by - ay)
    if length == 0:
        return
    a, b = (round(ax), round(ay)), (round(bx), round(by))
    cv2.line(image, a, b, LINE_COLOUR, thickness, cv2.LINE_AA)
    # The right-hand normal (image y points down): where an "in" crossing ends up.
    nx, ny = -(by - ay) / length, (bx - ax) / length
    arrow = max(12.0, min(image.shape[:2]) / 12)
    mx, my = (ax + bx) / 2, (ay + by) / 2
    tip = (round(mx + nx * arrow), round(my + ny * arrow))
    cv2.arrowedLine(image, (round(mx), round(my)), tip, LINE_COLOUR, thickness, cv2.LINE_AA, tipLength=0.35)
    text = _ascii(f"{line.name} in {line.crossed_in} out {line.crossed_out}")
    _label(image, text, (a[0] + 4, a[1] + 4 + round(14 * scale / 0.4)), LINE_COLOUR, scale)


def to_bgr(frame: Frame) -> np.ndarray:
    """A BGR copy of the frame's image (the copy every drawing goes on)."""
    return cv2.cvtColor(frame.image, cv2.COLOR_RGB2BGR)


def annotate(frame: Frame, image: np.ndarray | None = None) -> np.ndarray:
    """Draw the frame's zones, lines and objects on ``image`` (default: a new BGR copy)."""
    if image is None:
        image = to_bgr(frame)
    h, w = image.shape[:2]
    scale = max(0.4, min(w, h) / 900)
    # At least 2 px: a 1 px coloured line loses its colour to 4:2:0 video encoding.
    thickness = max(2, round(min(w, h) / 300))
    for name, polygon in frame.zones:
        draw_zone(image, name, polygon, thickness, scale)
    for line in frame.lines:
        draw_line(image, line, thickness, scale)
    for obj in frame.objects:
        colour = object_colour(obj)
        x1, y1, x2, y2 = (round(v) for v in obj.bbox)
        if obj.polygon:
            pts = np.array(obj.polygon, dtype=np.float32).round().astype(np.int32)
            cv2.polylines(image, [pts], isClosed=True, color=colour, thickness=thickness)
        else:
            cv2.rectangle(image, (x1, y1), (x2, y2), colour, thickness)
        text = caption(obj)
        (tw, th), baseline = cv2.getTextSize(text, FONT, scale, 1)
        # Above the box when there is room, else below it, else inside its top edge; a few
        # pixels clear of its line, so the box stays visible after video compression.
        gap = thickness + 4
        if y1 - gap - baseline - th - 2 >= 0:
            ty = y1 - gap - baseline
        elif y2 + gap + th + 2 + baseline < h:
            ty = y2 + gap + th + 2
        else:
            ty = y1 + gap + th + 2
        tx = min(max(0, x1), max(0, w - tw - 2))
        cv2.rectangle(image, (tx, ty - th - 2), (tx + tw + 2, ty + baseline), colour, cv2.FILLED)
        cv2.putText(image, text, (tx + 1, ty), FONT, scale, (0, 0, 0), 1, cv2.LINE_AA)
    return image
