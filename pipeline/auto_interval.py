"""``interval: auto``: on which frames a detector must run, and on which the tracker's prediction stands.

::

    - {name: people, type: infer, model: yolo, interval: auto}
    - {name: track, type: track}
    - name: gate
      type: zones
      lines: [{name: door, points: [[320, 0], [320, 360]]}]

The detector runs on a frame when any of these holds (the first one found is
the frame's ``reason``), and otherwise the track stage publishes its predicted
boxes, as for a fixed ``interval``:

- ``first``: the source's first frame;
- ``max_gap``: :data:`MAX_GAP` frames have passed since the detector last ran;
- ``new_object``: the last detection left an object that is not yet a track
  (a track needs a second hit to be confirmed), :data:`NEW_OBJECT_GAP` frames
  ago: its tentative track waits where it was seen;
- ``motion``: the picture changed where no track explains it. A downscaled
  grayscale copy of the frame (:func:`small_gray`) is compared with the one of
  the last frame the detector ran on; changed cells inside the tracks' boxes
  then and now (now: where the tracker predicts them, moving on as its last
  predicted step did) and inside the boxes of objects not yet tracked are
  their own motion, the rest is something new;
- ``fast``: a track moves more than :data:`FAST` of its size (its box's
  shorter side) per frame;
- ``uncertain``: a track's prediction may have drifted (frames since it was
  last detected times how much a box of its size and speed can wander, or less
  when its last detection found the prediction on time: :attr:`TrackState.error`), or the
  picture does not show it where it is predicted (nothing changed in the part
  of its predicted box it was not in at the last detection: it stopped);
- ``line``: a track's anchor, carried on at its velocity, crosses a line of a
  ``zones`` stage on this frame: the detector confirms the crossing (or shows
  the object stopped or turned before it) on the frame it is predicted, not on
  every frame near the line;
- ``zone``: a track's anchor is at a zone's edge, or inside a zone and the
  detector skipped the frame before.

Several reasons may hold on one frame: :attr:`Decision.triggers` lists them
all, and :attr:`AutoSchedule.triggered` counts them per source (which trigger
costs the most detections).

Everything here is pure: :class:`AutoSchedule` decides from the frame's
pixels, the tracks recorded by the track stage up to the previous frame
(:class:`TrackBoard`) and the zones; no clock, so a file gives the same
decisions on every run. Under overload only (live sources, whose frames would
otherwise be dropped), :class:`FairShare` sets one minimum gap between
detections for every camera, so each camera's detector rate drops evenly.
"""

from __future__ import annotations

import asyncio
import math
from collections import Counter
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field

import numpy as np

from pipeline.frames import Frame
from pipeline.geometry import (
    Anchor,
    Box,
    Point,
    anchor_point,
    crosses_segment,
    distance_to_edge,
    point_in_polygon,
    signed_distance,
)

# Frames the detector may skip in a row whatever the scene (at 10 fps: 1.5 s).
MAX_GAP = 15
# Speed (fraction of the box's size, its shorter side, per frame) above which a track is fast.
FAST = 0.5
# A track's prediction is uncertain once it may have wandered this fraction of its size (after
# skipped frames the tracker matches with buffered boxes, which still overlap a box this far off).
DRIFT = 0.45
# How far a box of size s can wander per predicted frame: DRIFT_BASE*s + DRIFT_SPEED*speed, or
# DRIFT_BASE*s + the error per frame its prediction showed at the last detection, if smaller.
DRIFT_BASE = 0.01
DRIFT_SPEED = 0.08
# Motion: the small frame is about this wide; a cell changed by more than
# MOTION_LEVEL grey levels moved; MOTION_CELLS changed cells no track explains is motion.
SMALL_WIDTH = 96
MOTION_LEVEL = 24
MOTION_CELLS = 3
# Boxes excluded from the motion mask grow by this fraction of their size: boxes are approximate,
# and a track a few pixels off its prediction still overlaps its next detection (the tracker
# matches at a fifth of IoU), so that is not motion to detect.
BOX_MARGIN = 0.4
# A detection that is no track yet is confirmed by a second hit this many frames later: its
# tentative track waits at its box, and the detector's run for another reason often comes first.
NEW_OBJECT_GAP = 2
# A predicted box is seen when at least this share of its new cells changed.
SEEN = 0.5

REASONS = ("first", "max_gap", "new_object", "motion", "fast", "uncertain", "line", "zone")


def small_gray(image: np.ndarray, width: int = SMALL_WIDTH) -> tuple[np.ndarray, float]:
    """A grayscale copy about ``width`` cells wide (sum of the channels), and the cell size in pixels.

    Every ``step``-th pixel, then 2×2 cells averaged: cheap on a large frame, and
    the averaging takes the edge off compression noise.
    """
    w = image.shape[1]
    step = max(1, w // (2 * width))
    sub = image[::step, ::step]
    sh, sw = (sub.shape[0] // 2) * 2, (sub.shape[1] // 2) * 2
    grey = sub[:sh, :sw].sum(axis=2, dtype=np.int32) if sub.ndim == 3 else sub[:sh, :sw].astype(np.int32)
    cells = grey.reshape(sh // 2, 2, sw // 2, 2).sum(axis=(1, 3), dtype=np.int32)
    channels = sub.shape[2] if sub.ndim == 3 else 1
    return (cells // (4 * channels)).astype(np.int16), float(2 * step)


def unexplained_motion(
    grey: np.ndarray, reference: np.ndarray, cell: float, explained: Iterable[Box], level: int = MOTION_LEVEL
) -> int:
    """Cells that changed by more than ``level`` since ``reference``, outside the ``explained`` boxes."""
    if grey.shape != reference.shape:
        return grey.size  # a new resolution: everything is new
    changed = np.abs(grey - reference) > level
    if not changed.any():
        return 0
    rows, cols = changed.shape
    for x1, y1, x2, y2 in explained:
        mx, my = BOX_MARGIN * (x2 - x1), BOX_MARGIN * (y2 - y1)
        c1, r1 = max(0, int((x1 - mx) / cell)), max(0, int((y1 - my) / cell))
        c2, r2 = min(cols, math.ceil((x2 + mx) / cell)), min(rows, math.ceil((y2 + my) / cell))
        if c2 > c1 and r2 > r1:
            changed[r1:r2, c1:c2] = False
    return int(changed.sum())


def prediction_seen(grey: np.ndarray, reference: np.ndarray, cell: float, old: Box, new: Box) -> bool:
    """Whether the picture changed in the part of ``new`` (the predicted box) that ``old`` did not cover.

    An object that moved where its track predicts changed those cells (it
    covers what was behind it then); one that stopped left them as they were.
    True when that part is under :data:`MOTION_CELLS` cells: too small to tell.
    """
    if grey.shape != reference.shape:
        return False
    rows, cols = grey.shape
    # Along an axis the box moved less than a cell, its fresh strip is a sliver the filter's
    # jitter makes (a track's predicted box creeping a few pixels down): it tells nothing.
    ox1, oy1, ox2, oy2 = old
    if abs((new[0] + new[2]) - (ox1 + ox2)) / 2 < cell:
        ox1, ox2 = new[0], new[2]
    if abs((new[1] + new[3]) - (oy1 + oy2)) / 2 < cell:
        oy1, oy2 = new[1], new[3]
    old = (ox1, oy1, ox2, oy2)

    def cells(box: Box, touched: bool) -> tuple[int, int, int, int]:
        # The new part counts cells mostly inside the predicted box, and leaves out every
        # cell the old box touched: a shift under a cell tells nothing either way.
        x1, y1, x2, y2 = (v / cell for v in box)
        if touched:
            return max(0, int(x1)), max(0, int(y1)), min(cols, math.ceil(x2)), min(rows, math.ceil(y2))
        return max(0, round(x1)), max(0, round(y1)), min(cols, round(x2)), min(rows, round(y2))

    c1, r1, c2, r2 = cells(new, touched=False)
    if c2 <= c1 or r2 <= r1:
        return True
    fresh = np.ones((r2 - r1, c2 - c1), dtype=bool)
    o1, q1, o2, q2 = cells(old, touched=True)
    fresh[max(0, q1 - r1) : max(0, q2 - r1), max(0, o1 - c1) : max(0, o2 - c1)] = False
    if fresh.sum() < MOTION_CELLS:
        return True
    changed = np.abs(grey[r1:r2, c1:c2] - reference[r1:r2, c1:c2]) > MOTION_LEVEL
    return bool(changed[fresh].mean() >= SEEN)


@dataclass(slots=True)
class TrackState:
    """What the schedule knows of one track after the frame it was last recorded on."""

    track_id: int
    box: Box
    velocity: tuple[float, float] = (0.0, 0.0)  # px per frame, of the box's centre
    since_detection: int = 0  # frames since a detector (not the tracker) placed it
    detected_box: Box = (0.0, 0.0, 0.0, 0.0)  # where and when a detector last placed it
    detected_at: int = 0
    # How far (px per frame) the prediction was off at the last detection, over the frames
    # since the one before; None until a detection has checked one.
    error: float | None = None

    def ahead(self, frames: int) -> Box:
        """The box ``frames`` frames later at its velocity (what the tracker will predict)."""
        dx, dy = self.velocity[0] * frames, self.velocity[1] * frames
        x1, y1, x2, y2 = self.box
        return (x1 + dx, y1 + dy, x2 + dx, y2 + dy)

    @property
    def speed(self) -> float:
        return math.hypot(*self.velocity)

    @property
    def size(self) -> float:
        """The box's shorter side: what bounds its overlap with itself shifted."""
        return max(1.0, min(self.box[2] - self.box[0], self.box[3] - self.box[1]))


@dataclass
class _SourceBoard:
    frame: int = -1  # the last frame recorded
    detected: int = -1  # the last frame the detector ran on
    tracks: dict[int, TrackState] = field(default_factory=dict)
    untracked: int = 0  # detections of the last frame that are no track yet
    untracked_boxes: list[Box] = field(default_factory=list)  # and where they are
    boxes_at_detection: dict[int, Box] = field(default_factory=dict)  # track id -> box
    # Frames that entered the schedule and are not yet recorded (or given up).
    pending: dict[int, asyncio.Future[None]] = field(default_factory=dict)


class TrackBoard:
    """Per source and detector stage, the tracks after each frame, written by the track stage in order.

    The detector stage reads it to decide on the next frame; it waits until the
    frame before has been recorded (:meth:`wait_for_previous`), so the decision
    is the same however many frames are in flight.
    """

    def __init__(self) -> None:
        self._boards: dict[tuple[str, str], _SourceBoard] = {}
        self.watched: set[str] = set()  # detector stages with interval: auto

    def board(self, source: str, stage: str) -> _SourceBoard:
        key = (source, stage)
        board = self._boards.get(key)
        if board is None:
            board = self._boards[key] = _SourceBoard()
        return board

    def enter(self, source: str, stage: str, index: int) -> asyncio.Future[None] | None:
        """Register frame ``index``; the future of the frame before it that is still open, if any."""
        board = self.board(source, stage)
        earlier = [i for i in board.pending if i < index]
        board.pending[index] = asyncio.get_running_loop().create_future()
        return board.pending[max(earlier)] if earlier else None

    def give_up(self, source: str, stage: str, index: int) -> None:
        """Frame ``index`` will never be recorded (it failed or was dropped before the track stage)."""
        future = self.board(source, stage).pending.pop(index, None)
        if future is not None and not future.done():
            future.set_result(None)

    def record(self, frame: Frame) -> None:
        """After the track stage: each watched detector's tracks on ``frame`` (in frame order)."""
        for stage in self.watched:
            key = (frame.source, stage)
            if key not in self._boards:
                continue
            self._record(self._boards[key], frame, stage)

    def _record(self, board: _SourceBoard, frame: Frame, stage: str, tracked: bool = True) -> None:
        detected = stage not in frame.skipped
        steps = max(1, frame.index - board.frame) if board.frame >= 0 else 1
        seen: dict[int, TrackState] = {}
        untracked: list[Box] = []
        for obj in frame.objects:
            if obj.stage != stage or not tracked:
                continue
            if obj.track_id is None:
                untracked.append(obj.bbox)
                continue
            old = board.tracks.get(obj.track_id)
            state = TrackState(obj.track_id, obj.bbox, detected_box=obj.bbox, detected_at=frame.index)
            if old is not None and obj.predicted:
                # The tracker's prediction: the next one moves on as this one did (its filter's
                # velocity, which lags the measured one after a turn or on a young track).
                state.since_detection = old.since_detection + steps
                state.velocity = (
                    (_cx(obj.bbox) - _cx(old.box)) / steps,
                    (_cy(obj.bbox) - _cy(old.box)) / steps,
                )
                state.detected_box, state.detected_at = old.detected_box, old.detected_at
                state.error = old.error
            elif old is not None:
                # Measured between two detections, however far apart; smoothed when they are
                # neighbours, where one detection's jitter is not a change of speed.
                gap = max(1, frame.index - old.detected_at)
                guess = old.ahead(steps)
                state.error = math.hypot(_cx(obj.bbox) - _cx(guess), _cy(obj.bbox) - _cy(guess)) / gap
                vx = (_cx(obj.bbox) - _cx(old.detected_box)) / gap
                vy = (_cy(obj.bbox) - _cy(old.detected_box)) / gap
                keep = 0.5 if gap == 1 and old.since_detection == 0 else 0.0
                state.velocity = (
                    keep * old.velocity[0] + (1 - keep) * vx,
                    keep * old.velocity[1] + (1 - keep) * vy,
                )
            seen[obj.track_id] = state
        board.tracks = seen
        board.frame = frame.index
        if detected:
            board.detected = frame.index
            board.untracked, board.untracked_boxes = len(untracked), untracked
            board.boxes_at_detection = {t.track_id: t.box for t in seen.values()}
        future = board.pending.pop(frame.index, None)
        if future is not None and not future.done():
            future.set_result(None)

    def mark(self, frame: Frame, stage: str) -> None:
        """A detector without a track stage after it records its own frames (no tracks)."""
        self._record(self.board(frame.source, stage), frame, stage, tracked=False)

    def forget_source(self, source: str) -> None:
        for key in [k for k in self._boards if k[0] == source]:
            for future in self._boards[key].pending.values():
                if not future.done():
                    future.set_result(None)
            del self._boards[key]


def _cx(box: Box) -> float:
    return (box[0] + box[2]) / 2


def _cy(box: Box) -> float:
    return (box[1] + box[3]) / 2


@dataclass(frozen=True)
class Places:
    """The lines and zones of the pipeline's ``zones`` stages, in pixels of one frame size."""

    lines: list[tuple[Point, Point]] = field(default_factory=list)
    zones: list[list[Point]] = field(default_factory=list)
    anchor: Anchor = "bottom_center"
    normalized: bool = False  # coordinates are 0-1 fractions of the frame's width and height

    @classmethod
    def of(
        cls, lines: Sequence[Sequence[Sequence[float]]], zones: Sequence[Sequence[Sequence[float]]],
        anchor: Anchor = "bottom_center", normalized: bool = False,
    ) -> Places:  # fmt: skip
        """From a ``zones`` stage's ``lines[].points`` and ``zones[].polygon``."""
        return cls(
            lines=[((p[0][0], p[0][1]), (p[1][0], p[1][1])) for p in lines],
            zones=[[(x, y) for x, y in polygon] for polygon in zones],
            anchor=anchor,
            normalized=normalized,
        )

    def in_pixels(self, width: int, height: int) -> Places:
        if not self.normalized:
            return self
        return Places(
            lines=[((a[0] * width, a[1] * height), (b[0] * width, b[1] * height)) for a, b in self.lines],
            zones=[[(x * width, y * height) for x, y in polygon] for polygon in self.zones],
            anchor=self.anchor,
        )


@dataclass(frozen=True)
class Decision:
    run: bool
    reason: str  # one of REASONS when run, "" otherwise
    triggers: tuple[str, ...] = ()  # every reason that held, the first being ``reason``


SKIP = Decision(False, "")
# A reason was found, but the overload share holds this camera's detector back.
DEFERRED = Decision(False, "deferred")


def triggers(
    frame: int, board: _SourceBoard, motion_cells: int, places: Places, unseen: bool = False
) -> list[str]:
    """Every reason that holds for ``frame``, in :data:`REASONS` order, from the board as recorded.

    ``motion_cells``: changed cells no track explains; ``unseen``: a track's
    predicted box shows no change where it moved to (:func:`prediction_seen`).
    """
    if board.detected < 0:
        return ["first"]
    held: set[str] = set()
    gap = frame - board.detected
    if gap >= MAX_GAP:
        held.add("max_gap")
    if board.untracked and gap >= NEW_OBJECT_GAP:
        held.add("new_object")
    if motion_cells >= MOTION_CELLS:
        held.add("motion")
    if unseen:
        held.add("uncertain")
    ahead = max(1, frame - board.frame)
    for track in board.tracks.values():
        held.update(_track_reasons(track, ahead, places, gap))
    return [r for r in REASONS if r in held]


def decide(
    frame: int, board: _SourceBoard, motion_cells: int, places: Places, unseen: bool = False
) -> Decision:
    """Whether the detector runs on ``frame``: the first of its :func:`triggers`, if any."""
    held = triggers(frame, board, motion_cells, places, unseen)
    return Decision(True, held[0], tuple(held)) if held else SKIP


def _track_reasons(track: TrackState, ahead: int, places: Places, gap: int) -> set[str]:
    h, speed = track.size, track.speed
    held = set()
    if speed >= FAST * h:
        held.add("fast")
    # A prediction a detection found on time (its error per frame under the speed's share) is
    # trusted for longer; a young track, never checked, gets the speed's share alone.
    drift = DRIFT_SPEED * speed if track.error is None else min(DRIFT_SPEED * speed, track.error)
    if (track.since_detection + ahead) * (DRIFT_BASE * h + drift) >= DRIFT * h:
        held.add("uncertain")
    now = anchor_point(track.box, places.anchor)
    point = anchor_point(track.ahead(ahead), places.anchor)
    reach = max(0.1 * h, 1.5 * speed)
    for a, b in places.lines:
        # The frame its prediction crosses: the detector confirms (or refutes) the crossing there.
        d0, d1 = signed_distance(now, a, b), signed_distance(point, a, b)
        if d0 != d1 and (d0 > 0) != (d1 > 0) and crosses_segment(now, point, a, b):
            held.add("line")
    for polygon in places.zones:
        if distance_to_edge(point, polygon) <= reach:
            held.add("zone")
        if gap >= 2 and point_in_polygon(point, polygon):
            held.add("zone")
    return held


class AutoSchedule:
    """One detector stage's decisions for every source: motion reference and board per source."""

    def __init__(self, stage: str, board: TrackBoard, places: Sequence[Places] = ()) -> None:
        self.stage = stage
        self.board = board
        board.watched.add(stage)
        self.places = list(places)
        # Per source: the small frame of the last detection, and its cell size.
        self._reference: dict[str, tuple[np.ndarray, float]] = {}
        # Per source, every reason that held on a frame where one did (several may hold at
        # once): which trigger costs the most detections, beside the first reason counted
        # in vidpipe_detector_frames_total.
        self.triggered: dict[str, Counter[str]] = {}

    def decide(self, frame: Frame, min_gap: int = 0) -> Decision:
        """The decision for ``frame``; call once the frame before it was recorded (or given up).

        ``min_gap`` (the overload share) holds every reason but ``first`` and
        ``max_gap`` until that many frames have passed since the last detection.
        """
        board = self.board.board(frame.source, self.stage)
        grey, cell = small_gray(frame.image)
        motion, stopped = 0, False
        ref = self._reference.get(frame.source)
        if ref is not None and board.detected >= 0:
            ahead = max(1, frame.index - board.frame)
            predicted = {i: t.ahead(ahead) for i, t in board.tracks.items()}
            # A new object's own motion is no news until its second hit (new_object) is due.
            explained = [*board.boxes_at_detection.values(), *predicted.values(), *board.untracked_boxes]
            motion = unexplained_motion(grey, ref[0], cell, explained)
            for track_id, box in predicted.items():
                old = board.boxes_at_detection.get(track_id)
                if old is not None and not prediction_seen(grey, ref[0], cell, old, box):
                    stopped = True
                    break
            else:
                stopped = False
        places = self._scaled(frame.width, frame.height)
        decision = decide(frame.index, board, motion, places, stopped)
        if decision.triggers:
            self.triggered.setdefault(frame.source, Counter()).update(decision.triggers)
        if (
            decision.run
            and decision.reason not in ("first", "max_gap")
            and frame.index - board.detected < min_gap
        ):
            return Decision(False, DEFERRED.reason, decision.triggers)
        if decision.run:
            self._reference[frame.source] = (grey, cell)
        return decision

    def _scaled(self, width: int, height: int) -> Places:
        pixels = [p.in_pixels(width, height) for p in self.places]
        anchor = pixels[0].anchor if pixels else "bottom_center"
        return Places([ln for p in pixels for ln in p.lines], [z for p in pixels for z in p.zones], anchor)

    def forget_source(self, source: str) -> None:
        self._reference.pop(source, None)
        self.triggered.pop(source, None)


@dataclass
class FairShare:
    """Under overload, one minimum gap between detections for every live camera of a detector stage.

    Fed with how old each live frame is when it reaches the stage (capture to
    now): older than ``behind`` seconds means the pipeline falls behind and
    would soon drop frames, so the gap grows by one frame (at most once per
    ``period`` seconds); once every frame arrives fresh (under a fifth of
    ``behind``) for a period, it shrinks by one. The same gap for every camera
    is the fair share: each camera's detector rate drops by the same factor.
    """

    behind: float = 0.5
    period: float = 1.0
    ceiling: int = MAX_GAP
    min_gap: int = 0
    rising: bool = False  # the last change raised the gap
    _worst: float = 0.0
    _since: float | None = None

    def observe(self, age: float, now: float) -> int | None:
        """One live frame's age on arrival; the new gap when it changed, else None."""
        self._worst = max(self._worst, age)
        if self._since is None:
            self._since = now
            return None
        if now - self._since < self.period:
            return None
        worst, self._worst, self._since = self._worst, 0.0, now
        if worst > self.behind and self.min_gap < self.ceiling:
            self.min_gap += 1
            self.rising = True
            return self.min_gap
        if worst < self.behind / 5 and self.min_gap > 0:
            self.min_gap -= 1
            self.rising = False
            return self.min_gap
        return None
