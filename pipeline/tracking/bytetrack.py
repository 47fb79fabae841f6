"""A ByteTrack-class tracker: Kalman prediction, two-stage Hungarian association.

Per frame (Zhang et al., "ByteTrack", ECCV 2022):

1. every track's Kalman filter predicts its box on this frame;
2. confirmed tracks (followed or lost) are matched to the high-score detections;
3. followed tracks still unmatched get a second chance against the low-score
   detections (an occluded object's score drops before it vanishes); those
   still unmatched become lost;
4. tentative tracks are matched to the remaining high-score detections, and are
   confirmed after ``min_hits`` hits (at once on the stream's first frame);
   a tentative track that misses a frame is dropped;
5. remaining detections scoring at least ``new_score`` start tentative tracks;
6. a lost track is forgotten ``max_age`` frames after it was last matched.

On frames the detector skipped (``predict``) the filters only predict. After
such frames a track is matched with both boxes grown by :data:`SKIPPED_BUFFER`
(buffered IoU: the prediction may be far off), and a matched track takes as its
velocity the displacement between its last two detections divided by the frames
between them, and the detection's aspect ratio: the filter's own update would
move them only part of the way, and its predictions would lag the object for
several detections. With the detector on every frame nothing of this applies.

Ids are handed out at confirmation, so detections that never become a track
(false positives) use up no ids.
"""

from __future__ import annotations

import enum
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np

from pipeline.tracking.assignment import iou_matrix, match
from pipeline.tracking.base import TrackedBox, Tracker, as_box
from pipeline.tracking.kalman import KalmanBox


@dataclass(frozen=True, slots=True)
class ByteTrackParams:
    """The tracker's thresholds (documented with ``type: track`` in docs/config.md)."""

    # The defaults of Ultralytics' and supervision's ByteTrack, tuned for YOLO-class scores.
    high_score: float = 0.25
    low_score: float = 0.1
    new_score: float = 0.35
    iou: float = 0.2
    low_iou: float = 0.5
    min_hits: int = 2
    max_age: int = 30
    per_label: bool = True


# After frames the detector skipped, a track and the detections are matched with both boxes
# grown by this share of their size on every side (C-BIoU's buffer scale): a prediction a
# whole box width off still overlaps by a fifth (the default ``iou``), not two thirds of one.
SKIPPED_BUFFER = 0.3


class TrackState(enum.Enum):
    TENTATIVE = "tentative"
    TRACKED = "tracked"
    LOST = "lost"


@dataclass(slots=True)
class _Track:
    kf: KalmanBox
    label: str
    score: float
    last_update: int
    hits: int = 1
    state: TrackState = TrackState.TENTATIVE
    id: int = 0  # 0 until confirmed
    skipped: int = 0  # frames the detector skipped since the track was last matched
    detected: tuple[float, float] = (0.0, 0.0)  # the centre of its last detection


class ByteTracker(Tracker):
    """One stream's ByteTrack state."""

    def __init__(
        self, params: ByteTrackParams | None = None, next_id: Callable[[], int] | None = None
    ) -> None:
        super().__init__(next_id)
        self.params = params or ByteTrackParams()
        self.tracks: list[_Track] = []
        self.frame = 0

    def update(self, boxes: np.ndarray, scores: np.ndarray, labels: Sequence[str]) -> list[int | None]:
        p = self.params
        boxes = np.asarray(boxes, dtype=np.float64).reshape(-1, 4)
        scores = np.asarray(scores, dtype=np.float64).reshape(-1)
        self.frame += 1
        for track in self.tracks:
            track.kf.predict()
        ids: list[int | None] = [None] * len(boxes)
        high = np.flatnonzero(scores >= p.high_score)
        low = np.flatnonzero((scores >= p.low_score) & (scores < p.high_score))

        # 1. confirmed tracks against high-score detections.
        pool = [t for t in self.tracks if t.state is not TrackState.TENTATIVE]
        pairs, free_tracks, free_high = match(self._iou(pool, boxes, labels, high), p.iou)
        for r, c in pairs:
            ids[high[c]] = self._hit(pool[r], boxes[high[c]], scores[high[c]], labels[high[c]])
        # 2. followed tracks left over against low-score detections.
        followed = [pool[r] for r in free_tracks if pool[r].state is TrackState.TRACKED]
        pairs, free_followed, _ = match(self._iou(followed, boxes, labels, low), p.low_iou)
        for r, c in pairs:
            ids[low[c]] = self._hit(followed[r], boxes[low[c]], scores[low[c]], labels[low[c]])
        for r in free_followed:
            followed[r].state = TrackState.LOST
        # 3. tentative tracks against the high-score detections nobody took.
        rest = high[free_high]
        tentative = [t for t in self.tracks if t.state is TrackState.TENTATIVE]
        pairs, free_tentative, free_rest = match(self._iou(tentative, boxes, labels, rest), p.iou)
        for r, c in pairs:
            ids[rest[c]] = self._hit(tentative[r], boxes[rest[c]], scores[rest[c]], labels[rest[c]])
        dropped = {id(tentative[r]) for r in free_tentative}
        self.tracks = [t for t in self.tracks if id(t) not in dropped]
        # 4. new tracks.
        for c in free_rest:
            d = rest[c]
            if scores[d] < p.new_score:
                continue
            track = _Track(KalmanBox.start(boxes[d]), labels[d], float(scores[d]), self.frame)
            track.detected = _centre(boxes[d])
            if p.min_hits <= 1 or self.frame == 1:
                self._confirm(track)
                ids[d] = track.id
            self.tracks.append(track)
        self._forget_old()
        return ids

    def predict(self) -> list[TrackedBox]:
        self.frame += 1
        for track in self.tracks:
            track.kf.predict()
            track.skipped += 1
        self._forget_old()
        return [
            TrackedBox(t.id, as_box(t.kf.box()), t.label, t.score)
            for t in self.tracks
            if t.state is TrackState.TRACKED
        ]

    def _iou(
        self, tracks: list[_Track], boxes: np.ndarray, labels: Sequence[str], idx: np.ndarray
    ) -> np.ndarray:
        if not tracks or len(idx) == 0:
            return np.zeros((len(tracks), len(idx)))
        iou = iou_matrix(np.array([t.kf.box() for t in tracks]), boxes[idx])
        late = [i for i, t in enumerate(tracks) if t.skipped]
        if late:
            # Buffered IoU (Yang et al., "Hard to Track Objects with Irregular Motions and
            # Similar Appearances? Make It Easier by Buffering the Matching Space", 2023):
            # after frames without detections, a prediction may be a good part of a box off.
            iou[late] = iou_matrix(_grown(np.array([tracks[i].kf.box() for i in late])), _grown(boxes[idx]))
        if self.params.per_label:
            same = np.array([[t.label == labels[d] for d in idx] for t in tracks])
            iou = np.where(same, iou, 0.0)
        return iou

    def _hit(self, track: _Track, box: np.ndarray, score: float, label: str) -> int | None:
        track.kf.update(box)
        centre = _centre(box)
        if track.skipped:
            gap = self.frame - track.last_update
            track.kf.catch_up(
                box, ((centre[0] - track.detected[0]) / gap, (centre[1] - track.detected[1]) / gap)
            )
            track.skipped = 0
        track.detected = centre
        track.score = float(score)
        track.label = label
        track.hits += 1
        track.last_update = self.frame
        if track.state is TrackState.TENTATIVE:
            if track.hits >= self.params.min_hits:
                self._confirm(track)
        else:
            track.state = TrackState.TRACKED
        return track.id or None

    def _confirm(self, track: _Track) -> None:
        track.state = TrackState.TRACKED
        track.id = self.next_id()

    def _forget_old(self) -> None:
        self.tracks = [t for t in self.tracks if self.frame - t.last_update <= self.params.max_age]


def _centre(box: np.ndarray) -> tuple[float, float]:
    return (float(box[0] + box[2]) / 2, float(box[1] + box[3]) / 2)


def _grown(boxes: np.ndarray, by: float = SKIPPED_BUFFER) -> np.ndarray:
    """N×4 boxes, each grown by ``by`` of its width and height on every side."""
    w, h = boxes[:, 2] - boxes[:, 0], boxes[:, 3] - boxes[:, 1]
    return boxes + np.stack([-by * w, -by * h, by * w, by * h], axis=1)
