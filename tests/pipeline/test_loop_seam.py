"""A looping file (``loop: true``): each pass is a new scene, as after a camera's reconnect.

At the seam the picture jumps back to the clip's first frame. Tracks open at the end of a
pass end there (their ``track_end`` at once, no crossing from the jump, fresh ids on the
next pass), and an event clip keeps to the frames of its own pass.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from fractions import Fraction
from pathlib import Path
from typing import ClassVar

import av
import numpy as np
import pytest

from pipeline.config import SourceConfig, load_config
from pipeline.frames import Frame
from pipeline.nats_server import EmbeddedNats
from pipeline.queues import EndOfStream, FrameQueue, StreamBreak
from pipeline.runtime import Runtime
from pipeline.sources.pattern import pattern_background, pattern_square_box
from pipeline.sources.registry import create_source
from pipeline.stages.base import Stage
from samples.make_clip import write_clip
from tests.conftest import Collector
from tests.pipeline.stack import stage_kinds, until

W, H, FPS = 320, 240, 15
Box = tuple[int, int, int, int]


def write_square_clip(path: Path, frames: int, box_at: Callable[[int], Box], gop: int = FPS) -> Path:
    """H.264 of a white square on the test pattern's background, at ``box_at(i)`` in frame i."""
    base = pattern_background(W, H)
    with av.open(str(path), "w") as out:
        stream = out.add_stream("libx264", rate=FPS, options={"crf": "18", "g": str(gop), "bf": "0"})
        stream.width, stream.height, stream.pix_fmt = W, H, "yuv420p"
        for i in range(frames):
            image = base.copy()
            x1, y1, x2, y2 = box_at(i)
            image[y1:y2, x1:x2] = 255
            frame = av.VideoFrame.from_ndarray(image, format="rgb24")
            frame.pts = i
            frame.time_base = Fraction(1, FPS)
            for packet in stream.encode(frame):
                out.mux(packet)
        for packet in stream.encode(None):
            out.mux(packet)
    return path


# --- the source: a break in its queue between passes ------------------------------------------


async def test_a_looping_file_leaves_a_break_between_passes_and_none_before_its_end(tmp_path: Path) -> None:
    clip = write_clip(tmp_path / "clip.mp4", frames=5, fps=10, width=64, height=48)
    items: dict[bool, list[int | str]] = {}
    for loop in (True, False):
        source = create_source(SourceConfig(url=str(clip), id="clip", loop=loop))
        queue: FrameQueue[Frame] = FrameQueue(32, "block", asyncio.get_running_loop(), breaks=True)
        source.start(queue)
        got: list[int | str] = []
        while sum(isinstance(i, int) for i in got) < 12:
            item = await asyncio.wait_for(queue.get(), 30)
            if isinstance(item, EndOfStream):
                got.append("END")
                break
            if isinstance(item, StreamBreak):
                got.append(repr(item))
                continue
            got.append(item.index)
            item.release()
        source.stop()
        source.join(30)
        items[loop] = got
    # The frames after a break come from the clip's start again, and are numbered on.
    assert items[True] == [
        0, 1, 2, 3, 4, "StreamBreak(next_index=5)", 5, 6, 7, 8, 9, "StreamBreak(next_index=10)", 10, 11,
    ]  # fmt: skip
    assert items[False] == [0, 1, 2, 3, 4, "END"]


# --- tracks and lines across the seam ---------------------------------------------------------

PASS = 16  # frames per pass
PASSES = 3
# The square moves right and crosses the line (its bottom-centre anchor is clearly right of
# it, past the 3 px hysteresis, from frame 8 of each pass on). Slow: the jump back at the
# seam is smaller than the square, so a tracker would take it for the same object moving
# back across the line. Fast: the jump leaves the square's last box far behind, so its
# track would only time out, track_end_after frames into the next pass.
MOTIONS: dict[str, Callable[[int], Box]] = {
    "slow": lambda i: (60 + 3 * i, 70, 160 + 3 * i, 170),  # anchor x 110 + 3i
    "fast": lambda i: (52 + 8 * i, 100, 92 + 8 * i, 140),  # anchor x 72 + 8i
}
LINE_X = 129.5  # clearly right beyond 132.5: slow 131 / 134 at frames 7 / 8, fast 128 / 136
CROSSES_AT = 8

TRACKS = """\
pipeline: loop
models: {models}
sources: [{{url: {clip}, id: cam, loop: true}}]
stages:
  - {{name: objects, type: infer, model: squares}}
  - {{name: track, type: track}}
  - name: gate
    type: zones
    lines: [{{name: door, points: [[{line}, {h}], [{line}, 0]]}}]
"""


@pytest.mark.parametrize("motion", ["slow", "fast"])
async def test_every_pass_of_a_looping_file_is_a_new_scene_with_its_own_tracks_and_crossings(
    tmp_path: Path, sample_models: Path, nats_server: EmbeddedNats, collector: Collector, motion: str
) -> None:
    box_at = MOTIONS[motion]
    clip = write_square_clip(tmp_path / "in.mp4", PASS, box_at)
    path = tmp_path / "p.yaml"
    path.write_text(TRACKS.format(models=sample_models, clip=clip, line=LINE_X, h=H))
    await collector.start(nats_server.url, "vidpipe.loop.cam.events")
    runtime = Runtime(load_config(path), nats_url=nats_server.url, max_frames=PASS * PASSES)
    await runtime.start()
    await runtime.wait(60)
    await runtime.stop()
    last = PASS * PASSES - 1  # the source's end ends the last track: its event comes last
    await until(lambda: any(e["type"] == "track_end" and e["frame"] == last for e in collector.messages))

    events = [(e["type"], e["track_id"], e["frame"], e.get("direction")) for e in collector.messages]
    # Each pass: its own track from its first frame, one crossing, and the track's end at
    # the pass's last frame, published before anything of the next pass.
    assert events == [
        event
        for k in range(PASSES)
        for event in (
            ("track_start", k + 1, k * PASS, None),
            ("line_cross", k + 1, k * PASS + CROSSES_AT, "in"),
            ("track_end", k + 1, k * PASS + PASS - 1, None),
        )
    ]
    for e in collector.messages:
        assert e["pts"] == pytest.approx(e["frame"] / FPS, abs=1e-6)  # the timeline goes on
        truth = box_at(e["frame"] % PASS)
        assert all(abs(a - t) <= 2 for a, t in zip(e["bbox"], truth, strict=True)), (e, truth)
    sample = runtime.metrics.registry.get_sample_value
    labels = {"pipeline": "loop", "source": "cam"}
    crossing = {**labels, "line": "door", "label": "square"}
    assert sample("vidpipe_line_crossings_total", {**crossing, "direction": "in"}) == PASSES
    assert sample("vidpipe_line_crossings_total", {**crossing, "direction": "out"}) is None
    assert sample("vidpipe_events_total", {**labels, "type": "track_end"}) == PASSES
    assert sample("vidpipe_active_tracks", labels) == 0


# --- clips across the seam --------------------------------------------------------------------


class HoldUntilNextPass(Stage):
    """Holds frame ``HELD`` until the source has queued the next pass's first frame (a seam, not
    a model): the clip recorder has had that pass's packets by the time the event is published."""

    kind = "hold_until_next_pass"
    runtime: Runtime | None = None

    async def process(self, frame: Frame) -> None:
        if frame.index == CLIP_EVENT and self.runtime is not None:
            source = self.runtime.sources[frame.source].source
            await until(lambda: source.stats.frames > CLIP_PASS, 30, "the next pass decoded")


CLIP_PASS = 30  # frames per pass: 2 s, keyframes at 0 and 1 s
CLIP_EVENT = 21  # the pattern square crosses x 160 (its anchor) "out" in frame 21
CLIPS = """\
pipeline: loopclips
models: {models}
sources: [{{url: {clip}, id: cam, loop: true, queue_size: 16}}]
stages:
  - {{name: hold, type: hold_until_next_pass}}
  - {{name: objects, type: infer, model: squares}}
  - {{name: track, type: track}}
  - {{name: gate, type: zones, lines: [{{name: door, points: [[160, 0], [160, {h}]]}}]}}
outputs:
  - {{type: clips, dir: clips, pre_s: 0.3, post_s: 2.0, on: [line_cross]}}
"""


async def test_an_event_clip_near_the_end_of_a_pass_ends_at_the_seam(
    tmp_path: Path, sample_models: Path, nats_server: EmbeddedNats, collector: Collector
) -> None:
    clip = write_square_clip(tmp_path / "in.mp4", CLIP_PASS, lambda i: pattern_square_box(i, W, H))
    path = tmp_path / "p.yaml"
    path.write_text(CLIPS.format(models=sample_models, clip=clip, h=H))
    await collector.start(nats_server.url, "vidpipe.loopclips.cam.clips")
    with stage_kinds(HoldUntilNextPass):
        # One and a half passes: the crossing of the second pass (frame 51) is not reached.
        runtime = Runtime(load_config(path), nats_url=nats_server.url, max_frames=CLIP_PASS * 3 // 2)
        HoldUntilNextPass.runtime = runtime
        try:
            await runtime.start()
            await runtime.wait(60)
            await runtime.stop()
        finally:
            HoldUntilNextPass.runtime = None
    await collector.wait_for(1, timeout=10)

    (message,) = collector.messages
    assert (message["event"]["type"], message["event"]["frame"]) == ("line_cross", CLIP_EVENT)
    assert message["event"]["pts"] == pytest.approx(CLIP_EVENT / FPS, abs=1e-6)
    # From the keyframe at 1 s (at or before the event less pre_s) to the pass's last
    # frame: the 2 s of post_s would reach into the next pass, which starts at 2 s.
    assert message["start"] == pytest.approx(15 / FPS, abs=1e-6)
    assert message["end"] == pytest.approx((CLIP_PASS - 1) / FPS, abs=1e-6)
    with av.open(message["path"]) as f:
        images = [frame.to_ndarray(format="rgb24") for frame in f.decode(video=0)]
    assert len(images) == CLIP_PASS - 15
    for i, image in zip(range(15, CLIP_PASS), images, strict=True):
        ys, xs = np.nonzero(image.min(axis=2) > 200)
        x1, y1, x2, y2 = pattern_square_box(i, W, H)
        assert (xs.min(), ys.min(), xs.max() + 1, ys.max() + 1) == pytest.approx((x1, y1, x2, y2), abs=2), i


class KeptRings(Stage):
    """At frame ``AT`` (its fifth pass), once the frames before it are published, notes how
    many ended passes' rings the source's clip recorder still holds."""

    kind = "kept_rings"
    runtime: Runtime | None = None
    seen: ClassVar[list[int]] = []

    async def process(self, frame: Frame) -> None:
        if frame.index == KEPT_AT and self.runtime is not None:
            run = self.runtime.sources[frame.source]
            await until(lambda: run.counters.published >= KEPT_AT - 5, 30, "the frames before published")
            (recorder,) = self.runtime.outputs._sources[frame.source].clips
            self.seen.append(len(recorder._ended))


KEPT_AT = CLIP_PASS * 4 + 10
NO_EVENTS = """pipeline: loopquiet
models: {models}
sources: [{{url: {clip}, id: cam, loop: true}}]
stages:
  - {{name: probe, type: kept_rings}}
  - {{name: objects, type: infer, model: squares}}
  - {{name: track, type: track}}
  - {{name: gate, type: zones, lines: [{{name: far, points: [[0, 1], [4, 1]]}}]}}
outputs:
  - {{type: clips, dir: clips, pre_s: 0.3, post_s: 1.0, on: [line_cross]}}
"""


async def test_a_looping_file_without_events_keeps_no_ring_per_pass(
    tmp_path: Path, sample_models: Path, nats_server: EmbeddedNats
) -> None:
    # The square never crosses the line: no event, and so no clip, in any pass.
    clip = write_square_clip(tmp_path / "in.mp4", CLIP_PASS, lambda i: pattern_square_box(i, W, H))
    path = tmp_path / "p.yaml"
    path.write_text(NO_EVENTS.format(models=sample_models, clip=clip))
    KeptRings.seen = []
    with stage_kinds(KeptRings):
        runtime = Runtime(load_config(path), nats_url=nats_server.url, max_frames=KEPT_AT + 5)
        KeptRings.runtime = runtime
        try:
            await runtime.start()
            await runtime.wait(60)
            await runtime.stop()
        finally:
            KeptRings.runtime = None
    # Four passes have ended; the published frames of the fifth let go of all of them.
    assert KeptRings.seen == [0]
