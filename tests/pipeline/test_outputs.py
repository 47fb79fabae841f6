"""Outputs: the annotated recording and event clips, from real pipelines with real codecs."""

from __future__ import annotations

import asyncio
import collections
import dataclasses
import errno
import itertools
import json
import math
import os
import re
import signal
import subprocess
import sys
import time
from collections.abc import Collection
from concurrent.futures import ThreadPoolExecutor
from fractions import Fraction
from pathlib import Path
from typing import Any

import av
import cv2
import jsonschema
import numpy as np
import pytest

from pipeline.annotate import LINE_COLOUR
from pipeline.config import ClipsOutputConfig, load_config
from pipeline.events import Event
from pipeline.frames import DetectedObject, Frame
from pipeline.nats_server import EmbeddedNats
from pipeline.outputs import clips
from pipeline.outputs.clips import (
    HEADROOM_S,
    MAX_GOP_S,
    PRUNE_GRACE_S,
    ClipInfo,
    ClipRecorder,
    clip_event,
    prune_clips,
)
from pipeline.outputs.manager import clip_message, clips_schema
from pipeline.runtime import Runtime
from pipeline.sources.pattern import pattern_background, pattern_square_box
from tests.conftest import ROOT, Collector
from tests.pipeline.stack import until
from tests.support.rtsp_server import RtspTestServer, free_port, gstreamer_available

W, H, FPS = 320, 240, 15


def write_pattern_clip(path: Path, frames: int, gop: int = 15, square_from: int = 0, bframes: int = 0,
                       pyramid: bool = False) -> Path:  # fmt: skip
    """The test pattern as H.264: the square in frame i at pattern_square_box(i) (from ``square_from``).

    ``bframes``: runs of that many B-frames, always (no adaptive placement, no scene cuts),
    as B-pyramids when ``pyramid``.
    """
    base = pattern_background(W, H)
    options = {"crf": "18", "g": str(gop), "bf": str(bframes)}
    if bframes:
        options["x264-params"] = f"b-adapt=0:b-pyramid={'normal' if pyramid else 'none'}:scenecut=0"
    with av.open(str(path), "w") as out:
        stream = out.add_stream("libx264", rate=FPS, options=options)
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
    jsonschema.validate(message, clips_schema())
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


async def test_two_clips_outputs_in_one_folder_never_overwrite_an_announced_clip(
    tmp_path: Path, nats_server: EmbeddedNats, sample_models: Path, collector: Collector
) -> None:
    clip = write_pattern_clip(tmp_path / "in.mp4", frames=90, gop=FPS, square_from=FPS)
    config = tmp_path / "p.yaml"
    config.write_text(
        f"pipeline: clipper\nmodels: {sample_models}\nnats: {{url: '{nats_server.url}'}}\n"
        f"sources: [{{url: {clip}, id: cam}}]\n"
        "stages: [{name: objects, type: infer, model: squares}, {name: track, type: track}]\n"
        "outputs:\n"
        "  - {type: clips, dir: clips, pre_s: 0.5, post_s: 1.0, on: [track_start]}\n"
        "  - {type: clips, dir: clips, pre_s: 0.5, post_s: 1.0, on: [track_start]}\n"
    )
    await collector.start(nats_server.url, "vidpipe.*.*.clips")
    runtime = Runtime(load_config(config), nats_url=nats_server.url)
    await runtime.start()
    await runtime.wait(60)
    await runtime.stop()
    await collector.wait_for(2, timeout=10)
    # Same source and event, written a moment apart: two files, each the one announced
    # (within the same second the second one is named .1).
    paths = sorted(Path(m["path"]) for m in collector.messages)
    assert len(set(paths)) == 2, paths
    if paths[0].stem[: -len("-track_start")] == paths[1].stem[: -len("-track_start.1")]:
        assert paths[1] == paths[0].with_name(paths[0].stem + ".1.mp4")
    for message in collector.messages:
        path = Path(message["path"])
        assert path.stat().st_size == message["bytes"]
        with av.open(str(path)) as f:
            shown = float(f.duration / 1e6)
        assert shown == pytest.approx(message["end"] - message["start"] + 1 / FPS, abs=0.05)


def obj(track_id: int | None, label: str = "car") -> DetectedObject:
    return DetectedObject(
        id=1, label=label, class_id=0, score=0.9, bbox=(0, 0, 1, 1), stage="d", track_id=track_id
    )


def test_clip_event_takes_the_frames_events_first_whatever_their_kind() -> None:
    known: collections.OrderedDict[int, None] = collections.OrderedDict()
    cross = Event("line_cross", 21, 1.4, 0.0, 1, "car", (0, 0, 1, 1), line="door", direction="out")
    enter = Event("zone_enter", 21, 1.4, 0.0, 2, "dog", (0, 0, 1, 1), zone="dock")
    assert clip_event([obj(1)], known, ["line_cross"], events=[enter, cross]) == ("line_cross", cross)
    assert clip_event([obj(1)], known, ["zone_enter"], events=[enter, cross]) == ("zone_enter", enter)
    assert clip_event([obj(1)], known, ["zone_enter"], labels=["car"], events=[enter, cross]) is None
    assert clip_event([obj(3)], known, ["zone_exit", "track_start"], events=[enter]) == (
        "track_start",
        obj(3),
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


# The pattern's square (40 px, 7 px a frame along x) has its bottom centre at x = 7i + 20 on the
# way right: it crosses a line at x = 160 (3 px dead band) at frame 21, back at 61, again at 101
# and 141. Walking the line from top to bottom its right is the picture's left: the first
# crossing (left to right on the picture) is "out".
CROSSINGS = [(21, "out"), (61, "in"), (101, "out"), (141, "in")]
LINE_PIPELINE = """\
pipeline: {name}
models: {models}
sources: [{{url: {clip}, id: cam{source_extra}}}]
stages:
  - {{name: objects, type: infer, model: squares}}
  - {{name: track, type: track}}
  - {{name: gate, type: zones, lines: [{{name: door, points: [[160, 0], [160, 240]]}}]}}
outputs:
  - {{type: clips, dir: clips, pre_s: {pre_s}, post_s: {post_s}, on: [line_cross]}}
  - {{type: file, path: "out/{{source}}.mp4", crf: 18}}
"""


def line_config(tmp_path: Path, clip: Path, models: Path, *, name: str = "lines", pre_s: float = 1.0,
                post_s: float = 2.0, source_extra: str = "") -> Path:  # fmt: skip
    path = tmp_path / "p.yaml"
    path.write_text(LINE_PIPELINE.format(name=name, models=models, clip=clip, pre_s=pre_s, post_s=post_s,
                                         source_extra=source_extra))  # fmt: skip
    return path


def ffprobe(path: Path) -> dict[str, Any]:
    """The video stream and duration of ``path`` as ffprobe reads every frame; fails on any error."""
    done = subprocess.run(
        ["ffprobe", "-v", "error", "-count_frames", "-show_entries",
         "stream=codec_type,codec_name,width,height,nb_read_frames:format=duration", "-of", "json", str(path)],
        capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert done.returncode == 0 and done.stderr == "", (path, done.stderr)
    data = json.loads(done.stdout)
    (stream,) = data["streams"]
    return {**stream, "frames": int(stream["nb_read_frames"]), "duration": float(data["format"]["duration"])}


def line_mask(image_bgr: np.ndarray) -> np.ndarray:
    """Where the image is the line colour (within JPEG / H.264 error)."""
    return np.abs(image_bgr.astype(np.int16) - np.array(LINE_COLOUR, dtype=np.int16)).max(axis=2) < 60


def line_pixels(image_bgr: np.ndarray, x: int, ys: range) -> float:
    """The share of points (x, y) drawn in the line colour (within JPEG / H.264 error)."""
    colour = np.array(LINE_COLOUR, dtype=np.int16)
    hits = [
        int(np.abs(image_bgr[y, x - 1 : x + 2].astype(np.int16) - colour).max(axis=1).min()) < 60 for y in ys
    ]
    return sum(hits) / len(hits)


async def test_each_line_crossing_makes_a_clip_announced_with_its_line_and_direction(
    tmp_path: Path, nats_server: EmbeddedNats, sample_models: Path, collector: Collector
) -> None:
    pre_s, post_s = 1.0, 2.0
    clip = write_pattern_clip(tmp_path / "in.mp4", frames=150, gop=FPS)
    config = line_config(tmp_path, clip, sample_models, pre_s=pre_s, post_s=post_s)
    await collector.start(nats_server.url, "vidpipe.lines.cam.clips")
    counts: dict[int, tuple[int, int]] = {}

    def seen(frame: Frame) -> None:
        (line,) = frame.lines
        counts[frame.index] = (line.crossed_in, line.crossed_out)

    runtime = Runtime(load_config(config), nats_url=nats_server.url, on_published=seen)
    await runtime.start()
    await runtime.wait(60)
    await runtime.stop()
    await collector.wait_for(len(CROSSINGS), timeout=10)

    messages = sorted(collector.messages, key=lambda m: m["event"]["frame"])
    assert [(m["event"]["frame"], m["event"]["direction"]) for m in messages] == CROSSINGS
    for message, (frame, _) in zip(messages, CROSSINGS, strict=True):
        assert message["schema"] == "vidpipe.clips/v1"
        jsonschema.validate(message, clips_schema())
        assert message["event"]["type"] == "line_cross" and message["event"]["line"] == "door"
        assert message["event"]["label"] == "square" and message["event"]["track_id"] == 1
        assert message["event"]["pts"] == pytest.approx(frame / FPS, abs=1e-3)
        # The clip starts at the keyframe (one a second) at or before event - pre_s.
        assert message["start"] == pytest.approx(int(frame / FPS - pre_s), abs=1e-3)
        end = min(frame / FPS + post_s, 149 / FPS)  # the last one ends with the file
        assert message["end"] == pytest.approx(end, abs=1.5 / FPS)
        probe = ffprobe(Path(message["path"]))
        assert (probe["codec_type"], probe["codec_name"], probe["width"], probe["height"]) == (
            "video", "h264", W, H,
        )  # fmt: skip
        assert probe["duration"] == pytest.approx(message["duration"] + 1 / FPS, abs=1e-3)
        assert probe["frames"] == round(probe["duration"] * FPS)
        assert message["bytes"] == Path(message["path"]).stat().st_size
    # Each frame carries the line's crossings so far, and the recording shows the line.
    assert [counts[i] for i in (20, 21, 60, 61, 100, 101, 149)] == [
        (0, 0), (0, 1), (0, 1), (1, 1), (1, 1), (1, 2), (2, 2),
    ]  # fmt: skip
    with av.open(str(tmp_path / "out" / "cam.mp4")) as f:
        image = next(fr for i, fr in enumerate(f.decode(video=0)) if i == 40).to_ndarray(format="bgr24")
    assert line_pixels(image, 160, range(0, 100)) > 0.9  # the square is lower down in frame 40
    # The arrow points the way "in" goes: to the picture's left of a top-to-bottom line.
    mask = line_mask(image)
    assert mask[115:126, 142:156].sum() >= 20 and mask[115:126, 165:178].sum() == 0
    assert line_pixels(image, 100, range(0, 100)) == 0


def test_the_clip_just_written_is_never_pruned_even_over_the_budget(tmp_path: Path) -> None:
    now = time.time()
    older = tmp_path / "cam-20261130T100000-0-track_start.mp4"
    newest = tmp_path / "cam-20261130T100001-1-track_start.mp4"
    older.write_bytes(b"x" * 1000)
    newest.write_bytes(b"x" * 5000)  # over the budget on its own
    os.utime(older, (now - PRUNE_GRACE_S - 10, now - PRUNE_GRACE_S - 10))
    deleted = prune_clips(tmp_path, max_bytes=2000, max_age_s=3600, now=now, keep=newest)
    assert deleted == [older] and [p.name for p in tmp_path.iterdir()] == [newest.name]


def events_on(recorder: ClipRecorder, video: Path, seconds: Collection[float]) -> None:
    """Every packet of ``video`` through ``recorder`` (a file decodes ahead), then a detection
    at each of ``seconds``: a clip each when they are further apart than its ``post_s``."""
    with av.open(str(video)) as f:
        stream = f.streams.video[0]
        for packet in f.demux(stream):
            recorder.on_packet(packet, stream)
    for at in seconds:
        image = np.zeros((H, W, 3), np.uint8)
        recorder.on_frame(Frame(recorder.source, round(at * FPS), at, 0.0, image, objects=[obj(None)]))


def test_retention_never_deletes_a_clip_another_recorder_of_the_folder_just_wrote(tmp_path: Path) -> None:
    video = write_pattern_clip(tmp_path / "in.mp4", frames=60, gop=FPS)
    folder = tmp_path / "clips"
    roomy = ClipsOutputConfig(type="clips", dir="clips", pre_s=0.5, post_s=0.5, on=["detection"])
    tiny = dataclasses.replace(roomy, max_size_mb=0.001)  # smaller than any clip
    written: list[tuple[str, Path, bool]] = []

    def announce(info: ClipInfo) -> None:
        # What a subscriber checks when the announcement arrives: every clip so far is there.
        written.append(
            (info.source, info.path, all(p.exists() for _, p, _ in written) and info.path.exists())
        )

    with ThreadPoolExecutor(1) as writer:
        door = ClipRecorder(roomy, "door", folder, writer, announce)
        yard = ClipRecorder(tiny, "yard", folder, writer, announce)
        events_on(door, video, [1.0])
        writer.submit(lambda: None).result()  # door's clip is written and announced
        events_on(yard, video, [1.0])
        writer.submit(lambda: None).result()
    assert [(source, there) for source, _, there in written] == [("door", True), ("yard", True)]
    assert all(path.exists() for _, path, _ in written)  # door's clip outlived yard's retention
    # Once past the grace, retention does delete it: the folder keeps to yard's budget.
    door_clip = written[0][1]
    old = time.time() - PRUNE_GRACE_S - 1
    os.utime(door_clip, (old, old))
    with ThreadPoolExecutor(1) as writer:
        yard = ClipRecorder(tiny, "yard", folder, writer, announce)
        events_on(yard, video, [2.5])
    assert not door_clip.exists() and written[2][1].exists()


def test_clips_on_a_full_disk_are_logged_once_a_minute_per_source_with_the_reason(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    video = write_pattern_clip(tmp_path / "in.mp4", frames=60, gop=FPS)
    folder = tmp_path / "clips"

    def disk_full(clip: Any, target: Any, format: str | None = None) -> int:
        # As PyAV raises it when FFmpeg's write finds no space (a tmpfs filled to the brim).
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), target)

    monkeypatch.setattr(clips, "_mux", disk_full)
    config = ClipsOutputConfig(type="clips", dir="clips", pre_s=0.5, post_s=0.5, on=["detection"])
    recorders = []
    with ThreadPoolExecutor(1) as writer:
        for source in ("door", "yard"):
            recorder = ClipRecorder(config, source, folder, writer, lambda info: None)
            events_on(recorder, video, [0.5, 1.5, 2.5])
            recorders.append(recorder)
    assert [r.failed for r in recorders] == [3, 3] and list(folder.iterdir()) == []
    lines = [r for r in caplog.records if "not written" in r.getMessage()]
    # One line per source for its three failures, with the reason and what to do.
    assert [(r.levelname, getattr(r, "source", None)) for r in lines] == [
        ("ERROR", "door"),
        ("ERROR", "yard"),
    ]
    for record, source in zip(lines, ("door", "yard"), strict=True):
        message = record.getMessage()
        assert message.startswith(f"source {source}: clips not written to {folder}: No space left on device")
        assert "free space there, or lower max_size_mb" in message and "FFmpeg" not in message


def vidpipe_run(config: Path, *args: str) -> subprocess.Popen[str]:
    """``vidpipe run CONFIG ARGS`` as a user runs it, output merged into one pipe."""
    return subprocess.Popen(
        [sys.executable, "-m", "pipeline.cli", "run", str(config), *args],
        cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
    )  # fmt: skip


async def finish(proc: subprocess.Popen[str], timeout: float = 120) -> str:
    out, _ = await asyncio.to_thread(proc.communicate, timeout=timeout)
    return out


@pytest.mark.parametrize("stop", ["sigint", "end_of_file", "max_frames"])
async def test_a_source_that_stops_while_a_clip_records_leaves_every_file_playable(
    stop: str, tmp_path: Path, nats_server: EmbeddedNats, sample_models: Path, collector: Collector
) -> None:
    # The clip opens at the first crossing (frame 21) and would record 30 s more: every stop
    # comes while it records.
    frames = {"sigint": 300, "end_of_file": 45, "max_frames": 300}[stop]
    clip = write_pattern_clip(tmp_path / "in.mp4", frames=frames, gop=FPS)
    realtime = ", realtime: true" if stop == "sigint" else ""
    config = line_config(tmp_path, clip, sample_models, post_s=30.0, source_extra=realtime)
    await collector.start(nats_server.url, "vidpipe.lines.cam.*")
    args = ["--nats", nats_server.url] + (["--max-frames", "40"] if stop == "max_frames" else [])
    proc = vidpipe_run(config, *args)
    try:
        if stop == "sigint":
            deadline = time.monotonic() + 60
            while not any(m.get("type") == "line_cross" for m in collector.messages):
                assert time.monotonic() < deadline and proc.poll() is None, "no crossing"
                await asyncio.sleep(0.05)
            proc.send_signal(signal.SIGINT)
        out = await finish(proc)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 0, out
    done = [line for line in out.splitlines() if "done: " in line]
    assert len(done) == 1, out
    published = int(done[0].split("done: ")[1].split()[0])
    if stop == "max_frames":
        assert published == 40
    elif stop == "end_of_file":
        assert published == 45
    else:
        assert 21 < published < 300
    await collector.wait_for(1, timeout=10)
    (announced,) = [m for m in collector.messages if m.get("schema") == "vidpipe.clips/v1"]
    assert announced["event"]["frame"] == 21 and announced["start"] == 0.0
    (recording,) = (tmp_path / "out").iterdir()
    (written,) = (tmp_path / "clips").iterdir()
    assert Path(announced["path"]) == written
    assert ffprobe(recording)["frames"] == published
    probe = ffprobe(written)
    assert probe["frames"] >= 22 and probe["duration"] == pytest.approx(
        announced["duration"] + 1 / FPS, abs=1e-3
    )


async def test_a_killed_run_leaves_a_recording_that_plays_to_the_kill_and_the_next_run_keeps_it(
    tmp_path: Path, nats_server: EmbeddedNats, sample_models: Path, collector: Collector
) -> None:
    clip = write_pattern_clip(tmp_path / "in.mp4", frames=600, gop=FPS)
    config = line_config(tmp_path, clip, sample_models, source_extra=", realtime: true")
    await collector.start(nats_server.url, "vidpipe.lines.cam.detections")
    proc = vidpipe_run(config, "--nats", nats_server.url)
    try:
        deadline = time.monotonic() + 60
        while not collector.messages or collector.messages[-1]["frame"] < 4 * FPS:
            assert time.monotonic() < deadline and proc.poll() is None, "the run did not get going"
            await asyncio.sleep(0.02)
        proc.send_signal(signal.SIGKILL)
        await finish(proc)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == -signal.SIGKILL
    last = collector.messages[-1]["frame"]
    recording = tmp_path / "out" / "cam.mp4"
    with av.open(str(recording)) as f:
        pts = [fr.time for fr in f.decode(video=0)]
    assert pts[0] == 0.0 and None not in pts
    # Everything published until two seconds before the kill plays.
    assert last / FPS - 2.0 <= (pts[-1] or 0.0) <= last / FPS, (last, pts[-1])
    killed = recording.read_bytes()

    proc = vidpipe_run(config, "--nats", nats_server.url, "--max-frames", "10")
    out = await finish(proc)
    assert proc.returncode == 0, out
    assert recording.read_bytes() == killed
    assert ffprobe(tmp_path / "out" / "cam.1.mp4")["frames"] == 10


def encode_one_keyframe(path: Path, frames: int, size: tuple[int, int], noise: bool) -> Path:
    """H.264 with a keyframe at its start and none after (a huge GOP), at 10 fps."""
    rng = np.random.default_rng(7)
    with av.open(str(path), "w") as out:
        stream = out.add_stream("libx264", rate=10, options={"g": "100000", "keyint_min": "100000",
                                                             "sc_threshold": "0", "bf": "0", "crf": "10"})  # fmt: skip
        stream.width, stream.height, stream.pix_fmt = size[0], size[1], "yuv420p"
        for i in range(frames):
            if noise:
                image = rng.integers(0, 256, (size[1], size[0], 3), dtype=np.uint8)
            else:
                image = np.full((size[1], size[0], 3), (i * 3) % 256, dtype=np.uint8)
            frame = av.VideoFrame.from_ndarray(image, format="rgb24")
            frame.pts, frame.time_base = i, Fraction(1, 10)
            for packet in stream.encode(frame):
                out.mux(packet)
        for packet in stream.encode(None):
            out.mux(packet)
    return path


def feed(recorder: ClipRecorder, path: Path) -> tuple[int, float, int]:
    """Every packet of ``path`` through ``recorder`` as the decode loop hands them over.

    Returns the bytes fed, and the most seconds and bytes the ring held at any time.
    """
    fed, most_s, most_bytes = 0, 0.0, 0
    with av.open(str(path)) as f:
        stream = f.streams.video[0]
        keyframes = 0
        for packet in f.demux(stream):
            if packet.size:
                fed += packet.size
                keyframes += packet.is_keyframe
                recorder.on_packet(packet, stream)
                most_s, most_bytes = max(most_s, recorder.ring_seconds), max(most_bytes, recorder.ring_bytes)
        assert keyframes == 1
    return fed, most_s, most_bytes


def test_the_clip_ring_is_bounded_in_time_without_a_later_keyframe_and_released_at_the_end(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    video = encode_one_keyframe(tmp_path / "one-gop.mp4", frames=400, size=(64, 48), noise=False)
    config = ClipsOutputConfig(type="clips", dir="clips", pre_s=1.0, post_s=2.0)
    with ThreadPoolExecutor(1) as writer:
        recorder = ClipRecorder(config, "cam", tmp_path / "clips", writer, lambda info: None)
        fed, most_s, _ = feed(recorder, video)
        # 40 s of stream; the ring lets go once it spans pre_s + HEADROOM_S + MAX_GOP_S.
        assert most_s == pytest.approx(config.pre_s + HEADROOM_S + MAX_GOP_S, abs=0.1)
        # Nothing after the one keyframe can start a ring again: all of it was dropped, counted.
        assert recorder.ring_bytes == 0 and recorder.dropped_bytes == fed
        assert recorder.dropped_packets == 400
    assert "no keyframe in 26 s" in caplog.text and "keyframe interval (GOP)" in caplog.text


def test_the_clip_ring_is_bounded_in_bytes_at_any_bitrate_and_a_stop_releases_it(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    cap = 1_000_000
    monkeypatch.setattr(clips, "RING_MAX_BYTES", cap)
    # Noise at crf 10: about 100 kB a frame, 8 Mb/s at 10 fps.
    video = encode_one_keyframe(tmp_path / "noise.mp4", frames=60, size=(320, 240), noise=True)
    config = ClipsOutputConfig(type="clips", dir="clips", pre_s=3.0, post_s=2.0)
    with ThreadPoolExecutor(1) as writer:
        recorder = ClipRecorder(config, "cam", tmp_path / "clips", writer, lambda info: None)
        fed, _, most_bytes = feed(recorder, video)
        assert fed > 3 * cap
        assert cap * 0.9 < most_bytes <= cap
        assert recorder.dropped_bytes + recorder.ring_bytes == fed
    # A source that stops lets its ring go.
    with ThreadPoolExecutor(1) as writer:
        recorder = ClipRecorder(config, "cam", tmp_path / "clips", writer, lambda info: None)
        with av.open(str(video)) as f:
            stream = f.streams.video[0]
            for packet in itertools.islice(f.demux(stream), 10):
                recorder.on_packet(packet, stream)
        assert recorder.ring_bytes > 0
        recorder.close()
        assert recorder.ring_bytes == 0 and recorder.ring_seconds == 0.0


async def test_a_live_stream_that_ends_releases_its_clip_ring(
    tmp_path: Path, nats_server: EmbeddedNats, sample_models: Path
) -> None:
    if not gstreamer_available():
        pytest.skip("needs /usr/bin/python3 with PyGObject and gst-rtsp-server")
    with RtspTestServer({"/live": "live"}) as server:
        config = tmp_path / "p.yaml"
        config.write_text(
            f"pipeline: ring\nmodels: {sample_models}\n"
            f"sources: [{{url: '{server.url('/live')}', id: cam, stall_timeout: 1.0,"
            " reconnect: {min_delay: 30, max_delay: 30}}]\n"
            "stages: [{name: objects, type: infer, model: squares}]\n"
            "outputs: [{type: clips, dir: clips, pre_s: 1, post_s: 1, on: [track_start]}]\n"
        )
        runtime = Runtime(load_config(config), nats_url=nats_server.url)
        await runtime.start()
        try:
            (recorder,) = runtime.outputs._sources["cam"].clips
            await until(lambda: recorder.ring_seconds > 1.0, what="a second of packets in the ring")
            server.kill()
            # The stream ends; the source waits 30 s to reconnect, without its packets.
            await until(lambda: recorder.ring_bytes == 0, what="the ring to be released")
            assert runtime.sources["cam"].source.state.value == "backoff"
        finally:
            await runtime.stop()


async def test_clips_from_udp_mpegts_whose_timestamps_go_back_are_written_and_play(
    tmp_path: Path, sample_models: Path
) -> None:
    # An encoder pushing MPEG-TS over UDP that restarts (three pushes one after another)
    # starts its timestamps afresh each time: a clip across a restart has timestamps that
    # go back, which the MP4 muxer refuses ("returned 22") unless the parts are joined.
    clip = write_pattern_clip(tmp_path / "in.mp4", frames=30, gop=FPS)
    port = free_port()
    config = tmp_path / "udp.yaml"
    config.write_text(
        f"pipeline: udpclips\nmodels: {sample_models}\n"
        f"sources: [{{url: 'udp://0.0.0.0:{port}', id: enc}}]\n"
        "stages: [{name: objects, type: infer, model: squares}, {name: track, type: track}]\n"
        "outputs: [{type: clips, dir: clips/, pre_s: 1, post_s: 1, on: [detection]}]\n"
    )
    proc = vidpipe_run(config, "--max-frames", "50", "--no-progress")
    assert proc.stdout is not None
    lines: list[str] = []
    try:
        # Push once the source listens: its "connecting" line comes as it opens the socket.
        while not any("connecting" in line for line in lines):
            line = await asyncio.to_thread(proc.stdout.readline)
            assert line, "".join(lines)
            lines.append(line)
        push = ["ffmpeg", "-hide_banner", "-loglevel", "error", "-re", "-i", str(clip), "-c", "copy"]
        for _ in range(3):
            done = await asyncio.to_thread(
                subprocess.run, [*push, "-f", "mpegts", f"udp://127.0.0.1:{port}"], timeout=60
            )
            assert done.returncode == 0
        out = "".join(lines) + await finish(proc)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 0, out
    assert "not written" not in out, out
    joined = re.findall(r"clip (\S+): the stream's timestamps went back [12] time\(s\)", out)
    assert joined, out
    written = sorted((tmp_path / "clips").iterdir())
    assert {str(p) for p in written} >= set(joined), out
    # Every clip plays without an error; a joined one holds both sides of the restart.
    for path in written:
        assert ffprobe(path)["frames"] >= (2 if str(path) in joined else 1), path


def test_a_clip_the_muxer_refuses_is_logged_with_ffmpegs_reason(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    video = write_pattern_clip(tmp_path / "in.mp4", frames=30, gop=FPS)
    config = ClipsOutputConfig(type="clips", dir="clips", pre_s=1.0, post_s=0.5, on=["detection"])
    with ThreadPoolExecutor(1) as writer:
        recorder = ClipRecorder(config, "cam", tmp_path / "clips", writer, lambda info: None)
        with av.open(str(video)) as f:
            stream = f.streams.video[0]
            for i, packet in enumerate(f.demux(stream)):
                if i == 3:  # shown before it is decoded: no muxer takes that
                    assert packet.dts is not None
                    packet.pts = packet.dts - 1
                recorder.on_packet(packet, stream)
        image = np.zeros((H, W, 3), np.uint8)
        recorder.on_frame(Frame("cam", 0, 0.0, 0.0, image, objects=[obj(None)]))
    assert recorder.failed == 1 and list((tmp_path / "clips").iterdir()) == []
    (line,) = [r.getMessage() for r in caplog.records if "not written" in r.getMessage()]
    assert line.endswith("returned 22 (FFmpeg: pts (3071) < dts (3072) in stream 0)"), line


async def test_an_event_in_the_first_frame_of_an_rtsp_stream_has_its_clip(
    tmp_path: Path, sample_models: Path
) -> None:
    # RTSP's first keyframe comes without timestamps (the sender's clock is not known yet);
    # the ring must still start at it, or the event in frame 0 has no clip.
    if not gstreamer_available():
        pytest.skip("needs /usr/bin/python3 with PyGObject and gst-rtsp-server")
    video = write_pattern_clip(tmp_path / "in.mp4", frames=150, gop=150)
    camera = subprocess.Popen(
        [sys.executable, "-m", "pipeline.cli", "serve-rtsp", "--port", str(free_port()), str(video)],
        cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
    )  # fmt: skip
    assert camera.stdout is not None
    try:
        url = (await asyncio.to_thread(camera.stdout.readline)).strip()
        ready = await asyncio.to_thread(camera.stdout.readline)
        assert url.startswith("rtsp://") and ready.startswith("serving"), (url, ready)
        config = tmp_path / "rtsp.yaml"
        config.write_text(
            f"pipeline: rtspclips\nmodels: {sample_models}\n"
            f"sources: [{{url: '{url}', id: cam}}]\n"
            "stages: [{name: objects, type: infer, model: squares}, {name: track, type: track}]\n"
            "outputs: [{type: clips, dir: clips/, pre_s: 1, post_s: 1, on: [track_start]}]\n"
        )
        proc = vidpipe_run(config, "--max-frames", "60", "--no-progress")
        try:
            out = await finish(proc)
        finally:
            if proc.poll() is None:
                proc.kill()
    finally:
        camera.terminate()
        camera.wait(10)
    assert proc.returncode == 0, out
    (written,) = (tmp_path / "clips").iterdir()
    assert written.name.endswith("-0-track_start.mp4"), out
    # From the first keyframe (frame 0) to post_s after the event; the RTP clock's jitter
    # can put frame 15 a tick before the end.
    assert ffprobe(written)["frames"] in (FPS, FPS + 1)


def test_an_event_before_any_keyframe_says_why_it_has_no_clip(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    config = ClipsOutputConfig(type="clips", dir="clips", pre_s=1.0, post_s=1.0, on=["track_start"])
    with ThreadPoolExecutor(1) as writer:
        recorder = ClipRecorder(config, "cam", tmp_path / "clips", writer, lambda info: None)
        image = np.zeros((H, W, 3), np.uint8)
        recorder.on_frame(Frame("cam", 3, 0.2, 0.0, image, objects=[obj(7)]))
        recorder.on_frame(Frame("cam", 4, 0.3, 0.0, image, objects=[obj(8)]))  # once a minute
    assert [r.getMessage() for r in caplog.records] == [
        "source cam: no clip for track_start at frame 3: no keyframe with timestamps has come "
        "from the stream yet (clips start at a keyframe)"
    ]
    assert recorder.clips == 0 and not (tmp_path / "clips").exists()


def test_an_event_published_after_its_stream_ended_says_that_is_why_it_has_no_clip(
    tmp_path: Path, caplog: pytest.LogCaptureFixture, gop_videos: dict[str, Path]
) -> None:
    # A live camera's stream broke: its ring went, while frames decoded before the break were
    # still on their way to publishing. Keyframes had come: the reason is the stream's end.
    config = ClipsOutputConfig(type="clips", dir="clips", pre_s=1.0, post_s=1.0, on=["track_start"])
    with ThreadPoolExecutor(1) as writer:
        recorder = ClipRecorder(config, "cam", tmp_path / "clips", writer, lambda info: None)
        with av.open(str(gop_videos["no-b"])) as f:
            stream = f.streams.video[0]
            for packet in f.demux(stream):
                if packet.size:
                    recorder.on_packet(packet, stream)
        recorder.stream_ended()
        image = np.zeros((H, W, 3), np.uint8)
        recorder.on_frame(Frame("cam", 40, 40 / FPS, 0.0, image, objects=[obj(7)]))
    assert [r.getMessage() for r in caplog.records] == [
        "source cam: no clip for track_start at frame 40: the stream ended (a reconnect, the source's "
        "end) before the frame was published, and its clip ring went with it"
    ]
    assert recorder.clips == 0 and not (tmp_path / "clips").exists()


def test_a_clip_from_the_start_of_the_stream_says_start_0_and_matches_its_schema() -> None:
    # The first frame's time less the source's offset can come out a hair below 0.
    info = ClipInfo(
        source="cam", path=Path("/srv/clips/cam-20261130T101500-0-track_start.mp4"), event="track_start",
        event_pts=-1e-9, event_frame=0, label="square", track_id=1, start=-1e-9, end=1.0 - 1e-9,
        packets=15, bytes=1000,
    )  # fmt: skip
    message = clip_message("clips", info)
    text = json.dumps(message)
    assert '"start": 0.0' in text and "-0.0" not in text, text
    times = (message["start"], message["end"], message["duration"], message["event"]["pts"])
    assert times == (0.0, 1.0, 1.0, 0.0)
    jsonschema.validate(message, clips_schema())


# 60 frames, a keyframe every 30; the second GOP's frames in decode order, as libx264 orders them.
GOPS: dict[str, tuple[int, bool, list[int]]] = {
    "no-b": (0, False, list(range(30, 60))),
    "b2": (2, False, [30, 33, 31, 32, 36, 34, 35, 39, 37, 38, 42, 40, 41, 45, 43, 44, 48, 46, 47, 51, 49, 50,
                      54, 52, 53, 57, 55, 56, 59, 58]),
    "b3-pyramid": (3, True, [30, 34, 32, 31, 33, 38, 36, 35, 37, 42, 40, 39, 41, 46, 44, 43, 45, 50, 48, 47,
                             49, 54, 52, 51, 53, 58, 56, 55, 57, 59]),
}  # fmt: skip


@pytest.fixture(scope="module")
def gop_videos(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    folder = tmp_path_factory.mktemp("gops")
    videos = {}
    for name, (bframes, pyramid, order) in GOPS.items():
        video = write_pattern_clip(folder / f"{name}.mp4", 60, gop=30, bframes=bframes, pyramid=pyramid)
        with av.open(str(video)) as f:
            stream = f.streams.video[0]
            shown = [round(float(p.pts * p.time_base) * FPS) for p in f.demux(stream) if p.size]
        assert shown[30:] == order, (name, shown)
        videos[name] = video
    return videos


def cut_clip(folder: Path, video: Path, event: int, pre_s: float, post_s: float, behind: bool = False,
             no_dts: Collection[int] = ()) -> ClipInfo:  # fmt: skip
    """The clip a track starting in frame ``event`` of ``video`` makes, fed as the decode loop feeds it.

    Live, the event's frame is published as soon as its packet is decoded; ``behind``, the
    decoder is far ahead of the graph (a file). The packets of the frames in ``no_dts``
    come without a dts, as FFmpeg's RTSP demuxer gives a stream's first packets.
    """
    config = ClipsOutputConfig(type="clips", dir="clips", pre_s=pre_s, post_s=post_s, on=["track_start"])
    written: list[ClipInfo] = []
    frame = Frame("cam", event, event / FPS, 0.0, np.zeros((H, W, 3), np.uint8), objects=[obj(1)])
    with ThreadPoolExecutor(1) as writer:
        recorder = ClipRecorder(config, "cam", folder, writer, written.append)
        with av.open(str(video)) as f:
            stream = f.streams.video[0]
            for packet in f.demux(stream):
                if packet.size:
                    shown = packet.pts * packet.time_base * FPS
                    if shown in no_dts:
                        packet.dts = None
                    recorder.on_packet(packet, stream)
                    if not behind and shown == event:
                        recorder.on_frame(frame)
        if behind:
            recorder.on_frame(frame)
        recorder.close()
    (info,) = written
    return info


def test_an_event_inside_the_last_clips_window_is_part_of_it_when_the_file_is_decoded_ahead(
    tmp_path: Path, gop_videos: dict[str, Path]
) -> None:
    # A file decodes ahead of publishing: the clip of the event at frame 10 (to 1 s after it,
    # frame 25) is complete and written before the event at frame 20 is published. That one
    # is inside its window, so part of it (it opened a second clip of the same footage);
    # frame 40 is past it and has its own.
    config = ClipsOutputConfig(type="clips", dir="clips", pre_s=0.2, post_s=1.0, on=["track_start"])
    written: list[ClipInfo] = []
    image = np.zeros((H, W, 3), np.uint8)
    with ThreadPoolExecutor(1) as writer:
        recorder = ClipRecorder(config, "cam", tmp_path / "clips", writer, written.append)
        with av.open(str(gop_videos["no-b"])) as f:
            stream = f.streams.video[0]
            for packet in f.demux(stream):
                if packet.size:
                    recorder.on_packet(packet, stream)
        for index, track in ((10, 1), (20, 2), (40, 3)):
            recorder.on_frame(Frame("cam", index, index / FPS, 0.0, image, objects=[obj(track)]))
        recorder.close()
    assert [(info.event_frame, info.track_id) for info in written] == [(10, 1), (40, 3)]
    assert sorted(p.name for p in (tmp_path / "clips").iterdir()) == sorted(i.path.name for i in written)


@pytest.mark.parametrize("behind", [False, True], ids=["live", "decoded-ahead"])
def test_an_event_at_the_last_clips_end_is_not_in_it_and_has_a_clip_of_its_own(
    tmp_path: Path, gop_videos: dict[str, Path], behind: bool
) -> None:
    # post_s 1 s: the clip of the event at frame 34 (2.266667 s) holds the frames before
    # 34 + 15 = 49 (3.266667 s). The event at frame 48 is in it; the one at frame 49 is not, so
    # it opens its own clip (live, while the one before still waits for the packet after its
    # end), which ends with the stream.
    config = ClipsOutputConfig(type="clips", dir="clips", pre_s=0.2, post_s=1.0, on=["track_start"])
    video = gop_videos["no-b"]
    events = {34: 1, 48: 2, 49: 3}  # frame: track id
    image = np.zeros((H, W, 3), np.uint8)
    written: list[ClipInfo] = []
    with ThreadPoolExecutor(1) as writer:
        recorder = ClipRecorder(config, "cam", tmp_path / "clips", writer, written.append)

        def publish(index: int) -> None:
            recorder.on_frame(Frame("cam", index, index / FPS, 0.0, image, objects=[obj(events[index])]))

        with av.open(str(video)) as f:
            stream = f.streams.video[0]
            for packet in f.demux(stream):
                if packet.size:
                    recorder.on_packet(packet, stream)
                    shown = round(packet.pts * packet.time_base * FPS)
                    if not behind and shown in events:
                        publish(shown)
        if behind:
            for index in events:
                publish(index)
        recorder.close()
    assert [(info.event_frame, info.track_id) for info in written] == [(34, 1), (49, 3)]
    assert_clip_is(written[0], video, 30, 48)
    assert_clip_is(written[1], video, 30, 59)


def assert_clip_is(info: ClipInfo, video: Path, first: int, last: int) -> None:
    """The clip holds frames ``first`` to ``last`` of ``video`` (exactly those, decoded alike, each
    at its time from 0), plays cleanly, and its message says where it starts and ends."""
    message = clip_message("clips", info)
    with av.open(str(info.path)) as f:
        images = [(float(image.time), image.to_ndarray(format="rgb24")) for image in f.decode(video=0)]
    with av.open(str(video)) as f:
        source = [image.to_ndarray(format="rgb24") for image in f.decode(video=0)]
    shown = (len(images), images[0][0], images[-1][0])
    assert shown == (last - first + 1, 0.0, pytest.approx((last - first) / FPS)), (shown, first, last)
    for i, (seconds, image) in enumerate(images):
        assert seconds == pytest.approx(i / FPS), i
        assert np.array_equal(image, source[first + i]), first + i
    probe = ffprobe(info.path)  # nothing is missing to decode them
    assert probe["frames"] == last - first + 1
    assert probe["duration"] == pytest.approx((last - first + 1) / FPS, abs=1e-3)
    # The message (and the log line) end at the last frame in the file.
    assert message["start"] == pytest.approx(first / FPS, abs=1e-6)
    assert message["end"] == pytest.approx(last / FPS, abs=1e-6)
    assert message["duration"] == pytest.approx(images[-1][0], abs=1e-6)


@pytest.mark.parametrize("behind", [False, True], ids=["live", "decoded-ahead"])
@pytest.mark.parametrize(
    ("gop", "end", "last"),
    [
        # The event is frame 38, pre_s 0.5 s: the clip starts at the keyframe at frame 30;
        # post_s ends it before frame ``end``. Every frame before the end is in the clip, and
        # the frames past it that those need (the run of B-frames the end falls in, to its
        # reference frame); none else.
        ("no-b", 45, 44),
        ("b2", 43, 42),  # B43 and B44 come after P45: no frame before the end needs them
        ("b2", 44, 45),  # B43 needs P45 (and B44 goes with them)
        ("b2", 45, 45),  # B43 and B44 need P45, which is at the end
        ("b2", 58, 57),  # the stream ends with P59 and B58, past the end
        ("b2", 59, 59),  # the stream ends while B58 still needs P59
        ("b3-pyramid", 44, 46),  # B43 needs B44 and P46 (and B45 goes with them)
        ("b3-pyramid", 47, 46),  # P50's run of B-frames starts at B47
        ("b3-pyramid", 49, 50),  # B48 (and B47) need P50
    ],
)
def test_a_clip_with_b_frames_holds_every_frame_to_its_end_and_its_message_ends_at_its_last_frame(
    tmp_path: Path, gop_videos: dict[str, Path], gop: str, end: int, last: int, behind: bool
) -> None:
    # B-frames come after the frame they are predicted from in decode order: a clip that
    # stopped at the first packet shown at the end lost the B-frames before it, and took
    # its end from the last packet in decode order, not the last frame in the file.
    event, pre_s, first = 38, 0.5, 30
    info = cut_clip(tmp_path / "clips", gop_videos[gop], event, pre_s, (end - event) / FPS, behind)
    assert first <= math.floor((event / FPS - pre_s) * FPS) and last >= min(end - 1, 59)
    assert_clip_is(info, gop_videos[gop], first, last)


@pytest.mark.parametrize(("gop", "no_dts", "last"), [("b2", {30}, 45), ("b3-pyramid", {30, 34}, 46)])
def test_a_clip_with_b_frames_from_rtsp_that_gives_its_first_packets_no_dts_keeps_its_timing(
    tmp_path: Path, caplog: pytest.LogCaptureFixture, gop_videos: dict[str, Path], gop: str,
    no_dts: set[int], last: int,
) -> None:  # fmt: skip
    # As their dts, the keyframe's pts (and the next P-frame's) are later than the dts of
    # the B-frames after them: the timestamps seemed to go back, and the clip was "joined"
    # out of order, a frame late from there on.
    info = cut_clip(tmp_path / "clips", gop_videos[gop], 38, 0.5, 6 / FPS, no_dts=no_dts)
    assert_clip_is(info, gop_videos[gop], 30, last)
    assert "went back" not in caplog.text
