"""Annotated JPEG snapshots: a published frame with what the graph found in it.

``GET /v1/sources/<id>/snapshot.jpg`` serves :func:`render_snapshot` of the
source's latest published frame, drawn by :func:`pipeline.annotate.annotate`.
"""

from __future__ import annotations

import cv2

from pipeline.annotate import annotate
from pipeline.frames import Frame

JPEG_QUALITY = 80


def render_snapshot(frame: Frame, quality: int = JPEG_QUALITY) -> bytes:
    """The annotated frame as JPEG bytes (the frame's own size)."""
    ok, buf = cv2.imencode(".jpg", annotate(frame), [cv2.IMWRITE_JPEG_QUALITY, quality])
    if not ok:
        raise RuntimeError(f"JPEG encoding failed for frame {frame.index} of {frame.source}")
    return buf.tobytes()


__all__ = ["render_snapshot"]
