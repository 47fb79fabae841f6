"""The annotator: a frame with what the graph found in it drawn on a copy.

Boxes (or polygons), each object's label and score, its track id when tracked,
recognised text, attributes and the zones it is in; zones and lines themselves
when the frame carries them. Everything drawn comes from the frame and its
objects, so a stage that adds ``zones`` to objects, or ``zones`` / ``lines`` to
the frame, shows up here without a change:

- ``obj.zones``: names of the zones the object is in (added to its caption);
- ``frame.zones`` / ``frame.lines``: ``{name: [(x, y), ...]}`` in source pixels
  (a zone is a polygon, a line two or more points).

Drawing never touches the frame's pooled buffer: :func:`annotate` converts it to
a BGR copy first. It runs on worker threads (OpenCV releases the GIL), and only
for sources someone watches or records (``pipeline.outputs``).
"""

from __future__ import annotations

import zlib
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

import cv2
import numpy as np

from pipeline.frames import DetectedObject, Frame

__all__ = ["annotate", "to_bgr"]

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


def _shapes(value: Any) -> Iterable[tuple[str, Sequence[Sequence[float]]]]:
    """``{name: points}`` or a list of ``{name, points}`` / ``{name, polygon}`` / ``{name, line}``."""
    if isinstance(value, Mapping):
        yield from ((str(k), v) for k, v in value.items())
    elif isinstance(value, Sequence):
        for item in value:
            if isinstance(item, Mapping):
                points = item.get("points") or item.get("polygon") or item.get("line") or []
                yield str(item.get("name", "")), points


def _draw_shape(
    image: np.ndarray, name: str, points: Sequence[Sequence[float]], colour: tuple[int, int, int],
    closed: bool, thickness: int, scale: float,
) -> None:  # fmt: skip
    if len(points) < 2:
        return
    pts = np.asarray(points, dtype=np.float32).round().astype(np.int32)
    cv2.polylines(image, [pts], isClosed=closed, color=colour, thickness=thickness, lineType=cv2.LINE_AA)
    if name:
        x, y = int(pts[0][0]), int(pts[0][1])
        cv2.putText(image, _ascii(name), (x + 3, max(12, y - 4)), FONT, scale, colour, 1, cv2.LINE_AA)


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
    for name, points in _shapes(getattr(frame, "zones", None)):
        _draw_shape(image, name, points, ZONE_COLOUR, True, thickness, scale)
    for name, points in _shapes(getattr(frame, "lines", None)):
        _draw_shape(image, name, points, LINE_COLOUR, False, thickness, scale)
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
