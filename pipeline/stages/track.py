"""Tracking: stable ``track_id`` per object across frames of one source.

::

    - {name: track, type: track, iou: 0.3, max_age: 15}

Greedy IoU matching per label between the previous frame's tracks and this
frame's objects; a track not seen for ``max_age`` frames is forgotten. It runs
in frame order per source (``ordered``), so ids never depend on timing.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from inference.schema import spec
from pipeline.frames import Frame
from pipeline.stages.base import Stage, StageContext, StageOptions


@dataclass(frozen=True)
class TrackOptions(StageOptions):
    """``type: track``: which objects to track and when a track ends."""

    classes: list[str] = field(default_factory=list, metadata=spec(help="labels to track; all when empty"))
    iou: float = field(default=0.3, metadata=spec(ge=0, le=1, help="minimum overlap to continue a track"))
    max_age: int = field(default=15, metadata=spec(ge=1, help="frames a track survives unseen"))


@dataclass(slots=True)
class _Track:
    id: int
    label: str
    box: tuple[float, float, float, float]
    last_seen: int


def iou_matrix(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """IoU of every box in ``a`` (N×4) against every box in ``b`` (M×4)."""
    x1 = np.maximum(a[:, None, 0], b[None, :, 0])
    y1 = np.maximum(a[:, None, 1], b[None, :, 1])
    x2 = np.minimum(a[:, None, 2], b[None, :, 2])
    y2 = np.minimum(a[:, None, 3], b[None, :, 3])
    inter = np.clip(x2 - x1, 0, None) * np.clip(y2 - y1, 0, None)
    area_a = (a[:, 2] - a[:, 0]) * (a[:, 3] - a[:, 1])
    area_b = (b[:, 2] - b[:, 0]) * (b[:, 3] - b[:, 1])
    union = area_a[:, None] + area_b[None, :] - inter
    return np.where(union > 0, inter / np.maximum(union, 1e-9), 0.0)


class TrackStage(Stage):
    """IoU tracker, one state per source."""

    kind = "track"
    options_type = TrackOptions
    ordered = True

    def __init__(self, options: StageOptions, context: StageContext) -> None:
        super().__init__(options, context)
        assert isinstance(options, TrackOptions)  # the registry builds kinds from their own options
        self.opts = options
        self._tracks: dict[str, list[_Track]] = {}
        self._next_id: dict[str, int] = {}

    async def process(self, frame: Frame) -> None:
        tracks = self._tracks.setdefault(frame.source, [])
        objects = [o for o in frame.objects if not self.opts.classes or o.label in self.opts.classes]
        unmatched = set(range(len(objects)))
        if tracks and objects:
            iou = iou_matrix(
                np.array([t.box for t in tracks], dtype=np.float64),
                np.array([o.bbox for o in objects], dtype=np.float64),
            )
            for t_idx, o_idx in zip(*np.unravel_index(np.argsort(-iou, axis=None), iou.shape), strict=True):
                if iou[t_idx, o_idx] < self.opts.iou:
                    break
                track, obj = tracks[t_idx], objects[o_idx]
                if o_idx not in unmatched or track.last_seen == frame.index or track.label != obj.label:
                    continue
                obj.track_id = track.id
                track.box = obj.bbox
                track.last_seen = frame.index
                unmatched.discard(o_idx)
        for o_idx in sorted(unmatched):
            obj = objects[o_idx]
            track_id = self._next_id.get(frame.source, 1)
            self._next_id[frame.source] = track_id + 1
            obj.track_id = track_id
            tracks.append(_Track(track_id, obj.label, obj.bbox, frame.index))
        self._tracks[frame.source] = [t for t in tracks if frame.index - t.last_seen <= self.opts.max_age]

    def forget_source(self, source: str) -> None:
        self._tracks.pop(source, None)
        self._next_id.pop(source, None)
