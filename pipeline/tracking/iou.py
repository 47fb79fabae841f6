"""The greedy IoU tracker (``tracker: iou``): no motion model, best overlaps first.

A detection continues the track it overlaps most (at least ``min_iou``, same
label); every other detection starts a track at once; a track not matched for
``max_age`` frames is forgotten. Cheap, and fine for slow objects detected on
every frame; it loses ids when objects cross or the detector misses a frame.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np

from pipeline.tracking.assignment import iou_matrix
from pipeline.tracking.base import Box, TrackedBox, Tracker, as_box


@dataclass(slots=True)
class _Track:
    id: int
    label: str
    box: Box
    score: float
    last_seen: int


class IouTracker(Tracker):
    """One stream's greedy IoU state."""

    def __init__(
        self, min_iou: float = 0.2, max_age: int = 30, next_id: Callable[[], int] | None = None
    ) -> None:
        super().__init__(next_id)
        self.min_iou = min_iou
        self.max_age = max_age
        self.tracks: list[_Track] = []
        self.frame = 0
        self._last_update = 0

    def update(self, boxes: np.ndarray, scores: np.ndarray, labels: Sequence[str]) -> list[int | None]:
        boxes = np.asarray(boxes, dtype=np.float64).reshape(-1, 4)
        self.frame += 1
        self._last_update = self.frame
        ids: list[int | None] = [None] * len(boxes)
        taken: set[int] = set()
        if self.tracks and len(boxes):
            iou = iou_matrix(np.array([t.box for t in self.tracks]), boxes)
            for t_idx, d in zip(
                *np.unravel_index(np.argsort(-iou, axis=None, kind="stable"), iou.shape), strict=True
            ):
                if iou[t_idx, d] < self.min_iou:
                    break
                track = self.tracks[t_idx]
                if ids[d] is not None or track.id in taken or track.label != labels[d]:
                    continue
                ids[d] = track.id
                taken.add(track.id)
                track.box = as_box(boxes[d])
                track.score = float(scores[d])
                track.last_seen = self.frame
        for d in range(len(boxes)):
            if ids[d] is None:
                track = _Track(self.next_id(), labels[d], as_box(boxes[d]), float(scores[d]), self.frame)
                ids[d] = track.id
                self.tracks.append(track)
        self.tracks = [t for t in self.tracks if self.frame - t.last_seen <= self.max_age]
        return ids

    def predict(self) -> list[TrackedBox]:
        self.frame += 1
        # Without a motion model the best guess is where the track was last seen.
        return [
            TrackedBox(t.id, t.box, t.label, t.score) for t in self.tracks if t.last_seen == self._last_update
        ]
