"""``interval: auto``: the detector's schedule on synthetic motion, and the overload share.

Frames are rendered with numpy (bright squares on a grey floor); the "detector"
answers each frame's true boxes, the real track stage follows them and records
the board, and :class:`AutoSchedule` decides on the next frame as the infer
stage does.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import av
import numpy as np
import pytest

from pipeline.auto_interval import (
    MAX_GAP,
    NEW_OBJECT_GAP,
    AutoSchedule,
    Decision,
    FairShare,
    Places,
    TrackBoard,
    TrackState,
    _SourceBoard,
    _track_reasons,
    decide,
    prediction_seen,
    small_gray,
    triggers,
    unexplained_motion,
)
from pipeline.config import load_config
from pipeline.frames import DetectedObject, Frame
from pipeline.metrics import Metrics
from pipeline.runtime import Runtime
from pipeline.stages.base import StageContext
from pipeline.stages.track import TrackOptions, TrackStage
from pipeline.stages.zones import ZonesOptions

W, H = 320, 240
Box = tuple[float, float, float, float]
Scene = Callable[[int], list[Box]]


def render(boxes: list[Box]) -> np.ndarray:
    image = np.full((H, W, 3), 60, dtype=np.uint8)
    image[::16, :] = 90  # a tiled floor: texture that does not move
    for x1, y1, x2, y2 in boxes:
        image[max(0, int(y1)) : int(y2), max(0, int(x1)) : int(x2)] = 240
    return image


async def schedule(
    tmp_path: Path, sample_models: Path, scene: Scene, frames: int, lines: str = "", min_gap: int = 0,
    published: list[list[Box]] | None = None, triggered: dict[str, int] | None = None,
) -> tuple[list[tuple[int, str]], list[list[int | None]]]:  # fmt: skip
    """Decisions ``(frame, reason)`` where the detector ran, and the track ids published per frame.

    ``published``, when given, gets every frame's published boxes; ``triggered`` the
    schedule's count of every reason that held.
    """
    zones = f"  - {{name: gate, type: zones, lines: [{lines}]}}\n" if lines else ""
    path = tmp_path / "auto.yaml"
    path.write_text(
        f"pipeline: auto\nmodels: {sample_models}\nstages:\n"
        "  - {name: det, type: infer, model: squares, interval: auto}\n"
        "  - {name: track, type: track}\n" + zones
    )
    config = load_config(path)
    context = StageContext(config=config, models=None, metrics=Metrics())
    track = TrackStage(TrackOptions(name="track", type="track"), context)
    places = [
        Places.of([ln.points for ln in s.lines], [], s.anchor)
        for s in config.stages
        if isinstance(s, ZonesOptions)
    ]
    auto = AutoSchedule("det", context.tracks, places)
    runs: list[tuple[int, str]] = []
    ids: list[list[int | None]] = []
    for index in range(frames):
        truth = scene(index)
        frame = Frame("cam", index, index / 10, 0.0, render(truth))
        context.tracks.enter("cam", "det", index)
        decision = auto.decide(frame, min_gap)
        if decision.run:
            runs.append((index, decision.reason))
            frame.objects = [
                DetectedObject(id=i + 1, label="square", class_id=0, score=0.9, bbox=box, stage="det")
                for i, box in enumerate(truth)
            ]
        else:
            frame.skipped.add("det")
        await track.process(frame)
        ids.append([o.track_id for o in frame.objects])
        if published is not None:
            published.append([o.bbox for o in frame.objects])
    if triggered is not None:
        triggered.update(auto.triggered.get("cam", {}))
    return runs, ids


def square(x: float, y: float, side: float = 30) -> Box:
    return (x, y, x + side, y + side)


async def test_a_still_empty_scene_runs_the_detector_only_at_the_start_and_each_max_gap(
    tmp_path: Path, sample_models: Path
) -> None:
    runs, _ = await schedule(tmp_path, sample_models, lambda i: [], 40)
    assert runs == [(0, "first"), (MAX_GAP, "max_gap"), (2 * MAX_GAP, "max_gap")]


async def test_a_still_object_is_left_to_its_track_until_the_max_gap(
    tmp_path: Path, sample_models: Path
) -> None:
    runs, ids = await schedule(tmp_path, sample_models, lambda i: [square(100, 100)], 40)
    # ByteTrack confirms the stream's first detections at once; after that nothing moves.
    assert runs == [(0, "first"), (MAX_GAP, "max_gap"), (2 * MAX_GAP, "max_gap")]
    assert all(frame_ids == [1] for frame_ids in ids)


async def test_a_moving_square_is_detected_as_often_as_its_prediction_needs_and_keeps_its_id(
    tmp_path: Path, sample_models: Path
) -> None:
    # 3 px a frame to the right, then it turns down at frame 30: the prediction goes
    # wrong, the motion outside the predicted box is seen, and the detector runs.
    def scene(i: int) -> list[Box]:
        x = 20 + 3 * min(i, 30)
        y = 60 + 3 * max(0, i - 30)
        return [square(x, y)]

    runs, ids = await schedule(tmp_path, sample_models, scene, 60)
    assert len(runs) <= 60 // 3
    assert {frame_ids[0] for frame_ids in ids[1:]} == {1}  # one id the whole way
    frames = [i for i, _ in runs]
    # Right after the turn the motion the tracker cannot explain brings the detector back.
    assert any(31 <= i <= 34 for i in frames)
    gaps = np.diff(frames)
    assert gaps.max() <= MAX_GAP  # on its straight stretch its prediction holds until the max gap


async def test_a_new_object_is_motion_the_tracker_cannot_explain(tmp_path: Path, sample_models: Path) -> None:
    def scene(i: int) -> list[Box]:
        return [square(40, 40)] + ([square(200, 150)] if i >= 6 else [])

    triggered: dict[str, int] = {}
    runs, ids = await schedule(tmp_path, sample_models, scene, 12, triggered=triggered)
    # A new track needs a second hit to be confirmed, NEW_OBJECT_GAP frames after it appeared;
    # its own motion in between is no news.
    assert runs == [(0, "first"), (6, "motion"), (6 + NEW_OBJECT_GAP, "new_object")]
    assert ids[7] == [1] and ids[8] == [1, 2]
    assert triggered == {"first": 1, "motion": 1, "new_object": 1}


async def test_a_fast_newcomer_is_confirmed_by_its_second_hit_frames_later(
    tmp_path: Path, sample_models: Path
) -> None:
    # A square entering at 12 px a frame: its tentative track waits where it was first seen,
    # and its second hit, NEW_OBJECT_GAP frames later, is 24 px (0.8 of its width) away. The
    # buffered match after skipped frames confirms it there; a plain one (IoU 0.11) would
    # start another tentative track and leave it without an id.
    def scene(i: int) -> list[Box]:
        return [square(40, 40)] + ([square(20 + 12 * (i - 6), 150)] if i >= 6 else [])

    runs, ids = await schedule(tmp_path, sample_models, scene, 12)
    assert runs[:3] == [(0, "first"), (6, "motion"), (6 + NEW_OBJECT_GAP, "new_object")]
    assert ids[6 + NEW_OBJECT_GAP] == [1, 2]
    assert all(frame_ids == [1, 2] for frame_ids in ids[6 + NEW_OBJECT_GAP :])


def test_a_prediction_its_last_detection_found_on_time_is_trusted_for_longer() -> None:
    # A 30 px square at 12 px a frame, on the 11th frame after its last detection: by its
    # speed alone its prediction may have drifted 11 × (0.3 + 0.96) = 13.9 px, over 45% of
    # its size (13.5 px). When that detection found the prediction 0.5 px a frame off,
    # 11 × 0.8 = 8.8 px is not.
    unchecked = TrackState(1, square(100, 100), velocity=(12.0, 0.0), since_detection=10)
    checked = TrackState(1, square(100, 100), velocity=(12.0, 0.0), since_detection=10, error=0.5)
    assert "uncertain" in _track_reasons(unchecked, 1, Places(), 11)
    assert "uncertain" not in _track_reasons(checked, 1, Places(), 11)
    # Far enough on, it is checked again: 17 × 0.8 px reaches 45% of 30 px.
    assert "uncertain" in _track_reasons(checked, 7, Places(), 17)


def test_the_board_records_how_far_off_the_prediction_was_at_a_detection() -> None:
    board = TrackBoard()
    board.watched.add("det")
    board.board("cam", "det")

    def frame(index: int, x: float, predicted: bool) -> Frame:
        f = Frame("cam", index, index / 10, 0.0, render([]))
        f.objects = [
            DetectedObject(id=1, label="square", class_id=0, score=0.9, bbox=square(x, 40), stage="det",
                           track_id=1, predicted=predicted)
        ]  # fmt: skip
        if predicted:
            f.skipped.add("det")
        return f

    # Detected at 0 and 1: 4 px from where a track at rest was expected. Predicted at 2 and 3
    # moving on at 4 px (the check of frame 1 carried), detected at 4 where the square is
    # 6 px further than predicted: 6 px over the 3 frames since the last detection.
    for index, x, predicted in [(0, 0, False), (1, 4, False), (2, 8, True), (3, 12, True), (4, 22, False)]:
        board.record(frame(index, x, predicted))
        if index == 3:
            assert board.board("cam", "det").tracks[1].error == pytest.approx(4.0)
    assert board.board("cam", "det").tracks[1].error == pytest.approx(2.0)


LINE_160 = "{name: l, points: [[0, 160], [320, 160]]}"


async def test_a_track_is_detected_on_the_frame_its_prediction_crosses_a_line_and_not_before(
    tmp_path: Path, sample_models: Path
) -> None:
    # A square walking down at 4 px a frame towards a line across the floor at y=160; its
    # anchor (bottom centre) is at 50 + 4i: 158 on frame 27, 162 on frame 28.
    def scene(i: int) -> list[Box]:
        return [square(140, 20 + 4 * i)]

    runs, ids = await schedule(tmp_path, sample_models, scene, 40, lines=LINE_160)
    assert [i for i, reason in runs if reason == "line"] == [28]
    # The frames before, within two steps of the line, are left to the tracker.
    assert {25, 26, 27} & {i for i, _ in runs} == set()
    assert {frame_ids[0] for frame_ids in ids[1:]} == {1}
    assert len(runs) <= 40 // 5


async def test_a_track_stopping_just_before_a_line_is_not_carried_across_it_by_its_prediction(
    tmp_path: Path, sample_models: Path
) -> None:
    # The same square stops on frame 26, its anchor 6 px before the line; its track still
    # moves at 4 px a frame and would cross on frame 28: the detector runs there instead.
    def scene(i: int) -> list[Box]:
        return [square(140, 20 + 4 * min(i, 26))]

    boxes: list[list[Box]] = []
    runs, _ = await schedule(tmp_path, sample_models, scene, 40, lines=LINE_160, published=boxes)
    assert (28, "line") in runs
    assert max(b[3] for frame_boxes in boxes for b in frame_boxes) < 160  # never published across


async def test_the_overload_share_defers_every_reason_but_the_start_and_the_max_gap(
    tmp_path: Path, sample_models: Path
) -> None:
    def scene(i: int) -> list[Box]:
        return [square(40, 40)] + ([square(200, 150)] if i >= 6 else [])

    runs, _ = await schedule(tmp_path, sample_models, scene, 20, min_gap=8)
    # The new square (6) and its second hit wait for the gap of 8 frames each.
    assert runs == [(0, "first"), (8, "motion"), (16, "new_object")]


def test_a_decision_lists_every_reason_that_held_the_first_being_its_reason() -> None:
    board = _SourceBoard(frame=MAX_GAP - 1, detected=0, untracked=1)
    decision = decide(MAX_GAP, board, motion_cells=5, places=Places())
    assert decision == Decision(True, "max_gap", ("max_gap", "new_object", "motion"))
    assert triggers(MAX_GAP - 1, board, motion_cells=0, places=Places()) == ["new_object"]


def test_a_prediction_that_moved_less_than_a_cell_is_seen_whatever_its_rounding() -> None:
    # The square moved 1 px right; its track's predicted box crept 1.2 px right and 1.8 px
    # down. Under a cell (2 px) either way, the fresh strips are rounding, not a stopped object.
    before, cell = small_gray(render([square(40, 40)]))
    after, _ = small_gray(render([square(41, 40)]))
    assert prediction_seen(after, before, cell, square(40, 40), (41.2, 41.8, 71.2, 71.8))
    # 12 px right is a real move: seen where the square went, not where it did not.
    moved, _ = small_gray(render([square(52, 40)]))
    assert prediction_seen(moved, before, cell, square(40, 40), square(52, 40))
    assert not prediction_seen(before, before, cell, square(40, 40), square(52, 40))


def test_unexplained_motion_counts_changed_cells_outside_the_explained_boxes() -> None:
    before, cell = small_gray(render([square(40, 40)]))
    after, _ = small_gray(render([square(46, 40), square(200, 150)]))
    assert cell == 2.0  # 320 px wide: every pixel, 2x2 cells averaged
    # Both squares changed; the first is explained by its track's boxes then and now.
    assert unexplained_motion(after, before, cell, []) > 0
    explained = unexplained_motion(after, before, cell, [square(40, 40), square(46, 40)])
    assert explained == 15 * 15  # the new 30 px square is 15x15 cells
    assert unexplained_motion(before, before, cell, []) == 0


@pytest.mark.parametrize(
    ("ages", "gaps"),
    [
        # Behind (over 0.5 s) for three periods: the gap grows one frame a period, then
        # fresh frames (under 0.1 s) bring it back one a period.
        ([0.9, 0.9, 0.9, 0.9, 0.05, 0.05, 0.05, 0.05], [None, 1, 2, 3, 2, 1, 0, None]),
        # Between the two bounds nothing changes.
        ([0.2, 0.9, 0.3, 0.3], [None, 1, None, None]),
    ],
)
def test_the_fair_share_raises_one_gap_for_every_camera_while_frames_arrive_late(
    ages: list[float], gaps: list[int | None]
) -> None:
    share = FairShare(behind=0.5, period=1.0)
    assert [share.observe(age, now=float(t)) for t, age in enumerate(ages)] == gaps


PIPELINE = """\
pipeline: auto
models: {models}
sources:
  - {{id: clip, url: "{clip}"}}
stages:
  - {{name: objects, type: infer, model: squares, interval: auto}}
  - {{name: track, type: track}}
runtime: {{max_in_flight: {in_flight}}}
"""


async def run_clip(
    tmp_path: Path, sample_models: Path, clip: Path, in_flight: int
) -> tuple[list[Frame], int]:
    """Every published frame of ``clip`` through squares (auto) -> track, and the detector's requests."""
    path = tmp_path / f"auto-{in_flight}.yaml"
    path.write_text(PIPELINE.format(models=sample_models, clip=clip, in_flight=in_flight))
    published: list[Frame] = []
    runtime = Runtime(load_config(path), nats_url=None, on_published=published.append)
    await runtime.start()
    await runtime.wait(120)
    assert runtime.models is not None
    requests = runtime.models.get("squares").stats.batched_requests
    counted = runtime.metrics.render().decode()
    await runtime.stop()
    runs = sum(
        float(line.rsplit(" ", 1)[1])
        for line in counted.splitlines()
        if line.startswith("vidpipe_detector_frames_total{") and 'decision="predicted"' not in line
    )
    assert runs == requests  # every frame the stage ran on is one request, nothing else
    return published, requests


async def test_a_pipeline_with_interval_auto_detects_the_same_frames_whatever_is_in_flight(
    tmp_path: Path, sample_models: Path
) -> None:
    clip = encode(tmp_path / "square.mp4", 90, lambda i: [bouncing(i)])
    one, requests_one = await run_clip(tmp_path, sample_models, clip, 1)
    four, requests_four = await run_clip(tmp_path, sample_models, clip, 4)
    assert [f.index for f in one] == [f.index for f in four] == list(range(90))
    detected = [[not o.predicted for o in f.objects] for f in one]
    assert detected == [[not o.predicted for o in f.objects] for f in four]
    assert requests_one == requests_four == sum(1 for d in detected if d == [True])
    assert requests_one <= 90 // 3
    # One square, one track, on every frame; predicted boxes stay on the true square
    # (least just after it turns, while the track's velocity turns with it): within the
    # motion margin, well above the fifth of IoU at which the tracker still matches.
    assert all([o.track_id for o in f.objects] == [1] for f in one)
    for f in one:
        truth = bouncing(f.index)
        assert _iou(f.objects[0].bbox, truth) >= 1 / 3, (f.index, f.objects[0].bbox, truth)


def bouncing(i: int) -> Box:
    """A 36 px square crossing the floor at 5 px a frame, turning back at the edges (every 56 frames)."""
    span = W - 36 - 20
    t = (5 * i) % (2 * span)
    x = 10 + (t if t < span else 2 * span - t)
    return square(x, 180, 36)


def encode(path: Path, frames: int, scene: Scene, fps: int = 30) -> Path:
    """The rendered scene as an H.264 file."""
    with av.open(str(path), mode="w") as container:
        stream = container.add_stream("libx264", rate=fps)
        stream.width, stream.height, stream.pix_fmt = W, H, "yuv420p"
        stream.options = {"crf": "18", "preset": "veryfast"}
        for i in range(frames):
            frame = av.VideoFrame.from_ndarray(render(scene(i)), format="rgb24")
            frame.pts = i
            container.mux(stream.encode(frame))
        container.mux(stream.encode())
    return path


def _iou(a: Box, b: Box) -> float:
    w = max(0.0, min(a[2], b[2]) - max(a[0], b[0]))
    h = max(0.0, min(a[3], b[3]) - max(a[1], b[1]))
    inter = w * h
    return inter / ((a[2] - a[0]) * (a[3] - a[1]) + (b[2] - b[0]) * (b[3] - b[1]) - inter)
