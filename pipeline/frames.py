"""Frames and the objects found in them, as they travel through the stage graph."""

from __future__ import annotations

import itertools
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import numpy as np

if TYPE_CHECKING:
    from pipeline.crops import Crop
    from pipeline.events import Event


@dataclass(slots=True)
class Attribute:
    """A secondary model's verdict on an object (``{model, label, score}`` in the payload)."""

    model: str
    label: str
    score: float
    # True when copied from the object's track, not computed on this frame (reinfer_interval).
    carried: bool = False

    def to_message(self) -> dict[str, Any]:
        out: dict[str, Any] = {"model": self.model, "label": self.label, "score": round(float(self.score), 4)}
        if self.carried:
            out["carried"] = True
        return out


@dataclass(slots=True)
class DetectedObject:
    """One object in a frame; ``bbox`` is ``[x1, y1, x2, y2]`` in source pixels."""

    id: int
    label: str
    class_id: int
    score: float
    bbox: tuple[float, float, float, float]
    stage: str
    polygon: list[tuple[float, float]] | None = None
    track_id: int | None = None
    text: str | None = None
    text_score: float | None = None
    attributes: list[Attribute] = field(default_factory=list)
    # Names of the zones the object is in; set (possibly empty) by a zones stage.
    zones: list[str] | None = None
    # The tracker's predicted box on a frame its detector skipped (infer ``interval``).
    predicted: bool = False
    # ``text`` copied from the object's track, not read on this frame (reinfer_interval).
    text_carried: bool = False
    # Crops cut for cascade stages, keyed by (kind, rotation), reused across stages.
    crops: dict[tuple[str, int], Crop] = field(default_factory=dict, repr=False)

    def to_message(self) -> dict[str, Any]:
        out: dict[str, Any] = {
            "id": self.id,
            "label": self.label,
            "class_id": self.class_id,
            "score": round(float(self.score), 4),
            "bbox": [round(float(v), 1) for v in self.bbox],
        }
        if self.polygon is not None:
            out["polygon"] = [[round(float(x), 1), round(float(y), 1)] for x, y in self.polygon]
        if self.track_id is not None:
            out["track_id"] = self.track_id
        if self.text is not None:
            out["text"] = self.text
            if self.text_score is not None:
                out["text_score"] = round(float(self.text_score), 4)
            if self.text_carried:
                out["text_carried"] = True
        if self.attributes:
            out["attributes"] = [a.to_message() for a in self.attributes]
        if self.zones is not None:
            out["zones"] = list(self.zones)
        if self.predicted:
            out["predicted"] = True
        return out


@dataclass(frozen=True, slots=True)
class LineMark:
    """A counting line as drawn: from ``a`` to ``b`` (source pixels), its crossings so far."""

    name: str
    a: tuple[float, float]
    b: tuple[float, float]
    crossed_in: int = 0
    crossed_out: int = 0


@dataclass(slots=True)
class Frame:
    """A decoded frame (H×W×3 uint8 RGB) and everything the graph learns about it."""

    source: str
    index: int
    pts: float
    capture_ts: float
    image: np.ndarray
    objects: list[DetectedObject] = field(default_factory=list)
    stage_times: dict[str, float] = field(default_factory=dict)
    # What happened to tracked objects in this frame (a zones stage); published after its message.
    events: list[Event] = field(default_factory=list)
    # Zones (name, polygon) and counting lines to draw on this frame (a zones stage).
    zones: list[tuple[str, list[tuple[float, float]]]] = field(default_factory=list)
    lines: list[LineMark] = field(default_factory=list)
    # Detector stages that skipped this frame (infer ``interval``); the tracker predicts for them.
    skipped: set[str] = field(default_factory=set)
    # The pooled buffer ``image`` lives in; it goes back to the source's pool on release().
    buffer: Any = field(default=None, repr=False)
    _ids: itertools.count = field(default_factory=lambda: itertools.count(1), repr=False)

    def release(self) -> None:
        """Give the image's buffer back to its pool; the frame must not be used afterwards."""
        if self.buffer is not None:
            buffer, self.buffer = self.buffer, None
            buffer.release()

    @property
    def width(self) -> int:
        return int(self.image.shape[1])

    @property
    def height(self) -> int:
        return int(self.image.shape[0])

    def next_object_id(self) -> int:
        """Object ids are unique within a frame, starting at 1."""
        return next(self._ids)
