"""What every tracker takes and gives: detections of one frame in, a track id per detection out."""

from __future__ import annotations

import itertools
from abc import ABC, abstractmethod
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np

Box = tuple[float, float, float, float]


def as_box(values: np.ndarray) -> Box:
    """Four numbers as a plain ``(x1, y1, x2, y2)`` tuple of floats."""
    x1, y1, x2, y2 = (float(v) for v in values)
    return (x1, y1, x2, y2)


@dataclass(frozen=True, slots=True)
class TrackedBox:
    """A confirmed track's box on a frame the detector skipped (the tracker's prediction)."""

    track_id: int
    box: Box
    label: str
    score: float


class Tracker(ABC):
    """One stream's tracker; ``update`` or ``predict`` is called once per frame, in frame order.

    ``next_id`` hands out track ids; trackers that share it (one per detector of
    a source) never hand out the same id twice.
    """

    def __init__(self, next_id: Callable[[], int] | None = None) -> None:
        self.next_id = next_id or itertools.count(1).__next__

    @abstractmethod
    def update(self, boxes: np.ndarray, scores: np.ndarray, labels: Sequence[str]) -> list[int | None]:
        """Detections of the next frame (N×4 x1,y1,x2,y2; N scores; N labels) -> a track id each, or None."""

    @abstractmethod
    def predict(self) -> list[TrackedBox]:
        """Advance one frame without detections; the boxes of the tracks being followed."""
