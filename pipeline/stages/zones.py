"""Zones and lines: which zones each object is in, and events when tracked objects move.

::

    - name: gate
      type: zones
      zones:
        - {name: dock, polygon: [[100, 200], [400, 200], [400, 360], [100, 360]]}
      lines:
        - {name: door, points: [[320, 0], [320, 360]]}
      normalized: false          # true: coordinates are fractions (0-1) of width and height
      anchor: bottom_center      # the point of the box that stands for the object
      hysteresis: 3              # px: dead band along lines and zone edges
      track_end_after: 30        # frames a track may go unseen before it ends
      classes: []                # labels to follow; all when empty

Every object (of ``classes``) gets ``zones``: the names of the zones its anchor
is in. Objects with a ``track_id`` (a ``track`` stage runs earlier) also make
events, attached to the frame and published after its message on
``vidpipe.<pipeline>.<source>.events`` (:mod:`pipeline.events`):

- ``track_start`` when a track id first appears, ``track_end`` once it has not
  been seen (detected or predicted) for ``track_end_after`` frames, or its source ends, or its live
  source goes down (leaves ``up`` for ``backoff``: the tracks of a connection end
  with it, and the next connection's objects get new ids);
- ``zone_enter`` / ``zone_exit`` (a track that ends inside a zone exits it first);
- ``line_cross`` when the anchor passes from one side of a line's segment to
  the other: ``in`` from its left to its right, walking from its first point to
  its second, ``out`` the other way.

Within ``hysteresis`` pixels of a line or zone edge a track keeps the side it
had, so a box jittering on a line crosses it once. Events come from detections:
a predicted box (a detector's ``interval``) keeps its track alive and carries the
zones the track is in, and an event's box and frame are the track's last detection.
The stage is ``ordered``: it sees each source's frames in order and keeps its state
per source.
"""

from __future__ import annotations

import logging
from collections import Counter
from dataclasses import dataclass, field

from inference.schema import spec
from pipeline.events import Direction, Event, EventType
from pipeline.frames import DetectedObject, Frame, LineMark
from pipeline.geometry import (
    Anchor,
    Box,
    Point,
    anchor_point,
    crosses_segment,
    inside_with_hysteresis,
    line_side,
    point_in_polygon,
)
from pipeline.names import NAME_HELP, check_name
from pipeline.stages.base import Stage, StageContext, StageOptions

log = logging.getLogger("vidpipe.zones")


@dataclass(frozen=True)
class ZoneConfig:
    """A named polygon: ``{name, polygon: [[x, y], ...]}`` (three corners at least)."""

    name: str = field(metadata=spec(check=check_name, help=NAME_HELP))
    # Its shape is checked here, with the zone's other keys, so a wrong name and a wrong
    # polygon are reported together.
    polygon: list[list[float]] = field(
        metadata=spec(
            check=lambda points: _shape_check("polygon", points), help="corners [[x, y], ...], three at least"
        )
    )


@dataclass(frozen=True)
class LineConfig:
    """A named, directed segment: ``{name, points: [[x1, y1], [x2, y2]]}``."""

    name: str = field(metadata=spec(check=check_name, help=NAME_HELP))
    points: list[list[float]] = field(
        metadata=spec(
            check=lambda points: _shape_check("points", points), help="two points [[x1, y1], [x2, y2]]"
        )
    )


@dataclass(frozen=True)
class ZonesOptions(StageOptions):
    """``type: zones``: the zones and lines, and how objects are placed against them."""

    # What problems() reads; the graph's checks read nothing of a zones stage but its name
    # and type. A wrong hysteresis, anchor, track_end_after or classes leaves the rest checked.
    problem_keys = frozenset({"zones", "lines", "normalized"})
    graph_keys = frozenset[str]()

    zones: list[ZoneConfig] = field(default_factory=list)
    lines: list[LineConfig] = field(default_factory=list)
    normalized: bool = field(
        default=False, metadata=spec(help="true: coordinates are 0-1 fractions of the frame's size")
    )
    anchor: Anchor = field(default="bottom_center", metadata=spec(help="the point of the box that counts"))
    hysteresis: float = field(
        default=3.0, metadata=spec(ge=0, help="px: dead band along lines and zone edges")
    )
    track_end_after: int = field(
        default=30, metadata=spec(ge=1, help="frames unseen before a track ends; at least the tracker's")
    )
    classes: list[str] = field(default_factory=list, metadata=spec(help="labels to follow; all when empty"))

    def problems(self) -> list[tuple[str, str]]:
        out: list[tuple[str, str]] = []
        if not self.zones and not self.lines:
            out.append(("zones", "a zones stage needs at least one zone or line"))
        shapes = [(f"zones[{i}]", z.name, "polygon", z.polygon) for i, z in enumerate(self.zones)]
        shapes += [(f"lines[{i}]", ln.name, "points", ln.points) for i, ln in enumerate(self.lines)]
        names: set[tuple[str, str]] = set()
        for where, name, key, points in shapes:
            if (where[0], name) in names:
                out.append((f"{where}.name", f"duplicate name {name!r}"))
            names.add((where[0], name))
            # The shape itself was checked with the zone or line (ZoneConfig, LineConfig).
            if self.normalized and any(not 0 <= v <= 1 for p in points for v in p):
                out.append((f"{where}.{key}", "with normalized: true, coordinates are between 0 and 1"))
        return out


def _shape_check(key: str, points: list[list[float]]) -> tuple[str, str] | None:
    """The field check of a polygon or a line's points: the problem, with no hint (the field's
    help would repeat what the problem says)."""
    problem = _shape_problem(key, points)
    return (problem, "") if problem else None


def _shape_problem(key: str, points: list[list[float]]) -> str | None:
    """What is wrong with a zone's polygon or a line's points, if anything."""
    if any(len(p) != 2 for p in points):
        return "every point is [x, y]"
    if key == "polygon" and len(points) < 3:
        return f"a polygon needs 3 corners at least, got {len(points)}"
    if key == "polygon":
        corners = [(float(x), float(y)) for x, y in points]
        crossing = _edges_crossing(corners)
        if crossing is not None:
            a, b = crossing
            return (
                f"the polygon's edges {a + 1} and {b + 1} cross each other; list the corners in order "
                "around the zone"
            )
        if _area(corners) == 0:
            return "the polygon has no area: its corners are on one line"
    if key == "points" and len(points) != 2:
        return f"a line is two points, got {len(points)}"
    if key == "points" and points[0] == points[1]:
        return "the two points are the same"
    return None


def _area(corners: list[tuple[float, float]]) -> float:
    """The polygon's area (shoelace formula)."""
    n = len(corners)
    return abs(sum(corners[i][0] * corners[(i + 1) % n][1] - corners[(i + 1) % n][0] * corners[i][1]
                   for i in range(n))) / 2  # fmt: skip


def _edges_crossing(corners: list[tuple[float, float]]) -> tuple[int, int] | None:
    """Two edges (by index: edge i runs from corner i to i+1) that cross, or None."""

    def side(p: tuple[float, float], q: tuple[float, float], r: tuple[float, float]) -> float:
        return (q[0] - p[0]) * (r[1] - p[1]) - (q[1] - p[1]) * (r[0] - p[0])

    n = len(corners)
    edges = [(corners[i], corners[(i + 1) % n]) for i in range(n)]
    for i in range(n):
        for j in range(i + 1, n):
            if j == i + 1 or (i == 0 and j == n - 1):
                continue  # neighbours share a corner
            (p1, p2), (q1, q2) = edges[i], edges[j]
            d1, d2 = side(q1, q2, p1), side(q1, q2, p2)
            d3, d4 = side(p1, p2, q1), side(p1, p2, q2)
            if d1 * d2 < 0 and d3 * d4 < 0:  # a proper crossing (touching is allowed)
                return i, j
    return None


@dataclass(slots=True)
class _Track:
    """What the stage remembers of one track: its last sighting and where it stands."""

    label: str
    frame: int
    pts: float
    ts: float
    bbox: Box
    zones: dict[str, bool] = field(default_factory=dict)  # zone -> inside
    sides: dict[str, int] = field(default_factory=dict)  # line -> -1 left, +1 right
    points: dict[str, Point] = field(default_factory=dict)  # line -> last anchor clearly on its side
    owned: bool = True  # this stage says when it starts and ends (see ZonesStage._owns)
    present: int = -1  # the last frame it was in, detected or predicted (the end counts from it)

    def event(
        self,
        kind: EventType,
        track_id: int,
        zone: str | None = None,
        line: str | None = None,
        direction: Direction | None = None,
    ) -> Event:
        """An event of this track at its last sighting."""
        return Event(
            kind, self.frame, self.pts, self.ts, track_id, self.label, self.bbox, zone, line, direction
        )


@dataclass(slots=True)
class _Source:
    source: str
    tracks: dict[int, _Track] = field(default_factory=dict)
    size: tuple[int, int] = (0, 0)
    zones: list[tuple[str, list[Point]]] = field(default_factory=list)
    lines: list[tuple[str, Point, Point]] = field(default_factory=list)
    crossings: Counter[tuple[str, Direction]] = field(default_factory=Counter)  # (line, direction)


class ZonesStage(Stage):
    """Zone membership for every object; track, zone and line events for tracked ones."""

    kind = "zones"
    options_type = ZonesOptions
    ordered = True

    def __init__(self, options: StageOptions, context: StageContext) -> None:
        super().__init__(options, context)
        assert isinstance(options, ZonesOptions)  # the registry builds kinds from their own options
        self.opts = options
        self.pipeline = context.config.pipeline
        self._sources: dict[str, _Source] = {}
        stages = context.config.stages
        self._before = stages[: [s.name for s in stages].index(self.name)]
        # The zones stages before this one: a track one of them follows is theirs to start
        # and end, so two zones stages do not publish each track_start and track_end twice.
        self._earlier = [s.classes for s in self._before if isinstance(s, ZonesOptions)]

    async def start(self) -> None:
        if not any(s.type == "track" for s in self._before):
            log.warning(
                "stage %s: no track stage before it; objects get zones, but events need track ids",
                self.name,
            )

    def _source(self, frame: Frame) -> _Source:
        state = self._sources.setdefault(frame.source, _Source(frame.source))
        if state.size != (frame.width, frame.height):
            # Coordinates in pixels of this stream; fractions scale with its size.
            sx, sy = (frame.width, frame.height) if self.opts.normalized else (1, 1)
            state.size = (frame.width, frame.height)
            state.zones = [(z.name, [(x * sx, y * sy) for x, y in z.polygon]) for z in self.opts.zones]
            state.lines = [
                (
                    ln.name,
                    (ln.points[0][0] * sx, ln.points[0][1] * sy),
                    (ln.points[1][0] * sx, ln.points[1][1] * sy),
                )
                for ln in self.opts.lines
            ]
            self._warn_outside(frame, state)
        return state

    def _warn_outside(self, frame: Frame, state: _Source) -> None:
        """One warning per zone or line that lies wholly outside this source's frame: nothing
        can ever enter or cross it (coordinates drawn on a snapshot of another size, say)."""
        w, h = frame.width, frame.height
        shapes = [("zone", name, pts) for name, pts in state.zones]
        shapes += [("line", name, [a, b]) for name, a, b in state.lines]
        for what, name, pts in shapes:
            xs, ys = [p[0] for p in pts], [p[1] for p in pts]
            if max(xs) >= 0 and min(xs) <= w and max(ys) >= 0 and min(ys) <= h:
                continue
            fix = (
                "give fractions of the frame (0-1)"
                if self.opts.normalized
                else "draw it in this source's pixels, or give fractions with normalized: true"
            )
            log.warning(
                "stage %s: %s %s lies outside the %dx%d frame of source %s (x %g to %g, y %g to %g): "
                "nothing can %s it; %s",
                self.name, what, name, w, h, frame.source,
                min(xs), max(xs), min(ys), max(ys),
                "enter" if what == "zone" else "cross", fix,
            )  # fmt: skip

    async def process(self, frame: Frame) -> None:
        state = self._source(frame)
        seen: set[int] = set()
        occupancy: Counter[str] = Counter()
        for obj in frame.objects:
            if self.opts.classes and obj.label not in self.opts.classes:
                continue
            point = anchor_point(obj.bbox, self.opts.anchor)
            if obj.track_id is None or obj.track_id in seen:
                obj.zones = [name for name, polygon in state.zones if point_in_polygon(point, polygon)]
            else:
                seen.add(obj.track_id)
                obj.zones = self._follow(state, frame, obj, point)
            occupancy.update(obj.zones)
        for track_id, track in list(state.tracks.items()):
            if frame.index - max(track.frame, track.present) >= self.opts.track_end_after:
                frame.events.extend(self._end(state, track_id, track))
        self._end_with_owner(state, frame)
        # What the annotator draws: the shapes, and each line's crossings up to this frame.
        frame.zones.extend(state.zones)
        counts = state.crossings
        frame.lines.extend(LineMark(n, a, b, counts[n, "in"], counts[n, "out"]) for n, a, b in state.lines)
        metrics = self.context.metrics
        for name, _ in state.zones:
            metrics.zone_objects.labels(self.pipeline, frame.source, name).set(occupancy[name])

    def _owns(self, label: str) -> bool:
        """Whether this stage is the first zones stage to follow objects of ``label``."""
        return not any(not classes or label in classes for classes in self._earlier)

    def _follow(self, state: _Source, frame: Frame, obj: DetectedObject, point: Point) -> list[str]:
        """Update one tracked object's track, adding its events to the frame; its zones."""
        assert obj.track_id is not None
        track_id, band = obj.track_id, self.opts.hysteresis
        track = state.tracks.get(track_id)
        if obj.predicted:
            # The tracker's guess on a frame its detector skipped: it keeps the track alive
            # and shows where it stands, but moves nothing. A prediction overshoots a line
            # an object only jitters on; the next detection confirms a crossing or not.
            if track is None:
                return [name for name, polygon in state.zones if point_in_polygon(point, polygon)]
            track.present = frame.index
            return [name for name, _ in state.zones if track.zones.get(name)]
        sighting = (frame.index, frame.pts, frame.capture_ts, obj.bbox)
        if track is None:
            track = state.tracks[track_id] = _Track(obj.label, *sighting, owned=self._owns(obj.label))
            if track.owned:
                frame.events.append(track.event("track_start", track_id))
                self.context.metrics.active_tracks.labels(self.pipeline, frame.source).inc()
        track.label, (track.frame, track.pts, track.ts, track.bbox) = obj.label, sighting
        for name, polygon in state.zones:
            was = track.zones.get(name)
            now = track.zones[name] = inside_with_hysteresis(was, point, polygon, band)
            if now != bool(was):
                frame.events.append(track.event("zone_enter" if now else "zone_exit", track_id, zone=name))
        for name, a, b in state.lines:
            side = line_side(point, a, b, band)
            if side is None:
                continue  # in the dead band: keep the side and the last clear point
            was_side = track.sides.get(name)
            if was_side is not None and side != was_side and crosses_segment(track.points[name], point, a, b):
                direction: Direction = "in" if side > 0 else "out"
                frame.events.append(track.event("line_cross", track_id, line=name, direction=direction))
                state.crossings[name, direction] += 1
                self.context.metrics.line_crossings.labels(
                    self.pipeline, frame.source, name, direction, obj.label
                ).inc()
            track.sides[name], track.points[name] = side, point
        return [name for name, _ in state.zones if track.zones[name]]

    def _end_with_owner(self, state: _Source, frame: Frame) -> None:
        """End the tracks an earlier zones stage ended on this frame, their zone exits just
        before its ``track_end``: on its own timer this stage's exits came after it."""
        if not self._earlier or not any(e.type == "track_end" for e in frame.events):
            return
        events: list[Event] = []
        for event in frame.events:
            track = state.tracks.get(event.track_id) if event.type == "track_end" else None
            if track is not None and not track.owned:
                events.extend(self._end(state, event.track_id, track))
            events.append(event)
        frame.events[:] = events

    def _end(self, state: _Source, track_id: int, track: _Track) -> list[Event]:
        """A track ends at its last sighting: it leaves its zones, then ends."""
        del state.tracks[track_id]
        exits = [track.event("zone_exit", track_id, zone=z) for z, inside in track.zones.items() if inside]
        if not track.owned:
            return exits
        self.context.metrics.active_tracks.labels(self.pipeline, state.source).dec()
        return [*exits, track.event("track_end", track_id)]

    def end_source(self, source: str) -> list[Event]:
        # The source ended, or its live stream broke (frames may follow from a new
        # connection, with new track ids): its tracks end; line counts are kept.
        state = self._sources.get(source)
        if state is None:
            return []
        events = [e for tid, track in list(state.tracks.items()) for e in self._end(state, tid, track)]
        metrics = self.context.metrics
        for name, _ in state.zones:
            metrics.zone_objects.labels(self.pipeline, source, name).set(0)
        metrics.active_tracks.labels(self.pipeline, source).set(0)
        return events

    def forget_source(self, source: str) -> None:
        state = self._sources.pop(source, None)
        owned = sum(track.owned for track in state.tracks.values()) if state is not None else 0
        if owned:  # removed without an end: its tracks no longer count as active
            self.context.metrics.active_tracks.labels(self.pipeline, source).dec(owned)
