"""Zones, lines and events: the geometry alone, the stage run from a config snippet, and end to end."""

from __future__ import annotations

import dataclasses
import json
import re
from pathlib import Path
from typing import Any

import jsonschema
import nats
import numpy as np
import pytest

from inference.schema import ConfigError
from pipeline.config import load_config
from pipeline.events import events_schema
from pipeline.frames import DetectedObject, Frame
from pipeline.geometry import (
    anchor_point,
    crosses_segment,
    distance_to_edge,
    inside_with_hysteresis,
    line_side,
    point_in_polygon,
    signed_distance,
)
from pipeline.metrics import Metrics
from pipeline.nats_server import EmbeddedNats
from pipeline.runtime import Runtime
from pipeline.sources.pattern import pattern_square_box
from pipeline.stages.base import StageContext
from pipeline.stages.registry import create_stage
from pipeline.stages.zones import ZonesStage
from tests.conftest import ROOT, Collector, run_cli, validate_message

# --- geometry -----------------------------------------------------------------------------

SQUARE = [(0.0, 0.0), (10.0, 0.0), (10.0, 10.0), (0.0, 10.0)]
# An L: the square's top-right quarter is cut away.
ELL = [(0.0, 0.0), (5.0, 0.0), (5.0, 5.0), (10.0, 5.0), (10.0, 10.0), (0.0, 10.0)]


def test_point_in_polygon_convex_and_concave() -> None:
    assert point_in_polygon((5, 5), SQUARE)
    assert not point_in_polygon((11, 5), SQUARE)
    assert not point_in_polygon((5, -0.1), SQUARE)
    assert point_in_polygon((2, 2), ELL)
    assert point_in_polygon((8, 8), ELL)
    assert not point_in_polygon((8, 2), ELL)  # in the cut-away corner
    assert distance_to_edge((8, 2), ELL) == pytest.approx(3.0)
    assert distance_to_edge((5, 5), SQUARE) == pytest.approx(5.0)


def test_signed_distance_is_positive_on_the_right_of_the_direction() -> None:
    # A line drawn left to right across the picture: the bottom (y larger) is its right.
    assert signed_distance((5, 8), (0, 5), (10, 5)) == pytest.approx(3.0)
    assert signed_distance((5, 2), (0, 5), (10, 5)) == pytest.approx(-3.0)
    # Drawn bottom to top: its right is the picture's right.
    assert signed_distance((7, 3), (5, 10), (5, 0)) == pytest.approx(2.0)


def test_line_side_has_a_dead_band() -> None:
    a, b = (0.0, 0.0), (0.0, 100.0)  # downwards: the picture's left is its right
    assert line_side((-3.5, 50), a, b, band=3) == 1
    assert line_side((-3.0, 50), a, b, band=3) is None
    assert line_side((2.9, 50), a, b, band=3) is None
    assert line_side((3.1, 50), a, b, band=3) == -1
    assert line_side((0.1, 50), a, b, band=0) == -1


def test_crossing_counts_only_through_the_segment() -> None:
    a, b = (50.0, 0.0), (50.0, 100.0)
    assert crosses_segment((40, 50), (60, 50), a, b)
    assert crosses_segment((40, 0), (60, 0), a, b)  # the segment's end counts
    assert not crosses_segment((40, 120), (60, 130), a, b)  # went around its lower end
    assert crosses_segment((40, 90), (60, 110), a, b)  # meets the line at y=100


def test_zone_membership_keeps_its_state_within_the_band() -> None:
    assert inside_with_hysteresis(None, (9.5, 5), SQUARE, band=2) is True  # first sight: where it is
    assert inside_with_hysteresis(True, (10.5, 5), SQUARE, band=2) is True  # just outside: stays in
    assert inside_with_hysteresis(True, (12.5, 5), SQUARE, band=2) is False
    assert inside_with_hysteresis(False, (9.0, 5), SQUARE, band=2) is False
    assert inside_with_hysteresis(False, (7.0, 5), SQUARE, band=2) is True


def test_anchor_points() -> None:
    box = (10.0, 20.0, 30.0, 60.0)
    assert anchor_point(box) == (20.0, 60.0)
    assert anchor_point(box, "center") == (20.0, 40.0)
    assert anchor_point(box, "top_center") == (20.0, 20.0)
    assert anchor_point(box, "bottom_left") == (10.0, 60.0)
    assert anchor_point(box, "top_right") == (30.0, 20.0)


# --- the stage, from a config snippet -----------------------------------------------------


def zones_stage(tmp_path: Path, snippet: str) -> tuple[ZonesStage, Metrics]:
    path = tmp_path / "zones.yaml"
    path.write_text("pipeline: z\nstages:\n  - {name: track, type: track}\n" + snippet)
    config = load_config(path)
    metrics = Metrics()
    stage = create_stage(config.stages[-1], StageContext(config=config, models=None, metrics=metrics))
    assert isinstance(stage, ZonesStage)
    return stage, metrics


def frame_with(index: int, *boxes: tuple[int | None, tuple[float, float, float, float]]) -> Frame:
    frame = Frame("cam", index, index / 10, 1000.0 + index, np.zeros((200, 400, 3), np.uint8))
    for track_id, box in boxes:
        frame.objects.append(
            DetectedObject(frame.next_object_id(), "person", 0, 0.9, box, "det", track_id=track_id)
        )
    return frame


def box_at(x: float, y: float = 100.0) -> tuple[float, float, float, float]:
    """A 20×40 box whose bottom centre is (x, y)."""
    return (x - 10, y - 40, x + 10, y)


async def run_path(stage: ZonesStage, xs: list[float], start: int = 0) -> list[Frame]:
    frames = []
    for i, x in enumerate(xs, start):
        frame = frame_with(i, (7, box_at(x)))
        await stage.process(frame)
        frames.append(frame)
    return frames


def crossings(frames: list[Frame]) -> list[tuple[int, str | None]]:
    return [(e.frame, e.direction) for f in frames for e in f.events if e.type == "line_cross"]


LINE = "  - {name: gate, type: zones, lines: [{name: door, points: [[200, 0], [200, 200]]}]%s}\n"
JITTER = [190, 195, 199, 201, 198, 202, 199, 201, 215, 201, 199, 202, 198, 201, 199, 185]


async def test_jitter_on_a_line_gives_one_crossing_each_way(tmp_path: Path) -> None:
    stage, metrics = zones_stage(tmp_path, LINE % "")
    frames = await run_path(stage, JITTER)
    # The line points down the picture: its left is the picture's right, so moving right is "out".
    assert crossings(frames) == [(8, "out"), (15, "in")]
    labels = {"pipeline": "z", "source": "cam", "line": "door", "label": "person"}
    assert (
        metrics.registry.get_sample_value("vidpipe_line_crossings_total", {**labels, "direction": "in"}) == 1
    )
    assert (
        metrics.registry.get_sample_value("vidpipe_line_crossings_total", {**labels, "direction": "out"}) == 1
    )
    # Without the dead band the same jitter crosses on nearly every frame.
    stage, _ = zones_stage(tmp_path, LINE % ", hysteresis: 0")
    assert len(crossings(await run_path(stage, JITTER))) == 10


async def test_predicted_boxes_keep_a_track_alive_but_never_cross_or_enter(tmp_path: Path) -> None:
    # A detector with an interval: detections jitter inside the line's dead band, the
    # tracker's predictions between them overshoot it (as a Kalman filter does).
    snippet = (
        "  - {name: gate, type: zones, track_end_after: 3, lines: [{name: door, points: [[200, 0], [200, 200]]}],\n"
        "     zones: [{name: right, polygon: [[230, 0], [400, 0], [400, 200], [230, 200]]}]}\n"
    )
    stage, metrics = zones_stage(tmp_path, snippet)
    path = [(190, False), (199, False), (206, True), (201, False), (194, True), (202, False), (207, True),
            (240, True), (199, False), (240, False), (241, True), (242, True), (243, True), (244, True)]  # fmt: skip
    frames = []
    for i, (x, predicted) in enumerate(path):
        frame = frame_with(i, (7, box_at(x)))
        frame.objects[0].predicted = predicted
        await stage.process(frame)
        frames.append(frame)
    # Only the detections move the track: out at frame 9 (x 240), where it also enters.
    assert crossings(frames) == [(9, "out")]
    events = [(f.index, e.type, e.frame) for f in frames for e in f.events]
    assert events == [(0, "track_start", 0), (9, "zone_enter", 9), (9, "line_cross", 9)]
    # A predicted box shows the zones its track is in; it is not a sighting.
    assert [f.objects[0].zones for f in frames[6:11]] == [[], [], [], ["right"], ["right"]]
    # Four predicted frames after the last detection the track is still alive (its end
    # counts from the last frame it was in, detected or not), and ends at its last detection.
    assert stage.end_source("cam")[-1].frame == 9
    labels = {"pipeline": "z", "source": "cam", "line": "door", "label": "person", "direction": "in"}
    assert metrics.registry.get_sample_value("vidpipe_line_crossings_total", labels) is None


async def test_passing_beyond_the_end_of_a_line_is_no_crossing(tmp_path: Path) -> None:
    stage, _ = zones_stage(
        tmp_path, "  - {name: gate, type: zones, lines: [{name: door, points: [[200, 0], [200, 80]]}]}\n"
    )
    frames = await run_path(stage, [150, 180, 220, 250])  # bottom centre at y=100, below the segment
    assert crossings(frames) == []


async def test_track_events_and_zone_events_with_normalized_coordinates(tmp_path: Path) -> None:
    # The left half of the picture, in fractions: 200 px of this 400 px wide frame.
    snippet = (
        "  - {name: gate, type: zones, normalized: true, track_end_after: 3,\n"
        "     zones: [{name: left, polygon: [[0, 0], [0.5, 0], [0.5, 1], [0, 1]]}]}\n"
    )
    stage, metrics = zones_stage(tmp_path, snippet)
    first = frame_with(0, (7, box_at(100)), (None, box_at(150)), (8, box_at(300)))
    await stage.process(first)
    assert [o.zones for o in first.objects] == [["left"], ["left"], []]
    assert [(e.type, e.track_id, e.zone) for e in first.events] == [
        ("track_start", 7, None), ("zone_enter", 7, "left"), ("track_start", 8, None),
    ]  # fmt: skip
    gauge = metrics.registry.get_sample_value
    assert gauge("vidpipe_zone_objects", {"pipeline": "z", "source": "cam", "zone": "left"}) == 2
    assert gauge("vidpipe_active_tracks", {"pipeline": "z", "source": "cam"}) == 2
    # Track 7 moves on and is then lost; it ends 3 frames after its last sighting, leaving its zone.
    await stage.process(second := frame_with(1, (7, box_at(120)), (8, box_at(300))))
    assert second.events == []
    for index in (2, 3):
        await stage.process(frame := frame_with(index, (8, box_at(300))))
        assert frame.events == []
    await stage.process(frame := frame_with(4, (8, box_at(300))))
    assert [(e.type, e.track_id, e.zone, e.frame, e.bbox) for e in frame.events] == [
        ("zone_exit", 7, "left", 1, box_at(120)), ("track_end", 7, None, 1, box_at(120)),
    ]  # fmt: skip
    assert gauge("vidpipe_active_tracks", {"pipeline": "z", "source": "cam"}) == 1
    # The source ends: what is left ends at its last sighting.
    ended = stage.end_source("cam")
    assert [(e.type, e.track_id, e.frame) for e in ended] == [("track_end", 8, 4)]
    assert gauge("vidpipe_active_tracks", {"pipeline": "z", "source": "cam"}) == 0
    assert stage.end_source("cam") == []
    schema = events_schema()
    for event in [*first.events, *frame.events, *ended]:
        jsonschema.validate(event.to_message("z", "cam"), schema)


@pytest.mark.parametrize(
    ("snippet", "where", "problem"),
    [
        ("zones: [{name: a, polygon: [[0, 0], [1, 1]]}]", "stages[1].zones[0].polygon",
         "a polygon needs 3 corners at least, got 2"),
        ("zones: [{name: a, polygon: [[0, 0], [5, 5], [10, 10]]}]", "stages[1].zones[0].polygon",
         "the polygon has no area: its corners are on one line"),
        ("zones: [{name: a, polygon: [[0, 0], [10, 0], [0, 10], [10, 10]]}]", "stages[1].zones[0].polygon",
         "the polygon's edges 2 and 4 cross each other; list the corners in order around the zone"),
        ("lines: [{name: a, points: [[0, 0], [1, 1], [2, 2]]}]", "stages[1].lines[0].points",
         "a line is two points, got 3"),
        ("lines: [{name: a, points: [[0, 0], [0, 0]]}]", "stages[1].lines[0].points",
         "the two points are the same"),
        ("lines: [{name: a, points: [[0, 0], [1]]}]", "stages[1].lines[0].points", "every point is [x, y]"),
        ("normalized: true, lines: [{name: a, points: [[0, 0], [640, 0]]}]", "stages[1].lines[0].points",
         "with normalized: true, coordinates are between 0 and 1"),
        ("lines: [{name: a, points: [[0, 0], [1, 0]]}, {name: a, points: [[0, 1], [1, 1]]}]",
         "stages[1].lines[1].name", "duplicate name 'a'"),
        ("anchor: feet", "stages[1].anchor", "expected one of 'bottom_center'"),
        ("hysteresis: -1", "stages[1].hysteresis", "must be at least 0"),
        ("track_end_after: 2", "stages[1]", "a zones stage needs at least one zone or line"),
        ("zones: [{name: 'dock 1', polygon: [[0, 0], [1, 0], [1, 1]]}]", "stages[1].zones[0].name",
         "'dock 1' is not a valid name"),
    ],
)  # fmt: skip
def test_bad_zones_config_is_refused_with_file_and_line(
    tmp_path: Path, snippet: str, where: str, problem: str
) -> None:
    path = tmp_path / "bad.yaml"
    path.write_text(
        f"pipeline: z\nstages:\n  - {{name: track, type: track}}\n  - {{name: g, type: zones, {snippet}}}\n"
    )
    with pytest.raises(ConfigError) as info:
        load_config(path)
    message = str(info.value)
    assert message.startswith(f"{path}:4: {where}"), message
    assert problem in message


def test_a_zone_error_in_block_style_names_the_line_of_its_key(tmp_path: Path) -> None:
    path = tmp_path / "bad.yaml"
    path.write_text(
        "pipeline: z\nstages:\n  - {name: track, type: track}\n  - name: g\n    type: zones\n"
        "    zones:\n      - name: dock\n        polygon: [[0, 0], [1, 1]]\n"
        "    lines:\n      - name: door\n        points: [[0, 0]]\n"
    )
    with pytest.raises(ConfigError) as info:
        load_config(path)
    assert [(e.line, e.path) for e in info.value.errors] == [
        (8, "stages[1].zones[0].polygon"),
        (11, "stages[1].lines[0].points"),
    ]


def test_zones_keys_do_not_apply_to_a_track_stage(tmp_path: Path) -> None:
    path = tmp_path / "bad.yaml"
    path.write_text("pipeline: z\nstages:\n  - {name: track, type: track, anchor: center}\n")
    with pytest.raises(ConfigError, match=r"stages\[0\]\.anchor: does not apply to a stage of type track"):
        load_config(path)


# --- end to end ---------------------------------------------------------------------------

W, H = 320, 240
FRAMES = 90
LINE_X = 205.5  # the line is drawn bottom to top: its left is the picture's left
ZONE_X = 240.5  # the dock: everything right of this

PIPELINE = f"""\
pipeline: zones
models: {{models}}
sources:
  - id: pattern
    url: test://?width={W}&height={H}&fps=30&frames={FRAMES}
    queue_size: 256        # live sources drop when behind; this run must see every frame
stages:
  - {{{{name: objects, type: infer, model: squares}}}}
  - {{{{name: track, type: track}}}}
  - name: gate
    type: zones
    lines: [{{{{name: door, points: [[{LINE_X}, {H}], [{LINE_X}, 0]]}}}}]
    zones: [{{{{name: dock, polygon: [[{ZONE_X}, -10], [330, -10], [330, 250], [{ZONE_X}, 250]]}}}}]
"""


def truth_anchor_x(index: int) -> float:
    x1, _, x2, _ = pattern_square_box(index, W, H)
    return (x1 + x2) / 2


def transitions(inside: Any) -> list[tuple[int, bool]]:
    """(frame, new state) wherever ``inside(anchor x)`` changes between consecutive frames."""
    return [
        (i, inside(truth_anchor_x(i)))
        for i in range(1, FRAMES)
        if inside(truth_anchor_x(i)) != inside(truth_anchor_x(i - 1))
    ]


async def read_events_with_ids(url: str, subject: str) -> list[tuple[str, dict[str, Any]]]:
    nc = await nats.connect(url)
    sub = await nc.jetstream().subscribe(subject, ordered_consumer=True)
    out = []
    while True:
        try:
            msg = await sub.next_msg(timeout=2.0)
        except TimeoutError:
            break
        out.append((msg.headers["Nats-Msg-Id"], json.loads(msg.data)))
    await nc.close()
    return out


@pytest.mark.parametrize("publish", ["core", "jetstream"])
async def test_a_square_crossing_a_line_each_way_gives_two_crossings_and_matching_events(
    tmp_path: Path, sample_models: Path, nats_server: EmbeddedNats, collector: Collector, publish: str
) -> None:
    path = tmp_path / "zones.yaml"
    path.write_text(PIPELINE.format(models=sample_models))
    config = load_config(path)
    config = dataclasses.replace(config, nats=dataclasses.replace(config.nats, publish=publish))
    await collector.start(nats_server.url, "vidpipe.zones.>")
    runtime = Runtime(config, nats_url=nats_server.url)
    await runtime.start()
    await runtime.wait(60)
    await runtime.stop()
    await collector.wait_for(FRAMES + 6)

    detections = [
        m for s, m in zip(collector.subjects, collector.messages, strict=True) if s.endswith(".detections")
    ]
    events = [m for s, m in zip(collector.subjects, collector.messages, strict=True) if s.endswith(".events")]
    assert {s for s in collector.subjects} == {
        "vidpipe.zones.pattern.detections",
        "vidpipe.zones.pattern.events",
    }
    assert [m["frame"] for m in detections] == list(range(FRAMES))
    for m in detections:
        validate_message(m)
    for e in events:
        jsonschema.validate(e, events_schema())
        assert (e["pipeline"], e["source"], e["label"], e["track_id"]) == ("zones", "pattern", "square", 1)

    # The truth, from where the pattern draws the square (bottom-centre anchor).
    crossings = transitions(lambda x: x > LINE_X)
    entries = transitions(lambda x: x > ZONE_X)
    assert [(i, "in" if right else "out") for i, right in crossings] == [(27, "in"), (54, "out")]
    assert [i for i, _ in entries] == [32, 49]

    assert [e["type"] for e in events] == [
        "track_start", "line_cross", "zone_enter", "zone_exit", "line_cross", "track_end",
    ]  # fmt: skip
    start, cross_in, enter, leave, cross_out, end = events
    assert (start["frame"], end["frame"]) == (0, FRAMES - 1)  # the source's end ends the track
    assert (cross_in["line"], cross_in["direction"]) == ("door", "in")
    assert (cross_out["line"], cross_out["direction"]) == ("door", "out")
    assert abs(cross_in["frame"] - 27) <= 1 and abs(cross_out["frame"] - 54) <= 1
    assert (enter["zone"], leave["zone"]) == ("dock", "dock")
    assert abs(enter["frame"] - 32) <= 1 and abs(leave["frame"] - 49) <= 1
    for e in events:
        truth = pattern_square_box(e["frame"], W, H)
        assert all(abs(a - t) <= 2 for a, t in zip(e["bbox"], truth, strict=True)), (e, truth)
        assert e["pts"] == pytest.approx(e["frame"] / 30, abs=1e-6)
    # Each object says which zones it is in.
    by_frame = {m["frame"]: m["objects"][0]["zones"] for m in detections}
    assert by_frame[10] == [] and by_frame[40] == ["dock"] and by_frame[70] == []

    sample = runtime.metrics.registry.get_sample_value
    labels = {"pipeline": "zones", "source": "pattern"}
    assert sample("vidpipe_objects_total", {**labels, "label": "square"}) == FRAMES
    for direction in ("in", "out"):
        crossing = {**labels, "line": "door", "direction": direction, "label": "square"}
        assert sample("vidpipe_line_crossings_total", crossing) == 1
    assert sample("vidpipe_events_total", {**labels, "type": "line_cross"}) == 2
    assert sample("vidpipe_events_total", {**labels, "type": "track_end"}) == 1
    assert sample("vidpipe_active_tracks", labels) == 0
    assert sample("vidpipe_zone_objects", {**labels, "zone": "dock"}) == 0

    if publish == "jetstream":
        stored = await read_events_with_ids(nats_server.url, "vidpipe.zones.pattern.events")
        assert [m for _, m in stored] == events
        ids = [i for i, _ in stored]
        assert len(set(ids)) == len(ids)
        assert all(re.fullmatch(r"zones/pattern/[0-9a-f]{12}/(\d+|end)/\d", i) for i in ids), ids
        assert ids[-1].split("/")[3:] == ["end", "0"]


async def test_a_second_zones_stage_adds_its_zone_events_and_the_track_still_ends_last(
    tmp_path: Path, sample_models: Path, nats_server: EmbeddedNats, collector: Collector
) -> None:
    path = tmp_path / "zones.yaml"
    whole = f"[[0, 0], [{W}, 0], [{W}, {H}], [0, {H}]]"
    path.write_text(
        PIPELINE.format(models=sample_models)
        + f"  - {{name: yard, type: zones, zones: [{{name: all, polygon: {whole}}}]}}\n"
    )
    await collector.start(nats_server.url, "vidpipe.zones.pattern.events")
    runtime = Runtime(load_config(path), nats_url=nats_server.url)
    await runtime.start()
    await runtime.wait(60)
    await runtime.stop()
    await collector.wait_for(8)
    # One start and one end for the track, though two zones stages follow it; the square is
    # still in "all" at the source's end, and leaves it before its track ends.
    assert [(e["type"], e.get("zone") or e.get("line")) for e in collector.messages] == [
        ("track_start", None), ("zone_enter", "all"), ("line_cross", "door"), ("zone_enter", "dock"),
        ("zone_exit", "dock"), ("line_cross", "door"), ("zone_exit", "all"), ("track_end", None),
    ]  # fmt: skip
    labels = {"pipeline": "zones", "source": "pattern", "type": "track_start"}
    assert runtime.metrics.registry.get_sample_value("vidpipe_events_total", labels) == 1


def test_summary_counts_frames_not_events(tmp_path: Path, sample_models: Path) -> None:
    path = tmp_path / "zones.yaml"
    path.write_text(PIPELINE.format(models=sample_models))
    proc = run_cli("run", str(path), "--source", "test://?fps=50&frames=10", "--summary")
    assert proc.returncode == 0, proc.stderr
    # Ten frames; the track's start and end went to the events subject and are not frames.
    assert "received 10 messages from 1 source(s)" in proc.stdout


# --- docs and dashboard -------------------------------------------------------------------


def test_docs_cover_zones_events_and_their_metrics() -> None:
    from pipeline.stages.zones import LineConfig, ZoneConfig, ZonesOptions

    config = re.sub(r"```.*?```", "", (ROOT / "docs" / "config.md").read_text(), flags=re.S)
    documented = {w for code in re.findall(r"`([^`]+)`", config) for w in re.findall(r"[a-z_0-9]+", code)}
    for cls in (ZonesOptions, ZoneConfig, LineConfig):
        for f in dataclasses.fields(cls):
            assert f.name in documented, f"docs/config.md does not mention {cls.__name__}.{f.name}"
    messages = (ROOT / "docs" / "messages.md").read_text()
    assert "vidpipe.events/v1" in messages and "pipeline/schemas/events.v1.json" in messages
    for name in events_schema()["properties"]:
        assert f"`{name}`" in messages, f"docs/messages.md does not describe the event field {name}"
    operations = (ROOT / "docs" / "operations.md").read_text()
    new = ["vidpipe_objects_total", "vidpipe_zone_objects", "vidpipe_line_crossings_total",
           "vidpipe_active_tracks", "vidpipe_events_total"]  # fmt: skip
    for name in new:
        assert f"**`{name}" in operations, f"docs/operations.md does not describe {name}"
    from tests.test_deploy_files import DASHBOARD, dashboard_exprs, load_one

    exprs = "\n".join(expr for _, expr in dashboard_exprs(load_one(DASHBOARD)))
    missing = [name for name in new if not re.search(rf"\b{name}\b", exprs)]
    assert not missing, f"the Grafana dashboard has no panel for {missing}"


async def test_a_zone_or_line_outside_the_frame_is_warned_once_per_source(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    # Drawn on a 1280x720 snapshot; the camera sends 400x200.
    stage, _ = zones_stage(
        tmp_path,
        "  - {name: gate, type: zones, lines: [{name: door, points: [[900, 300], [900, 700]]}],\n"
        "     zones: [{name: dock, polygon: [[500, 250], [1200, 250], [1200, 700]]},\n"
        "             {name: edge, polygon: [[-50, -50], [100, -50], [100, 100]]}]}\n",
    )
    with caplog.at_level("WARNING", logger="vidpipe"):
        await run_path(stage, [150, 160, 170])
    warned = [r.getMessage() for r in caplog.records if "lies outside" in r.getMessage()]
    fix = "draw it in this source's pixels, or give fractions with normalized: true"
    assert warned == [
        "stage gate: zone dock lies outside the 400x200 frame of source cam (x 500 to 1200, y 250 to 700): "
        f"nothing can enter it; {fix}",
        "stage gate: line door lies outside the 400x200 frame of source cam (x 900 to 900, y 300 to 700): "
        f"nothing can cross it; {fix}",
    ]


async def test_two_zones_stages_start_and_end_each_track_once(tmp_path: Path) -> None:
    path = tmp_path / "zones.yaml"
    path.write_text(
        "pipeline: z\nstages:\n  - {name: track, type: track}\n"
        "  - {name: gate, type: zones, lines: [{name: door, points: [[200, 0], [200, 200]]}]}\n"
        "  - {name: yard, type: zones, zones: [{name: right, polygon: [[250, 0], [400, 0], [400, 200], [250, 200]]}]}\n"
        "  - {name: cars, type: zones, classes: [car], zones: [{name: all, polygon: [[0, 0], [400, 0], [400, 200]]}]}\n"
    )
    config = load_config(path)
    metrics = Metrics()
    stages = [
        create_stage(options, StageContext(config=config, models=None, metrics=metrics))
        for options in config.stages[1:]
    ]
    frames = []
    for i, x in enumerate([150, 190, 230, 270, 300]):
        frame = frame_with(i, (7, box_at(x)))
        frame.objects.append(
            DetectedObject(frame.next_object_id(), "car", 1, 0.9, box_at(50 + x), "det", track_id=8)
        )
        for stage in stages:
            await stage.process(frame)
        frames.append(frame)
    ended = [e for stage in stages for e in stage.end_source("cam")]  # type: ignore[attr-defined]
    events = [(e.type, e.track_id, e.zone or e.line) for f in frames for e in f.events]
    events += [(e.type, e.track_id, e.zone or e.line) for e in ended]
    # The person is the first zones stage's to start and end; the car too (it follows every
    # class), though "cars" follows it as well. Each stage says its own zones and lines.
    assert events == [
        ("track_start", 7, None),
        ("track_start", 8, None),
        ("zone_enter", 8, "all"),
        ("line_cross", 7, "door"),
        ("zone_enter", 8, "right"),
        ("zone_enter", 7, "right"),
        ("track_end", 7, None),
        ("track_end", 8, None),
        ("zone_exit", 7, "right"),
        ("zone_exit", 8, "right"),
        ("zone_exit", 8, "all"),
    ]
    assert metrics.registry.get_sample_value("vidpipe_active_tracks", {"pipeline": "z", "source": "cam"}) == 0


async def test_a_track_that_times_out_leaves_a_later_stages_zone_before_it_ends(tmp_path: Path) -> None:
    # The later stage's own timer (track_end_after 30) put its zone_exit 29 frames after the
    # first stage's track_end (track_end_after 2): a consumer had already forgotten the track.
    path = tmp_path / "zones.yaml"
    path.write_text(
        "pipeline: z\nstages:\n  - {name: track, type: track}\n"
        "  - {name: gate, type: zones, track_end_after: 2, lines: [{name: door, points: [[200, 0], [200, 200]]}]}\n"
        "  - {name: yard, type: zones, zones: [{name: right, polygon: [[250, 0], [400, 0], [400, 200], [250, 200]]}]}\n"
    )
    config = load_config(path)
    stages = [
        create_stage(options, StageContext(config=config, models=None, metrics=Metrics()))
        for options in config.stages[1:]
    ]
    events = []
    for i in range(6):
        frame = frame_with(i, (7, box_at(300))) if i < 2 else frame_with(i)
        for stage in stages:
            await stage.process(frame)
        events += [(frame.index, e.type, e.zone, e.frame) for e in frame.events]
    assert events == [
        (0, "track_start", None, 0),
        (0, "zone_enter", "right", 0),
        (3, "zone_exit", "right", 1),
        (3, "track_end", None, 1),
    ]
    assert [stage.end_source("cam") for stage in stages] == [[], []]  # type: ignore[attr-defined]


def test_the_schemas_refuse_what_vidpipe_never_sends() -> None:
    # A text line's polygon is always its 4 corners; times are unix seconds.
    from pipeline.messages import detections_schema

    obj = {"id": 1, "label": "text", "class_id": 0, "score": 0.9, "bbox": [0.0, 0.0, 4.0, 2.0]}
    frame = {"schema": "vidpipe.detections/v1", "pipeline": "p", "source": "cam", "frame": 0, "pts": 0.0,
             "capture_ts": 1.0, "publish_ts": 1.0, "width": 8, "height": 8, "objects": [obj]}  # fmt: skip
    square = [[0.0, 0.0], [4.0, 0.0], [4.0, 2.0], [0.0, 2.0]]
    jsonschema.validate({**frame, "objects": [{**obj, "polygon": square}]}, detections_schema())
    for wrong in (
        {**frame, "objects": [{**obj, "polygon": square[:3]}]},
        {**frame, "objects": [{**obj, "polygon": [*square, [1.0, 1.0]]}]},
        {**frame, "capture_ts": -5.0},
        {**frame, "publish_ts": -1.0},
    ):
        with pytest.raises(jsonschema.ValidationError):
            jsonschema.validate(wrong, detections_schema())
    event = {"schema": "vidpipe.events/v1", "type": "track_start", "pipeline": "p", "source": "cam", "frame": 0,
             "pts": 0.0, "ts": 1.0, "track_id": 1, "label": "text", "bbox": [0.0, 0.0, 4.0, 2.0]}  # fmt: skip
    jsonschema.validate(event, events_schema())
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate({**event, "ts": -1.0}, events_schema())
