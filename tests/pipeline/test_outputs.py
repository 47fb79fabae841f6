"""Outputs: the annotated recording and event clips, from real pipelines with real codecs."""

from __future__ import annotations

import collections
import os
import time
from fractions import Fraction
from pathlib import Path

import av
import cv2
import numpy as np
import pytest

from pipeline.config import load_config
from pipeline.frames import DetectedObject
from pipeline.nats_server import EmbeddedNats
from pipeline.outputs.clips import clip_event, prune_clips
from pipeline.runtime import Runtime
from pipeline.sources.pattern import pattern_background, pattern_square_box
from tests.conftest import Collector

W, H, FPS = 320, 240, 15


def write_pattern_clip(path: Path, frames: int, gop: int = 15, square_from: int = 0) -> Path:
    """The test pattern as H.264: the square in frame i at pattern_square_box(i) (from ``square_from``)."""
    base = pattern_background(W, H)
    with av.open(str(path), "w") as out:
        stream = out.add_stream("libx264", rate=FPS, options={"crf": "18", "g": str(gop), "bf": "0"})
        stream.width, stream.height, stream.pix_fmt = W, H, "yuv420p"
        for i in range(frames):
            image = base.copy()
            if i >= square_from:
                x1, y1, x2, y2 = pattern_square_box(i, W, H)
                image[y1:y2, x1:x2] = 255
            frame = av.VideoFrame.from_ndarray(image, format="rgb24")
            frame.pts = i
            frame.time_base = Fraction(1, FPS)
            for packet in stream.encode(frame):
                out.mux(packet)
        for packet in stream.encode(None):
            out.mux(packet)
    return path


def _runs(indices: np.ndarray) -> list[tuple[int, int]]:
    """Runs of consecutive indices as (first, last)."""
    runs: list[tuple[int, int]] = []
    for i in indices.tolist():
        if runs and i == runs[-1][1] + 1:
            runs[-1] = (runs[-1][0], i)
        else:
            runs.append((i, i))
    return runs


def drawn_box(image_bgr: np.ndarray, truth: tuple[int, int, int, int]) -> tuple[float, float, float, float]:
    """The coloured rectangle drawn around ``truth``: the centres of its four edge lines.

    Measured through the box's middle row (left and right edges) and middle column
    (top and bottom edges). An edge is a thin run of coloured pixels; the caption, a
    filled block above or below the box, is a thick one.
    """
    hsv = cv2.cvtColor(image_bgr, cv2.COLOR_BGR2HSV)
    mask = (hsv[:, :, 1] > 90) & (hsv[:, :, 2] > 90)
    x1, y1, x2, y2 = truth
    ym, xm = (y1 + y2) // 2, (x1 + x2) // 2
    across = [r for r in _runs(np.flatnonzero(mask[ym])) if r[1] - r[0] < 8]
    down = [r for r in _runs(np.flatnonzero(mask[:, xm])) if r[1] - r[0] < 8]
    # The edges are the thin runs nearest the box's (uncoloured) inside on each side.
    left, right = [r for r in across if r[1] < xm], [r for r in across if r[0] > xm]
    top, bottom = [r for r in down if r[1] < ym], [r for r in down if r[0] > ym]
    assert left and right and top and bottom, f"no box drawn around {truth}: {across} {down}"
    (l0, l1), (r0, r1), (t0, t1), (b0, b1) = left[-1], right[0], top[-1], bottom[0]
    return (l0 + l1) / 2, (t0 + t1) / 2, (r0 + r1) / 2, (b0 + b1) / 2


async def test_annotated_file_has_the_box_on_every_frame_and_the_input_timing(
    tmp_path: Path, nats_server: EmbeddedNats, sample_models: Path
) -> None:
    frames = 45
    clip = write_pattern_clip(tmp_path / "in.mp4", frames)
    config = tmp_path / "p.yaml"
    config.write_text(
        f"pipeline: rec\nmodels: {sample_models}\n"
        f"sources: [{{url: {clip}, id: cam}}]\n"
        "stages: [{name: objects, type: infer, model: squares}]\n"
        'outputs: [{type: file, path: "out/{source}.mp4", annotate: true, crf: 18}]\n'
    )
    runtime = Runtime(load_config(config), nats_url=nats_server.url)
    await runtime.start()
    await runtime.wait(60)
    await runtime.stop()

    with av.open(str(tmp_path / "out" / "cam.mp4")) as out:
        stream = out.streams.video[0]
        images = [f.to_ndarray(format="bgr24") for f in out.decode(stream)]
        duration = float(stream.duration * stream.time_base)
    assert len(images) == frames
    assert duration == pytest.approx(frames / FPS, abs=1e-3)
    for i, image in enumerate(images):
        truth = pattern_square_box(i, W, H)
        box = drawn_box(image, truth)
        # cv2 draws a 2 px line centred on the box edge; the box ends are exclusive.
        expected = (truth[0], truth[1], truth[2] - 1, truth[3] - 1)
        assert all(abs(a - b) <= 3 for a, b in zip(box, expected, strict=True)), (i, box, expected)


async def test_an_event_makes_a_clip_with_pre_and_post_roll_and_announces_it(
    tmp_path: Path, nats_server: EmbeddedNats, sample_models: Path, collector: Collector
) -> None:
    # The square appears at 4.0 s: its track starts there. GOP: 1 s.
    event_at, pre_s, post_s, gop_s = 4.0, 2.0, 3.0, 1.0
    clip = write_pattern_clip(tmp_path / "in.mp4", frames=150, gop=FPS, square_from=int(event_at * FPS))
    config = tmp_path / "p.yaml"
    config.write_text(
        f"pipeline: clipper\nmodels: {sample_models}\nnats: {{url: '{nats_server.url}'}}\n"
        f"sources: [{{url: {clip}, id: cam}}]\n"
        "stages: [{name: objects, type: infer, model: squares}, {name: track, type: track}]\n"
        f"outputs: [{{type: clips, dir: clips, pre_s: {pre_s}, post_s: {post_s}, on: [track_start]}}]\n"
    )
    await collector.start(nats_server.url, "vidpipe.*.*.clips")
    runtime = Runtime(load_config(config), nats_url=nats_server.url)
    await runtime.start()
    await runtime.wait(60)
    await runtime.stop()
    await collector.wait_for(1, timeout=10)

    assert collector.subjects == ["vidpipe.clipper.cam.clips"]
    message = collector.messages[0]
    assert message["schema"] == "vidpipe.clips/v1"
    assert message["event"]["type"] == "track_start"
    assert message["event"]["pts"] == pytest.approx(event_at, abs=1e-3)
    assert message["start"] <= event_at <= message["end"]
    path = Path(message["path"])
    assert path.parent == tmp_path / "clips" and path.is_file()
    with av.open(str(path)) as f:
        stream = f.streams.video[0]
        images = [frame.to_ndarray(format="rgb24") for frame in f.decode(stream)]
        duration = float(f.duration / 1e6)
    # pre_s + post_s, plus at most one GOP before (the clip starts at a keyframe).
    assert pre_s + post_s - 0.1 <= duration <= pre_s + post_s + gop_s + 0.1
    assert len(images) == pytest.approx(duration * FPS, abs=1)
    # The event is inside: the first frame with the square is event_at - start into the clip.
    first = next(i for i, image in enumerate(images) if (image.min(axis=2) > 200).sum() > 100)
    assert first == round((event_at - message["start"]) * FPS)


def obj(track_id: int | None, label: str = "car") -> DetectedObject:
    return DetectedObject(
        id=1, label=label, class_id=0, score=0.9, bbox=(0, 0, 1, 1), stage="d", track_id=track_id
    )


def test_clip_event_is_a_new_track_or_a_listed_label() -> None:
    known: collections.OrderedDict[int, None] = collections.OrderedDict()
    assert clip_event([obj(1)], known, ["track_start"]) == ("track_start", obj(1))
    assert clip_event([obj(1)], known, ["track_start"]) is None  # known now
    assert clip_event([obj(2, "dog")], known, ["track_start"], labels=["car"]) is None
    assert clip_event([obj(3, "car")], known, ["track_start"], labels=["car"]) == ("track_start", obj(3))
    assert clip_event([obj(None, "car")], known, ["detection"], labels=["car"]) == ("detection", obj(None))
    assert clip_event([obj(None, "dog")], known, ["detection"], labels=["car"]) is None


def test_clips_folder_keeps_to_its_size_and_age(tmp_path: Path) -> None:
    now = time.time()
    names = [f"cam-20261130T10000{i}-{i}-track_start.mp4" for i in range(4)]
    for i, name in enumerate(names):
        (tmp_path / name).write_bytes(b"x" * 1000)
        os.utime(tmp_path / name, (now - 100 + i, now - 100 + i))
    (tmp_path / "notes.mp4").write_bytes(b"x" * 5000)  # not a clip: never touched
    os.utime(tmp_path / names[0], (now - 7200, now - 7200))
    deleted = prune_clips(tmp_path, max_bytes=2000, max_age_s=3600, now=now)
    assert [p.name for p in deleted] == names[:2]  # the old one, then the oldest over size
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted([*names[2:], "notes.mp4"])
