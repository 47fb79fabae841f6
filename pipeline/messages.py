"""The ``vidpipe.detections/v1`` payload: one JSON message per processed frame.

Documented in docs/messages.md; the JSON Schema ships as
``pipeline/schemas/detections.v1.json``.
"""

from __future__ import annotations

import json
from functools import cache
from importlib import resources
from typing import Any

from pipeline.frames import Frame

SCHEMA_ID = "vidpipe.detections/v1"


def subject_for(prefix: str, pipeline: str, source: str) -> str:
    """``vidpipe.<pipeline>.<source>.detections``."""
    return f"{prefix}.{pipeline}.{source}.detections"


def build_message(
    pipeline: str, frame: Frame, publish_ts: float, owner: tuple[str, int, int] | None = None
) -> dict[str, Any]:
    """The payload for one processed frame.

    ``owner`` is ``(worker, epoch, lease)`` in a fleet: the worker that published it and
    the fence of the lease it held (docs/fleet.md); a newer owner has a larger
    ``(epoch, lease)`` pair.
    """
    message: dict[str, Any] = {
        "schema": SCHEMA_ID,
        "pipeline": pipeline,
        "source": frame.source,
        "frame": frame.index,
        "pts": round(frame.pts, 6),
        "capture_ts": round(frame.capture_ts, 6),
        "publish_ts": round(publish_ts, 6),
        "width": frame.width,
        "height": frame.height,
        "objects": [obj.to_message() for obj in frame.objects],
    }
    if owner is not None:
        message["worker"], message["epoch"], message["lease"] = owner
    return message


def encode(message: dict[str, Any]) -> bytes:
    return json.dumps(message, separators=(",", ":"), ensure_ascii=False).encode()


@cache
def detections_schema() -> dict[str, Any]:
    """The JSON Schema of ``vidpipe.detections/v1``."""
    text = resources.files("pipeline").joinpath("schemas/detections.v1.json").read_text()
    schema: dict[str, Any] = json.loads(text)
    return schema
