"""Annotated JPEG snapshots: a published frame with what the graph found in it.

``GET /v1/sources/<id>/snapshot.jpg`` serves :func:`render_snapshot` of the
source's latest published frame: each object's box (or polygon), its label and
score, its track id when tracked, recognised text, and attributes.
"""

from __future__ import annotations

import zlib

import cv2
import numpy as np

from pipeline.frames import DetectedObject, Frame

JPEG_QUALITY = 80


def _colour(obj: DetectedObject) -> tuple[int, int, int]:
    """A stable, saturated BGR colour per track (or per label when untracked)."""
    key = f"track:{obj.track_id}" if obj.track_id is not None else f"label:{obj.label}"
    hue = zlib.crc32(key.encode()) % 180
    hsv = np.array([[[hue, 220, 255]]], dtype=np.uint8)
    b, g, r = cv2.cvtColor(hsv, cv2.COLOR_HSV2BGR)[0, 0]
    return int(b), int(g), int(r)


def _caption(obj: DetectedObject) -> str:
    parts = [f"#{obj.track_id}"] if obj.track_id is not None else []
    parts.append(f"{obj.label} {obj.score:.2f}")
    if obj.text:
        parts.append(f'"{obj.text}"')
    parts.extend(f"{a.label}" for a in obj.attributes)
    # cv2's Hershey fonts only draw ASCII; anything else would come out as '?'.
    return " ".join(parts).encode("ascii", "replace").decode()


def annotate(frame: Frame) -> np.ndarray:
    """A BGR copy of the frame with its objects drawn on it."""
    image = cv2.cvtColor(frame.image, cv2.COLOR_RGB2BGR)
    h, w = image.shape[:2]
    scale = max(0.4, min(w, h) / 900)
    thickness = max(1, round(min(w, h) / 400))
    for obj in frame.objects:
        colour = _colour(obj)
        if obj.polygon:
            pts = np.array(obj.polygon, dtype=np.float32).round().astype(np.int32)
            cv2.polylines(image, [pts], isClosed=True, color=colour, thickness=thickness)
        x1, y1, x2, y2 = (round(v) for v in obj.bbox)
        if not obj.polygon:
            cv2.rectangle(image, (x1, y1), (x2, y2), colour, thickness)
        caption = _caption(obj)
        (tw, th), baseline = cv2.getTextSize(caption, cv2.FONT_HERSHEY_SIMPLEX, scale, 1)
        # Above the box when there is room, else inside its top edge.
        ty = y1 - 4 if y1 - th - baseline - 4 >= 0 else y1 + th + 4
        tx = min(max(0, x1), max(0, w - tw - 2))
        cv2.rectangle(image, (tx, ty - th - 2), (tx + tw + 2, ty + baseline), colour, cv2.FILLED)
        cv2.putText(image, caption, (tx + 1, ty), cv2.FONT_HERSHEY_SIMPLEX, scale, (0, 0, 0), 1, cv2.LINE_AA)
    return image


def render_snapshot(frame: Frame, quality: int = JPEG_QUALITY) -> bytes:
    """The annotated frame as JPEG bytes (the frame's own size)."""
    ok, buf = cv2.imencode(".jpg", annotate(frame), [cv2.IMWRITE_JPEG_QUALITY, quality])
    if not ok:
        raise RuntimeError(f"JPEG encoding failed for frame {frame.index} of {frame.source}")
    return buf.tobytes()


__all__ = ["annotate", "render_snapshot"]
