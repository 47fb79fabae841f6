"""Outputs: the annotated recording and event clips, from real pipelines with real codecs."""

from __future__ import annotations

from fractions import Fraction
from pathlib import Path

import av
import cv2
import numpy as np
import pytest

from pipeline.config import load_config
from pipeline.nats_server import EmbeddedNats
from pipeline.runtime import Runtime
from pipeline.sources.pattern import pattern_background, pattern_square_box

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
