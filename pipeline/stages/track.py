"""Tracking: stable ``track_id`` per object across frames of one source.

::

    - name: track
      type: track
      tracker: bytetrack       # or iou: the greedy IoU tracker
      classes: [person, car]   # labels to track; all when empty
      match: label             # a track continues only with its own label; any: across labels
      iou: 0.2                 # minimum overlap to continue a track
      low_iou: 0.5             # bytetrack: overlap for the low-score second pass
      high_score: 0.25         # bytetrack: detections at least this sure are matched first
      low_score: 0.1           # bytetrack: below this a detection is ignored
      new_score: 0.35          # bytetrack: a new track needs a detection this sure
      min_hits: 2              # bytetrack: frames a track needs before it gets an id
      max_age: 30              # frames a lost track is kept for re-identification

The maths lives in :mod:`pipeline.tracking`; this stage keeps one tracker per
source and per detector stage (ids are unique per source), in frame order
(``ordered``), so ids never depend on timing. When a live source goes down
(``up`` to ``backoff``) its tracks end: the next connection's objects get new
ids. So do they at the seam of a looping file (``loop: true``), where the
picture jumps back to the clip's start: nothing is matched across the jump.
Objects of a detector that skipped the frame (infer ``interval``) are the
tracker's predicted boxes, added with ``predicted`` set. A detection that is
not (yet) part of a confirmed track keeps no ``track_id``.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Literal

import numpy as np

from inference.schema import spec
from pipeline.events import Event
from pipeline.frames import DetectedObject, Frame
from pipeline.stages.base import Stage, StageContext, StageOptions
from pipeline.tracking.base import Tracker
from pipeline.tracking.bytetrack import ByteTracker, ByteTrackParams
from pipeline.tracking.iou import IouTracker


@dataclass(frozen=True)
class TrackOptions(StageOptions):
    """``type: track``: which tracker, which objects, and its thresholds."""

    # What problems() reads; the graph's checks read only classes (track_misfits in
    # pipeline.config). A wrong tracker, match, iou, new_score, min_hits or max_age leaves
    # the rest checked.
    problem_keys = frozenset({"low_score", "high_score"})
    graph_keys = frozenset({"classes"})

    tracker: Literal["bytetrack", "iou"] = field(default="bytetrack", metadata=spec(help="bytetrack or iou"))
    classes: list[str] = field(default_factory=list, metadata=spec(help="labels to track; all when empty"))
    match: Literal["label", "any"] = field(
        default="label",
        metadata=spec(help="label: a track continues with its own label only; any: across labels"),
    )
    iou: float = field(default=0.2, metadata=spec(ge=0, le=1, help="minimum overlap to continue a track"))
    low_iou: float = field(
        default=0.5, metadata=spec(ge=0, le=1, help="bytetrack: overlap for low-score detections")
    )
    high_score: float = field(default=0.25, metadata=spec(ge=0, le=1, help="bytetrack: matched first"))
    low_score: float = field(
        default=0.1, metadata=spec(ge=0, le=1, help="bytetrack: detections below are ignored")
    )
    new_score: float = field(default=0.35, metadata=spec(ge=0, le=1, help="bytetrack: starts a track"))
    min_hits: int = field(
        default=2, metadata=spec(ge=1, le=1000, help="bytetrack: hits before a track gets an id")
    )
    max_age: int = field(default=30, metadata=spec(ge=1, le=100_000, help="frames a lost track is kept"))

    def problems(self) -> list[tuple[str, str]]:
        if self.low_score > self.high_score:
            return [("low_score", f"low_score {self.low_score} is above high_score {self.high_score}")]
        return []

    def later_problems(self, later: list[StageOptions]) -> list[tuple[str, str]]:
        # It tracks the objects of the detectors before it, in frame order; a detector
        # after it would add boxes that never get a track_id. (One with `interval` says so
        # itself, in its own words.)
        detectors = [
            s.name for s in later if s.models() and not s.references() and not getattr(s, "interval", 0)
        ]
        if detectors:
            return [
                ("type", f"the track stage comes before detector {detectors[0]!r}, whose objects it cannot "
                 "track; stages run in order: move the track stage below the detectors")
            ]  # fmt: skip
        return []


class _SourceTracks:
    """One source's trackers, one per detector stage, sharing the source's id counter."""

    def __init__(self, make: Callable[[Callable[[], int]], Tracker]) -> None:
        self._make = make
        self._next_id = itertools.count(1).__next__
        self.by_stage: dict[str, Tracker] = {}
        # class_id per label, for the predicted objects of skipped frames.
        self.class_ids: dict[str, int] = {}

    def tracker(self, stage: str) -> Tracker:
        tracker = self.by_stage.get(stage)
        if tracker is None:
            tracker = self.by_stage[stage] = self._make(self._next_id)
        return tracker


class TrackStage(Stage):
    """One tracker per source and detector stage, fed in frame order."""

    kind = "track"
    options_type = TrackOptions
    ordered = True

    def __init__(self, options: StageOptions, context: StageContext) -> None:
        super().__init__(options, context)
        assert isinstance(options, TrackOptions)  # the registry builds kinds from their own options
        self.opts = options
        self._sources: dict[str, _SourceTracks] = {}

    def _make_tracker(self, next_id: Callable[[], int]) -> Tracker:
        o = self.opts
        if o.tracker == "iou":
            return IouTracker(min_iou=o.iou, max_age=o.max_age, next_id=next_id)
        params = ByteTrackParams(
            high_score=o.high_score, low_score=o.low_score, new_score=o.new_score, iou=o.iou,
            low_iou=o.low_iou, min_hits=o.min_hits, max_age=o.max_age, per_label=o.match == "label",
        )  # fmt: skip
        return ByteTracker(params, next_id=next_id)

    async def process(self, frame: Frame) -> None:
        state = self._sources.get(frame.source)
        if state is None:
            state = self._sources[frame.source] = _SourceTracks(self._make_tracker)
        groups: dict[str, list[DetectedObject]] = {}
        for obj in frame.objects:
            if obj.track_id is None and (not self.opts.classes or obj.label in self.opts.classes):
                groups.setdefault(obj.stage, []).append(obj)
        # Every tracker sees every frame, with or without objects, so its tracks age.
        for stage in dict.fromkeys([*state.by_stage, *groups, *sorted(frame.skipped)]):
            tracker = state.tracker(stage)
            if stage in frame.skipped:
                self._predicted(frame, state, stage, tracker)
                continue
            objects = groups.get(stage, [])
            for obj in objects:
                state.class_ids[obj.label] = obj.class_id
            ids = tracker.update(
                np.array([o.bbox for o in objects], dtype=np.float64).reshape(-1, 4),
                np.array([o.score for o in objects], dtype=np.float64),
                [o.label for o in objects],
            )
            for obj, track_id in zip(objects, ids, strict=True):
                obj.track_id = track_id
        self.context.tracks.record(frame)  # what an interval: auto detector decides the next frame on

    def _predicted(self, frame: Frame, state: _SourceTracks, stage: str, tracker: Tracker) -> None:
        for tb in tracker.predict():
            frame.objects.append(
                DetectedObject(
                    id=frame.next_object_id(),
                    label=tb.label,
                    class_id=state.class_ids.get(tb.label, 0),
                    score=tb.score,
                    bbox=tb.box,
                    stage=stage,
                    track_id=tb.track_id,
                    predicted=True,
                )
            )

    def end_source(self, source: str) -> list[Event]:
        # The source ended, its live stream broke or a looping file starts its next pass:
        # its tracks end with it. The id counter stays, so objects of a next connection
        # (or pass) get ids never used before.
        state = self._sources.get(source)
        if state is not None:
            state.by_stage.clear()
        return []

    def forget_source(self, source: str) -> None:
        self._sources.pop(source, None)
