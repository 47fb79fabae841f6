"""The ``vidpipe.events/v1`` payload: what happened to tracked objects, one message per event.

A ``zones`` stage finds the events (:mod:`pipeline.stages.zones`); the
publisher sends each one to ``vidpipe.<pipeline>.<source>.events`` right after
the detections message of the frame it happened in. Documented in
docs/messages.md; the JSON Schema ships as ``pipeline/schemas/events.v1.json``.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from functools import cache
from importlib import resources
from typing import Any, Literal

SCHEMA_ID = "vidpipe.events/v1"

EventType = Literal["track_start", "track_end", "zone_enter", "zone_exit", "line_cross"]
EVENT_TYPES: tuple[EventType, ...] = ("track_start", "track_end", "zone_enter", "zone_exit", "line_cross")
# Crossing from the line's left to its right (walking from its first point to its second) is "in".
Direction = Literal["in", "out"]
DIRECTIONS: tuple[Direction, ...] = ("in", "out")


@dataclass(frozen=True, slots=True)
class Event:
    """One event of one track, as seen in one frame (``frame``, ``pts``, ``ts``, ``bbox``)."""

    type: EventType
    frame: int
    pts: float
    ts: float
    track_id: int
    label: str
    bbox: tuple[float, float, float, float]
    zone: str | None = None
    line: str | None = None
    direction: Direction | None = None

    def to_message(self, pipeline: str, source: str) -> dict[str, Any]:
        out: dict[str, Any] = {
            "schema": SCHEMA_ID,
            "type": self.type,
            "pipeline": pipeline,
            "source": source,
            "frame": self.frame,
            "pts": round(self.pts, 6),
            "ts": round(self.ts, 6),
            "track_id": self.track_id,
            "label": self.label,
            "bbox": [round(float(v), 1) for v in self.bbox],
        }
        if self.zone is not None:
            out["zone"] = self.zone
        if self.line is not None:
            out["line"] = self.line
            out["direction"] = self.direction
        return out


def events_subject(prefix: str, pipeline: str, source: str) -> str:
    """``vidpipe.<pipeline>.<source>.events``."""
    return f"{prefix}.{pipeline}.{source}.events"


@cache
def events_schema() -> dict[str, Any]:
    """The JSON Schema of ``vidpipe.events/v1``."""
    text = resources.files("pipeline").joinpath("schemas/events.v1.json").read_text()
    schema: dict[str, Any] = json.loads(text)
    return schema
