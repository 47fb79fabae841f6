"""The tracking maths alone: Kalman filter, Hungarian matching, ByteTrack and IoU trackers."""

from __future__ import annotations

import numpy as np
import pytest

from pipeline.tracking.assignment import iou_matrix, match
from pipeline.tracking.bytetrack import ByteTracker, ByteTrackParams
from pipeline.tracking.iou import IouTracker
from pipeline.tracking.kalman import KalmanBox


def square(x: float, y: float, side: float = 30) -> list[float]:
    return [x, y, x + side, y + side]


def test_kalman_filter_learns_a_constant_velocity() -> None:
    kf = KalmanBox.start(np.array(square(0, 50)))
    for f in range(1, 30):
        kf.predict()
        kf.update(np.array(square(5 * f, 50)))
    kf.predict()
    assert np.allclose(kf.box(), square(150, 50), atol=0.5)
    kf.predict()  # no measurement: it keeps going
    assert np.allclose(kf.box(), square(155, 50), atol=0.5)


def test_hungarian_matching_maximises_the_total_overlap_where_greedy_would_not() -> None:
    iou = np.array([[0.9, 0.8], [0.85, 0.1]])
    pairs, rows, cols = match(iou, 0.2)
    # Greedy takes (0, 0) first and leaves row 1 with 0.1, below the threshold.
    assert sorted(pairs) == [(0, 1), (1, 0)] and rows == [] and cols == []
    pairs, rows, cols = match(np.array([[0.1]]), 0.2)
    assert (pairs, rows, cols) == ([], [0], [0])


def test_iou_matrix() -> None:
    iou = iou_matrix(np.array([square(0, 0, 10)]), np.array([square(5, 0, 10), square(20, 0, 10)]))
    assert iou.tolist() == [[pytest.approx(50 / 150), 0.0]]


def crossing(tracker: ByteTracker | IouTracker, speed: int) -> tuple[list[int | None], list[int | None]]:
    """Two squares on the same row moving towards each other; they overlap fully mid-way."""
    a, b = [], []
    for f in range(200 // speed + 8):
        boxes = np.array([square(10 + speed * f, 50), square(210 - speed * f, 52)])
        ids = tracker.update(boxes, np.array([0.9, 0.9]), ["sq", "sq"])
        a.append(ids[0])
        b.append(ids[1])
    return a, b


@pytest.mark.parametrize("speed", [5, 8, 12, 15])
def test_two_squares_crossing_keep_their_ids(speed: int) -> None:
    a, b = crossing(ByteTracker(), speed)
    assert set(a) == {1} and set(b) == {2}


def test_the_greedy_iou_tracker_swaps_ids_where_fast_squares_cross() -> None:
    a, _ = crossing(IouTracker(min_iou=0.2), 12)
    assert set(a) == {1, 2}  # the reason bytetrack is the default


@pytest.mark.parametrize("missed", [1, 5, 30])
def test_a_track_missed_for_k_frames_keeps_its_id(missed: int) -> None:
    tracker = ByteTracker(ByteTrackParams(max_age=30))
    ids = []
    for f in range(10 + missed + 10):
        seen = not (10 <= f < 10 + missed)
        boxes = np.array([square(4 * f, 50)]) if seen else np.zeros((0, 4))
        ids.append(tracker.update(boxes, np.array([0.9] * len(boxes)), ["sq"] * len(boxes)))
    assert [i for i in ids if i] == [[1]] * 20
    assert ids[10 : 10 + missed] == [[]] * missed


def test_a_track_lost_for_longer_than_max_age_comes_back_with_a_new_id() -> None:
    tracker = ByteTracker(ByteTrackParams(max_age=3, min_hits=1))
    one = np.array([square(0, 0)])
    assert tracker.update(one, np.array([0.9]), ["sq"]) == [1]
    for _ in range(4):
        tracker.update(np.zeros((0, 4)), np.zeros(0), [])
    assert tracker.update(one, np.array([0.9]), ["sq"]) == [2]


def test_low_score_detections_continue_followed_tracks_but_start_none() -> None:
    tracker = ByteTracker()
    assert tracker.update(np.array([square(0, 0)]), np.array([0.9]), ["sq"]) == [1]
    # An occluded object's score drops: the second pass keeps its id.
    assert tracker.update(np.array([square(2, 0)]), np.array([0.2]), ["sq"]) == [1]
    # A low-score detection elsewhere starts nothing.
    assert tracker.update(np.array([square(4, 0), square(200, 200)]), np.array([0.9, 0.2]), ["sq", "sq"]) == [
        1,
        None,
    ]
    assert len(tracker.tracks) == 1


def test_a_new_track_gets_its_id_on_its_second_hit_and_a_one_frame_blip_uses_none() -> None:
    tracker = ByteTracker(ByteTrackParams(min_hits=2))
    assert tracker.update(np.array([square(0, 0)]), np.array([0.9]), ["sq"]) == [1]  # first frame: at once
    # A false detection for one frame: tentative, then dropped; it takes no id.
    assert tracker.update(np.array([square(0, 0), square(300, 0)]), np.array([0.9, 0.9]), ["sq", "sq"]) == [
        1,
        None,
    ]
    assert tracker.update(np.array([square(0, 0)]), np.array([0.9]), ["sq"]) == [1]
    # A real newcomer: no id on its first frame, the next id on its second.
    assert tracker.update(np.array([square(0, 0), square(100, 0)]), np.array([0.9, 0.9]), ["sq", "sq"]) == [
        1,
        None,
    ]
    assert tracker.update(np.array([square(0, 0), square(102, 0)]), np.array([0.9, 0.9]), ["sq", "sq"]) == [
        1,
        2,
    ]


def test_matching_per_label_or_across_labels() -> None:
    per_label = ByteTracker(ByteTrackParams(min_hits=1))
    across = ByteTracker(ByteTrackParams(min_hits=1, per_label=False))
    for tracker in (per_label, across):
        assert tracker.update(np.array([square(0, 0)]), np.array([0.9]), ["car"]) == [1]
    assert per_label.update(np.array([square(1, 0)]), np.array([0.9]), ["truck"]) == [2]
    assert across.update(np.array([square(1, 0)]), np.array([0.9]), ["truck"]) == [1]


def test_predict_follows_the_motion_and_returns_only_followed_tracks() -> None:
    tracker = ByteTracker()
    for f in range(10):
        tracker.update(np.array([square(10 * f, 0)]), np.array([0.8]), ["sq"])
    (first,) = tracker.predict()
    (second,) = tracker.predict()
    assert (first.track_id, first.label, first.score) == (1, "sq", 0.8)
    assert first.box == pytest.approx(square(100, 0), abs=1.5)
    assert second.box == pytest.approx(square(110, 0), abs=2.0)
    # Back to detections: the track continues where the prediction said.
    assert tracker.update(np.array([square(120, 0)]), np.array([0.8]), ["sq"]) == [1]


def one(tracker: ByteTracker, box: list[float]) -> list[int | None]:
    return tracker.update(np.array([box]), np.array([0.9]), ["sq"])


def test_after_skipped_frames_a_track_takes_the_velocity_between_its_last_two_detections() -> None:
    # Settled at 4 px a frame, then the detector skips 3 frames while the square speeds up
    # to 10 px a frame: one detection sets the velocity to the displacement over the gap
    # (the filter's own gain would take it only part of the way), so the predictions keep
    # up with the square (a few px behind: the filter's position is where it blends the
    # measurement with its prediction).
    tracker = ByteTracker()
    for f in range(10):
        one(tracker, square(4 * f, 50))
    for _ in range(3):
        tracker.predict()
    assert one(tracker, square(36 + 40, 50)) == [1]
    (track,) = tracker.tracks
    assert track.kf.mean[4] == pytest.approx(10.0)
    (first,) = tracker.predict()
    (second,) = tracker.predict()
    assert first.box == pytest.approx(square(86, 50), abs=3)
    assert second.box[0] - first.box[0] == pytest.approx(10.0)


def test_after_skipped_frames_a_track_takes_the_aspect_ratio_of_its_detection() -> None:
    # First seen half in view (15 px wide), then whole (30 px) after two skipped frames:
    # the predicted box is the whole square, not a sliver the filter widens over many frames.
    tracker = ByteTracker()
    assert one(tracker, [0, 50, 15, 80]) == [1]
    tracker.predict()
    assert one(tracker, square(10, 50)) == [1]
    (predicted,) = tracker.predict()
    assert predicted.box[2] - predicted.box[0] == pytest.approx(30, abs=0.5)


@pytest.mark.parametrize("skipped", [True, False])
def test_a_prediction_a_box_width_off_matches_after_skipped_frames_only(skipped: bool) -> None:
    # A still square's track; the square reappears 27 px (0.9 of its width) away: IoU 0.05.
    # After frames the detector skipped the boxes are matched buffered (grown by 0.3 each
    # side: IoU 0.28) and the id holds; after frames it ran and missed, the match is plain
    # ByteTrack's, as on every frame: a new track.
    tracker = ByteTracker(ByteTrackParams(min_hits=1))
    for _ in range(3):
        one(tracker, square(100, 50))
    for _ in range(2):
        if skipped:
            tracker.predict()
        else:
            tracker.update(np.zeros((0, 4)), np.zeros(0), [])
    assert one(tracker, square(127, 50)) == ([1] if skipped else [2])
